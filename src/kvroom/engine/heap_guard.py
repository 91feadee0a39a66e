"""Hold the process under the plan's total between steps (CPU).

The plan's run peak is ``steady + the largest step's transients`` (``plan.measured``), with
the step transients measured from a trimmed heap. glibc keeps freed heap chunks resident and
returns none from the middle of the heap on its own, so a long run of varied step shapes
leaves more and more free pages resident: on a tiny Llama (1,024-token context, 32 sequences,
preemption) the resident set between steps crept 4 MB in 3,500 steps, and the run peaked
0.7% over the plan. A heap that has settled is harmless (its steps reuse the free chunks and
grow it by nothing); a heap that keeps growing is not.

So after each step the guard reads the resident set (``/proc/self/statm``, about 10 us) and
trims the heap (``malloc_trim``) when the next step could take the process past the plan's
total: when ``resident + headroom > total``, with ``headroom`` the largest growth of one step
over the last ``window_steps`` steps that began from an untrimmed heap (the step right after
a trim re-faults its transients, which the plan's step term counts). When a trim leaves the
process above the mark anyway (live memory beyond the plan, such as a long request queue),
it waits ``cooldown_steps`` before it tries again: trimming then only costs page faults.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

from kvroom import heap

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
STATM = "/proc/self/statm"
WINDOW_STEPS = 16
COOLDOWN_STEPS = 64


def resident_bytes() -> int | None:
    """This process's resident set (``statm``'s second field), or None where unreadable."""
    try:
        with open(STATM, "rb") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


class HeapGuard:
    """Trims the heap between steps when the next step could exceed ``total_bytes()``."""

    def __init__(
        self,
        total_bytes: Callable[[bool], int],
        *,
        window_steps: int = WINDOW_STEPS,
        cooldown_steps: int = COOLDOWN_STEPS,
        read: Callable[[], int | None] = resident_bytes,
        trim: Callable[[], None] = heap.trim,
    ) -> None:
        """
        Args:
            total_bytes: the plan's total for the pool as it is now, given whether the
                process serves HTTP (``kvroom serve`` holds the server's term too).
            window_steps: how many recent steps' growth sets the headroom.
            cooldown_steps: steps to wait after a trim that left the process above the mark.
            read: the resident set now (None: unknown, nothing is done).
            trim: returns the heap's free pages to the kernel.
        """
        self.total_bytes = total_bytes
        self.cooldown_steps = cooldown_steps
        self.read = read
        self.trim = trim
        self.serving = False
        self.num_trims = 0
        self._growth: deque[int] = deque(maxlen=window_steps)
        self._before: int | None = None
        self._after_trim = True  # the heap was trimmed after loading
        self._cooldown = 0

    def before_step(self) -> None:
        self._before = self.read()

    def after_step(self) -> None:
        after = self.read()
        if after is None or self._before is None:
            return
        if not self._after_trim:
            self._growth.append(max(after - self._before, 0))
        self._after_trim = False
        if self._cooldown:
            self._cooldown -= 1
            return
        mark = self.total_bytes(self.serving) - max(self._growth, default=0)
        if after <= mark:
            return
        self.trim()
        self.num_trims += 1
        self._after_trim = True
        now = self.read()
        if now is not None and now > mark:
            self._cooldown = self.cooldown_steps
