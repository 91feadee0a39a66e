"""Memory math by hand: KV bytes, weights, runtime buffers, the fit and the plan's output."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from kvroom.config import DecoderOnlyConfig
from kvroom.device import TARGET_PROFILES, DeviceMemory
from kvroom.plan import MemoryPlan, compute_plan
from kvroom.plan.buffers import runtime_buffer_bytes
from kvroom.plan.kv import (
    kv_bytes_per_block,
    kv_bytes_per_token_per_layer,
    kv_heads_per_rank,
    sliding_window_bytes,
)
from kvroom.plan.measured import MeasuredTerms
from kvroom.plan.report import plan_table, terms_table
from kvroom.plan.weights import weight_bytes

SMOLLM2_135M_PARAMS = (
    49152 * 576  # embedding (tied: the LM head is counted once)
    + 30
    * (
        576 * 576 * 2  # q_proj, o_proj
        + 576 * 192 * 2  # k_proj, v_proj (3 kv heads x 64)
        + 576 * 1536 * 3  # gate, up, down
        + 576 * 2  # two RMSNorms
    )
    + 576  # final norm
)
SLIDING = "sliding_attention"
FULL = "full_attention"


@pytest.fixture
def smollm2(make_spec):
    """HuggingFaceTB/SmolLM2-135M's shape: 30 layers, 9 heads, 3 kv heads, head_dim 64."""
    return make_spec(layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)


@pytest.fixture
def tiny_plan(make_spec, make_config) -> MemoryPlan:
    """2 layers x (2 kv heads x head_dim 8), fp32, blocks of 4, max_seq_len 32, batch 2.

    weights  = 10_000 params x 4 B                          = 40_000
    runtime  = 44_032 (see test_runtime_buffers_tiny)
    block    = 2 layers x 4 tokens x (2 x 2 x 8 x 4 B)      = 1_024
    usable   = int(192_590 x 0.5) - 1_000                    = 95_295
    budget   = 95_295 - 40_000 - 44_032 - 0 (no sliding)     = 11_263
    fit      = 11_263 // 1_024                               = 10  (10_240 <= 11_263 < 11_264)
    """
    cfg = make_config(kvcache_memory_fraction=0.5, kvcache_reserve_memory=1000)
    return compute_plan(
        make_spec(),
        cfg,
        num_parameters=10_000,
        memory=DeviceMemory(192_590, "explicit"),
    )


# -- KV bytes -------------------------------------------------------------------------------------
def test_smollm2_kv_bytes_per_token(smollm2) -> None:
    per_layer = 2 * 3 * 64 * 4  # K and V x 3 kv heads x head_dim 64 x fp32
    assert per_layer == 1_536
    assert kv_bytes_per_token_per_layer(smollm2, "float32") == per_layer
    assert 30 * kv_bytes_per_token_per_layer(smollm2, "float32") == 46_080  # 30 layers


@pytest.mark.parametrize(
    ("kv_dtype", "expected"),
    [
        ("float32", 30 * 2 * 16 * 3 * 64 * 4),  # = 737_280 = 46_080 per token x 16 tokens
        ("bfloat16", 30 * 2 * 16 * 3 * 64 * 2),  # = 368_640
        ("float8_e4m3fn", 30 * 2 * 16 * 3 * 64 * 1),  # = 184_320
    ],
)
def test_smollm2_kv_bytes_per_block(smollm2, kv_dtype: str, expected: int) -> None:
    got = kv_bytes_per_block(
        smollm2, max_seq_len=2048, block_size=16, kv_dtype=kv_dtype, tensor_parallel_size=1
    )
    assert got == expected


@pytest.mark.parametrize(
    ("kv_heads", "tp", "expected"), [(3, 1, 3), (3, 2, 2), (8, 2, 4), (2, 4, 1), (1, 8, 1)]
)
def test_kv_heads_per_rank_rounds_up(kv_heads: int, tp: int, expected: int) -> None:
    assert kv_heads_per_rank(kv_heads, tp) == expected


def test_tp2_with_three_kv_heads_counts_four(smollm2) -> None:
    heads = 2 * 2  # ceil(3 / 2) = 2 per rank, x 2 ranks (one head replicated)
    assert kv_bytes_per_token_per_layer(smollm2, "float32", 2) == 2 * heads * 64 * 4  # = 2_048
    got = kv_bytes_per_block(
        smollm2, max_seq_len=2048, block_size=16, kv_dtype="float32", tensor_parallel_size=2
    )
    assert got == 30 * 16 * 2 * heads * 64 * 4  # = 983_040


def test_hybrid_block_counts_only_the_full_layer(make_spec) -> None:
    spec = make_spec(layers=4, layer_types=[SLIDING, SLIDING, SLIDING, FULL], sliding_window=8)
    per_token_layer = 2 * 2 * 8 * 4  # K and V x 2 kv heads x head_dim 8 x fp32 = 128
    shape = dict(max_seq_len=32, kv_dtype="float32", tensor_parallel_size=1)
    assert kv_bytes_per_block(spec, block_size=4, **shape) == 1 * 4 * per_token_layer  # = 512
    # 3 sliding layers x batch 2 x window 8 tokens
    assert sliding_window_bytes(spec, batch_size=2, **shape) == 3 * 2 * 8 * per_token_layer


def test_hybrid_window_covering_max_seq_len_is_all_full(make_spec) -> None:
    spec = make_spec(layers=4, layer_types=[SLIDING, SLIDING, SLIDING, FULL], sliding_window=8)
    shape = dict(max_seq_len=8, kv_dtype="float32", tensor_parallel_size=1)
    assert kv_bytes_per_block(spec, block_size=4, **shape) == 4 * 4 * (2 * 2 * 8 * 4)  # = 2_048
    assert sliding_window_bytes(spec, batch_size=2, **shape) == 0


# -- weights --------------------------------------------------------------------------------------
def test_smollm2_param_count_is_the_known_one() -> None:
    assert SMOLLM2_135M_PARAMS == 134_515_008


@pytest.mark.parametrize(
    ("dtype", "tp", "expected"),
    [
        ("float32", 1, 134_515_008 * 4),  # = 538_060_032
        ("bfloat16", 1, 134_515_008 * 2),  # = 269_030_016
        ("bfloat16", 2, 134_515_008 * 2 // 2),  # = 134_515_008 per rank
        ("float8_e4m3fn", 1, 134_515_008),
    ],
)
def test_weight_bytes(dtype: str, tp: int, expected: int) -> None:
    assert weight_bytes(SMOLLM2_135M_PARAMS, dtype, tp) == expected


def test_weight_bytes_round_up_per_rank() -> None:
    assert weight_bytes(3, "float32", 5) == 3  # ceil(3 x 4 / 5) = ceil(2.4)


# -- runtime buffers ------------------------------------------------------------------------------
def test_runtime_buffers_tiny(make_spec) -> None:
    spec = make_spec()  # hidden 32, 4 heads, 2 kv heads, head_dim 8, intermediate 64, vocab 128
    tokens = 16  # T = max(max_num_batched_tokens 16, batch 2)
    per_token = 4 * 32 + 4 * 8 + 2 * (2 * 8) + 3 * 64  # 4 x hidden + q_dim + 2 kv_dim + 3 x inter
    activations = 4 * tokens * per_token  # fp32: 4 x 16 x 384 = 24_576
    kv_gather = 4 * 2 * 32 * 2 * (2 * 8)  # k x S x L x 2 x kv_dim = 8_192
    scores = 4 * 4 * min(tokens, 32) * 32  # 4 x heads x min(T, L) x L = 8_192
    logits = 4 * 2 * 128 * 3  # 4 x S x vocab x 3 = 3_072
    expected = activations + kv_gather + scores + logits
    assert expected == 44_032
    got = runtime_buffer_bytes(
        spec,
        batch_size=2,
        max_seq_len=32,
        max_num_batched_tokens=16,
        dtype="float32",
        kv_dtype="float32",
    )
    assert got == expected


def test_runtime_buffers_tp2_bf16(make_spec) -> None:
    spec = make_spec()
    # per rank: 2 heads (q_dim 16), 1 kv head (kv_dim 8), intermediate 32; a = k = 2 bytes
    activations = 2 * 16 * (4 * 32 + 16 + 2 * 8 + 3 * 32)  # 2 x 16 x 256 = 8_192
    kv_gather = 2 * 2 * 32 * 2 * 8  # = 2_048
    scores = 4 * 2 * 16 * 32  # = 4_096
    logits = 4 * 2 * 128 * 3  # = 3_072
    got = runtime_buffer_bytes(
        spec,
        batch_size=2,
        max_seq_len=32,
        max_num_batched_tokens=16,
        dtype="bfloat16",
        kv_dtype="bfloat16",
        tensor_parallel_size=2,
    )
    assert got == activations + kv_gather + scores + logits == 17_408


def test_runtime_scores_chunk_capped_at_max_seq_len(make_spec) -> None:
    spec = make_spec()
    tokens = 64  # max_num_batched_tokens 64 > max_seq_len 32
    activations = 4 * tokens * 384  # = 98_304
    kv_gather = 4 * 2 * 32 * 2 * 16  # = 8_192
    scores = 4 * 4 * 32 * 32  # min(T, L) = 32, not 64: = 16_384
    logits = 4 * 2 * 128 * 3  # = 3_072
    got = runtime_buffer_bytes(
        spec,
        batch_size=2,
        max_seq_len=32,
        max_num_batched_tokens=64,
        dtype="float32",
        kv_dtype="float32",
    )
    assert got == activations + kv_gather + scores + logits == 125_952


def test_runtime_buffers_smollm2_defaults(smollm2) -> None:
    cfg = DecoderOnlyConfig()  # batch 32, max_seq_len 2048, 512 batched tokens, fp32
    activations = 4 * 512 * (4 * 576 + 576 + 2 * 192 + 3 * 1536)  # = 16_121_856
    kv_gather = 4 * 32 * 2048 * 2 * 192  # = 100_663_296
    scores = 4 * 9 * 512 * 2048  # = 37_748_736
    logits = 4 * 32 * 49152 * 3  # = 18_874_368
    got = runtime_buffer_bytes(
        smollm2,
        batch_size=cfg.batch_size,
        max_seq_len=cfg.max_seq_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        dtype=cfg.dtype,
        kv_dtype="float32",
    )
    assert got == activations + kv_gather + scores + logits == 173_408_256


# -- the fit --------------------------------------------------------------------------------------
def test_tiny_plan_figures(tiny_plan: MemoryPlan) -> None:
    p = tiny_plan
    assert (p.weight_bytes, p.runtime_buffer_bytes, p.sliding_window_bytes) == (40_000, 44_032, 0)
    assert p.measured_runtime_bytes is None
    assert p.runtime_bytes == 44_032
    assert p.kv_bytes_per_block == 1_024
    assert p.usable_bytes == 96_295 - 1_000
    assert p.kv_budget_bytes == 95_295 - 40_000 - 44_032  # = 11_263
    assert (p.num_min_blocks, p.num_full_blocks) == (8, 16)  # 32 / 4; 8 x batch 2
    assert (p.num_fit_blocks, p.estimated_num_blocks, p.num_blocks) == (10, 10, 10)
    assert p.num_blocks_source == "estimate"
    assert p.num_tokens == 10 * 4
    assert p.kv_bytes == 10 * 1_024
    assert p.max_concurrency == 1  # min(batch 2, 10 // 8)
    assert p.total_bytes == 40_000 + 44_032 + 10_240


def test_estimate_fits_and_one_more_does_not(tiny_plan: MemoryPlan) -> None:
    p = tiny_plan
    assert p.estimated_num_blocks * p.kv_bytes_per_block <= p.kv_budget_bytes
    assert (p.estimated_num_blocks + 1) * p.kv_bytes_per_block > p.kv_budget_bytes


def test_one_byte_of_budget_more_fits_one_more_block(make_spec, make_config) -> None:
    cfg = make_config(kvcache_memory_fraction=0.5, kvcache_reserve_memory=1000)
    # +2 device bytes = +1 usable byte at fraction 0.5: budget 11_264 = 11 x 1_024
    plan = compute_plan(
        make_spec(), cfg, num_parameters=10_000, memory=DeviceMemory(192_592, "explicit")
    )
    assert plan.kv_budget_bytes == 11_264
    assert plan.num_fit_blocks == plan.estimated_num_blocks == 11


def test_estimate_capped_at_full_blocks(make_spec, make_config) -> None:
    cfg = make_config(kvcache_memory_fraction=0.5, kvcache_reserve_memory=1000)
    plan = compute_plan(make_spec(), cfg, num_parameters=10_000, memory=DeviceMemory(2**30, "x"))
    assert plan.num_fit_blocks == (2**29 - 1_000 - 40_000 - 44_032) // 1_024  # = 524_204
    assert plan.estimated_num_blocks == plan.num_blocks == 16  # num_full_blocks


def test_negative_budget_fits_nothing(make_spec, make_config) -> None:
    plan = compute_plan(
        make_spec(), make_config(), num_parameters=10_000, memory=DeviceMemory(1_000, "x")
    )
    assert plan.kv_budget_bytes < 0
    assert (plan.num_fit_blocks, plan.estimated_num_blocks) == (0, 0)


def test_smollm2_on_h100_is_capped(smollm2) -> None:
    memory = DeviceMemory(TARGET_PROFILES["h100-80gb"], "profile:h100-80gb")
    plan = compute_plan(
        smollm2, DecoderOnlyConfig(), num_parameters=SMOLLM2_135M_PARAMS, memory=memory
    )
    usable = int(81559 * 2**20 * 0.9)  # = 76_968_728_985
    budget = usable - 538_060_032 - 173_408_256  # weights, runtime = 76_257_260_697
    assert plan.kv_budget_bytes == budget
    assert plan.num_fit_blocks == budget // 737_280 == 103_430
    assert plan.estimated_num_blocks == 4096  # capped: 128 blocks x batch 32


def test_hybrid_plan_subtracts_the_sliding_slots(make_spec, make_config) -> None:
    spec = make_spec(layers=4, layer_types=[SLIDING, SLIDING, SLIDING, FULL], sliding_window=8)
    cfg = make_config(kvcache_memory_fraction=1.0)
    memory = 40_000 + 44_032 + 6_144 + 5 * 512  # weights + runtime + sliding + 5 blocks
    plan = compute_plan(spec, cfg, num_parameters=10_000, memory=DeviceMemory(memory, "x"))
    assert (plan.kv_bytes_per_block, plan.sliding_window_bytes) == (512, 6_144)
    assert plan.kv_budget_bytes == 5 * 512
    assert plan.num_fit_blocks == 5
    assert plan.kv_bytes == 5 * 512 + 6_144
    assert plan.total_bytes == memory


def test_all_sliding_needs_no_blocks(make_spec, make_config) -> None:
    spec = make_spec(layers=2, layer_types=[SLIDING, SLIDING], sliding_window=8)
    plan = compute_plan(spec, make_config(), num_parameters=10_000, memory=DeviceMemory(2**30, "x"))
    assert plan.kv_bytes_per_block == 0
    assert plan.sliding_window_bytes == 2 * 2 * 8 * (2 * 2 * 8 * 4)  # = 4_096
    assert plan.num_fit_blocks == plan.estimated_num_blocks == 16  # a non-negative budget: full
    small = plan.refit(
        DeviceMemory(1_000, "x"), kvcache_memory_fraction=1.0, kvcache_reserve_bytes=0
    )
    assert (small.num_fit_blocks, small.estimated_num_blocks) == (0, 0)


# -- changes --------------------------------------------------------------------------------------
def test_with_num_blocks(tiny_plan: MemoryPlan) -> None:
    plan = tiny_plan.with_num_blocks(12, "manual")
    assert (plan.num_blocks, plan.num_blocks_source) == (12, "manual")
    assert plan.estimated_num_blocks == 10
    assert tiny_plan.num_blocks == 10  # frozen: the original is unchanged


def test_refit_to_another_budget(tiny_plan: MemoryPlan) -> None:
    plan = tiny_plan.with_num_blocks(12, "manual").refit(
        DeviceMemory(2**20, "cuda:0"),
        kvcache_memory_fraction=1.0,
        kvcache_reserve_bytes=0,
        device="cuda:0",
    )
    assert (plan.device, plan.device_memory_bytes, plan.device_memory_source) == (
        "cuda:0",
        2**20,
        "cuda:0",
    )
    assert plan.kv_budget_bytes == 2**20 - 40_000 - 44_032  # = 964_544
    assert plan.num_fit_blocks == 941  # 964_544 // 1_024
    assert (plan.estimated_num_blocks, plan.num_blocks) == (16, 16)
    assert plan.num_blocks_source == "estimate"


def test_refit_keeps_device_when_not_given(tiny_plan: MemoryPlan) -> None:
    plan = tiny_plan.refit(
        DeviceMemory(192_590, "explicit"), kvcache_memory_fraction=0.5, kvcache_reserve_bytes=0
    )
    assert plan.device == "cpu"
    assert plan.kv_budget_bytes == 96_295 - 40_000 - 44_032  # reserve 0 now: 12_263
    assert plan.num_fit_blocks == 11


def test_with_measured_runtime(tiny_plan: MemoryPlan) -> None:
    plan = tiny_plan.with_measured_runtime(42_000)
    assert plan.measured_runtime_bytes == 42_000
    assert plan.runtime_buffer_bytes == 44_032  # the formula is kept for the table
    assert plan.runtime_bytes == 42_000
    assert plan.kv_budget_bytes == 95_295 - 40_000 - 42_000  # = 13_295
    assert plan.num_fit_blocks == plan.num_blocks == 12  # 12_288 <= 13_295 < 13_312
    assert (plan.device_memory_bytes, plan.device_memory_source) == (192_590, "explicit")


def test_measured_runtime_given_to_compute_plan(make_spec, make_config, tiny_plan) -> None:
    cfg = make_config(kvcache_memory_fraction=0.5, kvcache_reserve_memory=1000)
    plan = compute_plan(
        make_spec(),
        cfg,
        num_parameters=10_000,
        memory=DeviceMemory(192_590, "explicit"),
        measured_runtime_bytes=42_000,
    )
    assert plan == tiny_plan.with_measured_runtime(42_000)


# -- output ---------------------------------------------------------------------------------------
def test_summary_line(smollm2) -> None:
    memory = DeviceMemory(TARGET_PROFILES["h100-80gb"], "profile:h100-80gb")
    plan = compute_plan(
        smollm2, DecoderOnlyConfig(), num_parameters=SMOLLM2_135M_PARAMS, memory=memory
    )
    # 4096 x 737_280 B = 2880.0 MiB; 4096 // 128 = 32 sequences = batch_size
    assert plan.summary_line() == (
        "KV cache: 4096 blocks x 16 tokens = 65536 tokens (2880.0 MiB); "
        "max concurrency at max_seq_len: 32"
    )
    # 1000 x 737_280 B = 703.125 MiB; 1000 // 128 = 7
    assert plan.with_num_blocks(1000, "set").summary_line(pin_hint=True) == (
        "KV cache: 1000 blocks x 16 tokens = 16000 tokens (703.1 MiB); "
        "max concurrency at max_seq_len: 7; pin with --kvcache-num-blocks 1000"
    )


def _rows(table: str) -> dict[str, str]:
    rows = {}
    for line in table.splitlines():
        match = re.match(r"^(.*?\S)\s{2,}(\S.*)$", line)
        assert match, line
        rows[match.group(1)] = match.group(2)
    return rows


def test_plan_table_has_every_figure(tiny_plan: MemoryPlan) -> None:
    assert _rows(plan_table(tiny_plan)) == {
        "device memory (cpu, explicit)": "188.08 KiB",  # 192_590 / 1024
        "x kvcache_memory_fraction 0.5": "94.04 KiB",  # 96_295
        "- kvcache_reserve_memory": "1000 B",
        "= usable": "93.06 KiB",  # 95_295
        "- weights": "39.06 KiB",  # 40_000
        "- runtime buffers (formula)": "43.00 KiB",  # 44_032
        "- runtime buffers (measured)": "-",
        "- sliding-window KV (fixed)": "0 B",
        "= KV budget": "11.00 KiB",  # 11_263
        "/ bytes per block (4 tokens, float32)": "1.00 KiB",
        "= blocks that fit": "10",
        "blocks for one full sequence (32 tokens)": "8",
        "blocks for batch_size=2 full sequences": "16",
        "estimated kvcache_num_blocks": "10",
        "chosen kvcache_num_blocks (estimate)": "10",
        "KV pool": "40 tokens, 10.00 KiB",
        "max concurrency at max_seq_len": "1",
        "  with a shared prefix of 16 tokens": "1",  # (10 - 4) // (8 - 4)
        "total at peak: kvroom run / LLM": "92.06 KiB",  # 40_000 + 44_032 + 10 x 1024
        "total at peak: kvroom serve": "92.06 KiB",  # the formula has no server term
    }


def test_plan_table_shows_measured_runtime(tiny_plan: MemoryPlan) -> None:
    rows = _rows(plan_table(tiny_plan.with_measured_runtime(42_000)))
    assert rows["- runtime buffers (measured)"] == "41.02 KiB"  # 42_000 / 1024
    assert rows["= blocks that fit"] == "12"


@pytest.mark.parametrize(
    ("source", "label"),
    [
        ("cgroup-v1 /kvtest, limit 2.00 GiB", "device memory (cgroup-v1 /kvtest, limit 2.00 GiB)"),
        ("psutil", "device memory (cpu, psutil)"),
    ],
)
def test_plan_table_names_the_memory_source(tiny_plan: MemoryPlan, source: str, label: str) -> None:
    plan = dataclasses.replace(tiny_plan, device_memory_source=source)
    assert _rows(plan_table(plan))[label] == "188.08 KiB"


def test_to_dict_round_trip(tiny_plan: MemoryPlan) -> None:
    data = tiny_plan.to_dict()
    assert data["num_fit_blocks"] == 10
    assert "kv_budget_bytes" not in data  # derived, not stored
    assert MemoryPlan.from_dict(data) == tiny_plan
    assert MemoryPlan.from_dict(json.loads(json.dumps(data))) == tiny_plan
    measured = tiny_plan.with_measured_runtime(42_000)
    assert MemoryPlan.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured


def test_from_dict_unknown_key_fails(tiny_plan: MemoryPlan) -> None:
    with pytest.raises(TypeError, match="bogus"):
        MemoryPlan.from_dict({**tiny_plan.to_dict(), "bogus": 1})


def test_runtime_tokens_at_least_batch_size(make_spec) -> None:
    spec = make_spec()
    tokens = 32  # T = max(max_num_batched_tokens 8, batch 32): one decode token per sequence
    activations = 4 * tokens * 384  # = 49_152
    kv_gather = 4 * 32 * 32 * 2 * 16  # = 131_072
    scores = 4 * 4 * 32 * 32  # min(T, L) = 32: = 16_384
    logits = 4 * 32 * 128 * 3  # = 49_152
    got = runtime_buffer_bytes(
        spec,
        batch_size=32,
        max_seq_len=32,
        max_num_batched_tokens=8,
        dtype="float32",
        kv_dtype="float32",
    )
    assert got == activations + kv_gather + scores + logits == 245_760


def test_plan_imports_no_torch() -> None:
    code = "import sys, kvroom.plan, kvroom.config, kvroom.device; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tp2_fits_each_rank_into_its_own_device(make_spec, make_config) -> None:
    """With tp=2 every rank holds half of each block (kv_heads 4 -> 2 per rank) and half of the
    weights, and fits them into one device's memory."""
    spec = make_spec(layers=2, heads=4, kv_heads=4, head_dim=8)
    cfg = make_config(tensor_parallel_size=2, batch_size=64)
    memory = 2**20
    plan = compute_plan(spec, cfg, num_parameters=10_000, memory=DeviceMemory(memory, "x"))
    all_ranks_block = 2 * 2 * 4 * 4 * 8 * 4  # layers x K,V x block 4 x 4 heads x dim 8 x fp32
    assert plan.kv_bytes_per_block == all_ranks_block
    assert plan.kv_bytes_per_block_per_rank == all_ranks_block // 2
    assert plan.weight_bytes == 10_000 * 4 // 2
    budget = int(memory * cfg.kvcache_memory_fraction) - plan.weight_bytes - plan.runtime_bytes
    assert plan.num_fit_blocks == budget // (all_ranks_block // 2)
    assert plan.kv_bytes == plan.num_blocks * (all_ranks_block // 2)


# -- measured terms -------------------------------------------------------------------------------
def _terms(**overrides: int) -> MeasuredTerms:
    values = dict(
        method="cpu-rss",
        process_bytes=20_000,
        tokenizer_bytes=3_000,
        weights_bytes=41_000,
        load_transient_bytes=500,
        engine_bytes=100,
        warmup_bytes=2_000,
        step_peak_bytes={"decode": 700, "prefill": 1_500, "prefill_many": 900, "mixed": 1_200},
        server_bytes=4_000,
    )
    values.update(overrides)
    return MeasuredTerms(**values)  # type: ignore[arg-type]


def test_measured_terms_sum_to_the_totals(tiny_plan: MemoryPlan) -> None:
    terms = _terms()
    assert terms.step_bytes == 1_500 and terms.peak_step_shape == "prefill"
    assert terms.fixed_bytes(serve=False) == 20_000 + 3_000 + 41_000 + 100 + 2_000 + 1_500
    assert terms.load_peak_bytes == 20_000 + 3_000 + 41_000 + 500
    plan = tiny_plan.with_measured(terms)
    fixed_serve = 67_600 + 4_000
    assert plan.runtime_bytes == fixed_serve - plan.weight_bytes  # the fit leaves room to serve
    assert plan.kv_budget_bytes == 95_295 - fixed_serve  # = 23_695 -> 23 blocks, capped at 16
    assert plan.num_blocks == 16
    assert plan.total_bytes == 67_600 + 16 * 1024
    assert plan.serve_total_bytes == plan.total_bytes + 4_000
    assert plan.formula_total_bytes == 40_000 + 44_032 + 16 * 1024


def test_load_peak_counts_when_it_is_the_larger(tiny_plan: MemoryPlan) -> None:
    plan = tiny_plan.with_measured(_terms(load_transient_bytes=90_000))
    assert plan.total_bytes == 20_000 + 3_000 + 41_000 + 90_000


def test_measured_plan_json_round_trip_and_total(tiny_plan: MemoryPlan) -> None:
    plan = tiny_plan.with_measured(_terms())
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["total_bytes"] == plan.total_bytes
    assert data["serve_total_bytes"] == plan.serve_total_bytes
    assert data["measured"]["step_peak_bytes"]["prefill"] == 1_500
    assert MemoryPlan.from_dict(data) == plan


def test_terms_table_side_by_side(tiny_plan: MemoryPlan) -> None:
    formula_only = terms_table(tiny_plan).splitlines()
    assert formula_only[0].split() == ["non-KV", "memory", "at", "peak", "formula", "measured"]
    text = terms_table(tiny_plan.with_measured(_terms()))
    assert "step peak: prefill" in text and "server (kvroom serve only)" in text
    assert "formula vs measured" in text


def test_file_backed_part_is_shown_but_not_added(tiny_plan: MemoryPlan) -> None:
    plain = tiny_plan.with_measured(_terms())
    with_files = tiny_plan.with_measured(_terms(file_backed_bytes=9_000))
    assert with_files.total_bytes == plain.total_bytes  # part of the terms, not a term
    assert "of which mapped files" not in terms_table(plain)
    assert "of which mapped files" in terms_table(with_files)
    old = {k: v for k, v in with_files.measured.to_dict().items() if k != "file_backed_bytes"}
    assert MeasuredTerms.from_dict(old).file_backed_bytes == 0  # artifacts from before it


def test_measured_weights_follow_the_cpu_bf16_widening(tiny_plan: MemoryPlan) -> None:
    widened = _terms(weights_bytes=41_000, bf16_projection_bytes=10_000, bf16_widened=True)
    packed = widened.on_cpu(False)
    assert (packed.weights_bytes, packed.bf16_widened) == (31_000, False)
    assert packed.on_cpu(True) == widened
    assert widened.on_cpu(True) is widened  # the same CPU kind: unchanged
    fp32 = _terms()  # nothing to widen: every CPU holds the same bytes
    assert fp32.on_cpu(True) is fp32 and fp32.on_cpu(False) is fp32


def test_plan_on_another_cpu_keeps_its_pool_and_moves_its_totals(tiny_plan: MemoryPlan) -> None:
    terms = _terms(weights_bytes=41_000, bf16_projection_bytes=10_000, bf16_widened=False)
    plan = tiny_plan.with_measured(terms).with_num_blocks(8, "set")
    there = plan.on_cpu(True)
    assert (there.num_blocks, there.num_blocks_source) == (8, "set")
    assert there.total_bytes == plan.total_bytes + 10_000
    assert there.runtime_bytes == plan.runtime_bytes + 10_000  # the estimate leaves room for it
    assert plan.on_cpu(False) is plan and tiny_plan.on_cpu(True) is tiny_plan


def test_quantized_weights_count_their_bytes_as_loaded(make_spec, make_config) -> None:
    types = {"int4 (Q4_1)": 5_000, "float32": 1_234}
    cfg = make_config(tensor_parallel_size=1)
    plan = compute_plan(
        make_spec(), cfg, num_parameters=10_000, memory=DeviceMemory(2**30, "x"), weight_types=types
    )
    assert plan.weight_bytes == 6_234  # not 10_000 x 4
    assert plan.weight_types == (("float32", 1_234), ("int4 (Q4_1)", 5_000))
    assert MemoryPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    table = plan_table(plan)
    assert "    int4 (Q4_1)" in table and "weights (as loaded)" in terms_table(plan)


@pytest.mark.parametrize(
    ("kv_dtype", "values", "scales", "label"),
    [
        ("int8", "256 B", "128 B", "float32 scales"),
        ("int4", "128 B", "128 B", "float16 scales and mins"),
    ],
)
def test_plan_table_splits_a_quantized_block_into_values_and_scales(
    make_spec, make_config, kv_dtype: str, values: str, scales: str, label: str
) -> None:
    """2 layers x 4 tokens x 2 (K, V) x 2 kv heads = 32 rows of 8 dims per block:
    int8 32 x 8 B, int4 32 x 4 B of values, and 32 x 4 B of scales (int4: scales and mins)."""
    cfg = make_config(kv_dtype=kv_dtype)
    plan = compute_plan(make_spec(), cfg, num_parameters=10, memory=DeviceMemory(2**20, "x"))
    rows = _rows(plan_table(plan))
    assert rows[f"    {kv_dtype} K/V values"] == values
    assert rows[f"    {label} (per token, kv head)"] == scales
    assert plan.kv_scale_bytes_per_block == 32 * 4
    assert plan.kv_bytes_per_block == 32 * (8 * (8 if kv_dtype == "int8" else 4) // 8 + 4)


def test_quantized_kv_fits_about_2x_and_3_5x_the_bf16_blocks(smollm2, make_config) -> None:
    """SmolLM2 (head_dim 64) in 1 GiB: a block costs 128 B per row in bf16, 68 B in int8 and
    36 B in int4, and the budget left after weights and buffers is divided by it."""
    fits = {}
    for kv_dtype in ("bfloat16", "int8", "int4"):
        cfg = make_config(dtype="bfloat16", kv_dtype=kv_dtype, max_seq_len=2048, batch_size=8)
        memory = DeviceMemory(2**30, "explicit")
        fits[kv_dtype] = compute_plan(smollm2, cfg, num_parameters=0, memory=memory).num_fit_blocks
    assert 1.88 <= fits["int8"] / fits["bfloat16"] < 2.1
    assert 3.5 <= fits["int4"] / fits["bfloat16"] < 4.0
