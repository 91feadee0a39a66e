"""The heap guard trims only when the next step could pass the plan's total."""

from __future__ import annotations

from kvroom.engine.kv.heap_guard import HeapGuard, Resident, resident


class _Process:
    """A resident set that steps grow and trims bring back to ``trimmed``."""

    def __init__(self, resident: int, trimmed: int = 100) -> None:
        self.resident = resident
        self.peak = resident
        self.trimmed = trimmed
        self.trims = 0

    def read(self) -> Resident:
        self.peak = max(self.peak, self.resident)
        return Resident(self.resident, self.peak)

    def trim(self) -> None:
        self.trims += 1
        self.resident = self.trimmed


def _guard(process: _Process, step_bytes: int = 0, **kwargs: int) -> HeapGuard:
    totals = {False: 200, True: 300}
    return HeapGuard(
        lambda serving: totals[serving],
        step_bytes,
        read=process.read,
        trim=process.trim,
        **kwargs,
    )


def _step(guard: HeapGuard, process: _Process, growth: int, transient: int = 0) -> None:
    guard.before_step()
    process.resident += growth + transient
    process.read()  # the step's peak
    process.resident -= transient
    guard.after_step()


def test_a_settled_heap_below_the_total_is_left_alone() -> None:
    process = _Process(150)
    guard = _guard(process)
    for _ in range(50):
        _step(guard, process, 0)
    assert process.trims == 0


def test_trims_when_the_last_steps_growth_would_pass_the_total() -> None:
    process = _Process(150)
    guard = _guard(process)
    _step(guard, process, 10)  # right after loading: not counted as growth
    _step(guard, process, 10)  # 170, headroom 10: 180 <= 200
    _step(guard, process, 10)  # 180 + 10 = 190
    assert process.trims == 0
    _step(guard, process, 15)  # 195 + 15 > 200
    assert process.trims == 1 and process.resident == 100


def test_keeps_the_plans_step_room_free_even_when_recent_steps_rose_less() -> None:
    process = _Process(150)
    guard = _guard(process, step_bytes=30)
    _step(guard, process, 0)
    _step(guard, process, 10)  # 160 + max(30, 10) <= 200
    _step(guard, process, 10)  # 170 + 30 <= 200
    assert process.trims == 0
    _step(guard, process, 5)  # 175 + 30 > 200, though no step rose more than 10
    assert process.trims == 1 and process.resident == 100


def test_recent_growth_above_the_step_room_widens_the_headroom() -> None:
    process = _Process(150)
    guard = _guard(process, step_bytes=5)
    _step(guard, process, 0)
    _step(guard, process, 20)  # 170 + 20 <= 200
    assert process.trims == 0
    _step(guard, process, 15)  # 185 + 20 > 200
    assert process.trims == 1


def test_a_transient_that_sets_a_new_peak_counts_as_headroom() -> None:
    process = _Process(150)
    guard = _guard(process)
    _step(guard, process, 0)
    _step(guard, process, 5, transient=20)  # peak 175: rise 25, ends at 155
    assert process.trims == 0
    _step(guard, process, 25)  # 180 + 25 > 200
    assert process.trims == 1


def test_a_transient_below_an_earlier_peak_is_not_seen() -> None:
    process = _Process(150)
    guard = _guard(process)
    _step(guard, process, 0, transient=40)  # peak 190, right after loading
    _step(guard, process, 0, transient=30)  # under the peak: rise 0
    _step(guard, process, 45)  # 195, headroom 45: trimmed
    assert process.trims == 1


def test_growth_right_after_a_trim_sets_no_headroom() -> None:
    process = _Process(150)
    guard = _guard(process)
    _step(guard, process, 0)
    _step(guard, process, 60)  # 210 > 200: trimmed to 100
    _step(guard, process, 80)  # the re-fault after the trim: 180, headroom stays 60
    assert process.trims == 2  # 180 + 60 > 200
    _step(guard, process, 80)  # after a trim again
    assert process.trims == 3


def test_cooldown_when_a_trim_cannot_bring_the_process_under() -> None:
    process = _Process(250, trimmed=240)
    guard = _guard(process, cooldown_steps=5)
    _step(guard, process, 0)
    assert process.trims == 1
    for _ in range(5):
        _step(guard, process, 0)
    assert process.trims == 1
    _step(guard, process, 0)
    assert process.trims == 2


def test_steps_while_the_pool_is_faulted_in_set_no_headroom() -> None:
    process = _Process(150)
    populated = [False]
    guard = HeapGuard(
        lambda serving: 200, read=process.read, trim=process.trim, settled=lambda: populated[0]
    )
    _step(guard, process, 0)
    _step(guard, process, 40)  # the pool's pages arriving: 190, no headroom from it
    _step(guard, process, 0)
    assert process.trims == 0
    populated[0] = True
    _step(guard, process, 0)
    _step(guard, process, 5)  # a settled step's rise counts: 195 + 5 <= 200
    assert process.trims == 0
    _step(guard, process, 6)  # 201 > 200: trimmed
    assert process.trims == 1


def test_serving_uses_the_servers_total() -> None:
    process = _Process(250)
    guard = _guard(process)
    guard.serving = True
    for _ in range(3):
        _step(guard, process, 0)
    assert process.trims == 0


def test_unknown_resident_set_does_nothing() -> None:
    process = _Process(10**9)
    guard = HeapGuard(lambda serving: 1, read=lambda: None, trim=process.trim)
    _step(guard, process, 0)
    assert process.trims == 0


def test_resident_reads_this_process() -> None:
    now = resident()
    assert now is not None and now.peak_bytes >= now.now_bytes > 1 << 20
