"""Structured outputs over HTTP with the official ``openai`` client on the tiny random model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_harness import ThreadServer

from kvroom.llm import LLM
from kvroom.server.app import create_app

pytestmark = pytest.mark.server

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_artifact: Path) -> Iterator[ThreadServer]:
    server = ThreadServer(create_app(LLM(tiny_artifact), served_model_name=MODEL))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ThreadServer) -> openai.OpenAI:
    return server.client()


def check(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"a", "b"} and 0 <= value["a"] <= 9 and isinstance(value["b"], bool)


def json_schema_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}}


def test_chat_response_format_json_schema(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=1.0, seed=4, n=2,
        response_format=json_schema_format(),
    )  # fmt: skip
    assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
    for choice in r.choices:
        check(choice.message.content)


def test_completions_response_format_and_vllm_fields(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=30, temperature=0,
        extra_body={"response_format": json_schema_format()},  # vLLM's extension on completions
    )  # fmt: skip
    check(r.choices[0].text)
    cases = [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
        ({"guided_regex": "x+y"}, r"x+y"),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, r"alpha|beta"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),
        ({"structured_outputs": {"grammar": 'root ::= "<" [a-c]+ ">"'}}, r"<[a-c]+>"),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, r"yes|no"),
        ({"guided_json": SCHEMA}, None),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, None),
    ]
    for extra, pattern in cases:
        r = client.completions.create(
            model=MODEL, prompt="hi", max_tokens=30, temperature=1.0, seed=2, extra_body=extra
        )
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop", (extra, text)
        if pattern is None:
            check(text)
        else:
            assert re.fullmatch(pattern, text), (extra, text)


def test_json_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert r.choices[0].message.content.startswith("{")
    text = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
        response_format={"type": "text"},
    ).choices[0].message.content  # fmt: skip
    assert not text.startswith("{")


def test_streamed_deltas_add_up_to_the_constrained_text(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0, stream=True,
        response_format=json_schema_format(),
    )  # fmt: skip
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    check("".join(parts))
    assert reasons[-1] == "stop"


BAD = [
    (
        {"guided_regex": "(a"},
        "guided_regex",
        r"^'guided_regex': the regular expression does not "
        r"compile: Regex parsing error at position 3: The parenthesis is not closed\.$",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format",
        r"^'response_format': the JSON schema does not "
        r'compile: Unsupported type "nope"$',
    ),
    (
        {"structured_outputs": {"grammar": "root ::= x"}},
        "structured_outputs",
        r"the grammar does not compile: EBNF parser error at line 1, column 10",
    ),
    (
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs",
        r"set exactly one of .*; got \['regex', 'choice'\]",
    ),
    (
        {"guided_regex": "a", "response_format": {"type": "json_object"}},
        "guided_regex",
        r"^'response_format', 'guided_regex' each constrain the output; set only one$",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", r"needs 'json_schema'"),
    ({"guided_json": "{bad"}, "guided_json", r"^'guided_json': the schema is not valid JSON"),
    ({"guided_regex": "a", "min_tokens": 1}, "min_tokens", r"must be unset with structured"),
    ({"response_format": {"type": "xml"}}, "response_format", r"'text', 'json_object'"),
]


@pytest.mark.parametrize(("extra", "param", "message"), BAD, ids=[b[1] for b in BAD])
def test_bad_constraints_are_400s_and_the_server_keeps_serving(
    server: ThreadServer, extra: dict[str, Any], param: str, message: str
) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
    ]:
        response = server.post(path, json={**body, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and re.search(message, error["message"]), error
    ok = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
