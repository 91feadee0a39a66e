"""Shared factories: tiny ``ModelSpec``s and ``DecoderOnlyConfig``s. Torch-free, no model files.

Both are fixtures that return a factory, so a test asks for ``make_spec`` / ``make_config`` and
calls it with the few values it cares about.

Where the session runs ``plan_truth`` tests, the libraries' page cache is dropped before the
first test (``pytest_collection_finish``), as ``benchmarks/plan_truth.py`` does by default.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from kvroom.config import DecoderOnlyConfig
from kvroom.model_spec import ModelSpec


def pytest_collection_finish(session: pytest.Session) -> None:
    """Drop the page cache of the deployment's libraries (``kvroom.pagecache``) when a
    ``plan_truth`` test is to run. A fresh install leaves them cached in large folios, and then
    a process maps more of their pages the more code it runs: the plan, which counts the code
    of every path a deployment can take, came out 3.1-3.6% over a tiny greedy run's peak where
    the same run after the drop was within 0.9-1.8% (file pages are a third to half of a tiny
    model's process). Before the first test, so the tests that run in this process before the
    plan-truth cases read the libraries back the way the measured processes do."""
    if any(item.get_closest_marker("plan_truth") for item in session.items):
        cmd = [sys.executable, "-m", "kvroom.pagecache", "drop"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)


def build_spec(
    *,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    intermediate: int = 64,
    vocab: int = 128,
    architecture: str = "LlamaForCausalLM",
    **hf_overrides: Any,
) -> ModelSpec:
    """A ``ModelSpec`` read from a tiny HF config dict (hidden = heads x head_dim).

    ``hf_overrides`` are HF ``config.json`` keys (``layer_types``, ``sliding_window``, ...).
    """
    hf_config: dict[str, Any] = {
        "architectures": [architecture],
        "num_hidden_layers": layers,
        "hidden_size": heads * head_dim,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }
    hf_config.update(hf_overrides)
    return ModelSpec.from_hf_config(hf_config)


TINY_CONFIG: dict[str, Any] = {
    "max_seq_len": 32,
    "batch_size": 2,
    "kvcache_block_size": 4,
    "max_num_batched_tokens": 16,
    "dtype": "float32",
    "device": "cpu",
}
"""Defaults of ``make_config``: 32 tokens in blocks of 4 -> 8 blocks per sequence, 16 for 2."""


def build_config(**overrides: Any) -> DecoderOnlyConfig:
    """A ``DecoderOnlyConfig`` with ``TINY_CONFIG`` values, any field overridden."""
    return DecoderOnlyConfig(**{**TINY_CONFIG, **overrides})


@pytest.fixture
def make_spec() -> Callable[..., ModelSpec]:
    return build_spec


@pytest.fixture
def make_config() -> Callable[..., DecoderOnlyConfig]:
    return build_config
