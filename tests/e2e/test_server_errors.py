"""Every bad input gets an OpenAI error body with a 4xx, and the server keeps serving.

The server is ``create_app(LLM(tiny_artifact))`` under uvicorn on a thread of this process
(127.0.0.1, free port): the same HTTP stack as ``kvroom serve`` without a second start-up.
Each case checks the status, the body's shape, the parameter named, the message, and that a
normal request succeeds right after.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from server_harness import ThreadServer

from kvroom.llm import LLM
from kvroom.server.app import create_app

pytestmark = pytest.mark.server

MODEL = "tiny"
LONG_TEXT = "xq " * 40  # 120 byte-level tokens (no merge covers "xq"): over max_seq_len 64


@pytest.fixture(scope="module")
def server(tiny_artifact: Path) -> Iterator[ThreadServer]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    app = create_app(LLM(tiny_artifact), served_model_name=MODEL)
    server = ThreadServer(app)
    yield server
    server.stop()
    torch.set_num_threads(threads)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def without(body: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != name}


C, CHAT = "/v1/completions", "/v1/chat/completions"

# (id, path, body (dict, or raw text), status, param, message regex)
CASES = [
    ("malformed-json", C, '{"prompt": "hi",', 400, None, r"^malformed JSON body: "),
    ("body-not-object", C, "[1, 2]", 400, None, r"^the request body must be a JSON object$"),
    ("empty-body", C, "", 400, None, r"^the request body must be a JSON object$"),
    ("missing-prompt", C, without(completion(), "prompt"), 400, "prompt", r"missing.*'prompt'"),
    ("missing-messages", CHAT, without(chat(), "messages"), 400, "messages", r"'messages'$"),
    ("prompt-wrong-type", C, completion(prompt=5), 400, "prompt", r"^invalid 'prompt': .*got 5"),
    ("max-tokens-string", C, completion(max_tokens="4"), 400, "max_tokens", r"valid integer"),
    ("max-tokens-bool", C, completion(max_tokens=True), 400, "max_tokens", r"valid integer"),
    ("temperature-string", C, completion(temperature="hot"), 400, "temperature", r"number"),
    ("messages-string", CHAT, chat(messages="hi"), 400, "messages", r"valid list"),
    ("bad-role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages", "role"),
    ("no-messages", CHAT, chat(messages=[]), 400, "messages", r"at least 1 item"),
    ("max-tokens-zero", C, completion(max_tokens=0), 400, "max_tokens", r">= 1|equal to 1"),
    ("max-tokens-negative", C, completion(max_tokens=-5), 400, "max_tokens", r"equal to 0"),
    ("chat-max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", r"equal to 1"),
    (
        "max-tokens-huge",
        C,
        completion(max_tokens=10**12),
        400,
        "max_tokens",
        r"\+ max_tokens \(1000000000000\) = \d+ exceeds max_seq_len \(64\)",
    ),
    (
        "prompt-too-long",
        C,
        completion(prompt=LONG_TEXT),
        400,
        "prompt",
        r"^prompt_len \(120\) \+ max_tokens \(4\) = 124 exceeds max_seq_len \(64\)",
    ),
    (
        "chat-prompt-too-long",
        CHAT,
        chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        "messages",
        r"leaves no room to generate within max_seq_len \(64\)",
    ),
    ("empty-prompt", C, completion(prompt=""), 400, "prompt", r"^the prompt is empty; send"),
    ("token-id-outside-vocab", C, completion(prompt=[1, 300]), 400, "prompt", r"\[0, 300\)"),
    ("empty-prompt-list", C, completion(prompt=[]), 400, "prompt", r"'prompt' is empty"),
    ("temperature-above-2", C, completion(temperature=5), 400, "temperature", r"less than or"),
    ("top-p-zero", C, completion(top_p=0), 400, "top_p", r"greater than 0"),
    ("unknown-model", C, completion(model="gpt-4"), 404, "model", r"'gpt-4' does not exist"),
    ("n-above-batch", C, completion(n=5), 400, "n", r"'n' is 5, .* at most 4 .*batch_size"),
    ("n-zero", C, completion(n=0), 400, "n", r"greater than or equal to 1"),
    ("best-of-below-n", C, completion(n=3, best_of=2), 400, "best_of", r">= n \(3\)"),
    ("best-of-stream", C, completion(n=1, best_of=2, stream=True), 400, "best_of", "streamed"),
    ("logprobs-21", C, completion(logprobs=21), 400, "logprobs", r"less than or equal to 20"),
    ("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "20"),
    ("top-logprobs-alone", CHAT, chat(top_logprobs=2), 400, "top_logprobs", r"needs 'logprobs'"),
    ("penalty", CHAT, chat(presence_penalty=3), 400, "presence_penalty", r"less than or equal"),
    ("repetition-zero", C, completion(repetition_penalty=0), 400, "repetition_penalty", "than 0"),
    ("logit-bias-key", C, completion(logit_bias={"x": 1}), 400, "logit_bias", r"'x' is not"),
    ("logit-bias-vocab", C, completion(logit_bias={"999": 1}), 400, "logit_bias", r"\[0, 300\)"),
    ("stop-id-vocab", C, completion(stop_token_ids=[300]), 400, "stop_token_ids", r"300"),
    ("min-tokens", C, completion(min_tokens=9), 400, "min_tokens", r"max_tokens=4"),
    ("tools", CHAT, chat(tools=[{"type": "function"}]), 400, "tools.0.function", r"missing"),
    ("unknown-field", C, completion(foo=1, bar=2), 400, "foo", r"'foo', 'bar'"),
    ("empty-stop-string", C, completion(stop=[""]), 400, "stop", r"at least 1 character"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input_is_an_openai_error_and_the_server_stays_up(
    server, path, body, status, param, message
):
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, str) else {"json": body}
    response = server.post(path, headers={"content-type": "application/json"}, **kwargs)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert isinstance(error["code"], str)
    assert re.search(message, error["message"]), error["message"]
    ok = server.post(C, json=completion(temperature=0))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


def test_the_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert not_found.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=9)
    assert bad.value.body["param"] == "n"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


def test_a_request_that_cannot_fit_is_rejected_not_queued(server):
    """prompt + max_tokens beyond max_seq_len is the engine's AdmissionError: 400 at once."""
    response = server.post(C, json=completion(max_tokens=61, prompt=[5, 6, 7, 8]))
    assert response.status_code == 400
    assert "shorten the prompt or lower max_tokens" in response.json()["error"]["message"]
    metrics = server.metrics()
    assert metrics["kvroom_num_requests_waiting"] == metrics["kvroom_num_requests_running"] == 0
    assert server.post(C, json=completion(max_tokens=60, prompt=[5, 6, 7, 8])).status_code == 200


def test_unknown_routes_and_methods_are_openai_errors(server):
    missing = server.get("/v1/nothing")
    assert missing.status_code == 404 and set(missing.json()["error"]) >= {"message", "type"}
    wrong_method = server.get(C)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
