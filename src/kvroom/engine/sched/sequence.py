"""One request's tokens and lifecycle state (torch-free).

Lifecycle (every arrow goes through ``Sequence._set_status``, the one place status changes)::

    WAITING ──admit──> RUNNING ──stop token / EOS──> FINISHED_STOPPED
       │                │  │ ───max_tokens────────> FINISHED_LENGTH
       │                │  └──preempt──> PREEMPTED ──admit──> RUNNING
       └──abort──> FINISHED_ABORTED <──abort── (RUNNING or PREEMPTED)

PREEMPTED is a waiting state, kept apart from WAITING so that logs, metrics and tests can see
that the sequence lost its KV and will be recomputed from ``prompt + output`` tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from kvroom.engine.params.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(Enum):
    WAITING = "waiting"
    """Queued, never admitted; holds no blocks."""
    RUNNING = "running"
    """Admitted: holds blocks (and a sliding slot), possibly still mid-prefill."""
    PREEMPTED = "preempted"
    """Back in the waiting queue after losing its blocks; recomputed on re-admission."""
    FINISHED_STOPPED = "finished_stopped"
    """Ended by EOS, a stop token id, or a stop string (the engine decides the last)."""
    FINISHED_LENGTH = "finished_length"
    """Ended because ``max_tokens`` tokens were generated."""
    FINISHED_ABORTED = "finished_aborted"
    """Cancelled by the client."""

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """The OpenAI-style reason, or None while the sequence is still live."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[SequenceStatus, FinishReason] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}

_S = SequenceStatus
_ALLOWED: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
    _S.RUNNING: frozenset(
        {_S.PREEMPTED, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH, _S.FINISHED_ABORTED}
    ),
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
    _S.FINISHED_STOPPED: frozenset(),
    _S.FINISHED_LENGTH: frozenset(),
    _S.FINISHED_ABORTED: frozenset(),
}
"""The state machine: a transition not listed here is a kvroom bug."""


@dataclass(eq=False)
class Sequence:
    """A request as the scheduler sees it: token ids, progress, and where its KV lives.

    Token layout (``T = num_tokens``, ``C = num_computed_tokens``)::

        all_token_ids:  prompt_token_ids ........ | output_token_ids ...........
        index:          0 ............................ C-1 | C ............ T-1
                        KV in the pool (block_table)       | still to compute

    A decoding sequence has ``C == T - 1``: its last sampled token is fed next step. After a
    preemption ``C`` drops to 0 and the whole ``prompt + output`` is prefilled again.
    """

    seq_id: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    """End-of-sequence ids of the model; ignored when ``params.ignore_eos``."""
    arrival_time: float = field(default_factory=time.monotonic)
    """When the request arrived (monotonic seconds), for latency metrics. Arrival *order* is
    the scheduler's FIFO waiting queue; admission order is its running list."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the pool; advanced by the scheduler after each step."""
    block_table: tuple[int, ...] = ()
    """Mirror of the block manager's table, refreshed by the scheduler after each allocation."""
    multimodal: object | None = None
    """Images etc. of the prompt, data for the model (the engine never looks inside)."""
    sliding_slot: int | None = None
    """Fixed sliding-window slot while RUNNING (hybrid models only), else None."""
    status: SequenceStatus = SequenceStatus.WAITING
    """Read freely; changed only through the transition methods below."""

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        self.eos_token_ids = frozenset(self.eos_token_ids)

    # -- derived -----------------------------------------------------------------------

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)

    @property
    def max_len(self) -> int:
        """The longest this sequence can grow: prompt plus ``max_tokens``."""
        return self.prompt_len + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: ``params.stop_token_ids`` plus EOS unless ignored."""
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        return eos | frozenset(self.params.stop_token_ids)

    def stop_status(self) -> SequenceStatus | None:
        """Which finished state the last generated token leads to, or None to keep going.

        A stop token wins over the length limit when both hold, as in vLLM.
        """
        if self.output_token_ids and self.output_token_ids[-1] in self.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    # -- transitions ---------------------------------------------------------------------

    def admit(self) -> None:
        """WAITING/PREEMPTED -> RUNNING (the scheduler then records its blocks)."""
        self._set_status(SequenceStatus.RUNNING)

    def preempt(self) -> None:
        """RUNNING -> PREEMPTED: the KV is gone, so progress restarts at token 0."""
        self._set_status(SequenceStatus.PREEMPTED)
        self._drop_kv()

    def finish(self, status: SequenceStatus) -> None:
        """Enter a finished state; the caller has already returned the blocks."""
        assert status.is_finished, f"finish() needs a finished status, got {status}"
        self._set_status(status)
        self._drop_kv()

    def _drop_kv(self) -> None:
        self.num_computed_tokens = 0
        self.block_table = ()
        self.sliding_slot = None

    def _set_status(self, new: SequenceStatus) -> None:
        assert new in _ALLOWED[self.status], f"seq {self.seq_id}: {self.status} -> {new}"
        self.status = new
