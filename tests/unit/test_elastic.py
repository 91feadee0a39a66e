"""Elastic KV pool: the pure policy over numbers, and the controller with an injected probe."""

from __future__ import annotations

import pytest

from kvroom import device
from kvroom.device import DeviceMemory
from kvroom.engine.kv import elastic
from kvroom.engine.kv.elastic import (
    ElasticController,
    ElasticPolicy,
    MemorySample,
    decide,
    sample_memory,
)
from kvroom.errors import ConfigError

MiB = 2**20
# 1 MiB blocks, 16..1024 of them, keep 1024 MiB free, hysteresis 256 MiB
POLICY = ElasticPolicy(
    min_num_blocks=16,
    max_num_blocks=1024,
    bytes_per_block=MiB,
    reserve_bytes=1024 * MiB,
    hysteresis_bytes=256 * MiB,
    grow_cooldown_s=5.0,
)


def sample(available_mib: int, pressure: float | None = None) -> MemorySample:
    return MemorySample(available_mib * MiB, "test", pressure)


def test_inside_the_band_the_pool_stays() -> None:
    for available in (1024, 1100, 1280):  # slack 0, 76, 256 MiB: within [0, H]
        assert decide(POLICY, sample(available), 512, since_resize_s=60) is None


def test_below_the_reserve_it_shrinks_to_the_middle_of_the_band() -> None:
    # slack = -200 MiB: give back 200 + 128 MiB = 328 blocks
    d = decide(POLICY, sample(824), 512, since_resize_s=0)
    assert d is not None and d.num_blocks == 512 - 328
    assert d.why == "shrink: 824 MiB available (test) < reserve 1024 MiB"


def test_above_the_band_it_grows_to_the_middle_of_the_band() -> None:
    # slack = 476 MiB: take 476 - 128 = 348 blocks
    d = decide(POLICY, sample(1500), 512, since_resize_s=10)
    assert d is not None and d.num_blocks == 860 and d.why.startswith("grow: 1500 MiB")


def test_after_a_shrink_or_grow_the_next_sample_is_inside_the_band() -> None:
    """Hysteresis: applying a decision moves the slack to H/2, where nothing more happens."""
    available = 1500
    d = decide(POLICY, sample(available), 512, since_resize_s=10)
    assert d is not None
    available -= (d.num_blocks - 512) * 1  # the new blocks are now resident
    assert decide(POLICY, sample(available), d.num_blocks, since_resize_s=10) is None
    d2 = decide(POLICY, sample(available - 600), d.num_blocks, since_resize_s=10)
    assert d2 is not None and d2.num_blocks < d.num_blocks
    back = available - 600 + (d.num_blocks - d2.num_blocks)
    assert decide(POLICY, sample(back), d2.num_blocks, since_resize_s=10) is None


def test_grow_waits_for_the_cooldown_and_for_no_pressure() -> None:
    assert decide(POLICY, sample(4096), 512, since_resize_s=1) is None
    assert decide(POLICY, sample(4096, pressure=35.0), 512, since_resize_s=60) is None
    assert decide(POLICY, sample(4096, pressure=1.0), 512, since_resize_s=60) is not None


def test_pressure_near_the_reserve_shrinks_a_step() -> None:
    d = decide(POLICY, sample(1100, pressure=40.0), 512, since_resize_s=0)
    assert d is not None and d.num_blocks == 512 - 128 and "memory pressure 40.0%" in d.why


def test_bounds_clamp_every_decision() -> None:
    assert decide(POLICY, sample(0), 100, since_resize_s=0).num_blocks == 16
    assert decide(POLICY, sample(0), 16, since_resize_s=0) is None
    assert decide(POLICY, sample(99999), 1000, since_resize_s=60).num_blocks == 1024
    assert decide(POLICY, sample(99999), 1024, since_resize_s=60) is None


def test_bad_bounds_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"min_num_blocks \(20\) <= max_num_blocks \(10\)"):
        ElasticPolicy(min_num_blocks=20, max_num_blocks=10, bytes_per_block=1)


def test_the_sample_is_the_cgroup_probe_and_its_pressure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probed = DeviceMemory(1536 * MiB, "cgroup-v1 /kvtest, limit 2.00 GiB")
    monkeypatch.setattr(device, "probe_cpu", lambda: probed)
    monkeypatch.setattr(elastic, "memory_pressure", lambda: 12.5)
    assert sample_memory() == MemorySample(1536 * MiB, probed.source, 12.5)


def test_controller_samples_and_applies_through_the_injected_pieces() -> None:
    readings = iter([sample(1100), sample(500), sample(500), sample(3000), sample(3000)])
    size = {"n": 512}
    applied: list[tuple[int, str]] = []
    now = {"t": 0.0}

    def apply(n: int, why: str) -> None:
        applied.append((n, why))
        size["n"] = n

    ctl = ElasticController(
        POLICY,
        current=lambda: size["n"],
        apply=apply,
        probe=lambda: next(readings),
        clock=lambda: now["t"],
    )
    assert ctl.tick() is None  # in the band
    assert ctl.tick().num_blocks == 16  # 524 MiB under the reserve: down to the minimum
    assert ctl.tick() is None  # already at the minimum
    now["t"] = 2.0
    assert ctl.tick() is None  # memory is back, but within the grow cooldown
    now["t"] = 10.0
    assert ctl.tick().num_blocks == 1024  # grows, clamped at the maximum
    assert [n for n, _ in applied] == [16, 1024]
    assert applied[0][1].startswith("shrink: 500 MiB available")


def test_controller_thread_survives_a_refused_resize() -> None:
    import threading

    calls = threading.Event()

    def apply(n: int, why: str) -> None:
        calls.set()
        raise ConfigError("refused")

    fast = ElasticPolicy(
        min_num_blocks=1,
        max_num_blocks=8,
        bytes_per_block=MiB,
        reserve_bytes=0,
        interval_s=0.01,
        grow_cooldown_s=0,
    )
    ctl = ElasticController(fast, current=lambda: 1, apply=apply, probe=lambda: sample(4096))
    ctl.start()
    assert calls.wait(5)
    ctl.stop()
    assert ctl.num_errors >= 1
