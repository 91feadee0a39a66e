"""Where the multi-model budget comes from: a fixed ``--memory-budget``, or the memory this
process may use, followed live (the default).

Following the memory, the budget is what this process holds now plus what it could still take,
less the reserve, with the elastic pool's band (``engine/kv/elastic.py``)::

    slack = available - reserve
    slack < 0        budget = held + slack - H/2        (shrink now: below the reserve)
    PSI some avg10 >= pressure_pct and slack < H
                     budget = held - H/2                (reclaim is already stalling tasks)
    slack > H        budget = held + slack - H/2        (grow, at most by what is free;
                                                         not under pressure)
    otherwise        unchanged                          (no flapping around one value)

``held`` is the arbiter's own account (process + loaded models' fixed bytes + pools), so the
probe's "available" (which already counts them as used) is not counted twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvroom.engine.kv.elastic import DEFAULT_HYSTERESIS_BYTES, MemorySample, sample_memory
from kvroom.units import format_bytes


class FixedBudget:
    """``--memory-budget`` (an operator can change it live through ``POST /kv_cache``)."""

    def __init__(self, budget_bytes: int, source: str = "--memory-budget") -> None:
        self._bytes = budget_bytes
        self._lock = threading.Lock()
        self._source = source

    def set(self, budget_bytes: int) -> None:
        with self._lock:
            self._bytes = budget_bytes
            self._source = "set by an operator"

    def budget_bytes(self, held_bytes: int) -> int:
        with self._lock:
            return self._bytes

    def describe(self) -> str:
        return f"{format_bytes(self.budget_bytes(0))}, {self._source}"


class MemoryBudget(FixedBudget):
    """The memory this process may use (cgroup headroom or MemAvailable) less ``reserve``."""

    def __init__(
        self,
        reserve_bytes: int,
        *,
        hysteresis_bytes: int = DEFAULT_HYSTERESIS_BYTES,
        pressure_pct: float = 20.0,
        probe: Callable[[], MemorySample] = sample_memory,
    ) -> None:
        self.reserve_bytes = reserve_bytes
        self.hysteresis_bytes = hysteresis_bytes
        self.pressure_pct = pressure_pct
        self._probe = probe
        self._pinned = False
        sample = probe()
        super().__init__(sample.available_bytes - reserve_bytes)
        self.source = sample.source

    def set(self, budget_bytes: int) -> None:
        """An operator's value: stop following the memory."""
        super().set(budget_bytes)
        self._pinned = True

    def budget_bytes(self, held_bytes: int) -> int:
        """The budget now (a fresh sample unless an operator set it)."""
        if self._pinned:
            return super().budget_bytes(held_bytes)
        sample = self._probe()
        self.source = sample.source
        slack, band = sample.available_bytes - self.reserve_bytes, self.hysteresis_bytes
        pressed = sample.pressure_pct is not None and sample.pressure_pct >= self.pressure_pct
        if slack < 0 or (slack > band and not pressed):
            super().set(held_bytes + slack - band // 2)
        elif pressed and slack < band:
            super().set(held_bytes - band // 2)
        return super().budget_bytes(held_bytes)

    def describe(self) -> str:
        if self._pinned:
            return super().describe()
        return (
            f"{format_bytes(super().budget_bytes(0))}, memory available ({self.source}) "
            f"less the reserve {format_bytes(self.reserve_bytes)}, followed live"
        )
