"""Tool calling over HTTP with the official ``openai`` client on the tiny random model.

``required`` and a named ``tool_choice`` force the output through the tools' schemas, so even
a random model calls them correctly. ``auto`` is the model's own decision: here a ``guided_regex``
makes the random model write a Hermes ``<tool_call>`` block, which the parser must turn into
``tool_calls``, whole or streamed.
"""

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
from kvroom.server.openai.tools import ToolOptions
from tiny_models import compile_tiny_artifact

pytestmark = pytest.mark.server

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"c": {"enum": ["P", "R"]}},
            "required": ["c"],
            "additionalProperties": False,
        },
    },
}
FLAG = {
    "type": "function",
    "function": {
        "name": "flag",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}},
            "required": ["on"],
        },
    },
}
TOOLS_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% endfor %}assistant:"
)
HERMES = r'<tool_call>\{"name": "weather", "arguments": \{"c": "(P|R)"\}\}</tool_call>'


def serve(artifact: Path, **kw: Any) -> ThreadServer:
    llm = LLM(artifact)
    llm.tokenizer.chat_template = TOOLS_TEMPLATE
    return ThreadServer(create_app(llm, served_model_name=MODEL, **kw))


@pytest.fixture(scope="module")
def artifact(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with room for a tool prompt and a call: max_seq_len 128."""
    out = tmp_path_factory.mktemp("tools") / "art"
    return compile_tiny_artifact(tiny_llama_dir, out, max_seq_len=128, kvcache_num_blocks=128)


@pytest.fixture(scope="module")
def server(artifact: Path) -> Iterator[ThreadServer]:
    server = serve(artifact)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auto_server(artifact: Path) -> Iterator[ThreadServer]:
    server = serve(artifact, tool_options=ToolOptions(True, "hermes"))
    yield server
    server.stop()


def create(client: openai.OpenAI, **kw: Any) -> Any:
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "temperature": 0, **kw}
    return client.chat.completions.create(**args)


def check_weather(call: Any) -> None:
    assert call.type == "function" and call.function.name == "weather"
    assert json.loads(call.function.arguments)["c"] in ("P", "R")
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)


def streamed(stream: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, calls reassembled from ``delta.tool_calls``, the last finish_reason)."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for piece in c.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"arguments": ""})
                if piece.id is not None:
                    assert "id" not in call and piece.type == "function"
                    call.update(id=piece.id, name=piece.function.name)
                call["arguments"] += piece.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], reason


def test_required_returns_tool_calls(server: ThreadServer) -> None:
    r = create(server.client(), tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_weather(call)


def test_a_named_function_is_called(server: ThreadServer) -> None:
    named = {"type": "function", "function": {"name": "flag"}}
    r = create(server.client(), tools=[WEATHER, FLAG], tool_choice=named, temperature=1.0, seed=1)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "flag" and isinstance(
        json.loads(call.function.arguments)["on"], bool
    )
    assert r.choices[0].finish_reason == "tool_calls"


def test_tools_reach_the_chat_template(server: ThreadServer) -> None:
    plain = create(server.client(), max_tokens=1)
    with_tools = create(server.client(), max_tokens=1, tools=[WEATHER], tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls == []


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "weather"}}]
)
def test_forced_calls_stream(server: ThreadServer, choice: Any) -> None:
    stream = create(
        server.client(), tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False, stream=True
    )
    content, calls, reason = streamed(stream)
    assert content == "" and reason == "tool_calls"
    [call] = calls
    assert call["name"] == "weather" and json.loads(call["arguments"])["c"] in ("P", "R")


def test_auto_parses_hermes_calls(auto_server: ThreadServer) -> None:
    client = auto_server.client()
    r = create(client, tools=[WEATHER], max_tokens=90, extra_body={"guided_regex": HERMES})
    [call] = r.choices[0].message.tool_calls
    check_weather(call)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    content, calls, reason = streamed(
        create(
            client, tools=[WEATHER], max_tokens=90, stream=True, extra_body={"guided_regex": HERMES}
        )
    )
    assert content == "" and reason == "tool_calls"
    assert [c["name"] for c in calls] == ["weather"]
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_auto_without_a_call_is_plain_content(auto_server: ThreadServer) -> None:
    r = create(auto_server.client(), tools=[WEATHER], max_tokens=5, extra_body={"ignore_eos": True})
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content


def test_a_multi_turn_tool_conversation_is_accepted(auto_server: ThreadServer) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"c": "P"}'},
    }
    messages = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sun"},
    ]
    r = create(auto_server.client(), messages=messages, tools=[WEATHER], max_tokens=2)
    assert r.usage.prompt_tokens > 20


BAD = [
    (
        "auto-not-enabled",
        {"tools": [WEATHER]},
        "tool_choice",
        r"requires --enable-auto-tool-choice",
    ),
    (
        "unknown-function",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        r"^'tool_choice' names function 'nope', which is not in 'tools' \('weather'\)$",
    ),
    ("no-tools", {"tool_choice": "required"}, "tool_choice", r"needs 'tools'"),
    (
        "with-response-format",
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        r"forces the output to the tools' schema; drop 'response_format'",
    ),
    (
        "bad-parameters",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
            ],
            "tool_choice": "required",
        },
        "tools",
        r"^'tools': the JSON schema does not compile: .*nope",
    ),
    ("malformed-tool", {"tools": [{"type": "function"}]}, "tools.0.function", r"missing"),
]


@pytest.mark.parametrize(
    ("extra", "param", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_tool_requests_are_400s(
    server: ThreadServer, extra: Any, param: str, message: str
) -> None:
    response = server.post("/v1/chat/completions", json={"messages": MESSAGES, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
    assert (
        server.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}
        ).status_code
        == 200
    )
