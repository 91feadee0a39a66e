"""64 concurrent streaming clients on a pool deliberately too small for them, within a minute.

The tiny artifact (max_seq_len 64, batch 4, blocks of 4 tokens) is started with
``--kvcache-num-blocks 20``: four running requests of up to ~55 tokens (14 blocks each) cannot
all grow at once, so the scheduler must preempt, and 60 of the 64 requests must queue for a
seat. Every request must still return exactly its solo greedy output.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_harness import ServerProcess

from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM

pytestmark = pytest.mark.server

MODEL = "tiny"
NUM_BLOCKS = 20
NUM_CLIENTS = 64
WORKLOAD = [("ab" * (1 + i % 6) + "c" * (i // 6), 24 + (i * 5) % 17) for i in range(16)]
"""16 distinct (prompt, max_tokens) pairs, each sent by 4 clients: prompts of 1 to 8 tokens
("ab" is one token of the tiny tokenizer), 24 to 40 new tokens, so up to 12 blocks each."""
MAX_PEAK_RSS_BYTES = 2**30
MAX_RSS_GROWTH_BYTES = 300 * 2**20


@pytest.fixture(scope="module")
def server(
    tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    flags = ("--served-model-name", MODEL, "--kvcache-num-blocks", str(NUM_BLOCKS))
    proc = ServerProcess.start(tiny_artifact, tmp_path_factory.mktemp("server"), *flags)
    yield proc
    assert proc.terminate() == 0, proc.log


@pytest.fixture(scope="module")
def solo_outputs(tiny_artifact: Path) -> dict[tuple[str, int], str]:
    """Each workload item run alone through ``LLM.generate`` (greedy, EOS ignored)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(tiny_artifact)
    outputs = {}
    for prompt, max_tokens in WORKLOAD:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        (out,) = llm.generate(prompt, params)
        outputs[(prompt, max_tokens)] = out.text
    torch.set_num_threads(threads)
    return outputs


async def stream_one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, reason = "", ""
    async for chunk in stream:
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


async def max_waiting_while(server: ServerProcess, done: asyncio.Event) -> float:
    """Sample ``kvroom_num_requests_waiting`` every 50 ms until ``done``; the largest seen."""
    largest = 0.0
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        while not done.is_set():
            text = (await http.get("/metrics")).text
            line = next(ln for ln in text.splitlines() if ln.startswith("kvroom_num_requests_wait"))
            largest = max(largest, float(line.split()[-1]))
            await asyncio.sleep(0.05)
    return largest


async def run_load(server: ServerProcess) -> tuple[list[tuple[str, str] | BaseException], float]:
    jobs = [WORKLOAD[i % len(WORKLOAD)] for i in range(NUM_CLIENTS)]
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
    http = httpx.AsyncClient(limits=limits, timeout=60)
    done = asyncio.Event()
    async with server.async_client(http_client=http) as client:
        sampler = asyncio.create_task(max_waiting_while(server, done))
        results = await asyncio.wait_for(
            asyncio.gather(*(stream_one(client, p, m) for p, m in jobs), return_exceptions=True),
            timeout=60,
        )
        done.set()
        return results, await sampler


def test_64_streaming_clients_on_a_small_pool(server, solo_outputs, record_property):
    before = server.metrics()
    assert before["kvroom_kv_cache_num_blocks"] == NUM_BLOCKS
    rss_before = server.rss_bytes()
    start = time.monotonic()
    results, max_waiting = asyncio.run(run_load(server))
    elapsed = time.monotonic() - start

    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    jobs = [WORKLOAD[i % len(WORKLOAD)] for i in range(NUM_CLIENTS)]
    for (prompt, max_tokens), (text, reason) in zip(jobs, results, strict=True):  # type: ignore[misc]
        assert text == solo_outputs[(prompt, max_tokens)], prompt
        assert reason == "length"

    after = server.metrics()
    assert server.wait_for_metric("kvroom_kv_cache_num_free_blocks", NUM_BLOCKS) == NUM_BLOCKS
    assert after["kvroom_num_preemptions_total"] > before["kvroom_num_preemptions_total"]
    assert max_waiting > 0, "no request ever queued"
    assert after['kvroom_request_success_total{finished_reason="length"}'] == NUM_CLIENTS
    assert after['kvroom_request_success_total{finished_reason="abort"}'] == 0
    assert after["kvroom_num_requests_running"] == after["kvroom_num_requests_waiting"] == 0

    peak, growth = server.peak_rss_bytes(), server.rss_bytes() - rss_before
    record_property("peak_rss_mib", round(peak / 2**20))
    record_property("load_seconds", round(elapsed, 2))
    print(
        f"\n64 clients in {elapsed:.1f}s, {after['kvroom_num_preemptions_total']:.0f} preemptions, "
        f"max {max_waiting:.0f} waiting, server peak RSS {peak / 2**20:.0f} MiB "
        f"(growth under load {growth / 2**20:+.0f} MiB)"
    )
    assert peak < MAX_PEAK_RSS_BYTES
    assert growth < MAX_RSS_GROWTH_BYTES
    assert "Traceback" not in server.log, server.log
