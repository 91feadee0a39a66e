"""Sampling parameters, validated and torch-free; the sampler is ``engine/sampling/sampler.py``.

The names and meanings are vLLM's (``vllm.SamplingParams``), so a request that works there
means the same here. Logprobs are those of the raw model output (``log_softmax`` of the
logits before penalties, bias, temperature or truncation), vLLM's default ``raw_logprobs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kvroom.engine.params.structured import StructuredOutputsParams
from kvroom.errors import ConfigError

MAX_LOGPROBS = 20
"""Most top logprobs one token may carry (vLLM's default ``max_logprobs``, OpenAI's limit)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, what to report, and when to stop (vLLM names)."""

    n: int = 1
    """Independent output sequences per prompt (``LLM.generate``; the server fans them out)."""
    best_of: int | None = None
    """Sequences generated per prompt, of which the ``n`` with the highest cumulative logprob
    are returned; None means ``n``."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the most likely one's."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that already appears in the output."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence of the token in the output so far."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on tokens of the prompt or output: a logit > 0 is divided by it, a
    logit < 0 multiplied; 1 disables."""
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    """``(token_id, bias)`` pairs added to the logits (a mapping is accepted)."""
    max_tokens: int = 16
    """Maximum number of tokens to generate."""
    min_tokens: int = 0
    """EOS and stop token ids cannot be sampled (nor stop strings end the text) before this
    many tokens have been generated."""
    seed: int | None = None
    """Seed of this request's own generator, for reproducible sampling."""
    stop: tuple[str, ...] = field(default=())
    """Stop strings; generation ends when the text contains one."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the text at its end (it is cut off by default)."""
    stop_token_ids: tuple[int, ...] = field(default=())
    """Extra token ids that end generation (the token is kept in the output)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int | None = None
    """Report, for each generated token, its logprob and the ``logprobs`` most likely
    alternatives (0: only the token's own); None reports nothing."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (whose entry is None); computing them
    needs logits at every prompt position, so only requests that ask pay for it."""
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the text."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar
    (``engine/structured/grammar.py`` compiles it, ``engine/structured/masks.py`` masks the
    logits); the grammar decides where the output ends, so neither ``min_tokens`` nor
    ``ignore_eos`` may be set with it."""

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in pairs))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate_sampling()
        self._validate_lengths()
        self._validate_reporting()
        self._validate_structured()

    def _validate_sampling(self) -> None:
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, ">= 0 or -1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            self.presence_penalty,
            "in [-2, 2]",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            self.frequency_penalty,
            "in [-2, 2]",
        )
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an int")

    def _validate_lengths(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an int >= 1")
        best_of = self.best_of
        _check(
            best_of is None or (_is_int(best_of) and best_of >= self.n),
            "best_of",
            best_of,
            f"an int >= n ({self.n})",
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens > 0, "max_tokens", self.max_tokens, "> 0"
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"in [0, max_tokens={self.max_tokens}]",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty str")

    def _validate_reporting(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            expected = f"None or an int in [0, {MAX_LOGPROBS}]"
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                value,
                expected,
            )

    def _validate_structured(self) -> None:
        so = self.structured_outputs
        _check(
            so is None or isinstance(so, StructuredOutputsParams),
            "structured_outputs",
            so,
            "None or a StructuredOutputsParams",
        )
        if so is None:
            return
        for name in ("min_tokens", "ignore_eos"):
            _check(
                not getattr(self, name),
                name,
                getattr(self, name),
                "unset with structured_outputs (the grammar decides where the output ends)",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def num_sequences(self) -> int:
        """Sequences generated for one prompt: ``best_of`` if set, else ``n``."""
        return self.best_of or self.n

    @property
    def ranks_by_logprob(self) -> bool:
        """``best_of > n``: choices are picked by cumulative logprob, so it must be computed."""
        return self.num_sequences > self.n

    def child(self, index: int) -> SamplingParams:
        """The params of sequence ``index`` of ``num_sequences`` for one prompt.

        One sequence each (``n = 1``), seed ``seed + index`` as vLLM's parallel sampling, and
        logprobs at least 0 when ``best_of`` ranks the sequences by cumulative logprob.
        """
        logprobs = self.logprobs
        if logprobs is None and self.ranks_by_logprob:
            logprobs = 0
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, best_of=None, seed=seed, logprobs=logprobs)

    @property
    def penalised(self) -> bool:
        """Needs the token history (presence, frequency or repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def processes_logits(self) -> bool:
        """Changes the logits before sampling (so even greedy is not a plain argmax)."""
        return self.penalised or bool(self.logit_bias) or self.min_tokens > 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"SamplingParams.{name}: must be {expected}, got {value!r}")
