"""Sampling parameters, validated and torch-free; the sampler lives in ``engine/sampler.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroom.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM names)."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables."""
    max_tokens: int = 16
    """Maximum number of tokens to generate."""
    seed: int | None = None
    """Seed of this request's own generator, for reproducible sampling."""
    stop: tuple[str, ...] = field(default=())
    """Stop strings; generation ends when the text contains one (it is not returned)."""
    stop_token_ids: tuple[int, ...] = field(default=())
    """Extra token ids that end generation (the token is kept in the output)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, ">= 0 or -1")
        _check(
            _is_int(self.max_tokens) and self.max_tokens > 0, "max_tokens", self.max_tokens, "> 0"
        )
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an int")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty str")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"SamplingParams.{name}: must be {expected}, got {value!r}")
