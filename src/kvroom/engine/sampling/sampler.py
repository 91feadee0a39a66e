"""Batched next-token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds.

Order of the transforms (as vLLM): min_tokens / logit bias / penalties (``penalties.py``) ->
greedy argmax, or temperature -> min_p -> top-k -> top-p -> sample. Logprobs are computed from
the logits as they came in (``logprobs.py``).

Reproducibility. A seeded request samples token ``k`` (``k`` = tokens generated so far) from a
generator seeded with ``mix(seed, k)``. Its output therefore depends only on its own logits,
not on what it was batched with, and a preempted request that is recomputed draws the same
tokens again. The generators are kept per ``seq_id`` so a step allocates none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sampling.logprobs import token_logprobs
from kvroom.engine.sampling.penalties import TokenHistory, process_logits
from kvroom.engine.sched.output import ScheduledSeq, TokenLogprobs

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """SplitMix64 of ``(seed, step)``: neighbouring seeds and steps give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    """Samples one token per logits row; owns the per-sequence generators."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._generators: dict[int, torch.Generator] = {}
        self._unseeded = torch.Generator(device=self.device)
        self._unseeded.seed()
        self.history = TokenHistory()
        """Tokens of penalised sequences; the runner records every scheduled chunk."""

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence's generator and history."""
        self._generators.pop(seq_id, None)
        self.history.release(seq_id)

    def sample_step(
        self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]
    ) -> tuple[list[int], dict[int, TokenLogprobs]]:
        """Next token of each sequence (row ``i`` of ``logits`` is ``seqs[i]``'s last position).

        Returns:
            The tokens, and ``seq_id -> logprobs`` for the sequences whose params ask.
        """
        params = [s.sampling for s in seqs]
        x = logits
        if any(p.processes_logits for p in params):
            x = process_logits(logits, seqs, self.history)
        tokens = self._sample(x, params, [s.seq_id for s in seqs], [s.num_generated for s in seqs])
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return tokens.tolist(), {}
        index = torch.tensor(rows, device=logits.device)
        num_top = [params[i].logprobs or 0 for i in rows]
        found = token_logprobs(logits[index], tokens[index], num_top)
        return tokens.tolist(), {seqs[i].seq_id: lp for i, lp in zip(rows, found, strict=True)}

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seq_ids: Sequence[int],
        num_generated: Sequence[int],
    ) -> list[int]:
        """Next token of each row.

        Args:
            logits: ``[N, vocab]`` float32 logits, one row per sequence.
            params: per row, how to sample.
            seq_ids: per row, the sequence (keys its generator).
            num_generated: per row, tokens the sequence has generated so far.

        Returns:
            N token ids, as Python ints (the step's one host sync).
        """
        return self._sample(logits, params, seq_ids, num_generated).tolist()

    def _sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seq_ids: Sequence[int],
        num_generated: Sequence[int],
    ) -> torch.Tensor:
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)
        if len(params) <= SAMPLE_ROWS:
            return self._sample_rows(logits, params, seq_ids, num_generated)
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        for start in range(0, len(params), SAMPLE_ROWS):
            part = slice(start, start + SAMPLE_ROWS)
            tokens[part] = self._sample_rows(
                logits[part], params[part], seq_ids[part], num_generated[part]
            )
        return tokens

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seq_ids: Sequence[int],
        num_generated: Sequence[int],
    ) -> torch.Tensor:
        probs = filtered_probs(logits, params)
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            tokens[rows] = logits[rows].argmax(dim=-1)
        free = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
        if free:
            rows = torch.tensor(free, device=logits.device)
            tokens[rows] = torch.multinomial(probs[rows], 1, generator=self._unseeded)[:, 0]
        for i, p in enumerate(params):
            if not p.greedy and p.seed is not None:
                gen = self._generator(seq_ids[i], mix_seed(p.seed, num_generated[i]))
                tokens[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return tokens

    def _generator(self, seq_id: int, seed: int) -> torch.Generator:
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = self._generators[seq_id] = torch.Generator(device=self.device)
        return gen.manual_seed(seed)


SAMPLE_ROWS = 4
"""Rows filtered and sampled together. Top-p sorts the whole vocabulary, and its buffers
(values, int64 order, softmax, cumsum, masks) for a 32-row decode over SmolLM2's 49,152
tokens were that step's largest transient, about 50 MB; 4 rows at a time hold an eighth,
sorting the same rows."""


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p (greedy rows come out unfiltered)."""
    temps = [1.0 if p.greedy else p.temperature for p in params]
    x = logits / torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]
    min_ps = [0.0 if p.greedy else p.min_p for p in params]
    if any(min_ps):
        x = _min_p(x, min_ps)
    ks = [p.top_k if p.top_k > 0 and not p.greedy else 0 for p in params]
    if any(ks):
        x = _top_k(x, ks)
    top_ps = [1.0 if p.greedy else p.top_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        x = _top_p(x, top_ps)
    return x.softmax(dim=-1)


def _min_p(x: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token."""
    probs = x.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_ps, device=x.device)[:, None]
    return x.masked_fill(probs < floor, float("-inf"))


def _top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keep logits >= the k-th largest of their row (ties at the threshold kept, as HF)."""
    vocab = x.shape[-1]
    k_eff = [min(k, vocab) if k else vocab for k in ks]
    top = x.topk(max(k_eff), dim=-1).values
    idx = torch.tensor([k - 1 for k in k_eff], device=x.device)[:, None]
    threshold = top.gather(1, idx)
    return x.masked_fill(x < threshold, float("-inf"))


def _top_p(x: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``.

    Sorted ascending, a token is dropped when the mass of it and everything less likely is
    ``<= 1 - top_p``; the most likely token is always kept.
    """
    sorted_x, order = x.sort(dim=-1)
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    limit = 1.0 - torch.tensor(top_ps, dtype=cum.dtype, device=x.device)[:, None]
    drop = cum <= limit
    drop[:, -1] = False
    return x.masked_fill(drop.scatter(1, order, drop), float("-inf"))
