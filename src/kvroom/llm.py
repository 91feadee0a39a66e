"""``LLM``: the offline batch API over an artifact (vLLM's ``LLM`` shape).

llm = LLM("artifacts/smollm2-135m", kvcache_num_blocks="auto")
outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
outs[0].text, outs[0].token_ids          # the first choice
outs[0].outputs[i].logprobs                # vLLM's shape: one CompletionOutput per choice
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroom import heap
from kvroom.artifact.resize import startup_plan
from kvroom.engine.engine import RequestOutput
from kvroom.engine.kv.live_pool import KVCacheState, resolve_resize
from kvroom.engine.kv.migration import ResizeResult
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.output import TokenLogprobs
from kvroom.errors import AdmissionError, ConfigError
from kvroom.models.layers import widens_bf16_weights
from kvroom.runtime import Runtime, build_runtime

logger = logging.getLogger("kvroom")

Prompt = str | Sequence[int] | Mapping[str, Any]
"""Text, token ids, or vLLM's ``{"prompt": text, "multi_modal_data": {"image": ...}}``."""
Message = Mapping[str, str]


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: one token's logprob under the raw model output, rank, and text."""

    logprob: float
    rank: int | None
    decoded_token: str | None


LogprobDict = dict[int, Logprob]
"""Per position: the token itself first, then the requested most likely tokens (vLLM)."""


@dataclass(frozen=True)
class CompletionOutput:
    """One choice of a prompt (vLLM's ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    """Generated tokens (stop token kept, stop string's tokens kept, text cut before it)."""
    cumulative_logprob: float | None
    logprobs: list[LogprobDict] | None
    finish_reason: str | None


@dataclass(frozen=True)
class GenerationResult:
    """One prompt's result, in the order of the prompts given (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    """The first choice's tokens (``outputs[0].token_ids``)."""
    text: str
    """The first choice's text."""
    finish_reason: str | None
    outputs: tuple[CompletionOutput, ...] = ()
    """``SamplingParams.n`` choices (the best ``n`` of ``best_of`` by cumulative logprob)."""
    prompt_logprobs: list[LogprobDict | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: None for the first prompt token, then one dict."""


class LLM:
    """Load an artifact and generate for many prompts at once (continuous batching)."""

    def __init__(
        self,
        path: str | Path,
        *,
        kvcache_num_blocks: int | str | None = None,
        device_memory: int | str | None = None,
        kvcache_reserve_memory: int | str | None = None,
        kvcache_memory_fraction: float | None = None,
        kvcache_num_blocks_adjuster: Callable[..., int] | None = None,
        device: str | None = None,
        kvcache_max_blocks: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        """
        Args:
            path: an artifact folder written by ``kvroom compile``.
            kvcache_num_blocks: start-up override of the pool: an int (validated like
                ``kvroom set``) or ``"auto"`` (re-estimated here); the artifact is not changed.
            device_memory, kvcache_reserve_memory, kvcache_memory_fraction: re-fit the pool
                for this start with another budget (implies ``auto`` unless an int is given).
            kvcache_num_blocks_adjuster: ignored (the estimate does not run at load), noted once.
            device: run on another device than the one planned for.
            kvcache_max_blocks: the largest size ``resize_kv_cache`` may reach (address space
                reserved now; default the larger of ``num_full_blocks`` and the start size).
            enable_prefix_caching: reuse the K/V of earlier prompts' full blocks (vLLM's
                automatic prefix caching; on by default, off for sliding-window models).
        """
        from transformers import AutoTokenizer

        heap.configure()  # before the tokenizer and the runtime start threads
        if kvcache_num_blocks_adjuster is not None:
            logger.warning(
                "kvcache_num_blocks_adjuster is ignored when loading an artifact: the estimate "
                "ran at build time; pass kvcache_num_blocks=N or 'auto' to resize at start-up"
            )
        info, plan = startup_plan(
            path,
            kvcache_num_blocks,
            device_memory=device_memory,
            kvcache_reserve_memory=kvcache_reserve_memory,
            kvcache_memory_fraction=kvcache_memory_fraction,
            widens_bf16=None if device not in (None, "cpu") else widens_bf16_weights,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(info.folder))
        self.runtime: Runtime = build_runtime(
            info,
            plan,
            device=device,
            tokenizer=tokenizer,
            max_num_blocks=kvcache_max_blocks,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.tokenizer = tokenizer
        self.last_resize: ResizeResult | None = None

    @classmethod
    def from_runtime(cls, runtime: Runtime) -> LLM:
        """An ``LLM`` over an assembled runtime (the profiling pass builds one step by step)."""
        llm = cls.__new__(cls)
        llm.runtime = runtime
        llm.tokenizer = runtime.tokenizer
        return llm

    @property
    def engine(self) -> Any:
        return self.runtime.engine

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache (vLLM's ``LLM.reset_prefix_cache``); blocks dropped."""
        return self.runtime.engine.reset_prefix_cache()

    def resize_kv_cache(self, num_blocks: int | str, *, persist: bool = False) -> ResizeResult:
        """Grow or shrink the KV pool now, keeping every request's KV (or recomputing the
        newest ones only if the used blocks do not fit); no generated token changes.

        Args:
            num_blocks: the new ``kvcache_num_blocks``: an int, or ``"auto"`` (re-fit to the
                memory available now).
            persist: also write it into the artifact (the atomic ``kvroom set``).

        Raises:
            ConfigError: not an int or "auto", below ``num_min_blocks`` (the policy's error),
                or above the address space reserved at load.
            MemoryNotEnoughError: "auto" finds too little memory.
        """
        runtime = self.runtime
        plan = resolve_resize(
            runtime.plan,
            num_blocks,
            kv_bytes_now=runtime.pool.nbytes(),
            max_num_blocks=runtime.pool.max_num_blocks,
        )
        result = runtime.engine.resize_kv_cache(plan.num_blocks)
        runtime.plan = plan
        self.last_resize = result
        if persist:
            from kvroom.artifact.resize import set_kvcache_num_blocks

            set_kvcache_num_blocks(runtime.info.folder, plan.num_blocks)
        return result

    def kv_cache_state(self) -> KVCacheState:
        """The pool now: blocks, bytes, use, the plan it came from, the resizes so far."""
        runtime = self.runtime
        return KVCacheState.of(
            runtime.plan,
            runtime.engine.stats,
            max_num_blocks=runtime.pool.max_num_blocks,
            last_resize=self.last_resize,
            populated=self.runtime.pool.populated,
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt; results in prompt order.

        A prompt is text, token ids, or a dict ``{"prompt": text, "multi_modal_data":
        {"image": image or [images]}}`` (vLLM's form) whose text holds the model's image
        placeholder once per image (Qwen3-VL: ``<|vision_start|><|image_pad|><|vision_end|>``);
        kvroom expands it to the image's token count. An image is a PIL image, bytes, a path
        or a ``data:`` URL.

        Raises:
            AdmissionError: a prompt can never be served (too long, larger than the pool); no
                request of this call is left running.
            ConfigError: an image does not decode, has an unsupported format, or there are
                more than ``max_images_per_request`` (all ``ValueError`` s).
        """
        items = [self._prepare(p) for p in _as_prompt_list(prompts)]
        return self._run(items, sampling_params)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Apply the chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        token_lists = [self.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self._run([(t, None) for t in token_lists], sampling_params)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"{self.runtime.info.folder}: the tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def stream(
        self, prompt: Prompt, params: SamplingParams, *, fill_context: bool = False
    ) -> Iterator[RequestOutput]:
        """Yield each step's output of one request (used by ``kvroom run``).

        With ``fill_context``, ``params.max_tokens`` becomes what ``max_seq_len`` leaves after
        the prompt (vLLM's default for a request that names no ``max_tokens``).

        Raises:
            AdmissionError: the prompt leaves no room to generate, or can never be served.
        """
        engine = self.runtime.engine
        tokens, multimodal = self._prepare(prompt)
        if fill_context:
            params = dataclasses.replace(params, max_tokens=self._room_left(len(tokens)))
        request_id = engine.add_request(tokens, params, multimodal=multimodal)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == request_id:
                    yield out

    def _room_left(self, num_prompt_tokens: int) -> int:
        max_seq_len = self.runtime.info.config.max_seq_len
        if num_prompt_tokens >= max_seq_len:
            raise AdmissionError(
                f"the prompt has {num_prompt_tokens} tokens, which leaves no room to generate "
                f"within max_seq_len ({max_seq_len}); shorten the prompt"
            )
        return max_seq_len - num_prompt_tokens

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def _prepare(self, prompt: Prompt) -> tuple[list[int], Any]:
        """Token ids and the model's multimodal inputs (None for a text prompt)."""
        if not isinstance(prompt, Mapping):
            return self._encode(prompt), None
        from kvroom.media import load_image

        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
        if unknown:
            raise ConfigError(f"prompt: unknown key(s) {', '.join(unknown)}")
        tokens = self._encode(prompt.get("prompt_token_ids") or prompt.get("prompt") or "")
        data = dict(prompt.get("multi_modal_data") or {})
        if set(data) - {"image"}:
            raise ConfigError(f"multi_modal_data: only 'image' is supported, got {sorted(data)}")
        items = data.get("image")
        if items is None:
            return tokens, None
        images = [load_image(i) for i in (items if isinstance(items, list | tuple) else [items])]
        model = self.runtime.runner.model
        if not hasattr(model, "prepare_prompt"):
            raise ConfigError(f"{self.runtime.spec.architecture} does not take images")
        return model.prepare_prompt(tokens, images)

    def _run(
        self,
        items: list[tuple[list[int], Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[GenerationResult]:
        token_lists = [tokens for tokens, _ in items]
        params = _as_params_list(sampling_params, len(items))
        engine = self.runtime.engine
        ids: list[list[str]] = []
        try:
            for (tokens, multimodal), p in zip(items, params, strict=True):
                ids.append([])
                for i in range(p.num_sequences):
                    child = p.child(i)
                    ids[-1].append(engine.add_request(tokens, child, multimodal=multimodal))
        except Exception:
            for request_id in (r for group in ids for r in group):
                engine.abort(request_id)
            while engine.has_unfinished():
                engine.step()
            raise
        finals: dict[str, RequestOutput] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [
            self._result([finals[r] for r in group], tokens, p)
            for group, tokens, p in zip(ids, token_lists, params, strict=True)
        ]

    def _result(
        self, finals: list[RequestOutput], tokens: list[int], params: SamplingParams
    ) -> GenerationResult:
        choices = best_choices(finals, params)
        outputs = tuple(
            CompletionOutput(
                index=i,
                text=out.text or "",
                token_ids=out.output_token_ids,
                cumulative_logprob=out.cumulative_logprob if params.logprobs is not None else None,
                logprobs=self._logprob_dicts(out.logprobs) if params.logprobs is not None else None,
                finish_reason=out.finish_reason,
            )
            for i, out in enumerate(choices)
        )
        prompt_lps = finals[0].prompt_logprobs
        return GenerationResult(
            request_id=finals[0].request_id,
            prompt_token_ids=tuple(tokens),
            token_ids=outputs[0].token_ids,
            text=outputs[0].text,
            finish_reason=outputs[0].finish_reason,
            outputs=outputs,
            prompt_logprobs=None if prompt_lps is None else self._logprob_dicts(prompt_lps),
        )

    def _logprob_dicts(self, entries: Sequence[TokenLogprobs | None] | None) -> list[Any]:
        return [None if e is None else logprob_dict(e, self._decode_one) for e in entries or ()]

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def best_choices(finals: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """The ``n`` choices to return: all of them, or the best ``n`` of ``best_of`` (stable)."""
    if not params.ranks_by_logprob:
        return finals
    ranked = sorted(finals, key=lambda out: -(out.cumulative_logprob or 0.0))
    return ranked[: params.n]


def logprob_dict(entry: TokenLogprobs, decode: Callable[[int], str]) -> LogprobDict:
    """vLLM's per-position dict: the token itself, then the most likely tokens."""
    out = {entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        out.setdefault(token_id, Logprob(logprob, rank, decode(token_id)))
    return out


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    items = list(params)
    if len(items) != n:
        raise ConfigError(f"sampling_params: {len(items)} given for {n} prompts")
    return items
