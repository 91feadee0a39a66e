"""``GET/POST /kv_cache`` of a multi-model server (Bearer ``--admin-key``, as for one model).

``GET`` answers every model's pool (or ``{"loaded": false}`` once evicted), the budget and the
arbiter's last decisions. ``POST`` takes one of::

    {"model": NAME, "num_blocks": N, "pin": false}   resize one pool (within the budget);
                                                     pin: the arbiter leaves it at N until
                                                     the budget forces a shrink
    {"model": NAME, "pin": false}                    unpin: the arbiter may move it again
    {"memory_budget": "2GiB"}                        set the budget (the arbiter fits the
                                                     pools to it on its next tick)
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from kvroom.errors import KvroomError
from kvroom.server.admin import authorized
from kvroom.server.multi.models import MultiModels
from kvroom.server.openai.protocol import ApiError
from kvroom.units import parse_bytes

router = APIRouter()


class MultiResizeRequest(BaseModel):
    """Body of ``POST /kv_cache`` on a multi-model server."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    num_blocks: int | None = None
    pin: bool = False
    memory_budget: int | str | None = None


def install_multi_admin(app: FastAPI, models: MultiModels, admin_key: str | None) -> None:
    app.state.kvroom_admin = (models, admin_key)
    app.include_router(router)


def kv_cache_state(models: MultiModels) -> dict[str, Any]:
    """Every pool, the budget and the arbiter's last decisions (newest last)."""
    budget, pool_budget, _ = models.budget_now()
    pools: dict[str, Any] = {}
    for name, slot in models.slots.items():
        entry: dict[str, Any] = {"loaded": slot.live is not None, "pinned": slot.pinned}
        if slot.live is not None:
            entry |= slot.live.state().to_dict()
        entry |= {"priority": slot.cost.priority, "floor_blocks": slot.cost.min_blocks}
        entry |= {"num_loads": slot.num_loads, "num_evictions": slot.num_evictions}
        pools[name] = entry
    return {
        "memory_budget_bytes": budget,
        "memory_budget_source": models.budget.describe(),
        "kv_pool_budget_bytes": pool_budget,
        "held_bytes": models.held_bytes(),
        "models": pools,
        "decisions": list(models.decisions),
    }


@router.get("/kv_cache")
async def get_kv_cache(request: Request) -> JSONResponse:
    return JSONResponse(kv_cache_state(authorized(request)))


@router.post("/kv_cache")
async def post_kv_cache(request: Request) -> JSONResponse:
    models: MultiModels = authorized(request)
    body = _parse(await request.body())
    if body.memory_budget is not None:
        try:
            models.budget.set(parse_bytes(body.memory_budget, "memory_budget"))
        except KvroomError as exc:
            raise ApiError(400, str(exc), param="memory_budget") from exc
        await asyncio.to_thread(models.tick)
        return JSONResponse(kv_cache_state(models))
    if body.model is None:
        raise ApiError(400, "send 'model' (with 'num_blocks' or 'pin') or 'memory_budget'")
    slot = models.slot(body.model)
    if body.num_blocks is None:
        slot.pinned = body.pin
        return JSONResponse(kv_cache_state(models))
    try:
        result = await asyncio.to_thread(
            models.resize, body.model, body.num_blocks, pin=body.pin, why="admin request"
        )
    except KvroomError as exc:
        raise ApiError(400, " ".join(str(exc).split()), param="num_blocks") from exc
    state = kv_cache_state(models)
    state["resize"] = result.__dict__.copy()
    return JSONResponse(state)


def _parse(raw: bytes) -> MultiResizeRequest:
    try:
        return MultiResizeRequest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "body"
        hint = '{"model": NAME, "num_blocks": N, "pin": bool} or {"memory_budget": "2GiB"}'
        raise ApiError(400, f"{field}: {first['msg']}; send {hint}", param=field) from exc
