"""The OpenAI HTTP schema: pydantic models for requests, responses, stream chunks and errors.

This is the only module of kvroom that uses pydantic (rule 14). Requests are strict (no
``"16"`` for an int, no ``true`` for a number) and closed: an unknown field is an unsupported
parameter, named in the 400. Fields that OpenAI defines but kvroom does not implement are
declared so that their *default* value passes (clients that send ``"n": 1`` or
``"logprobs": null`` keep working) and any other value is rejected by ``unsupported_params``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MAX = 2**63 - 1
StopStr = Annotated[str, Field(min_length=1)]


class ApiError(Exception):
    """An error answered with an OpenAI error body (``{"error": {...}}``) and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(
            error=ErrorInfo(message=message, type=type, param=param, code=code)
        )


# -- requests --------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = False
    """Send one more chunk before ``[DONE]`` with ``usage`` and no choices."""


class _SamplingRequest(_Request):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "n": (1, None),
        "presence_penalty": (0, 0.0, None),
        "frequency_penalty": (0, 0.0, None),
        "logit_bias": (None, {}),
    }
    """Declared but not implemented: field -> the values that mean "not used" (the fields are
    strict, so ``True`` never arrives where ``1`` is expected)."""

    model: str | None = None
    """The served model name; omitted means the one model served."""
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    """vLLM extension: keep the k most likely tokens; 0 or -1 disables."""
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: StopStr | list[StopStr] | None = None
    stop_token_ids: list[int] | None = None
    """vLLM extension: token ids that end generation."""
    ignore_eos: bool = False
    """vLLM extension: keep generating past EOS (benchmarks)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted and ignored, as OpenAI's end-user id."""
    n: int = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported_params(self) -> list[str]:
        """Names of declared-but-unimplemented fields set to a value other than "not used"."""
        items = self.UNSUPPORTED.items()
        return [name for name, unused in items if getattr(self, name) not in unused]


class CompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest.UNSUPPORTED,
        "best_of": (1, None),
        "echo": (False, None),
        "logprobs": (None,),
        "suffix": (None,),
    }

    prompt: str | list[int] | list[str] | list[list[int]]
    """One prompt: text, or token ids (a list holding exactly one of those is accepted too)."""
    max_tokens: int | None = Field(16, ge=1)
    """OpenAI's default is 16; null means "up to max_seq_len"."""
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str
    """``data:image/...;base64,...``, or a local file under ``--allowed-local-media-path``."""
    detail: str | None = None
    """Accepted and ignored (OpenAI's resolution hint)."""


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    """Accepted; passed to the chat template."""

    def image_urls(self) -> list[str]:
        """URLs of the message's ``image_url`` parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def as_template_input(self, image_placeholder: str = "") -> dict[str, str]:
        """``{"role", "content"}`` (text parts joined, an image part as the model's
        ``image_placeholder``) for ``apply_chat_template``."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(
                p.text if isinstance(p, TextPart) else image_placeholder for p in content
            )
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest.UNSUPPORTED,
        "logprobs": (False, None),
        "top_logprobs": (None, 0),
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "parallel_tool_calls": (None,),
        "response_format": (None,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of ``max_completion_tokens``; null = up to max_seq_len."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# -- responses -------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
        )


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    """Set on a whole response and on the usage chunk of a stream; null on other chunks."""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvroom"
    root: str
    """The artifact folder."""
    max_model_len: int
    """The artifact's max_seq_len (vLLM's name)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- builders: one per endpoint, so the streaming code is shared -------------------------


class CompletionFormat:
    """Builds ``/v1/completions`` bodies and stream chunks for one request."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def opening(self) -> list[BaseModel]:
        """Chunks sent before the first token (none for completions)."""
        return []

    def chunk(self, delta: str, finish_reason: str | None) -> BaseModel:
        choice = CompletionChoice(text=delta, finish_reason=finish_reason)
        return self._response([choice], None)

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._response([], usage)

    def response(self, text: str, finish_reason: str | None, usage: UsageInfo) -> BaseModel:
        return self._response([CompletionChoice(text=text, finish_reason=finish_reason)], usage)

    def _response(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> BaseModel:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )


class ChatFormat(CompletionFormat):
    """Builds ``/v1/chat/completions`` bodies and chunks (the first chunk carries the role)."""

    def opening(self) -> list[BaseModel]:
        delta = DeltaMessage(role="assistant", content="")
        return [self._chunk([ChatStreamChoice(delta=delta)], None)]

    def chunk(self, delta: str, finish_reason: str | None) -> BaseModel:
        choice = ChatStreamChoice(delta=DeltaMessage(content=delta), finish_reason=finish_reason)
        return self._chunk([choice], None)

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._chunk([], usage)

    def response(self, text: str, finish_reason: str | None, usage: UsageInfo) -> BaseModel:
        message = AssistantMessage(content=text)
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[ChatChoice(message=message, finish_reason=finish_reason)],
            usage=usage,
        )

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None) -> BaseModel:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )
