"""KVCachePool: bytes equal the planner's formula exactly, layer views, bad sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvroom.engine.kv_cache import KVCachePool
from kvroom.errors import ConfigError
from kvroom.model_spec import ModelSpec


def _spec(layer_types: tuple[str, ...], window: int | None = 8) -> ModelSpec:
    return ModelSpec(
        architecture="Gemma3ForCausalLM",
        model_type="gemma3_text",
        num_layers=len(layer_types),
        hidden_size=16,
        intermediate_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        vocab_size=64,
        layer_types=layer_types,
        sliding_window=window,
        tie_embeddings=True,
        max_position_embeddings=64,
    )


HYBRID = ("sliding_attention", "full_attention", "sliding_attention")


def _pool(spec: ModelSpec, max_seq_len: int = 32, dtype: torch.dtype = torch.float32, **kw):
    args = dict(num_blocks=5, block_size=4, num_sliding_slots=3) | kw
    return KVCachePool(spec, max_seq_len=max_seq_len, dtype=dtype, device="cpu", **args)


def test_hybrid_nbytes_is_the_formula() -> None:
    # full:    1 layer  x 2 (K,V) x 5 blocks x 4 tokens x 2 kv heads x 4 dims x 4 bytes = 1280
    # sliding: 2 layers x 2 (K,V) x 3 slots  x 8 window x 2 kv heads x 4 dims x 4 bytes = 3072
    assert _pool(_spec(HYBRID)).nbytes() == 1280 + 3072


def test_bf16_halves_the_bytes() -> None:
    assert _pool(_spec(HYBRID), dtype=torch.bfloat16).nbytes() == (1280 + 3072) // 2


def test_window_covering_max_seq_len_is_stored_as_full() -> None:
    pool = _pool(_spec(HYBRID), max_seq_len=8)
    assert pool.layer_kinds == ("full", "full", "full")
    assert pool.sliding_window is None
    assert pool.nbytes() == 3 * 1280


def test_layer_views_have_the_documented_shapes_and_share_the_pool() -> None:
    pool = _pool(_spec(HYBRID))
    assert [tuple(t.shape) for t in pool.layers] == [
        (3, 8, 2, 2, 4),
        (5, 4, 2, 2, 4),
        (3, 8, 2, 2, 4),
    ]
    pool.layers[1][4, 3, 1].fill_(7.0)
    assert pool.nbytes() == sum(t.nbytes for t in pool._tensors)
    assert pool.full_tensors[0][0, 4, 3, 1].eq(7.0).all()
    assert pool.num_tokens == 20


def test_pool_starts_zeroed() -> None:
    pool = _pool(_spec(HYBRID))
    assert all(not t.any() for t in pool.layers)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_cpu_pool_becomes_resident_in_the_background_without_losing_writes() -> None:
    """A 256 MiB pool costs no resident memory at creation; it is faulted in off the caller's
    thread once started (the runner starts it after its first step); K/V written meanwhile
    survive."""
    before = _rss_bytes()
    pool = _pool(_spec(HYBRID), num_blocks=256 * 2**20 // 256, dtype=torch.float32)
    assert pool.nbytes() >= 256 * 2**20
    assert _rss_bytes() - before < 32 * 2**20
    pool.layers[1][-1].fill_(3.0)  # the last block, most likely not populated yet
    pool.layers[0][0].fill_(2.0)
    pool.touch()
    assert _rss_bytes() - before >= 240 * 2**20
    assert pool.layers[1][-1].eq(3.0).all() and pool.layers[0][0].eq(2.0).all()
    assert int(pool.full_tensors[0].count_nonzero()) == pool.layers[1][-1].numel()


def test_touch_without_the_kernel_populate_keeps_contents(monkeypatch) -> None:
    """Where MADV_POPULATE_WRITE is refused, ``touch`` writes one unchanged byte per page."""
    monkeypatch.setattr("kvroom.engine.kv_cache.MADV_POPULATE_WRITE", -1)  # EINVAL
    pool = _pool(_spec(HYBRID), num_blocks=4096)
    pool.layers[1][7].fill_(-1.5)
    pool.touch()
    assert pool._populating is not None and not pool._populating.populated
    assert pool.layers[1][7].eq(-1.5).all()
    assert int(pool.full_tensors[0].count_nonzero()) == pool.layers[1][7].numel()


def test_bad_sizes_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^KVCachePool.num_blocks: must be > 0, got 0$"):
        _pool(_spec(HYBRID), num_blocks=0)
    with pytest.raises(ConfigError, match="num_sliding_slots: must be > 0 for sliding layers"):
        _pool(_spec(HYBRID), num_sliding_slots=0)
