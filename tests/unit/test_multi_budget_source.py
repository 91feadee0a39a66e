"""Where the multi-model budget comes from: fixed, or the memory followed with a band."""

from __future__ import annotations

from kvroom.engine.kv.elastic import MemorySample
from kvroom.server.multi.budget_source import FixedBudget, MemoryBudget

MiB = 2**20


class Probe:
    def __init__(self, available_mib: int, pressure_pct: float | None = None) -> None:
        self.available_mib = available_mib
        self.pressure_pct = pressure_pct

    def __call__(self) -> MemorySample:
        return MemorySample(self.available_mib * MiB, "fake", self.pressure_pct)


def test_a_fixed_budget_is_what_was_given_until_an_operator_sets_another() -> None:
    budget = FixedBudget(800 * MiB)
    assert budget.budget_bytes(held_bytes=500 * MiB) == 800 * MiB
    budget.set(600 * MiB)
    assert budget.budget_bytes(held_bytes=500 * MiB) == 600 * MiB
    assert budget.describe() == "600.00 MiB, set by an operator"


def test_the_memory_budget_follows_what_is_free_with_a_band() -> None:
    probe = Probe(3000)
    budget = MemoryBudget(1024 * MiB, hysteresis_bytes=256 * MiB, probe=probe)
    assert budget.budget_bytes(held_bytes=0) == (3000 - 1024 - 128) * MiB  # half a band spare
    probe.available_mib = 1024 + 100  # held 1500, inside the band: unchanged
    assert budget.budget_bytes(held_bytes=1500 * MiB) == (3000 - 1024 - 128) * MiB
    probe.available_mib = 900  # below the reserve: held - 124 - 128
    assert budget.budget_bytes(held_bytes=1500 * MiB) == (1500 - 124 - 128) * MiB
    probe.available_mib = 1024 + 1000  # room again: held + 1000 - 128
    assert budget.budget_bytes(held_bytes=1248 * MiB) == (1248 + 1000 - 128) * MiB


def test_an_operators_value_stops_the_following() -> None:
    probe = Probe(3000)
    budget = MemoryBudget(1024 * MiB, probe=probe)
    budget.set(500 * MiB)
    probe.available_mib = 100
    assert budget.budget_bytes(held_bytes=400 * MiB) == 500 * MiB


def test_memory_pressure_near_the_reserve_shrinks_and_blocks_growth() -> None:
    probe = Probe(3000)
    budget = MemoryBudget(1024 * MiB, hysteresis_bytes=256 * MiB, probe=probe)
    probe.available_mib, probe.pressure_pct = 1024 + 100, 35.0  # in the band, but stalling
    assert budget.budget_bytes(held_bytes=1500 * MiB) == (1500 - 128) * MiB
    probe.available_mib = 1024 + 1000  # room, still under pressure: no growth
    assert budget.budget_bytes(held_bytes=1372 * MiB) == (1500 - 128) * MiB
