"""vLLM's sampling parameters over HTTP with the official ``openai`` client.

One in-process server (``ThreadServer``) on the tiny artifact; the oracle is ``LLM.generate``
on the same artifact with the same ``SamplingParams``: logprobs, echo, prompt lists, ``n``,
penalties and the tokenizer routes must agree with the offline API.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from server_harness import ThreadServer

from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM
from kvroom.server.app import create_app

pytestmark = pytest.mark.server

MODEL = "tiny"
IDS = [[5, 6, 7, 8, 9], [20, 21, 22]]


@pytest.fixture(scope="module")
def llm(tiny_artifact: Path) -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(tiny_artifact)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(tiny_artifact: Path, llm: LLM) -> Iterator[ThreadServer]:
    server = ThreadServer(create_app(LLM(tiny_artifact), served_model_name=MODEL))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ThreadServer) -> openai.OpenAI:
    return server.client()


def offline(llm: LLM, prompt: list[int], **params: Any) -> Any:
    return llm.generate([prompt], SamplingParams(**params))[0]


def test_completion_logprobs_match_the_offline_api(client: openai.OpenAI, llm: LLM) -> None:
    out = client.completions.create(
        model=MODEL, prompt=IDS[0], max_tokens=4, temperature=0, logprobs=2
    )
    ref = offline(llm, IDS[0], max_tokens=4, temperature=0, logprobs=2).outputs[0]
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 4
    expected = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_lp == pytest.approx(max(top.values()))  # greedy: the token is the top one


def test_echo_gives_prompt_logprobs_first_null_as_lm_eval_reads_them(
    client: openai.OpenAI, llm: LLM
) -> None:
    out = client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    for prompt, choice in zip(IDS, out.choices, strict=True):
        lp = choice.logprobs
        assert lp is not None and len(lp.token_logprobs) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = offline(llm, prompt, max_tokens=1, temperature=0, prompt_logprobs=1)
        expected = [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i]
        assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-5)
        assert choice.text.startswith(llm.tokenizer.decode(prompt))


def test_echo_also_returns_vllm_prompt_logprobs(client: openai.OpenAI) -> None:
    """vLLM turns ``echo`` + ``logprobs=k`` into ``prompt_logprobs=k`` and returns them too."""
    out = client.completions.create(
        model=MODEL, prompt=IDS[0], max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = out.choices[0]
    prompt_lps = choice.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(prompt_lps) == len(IDS[0]) and prompt_lps[0] is None
    token_lps = choice.logprobs.token_logprobs  # type: ignore[union-attr]
    for i, (token, entry) in enumerate(zip(IDS[0][1:], prompt_lps[1:], strict=True), start=1):
        assert entry[str(token)]["logprob"] == pytest.approx(token_lps[i])
        assert 1 <= len(entry) <= 2 and {"logprob", "rank", "decoded_token"} == set(
            entry[str(token)]
        )


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_alone(
    client: openai.OpenAI, llm: LLM, stream: bool
) -> None:
    """vLLM's answer to ``echo`` with ``max_tokens: 0``: the prompt and its logprobs, no
    completion (one token is generated, counted in usage, and dropped)."""
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": IDS[0], "max_tokens": 0}
    kwargs.update(temperature=0, logprobs=1, echo=True)
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]  # type: ignore[union-attr]
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
        tokens = out.choices[0].logprobs.tokens  # type: ignore[union-attr]
        assert out.usage is not None and out.usage.completion_tokens == 1
    assert text == llm.tokenizer.decode(IDS[0])
    assert len(tokens) == len(IDS[0]) and finish == "length"


def test_max_tokens_0_without_echo_is_a_400(server: ThreadServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 0}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "0 only with echo" in error["message"]


def test_prompt_lists_times_n_are_numbered_as_openai(client: openai.OpenAI, llm: LLM) -> None:
    out = client.completions.create(
        model=MODEL, prompt=["hello world", "a b"], n=2, max_tokens=5, temperature=0.9, seed=11
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, text in enumerate(["hello world", "a b"]):
        ids = llm.tokenizer(text)["input_ids"]
        ref = offline(llm, ids, n=2, max_tokens=5, temperature=0.9, seed=11)
        assert [c.text for c in out.choices[2 * i : 2 * i + 2]] == [o.text for o in ref.outputs]
    prompt_tokens = sum(len(llm.tokenizer(t)["input_ids"]) for t in ["hello world", "a b"])
    assert out.usage is not None and out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 20


def test_chat_logprobs_with_top_logprobs_and_bytes(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))


def test_chat_top_logprobs_put_the_sampled_token_first_as_vllm(client: openai.OpenAI) -> None:
    """vLLM's chat ``top_logprobs``: the chosen token, then the most likely ones, ``k`` in all.
    Sampled hot, many chosen tokens are not the most likely one."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=12,
        temperature=2.0,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 12
    not_top = 0
    for entry in content:
        assert len(entry.top_logprobs) == 2
        first, second = entry.top_logprobs
        assert first.logprob == pytest.approx(entry.logprob)
        not_top += second.logprob > first.logprob
    assert not_top > 0  # the case where this order differs from "most likely first"


def test_streamed_n_with_logprobs_adds_up_to_the_whole_response(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "prompt": "hello",
        "n": 2,
        "max_tokens": 6,
        "seed": 5,
        "logprobs": 1,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kwargs)
    texts, tokens = {0: "", 1: ""}, {0: 0, 1: 0}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += len(c.logprobs.tokens) if c.logprobs else 0
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert tokens == {0: 6, 1: 6}


def test_penalties_bias_and_vllm_extras_are_accepted(client: openai.OpenAI, llm: LLM) -> None:
    extra = {"repetition_penalty": 1.3, "min_tokens": 2, "min_p": 0.05, "top_k": 20}
    out = client.completions.create(
        model=MODEL,
        prompt=IDS[0],
        max_tokens=5,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"42": 2.0},
        extra_body=extra,
    )
    ref = offline(
        llm,
        IDS[0],
        max_tokens=5,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={42: 2.0},
        **extra,
    )
    assert out.choices[0].text == ref.text
    bench = client.completions.create(  # what `vllm bench serve` sends
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"repetition_penalty": 1.0}
    )
    assert bench.choices[0].finish_reason in ("length", "stop")  # unseeded: EOS may come


def test_tokenize_and_detokenize_in_vllm_shapes(server: ThreadServer, llm: LLM) -> None:
    body = server.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    ids = llm.tokenizer("hello world")["input_ids"]
    assert body == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
    back = server.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert back == {"prompt": llm.tokenizer.decode(ids)}
    messages = [{"role": "user", "content": "hi"}]
    chat = server.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == llm.apply_chat_template(messages)
    bad = server.post("/detokenize", json={"tokens": [999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_health_answers_while_a_10_mb_prompt_is_handled(server: ThreadServer) -> None:
    result: dict[str, Any] = {}

    def big() -> None:
        body = json.dumps({"model": MODEL, "prompt": "xq " * 3_500_000, "max_tokens": 2})
        headers = {"content-type": "application/json"}
        result["response"] = server.post("/v1/completions", content=body, headers=headers)

    thread = threading.Thread(target=big)
    thread.start()
    waits = []
    while thread.is_alive():
        start = time.monotonic()
        assert server.get("/health").status_code == 200
        waits.append(time.monotonic() - start)
    thread.join()
    assert max(waits) < 5.0, waits  # tokenizing 10 MB on the event loop held it 12.5 s
    response = result["response"]
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert response.json()["error"]["code"] == "context_length_exceeded"


@pytest.fixture(scope="module")
def guarded(tiny_artifact: Path) -> Iterator[ThreadServer]:
    app = create_app(LLM(tiny_artifact), api_key="s3cret", max_request_bytes=4096)
    server = ThreadServer(app)
    yield server
    server.stop()


def test_api_key_is_required_on_v1_only(guarded: ThreadServer) -> None:
    with pytest.raises(openai.AuthenticationError) as denied:
        guarded.client().models.list()
    assert denied.value.status_code == 401
    assert denied.value.body["code"] == "invalid_api_key"
    key = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="s3cret", max_retries=0)
    assert key.models.list().data
    assert guarded.get("/health").status_code == 200


def test_a_body_over_the_cap_is_a_413(guarded: ThreadServer) -> None:
    headers = {"authorization": "Bearer s3cret"}
    body = {"prompt": "x" * 5000, "max_tokens": 1}
    response = httpx.post(f"{guarded.base_url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert guarded.get("/health").status_code == 200
