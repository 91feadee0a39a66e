"""From a validated body to engine input: prompts as token ids, and ``SamplingParams``.

Text is tokenized in the tokenizer pool (never on the event loop), and a text that cannot fit
in ``max_seq_len`` is refused before any of it is tokenized. Everything a request could get
wrong that pydantic cannot see (a token id outside the vocabulary, more choices than the
engine can ever hold, ``top_logprobs`` without ``logprobs``) is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

import jinja2

from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.params.structured import StructuredOutputsParams
from kvroom.errors import ConfigError
from kvroom.server.openai.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvroom.server.openai.serving import Prompt, ServerState

SamplingBody = CompletionRequest | ChatCompletionRequest


async def completion_prompts(s: ServerState, prompt: str | list[Any], echo: bool) -> list[Prompt]:
    """The prompts of ``/v1/completions``: text, token ids, or a non-empty list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items: list[Any] = [prompt]
    else:
        items = list(prompt)
    if not items or any(isinstance(p, list) and not p for p in items):
        raise ApiError(
            400, "'prompt' is empty; send at least one token", param="prompt", code="invalid_value"
        )
    return [await _prompt(s, item, echo) for item in items]


async def _prompt(s: ServerState, item: str | list[int], echo: bool) -> Prompt:
    if isinstance(item, str):
        return Prompt(await encode_text(s, item, "prompt"), item)
    check_token_ids(s, item, "prompt")
    return Prompt(list(item), await s.tokenizers.decode(item) if echo else "")


async def encode_text(s: ServerState, text: str, param: str, add_special: bool = True) -> list[int]:
    """Token ids of ``text`` (off the event loop), refused at once if it cannot fit."""
    if s.tokenizers.cannot_fit(text, s.max_seq_len):
        raise ApiError(
            400,
            f"'{param}' has {len(text)} characters, more than max_seq_len ({s.max_seq_len}) "
            f"tokens of at most {s.tokenizers.max_token_chars} characters each can hold; "
            "shorten it",
            param=param,
            code="context_length_exceeded",
        )
    return await s.tokenizers.encode(text, add_special_tokens=add_special)


def check_token_ids(s: ServerState, ids: list[int], param: str) -> None:
    outside = [t for t in ids if not 0 <= t < s.vocab_size]
    if outside:
        raise ApiError(
            400,
            f"'{param}': token id {outside[0]} is outside the vocabulary [0, {s.vocab_size})",
            param=param,
            code="invalid_value",
        )


async def chat_prompt_ids(
    s: ServerState,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    if not getattr(s.tokenizers.loop_tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "this model's tokenizer has no chat template; use /v1/completions",
            param="messages",
        )
    try:
        return await s.tokenizers.chat_ids(messages, add_generation_prompt, tools)
    except jinja2.TemplateError as exc:
        raise ApiError(
            400, f"the chat template rejected these messages: {exc}", param="messages"
        ) from exc


def sampling_params(
    s: ServerState,
    body: SamplingBody,
    prompts: list[Prompt],
    max_tokens: int | None,
    prompt_param: str,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's params for ``body``; ``max_tokens`` None means "up to max_seq_len";
    ``structured``: the output's constraint (``server/openai/structured.py``)."""
    if max_tokens is None:
        longest = max(len(p.token_ids) for p in prompts)
        max_tokens = s.max_seq_len - longest
        if max_tokens <= 0:
            raise ApiError(
                400,
                f"the prompt has {longest} tokens, which leaves no room to generate "
                f"within max_seq_len ({s.max_seq_len}); shorten the prompt",
                param=prompt_param,
                code="context_length_exceeded",
            )
    if body.stop_token_ids:
        check_token_ids(s, body.stop_token_ids, "stop_token_ids")
    try:
        params = SamplingParams(
            n=body.n,
            best_of=getattr(body, "best_of", None),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            logit_bias=_logit_bias(s, body.logit_bias),
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            seed=body.seed,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
            include_stop_str_in_output=body.include_stop_str_in_output,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            structured_outputs=structured,
        )
    except ConfigError as exc:
        field = str(exc).split(":")[0].removeprefix("SamplingParams.")
        raise ApiError(400, str(exc), param=field, code="invalid_value") from exc
    check_fanout(s, params, prompts)
    return params


def _logit_bias(s: ServerState, bias: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < s.vocab_size:
            raise ApiError(
                400,
                f"'logit_bias': key {key!r} is not a token id in [0, {s.vocab_size})",
                param="logit_bias",
                code="invalid_value",
            )
        out[int(key)] = value
    return out


def check_fanout(s: ServerState, params: SamplingParams, prompts: list[Prompt]) -> None:
    """Refuse more sequences per prompt than the engine's batch, or than its pool, holds."""
    field = "best_of" if params.ranks_by_logprob else "n"
    k = params.num_sequences
    if k > s.max_num_seqs:
        raise ApiError(
            400,
            f"'{field}' is {k}, but this server runs at most {s.max_num_seqs} sequences at once "
            "(batch_size); ask for fewer choices",
            param=field,
            code="invalid_value",
        )
    if k == 1:
        return  # one sequence: the engine's own admission check answers, with its numbers
    stats = s.engine.stats
    longest = max(len(p.token_ids) for p in prompts) + params.max_tokens
    blocks = k * -(-longest // s.block_size)
    if blocks > stats.num_total_blocks:
        raise ApiError(
            400,
            f"'{field}' is {k}: {k} sequences of up to {longest} tokens need {blocks} KV blocks "
            f"of {s.block_size} tokens, but the pool has {stats.num_total_blocks}; ask for fewer "
            "choices or fewer max_tokens",
            param=field,
            code="invalid_value",
        )
