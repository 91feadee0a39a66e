"""KVCachePool: bytes equal the planner's formula exactly, layer views, bad sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvroom.engine.kv.pool import KVCachePool
from kvroom.errors import ConfigError
from kvroom.model_spec import ModelSpec
from kvroom.models.kv_quant import KVCodec
from kvroom.plan.kv import kv_bytes_per_block, kv_scale_bytes_per_block, sliding_window_bytes


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


@pytest.mark.parametrize(("kv_dtype", "row_bytes"), [("int8", 4 + 4), ("int4", 2 + 4)])
def test_a_quantized_pool_allocates_what_the_plan_counts(kv_dtype: str, row_bytes: int) -> None:
    """Rows of 4 dims: int8 4 values + a 4-byte scale, int4 2 bytes + the scale."""
    spec = _spec(HYBRID)
    pool = _pool(spec, kv_codec=KVCodec(8 if kv_dtype == "int8" else 4, False))
    assert pool.layers[1].dtype == torch.uint8 and pool.layers[1].shape[-1] == row_bytes
    shape = dict(max_seq_len=32, kv_dtype=kv_dtype, tensor_parallel_size=1)
    per_block = kv_bytes_per_block(spec, block_size=4, **shape)
    assert per_block == pool.bytes_per_block == 1 * 4 * 2 * 2 * row_bytes
    assert kv_scale_bytes_per_block(spec, block_size=4, **shape) == 1 * 4 * 2 * 2 * 4
    rings = sliding_window_bytes(spec, batch_size=3, **shape)
    assert pool.nbytes() == 5 * per_block + rings == 5 * per_block + 2 * 3 * 8 * 2 * 2 * row_bytes


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
    assert pool.nbytes() == sum(t.nbytes for t in pool.layers)
    assert pool._stores[0]._reserved[0, 4, 3, 1].eq(7.0).all()
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
    assert int(pool.layers[1].count_nonzero()) == pool.layers[1][-1].numel()


def test_touch_without_the_kernel_populate_keeps_contents(monkeypatch) -> None:
    """Where MADV_POPULATE_WRITE is refused, ``touch`` writes one unchanged byte per page."""
    monkeypatch.setattr("kvroom.engine.kv.pages.MADV_POPULATE_WRITE", -1)  # EINVAL
    pool = _pool(_spec(HYBRID), num_blocks=4096)
    pool.layers[1][7].fill_(-1.5)
    pool.touch()
    assert pool._populating is not None and not pool._populating.populated
    assert pool.layers[1][7].eq(-1.5).all()
    assert int(pool.layers[1].count_nonzero()) == pool.layers[1][7].numel()


def test_bad_sizes_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^KVCachePool.num_blocks: must be > 0, got 0$"):
        _pool(_spec(HYBRID), num_blocks=0)
    with pytest.raises(ConfigError, match="num_sliding_slots: must be > 0 for sliding layers"):
        _pool(_spec(HYBRID), num_sliding_slots=0)


# -- live resize -------------------------------------------------------------------------

BACKENDS = [
    pytest.param("cpu", "mapped", id="cpu-mapped"),
    pytest.param("cpu", "copy", id="cpu-copy"),
    pytest.param(
        "cuda",
        "copy",
        id="cuda-copy",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


def _resizable(device: str, backend: str, **kw):
    args = dict(num_blocks=16, max_num_blocks=64, backend=backend, device=device) | kw
    return KVCachePool(
        _spec(HYBRID),
        max_seq_len=32,
        dtype=torch.float32,
        block_size=4,
        num_sliding_slots=3,
        **args,
    )


@pytest.mark.parametrize(("device", "backend"), BACKENDS)
def test_resize_keeps_the_layer_objects_and_the_kept_contents(device: str, backend: str) -> None:
    pool = _resizable(device, backend)
    layers = list(pool.layers)
    pool.layers[1][15].fill_(5.0)
    pool.layers[0][2].fill_(1.0)  # a sliding ring: never resized
    pool.resize(64)
    assert [t is u for t, u in zip(pool.layers, layers, strict=True)] == [True] * 3
    assert pool.layers[1].shape[0] == 64 and pool.num_tokens == 256
    assert pool.layers[1][15].eq(5.0).all() and not pool.layers[1][16:].any()
    pool.layers[1][63].fill_(9.0)
    pool.resize(8)
    assert pool.layers[1].shape[0] == 8 and pool.layers[0].eq(1.0).sum() > 0
    pool.resize(64)
    # released pages read as zeros; blocks 8..15 share page 0 with the kept ones (256 B each)
    assert not pool.layers[1][16:].any(), "blocks a grow adds read as zeros"
    # 1 full layer x 2 x 64 blocks x 4 tokens x 2 heads x 4 dims x 4 bytes + the rings
    assert pool.nbytes() == 64 * 256 + 3072


@pytest.mark.parametrize(("device", "backend"), BACKENDS)
@pytest.mark.parametrize(("seed", "codec"), [(0, None), (1, None), (2, KVCodec(8, True))])
def test_every_live_sequence_keeps_its_kv_bytes_through_a_migration(
    device: str, backend: str, seed: int, codec: KVCodec | None
) -> None:
    """Random sequences on a 64-block pool, random frees, a shrink to 20: the block manager
    plans the moves, the pool copies them; each survivor's K/V, read through its new table,
    is byte-identical to what it wrote."""
    from kvroom.engine.kv.block_manager import BlockManager

    gen = torch.Generator().manual_seed(seed)
    pool = _resizable(device, backend, num_blocks=64, kv_codec=codec)
    bm = BlockManager(64, 4)
    written: dict[int, torch.Tensor] = {}
    for seq_id in range(12):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        table = bm.allocate(seq_id, 4 * n)
        assert table is not None
        kv = torch.randn(n, *pool.layers[1].shape[1:], generator=gen)
        if codec is not None:  # int8 rows: values and scale, every byte
            kv = torch.randint(0, 256, kv.shape, generator=gen, dtype=torch.uint8)
        kv = kv.to(device)
        pool.layers[1][list(table)] = kv
        written[seq_id] = kv
    for seq_id in torch.randperm(12, generator=gen)[:7].tolist():
        bm.free(seq_id)
        del written[seq_id]
    target = max(bm.num_used_blocks, 1) + 2
    migration = bm.shrink(target)
    assert any(src >= target for src, _ in migration.moves) or bm.num_used_blocks == 0
    pool.copy_blocks(migration.moves)
    pool.resize(target)
    bm.check_invariants()
    for seq_id, kv in written.items():
        got = pool.layers[1][list(bm.block_table(seq_id))]
        assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8)), f"seq {seq_id}"


def test_a_shrink_returns_the_pages_to_the_kernel() -> None:
    """Grow to 64 MiB, make it resident, shrink to 1/16: resident memory drops at once."""
    pool = _pool(_spec(HYBRID), num_blocks=1024, max_num_blocks=64 * 2**20 // 256)
    pool.resize(pool.max_num_blocks)
    pool.touch()
    before = _rss_bytes()
    freed = pool.nbytes()
    pool.resize(pool.max_num_blocks // 16)
    freed -= pool.nbytes()
    assert before - _rss_bytes() >= 0.9 * freed
    pool.touch()
    assert pool.populated and before - _rss_bytes() >= 0.9 * freed, "nothing faulted back in"


def test_resize_outside_the_reserve_is_refused() -> None:
    pool = _resizable("cpu", "mapped")
    with pytest.raises(ConfigError, match=r"^kvcache_num_blocks: 65 is outside \[1, 64\]"):
        pool.resize(65)
    with pytest.raises(ConfigError, match="max_num_blocks: must be >= num_blocks \\(16\\)"):
        _resizable("cpu", "mapped", max_num_blocks=8)
