"""Tool-call parsers: the model's text -> content and OpenAI ``tool_calls``, whole or streamed.

``hermes`` (vLLM's ``--tool-call-parser hermes``) reads the format Hermes, Qwen2.5 and
SmolLM-style chat templates teach::

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

As in vLLM, each call's ``arguments`` is the JSON text of the object, and a block that is not
a JSON object with a ``name`` makes the whole output plain content (no call is invented).
Torch- and pydantic-free, so it is tested on its own.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)
_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.DOTALL)


def new_call_id() -> str:
    """An id in vLLM's shape (``chatcmpl-tool-`` + 32 hex digits)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made."""

    name: str
    arguments: str
    """The arguments as JSON text."""
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into its plain text and its tool calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one streamed call (OpenAI's ``delta.tool_calls[i]``)."""

    index: int
    id: str | None = None
    """Set (with ``name``) on the first piece of a call only."""
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamDelta:
    """What one new piece of text adds: content and/or pieces of calls."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    def parse(self, text: str) -> ParsedOutput:
        """Split a whole output; any malformed block leaves all of it as content."""
        if START not in text:
            return ParsedOutput(text)
        calls = []
        for match in _BLOCK.finditer(text):
            call = _call(match.group(1))
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        content = _BLOCK.sub("", text).strip()
        return ParsedOutput(content or None, tuple(calls))

    def streamer(self) -> HermesStreamer:
        return HermesStreamer()


def _call(block: str) -> ToolCall | None:
    """The call in one block's JSON, or None if it is not ``{"name": str, "arguments": ...}``."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesStreamer:
    """Incremental Hermes parsing: content as it comes, a call's name as soon as it is known,
    then its arguments text as the model writes it.

    Held back: a tail that may be the start of ``<tool_call>``, and while in a call a tail that
    may start ``</tool_call>`` and the run of ``}`` and whitespace before it (it may close the
    block's outer object rather than the arguments). A block without a readable name is sent
    as content when it closes.
    """

    def __init__(self) -> None:
        self._text = ""
        self._done = 0
        """Characters of ``_text`` fully handled (content sent, or blocks closed)."""
        self._index = -1
        """Index of the call in progress (or last), -1 before the first."""
        self._call: _OpenCall | None = None

    def feed(self, text: str, *, finished: bool = False) -> StreamDelta:
        """The delta for the output text grown to ``text`` (each call extends the last)."""
        self._text = text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            progressed = self._step(content, calls, finished)
            if not progressed:
                break
        return StreamDelta("".join(content), tuple(calls))

    @property
    def num_calls(self) -> int:
        """Calls started so far."""
        return self._index + 1

    def _step(self, content: list[str], calls: list[ToolCallDelta], finished: bool) -> bool:
        if self._call is None:
            return self._outside(content, finished)
        return self._inside(content, calls, finished)

    def _outside(self, content: list[str], finished: bool) -> bool:
        rest = self._text[self._done :]
        start = rest.find(START)
        if start < 0:
            keep = 0 if finished else _partial_suffix(rest, START)
            content.append(rest[: len(rest) - keep])
            self._done += len(rest) - keep
            return False
        content.append(rest[:start])
        self._done += start + len(START)
        self._call = _OpenCall(self._done)
        return True

    def _inside(self, content: list[str], calls: list[ToolCallDelta], finished: bool) -> bool:
        call = self._call
        assert call is not None
        body = self._text[call.start :]
        end = body.find(END)
        closed = end >= 0 or finished
        block = body[:end] if end >= 0 else body
        if call.name is None:
            self._find_name(call, block, calls)
        if call.name is not None:
            self._send_arguments(call, block, calls, closed)
        if not closed:
            return False
        if call.name is None:
            content.append(START + block + (END if end >= 0 else ""))
        self._done = call.start + (end + len(END) if end >= 0 else len(body))
        self._call = None
        return True

    def _find_name(self, call: _OpenCall, block: str, calls: list[ToolCallDelta]) -> None:
        match = _NAME.match(block)
        if match is None:
            return
        call.name = json.loads(f'"{match.group(1)}"')
        call.arguments_start = match.end()
        self._index += 1
        calls.append(ToolCallDelta(self._index, new_call_id(), call.name))

    def _send_arguments(
        self, call: _OpenCall, block: str, calls: list[ToolCallDelta], closed: bool
    ) -> None:
        raw = block[call.arguments_start :]
        if closed:
            stripped = raw.rstrip()
            text = stripped[:-1].rstrip() if stripped.endswith("}") else stripped
        else:
            text = raw[: len(raw) - _partial_suffix(raw, END)].rstrip("} \n\t\r")
        if len(text) > call.num_sent:
            calls.append(ToolCallDelta(self._index, arguments=text[call.num_sent :]))
            call.num_sent = len(text)


@dataclass
class _OpenCall:
    start: int
    """Index in the text where the block's body begins (after ``<tool_call>``)."""
    name: str | None = None
    arguments_start: int = 0
    """Index in the body where the arguments value begins."""
    num_sent: int = 0
    """Characters of the arguments text already sent."""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


TOOL_CALL_PARSERS: dict[str, type[HermesParser]] = {"hermes": HermesParser}
"""``--tool-call-parser`` names -> parsers."""
