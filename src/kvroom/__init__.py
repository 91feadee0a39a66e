"""kvroom: decoder-only LLM artifacts whose paged KV cache is fitted to the memory at hand.

Public API (imported lazily, so ``import kvroom`` stays light)::

    DecoderOnlyConfig, MemoryPlan, plan_model, compile, get_kvcache_num_blocks,
    set_kvcache_num_blocks, read_info, LLM, SamplingParams, KvroomModelForCausalLM
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DecoderOnlyConfig": "kvroom.config",
    "MemoryPlan": "kvroom.plan",
    "plan_model": "kvroom.compile",
    "compile": "kvroom.compile",
    "get_kvcache_num_blocks": "kvroom.artifact.resize",
    "set_kvcache_num_blocks": "kvroom.artifact.resize",
    "read_info": "kvroom.artifact.layout",
    "LLM": "kvroom.llm",
    "SamplingParams": "kvroom.engine.sampling",
    "KvroomModelForCausalLM": "kvroom.modeling",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvroom' has no attribute {name!r}")
