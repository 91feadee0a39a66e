"""vLLM's ``prompt_logprobs``: the logprob of every prompt token given the tokens before it.

Only sequences that ask pay for it: the runner hands this module the hidden states of their
prompt chunks, and logits are computed for those rows only, ``ROWS_PER_PASS`` at a time so a
long prompt never holds a ``[prompt_len, vocab]`` tensor. Row ``j`` of a chunk (position
``p = start_pos + j``) predicts the token at ``p + 1``::

    chunk k:    positions s ... s+n-1      row j scores token_ids[j+1]
    last row:   scores the first token of chunk k+1, not known yet: its log-softmax row is
                kept until that chunk arrives (a final chunk's last row predicts the first
                generated token, which is the sampler's business)

A preempted sequence is recomputed from position 0 and reports the same positions again; the
engine keeps the first report of each position. Position 0 has no logprob (None in outputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvroom.engine.sampling.logprobs import token_logprobs
from kvroom.engine.sched.output import ScheduledSeq, TokenLogprobs

ROWS_PER_PASS = 256
"""Prompt rows whose logits are materialised at once."""

Found = dict[int, list[tuple[int, TokenLogprobs]]]


def wants_prompt_logprobs(s: ScheduledSeq) -> bool:
    """A prompt chunk of a sequence that asks (a recompute after output exists does not)."""
    return s.sampling.prompt_logprobs is not None and s.num_generated == 0


class PromptLogprobs:
    """Scores the prompt chunks of the sequences that ask for prompt logprobs."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}
        """seq_id -> (position, raw logits row) of a chunk's last row, awaiting its target."""

    def release(self, seq_id: int) -> None:
        self._pending.pop(seq_id, None)

    def compute(
        self,
        seqs: Sequence[ScheduledSeq],
        hidden: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> Found:
        """Prompt logprobs for this step's chunks; ``seqs`` in packed order over ``hidden``."""
        found: Found = {}
        offset = 0
        for s in seqs:
            n = len(s.token_ids)
            if wants_prompt_logprobs(s):
                rows = hidden[offset : offset + n]
                found[s.seq_id] = self._score_chunk(s, rows, compute_logits)
            offset += n
        return found

    def _score_chunk(
        self,
        s: ScheduledSeq,
        rows: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[tuple[int, TokenLogprobs]]:
        k = s.sampling.prompt_logprobs or 0
        out: list[tuple[int, TokenLogprobs]] = []
        pending = self._pending.pop(s.seq_id, None)
        if pending is not None and pending[0] == s.start_pos - 1:
            target = torch.tensor([s.token_ids[0]], device=rows.device)
            out.append((s.start_pos, token_logprobs(pending[1], target, [k])[0]))
        targets = torch.tensor(s.token_ids[1:], dtype=torch.long, device=rows.device)
        for lo in range(0, len(s.token_ids) - 1, ROWS_PER_PASS):
            hi = min(lo + ROWS_PER_PASS, len(s.token_ids) - 1)
            logits = compute_logits(rows[lo:hi])
            found = token_logprobs(logits, targets[lo:hi], [k] * (hi - lo))
            out.extend((s.start_pos + 1 + lo + i, lp) for i, lp in enumerate(found))
        if not s.needs_sample:
            last = s.start_pos + len(s.token_ids) - 1
            self._pending[s.seq_id] = (last, compute_logits(rows[-1:]))
        return out
