"""Admin endpoints of the KV pool: ``GET /kv_cache`` and ``POST /kv_cache`` (resize it live).

Enabled only by ``kvroom serve --admin-key KEY``: a request must carry ``Authorization: Bearer
KEY``. Without a configured key both answer 404 (the endpoint does not exist), with a missing or
wrong key 403, whatever the client's address.

``LivePool`` is the one way the pool changes while serving (the admin handler and the elastic
controller both go through it): under one lock it applies the policy (``resolve_resize``), has
the engine loop resize between two steps, records the new plan, optionally persists it through
the atomic ``set``, and logs one line (from, to, why).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from kvroom.engine.kv.elastic import ElasticController, ElasticPolicy
from kvroom.engine.kv.live_pool import KVCacheState, resolve_resize
from kvroom.engine.kv.migration import ResizeResult
from kvroom.errors import KvroomError
from kvroom.server.async_engine import AsyncEngine
from kvroom.server.openai.protocol import ApiError

logger = logging.getLogger("kvroom")

router = APIRouter()


class ResizeRequest(BaseModel):
    """Body of ``POST /kv_cache``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    num_blocks: int | Literal["auto"]
    """The new pool size, or "auto" (re-fit to the memory available now)."""
    persist: bool = False
    """Also write the size into the artifact (the atomic ``kvroom set``)."""


class LivePool:
    """Resizes a serving engine's pool, one resize at a time, from any thread."""

    def __init__(self, runtime: Any, engine: AsyncEngine) -> None:
        self.runtime = runtime
        self.engine = engine
        self.last_resize: ResizeResult | None = None
        self._lock = threading.Lock()

    def state(self) -> KVCacheState:
        return KVCacheState.of(
            self.runtime.plan,
            self.engine.stats,
            max_num_blocks=self.runtime.pool.max_num_blocks,
            last_resize=self.last_resize,
            populated=self.runtime.pool.populated,
        )

    def resize(
        self, requested: int | str, *, why: str, persist: bool = False, source: str = "resize"
    ) -> ResizeResult:
        """Validate ``requested`` by the policy, resize between steps, log, maybe persist.

        Raises:
            KvroomError: refused by the policy or the reserve; nothing changed.
        """
        with self._lock:
            before = self.state()
            plan = resolve_resize(
                self.runtime.plan,
                requested,
                kv_bytes_now=before.bytes,
                max_num_blocks=before.max_num_blocks,
                source=source,
            )
            result = self.engine.resize_kv_cache(plan.num_blocks)
            self.runtime.plan = plan
            self.last_resize = result
            if persist:
                from kvroom.artifact.resize import set_kvcache_num_blocks

                set_kvcache_num_blocks(self.runtime.info.folder, plan.num_blocks)
        logger.info(
            "KV cache resized: %d -> %d blocks (%s); %d blocks moved, %d sequences preempted, "
            "%.1f ms%s",
            result.from_blocks,
            result.to_blocks,
            why,
            result.num_moved_blocks,
            result.num_preempted,
            result.seconds * 1e3,
            ", persisted" if persist else "",
        )
        return result


def start_elastic(pool: LivePool, policy: ElasticPolicy | None) -> ElasticController | None:
    """Start the elastic controller over ``pool`` (None without a policy)."""
    if policy is None:
        return None
    controller = ElasticController(
        policy,
        current=lambda: pool.engine.stats.num_total_blocks,
        apply=lambda n, why: pool.resize(n, why=f"elastic {why}", source="elastic"),
    )
    controller.start()
    logger.info(
        "elastic KV pool: %d..%d blocks, keeping %d MiB free (hysteresis %d MiB)",
        policy.min_num_blocks,
        policy.max_num_blocks,
        policy.reserve_bytes // 2**20,
        policy.hysteresis_bytes // 2**20,
    )
    return controller


def install_admin(app: FastAPI, pool: LivePool, admin_key: str | None) -> None:
    """Serve the admin routes of ``pool`` on ``app`` (404 for all of them without a key)."""
    app.state.kvroom_admin = (pool, admin_key)
    app.include_router(router)


def authorized(request: Request) -> Any:
    """What ``app.state.kvroom_admin`` holds (the ``LivePool``, or a multi-model server's
    models) once the admin key checks out; 404 without a key, 403 with a wrong one."""
    pool, key = request.app.state.kvroom_admin
    if key is None:
        raise ApiError(404, "admin endpoints are off; start with --admin-key", code="not_found")
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise ApiError(403, "admin endpoint: missing or wrong admin key", code="forbidden")
    return pool


@router.get("/kv_cache")
async def get_kv_cache(request: Request) -> JSONResponse:
    """The pool now: blocks, tokens, bytes, used, free, the plan it came from, resizes."""
    return JSONResponse(authorized(request).state().to_dict())


@router.post("/kv_cache")
async def post_kv_cache(request: Request) -> JSONResponse:
    """Resize the pool; answers once the resize is complete, with the new state."""
    pool = authorized(request)  # before the body is read: no key, no validation messages
    try:
        body = ResizeRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "body"
        message = f'{field}: {first["msg"]}; send {{"num_blocks": N | "auto", "persist": bool}}'
        raise ApiError(400, message, param=field) from exc
    try:
        result = await asyncio.to_thread(
            pool.resize, body.num_blocks, why="admin request", persist=body.persist
        )
    except KvroomError as exc:
        raise ApiError(400, " ".join(str(exc).split()), param="num_blocks") from exc
    state = pool.state().to_dict()
    state["resize"] = result.__dict__.copy()
    return JSONResponse(state)
