"""The engine loop in-process (no HTTP): streams, admission, abort, shutdown, death, idling.

Each test wraps a tiny artifact's ``LLMEngine`` in its own ``AsyncEngine`` and drives it from
``asyncio.run``; the oracle is ``LLM.generate`` on the same engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from prometheus_client import REGISTRY

from kvroom.engine.engine import RequestOutput
from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import AdmissionError
from kvroom.llm import LLM
from kvroom.server.app import create_app
from kvroom.server.async_engine import AsyncEngine, EngineClosedError, EngineDeadError

pytestmark = pytest.mark.server

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_artifact: Path) -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(tiny_artifact)
    torch.set_num_threads(threads)


@pytest.fixture
def loop_engine(llm: LLM) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(llm.runtime.engine)
    engine.start()
    yield engine
    engine.shutdown(10)
    assert not llm.runtime.engine.has_unfinished()


async def drain(engine: AsyncEngine, prompt: list[int], request_id: str) -> list[RequestOutput]:
    stream = await engine.add_request(prompt, GREEDY_32, request_id)
    return [out async for out in stream]


def test_streams_equal_llm_generate_and_free_their_blocks(llm, loop_engine):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(
            *(drain(loop_engine, p, f"r{i}") for i, p in enumerate(prompts))
        )

    streams = asyncio.run(main())
    stats = loop_engine.stats
    loop_engine.shutdown(10)  # the oracle below drives the same LLMEngine: one driver at a time
    assert stats.num_free_blocks == stats.num_total_blocks
    for prompt, outs in zip(prompts, streams, strict=True):
        (want,) = llm.generate(prompt, GREEDY_32)
        assert outs[-1].finished and outs[-1].output_token_ids == want.token_ids
        assert [t for o in outs for t in o.new_token_ids] == list(want.token_ids)


def test_admission_error_reaches_the_caller_and_nothing_is_queued(loop_engine):
    async def main() -> None:
        with pytest.raises(AdmissionError, match=r"exceeds max_seq_len \(64\)"):
            await loop_engine.add_request([5] * 40, GREEDY_32, "too-long")

    asyncio.run(main())
    assert loop_engine.stats.num_waiting == loop_engine.stats.num_running == 0


def test_close_mid_stream_aborts_and_frees_the_blocks(loop_engine):
    """The event loop stays open while we wait: only the abort can free the blocks early."""
    generated = loop_engine.stats.num_generation_tokens_total

    async def main() -> None:
        stream = await loop_engine.add_request([5, 6, 7], GREEDY_32, "gone")
        first = await stream.__anext__()
        assert first.new_token_ids and not first.finished
        stream.close()
        assert stream.finish_reason == "abort"
        deadline = time.monotonic() + 5
        while loop_engine.stats.num_free_blocks != loop_engine.stats.num_total_blocks:
            assert time.monotonic() < deadline, loop_engine.stats
            await asyncio.sleep(0.001)

    asyncio.run(main())
    assert loop_engine.stats.num_generation_tokens_total - generated < 32 / 2


def test_shutdown_aborts_live_requests_then_refuses_new_ones(llm):
    engine = AsyncEngine(llm.runtime.engine)
    engine.start()

    async def main() -> list[RequestOutput]:
        stream = await engine.add_request([5, 6, 7], GREEDY_32, "in-flight")
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown, 10)
        rest = [out async for out in stream]
        with pytest.raises(EngineClosedError, match="shutting down"):
            await engine.add_request([5], GREEDY_32, "late")
        return rest

    rest = asyncio.run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert not engine.is_alive
    assert engine.stats.num_free_blocks == engine.stats.num_total_blocks


def test_a_dying_engine_fails_its_streams_and_health(tiny_artifact, monkeypatch):
    llm = LLM(tiny_artifact)
    engine = AsyncEngine(llm.runtime.engine)

    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("boom")

    monkeypatch.setattr(llm.runtime.engine, "step", broken_step)
    engine.start()

    async def main() -> None:
        stream = await engine.add_request([5, 6], GREEDY_32, "doomed")
        with pytest.raises(EngineDeadError, match="boom") as dead:
            await stream.__anext__()
        assert isinstance(dead.value.__cause__, RuntimeError)
        with pytest.raises(EngineDeadError, match="has stopped"):
            await engine.add_request([5], GREEDY_32, "after")

    asyncio.run(main())
    assert not engine.is_alive


def test_the_idle_loop_sleeps(loop_engine):
    """No busy spin: an idle engine thread uses (almost) no CPU."""
    asyncio.run(drain(loop_engine, [5, 6], "warm-up"))
    native_id = loop_engine._thread.native_id
    process = psutil.Process()

    def cpu_s() -> float:
        (thread,) = [t for t in process.threads() if t.id == native_id]
        return thread.user_time + thread.system_time

    before = cpu_s()
    time.sleep(0.5)
    assert cpu_s() - before < 0.05


def test_each_app_has_its_own_metrics_registry(llm):
    first, second = create_app(llm), create_app(llm)
    assert first.state.kvroom.metrics.registry is not second.state.kvroom.metrics.registry
    assert REGISTRY.get_sample_value("kvroom_kv_cache_num_blocks") is None
    value = first.state.kvroom.metrics.registry.get_sample_value("kvroom_kv_cache_num_blocks")
    assert value == 64


def test_run_between_steps_runs_on_the_loop_thread_and_returns_its_result(loop_engine):
    ran = loop_engine.run_between_steps(lambda engine: (threading.current_thread().name, engine))
    assert ran == ("kvroom-engine-loop", loop_engine._engine)
