"""The heap guard trims only above the plan's steady state, at most once per interval."""

from __future__ import annotations

from kvroom.engine.heap_guard import HeapGuard, resident_bytes


class _Process:
    def __init__(self, resident: int) -> None:
        self.resident = resident
        self.trims = 0

    def trim(self) -> None:
        self.trims += 1
        self.resident = 100


def _guard(process: _Process, interval: int = 4) -> HeapGuard:
    marks = {False: 150, True: 250}
    return HeapGuard(
        lambda serving: marks[serving],
        min_interval_steps=interval,
        read=lambda: process.resident,
        trim=process.trim,
    )


def test_no_trim_at_or_below_the_steady_state() -> None:
    process = _Process(150)
    guard = _guard(process)
    for _ in range(20):
        guard.after_step()
    assert process.trims == 0


def test_trims_when_above_and_waits_the_interval_before_the_next() -> None:
    process = _Process(200)
    guard = _guard(process, interval=4)
    guard.after_step()
    assert (process.trims, process.resident) == (1, 100)
    process.resident = 200
    for _ in range(3):
        guard.after_step()
    assert process.trims == 1
    guard.after_step()
    assert process.trims == 2
    assert guard.num_trims == 2


def test_serving_uses_the_servers_mark() -> None:
    process = _Process(200)
    guard = _guard(process)
    guard.serving = True
    guard.after_step()
    assert process.trims == 0


def test_unknown_resident_set_does_nothing() -> None:
    process = _Process(10**9)
    guard = HeapGuard(lambda serving: 1, read=lambda: None, trim=process.trim)
    guard.after_step()
    assert process.trims == 0


def test_resident_bytes_reads_this_process() -> None:
    resident = resident_bytes()
    assert resident is not None and resident > 1 << 20
