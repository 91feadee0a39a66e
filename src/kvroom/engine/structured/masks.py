"""Structured outputs in the engine step: one grammar matcher per sequence, one bitmask per step.

The runner calls three verbs around its forward pass::

    masks = structured.begin(seqs)      # before the forward: fill starts on a worker thread
    logits = model(...)                 #   (xgrammar fills in C++ while torch runs)
    structured.apply(masks, logits)     # wait for the fill; masked logits -> -inf, in place
    tokens = sampler.sample_step(...)
    structured.accept(masks, tokens)    # each matcher advances by its sequence's token

Rows of the bitmask are rows of the logits (the sequences that sample, in the runner's order);
only the rows of constrained sequences are filled and applied, so a step with none of them
costs one attribute check per sequence, and unconstrained rows are never touched.

Invariant: a live matcher has accepted exactly the sequence's generated tokens
(``num_accepted == num_generated`` when its sequence next samples). A preempted sequence keeps
its output tokens and is recomputed from them, so its matcher stays valid; a matcher that is
ahead (tokens dropped) is rolled back. Once the grammar is complete the mask allows only the
stop tokens, so the sequence ends with EOS, and the scheduler finishes it. A matcher that
rejects a token (only possible if every allowed token was masked by something else) is left
alone and its row allows only the stop tokens from then on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvroom.engine.sched.output import ScheduledSeq
from kvroom.engine.structured.grammar import GrammarCompiler

logger = logging.getLogger("kvroom")


@dataclass
class _Matcher:
    matcher: Any
    """An ``xgrammar.GrammarMatcher``."""
    num_accepted: int = 0
    failed: bool = False
    """It rejected a token: from then on only a stop token may follow."""


@dataclass
class StepMasks:
    """The bitmask fill of one step, in flight on the worker thread."""

    rows: list[int]
    """Logits rows of the constrained sequences."""
    matchers: list[_Matcher]
    bitmask: torch.Tensor
    """int32 ``[num rows, ceil(vocab / 32)]`` on the CPU; bit set = token allowed."""
    done: Future[None]


class StructuredOutputs:
    """Grammar matchers of the live constrained sequences, and their per-step masks."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[int, _Matcher] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvroom-grammar")
        self._bitmask = torch.empty(0)
        self._batch: Any = None
        self.fill_seconds = 0.0
        """Time spent filling masks (on the worker thread, mostly under the forward)."""
        self.wait_seconds = 0.0
        """Time ``apply`` waited for a fill: the part the forward did not hide."""

    def begin(self, seqs: Sequence[ScheduledSeq]) -> StepMasks | None:
        """Start filling the masks of the constrained ``seqs`` (row ``i`` is ``seqs[i]``).

        Returns:
            The fill in flight, or None when no sequence of the step is constrained.
        """
        rows = [i for i, s in enumerate(seqs) if s.sampling.structured_outputs is not None]
        if not rows:
            return None
        matchers = [self._matcher(seqs[i]) for i in rows]
        bitmask = self._buffer(len(seqs))
        done = self._executor.submit(self._fill, matchers, bitmask, rows)
        return StepMasks(rows, matchers, bitmask, done)

    def apply(self, masks: StepMasks, logits: torch.Tensor) -> None:
        """Wait for the fill, then set disallowed logits of the constrained rows to -inf."""
        import xgrammar as xgr

        start = time.perf_counter()
        masks.done.result()
        self.wait_seconds += time.perf_counter() - start
        bitmask = masks.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.compiler.vocab_size, indices=masks.rows
        )

    def accept(self, masks: StepMasks, tokens: Sequence[int]) -> None:
        """Advance each constrained sequence's matcher by the token it sampled."""
        for row, m in zip(masks.rows, masks.matchers, strict=True):
            if not m.failed and not m.matcher.accept_token(tokens[row]):
                logger.error("grammar rejected sampled token %d; ending the output", tokens[row])
                m.failed = True
            m.num_accepted += 1

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence's matcher."""
        self._matchers.pop(seq_id, None)

    @property
    def num_live(self) -> int:
        """Matchers held (one per live constrained sequence)."""
        return len(self._matchers)

    def _matcher(self, seq: ScheduledSeq) -> _Matcher:
        """The sequence's matcher, created on first sight, rolled back if it is ahead."""
        m = self._matchers.get(seq.seq_id)
        if m is None:
            import xgrammar as xgr

            assert seq.sampling.structured_outputs is not None
            grammar = self.compiler.compile(seq.sampling.structured_outputs)
            m = self._matchers[seq.seq_id] = _Matcher(xgr.GrammarMatcher(grammar))
        ahead = m.num_accepted - seq.num_generated
        assert ahead >= 0, f"seq {seq.seq_id}: matcher behind its tokens by {-ahead}"
        if ahead:
            m.matcher.rollback(ahead)
            m.num_accepted = seq.num_generated
        return m

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The reused CPU bitmask, grown to ``num_rows`` rows."""
        if self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(num_rows, self.compiler.vocab_size)
        return self._bitmask[:num_rows]

    def _fill(self, matchers: list[_Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill the rows of live matchers in one batched call; stop-only rows by hand."""
        import xgrammar as xgr

        start = time.perf_counter()
        live = [(m, r) for m, r in zip(matchers, rows, strict=True) if _is_live(m)]
        if live:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=1)
            self._batch.batch_fill_next_token_bitmask(
                [m.matcher for m, _ in live], bitmask, [r for _, r in live]
            )
        for m, row in zip(matchers, rows, strict=True):
            if not _is_live(m):
                _allow_only(bitmask[row], m.matcher.stop_token_ids)
        self.fill_seconds += time.perf_counter() - start


def _is_live(m: _Matcher) -> bool:
    return not m.failed and not m.matcher.is_terminated()


def _allow_only(row: torch.Tensor, token_ids: Sequence[int]) -> None:
    """Set a bitmask row to allow exactly ``token_ids`` (bit ``t % 32`` of word ``t // 32``)."""
    row.zero_()
    for t in token_ids:
        word = int(row[t // 32]) | (1 << (t % 32))
        row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word
