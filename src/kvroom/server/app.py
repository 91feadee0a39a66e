"""The FastAPI app: OpenAI routes over one ``AsyncEngine``, errors as OpenAI error bodies.

A request's way through (``/v1/completions`` and ``/v1/chat/completions`` share it):

1. pydantic parses the body (``protocol``); a bad body is a 400 naming the parameter;
2. the model name, unsupported parameters and the prompt (text, token ids, or messages through
   the chat template) are checked, and the prompt is tokenized here, on the event loop, with the
   app's own tokenizer copy (the engine loop thread decodes with the engine's: a fast tokenizer
   is not safe to use from two threads at once);
3. ``serving.serve_job`` waits for the engine's admission verdict (``AdmissionError``: too long,
   larger than the pool, is a 400, never a request queued forever), then streams or collects.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import signal
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import jinja2
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvroom.engine.sampling import SamplingParams
from kvroom.errors import ConfigError
from kvroom.llm import LLM
from kvroom.server.async_engine import AsyncEngine
from kvroom.server.images import ChatImages
from kvroom.server.metrics import ServerMetrics
from kvroom.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from kvroom.server.serving import Job, ServerState, json_response, serve_job

router = APIRouter()


def create_app(
    llm: LLM,
    *,
    served_model_name: str | None = None,
    allowed_local_media_path: str | Path | None = None,
) -> FastAPI:
    """An app serving ``llm``'s engine; the engine loop runs while the app's lifespan does.

    ``allowed_local_media_path``: the folder ``image_url`` parts may name local files in.
    """
    runtime = llm.runtime
    model = runtime.runner.model
    media = Path(allowed_local_media_path) if allowed_local_media_path else None
    engine = AsyncEngine(runtime.engine)
    state = ServerState(
        engine=engine,
        metrics=ServerMetrics(lambda: engine.stats),
        tokenizer=copy.deepcopy(llm.tokenizer),
        model_name=served_model_name or str(runtime.info.folder),
        artifact=str(runtime.info.folder),
        max_seq_len=runtime.info.config.max_seq_len,
        vocab_size=runtime.spec.vocab_size,
        images=ChatImages(model, media) if hasattr(model, "prepare_prompt") else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvroom", lifespan=lifespan)
    app.state.kvroom = state
    app.include_router(router)
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.kvroom


# -- routes ----------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine loop runs, 503 once it has stopped (vLLM's contract)."""
    return Response(status_code=200 if _state(request).engine.is_alive else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = _state(request).metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    s = _state(request)
    card = ModelCard(id=s.model_name, root=s.artifact, max_model_len=s.max_seq_len)
    return json_response(ModelList(data=[card]))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    s = _state(request)
    _check_request(s, body)
    prompt_ids = _completion_prompt_ids(s, body.prompt)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    fmt = CompletionFormat(request_id, s.model_name)
    return await serve_job(s, _job(s, body, prompt_ids, body.max_tokens, fmt, "prompt"), request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    s = _state(request)
    _check_request(s, body)
    prompt_ids, multimodal = _chat_prompt_ids(s, body)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    fmt = ChatFormat(request_id, s.model_name)
    job = _job(s, body, prompt_ids, body.max_new_tokens, fmt, "messages")
    return await serve_job(s, dataclasses.replace(job, multimodal=multimodal), request)


# -- validation --------------------------------------------------------------------------


def _check_request(s: ServerState, body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.model is not None and body.model != s.model_name:
        raise ApiError(
            404,
            f"The model '{body.model}' does not exist; this server serves '{s.model_name}'",
            param="model",
            code="model_not_found",
        )
    unsupported = body.unsupported_params()
    if unsupported:
        raise unsupported_params_error(
            unsupported,
            "kvroom serves n=1 without logprobs, penalties, logit_bias, tools or response "
            "formats: leave them unset",
        )


def _completion_prompt_ids(s: ServerState, prompt: str | list[Any]) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(
                400,
                f"'prompt' holds {len(prompt)} prompts; kvroom takes one prompt per request: "
                "send one request for each",
                param="prompt",
                code="unsupported_parameter",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return s.encode(prompt)
    outside = [t for t in prompt if not 0 <= t < s.vocab_size]
    if outside:
        raise ApiError(
            400,
            f"'prompt': token id {outside[0]} is outside the vocabulary [0, {s.vocab_size})",
            param="prompt",
            code="invalid_value",
        )
    return list(prompt)


def _chat_prompt_ids(s: ServerState, body: ChatCompletionRequest) -> tuple[list[int], Any]:
    """Prompt ids (placeholders expanded) and the model's multimodal inputs (None: text)."""
    if not getattr(s.tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "this model's tokenizer has no chat template; use /v1/completions",
            param="messages",
        )
    urls = [u for m in body.messages for u in m.image_urls()]
    if urls and s.images is None:
        raise ApiError(400, "this model does not take images", param="messages")
    placeholder = s.images.placeholder if s.images is not None else ""
    messages = [m.as_template_input(placeholder) for m in body.messages]
    try:
        ids = s.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except jinja2.TemplateError as exc:
        raise ApiError(
            400, f"the chat template rejected these messages: {exc}", param="messages"
        ) from exc
    if not urls:
        return list(ids), None
    assert s.images is not None
    return s.images.prepare_prompt(list(ids), urls)


def _job(
    s: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    fmt: CompletionFormat,
    prompt_param: str,
) -> Job:
    """Sampling parameters of ``body``; ``max_tokens`` None means "up to max_seq_len"."""
    if max_tokens is None:
        max_tokens = s.max_seq_len - len(prompt_ids)
        if max_tokens <= 0:
            raise ApiError(
                400,
                f"the prompt has {len(prompt_ids)} tokens, which leaves no room to generate "
                f"within max_seq_len ({s.max_seq_len}); shorten the prompt",
                param=prompt_param,
                code="context_length_exceeded",
            )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
    except ConfigError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from exc
    return Job(
        fmt.request_id, prompt_ids, params, fmt, body.stream, body.include_usage, prompt_param
    )


# -- errors ------------------------------------------------------------------------------


async def _api_error(request: Request, exc: ApiError) -> Response:
    return json_response(exc.body, exc.status)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    error = validation_api_error(exc.errors())
    return json_response(error.body, error.status)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    error = ApiError(exc.status_code, str(exc.detail), code=None)
    return json_response(error.body, error.status)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette logs the traceback and re-raises after this response is sent.
    error = ApiError(500, f"internal server error: {exc!r}", type="server_error")
    return json_response(error.body, error.status)


def unsupported_params_error(names: Sequence[str], remedy: str) -> ApiError:
    """400 naming every unsupported parameter (the first one as ``param``)."""
    quoted = ", ".join(f"'{name}'" for name in names)
    return ApiError(
        400,
        f"unsupported parameter(s): {quoted}; {remedy}",
        param=names[0],
        code="unsupported_parameter",
    )


def validation_api_error(errors: Sequence[Any]) -> ApiError:
    """One OpenAI-style 400 for pydantic's errors: unknown fields first, then the first field."""
    extra = [_path(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        return unsupported_params_error(
            extra, "see the OpenAI API reference for the fields kvroom accepts"
        )
    first = errors[0]
    path = _path(first["loc"])
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        return ApiError(400, f"malformed JSON body: {reason}", code="invalid_json")
    if not path:
        return ApiError(400, "the request body must be a JSON object", code="invalid_body")
    if first["type"] == "missing":
        return ApiError(
            400, f"missing required parameter '{path}'", param=path, code="missing_parameter"
        )
    param = path.split(".")[0]
    same = [e for e in errors if _path(e["loc"]).split(".")[0] == param][:4]
    detail = "; ".join(e["msg"] if _path(e["loc"]) == param else _where(e) for e in same)
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
    return ApiError(
        400, f"invalid '{param}': {detail} (got {_short(first['input'])})", param=param, code=code
    )


def _where(error: Any) -> str:
    return f"{_path(error['loc'])}: {error['msg']}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _path(loc: Sequence[Any]) -> str:
    """``('body', 'messages', 0, 'role')`` -> ``'messages.0.role'``."""
    return ".".join(str(p) for p in loc if p != "body")


# -- running -----------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT that stopped it gracefully is not raised
    again afterwards: uvicorn re-raises it (so the process dies of the signal), while
    ``kvroom serve`` drains, stops the engine loop and exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(
    app: FastAPI,
    sock: socket.socket,
    *,
    access_log: bool = True,
    shutdown_timeout_s: float = 30.0,
) -> None:
    """Serve ``app`` on the bound socket ``sock`` until SIGTERM/SIGINT.

    On the signal: stop accepting, let in-flight requests finish for up to
    ``shutdown_timeout_s`` seconds, cancel (abort) what is left, stop the engine loop, return.
    """
    config = uvicorn.Config(
        app,
        loop="asyncio",
        http="h11",
        lifespan="on",
        access_log=access_log,
        timeout_graceful_shutdown=shutdown_timeout_s,  # type: ignore[arg-type]
    )
    _Server(config).run(sockets=[sock])
