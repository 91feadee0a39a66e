"""Chat ``tools`` and ``tool_choice``: what the request constrains, and how output becomes calls.

``tool_choice`` (default ``"auto"`` when ``tools`` are given, as vLLM):

- ``"none"``: the tools reach the chat template; the output is plain content.
- ``"required"``: the output is forced to a JSON array of ``{"name", "parameters"}`` objects,
  one per call, each matching one tool's parameter schema (vLLM's schema); at most one item
  when ``parallel_tool_calls`` is false.
- ``{"type": "function", "function": {"name": N}}``: the output is forced to N's parameter
  schema and is that one call's arguments.
- ``"auto"``: needs ``--enable-auto-tool-choice`` and a ``--tool-call-parser``; the model
  decides, and the parser (``tool_calls.py``) turns its format into calls.

A choice that ends with calls has ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kvroom.engine.params.structured import StructuredOutputsParams
from kvroom.errors import ConfigError
from kvroom.server.openai.protocol import ApiError, ChatCompletionRequest, ChatTool
from kvroom.server.openai.tool_calls import (
    TOOL_CALL_PARSERS,
    HermesParser,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    new_call_id,
)

ToolMode = Literal["required", "named", "auto"]


@dataclass(frozen=True)
class ToolOptions:
    """The server's tool-calling flags (vLLM's)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    """A name of ``TOOL_CALL_PARSERS``; needed with ``enable_auto_tool_choice``."""

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            names = ", ".join(sorted(TOOL_CALL_PARSERS))
            raise ConfigError(
                f"--tool-call-parser: unknown parser {self.tool_call_parser!r}; known: {names}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")


@dataclass(frozen=True)
class ToolUse:
    """How one chat request's output turns into tool calls."""

    mode: ToolMode
    name: str | None = None
    """The forced function (``named``)."""
    parser: HermesParser | None = None
    """The model's format (``auto``)."""

    def parse(self, text: str) -> ParsedOutput:
        """A whole output as content and calls."""
        if self.mode == "named":
            assert self.name is not None
            return ParsedOutput(None, (ToolCall(self.name, text),))
        if self.mode == "required":
            return _parse_required(text)
        assert self.parser is not None
        return self.parser.parse(text)

    def streamer(self) -> Any:
        """An object with ``feed(text, finished=) -> StreamDelta`` and ``num_calls``."""
        if self.mode == "named":
            assert self.name is not None
            return _NamedStreamer(self.name)
        if self.mode == "required":
            return _RequiredStreamer()
        assert self.parser is not None
        return self.parser.streamer()


def resolve_tools(
    body: ChatCompletionRequest, options: ToolOptions
) -> tuple[ToolUse | None, StructuredOutputsParams | None]:
    """The request's tool use and the constraint it forces (None, None: no tools in play).

    Raises:
        ApiError: 400 for a ``tool_choice`` without tools, naming an unknown function, or
            ``auto`` on a server started without ``--enable-auto-tool-choice``.
    """
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None, None
    if not tools:
        raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if choice == "auto":
        return _auto(options), None
    if choice == "required":
        return ToolUse("required"), _required_schema(tools, body.parallel_tool_calls)
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        known = ", ".join(repr(t.function.name) for t in tools)
        raise ApiError(
            400,
            f"'tool_choice' names function {name!r}, which is not in 'tools' ({known})",
            param="tool_choice",
            code="invalid_value",
        )
    return ToolUse("named", name=name), StructuredOutputsParams(json=_parameters(tool))


def _auto(options: ToolOptions) -> ToolUse:
    if not options.enable_auto_tool_choice or options.tool_call_parser is None:
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            'be set; or send tool_choice "required", "none" or a named function',
            param="tool_choice",
        )
    return ToolUse("auto", parser=TOOL_CALL_PARSERS[options.tool_call_parser]())


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _required_schema(tools: list[ChatTool], parallel: bool | None) -> StructuredOutputsParams:
    """vLLM's: an array of ``{"name": one tool's name, "parameters": its schema}``."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _parse_required(text: str) -> ParsedOutput:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return ParsedOutput(text)  # cut off by max_tokens: no call can be read
    return ParsedOutput(None, tuple(_required_call(item) for item in items))


def _required_call(item: dict[str, Any]) -> ToolCall:
    return ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))


class _NamedStreamer:
    """The output is the arguments: the first piece carries the id and name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0
        self._num_sent = 0

    def feed(self, text: str, *, finished: bool = False) -> StreamDelta:
        pieces: list[ToolCallDelta] = []
        if self.num_calls == 0:
            pieces.append(ToolCallDelta(0, new_call_id(), self.name))
            self.num_calls = 1
        if len(text) > self._num_sent:
            pieces.append(ToolCallDelta(0, arguments=text[self._num_sent :]))
            self._num_sent = len(text)
        return StreamDelta(tool_calls=tuple(pieces))


class _RequiredStreamer:
    """The output is a JSON array: each call is sent whole as soon as its item is complete."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._pos = 0
        """Where the next array item may start."""
        self._decoder = json.JSONDecoder()

    def feed(self, text: str, *, finished: bool = False) -> StreamDelta:
        pieces: list[ToolCallDelta] = []
        while True:
            start = _next_item(text, self._pos)
            if start is None:
                break
            try:
                item, end = self._decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                break
            call = _required_call(item)
            pieces.append(ToolCallDelta(self.num_calls, call.id, call.name, call.arguments))
            self.num_calls += 1
            self._pos = end
        return StreamDelta(tool_calls=tuple(pieces))


def _next_item(text: str, pos: int) -> int | None:
    """Index of the next item's first character after ``[`` or ``,`` (None: not yet there)."""
    i = pos
    while i < len(text) and text[i] in " \n\t\r":
        i += 1
    if i >= len(text) or text[i] not in "[,":
        return None
    i += 1
    while i < len(text) and text[i] in " \n\t\r":
        i += 1
    return i if i < len(text) else None
