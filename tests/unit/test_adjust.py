"""The num-blocks policy: manual value, adjuster, warnings and ``Memory is not enough``."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from kvroom.adjust import AdjusterError, resolve_num_blocks, validate_num_blocks
from kvroom.config import DecoderOnlyConfig
from kvroom.device import DeviceMemory
from kvroom.errors import ConfigError, KvroomError, MemoryNotEnoughError
from kvroom.plan import MemoryPlan, compute_plan

# The tiny model at batch 4 (fraction 1, reserve 0): 8 blocks per sequence, 32 for the batch.
WEIGHTS = 10_000 * 4  # 10_000 fp32 params
RUNTIME = 4 * 16 * 384 + 4 * 4 * 32 * 2 * 16 + 4 * 4 * 16 * 32 + 4 * 4 * 128 * 3  # = 55_296
BLOCK = 2 * 4 * (2 * 2 * 8 * 4)  # 2 layers x 4 tokens x (K, V x 2 heads x 8 x fp32) = 1_024


def memory_for(blocks: int) -> DeviceMemory:
    return DeviceMemory(WEIGHTS + RUNTIME + blocks * BLOCK, "explicit")


@pytest.fixture
def config(make_config):
    def build(**overrides) -> DecoderOnlyConfig:
        return make_config(**{"batch_size": 4, "kvcache_memory_fraction": 1.0, **overrides})

    return build


@pytest.fixture
def plan_for(make_spec, config):
    """The plan of the tiny model with room for exactly ``blocks`` blocks."""

    def build(blocks: int, cfg: DecoderOnlyConfig | None = None) -> MemoryPlan:
        plan = compute_plan(
            make_spec(), cfg or config(), num_parameters=10_000, memory=memory_for(blocks)
        )
        assert plan.num_fit_blocks == blocks
        return plan

    return build


def _exact(message: str) -> str:
    return f"^{re.escape(message)}$"


# -- no adjuster, no manual value ----------------------------------------------------------------
def test_estimate_is_kept(plan_for, config) -> None:
    plan = plan_for(20)
    assert resolve_num_blocks(plan, config()) == plan
    assert (plan.num_blocks, plan.num_blocks_source) == (20, "estimate")


def test_estimate_not_fitting_is_memory_not_enough(plan_for, config) -> None:
    plan = plan_for(7)  # one sequence needs 8
    expected = (
        "Memory is not enough: one full-length sequence (max_seq_len=32) needs 8 blocks of 4 "
        "tokens and 7 fit in the KV budget of 7.00 KiB, what the 100.06 KiB usable (100.06 KiB "
        "device memory x kvcache_memory_fraction 1) leaves after weights 39.06 KiB + runtime "
        "buffers 54.00 KiB. To fit: give kvroom at least 101.06 KiB of device memory "
        "(device_memory now 100.06 KiB, explicit), lower max_seq_len (now 32) or batch_size "
        "(now 4), or use a smaller kv_dtype (now float32)"
    )  # 7 x 1_024 = 7_168 B budget; usable 40_000 + 55_296 + 7_168 = 102_464 B; one more block
    with pytest.raises(MemoryNotEnoughError, match=_exact(expected)):
        resolve_num_blocks(plan, config())


def test_weights_and_runtime_not_fitting_say_so(make_spec, config) -> None:
    plan = compute_plan(
        make_spec(), config(), num_parameters=10_000, memory=DeviceMemory(50_000, "explicit")
    )
    expected = (  # 40_000 + 55_296 = 95_296 B of fixed terms in 50_000 B; never a negative budget
        "Memory is not enough: weights 39.06 KiB + runtime buffers 54.00 KiB = 93.06 KiB exceed "
        "the 48.83 KiB usable (48.83 KiB device memory x kvcache_memory_fraction 1). To fit: give "
        "kvroom at least 101.06 KiB of device memory (device_memory now 48.83 KiB, explicit), or "
        "lower max_seq_len (now 32) or batch_size (now 4)"
    )
    with pytest.raises(MemoryNotEnoughError, match=_exact(expected)):
        resolve_num_blocks(plan, config())


def test_weights_alone_not_fitting_say_so(make_spec, config) -> None:
    cfg = config(kvcache_memory_fraction=0.5, kvcache_reserve_memory=1_000)
    plan = compute_plan(
        make_spec(), cfg, num_parameters=10_000, memory=DeviceMemory(60_000, "explicit")
    )
    expected = (  # usable 30_000 - 1_000 = 29_000 B < 40_000 B of weights
        "Memory is not enough: the weights alone (39.06 KiB) exceed the 28.32 KiB usable "
        "(58.59 KiB device memory x kvcache_memory_fraction 0.5 - kvcache_reserve_memory "
        "1000 B). To fit: give kvroom at least 204.08 KiB of device memory (device_memory now "
        "58.59 KiB, explicit), reserve less (kvcache_reserve_memory now 1000 B), or raise "
        "kvcache_memory_fraction (now 0.5)"
    )  # (103_488 + 1_000) / 0.5 = 208_976 B
    with pytest.raises(MemoryNotEnoughError, match=_exact(expected)):
        resolve_num_blocks(plan, cfg)


@pytest.mark.parametrize(
    ("reserve", "fix"),
    [
        (200_750, "reserve at most 94.98 KiB"),  # 200_750 - 103_488 = 97_262 B
        (10**12, "reserve at most 94.98 KiB"),
    ],
)
def test_a_reserve_taking_everything_says_so(make_spec, config, reserve, fix) -> None:
    cfg = config(kvcache_reserve_memory=reserve)
    plan = compute_plan(
        make_spec(), cfg, num_parameters=10_000, memory=DeviceMemory(200_750, "explicit")
    )
    message = (
        r"^Memory is not enough: kvcache_reserve_memory \(\d+\.\d\d [KG]iB\) leaves nothing of "
        r"the 196\.04 KiB kvroom may use \(196\.04 KiB device memory x kvcache_memory_fraction "
        r"1\), and the weights, runtime and one sequence's KV need 101\.06 KiB\. To fit: "
        + re.escape(fix)
        + "$"
    )
    with pytest.raises(MemoryNotEnoughError, match=message):
        resolve_num_blocks(plan, cfg)


def test_a_reserve_in_too_little_memory_asks_for_both(make_spec, config) -> None:
    cfg = config(kvcache_reserve_memory=60_000)
    plan = compute_plan(
        make_spec(), cfg, num_parameters=10_000, memory=DeviceMemory(50_000, "explicit")
    )
    with pytest.raises(
        MemoryNotEnoughError,
        match=r"To fit: reserve less, and give kvroom at least 101\.06 KiB of device memory$",
    ):
        resolve_num_blocks(plan, cfg)


def test_memory_not_enough_is_a_user_value_error() -> None:
    assert issubclass(MemoryNotEnoughError, ConfigError)
    assert issubclass(MemoryNotEnoughError, ValueError)
    assert issubclass(MemoryNotEnoughError, KvroomError)


# -- the adjuster ---------------------------------------------------------------------------------
def test_halving_adjuster(plan_for, config) -> None:
    calls = []

    def halve(n: int, cfg: DecoderOnlyConfig) -> int:
        calls.append((n, cfg))
        return n // 2

    cfg = config(kvcache_num_blocks_adjuster=halve)
    plan = resolve_num_blocks(plan_for(21, cfg), cfg)
    assert plan.num_blocks == 10  # 21 // 2
    assert plan.num_blocks_source == "adjuster"
    assert plan.estimated_num_blocks == 21
    assert len(calls) == 1
    assert calls[0][0] == 21
    assert calls[0][1] is cfg


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (10.0, "kvcache_num_blocks_adjuster: kvcache_num_blocks must be an int, got 10.0"),
        ("10", "kvcache_num_blocks_adjuster: kvcache_num_blocks must be an int, got '10'"),
        (None, "kvcache_num_blocks_adjuster: kvcache_num_blocks must be an int, got None"),
        (True, "kvcache_num_blocks_adjuster: kvcache_num_blocks must be an int, got True"),
        (0, "kvcache_num_blocks_adjuster: kvcache_num_blocks must be > 0, got 0"),
        (-3, "kvcache_num_blocks_adjuster: kvcache_num_blocks must be > 0, got -3"),
    ],
)
def test_adjuster_bad_return(plan_for, config, returned: object, expected: str) -> None:
    cfg = config(kvcache_num_blocks_adjuster=lambda n, c: returned)
    with pytest.raises(ValueError, match=_exact(expected)) as info:
        resolve_num_blocks(plan_for(20, cfg), cfg)
    assert type(info.value) is ConfigError  # not MemoryNotEnoughError


def test_adjuster_below_min_names_the_minimum(plan_for, config) -> None:
    cfg = config(kvcache_num_blocks_adjuster=lambda n, c: 7)
    expected = (
        "kvcache_num_blocks_adjuster: 7 blocks is below the minimum of 8 (one max_seq_len=32 "
        "sequence in blocks of 4 tokens); use at least 8, or a lower max_seq_len at compile"
    )  # memory is not the problem: 20 blocks fit
    with pytest.raises(ConfigError, match=_exact(expected)) as info:
        resolve_num_blocks(plan_for(20, cfg), cfg)
    assert type(info.value) is ConfigError  # not MemoryNotEnoughError


def test_adjuster_at_min_is_accepted(plan_for, config) -> None:
    cfg = config(kvcache_num_blocks_adjuster=lambda n, c: 8)
    assert resolve_num_blocks(plan_for(20, cfg), cfg).num_blocks == 8


def test_adjuster_above_estimate_warns_and_is_honoured(
    plan_for, config, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(kvcache_num_blocks_adjuster=lambda n, c: n + 5)
    caplog.set_level(logging.WARNING, logger="kvroom")
    plan = resolve_num_blocks(plan_for(20, cfg), cfg)
    assert (plan.num_blocks, plan.num_blocks_source) == (25, "adjuster")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            "kvroom",
            logging.WARNING,
            "kvcache_num_blocks_adjuster: kvcache_num_blocks=25 is above the memory estimate of "
            "20 blocks (113.06 KiB device memory, explicit); honoured, make sure the memory is "
            "there",
        )
    ]


def test_adjuster_equal_to_estimate_does_not_warn(
    plan_for, config, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(kvcache_num_blocks_adjuster=lambda n, c: n)
    caplog.set_level(logging.DEBUG, logger="kvroom")
    assert resolve_num_blocks(plan_for(20, cfg), cfg).num_blocks == 20
    assert caplog.records == []


def test_adjuster_raising_is_chained(plan_for, config) -> None:
    original = ZeroDivisionError("division by zero")

    def broken(n: int, cfg: DecoderOnlyConfig) -> int:
        raise original

    cfg = config(kvcache_num_blocks_adjuster=broken)
    expected = "raised inside kvcache_num_blocks_adjuster(20, config): ZeroDivisionError: "
    with pytest.raises(AdjusterError, match=_exact(expected + "division by zero")) as info:
        resolve_num_blocks(plan_for(20, cfg), cfg)
    assert info.value.__cause__ is original
    assert original.__notes__ == ["raised inside kvcache_num_blocks_adjuster(20, config)"]
    assert isinstance(info.value, KvroomError)
    assert not isinstance(info.value, ValueError)  # a bug in user code, not a bad config value


def test_adjuster_not_called_when_estimate_does_not_fit(plan_for, config) -> None:
    calls = []
    cfg = config(kvcache_num_blocks_adjuster=lambda n, c: calls.append(n) or 100)
    with pytest.raises(MemoryNotEnoughError, match="^Memory is not enough: one full-length"):
        resolve_num_blocks(plan_for(7, cfg), cfg)
    assert calls == []


# -- a manual kvcache_num_blocks ------------------------------------------------------------------
def test_manual_value_wins_over_the_adjuster(plan_for, config) -> None:
    calls = []
    cfg = config(kvcache_num_blocks=12, kvcache_num_blocks_adjuster=lambda n, c: calls.append(n))
    plan = resolve_num_blocks(plan_for(20, cfg), cfg)
    assert (plan.num_blocks, plan.num_blocks_source) == (12, "manual")
    assert plan.estimated_num_blocks == 20
    assert calls == []


def test_manual_below_min_names_the_minimum(plan_for, config) -> None:
    cfg = config(kvcache_num_blocks=5)
    with pytest.raises(
        ConfigError,
        match=r"^kvcache_num_blocks: 5 blocks is below the minimum of 8 \(one max_seq_len=32 "
        r"sequence in blocks of 4 tokens\); use at least 8, or a lower max_seq_len at compile$",
    ) as info:
        resolve_num_blocks(plan_for(20, cfg), cfg)
    assert not isinstance(info.value, MemoryNotEnoughError)


def test_manual_above_estimate_warns_and_is_honoured(
    plan_for, config, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(kvcache_num_blocks=30)
    caplog.set_level(logging.WARNING, logger="kvroom")
    plan = resolve_num_blocks(plan_for(20, cfg), cfg)
    assert (plan.num_blocks, plan.num_blocks_source) == (30, "manual")
    assert [r.getMessage() for r in caplog.records] == [
        "kvcache_num_blocks: kvcache_num_blocks=30 is above the memory estimate of 20 blocks "
        "(113.06 KiB device memory, explicit); honoured, make sure the memory is there"
    ]


def test_manual_value_honoured_when_estimate_does_not_fit(
    plan_for, config, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(kvcache_num_blocks=8)
    caplog.set_level(logging.WARNING, logger="kvroom")
    plan = resolve_num_blocks(plan_for(7, cfg), cfg)  # the caller knows its machine
    assert (plan.num_blocks, plan.num_blocks_source) == (8, "manual")
    assert len(caplog.records) == 1
    assert "kvcache_num_blocks=8 is above the memory estimate of 7 blocks" in caplog.text


def test_validate_names_its_source(plan_for) -> None:
    with pytest.raises(ConfigError, match=_exact("set: kvcache_num_blocks must be > 0, got 0")):
        validate_num_blocks(0, plan_for(20), source="set")
    assert validate_num_blocks(16, plan_for(20), source="set") == 16


def test_adjust_imports_no_torch() -> None:
    code = "import sys, kvroom.adjust; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
