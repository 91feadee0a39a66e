"""Logits processors that depend on a request's own state: penalties, logit bias, min_tokens.

All three work on the whole batch at once: the rows that need a processor are gathered, the
per-row numbers become ``[R, 1]`` tensors, and the token histories become ``[R, vocab]``
count and presence tensors built with one ``scatter`` each, so a step costs a few tensor ops
whatever the batch size (no Python loop over the vocabulary).

Order, as vLLM's sampler: min_tokens mask and logit bias, then the penalties (on the biased
logits), then the sampler's temperature / min_p / top-k / top-p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvroom.engine.sched.output import ScheduledSeq


class TokenHistory:
    """The tokens of every penalised sequence, by position (prompt then output).

    The runner records each scheduled chunk before sampling, so at sampling time a sequence's
    list holds all ``prompt + output`` tokens. A preempted sequence recomputed from position 0
    rewrites the same tokens, so the history never needs to be told about preemption.
    """

    def __init__(self) -> None:
        self._tokens: dict[int, list[int]] = {}

    def record(self, seqs: Sequence[ScheduledSeq]) -> None:
        for s in seqs:
            if s.sampling.penalised:
                tokens = self._tokens.setdefault(s.seq_id, [])
                del tokens[s.start_pos :]
                tokens.extend(s.token_ids)

    def release(self, seq_id: int) -> None:
        self._tokens.pop(seq_id, None)

    def split(self, s: ScheduledSeq) -> tuple[list[int], list[int]]:
        """``(all tokens, output tokens)`` of a sequence about to sample."""
        tokens = self._tokens.get(s.seq_id, [])
        return tokens, tokens[len(tokens) - s.num_generated :] if s.num_generated else []


def process_logits(
    logits: torch.Tensor, seqs: Sequence[ScheduledSeq], history: TokenHistory
) -> torch.Tensor:
    """A copy of ``logits`` with min_tokens, logit bias and penalties applied per row."""
    x = logits.clone()
    _mask_early_stops(x, seqs)
    _add_logit_bias(x, seqs)
    rows = [i for i, s in enumerate(seqs) if s.sampling.penalised]
    if rows:
        _apply_penalties(x, rows, [seqs[i] for i in rows], history)
    return x


def _mask_early_stops(x: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> None:
    """Stop ids get -inf in rows that have generated fewer than ``min_tokens``."""
    vocab = x.shape[1]
    pairs = [
        (i, t)
        for i, s in enumerate(seqs)
        if s.num_generated < s.sampling.min_tokens
        for t in s.stop_token_ids
        if 0 <= t < vocab
    ]
    if pairs:
        rows, cols = zip(*pairs, strict=True)
        x[_long(rows, x), _long(cols, x)] = float("-inf")


def _add_logit_bias(x: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> None:
    vocab = x.shape[1]
    triples = [
        (i, t, b) for i, s in enumerate(seqs) for t, b in s.sampling.logit_bias if 0 <= t < vocab
    ]
    if triples:
        rows, cols, bias = zip(*triples, strict=True)
        values = torch.tensor(bias, dtype=x.dtype, device=x.device)
        x.index_put_((_long(rows, x), _long(cols, x)), values, accumulate=True)


def _apply_penalties(
    x: torch.Tensor, rows: list[int], seqs: list[ScheduledSeq], history: TokenHistory
) -> None:
    """vLLM's penalties on ``x[rows]``, in place.

    ``repetition``: a logit of a token seen in the prompt or output is divided by the penalty
    when positive, multiplied when not. ``frequency`` and ``presence`` subtract
    ``f * count + p * (count > 0)`` over the output tokens only.
    """
    vocab = x.shape[1]
    seen_ids, output_ids = zip(*(history.split(s) for s in seqs), strict=True)
    seen = _scatter_counts(seen_ids, vocab, x) > 0
    counts = _scatter_counts(output_ids, vocab, x)
    rep = _column([s.sampling.repetition_penalty for s in seqs], x)
    freq = _column([s.sampling.frequency_penalty for s in seqs], x)
    pres = _column([s.sampling.presence_penalty for s in seqs], x)
    index = _long(rows, x)
    sub = x[index]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    x[index] = sub - freq * counts - pres * (counts > 0).to(x.dtype)


def _scatter_counts(ids: Sequence[list[int]], vocab: int, x: torch.Tensor) -> torch.Tensor:
    """``[R, vocab]`` occurrence counts of each row's ids (padding goes to a spare column)."""
    width = max(1, max(len(row) for row in ids))
    padded = torch.tensor([row + [vocab] * (width - len(row)) for row in ids], device=x.device)
    counts = torch.zeros(len(ids), vocab + 1, dtype=x.dtype, device=x.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=x.dtype))
    return counts[:, :vocab]


def _column(values: list[float], x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=x.dtype, device=x.device)[:, None]


def _long(values: Sequence[int], x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=x.device)
