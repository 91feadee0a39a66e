"""How idle OpenMP threads wait, chosen before torch loads its OpenMP runtime.

A step opens about ten parallel regions per layer. Between two of them the second thread
either spins for the next one or sleeps and is woken by the kernel. On a machine whose cores
are free, a short spin catches the next region: SmolLM2 fp32 on 2 idle cores, 32 x 64 batch,
``GOMP_SPINCOUNT=100000`` ran about 1.3x the tokens per second of sleeping at once, single
stream 1.5x (``benchmarks/RESULTS.md``). Where the cores are oversubscribed, a spinning
worker steals the slice its peer needs and every join waits a scheduler tick: at load 14 on
2 cores, sleeping at once ran 16.5 tok/s and libgomp's default spin 8.1. So the spin is
bounded, and the threads sleep at once where the load average says the cores are taken.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

SPIN_COUNT = 100_000
"""``GOMP_SPINCOUNT`` on free cores: a third of libgomp's default (300,000)."""

OVERSUBSCRIBED = 2.0
"""Load average per usable core above which idle threads sleep at once (``PASSIVE``)."""

WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def choose_wait_policy() -> None:
    """Set ``wait_policy_env()``; OpenMP reads it once, when torch loads its runtime."""
    os.environ.update(wait_policy_env())


def wait_policy_env() -> dict[str, str]:
    """``GOMP_SPINCOUNT`` on free cores, ``OMP_WAIT_POLICY=PASSIVE`` on oversubscribed ones;
    nothing where the environment sets either."""
    if any(name in os.environ for name in WAIT_ENV):
        return {}
    if _load_per_core() > OVERSUBSCRIBED:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def describe() -> str:
    """The wait policy in effect, for the logged kernels line."""
    if os.environ.get("OMP_WAIT_POLICY"):
        return f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
    if os.environ.get("GOMP_SPINCOUNT"):
        return f"GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}"
    return "OpenMP's default wait"


def _load_per_core() -> float:
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return load / max(cores or 1, 1)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's CPU ops inside the block on one thread (the count is restored after).

    For ops on tensors too small to share: single-stream decode attention is ~40 us of work
    split over 3 heads, and the fork/join costs about as much as it saves; when the second
    core is busy with another process the join waits for a whole scheduler slice (measured:
    8 ms instead of 50 us per call).
    """
    import torch

    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
