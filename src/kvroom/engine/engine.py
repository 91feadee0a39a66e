"""The engine step: ``schedule() -> execute() -> update()``, plus requests, text and stats.

The scheduler knows only token ids, so everything about text lives here: detokenizing the
output, finding stop strings, and holding back a tail that might still become one (so streamed
text never has to be taken back).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvroom.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from kvroom.engine.kv.heap_guard import HeapGuard
from kvroom.engine.kv.migration import ResizeResult, check_reserve
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.output import SchedulerOutput, StepResult, TokenLogprobs
from kvroom.engine.sched.scheduler import Scheduler
from kvroom.engine.sched.sequence import FinishReason, Sequence, SequenceStatus
from kvroom.engine.structured.grammar import GrammarCompiler
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


class ResizablePool(Protocol):
    """What the engine needs from the KV pool to resize it (``KVCachePool``)."""

    max_num_blocks: int

    def resize(self, num_blocks: int) -> None: ...

    def copy_blocks(self, moves: tuple[tuple[int, int], ...]) -> None: ...


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
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """Per generated token, when ``params.logprobs`` is set."""
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """Per prompt token (None for the first), when ``params.prompt_logprobs`` is set; present
    from the first output that carries a token."""
    cumulative_logprob: float | None = None
    """Sum of ``logprobs`` (vLLM's name), when they are reported."""


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
    num_kv_resizes: int = 0
    """Live resizes of the KV pool since start."""
    num_prefix_cache_queries: int = 0
    """Prompt tokens of admitted requests looked up in the prefix cache (vLLM counts tokens)."""
    num_prefix_cache_hits: int = 0
    """Of those, tokens whose K/V came from the cache instead of being computed."""
    num_forked_tokens: int = 0
    """Prompt tokens not computed because a running twin (another of ``n`` choices) had them."""


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
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLMEngine:
    """Turns requests into streamed outputs over a scheduler and a runner."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        eos_token_ids: set[int],
        detokenize: Callable[[list[int]], str] | None,
        pool: ResizablePool | None = None,
        grammars: GrammarCompiler | None = None,
        heap_guard: HeapGuard | None = None,
    ) -> None:
        """
        Args:
            scheduler: decides each step's tokens; owns the block manager.
            runner: computes a step and samples (see ``Runner``).
            eos_token_ids: the model's end-of-sequence ids.
            detokenize: token ids -> text; needed for ``text`` and for stop strings.
            pool: the KV pool, for ``resize_kv_cache`` (None: only the block manager resizes).
            grammars: compiles ``params.structured_outputs`` (the runner's, so its cache is
                warm when the runner builds the matcher); None refuses constrained requests.
            heap_guard: trims the heap between steps when the next one could take the process
                past the plan's total (CPU with measured terms; None: never).
        """
        self.scheduler = scheduler
        self.runner = runner
        self.pool = pool
        self.num_kv_resizes = 0
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.grammars = grammars
        self.heap_guard = heap_guard
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
        if params.structured_outputs is not None:
            self._check_grammar(request_id, params)
        seq = Sequence(
            seq_id, tuple(prompt_token_ids), params, self.eos_token_ids, multimodal=multimodal
        )
        self.scheduler.add(seq)
        request = _Request(request_id, seq, self._detokenizer(params))
        if params.logprobs is not None:
            request.logprobs = []
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * seq.prompt_len
        self._requests[request_id] = request
        self._by_seq[seq_id] = request
        return request_id

    def _check_grammar(self, request_id: str, params: SamplingParams) -> None:
        """Compile the request's constraint now (cached): a bad one is refused up front.

        Raises:
            StructuredOutputError: the schema, regex or grammar does not compile.
            AdmissionError: this engine has no grammar compiler (no tokenizer).
        """
        if self.grammars is None:
            raise AdmissionError(
                f"request {request_id!r}: structured outputs need the model's tokenizer; "
                "pass grammars= to LLMEngine (kvroom.LLM and kvroom serve do)"
            )
        assert params.structured_outputs is not None
        self.grammars.compile(params.structured_outputs)

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
        guard = None if output.is_empty else self.heap_guard
        if guard is not None:
            guard.before_step()
        sampled = {} if output.is_empty else self.runner.execute(output)
        if guard is not None:
            guard.after_step()
        updated = self.scheduler.update(output, sampled)
        if isinstance(sampled, StepResult):
            self._record_logprobs(sampled)
        results, self._pending = self._pending, []
        return results + [self._emit(seq) for seq in updated]

    def resize_kv_cache(self, num_blocks: int) -> ResizeResult:
        """Change the KV pool to ``num_blocks`` blocks now, between steps; no token changes.

        Grow: the pool commits the new blocks, then they join the free list. Shrink: the
        scheduler preempts the newest sequences only if the used blocks do not fit, the block
        tables move to low ids, the K/V of moved blocks is copied, then the pool releases the
        rest. The caller validates ``num_blocks`` against the plan (``adjust``).

        Raises:
            ConfigError: below one ``max_seq_len`` sequence, or above the pool's reserve.
        """
        start = time.perf_counter()
        old = self.scheduler.block_manager.num_total_blocks
        if self.pool is not None:
            check_reserve(num_blocks, self.pool.max_num_blocks)
        if self.pool is not None and num_blocks > old:
            self.pool.resize(num_blocks)
        done = self.scheduler.resize(num_blocks)
        if self.pool is not None and num_blocks < old:
            self.pool.copy_blocks(done.moves)
            self.pool.resize(num_blocks)
        if num_blocks != old:
            self.num_kv_resizes += 1
        return ResizeResult.of(done, time.perf_counter() - start)

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
            num_kv_resizes=self.num_kv_resizes,
            num_prefix_cache_queries=bm.cache.num_query_tokens if bm.cache else 0,
            num_prefix_cache_hits=bm.cache.num_hit_tokens if bm.cache else 0,
            num_forked_tokens=self.scheduler.num_forked_tokens,
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (between steps); running requests keep their blocks.

        Returns:
            Cached-free blocks dropped (0 when prefix caching is off).
        """
        return self.scheduler.block_manager.reset_prefix_cache()

    @property
    def prefix_caching(self) -> bool:
        return self.scheduler.block_manager.cache is not None

    # -- per-token bookkeeping -----------------------------------------------------------

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.detokenize is None:
            return None
        if params.skip_special_tokens:
            return IncrementalDetokenizer(self.detokenize)
        detokenize = self.detokenize
        return IncrementalDetokenizer(lambda ids: detokenize(ids, skip_special_tokens=False))  # type: ignore[call-arg]

    def _record_logprobs(self, result: StepResult) -> None:
        """Keep what the runner reported; a recomputed prompt position keeps its first report."""
        for seq_id, found in result.prompt_logprobs.items():
            request = self._by_seq.get(seq_id)
            if request is not None and request.prompt_logprobs is not None:
                for pos, lp in found:
                    if request.prompt_logprobs[pos] is None:
                        request.prompt_logprobs[pos] = lp
        for seq_id, lp in result.logprobs.items():
            request = self._by_seq.get(seq_id)
            if request is not None and request.logprobs is not None:
                request.logprobs.append(lp)

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
        if stops and len(seq.output_token_ids) >= seq.params.min_tokens:
            longest = max(len(s) for s in stops)
            start = max(0, request.num_checked_chars - longest + 1)
            cut = _first_stop(text, stops, start)
            request.num_checked_chars = len(text.rstrip(REPLACEMENT_CHAR))
            if cut is not None:
                if seq.params.include_stop_str_in_output:
                    cut += _stop_len(text, stops, cut)
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
        logprobs = None if request.logprobs is None else tuple(request.logprobs)
        prompt_logprobs = None
        if request.prompt_logprobs is not None and seq.output_token_ids:
            prompt_logprobs = tuple(request.prompt_logprobs)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new,
            output_token_ids=tuple(seq.output_token_ids),
            text=text,
            finished=seq.is_finished,
            finish_reason=reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cumulative_logprob=None if logprobs is None else sum(lp.logprob for lp in logprobs),
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


def _stop_len(text: str, stops: tuple[str, ...], cut: int) -> int:
    """Length of the (longest) stop string that starts at ``cut``."""
    return max(len(s) for s in stops if text.startswith(s, cut))


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
