"""``--api-key``: a bearer token required on ``/v1/*``, as vLLM's server does it.

The token is compared with ``hmac.compare_digest`` (constant time: how long the check takes
says nothing about how much of a guess was right). A missing or wrong token is a 401 in the
OpenAI error shape. ``/health``, ``/metrics`` and the tokenizer routes stay open, as in vLLM;
``/reset_prefix_cache`` needs the key too.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvroom.server.openai.errors import error_response
from kvroom.server.openai.protocol import ApiError

PROTECTED_PATHS = frozenset({"/reset_prefix_cache"})
"""Routes outside ``/v1`` that need the key as well."""

API_KEY_ENV = "KVROOM_API_KEY"
"""The environment variable ``kvroom serve`` reads when ``--api-key`` is not given."""


def add_api_key_check(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_api_key(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        path = request.url.path
        if request.method == "OPTIONS" or not (path.startswith("/v1") or path in PROTECTED_PATHS):
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return error_response(
                ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error",
                    code="invalid_api_key",
                )
            )
        return await call_next(request)
