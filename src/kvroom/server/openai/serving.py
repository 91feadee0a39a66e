"""One validated request through the engine and back: SSE deltas, or one JSON body.

Shared by ``/v1/completions`` and ``/v1/chat/completions`` (the ``fmt`` builder is the only
difference). A request fans out into one engine request per choice: ``len(prompts) x
num_sequences`` (``n``, or ``best_of`` of which the best ``n`` are kept), numbered as OpenAI
and vLLM number them, ``index = prompt_index * n + choice``. A client that disconnects
cancels its handler (Starlette does it for a stream; ``until_disconnect`` for a plain
response), and closing the streams aborts every choice so their KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from kvroom.engine.engine import RequestOutput
from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import AdmissionError
from kvroom.llm import best_choices
from kvroom.server.async_engine import (
    AsyncEngine,
    EngineClosedError,
    EngineDeadError,
    RequestStream,
)
from kvroom.server.metrics import ServerMetrics
from kvroom.server.openai.formats import CompletionFormat, Entry, FinalChoice, StreamDelta
from kvroom.server.openai.protocol import ApiError
from kvroom.server.openai.responses import UsageInfo
from kvroom.server.openai.tokenization import TokenizerPool
from kvroom.server.openai.tool_calls import ToolCallDelta
from kvroom.server.openai.tools import ToolOptions, ToolUse

T = TypeVar("T")
_ENGINE_REQUEST_PREFIX = re.compile(r"^request \d+: ")
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class ServerState:
    """What the routes need for one model; the app's ``ModelRouter`` hands it out."""

    engine: AsyncEngine
    metrics: ServerMetrics
    tokenizers: TokenizerPool
    model_name: str
    artifact: str
    max_seq_len: int
    vocab_size: int
    max_num_seqs: int
    """The engine's batch size: the most choices one request may ask for."""
    block_size: int
    """Tokens per KV block, to tell whether ``n`` sequences could ever fit in the pool."""
    images: Any = None
    """``images.ChatImages`` when the model takes images, else None."""
    grammars: Any = None
    """The engine's ``GrammarCompiler`` (structured outputs), or None without a tokenizer."""
    tool_options: ToolOptions = field(default_factory=ToolOptions)
    """``--enable-auto-tool-choice`` and ``--tool-call-parser``."""


@dataclass
class Prompt:
    """One prompt of a request: its token ids, and its text for ``echo``."""

    token_ids: list[int]
    text: str


@dataclass
class Job:
    """One validated request, ready for the engine."""

    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    """The request's params (``n``, ``best_of``); each choice runs ``params.child(i)``."""
    fmt: CompletionFormat
    stream: bool
    include_usage: bool
    prompt_param: str
    """The request field that holds the prompt ('prompt' or 'messages'), for error bodies."""
    echo: bool = False
    """Completions: the prompt (and its logprobs) comes before each choice's text."""
    echo_only: bool = False
    """Completions, ``echo`` with ``max_tokens`` 0: the prompt alone; the one token generated
    (``params.max_tokens`` is 1) is dropped from text and logprobs, as vLLM does."""
    arrival_time: float = field(default_factory=time.monotonic)
    multimodal: Any = None
    """The prompt's images as the model prepared them (``image_url`` parts), or None."""
    tool_use: ToolUse | None = None
    """Chat with tools in play: how each choice's output becomes ``tool_calls``."""

    def engine_requests(self) -> list[tuple[str, Prompt, SamplingParams]]:
        """``(request id, prompt, params)`` per sequence, prompt-major."""
        k = self.params.num_sequences
        return [
            (f"{self.request_id}-{i}-{j}", prompt, self.params.child(j))
            for i, prompt in enumerate(self.prompts)
            for j in range(k)
        ]

    def choice_index(self, sequence: int) -> int:
        """The OpenAI index of engine sequence ``sequence`` (streams keep all of them)."""
        k = self.params.num_sequences
        return sequence // k * self.params.n + sequence % k

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)


async def serve_job(s: ServerState, job: Job, request: Request) -> Response:
    """Submit every choice of ``job``; stream them, or wait while watching for a disconnect."""
    streams = await _submit(s, job)
    if job.stream:
        return StreamingResponse(_sse(s, job, streams), media_type="text/event-stream")
    finals = await until_disconnect(request, _collect_all(s, job, streams))
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = _final_choices(job, finals)
    completion = sum(len(o.output_token_ids) for o in finals)
    usage = UsageInfo.of(job.num_prompt_tokens, completion)
    return json_response(job.fmt.response(choices, usage))


async def _submit(s: ServerState, job: Job) -> list[RequestStream]:
    """Add every sequence; on a refusal abort the ones already added and answer the error."""
    streams: list[RequestStream] = []
    try:
        for request_id, prompt, params in job.engine_requests():
            streams.append(
                await s.engine.add_request(
                    prompt.token_ids, params, request_id, multimodal=job.multimodal
                )
            )
    except AdmissionError as exc:
        _close_all(streams)
        too_long = any(not 0 < len(p.token_ids) < s.max_seq_len for p in job.prompts)
        param = job.prompt_param if too_long else "max_tokens"
        message = _ENGINE_REQUEST_PREFIX.sub("", str(exc))  # its seq number means nothing here
        raise ApiError(400, message, param=param, code="context_length_exceeded") from exc
    except EngineClosedError as exc:
        _close_all(streams)
        raise ApiError(503, str(exc), type="service_unavailable") from exc
    except EngineDeadError as exc:
        _close_all(streams)
        raise ApiError(500, str(exc), type="server_error") from exc
    except BaseException:
        _close_all(streams)
        raise
    return streams


def _close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def _collect_all(
    s: ServerState, job: Job, streams: list[RequestStream]
) -> list[RequestOutput]:
    try:
        return list(await asyncio.gather(*(_collect(s, job, st) for st in streams)))
    finally:
        _close_all(streams)  # a failed or cancelled sibling must not leave the rest running


async def _collect(s: ServerState, job: Job, stream: RequestStream) -> RequestOutput:
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
    except EngineDeadError as exc:
        raise ApiError(500, str(exc), type="server_error") from exc
    finally:
        stream.close()
        _observe(s, job, stream)
    assert last is not None and last.finished, f"{job.request_id}: stream ended unfinished"
    return last


def _final_choices(job: Job, finals: list[RequestOutput]) -> list[FinalChoice]:
    k = job.params.num_sequences
    choices: list[FinalChoice] = []
    for i, prompt in enumerate(job.prompts):
        kept = best_choices(finals[i * k : (i + 1) * k], job.params)
        for j, out in enumerate(kept):
            text = (prompt.text if job.echo else "") + _output_text(job, out)
            entries = _entries(job, prompt, out, 0, first=True)
            index = i * job.params.n + j
            choice = FinalChoice(index, text, entries, out.finish_reason, out.prompt_logprobs)
            choices.append(choice if job.tool_use is None else _with_calls(job.tool_use, choice))
    return choices


def _with_calls(tool_use: ToolUse, choice: FinalChoice) -> FinalChoice:
    """The choice's text split into content and calls (``finish_reason`` "tool_calls")."""
    parsed = tool_use.parse(choice.text)
    reason = choice.finish_reason
    if parsed.tool_calls and reason == "stop":
        reason = "tool_calls"
    return dataclasses.replace(
        choice,
        text=parsed.content or "",
        finish_reason=reason,
        tool_calls=parsed.tool_calls,
        content_is_null=parsed.content is None,
    )


def _entries(
    job: Job, prompt: Prompt, out: RequestOutput, num_sent: int, *, first: bool
) -> list[Entry] | None:
    """Tokens with logprobs from output token ``num_sent`` on (and the echoed prompt first)."""
    if job.params.logprobs is None:
        return None
    entries: list[Entry] = []
    if job.echo and first:
        entries.extend(zip(prompt.token_ids, out.prompt_logprobs or (), strict=False))
    logprobs = () if job.echo_only else out.logprobs or ()
    entries.extend((lp.token_id, lp) for lp in logprobs[num_sent:])
    return entries


def _output_text(job: Job, out: RequestOutput) -> str:
    return "" if job.echo_only else out.text or ""


@dataclass
class _Sent:
    """What one streamed choice has sent so far."""

    text: str = ""
    num_tokens: int = 0
    """Output tokens whose logprobs have been sent."""
    offset: int = 0
    """Characters of token text sent in logprobs (the next ``text_offset``)."""
    started: bool = False
    streamer: Any = None
    """With tools: the parser turning this choice's text into content and call pieces."""


async def _sse(s: ServerState, job: Job, streams: list[RequestStream]) -> AsyncIterator[str]:
    """SSE events: per-choice deltas (with logprobs), an optional usage chunk, then ``[DONE]``.

    While a choice runs, a trailing U+FFFD (a UTF-8 character whose last bytes are still to
    come) is held back, so the deltas always add up to the final text.
    """
    sent = [_Sent() for _ in streams]
    if job.tool_use is not None:
        for one in sent:
            one.streamer = job.tool_use.streamer()
    num_generated = [0] * len(streams)
    try:
        for chunk in job.fmt.opening([job.choice_index(i) for i in range(len(streams))]):
            yield _event(chunk)
        async for i, out in _merged(streams):
            num_generated[i] = len(out.output_token_ids)
            chunk = _delta_chunk(job, i, out, sent[i])
            if chunk is not None:
                yield _event(chunk)
        if job.include_usage:
            yield _event(
                job.fmt.usage_chunk(UsageInfo.of(job.num_prompt_tokens, sum(num_generated)))
            )
    except EngineDeadError as exc:
        yield _event(ApiError(500, str(exc), type="server_error").body)
    finally:
        for stream in streams:
            stream.close()
            _observe(s, job, stream)
    yield "data: [DONE]\n\n"


def _delta_chunk(job: Job, i: int, out: RequestOutput, sent: _Sent) -> BaseModel | None:
    """The chunk that brings choice ``i`` up to ``out``, or None when nothing is new."""
    prompt = job.prompts[i // job.params.num_sequences]
    prefix = prompt.text if job.echo and not sent.started else ""
    text = _output_text(job, out)
    visible = text if out.finished else text.rstrip(_REPLACEMENT_CHAR)
    delta = visible[len(sent.text) :]
    calls: tuple[ToolCallDelta, ...] = ()
    if sent.streamer is not None:
        parsed = sent.streamer.feed(visible, finished=out.finished)
        delta, calls = parsed.content, parsed.tool_calls
    entries = _entries(job, prompt, out, sent.num_tokens, first=not sent.started)
    if not (prefix or delta or calls or entries or out.finished):
        return None
    sent.started = True
    sent.text = visible
    sent.num_tokens = len(out.logprobs or ())
    reason = out.finish_reason if out.finished else None
    if reason == "stop" and sent.streamer is not None and sent.streamer.num_calls:
        reason = "tool_calls"
    index = job.choice_index(i)
    chunk = job.fmt.chunk(
        StreamDelta(index, prefix + delta, entries or [], sent.offset, reason, calls)
    )
    sent.offset += sum(len(job.fmt.token_text(t)) for t, _ in entries or ())
    return chunk


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(stream index, output)`` from every stream as they come, each stream in order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(_next(st)): i for i, st in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if out is None:
                    continue
                yield i, out
                pending[asyncio.ensure_future(_next(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()


async def _next(stream: RequestStream) -> RequestOutput | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _observe(s: ServerState, job: Job, stream: RequestStream) -> None:
    end = stream.finish_time or time.monotonic()
    first = stream.first_token_time
    s.metrics.observe_request(
        e2e_s=end - job.arrival_time,
        ttft_s=None if first is None else first - job.arrival_time,
        finish_reason=stream.finish_reason,
    )


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, cancelling it if the client disconnects first (then None)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the client is gone (or this handler is being cancelled)
    if task.cancelled() or not task.done():
        await asyncio.wait({task})  # let its ``finally`` abort the request
        return None
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")
