"""Response builders: one per endpoint, so serving (streamed or whole) is shared.

A builder turns the engine's outputs of one choice (text, and tokens with their
``TokenLogprobs``) into that endpoint's JSON: the completions logprobs are four parallel lists
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), chat's a list of
``{token, logprob, bytes, top_logprobs}``. Token strings are single-token decodes, as vLLM
returns them; the entry of the token itself comes first in a completions ``top_logprobs``
dict, followed by the requested number of most likely tokens (vLLM's order), and chat's
``top_logprobs`` list is the first ``top_logprobs`` entries of that same order. Logprobs below
-9999 (``-inf``) are reported as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from kvroom.engine.sched.output import TokenLogprobs
from kvroom.server.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    UsageInfo,
)
from kvroom.server.openai.tool_calls import ToolCall, ToolCallDelta

TokenText = Callable[[int], str]
Entry = tuple[int, TokenLogprobs | None]
"""A token id and its logprobs (None for the first prompt token)."""
MIN_LOGPROB = -9999.0


@dataclass
class FinalChoice:
    """One finished choice, as the builders need it."""

    index: int
    text: str
    entries: list[Entry] | None
    """Tokens with logprobs, when the request asked (echoed prompt tokens first)."""
    finish_reason: str | None
    prompt_logprobs: Sequence[TokenLogprobs | None] | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    """Chat: the calls parsed from the output; ``text`` is then the content outside them."""
    content_is_null: bool = False
    """Chat: no content besides the calls (``"content": null``)."""


@dataclass(frozen=True)
class StreamDelta:
    """What one stream chunk brings to one choice."""

    index: int
    text: str
    entries: list[Entry]
    """The new tokens with their logprobs (empty when none were asked)."""
    offset: int
    """Text length already sent for this choice (the next ``text_offset``)."""
    finish_reason: str | None
    tool_calls: Sequence[ToolCallDelta] = ()
    """Chat alone streams ``tool_calls``."""


class CompletionFormat:
    """Builds ``/v1/completions`` bodies and stream chunks for one request."""

    chunk_model: type[BaseModel] = CompletionResponse
    """The stream chunk's schema (completions stream ``text_completion`` objects)."""

    def __init__(
        self, request_id: str, model: str, token_text: TokenText, num_top: int | None
    ) -> None:
        """``num_top``: alternatives per token in logprobs (None: no logprobs asked)."""
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.num_top = num_top

    def opening(self, indexes: Sequence[int]) -> list[BaseModel]:
        """Chunks sent before the first token (none for completions)."""
        return []

    def chunk(self, delta: StreamDelta) -> BaseModel:
        """One choice's stream chunk."""
        return self._envelope(self.chunk_model, [self._stream_choice(delta)], None)

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._envelope(self.chunk_model, [], usage)

    def response(self, choices: list[FinalChoice], usage: UsageInfo) -> BaseModel:
        return self._envelope(CompletionResponse, [self._choice(c) for c in choices], usage)

    def _stream_choice(self, d: StreamDelta) -> BaseModel:
        logprobs = None if self.num_top is None else self._logprobs(d.entries, d.offset)
        return CompletionChoice(
            index=d.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason
        )

    def _choice(self, c: FinalChoice) -> BaseModel:
        logprobs = None if c.entries is None else self._logprobs(c.entries, 0)
        return CompletionChoice(
            index=c.index,
            text=c.text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            prompt_logprobs=self.prompt_logprobs(c.prompt_logprobs),
        )

    def _logprobs(self, entries: list[Entry], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        k = self.num_top or 0
        for token_id, lp in entries:
            token = self.token_text(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
            top = {token: max(lp.logprob, MIN_LOGPROB)}
            for alt, value in lp.top[:k]:
                top.setdefault(self.token_text(alt), max(value, MIN_LOGPROB))
            out.top_logprobs.append(top)
        return out

    def prompt_logprobs(
        self, entries: Sequence[TokenLogprobs | None] | None
    ) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: ``{token_id: {logprob, rank, decoded_token}}``."""
        if entries is None:
            return None
        return [None if e is None else self._logprob_dict(e) for e in entries]

    def _logprob_dict(self, e: TokenLogprobs) -> dict[str, Any]:
        out = {str(e.token_id): self._one(e.token_id, e.logprob, e.rank)}
        for rank, (alt, value) in enumerate(e.top, start=1):
            out.setdefault(str(alt), self._one(alt, value, rank))
        return out

    def _one(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        decoded = self.token_text(token_id)
        return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": decoded}

    def _envelope(
        self, model: type[BaseModel], choices: list[Any], usage: UsageInfo | None, **extra: Any
    ) -> BaseModel:
        """``model`` with this request's id, creation time and model name around ``choices``."""
        return model(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            **extra,
        )


class ChatFormat(CompletionFormat):
    """Builds ``/v1/chat/completions`` bodies and chunks (the first chunk carries the role)."""

    chunk_model = ChatCompletionChunk

    def opening(self, indexes: Sequence[int]) -> list[BaseModel]:
        delta = DeltaMessage(role="assistant", content="")
        choices = [[ChatStreamChoice(index=i, delta=delta)] for i in indexes]
        return [self._envelope(self.chunk_model, c, None) for c in choices]

    def response(self, choices: list[FinalChoice], usage: UsageInfo) -> BaseModel:
        prompt_logprobs = self.prompt_logprobs(choices[0].prompt_logprobs if choices else None)
        out = [self._choice(c) for c in choices]
        return self._envelope(ChatCompletionResponse, out, usage, prompt_logprobs=prompt_logprobs)

    def _stream_choice(self, d: StreamDelta) -> BaseModel:
        logprobs = None if self.num_top is None else self._chat_logprobs(d.entries)
        message = DeltaMessage(content=d.text)
        if d.tool_calls:
            message = DeltaMessage(content=d.text or None, tool_calls=_delta_calls(d.tool_calls))
        return ChatStreamChoice(
            index=d.index, delta=message, logprobs=logprobs, finish_reason=d.finish_reason
        )

    def _choice(self, c: FinalChoice) -> BaseModel:
        return ChatChoice(
            index=c.index,
            message=_message(c),
            logprobs=None if c.entries is None else self._chat_logprobs(c.entries),
            finish_reason=c.finish_reason,
        )

    def _chat_logprobs(self, entries: list[Entry]) -> ChatLogprobs:
        k = self.num_top or 0
        content = [
            ChatLogprobEntry(
                **self._token(token_id, lp.logprob).model_dump(),
                top_logprobs=[self._token(t, v) for t, v in _chat_top(token_id, lp, k)],
            )
            for token_id, lp in entries
            if lp is not None
        ]
        return ChatLogprobs(content=content)

    def _token(self, token_id: int, logprob: float) -> ChatTokenLogprob:
        token = self.token_text(token_id)
        return ChatTokenLogprob(
            token=token,
            logprob=max(logprob, MIN_LOGPROB),
            bytes=list(token.encode("utf-8", errors="replace")),
        )


def _chat_top(token_id: int, lp: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    """vLLM's chat ``top_logprobs``: the first ``k`` of the chosen token, then the ``k`` most
    likely (each once). Greedy, that is the top ``k``; a sampled token outside them comes
    first and pushes the k-th out."""
    ranked = {token_id: lp.logprob}
    for alt, value in lp.top[:k]:
        ranked.setdefault(alt, value)
    return list(ranked.items())[:k]


def _message(c: FinalChoice) -> AssistantMessage:
    calls = [
        ToolCallOut(id=t.id, function=FunctionCallOut(name=t.name, arguments=t.arguments))
        for t in c.tool_calls
    ]
    return AssistantMessage(content=None if c.content_is_null else c.text, tool_calls=calls)


def _delta_calls(pieces: Sequence[ToolCallDelta]) -> list[DeltaToolCall]:
    return [
        DeltaToolCall(
            index=p.index,
            id=p.id,
            type="function" if p.id is not None else None,
            function=DeltaFunction(name=p.name, arguments=p.arguments),
        )
        for p in pieces
    ]
