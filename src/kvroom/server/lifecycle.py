"""Running an app under uvicorn: bound socket, graceful shutdown, aborts at the deadline."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from kvroom.server.openai.routing import ModelRouter

logger = logging.getLogger("kvroom")

ABORT_GRACE_S = 10.0
"""After the deadline's aborts, how long handlers get to send their last bytes (the engine
finishes the step it is in first) before uvicorn cancels what is still running."""


class _Server(uvicorn.Server):
    """uvicorn's server, with two changes for ``kvroom serve``:

    - a SIGTERM/SIGINT that stopped it gracefully is not raised again afterwards (uvicorn
      re-raises it, so the process would die of the signal): ``kvroom serve`` exits 0;
    - at the shutdown deadline the engine aborts every live request, so each ends as a
      response (``finish_reason`` "abort"; a stream then sends ``[DONE]``) instead of a
      cancelled handler (a bare 500, a cut stream and a traceback).
    """

    def __init__(self, config: uvicorn.Config, models: ModelRouter, deadline_s: float) -> None:
        super().__init__(config)
        self.models = models
        self.deadline_s = deadline_s

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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.get_running_loop().call_later(self.deadline_s, self._abort_live)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _abort_live(self) -> None:
        engines = self.models.engines()
        live = sum(e.stats.num_running + e.stats.num_waiting for e in engines)
        if live:
            logger.warning(
                "shutdown: %d request(s) still running after --shutdown-timeout %gs; aborting them",
                live,
                self.deadline_s,
            )
        for engine in engines:
            engine.shutdown(timeout=0)  # stop taking requests, abort and deliver the rest


def serve(
    app: FastAPI,
    sock: socket.socket,
    *,
    access_log: bool = True,
    shutdown_timeout_s: float = 30.0,
) -> None:
    """Serve ``app`` on the bound socket ``sock`` until SIGTERM/SIGINT.

    On the signal: stop accepting, let in-flight requests finish for up to
    ``shutdown_timeout_s`` seconds, then abort what is left (each request still gets its
    answer, with ``finish_reason`` "abort"), stop the engine loop, return.
    """
    config = uvicorn.Config(
        app,
        loop="auto",  # uvloop and httptools where installed: a streamed token costs the
        http="auto",  # event loop less than asyncio's pure-Python loop and h11's framing
        lifespan="on",
        access_log=access_log,
        timeout_graceful_shutdown=shutdown_timeout_s + ABORT_GRACE_S,  # type: ignore[arg-type]
    )
    _Server(config, app.state.kvroom_models, shutdown_timeout_s).run(sockets=[sock])
