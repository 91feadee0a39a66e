"""``kvroom serve`` driven by the official ``openai`` client on a tiny random model.

One server (a subprocess on 127.0.0.1, free port) serves every test here. The oracle is the
offline API: greedy output over HTTP must equal ``LLM.generate`` / ``LLM.chat`` on the same
artifact, token for token and character for character.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from server_harness import ServerProcess

from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM

pytestmark = pytest.mark.server

MODEL = "tiny"
PROMPTS = ["hello world", "the quick brown fox jumps", "a"]
GREEDY = {"temperature": 0}
ABORTED = 'kvroom_request_success_total{finished_reason="abort"}'
FREE = "kvroom_kv_cache_num_free_blocks"
GENERATED = "kvroom_generation_tokens_total"


@pytest.fixture(scope="module")
def server(
    tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    proc = ServerProcess.start(
        tiny_artifact, tmp_path_factory.mktemp("server"), "--served-model-name", MODEL
    )
    yield proc
    assert proc.terminate() == 0, proc.log


@pytest.fixture(scope="module")
def reference(tiny_artifact: Path) -> Iterator[LLM]:
    """The offline oracle, on one torch thread (the tiny model gains nothing from two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(tiny_artifact)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


def solo(llm: LLM, prompt: str | list[int], **params: object) -> tuple[str, str | None, int, int]:
    """(text, finish_reason, prompt tokens, output tokens) of one offline request."""
    (out,) = llm.generate(prompt, SamplingParams(**params))  # type: ignore[arg-type]
    return out.text, out.finish_reason, len(out.prompt_token_ids), len(out.token_ids)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_llm_generate(client, reference, prompt):
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, **GREEDY)
    text, reason, num_prompt, num_output = solo(reference, prompt, max_tokens=20, **GREEDY)
    assert got.object == "text_completion" and got.model == MODEL
    assert got.choices[0].text == text
    assert got.choices[0].finish_reason == reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (num_prompt, num_output)
    assert got.usage.total_tokens == num_prompt + num_output


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_completion_equals_llm_generate(client, reference, prompt):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text, reason, num_prompt, num_output = solo(reference, prompt, max_tokens=20, **GREEDY)
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in token_chunks) == text
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == reason
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == num_prompt
    assert usage_chunk.usage.completion_tokens == num_output


def test_token_id_prompt_equals_text_prompt(client, reference):
    ids = reference.tokenizer("hello world")["input_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, **GREEDY)
    by_text = client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_llm_chat(client, reference, stream):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    (want,) = reference.chat(messages, SamplingParams(max_tokens=16, **GREEDY))
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, stream=stream, **GREEDY
    )
    if stream:
        chunks = list(got)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].object == "chat.completion.chunk"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        assert got.object == "chat.completion"
        assert got.choices[0].message.role == "assistant"
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        text, reason = got.choices[0].message.content, got.choices[0].finish_reason
    assert (text, reason) == (want.text, want.finish_reason)


def test_chat_default_max_tokens_fills_the_context(client, reference):
    """No max_tokens: up to max_seq_len (64), as vLLM does; ignore_eos makes it exact."""
    messages = [{"role": "user", "content": "hi"}]
    got = client.chat.completions.create(
        model=MODEL, messages=messages, extra_body={"ignore_eos": True}, **GREEDY
    )
    prompt_len = len(reference.apply_chat_template(messages))
    assert got.usage.completion_tokens == 64 - prompt_len
    assert got.choices[0].finish_reason == "length"


def test_stop_string_cuts_text_like_llm_generate(client, reference):
    text, *_ = solo(reference, "hello world", max_tokens=24, ignore_eos=True, **GREEDY)
    stop = text[5:8]
    assert len(stop) == 3 and stop in text, text
    want, reason, *_ = solo(reference, "hello world", max_tokens=24, stop=stop, **GREEDY)
    for stream in (False, True):
        got = client.completions.create(
            model=MODEL, prompt="hello world", max_tokens=24, stop=[stop], stream=stream, **GREEDY
        )
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks) == want == text[: text.index(stop)]
        assert chunks[-1].choices[0].finish_reason == reason == "stop"


def test_seeded_sampling_is_reproducible_and_equals_llm_generate(client, reference):
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 16}
    first = client.completions.create(model=MODEL, prompt="hello", **params)
    second = client.completions.create(model=MODEL, prompt="hello", **params)
    text, *_ = solo(reference, "hello", **params)
    assert first.choices[0].text == second.choices[0].text == text


def test_models_and_health(server, client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.object == "model"
    assert card.model_extra["max_model_len"] == 64
    assert server.get("/health").status_code == 200


def test_metrics_exposes_pool_queues_and_counters(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL, prompt="hello", max_tokens=5, **GREEDY)
    after = server.metrics()
    assert after["kvroom_kv_cache_num_blocks"] == 64
    assert after[FREE] == 64 and after["kvroom_kv_cache_num_used_blocks"] == 0
    assert after["kvroom_num_requests_running"] == after["kvroom_num_requests_waiting"] == 0
    assert "kvroom_num_preemptions_total" in after
    assert after["kvroom_prompt_tokens_total"] - before["kvroom_prompt_tokens_total"] == 5
    assert after["kvroom_generation_tokens_total"] - before["kvroom_generation_tokens_total"] == 5
    count = "kvroom_e2e_request_latency_seconds_count"
    assert after[count] == before[count] + 1
    assert after["kvroom_time_to_first_token_seconds_count"] >= 1
    assert server.get("/metrics").headers["content-type"].startswith("text/plain")


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    """Four clients each read one chunk of a long stream and hang up: all four are aborted."""
    before = server.metrics()

    async def read_one_chunk_then_hang_up(client: openai.AsyncOpenAI) -> str:
        stream = await client.completions.create(
            model=MODEL,
            prompt="abc",
            max_tokens=60,
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
        async for chunk in stream:
            await stream.close()
            return chunk.choices[0].text
        raise AssertionError("the stream ended before its first chunk")

    async def main() -> None:
        async with server.async_client() as client:
            await asyncio.gather(*(read_one_chunk_then_hang_up(client) for _ in range(4)))

    asyncio.run(main())
    assert server.wait_for_metric(FREE, 64) == 64
    aborted = before[ABORTED] + 4
    assert server.wait_for_metric(ABORTED, aborted) == aborted
    after = server.metrics()
    assert after["kvroom_num_requests_running"] == 0
    generated = after[GENERATED] - before[GENERATED]
    assert generated < 4 * 60, f"{generated} tokens: the streams ran to the end"


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    before = server.metrics()
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=0.02).completions.create(
            model=MODEL, prompt="abc", max_tokens=60, extra_body={"ignore_eos": True}, **GREEDY
        )
    assert server.wait_for_metric(ABORTED, before[ABORTED] + 1) == before[ABORTED] + 1
    assert server.wait_for_metric(FREE, 64) == 64
    generated = server.metrics()[GENERATED] - before[GENERATED]
    assert generated < 60, f"{generated} tokens: the request ran to the end"
