"""The engine step: ``schedule() -> execute() -> update()``, plus requests, text and stats.

The scheduler knows only token ids, so everything about text lives here: detokenizing the
output, finding stop strings, and holding back a tail that might still become one (so streamed
text never has to be taken back).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvroom.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from kvroom.engine.output import SchedulerOutput
from kvroom.engine.sampling import SamplingParams
from kvroom.engine.scheduler import Scheduler
from kvroom.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvroom.errors import AdmissionError


class Runner(Protocol):
    """What the engine needs from a model runner (``ModelRunner`` or a test fake)."""

    def execute(self, output: SchedulerOutput) -> dict[int, int]:
        """Compute ``output``; return seq_id -> sampled token for each seq with needs_sample."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget per-sequence state (its RNG). Called once per finished or aborted seq,
        including ones that never ran; never called on preemption."""
        ...


@dataclass(frozen=True)
class RequestOutput:
    """What one request gained in one step (streaming unit of the server and ``LLM``)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    """Tokens generated this step (empty for an abort)."""
    output_token_ids: tuple[int, ...]
    """Every token generated so far."""
    text: str | None
    """Output text so far (None without a detokenizer). While unfinished it omits a tail that
    may still grow into a stop string, so each step's text extends the previous one."""
    finished: bool
    finish_reason: FinishReason | None
    """'stop' (EOS, stop token, stop string), 'length' (max_tokens) or 'abort'."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics (gauges and counters)."""

    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_prompt_tokens_total: int
    """Prompt tokens of requests that produced their first token (counted once each)."""
    num_generation_tokens_total: int


@dataclass
class _Request:
    request_id: str
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    num_emitted: int = 0
    """Output tokens already returned in a ``RequestOutput``."""
    text: str = ""
    """Detokenized output, cut before a stop string once one is found."""
    num_checked_chars: int = 0
    """Prefix of ``text`` already searched for stop strings (and stable)."""
    stopped_by_string: bool = False


class LLMEngine:
    """Turns requests into streamed outputs over a scheduler and a runner."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        eos_token_ids: set[int],
        detokenize: Callable[[list[int]], str] | None,
    ) -> None:
        """
        Args:
            scheduler: decides each step's tokens; owns the block manager.
            runner: computes a step and samples (see ``Runner``).
            eos_token_ids: the model's end-of-sequence ids.
            detokenize: token ids -> text; needed for ``text`` and for stop strings.
        """
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._pending: list[RequestOutput] = []  # abort outputs, returned by the next step()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    def add_request(
        self,
        prompt_token_ids: Iterable[int],
        params: SamplingParams,
        request_id: str | None = None,
        multimodal: object | None = None,
    ) -> str:
        """Queue a request (``multimodal``: the prompt's images, as the model prepared them).

        Returns:
            The request id (``request_id``, or a fresh one).

        Raises:
            AdmissionError: duplicate live id, stop strings without a detokenizer, or any
                scheduler rejection (empty, too long, larger than the pool).
        """
        seq_id = next(self._ids)
        request_id = str(seq_id) if request_id is None else request_id
        if request_id in self._requests:
            raise AdmissionError(f"request {request_id!r}: this id is already in flight")
        if params.stop and self.detokenize is None:
            raise AdmissionError(
                f"request {request_id!r}: stop strings {params.stop!r} need a detokenizer; "
                "pass detokenize= to LLMEngine or drop SamplingParams.stop"
            )
        seq = Sequence(
            seq_id, tuple(prompt_token_ids), params, self.eos_token_ids, multimodal=multimodal
        )
        self.scheduler.add(seq)
        detokenizer = IncrementalDetokenizer(self.detokenize) if self.detokenize else None
        request = _Request(request_id, seq, detokenizer)
        self._requests[request_id] = request
        self._by_seq[seq_id] = request
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request in any state; its final output comes from the next ``step()``.

        Returns:
            True if it was live, False if it is unknown or already finished.
        """
        request = self._requests.get(request_id)
        if request is None:
            return False
        self.scheduler.abort(request.seq.seq_id)
        self._pending.append(self._output(request, ()))
        self._retire(request)
        return True

    def step(self) -> list[RequestOutput]:
        """Run one engine step.

        Returns:
            One output per request that got a token or finished (aborts first).
        """
        output = self.scheduler.schedule()
        sampled = {} if output.is_empty else self.runner.execute(output)
        updated = self.scheduler.update(output, sampled)
        results, self._pending = self._pending, []
        return results + [self._emit(seq) for seq in updated]

    def has_unfinished(self) -> bool:
        """True while any request is live or an abort output is not yet returned."""
        return bool(self._requests) or bool(self._pending)

    @property
    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(
            num_total_blocks=bm.num_total_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_total=self._num_prompt_tokens,
            num_generation_tokens_total=self._num_generation_tokens,
        )

    # -- per-token bookkeeping -----------------------------------------------------------

    def _emit(self, seq: Sequence) -> RequestOutput:
        """Turn a sequence's new token into a ``RequestOutput``, applying stop strings."""
        request = self._by_seq[seq.seq_id]
        new = tuple(seq.output_token_ids[request.num_emitted :])
        if request.num_emitted == 0:
            self._num_prompt_tokens += seq.prompt_len
        self._num_generation_tokens += len(new)
        request.num_emitted = len(seq.output_token_ids)
        if self.detokenize is not None:
            self._update_text(request)
        if request.stopped_by_string and not seq.is_finished:
            self.scheduler.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
        result = self._output(request, new)
        if seq.is_finished:
            self._retire(request)
        return result

    def _update_text(self, request: _Request) -> None:
        """Detokenize the output and cut it before the first stop string, if any.

        Only the tail can hold a new match: text before ``num_checked_chars`` was already
        searched, so a match must start at most ``len(stop) - 1`` characters earlier.
        Trailing U+FFFD (an incomplete UTF-8 character the next token may complete) is not
        counted as checked.
        """
        assert request.detokenizer is not None
        seq = request.seq
        text = request.detokenizer.update(seq.output_token_ids, finished=seq.is_finished)
        stops = seq.params.stop
        if stops:
            longest = max(len(s) for s in stops)
            start = max(0, request.num_checked_chars - longest + 1)
            cut = _first_stop(text, stops, start)
            request.num_checked_chars = len(text.rstrip(REPLACEMENT_CHAR))
            if cut is not None:
                text = text[:cut]
                request.stopped_by_string = True
        request.text = text

    def _output(self, request: _Request, new: tuple[int, ...]) -> RequestOutput:
        seq = request.seq
        reason = "stop" if request.stopped_by_string else seq.finish_reason
        text: str | None = None
        if self.detokenize is not None:
            text = request.text
            if not seq.is_finished:
                text = text[: len(text) - _held_back(text, seq.params.stop)]
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new,
            output_token_ids=tuple(seq.output_token_ids),
            text=text,
            finished=seq.is_finished,
            finish_reason=reason,
        )

    def _retire(self, request: _Request) -> None:
        """Forget a finished request here and in the runner."""
        del self._requests[request.request_id]
        del self._by_seq[request.seq.seq_id]
        self.runner.release(request.seq.seq_id)


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index where the earliest stop string begins in ``text[start:]``, or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
