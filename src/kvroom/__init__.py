"""kvroom: decoder-only LLM artifacts whose paged KV cache is fitted to the memory at hand.

Public API (imported lazily, so ``import kvroom`` stays light)::

    DecoderOnlyConfig, MemoryPlan, plan_model, compile, get_kvcache_num_blocks,
    set_kvcache_num_blocks, read_info, LLM, SamplingParams, StructuredOutputsParams,
    KvroomModelForCausalLM
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from kvroom.heap import bound_kernel_caches
from kvroom.threads import choose_wait_policy

if "torch" not in sys.modules:  # read once, when torch loads its OpenMP runtime
    choose_wait_policy()

__version__ = "0.1.0"

bound_kernel_caches()  # before torch loads oneDNN (see kvroom/heap.py)

_EXPORTS = {
    "DecoderOnlyConfig": "kvroom.config",
    "MemoryPlan": "kvroom.plan",
    "plan_model": "kvroom.compile",
    "compile": "kvroom.compile",
    "get_kvcache_num_blocks": "kvroom.artifact.resize",
    "set_kvcache_num_blocks": "kvroom.artifact.resize",
    "read_info": "kvroom.artifact.layout",
    "LLM": "kvroom.llm",
    "SamplingParams": "kvroom.engine.params.sampling",
    "StructuredOutputsParams": "kvroom.engine.params.structured",
    "KvroomModelForCausalLM": "kvroom.modeling",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvroom' has no attribute {name!r}")
