"""Hold the process under the plan's total between steps (CPU).

The plan's run peak is ``steady + the largest step's transients`` (``plan.measured``), with
the step transients measured from a trimmed heap. glibc keeps freed heap chunks resident and
returns none from the middle of the heap on its own, so a long run of varied step shapes
leaves more and more free pages resident: on a tiny Llama (1,024-token context, 32 sequences,
preemption) the resident set between steps crept 4 MB in 3,500 steps, and the run peaked
0.7% over the plan. A heap that has settled with a step's room to spare is harmless (its
steps reuse the free chunks and grow it by nothing); a heap that keeps growing is not.

So around each step the guard reads the resident set and its peak (``/proc/self/status``,
tens of microseconds) and trims the heap (``malloc_trim``) when the next step could take the
process past the plan's total: when ``resident + headroom > total``. ``headroom`` is the room
the plan sets aside for one step's transients (its largest step term), or the largest rise of
one step over the last ``window_steps`` steps that began from an untrimmed heap where that is
more (the step right after a trim re-faults its transients, which the plan's step term
counts). The plan's room is the floor because a step shape the last steps did not take can
still come: with the recent rises alone, a settled heap crept up to the total and the next
new shape took a tiny Gemma 3 run (2,048-token context) 0.4% past it. A step's rise is how
far it took the resident set, or its peak where the step set a new one: transients freed
before the step ended count too. When a trim leaves the process above the mark anyway (live
memory beyond the plan, such as a long request queue), it waits ``cooldown_steps`` before it
tries again: trimming then only costs page faults.

Steps that ran while the KV pool was still being faulted in (``KVCachePool.start_populating``
fills it on a background thread after the first step) set no headroom: their rise is the
pool's pages arriving, which the plan counts in full already (270 MB within one step on
SmolLM2, which put every later step over the mark and the guard into its cooldown).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from kvroom import heap

WINDOW_STEPS = 16
COOLDOWN_STEPS = 64


class Resident(NamedTuple):
    now_bytes: int
    """``VmRSS``."""
    peak_bytes: int
    """``VmHWM``: the most the process has held so far."""


def resident() -> Resident | None:
    """This process's resident set and its peak, or None where unreadable."""
    fields = heap.status_bytes("VmRSS", "VmHWM")
    if len(fields) < 2:
        return None
    return Resident(fields["VmRSS"], fields["VmHWM"])


class HeapGuard:
    """Trims the heap between steps when the next step could exceed ``total_bytes()``."""

    def __init__(
        self,
        total_bytes: Callable[[bool], int],
        step_bytes: int = 0,
        *,
        window_steps: int = WINDOW_STEPS,
        cooldown_steps: int = COOLDOWN_STEPS,
        read: Callable[[], Resident | None] = resident,
        trim: Callable[[], None] = heap.trim,
        settled: Callable[[], bool] = lambda: True,
    ) -> None:
        """
        Args:
            total_bytes: the plan's total for the pool as it is now, given whether the
                process serves HTTP (``kvroom serve`` holds the server's term too).
            step_bytes: the plan's room for one step's transients (its largest step term).
            window_steps: how many recent steps' growth sets the headroom.
            cooldown_steps: steps to wait after a trim that left the process above the mark.
            read: the resident set and its peak now (None: unknown, nothing is done).
            trim: returns the heap's free pages to the kernel.
            settled: whether the planned memory outside the heap is resident already (the
                CPU pool populated); a step begun before then sets no headroom.
        """
        self.total_bytes = total_bytes
        self.step_bytes = step_bytes
        self.cooldown_steps = cooldown_steps
        self.read = read
        self.trim = trim
        self.settled = settled
        self.serving = False
        self.num_trims = 0
        self._growth: deque[int] = deque(maxlen=window_steps)
        self._before: Resident | None = None
        self._settled_before = False
        self._after_trim = True  # the heap was trimmed after loading
        self._cooldown = 0

    def before_step(self) -> None:
        self._before = self.read()
        self._settled_before = self.settled()

    def after_step(self) -> None:
        after, before = self.read(), self._before
        if after is None or before is None:
            return
        if not self._after_trim and self._settled_before:
            self._growth.append(_rise(before, after))
        self._after_trim = False
        if self._cooldown:
            self._cooldown -= 1
            return
        headroom = max([self.step_bytes, *self._growth])
        mark = self.total_bytes(self.serving) - headroom
        if after.now_bytes <= mark:
            return
        self.trim()
        self.num_trims += 1
        self._after_trim = True
        now = self.read()
        if now is not None and now.now_bytes > mark:
            self._cooldown = self.cooldown_steps


def _rise(before: Resident, after: Resident) -> int:
    """How far a step took the process above where it began: to its end state, or to its
    peak where the step set a new one."""
    top = after.peak_bytes if after.peak_bytes > before.peak_bytes else after.now_bytes
    return max(top - before.now_bytes, 0)
