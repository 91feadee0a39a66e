"""``POST /reset_prefix_cache`` (vLLM's route): forget every cached KV block.

Running requests keep their blocks; only the cached-free blocks are dropped and no later
request can hit what was cached before. The answer is 200 with how many blocks were dropped
(summed over the models a multi-model server has loaded).
When the server has an ``--api-key``, the route needs it too (``server/auth.py``): resetting
the cache slows every client down, so it is not left open as vLLM's dev-mode route is.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()

RESET_PREFIX_CACHE = "/reset_prefix_cache"


@router.post(RESET_PREFIX_CACHE)
async def reset_prefix_cache(request: Request) -> JSONResponse:
    """Reset between two engine steps; answers once done."""
    dropped = 0
    for engine in request.app.state.kvroom_models.engines():
        dropped += await asyncio.to_thread(engine.reset_prefix_cache)
    return JSONResponse({"num_dropped_blocks": dropped})
