"""The FastAPI app: OpenAI routes over a ``ModelRouter`` (one model: ``SingleModel`` over one
``AsyncEngine``; several: ``server/multi``), errors as OpenAI error bodies.

A request's way through (``/v1/completions`` and ``/v1/chat/completions`` share it):

1. the body cap (``limits``) and, with an API key, the bearer check (``auth``) run first;
2. pydantic parses the body (``protocol``); a bad body is a 400 naming the parameter;
3. the model name, unsupported parameters and the prompts (text, token ids, lists of either,
   or messages through the chat template) are checked, and text is tokenized in the
   tokenizer pool, off the event loop (``prompts``, ``tokenization``);
4. ``serving.serve_job`` fans the request out into one engine request per choice, waits for
   the engine's admission verdict (``AdmissionError``: too long, larger than the pool, is a
   400, never a request queued forever), then streams or collects.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from kvroom.engine.kv.elastic import ElasticPolicy
from kvroom.engine.params.structured import StructuredOutputsParams
from kvroom.llm import LLM
from kvroom.server.admin import LivePool, install_admin, start_elastic
from kvroom.server.async_engine import AsyncEngine
from kvroom.server.auth import add_api_key_check
from kvroom.server.cache_routes import router as cache_router
from kvroom.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from kvroom.server.metrics import ServerMetrics
from kvroom.server.openai.errors import add_error_handlers, unsupported_params_error
from kvroom.server.openai.formats import ChatFormat, CompletionFormat
from kvroom.server.openai.images import ChatImages
from kvroom.server.openai.prompts import (
    SamplingBody,
    chat_prompt_ids,
    completion_prompts,
    sampling_params,
)
from kvroom.server.openai.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvroom.server.openai.responses import ModelList
from kvroom.server.openai.routing import ModelRouter, SingleModel
from kvroom.server.openai.serving import Job, Prompt, ServerState, json_response, serve_job
from kvroom.server.openai.structured import check_compiles, requested_constraint
from kvroom.server.openai.tokenization import TokenizerPool
from kvroom.server.openai.tokenize import router as tokenize_router
from kvroom.server.openai.tools import ToolOptions, resolve_tools

router = APIRouter()
logger = logging.getLogger("kvroom")


def create_app(
    llm: LLM,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    admin_key: str | None = None,
    elastic: ElasticPolicy | None = None,
    allowed_local_media_path: str | Path | None = None,
    tool_options: ToolOptions | None = None,
) -> FastAPI:
    """An app serving ``llm``'s engine; the engine loop runs while the app's lifespan does.

    Args:
        api_key: when set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>``.
        max_request_bytes: larger request bodies are refused with a 413 before parsing.

    ``admin_key`` enables the admin routes (``server/admin.py``); ``elastic`` runs the elastic
    KV pool controller while the app runs; ``allowed_local_media_path``: the folder
    ``image_url`` parts may name local files in; ``tool_options``: vLLM's
    ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (``server/openai/tools.py``).
    """
    state, live_pool = build_state(
        llm,
        served_model_name=served_model_name,
        allowed_local_media_path=allowed_local_media_path,
        tool_options=tool_options,
    )
    engine = state.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        controller = start_elastic(live_pool, elastic)
        try:
            yield
        finally:
            if controller is not None:
                await asyncio.to_thread(controller.stop)
            await asyncio.to_thread(engine.shutdown)
            state.tokenizers.shutdown()

    app = FastAPI(title="kvroom", lifespan=lifespan)
    app.state.kvroom = state
    install_admin(app, live_pool, admin_key)
    install_routes(app, SingleModel(state), api_key=api_key, max_request_bytes=max_request_bytes)
    return app


def build_state(
    llm: LLM,
    *,
    served_model_name: str | None = None,
    allowed_local_media_path: str | Path | None = None,
    tool_options: ToolOptions | None = None,
    metrics: ServerMetrics | None = None,
) -> tuple[ServerState, LivePool]:
    """The routes' view of one loaded model (its engine thread not started yet) and the
    ``LivePool`` that resizes it; ``metrics`` defaults to a registry of its own."""
    runtime = llm.runtime
    model = runtime.runner.model
    media = Path(allowed_local_media_path) if allowed_local_media_path else None
    engine = AsyncEngine(runtime.engine)
    if runtime.engine.heap_guard is not None:
        runtime.engine.heap_guard.serving = True  # the server's own memory is in the plan too
    cfg = runtime.info.config
    state = ServerState(
        engine=engine,
        metrics=metrics or ServerMetrics(lambda: engine.stats),
        tokenizers=TokenizerPool(llm.tokenizer),
        model_name=served_model_name or str(runtime.info.folder),
        artifact=str(runtime.info.folder),
        max_seq_len=cfg.max_seq_len,
        vocab_size=runtime.spec.vocab_size,
        max_num_seqs=cfg.batch_size,
        block_size=cfg.kvcache_block_size,
        images=ChatImages(model, media) if hasattr(model, "prepare_prompt") else None,
        grammars=runtime.engine.grammars,
        tool_options=tool_options or ToolOptions(),
    )
    return state, LivePool(runtime, engine)


def install_routes(
    app: FastAPI, models: ModelRouter, *, api_key: str | None, max_request_bytes: int
) -> None:
    """The OpenAI, tokenizer and cache routes over ``models``, error bodies, key and body cap
    (the admin routes are the caller's: one pool or several)."""
    app.state.kvroom_models = models
    app.include_router(router)
    app.include_router(tokenize_router)
    app.include_router(cache_router)
    add_error_handlers(app)
    if api_key:
        add_api_key_check(app, api_key)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)


def _models(request: Request) -> ModelRouter:
    return request.app.state.kvroom_models


# -- routes ----------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while every engine loop runs, 503 once one has stopped (vLLM's contract)."""
    alive = all(engine.is_alive for engine in _models(request).engines())
    return Response(status_code=200 if alive else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = _models(request).render_metrics()
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return json_response(ModelList(data=_models(request).cards()))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    async with _models(request).lease(body.model) as s:
        return await _completions(s, body, request)


async def _completions(s: ServerState, body: CompletionRequest, request: Request) -> Response:
    check_request(s, body)
    if body.stream and body.best_of is not None and body.best_of > body.n:
        raise ApiError(
            400,
            "'best_of' > n cannot be streamed; drop stream or best_of",
            param="best_of",
            code="invalid_value",
        )
    echo = bool(body.echo)
    echo_only = _echo_only(body)
    prompts = await completion_prompts(s, body.prompt, echo)
    wants_prompt_lps = echo and body.logprobs is not None
    prompt_logprobs = body.logprobs if wants_prompt_lps else body.prompt_logprobs
    params = sampling_params(
        s,
        body,
        prompts,
        1 if echo_only else body.max_tokens,
        "prompt",
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=await _constraint(s, body),
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    fmt = CompletionFormat(request_id, s.model_name, s.tokenizers.token_text, body.logprobs)
    job = Job(request_id, prompts, params, fmt, body.stream, body.include_usage, "prompt", echo)
    return await serve_job(s, dataclasses.replace(job, echo_only=echo_only), request)


def _echo_only(body: CompletionRequest) -> bool:
    """``max_tokens`` 0: with ``echo``, the prompt alone (vLLM's answer: it generates one token,
    counted in ``usage``, and returns only the prompt); without, a 400."""
    if body.max_tokens != 0:
        return False
    if not body.echo:
        raise ApiError(
            400,
            "max_tokens: must be greater than or equal to 1 (0 only with echo, which returns "
            "the prompt alone)",
            param="max_tokens",
            code="invalid_value",
        )
    return True


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    async with _models(request).lease(body.model) as s:
        return await _chat_completions(s, body, request)


async def _chat_completions(
    s: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    check_request(s, body)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(
            400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value"
        )
    tool_use, forced = resolve_tools(body, s.tool_options)
    structured = await _constraint(s, body, forced)
    prompt_ids, multimodal = await _chat_prompt(s, body)
    prompts = [Prompt(prompt_ids, "")]
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(
        s,
        body,
        prompts,
        body.max_new_tokens,
        "messages",
        logprobs=logprobs,
        prompt_logprobs=body.prompt_logprobs,
        structured=structured,
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    fmt = ChatFormat(request_id, s.model_name, s.tokenizers.token_text, logprobs)
    job = Job(request_id, prompts, params, fmt, body.stream, body.include_usage, "messages")
    job = dataclasses.replace(job, multimodal=multimodal, tool_use=tool_use)
    return await serve_job(s, job, request)


def check_request(s: ServerState, body: SamplingBody) -> None:
    """The model name, and no parameter kvroom declares but does not implement."""
    if body.model is not None and body.model != s.model_name:
        raise ApiError(
            404,
            f"The model '{body.model}' does not exist; this server serves '{s.model_name}'",
            param="model",
            code="model_not_found",
        )
    unsupported = body.unsupported_params()
    if unsupported:
        raise unsupported_params_error(unsupported, "kvroom does not serve suffix: leave it unset")


async def _constraint(
    s: ServerState, body: SamplingBody, forced: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """The body's output constraint (or the one ``tool_choice`` ``forced``), compiled; a 400
    naming the field if it does not compile."""
    found = requested_constraint(body)
    if forced is not None and found is not None:
        raise ApiError(
            400,
            f"'tool_choice' forces the output to the tools' schema; drop '{found[0]}'",
            param=found[0],
            code="invalid_value",
        )
    if forced is not None:
        found = ("tools", forced)
    if found is None:
        return None
    field, params = found
    await check_compiles(s.grammars, field, params)
    return params


async def _chat_prompt(s: ServerState, body: ChatCompletionRequest) -> tuple[list[int], Any]:
    """Prompt ids (image placeholders expanded) and the model's multimodal inputs (None: text)."""
    urls = [u for m in body.messages for u in m.image_urls()]
    if urls and s.images is None:
        raise ApiError(400, "this model does not take images", param="messages")
    placeholder = s.images.placeholder if s.images is not None else ""
    messages = [m.as_template_input(placeholder) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    ids = await chat_prompt_ids(s, messages, tools=tools)
    if not urls:
        return ids, None
    assert s.images is not None
    return s.images.prepare_prompt(ids, urls)
