"""One validated request through the engine and back: SSE deltas, or one JSON body.

Shared by ``/v1/completions`` and ``/v1/chat/completions`` (the ``fmt`` builder is the only
difference). A client that disconnects cancels its handler (Starlette does it for a stream;
``until_disconnect`` for a plain response), and the stream's ``close()`` aborts the request so
its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from kvroom.engine.engine import RequestOutput
from kvroom.engine.sampling import SamplingParams
from kvroom.errors import AdmissionError
from kvroom.server.async_engine import (
    AsyncEngine,
    EngineClosedError,
    EngineDeadError,
    RequestStream,
)
from kvroom.server.metrics import ServerMetrics
from kvroom.server.protocol import ApiError, CompletionFormat, UsageInfo

T = TypeVar("T")
_ENGINE_REQUEST_PREFIX = re.compile(r"^request \d+: ")
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class ServerState:
    """What the routes need, kept on ``app.state.kvroom``."""

    engine: AsyncEngine
    metrics: ServerMetrics
    tokenizer: Any
    """The HTTP side's own tokenizer (encode, chat template); used on the event loop only."""
    model_name: str
    artifact: str
    max_seq_len: int
    vocab_size: int
    images: Any = None
    """``images.ChatImages`` when the model takes images, else None."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` exactly as ``LLM.generate`` would make them."""
        return list(self.tokenizer(text)["input_ids"])


@dataclass
class Job:
    """One validated request, ready for the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    fmt: CompletionFormat
    stream: bool
    include_usage: bool
    prompt_param: str
    """The request field that holds the prompt ('prompt' or 'messages'), for error bodies."""
    arrival_time: float = field(default_factory=time.monotonic)
    multimodal: Any = None
    """The prompt's images as the model prepared them (``image_url`` parts), or None."""


async def serve_job(s: ServerState, job: Job, request: Request) -> Response:
    """Submit ``job``; stream it, or wait for it while watching for a disconnect."""
    try:
        stream = await s.engine.add_request(
            job.prompt_token_ids, job.params, job.request_id, multimodal=job.multimodal
        )
    except AdmissionError as exc:
        blame_prompt = not 0 < len(job.prompt_token_ids) < s.max_seq_len
        param = job.prompt_param if blame_prompt else "max_tokens"
        message = _ENGINE_REQUEST_PREFIX.sub("", str(exc))  # its seq number means nothing here
        raise ApiError(400, message, param=param, code="context_length_exceeded") from exc
    except EngineClosedError as exc:
        raise ApiError(503, str(exc), type="service_unavailable") from exc
    except EngineDeadError as exc:
        raise ApiError(500, str(exc), type="server_error") from exc
    if job.stream:
        return StreamingResponse(_sse(s, job, stream), media_type="text/event-stream")
    final = await until_disconnect(request, _collect(s, job, stream))
    if final is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    usage = UsageInfo.of(len(job.prompt_token_ids), len(final.output_token_ids))
    return json_response(job.fmt.response(final.text or "", final.finish_reason, usage))


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


async def _sse(s: ServerState, job: Job, stream: RequestStream) -> AsyncIterator[str]:
    """SSE events: text deltas, an optional usage chunk, then ``[DONE]``.

    While a request runs, a trailing U+FFFD (a UTF-8 character whose last bytes are still to
    come) is held back, so the deltas always add up to the final text.
    """
    sent = ""
    last: RequestOutput | None = None
    try:
        for chunk in job.fmt.opening():
            yield _event(chunk)
        async for last in stream:
            text = last.text or ""
            visible = text if last.finished else text.rstrip(_REPLACEMENT_CHAR)
            delta = visible[len(sent) :]
            if delta or last.finished:
                sent = visible
                reason = last.finish_reason if last.finished else None
                yield _event(job.fmt.chunk(delta, reason))
        if job.include_usage and last is not None:
            usage = UsageInfo.of(len(job.prompt_token_ids), len(last.output_token_ids))
            yield _event(job.fmt.usage_chunk(usage))
    except EngineDeadError as exc:
        yield _event(ApiError(500, str(exc), type="server_error").body)
    finally:
        stream.close()
        _observe(s, job, stream)
    yield "data: [DONE]\n\n"


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
