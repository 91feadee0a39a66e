"""The scheduler -> model runner contract: what to compute in one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroom.engine.params.sampling import SamplingParams


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of an engine step.

    Token layout of a sequence (``p`` = position)::

        p:  0 ........ start_pos-1 | start_pos ... start_pos+len(token_ids)-1 | ...
            KV already in the pool | computed this step (KV written here)      | not yet
    """

    seq_id: int
    token_ids: tuple[int, ...]
    """Tokens to run this step: a prompt chunk, or the single last token when decoding."""
    start_pos: int
    """Position of ``token_ids[0]``; equals the number of tokens whose KV is already cached."""
    block_table: tuple[int, ...]
    """Physical block ids of the full-attention pool; position p lives in block p // block_size."""
    sliding_slot: int | None
    """Index of this sequence's fixed sliding-window slot (hybrid models), else None."""
    needs_sample: bool
    """This step reaches the sequence's last known token, so a next token is sampled."""
    sampling: SamplingParams
    """How to sample; ``sampling.seed`` seeds a per-sequence generator kept by the runner."""
    num_generated: int = 0
    """Tokens generated so far (a recomputed preempted sequence keeps its count)."""
    stop_token_ids: frozenset[int] = frozenset()
    """EOS and stop ids the sampler masks while ``num_generated < sampling.min_tokens``
    (set only when ``min_tokens`` is)."""
    multimodal: object | None = None
    """The sequence's images etc. (``models.multimodal.MultimodalInputs``), passed to the
    model with every chunk; the scheduler and the runner never look inside."""


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner computes in one step, and what the scheduler did to get there."""

    seqs: tuple[ScheduledSeq, ...]
    """Sequences to run, decodes first, then prefill chunks."""
    preempted_seq_ids: tuple[int, ...] = field(default=())
    """Sequences whose blocks were freed this step; they are recomputed later."""
    block_copies: tuple[tuple[int, int], ...] = field(default=())
    """Copy-on-write ``(src, dst)`` block K/V copies to run before this step's forward; every
    src is read before any dst is written (a shared block one sequence is about to write)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's logprob under the raw model output, and the most likely alternatives."""

    token_id: int
    logprob: float
    rank: int
    """1 for the most likely token of its position."""
    top: tuple[tuple[int, float], ...] = ()
    """``(token_id, logprob)`` of the k most likely tokens, most likely first."""


class StepResult(dict[int, int]):
    """``seq_id -> sampled token`` (what the scheduler records), plus what requests asked for.

    A ``dict`` so that a runner may return a plain one (test fakes do); the extras are empty.
    """

    def __init__(
        self,
        tokens: dict[int, int],
        logprobs: dict[int, TokenLogprobs] | None = None,
        prompt_logprobs: dict[int, list[tuple[int, TokenLogprobs]]] | None = None,
    ) -> None:
        super().__init__(tokens)
        self.logprobs = logprobs or {}
        """seq_id -> the sampled token's logprobs, for sequences whose params ask."""
        self.prompt_logprobs = prompt_logprobs or {}
        """seq_id -> ``(position, logprobs)`` of prompt tokens computed this step."""
