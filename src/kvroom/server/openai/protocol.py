"""The OpenAI HTTP schema: pydantic models for requests, responses, stream chunks and errors.

Requests live here, responses in ``responses.py``; the two are the only modules of kvroom
that use pydantic (rule 14). Requests are strict (no ``"16"`` for an int, no ``true`` for a
number) and closed: an unknown field is an unsupported parameter, named in the 400. Fields
that OpenAI defines but kvroom does not implement are declared so that their *default* value
passes (clients that send ``"tools": []`` keep working) and any other value is rejected by
``unsupported_params``. The sampling fields are vLLM's OpenAI server's, with its names.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvroom.engine.params.sampling import MAX_LOGPROBS
from kvroom.server.openai.responses import ErrorInfo, ErrorResponse

INT64_MAX = 2**63 - 1
StopStr = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


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


class JsonSchemaFormat(_Request):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The JSON schema; absent means any JSON object."""
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(_Request):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` field: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    """False allows any whitespace in JSON (kvroom's default is compact JSON)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class _SamplingRequest(_Request):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """Declared but not implemented: field -> the values that mean "not used" (the fields are
    strict, so ``True`` never arrives where ``1`` is expected)."""

    model: str | None = None
    """The served model name; omitted means the one model served."""
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    """vLLM extension: keep the k most likely tokens; 0 or -1 disables."""
    min_p: float | None = Field(None, ge=0, le=1)
    """vLLM extension: drop tokens below ``min_p`` times the most likely one's probability."""
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    """Choice ``i`` of ``n`` samples with ``seed + i`` (vLLM)."""
    stop: StopStr | list[StopStr] | None = None
    stop_token_ids: list[int] | None = None
    """vLLM extension: token ids that end generation."""
    include_stop_str_in_output: bool = False
    """vLLM extension: keep the stop string that ended the text."""
    skip_special_tokens: bool = True
    """vLLM extension: leave special tokens out of the text."""
    ignore_eos: bool = False
    """vLLM extension: keep generating past EOS (benchmarks)."""
    min_tokens: int = Field(0, ge=0)
    """vLLM extension: no EOS, stop token or stop string before this many tokens."""
    n: int = Field(1, ge=1)
    """Choices per prompt, generated as independent sequences."""
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    """vLLM extension: 1 (or null) disables."""
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    """Token id (as a string, OpenAI's shape) -> bias added to its logit."""
    prompt_logprobs: NumLogprobs | None = None
    """vLLM extension: logprobs of the prompt tokens (and this many alternatives)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted and ignored, as OpenAI's end-user id."""
    response_format: ResponseFormat | None = None
    """OpenAI's ``json_object`` / ``json_schema`` (``text``: unconstrained)."""
    structured_outputs: StructuredOutputsRequest | None = None
    """vLLM extension: ``json``, ``regex``, ``choice`` or ``grammar``."""
    guided_json: str | dict[str, Any] | None = None
    """vLLM's older names for ``structured_outputs`` fields."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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
        "suffix": (None,),
    }

    prompt: str | list[int] | list[str] | list[list[int]]
    """Text, token ids, or a list of either: one choice per prompt (times ``n``)."""
    max_tokens: int | None = Field(16, ge=0)
    """OpenAI's default is 16; null means "up to max_seq_len"; 0 only with ``echo`` (the prompt
    alone, as vLLM returns it)."""
    best_of: int | None = Field(None, ge=1)
    """Generate this many per prompt and return the ``n`` with the highest cumulative logprob."""
    echo: bool | None = False
    """Put the prompt before the completion (and its logprobs before the completion's)."""
    logprobs: NumLogprobs | None = None
    """Logprobs of each token, with this many most likely alternatives."""
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


class FunctionCall(_Request):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class MessageToolCall(_Request):
    """A call an earlier assistant turn made (sent back in multi-turn tool use)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    """Accepted; passed to the chat template."""
    tool_calls: list[MessageToolCall] | None = None
    """An assistant turn's calls; passed to the chat template (arguments as objects)."""
    tool_call_id: str | None = None
    """A tool turn: the call it answers."""

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
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    """A call as chat templates read it: arguments as an object when they parse (vLLM)."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class FunctionDef(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object."""
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of ``max_completion_tokens``; null = up to max_seq_len."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    """Logprobs of each generated token."""
    top_logprobs: NumLogprobs | None = None
    """With ``logprobs``: this many most likely alternatives per token."""
    tools: list[ChatTool] | None = None
    """Functions the model may call; passed to the chat template (``server/openai/tools.py``)."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default ``"auto"`` when ``tools`` are given, else ``"none"`` (vLLM)."""
    parallel_tool_calls: bool | None = None
    """False: at most one call (``"required"``)."""

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
