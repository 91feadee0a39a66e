"""The engine loop: one thread owns the ``LLMEngine`` (and so the KV pool); asyncio talks to it.

::

    HTTP handler (event loop)            engine loop thread
    -------------------------            -------------------------------------------------
    add_request() --_Add--> submit queue -> engine.add_request()  (AdmissionError or OK
         await admitted  <----------------   resolves the handler's future)
    async for out in stream              -> engine.step() -> outputs grouped per event loop,
         queue.get()     <----------------   one call_soon_threadsafe per loop and step
    stream.close()  --_Abort--> same queue -> engine.abort()  (blocks freed at once)
    resize_kv_cache() --_Resize--> queue  -> engine.resize_kv_cache()  (between two steps;
         future.result() <----------------   the new stats are published before it resolves)

Only the loop thread touches the engine. Commands go through one FIFO, so an abort can never
overtake the add it cancels. With no commands and no live request the thread sleeps on a
condition variable: an idle server spins nothing. ``stats`` is a snapshot the thread publishes
after every step and before delivering its outputs, so ``/metrics`` never reads the scheduler
while it changes, and a client that has its last token already sees that request's blocks free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvroom.engine.engine import EngineStats, LLMEngine, RequestOutput
from kvroom.engine.kv.migration import ResizeResult
from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import AdmissionError, KvroomError

logger = logging.getLogger("kvroom")

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an unexpected exception (a kvroom bug); see the log."""


class EngineClosedError(RuntimeError):
    """The engine loop is shutting down and takes no new requests."""


@dataclass
class _Sink:
    """Where one request's outputs go: a queue (and an admission future) on its event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    admitted: asyncio.Future[None] | None = None


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: _Sink
    multimodal: Any = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Resize:
    num_blocks: int
    done: concurrent.futures.Future[ResizeResult]


@dataclass(frozen=True)
class _Call:
    """Run ``fn(engine)`` between two steps (cache maintenance)."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]


_Command = _Add | _Abort | _Resize | _Call


class RequestStream:
    """The outputs of one request, as an async iterator; ``close()`` aborts it if unfinished."""

    def __init__(self, engine: AsyncEngine, request_id: str, sink: _Sink) -> None:
        self.request_id = request_id
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        """'stop', 'length' or 'abort' once finished (also 'abort' after ``close()``)."""
        self._engine = engine
        self._sink = sink

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            self._finish("abort")
            raise item
        if item.new_token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if item.finished:
            self._finish(item.finish_reason or "abort")
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (the client went away, or gave up)."""
        if not self.finished:
            self._finish("abort")
            self._engine.abort(self.request_id)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.finish_time = time.monotonic()


class AsyncEngine:
    """Runs an ``LLMEngine`` on its own thread and streams each request to an asyncio queue."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._routes: dict[str, _Sink] = {}  # loop thread only
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = engine.stats
        self._thread = threading.Thread(target=self._run, name="kvroom-engine-loop", daemon=True)

    # -- any thread ----------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot the loop published (blocks, queues, counters)."""
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort what is still live, deliver the abort outputs, and stop the loop thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op if unknown or finished); its blocks are freed by the loop."""
        self._submit(_Abort(request_id), check=False)

    def resize_kv_cache(self, num_blocks: int, timeout: float | None = None) -> ResizeResult:
        """Resize the KV pool between two steps of the loop; blocks until it is done.

        Call it from any thread but the loop's (the admin handlers use ``asyncio.to_thread``).

        Raises:
            KvroomError: the engine refused the size (nothing changed).
            EngineClosedError / EngineDeadError: as for ``add_request``.
        """
        done: concurrent.futures.Future[ResizeResult] = concurrent.futures.Future()
        self._submit(_Resize(num_blocks, done))
        return done.result(timeout)

    def reset_prefix_cache(self, timeout: float | None = None) -> int:
        """Forget the prefix cache between two steps; blocks until done (any thread but the
        loop's). Returns the cached-free blocks dropped."""
        return self.run_between_steps(lambda engine: engine.reset_prefix_cache(), timeout)

    def run_between_steps(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """``fn(engine)`` on the loop thread between two steps; blocks until done (any thread
        but the loop's). An exception in ``fn`` stops the loop, as a failing step does."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(_Call(fn, done))
        return done.result(timeout)

    # -- event-loop side -----------------------------------------------------------------

    async def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        multimodal: Any = None,
    ) -> RequestStream:
        """Submit a request and wait until the engine has queued it.

        Raises:
            AdmissionError: the engine can never serve it (too long, larger than the pool).
            EngineClosedError: the server is shutting down.
            EngineDeadError: the engine loop has died.
        """
        loop = asyncio.get_running_loop()
        sink = _Sink(loop, admitted=loop.create_future())
        self._submit(_Add(request_id, prompt_token_ids, params, sink, multimodal))
        try:
            await sink.admitted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, sink)

    def _submit(self, command: _Command, *, check: bool = True) -> None:
        with self._cond:
            if check and self._error is not None:
                raise EngineDeadError("the engine loop has stopped; see the server log")
            if check and self._stopping:
                raise EngineClosedError("the server is shutting down")
            self._commands.append(command)
            self._cond.notify()

    # -- loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._next_pass():
                pass
        except BaseException as exc:
            logger.exception("kvroom engine loop died; failing every live request")
            self._fail_all(exc)

    def _next_pass(self) -> bool:
        """Apply queued commands, run one step if anything is live; False once stopped."""
        commands, stopping = self._wait_for_work()
        for command in commands:
            self._apply(command)
        if stopping:
            self._drain()
            return False
        outputs = self._engine.step() if self._engine.has_unfinished() else []
        self._stats = self._engine.stats  # before delivery: a finished client sees its blocks freed
        self._deliver(outputs)
        return True

    def _wait_for_work(self) -> tuple[list[_Command], bool]:
        with self._cond:
            while not (self._commands or self._stopping or self._engine.has_unfinished()):
                self._cond.wait()
            commands = list(self._commands)
            self._commands.clear()
            return commands, self._stopping

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Abort):
            self._engine.abort(command.request_id)
            return
        if isinstance(command, _Resize):
            self._resize(command)
            return
        if isinstance(command, _Call):
            self._call(command)
            return
        if command.sink.loop.is_closed():
            return  # its handler's event loop is gone: nobody would read the outputs
        try:
            self._engine.add_request(
                command.prompt_token_ids,
                command.params,
                request_id=command.request_id,
                multimodal=command.multimodal,
            )
        except AdmissionError as exc:
            _resolve(command.sink, exc)
            return
        self._routes[command.request_id] = command.sink
        _resolve(command.sink, None)

    def _resize(self, command: _Resize) -> None:
        try:
            result = self._engine.resize_kv_cache(command.num_blocks)
        except KvroomError as exc:
            command.done.set_exception(exc)
            return
        except BaseException as exc:
            command.done.set_exception(exc)
            raise
        self._stats = self._engine.stats
        command.done.set_result(result)

    def _call(self, command: _Call) -> None:
        try:
            result = command.fn(self._engine)
        except BaseException as exc:
            command.done.set_exception(exc)
            raise
        self._stats = self._engine.stats
        command.done.set_result(result)

    def _drain(self) -> None:
        """Shutdown: abort every live request and deliver the abort outputs."""
        for request_id in list(self._routes):
            self._engine.abort(request_id)
        while self._engine.has_unfinished():
            outputs = self._engine.step()
            self._stats = self._engine.stats
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its request's queue: one thread-safe call per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, RequestOutput]]]
        batches = defaultdict(list)
        for out in outputs:
            sink = self._routes.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._routes[out.request_id]
            batches[sink.loop].append((sink, out))
        for loop, items in batches.items():
            self._post(loop, items)

    def _post(
        self, loop: asyncio.AbstractEventLoop, items: list[tuple[_Sink, RequestOutput]]
    ) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:
            if not loop.is_closed():
                raise
            # Nobody can read these any more (their event loop is gone): free their blocks.
            for _, out in items:
                self._routes.pop(out.request_id, None)
                self._engine.abort(out.request_id)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            pending = [c.sink for c in self._commands if isinstance(c, _Add)]
            resizes = [c.done for c in self._commands if isinstance(c, _Resize)]
            self._commands.clear()
        dead = EngineDeadError(f"the engine loop died: {exc!r}")
        dead.__cause__ = exc
        for done in resizes:
            done.set_exception(dead)
        for sink in [*self._routes.values(), *pending]:
            if not sink.loop.is_closed():
                sink.loop.call_soon_threadsafe(_fail, sink, dead)
        self._routes.clear()


def _resolve(sink: _Sink, error: BaseException | None) -> None:
    sink.loop.call_soon_threadsafe(_set_admitted, sink, error)


def _set_admitted(sink: _Sink, error: BaseException | None) -> None:
    """On the event loop: settle the admission future unless its handler was cancelled."""
    future = sink.admitted
    if future is None or future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _fail(sink: _Sink, error: BaseException) -> None:
    _set_admitted(sink, error)
    sink.queue.put_nowait(error)


def _put_all(items: list[tuple[_Sink, RequestOutput]]) -> None:
    for sink, out in items:
        sink.queue.put_nowait(out)
