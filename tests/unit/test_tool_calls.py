"""The Hermes tool-call parser, whole and streamed (torch-free)."""

from __future__ import annotations

import json

import pytest

from kvroom.server.openai.tool_calls import HermesParser, StreamDelta

P = HermesParser()
ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = (
    'Let me check.<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
    '<tool_call>{"name": "b", "arguments": {"y": [1, {"z": "}"}]}}</tool_call>'
)


def test_one_complete_call() -> None:
    out = P.parse(ONE)
    assert out.content is None
    [call] = out.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) == 14 + 32


def test_several_calls_and_content() -> None:
    out = P.parse(TWO)
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("a", {"x": 1}),
        ("b", {"y": [1, {"z": "}"}]}),
    ]
    assert len({c.id for c in out.tool_calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": 1}',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>[1]</tool_call>',
    ],
)
def test_malformed_output_stays_content(text: str) -> None:
    assert P.parse(text).content == text and P.parse(text).tool_calls == ()


def test_plain_text_is_content() -> None:
    assert P.parse("hello").content == "hello" and P.parse("hello").tool_calls == ()


def stream(text: str, step: int) -> list[StreamDelta]:
    streamer = P.streamer()
    pieces = [text[: i + step] for i in range(0, len(text), step)]
    return [streamer.feed(t, finished=i == len(pieces) - 1) for i, t in enumerate(pieces)]


def joined(deltas: list[StreamDelta]) -> tuple[str, dict[int, dict[str, str]]]:
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for c in d.tool_calls:
            entry = calls.setdefault(c.index, {"arguments": ""})
            if c.id is not None:
                assert "id" not in entry, "the id comes once per call"
                entry.update(id=c.id, name=c.name)
            entry["arguments"] += c.arguments
    return content, calls


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_streamed_deltas_add_up_to_the_parse(step: int) -> None:
    content, calls = joined(stream(TWO, step))
    assert content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("a", {"x": 1}),
        ("b", {"y": [1, {"z": "}"}]}),
    ]
    assert sorted(calls) == [0, 1]


def test_the_name_streams_before_the_arguments_finish() -> None:
    streamer = P.streamer()
    assert streamer.feed("Hi <tool").content == "Hi "  # '<tool' may start a call: held back
    first = streamer.feed('Hi <tool_call>{"name": "f", "arguments": {"a": "b')
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [
        (0, "f", ""),
        (0, None, '{"a": "b'),
    ]
    last = streamer.feed('Hi <tool_call>{"name": "f", "arguments": {"a": "bc"}}</tool_call>')
    assert [c.arguments for c in last.tool_calls] == ['c"}'] and streamer.num_calls == 1


def test_a_malformed_streamed_block_comes_out_as_content() -> None:
    content, calls = joined(stream("x<tool_call>oops</tool_call>y", 3))
    assert content == "x<tool_call>oops</tool_call>y" and calls == {}


def test_text_that_only_looks_like_a_start_is_released() -> None:
    content, calls = joined(stream("a <tool b", 1))
    assert content == "a <tool b" and calls == {}
