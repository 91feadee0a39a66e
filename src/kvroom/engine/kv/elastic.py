"""Elastic KV pool: follow the memory the machine has, keeping ``reserve_bytes`` free.

A pure policy (``decide``: memory now, pool now -> new size and why, or stay) and a thin thread
(``ElasticController``) that samples about once a second and applies; the probe, the clock and
the resize are injected, so the policy is tested with numbers and the thread with fakes.

The band (``slack = available - reserve``, ``H = hysteresis_bytes``)::

    slack < 0          shrink now, to slack = H / 2       (before the kernel's OOM killer would)
    PSI some avg10 >= pressure_pct and slack < H
                       shrink by H / 2 worth of blocks    (reclaim is already stalling tasks)
    0 <= slack <= H    stay                               (no flapping around one value)
    slack > H          grow to slack = H / 2, at most once per ``grow_cooldown_s`` and not
                       under pressure (a grow's pages are faulted in over the next seconds,
                       so the probe sees them late)

Always clamped to ``[min_num_blocks, max_num_blocks]``. Memory available is the headroom under
the tightest limit of this process's own cgroup and its ancestors, capped by ``MemAvailable``
(``device.probe_cpu``); pressure is PSI ``memory.pressure`` of the process's own v2 cgroup,
else the machine's ``/proc/pressure/memory``, where the kernel has it (``kvroom.cgroup``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvroom.cgroup import memory_pressure
from kvroom.errors import ConfigError

logger = logging.getLogger("kvroom")

DEFAULT_RESERVE_BYTES = 1 * 2**30
"""Kept free when the artifact's ``kvcache_reserve_memory`` is 0."""
DEFAULT_HYSTERESIS_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ElasticPolicy:
    """How the elastic pool follows memory (all sizes in blocks or bytes)."""

    min_num_blocks: int
    """Never below (at least ``num_min_blocks``: one full-length sequence)."""
    max_num_blocks: int
    """Never above (the address space reserved at start-up)."""
    bytes_per_block: int
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    """Memory kept free for everything else on the machine."""
    hysteresis_bytes: int = DEFAULT_HYSTERESIS_BYTES
    """Width of the band of free memory above the reserve in which the pool stays put."""
    pressure_pct: float = 20.0
    """PSI ``some avg10`` (% of time tasks stalled on memory) that counts as pressure."""
    interval_s: float = 1.0
    """Seconds between samples."""
    grow_cooldown_s: float = 5.0
    """Seconds after any resize before the pool may grow again."""

    def __post_init__(self) -> None:
        if not 0 < self.min_num_blocks <= self.max_num_blocks:
            raise ConfigError(
                f"ElasticPolicy: need 0 < min_num_blocks ({self.min_num_blocks}) <= "
                f"max_num_blocks ({self.max_num_blocks}); check --kvcache-min-blocks and "
                "--kvcache-max-blocks"
            )
        for name in ("bytes_per_block", "reserve_bytes", "hysteresis_bytes"):
            if getattr(self, name) < (1 if name == "bytes_per_block" else 0):
                raise ConfigError(f"ElasticPolicy.{name}: got {getattr(self, name)}")


@dataclass(frozen=True)
class MemorySample:
    """One reading of the machine."""

    available_bytes: int
    """Memory this process could still take now (its own pool is already counted as used)."""
    source: str
    pressure_pct: float | None = None
    """PSI ``some avg10``, None where the kernel has no PSI."""


@dataclass(frozen=True)
class Decision:
    num_blocks: int
    why: str


def decide(
    policy: ElasticPolicy, sample: MemorySample, num_blocks: int, since_resize_s: float
) -> Decision | None:
    """The size the pool should have now, or None to stay (see the module's band)."""
    bpb, band = policy.bytes_per_block, policy.hysteresis_bytes
    slack = sample.available_bytes - policy.reserve_bytes
    free = f"{sample.available_bytes / 2**20:.0f} MiB available ({sample.source})"
    keep = f"reserve {policy.reserve_bytes / 2**20:.0f} MiB"
    pressured = sample.pressure_pct is not None and sample.pressure_pct >= policy.pressure_pct
    if slack < 0:
        want = num_blocks - _cdiv(band // 2 - slack, bpb)
        why = f"shrink: {free} < {keep}"
    elif pressured and slack < band:
        want = num_blocks - _cdiv(band // 2, bpb)
        why = f"shrink: memory pressure {sample.pressure_pct:.1f}% (PSI some avg10), {free}"
    elif slack > band and not pressured and since_resize_s >= policy.grow_cooldown_s:
        want = num_blocks + (slack - band // 2) // bpb
        why = f"grow: {free}, {keep}"
    else:
        return None
    want = max(policy.min_num_blocks, min(policy.max_num_blocks, want))
    return Decision(want, why) if want != num_blocks else None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sample_memory() -> MemorySample:
    """The machine now: the process's cgroup headroom or MemAvailable, and PSI pressure."""
    from kvroom.device import probe_cpu

    memory = probe_cpu()
    return MemorySample(memory.available_bytes, memory.source, memory_pressure())


class ElasticController:
    """Samples every ``policy.interval_s`` and applies ``decide``'s answer (a daemon thread)."""

    def __init__(
        self,
        policy: ElasticPolicy,
        *,
        current: Callable[[], int],
        apply: Callable[[int, str], object],
        probe: Callable[[], MemorySample] = sample_memory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            policy: the band and bounds.
            current: the pool size now (blocks).
            apply: resize to ``n`` blocks, logging ``why`` (blocks until done).
            probe: reads the machine (injected in tests).
            clock: monotonic seconds (injected in tests).
        """
        self.policy = policy
        self._current = current
        self._apply = apply
        self._probe = probe
        self._clock = clock
        self._last_resize = -float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvroom-elastic", daemon=True)
        self.num_errors = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def tick(self) -> Decision | None:
        """One sample and, if the policy says so, one resize; returns what was decided."""
        now = self._clock()
        decision = decide(self.policy, self._probe(), self._current(), now - self._last_resize)
        if decision is not None:
            self._apply(decision.num_blocks, decision.why)
            self._last_resize = self._clock()
        return decision

    def _run(self) -> None:
        while not self._stop.wait(self.policy.interval_s):
            try:
                self.tick()
            except Exception as exc:  # a refused resize must not end elasticity
                self.num_errors += 1
                logger.warning("elastic KV pool: %s: %s", type(exc).__name__, exc)
                if type(exc).__name__ in ("EngineClosedError", "EngineDeadError"):
                    return
