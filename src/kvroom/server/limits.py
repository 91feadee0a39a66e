"""The request body cap (``--max-request-bytes``): a larger body is a 413, never parsed.

A plain ASGI middleware, so it sees the body as it arrives: a ``Content-Length`` over the cap
is refused before a byte is read, and a chunked body is refused as soon as it passes the cap.
"""

from __future__ import annotations

from typing import Any

from kvroom.server.openai.errors import error_response
from kvroom.server.openai.protocol import ApiError

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""32 MiB: far above any prompt that fits a context window, far below what hurts memory."""

Scope = dict[str, Any]
Receive = Any
Send = Any


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    """Refuses HTTP request bodies larger than ``max_bytes`` with an OpenAI-shaped 413."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0
        started = False

        async def counted_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = ApiError(
            413,
            f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)",
            code="request_too_large",
        )
        await error_response(error)(scope, receive, send)
