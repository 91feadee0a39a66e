"""Normalised facts about a decoder-only model, read once from its Hugging Face config.

``ModelSpec.from_hf_config`` is the only place that knows the spelling quirks of HF configs
(``head_dim`` missing, ``layer_types`` vs a bare ``sliding_window``, tied embeddings). Everything
downstream (the memory plan, the runtime) reads a ``ModelSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvroom.errors import ModelSourceError

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
}
"""HF ``architectures`` name -> HF ``model_type`` of every architecture kvroom runs."""

_REQUIRED_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
)
_ARCH_BY_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

LayerKind = Literal["full", "sliding"]


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer, as the planner and the runtime need them."""

    architecture: str
    """HF architecture name, e.g. ``LlamaForCausalLM``."""
    model_type: str
    """HF ``model_type``, e.g. ``llama``."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (fewer than ``num_heads`` with grouped-query attention)."""
    head_dim: int
    vocab_size: int
    layer_types: tuple[str, ...]
    """Per layer: ``full_attention`` or ``sliding_attention`` (HF spelling)."""
    sliding_window: int | None
    """Window of the sliding-attention layers, in tokens; None when there are none."""
    tie_embeddings: bool
    """The LM head shares the input embedding matrix."""
    max_position_embeddings: int
    attention_bias: bool = False
    """q/k/v projections carry a bias (qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k (qwen3, gemma3)."""

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelSpec:
        """Build from a ``config.json`` mapping.

        Raises:
            ModelSourceError: the architecture is not supported (the message lists those that are).
        """
        architecture = _architecture_of(cfg)
        missing = [k for k in _REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ModelSourceError(f"config.json: missing {', '.join(missing)} ({architecture})")
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        num_layers = int(cfg["num_hidden_layers"])
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        window = cfg.get("sliding_window")
        return cls(
            architecture=architecture,
            model_type=model_type,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            vocab_size=int(cfg["vocab_size"]),
            layer_types=_layer_types(cfg, model_type, num_layers),
            sliding_window=int(window) if window else None,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "gemma3_text")),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
        )

    def layer_kinds(self, max_seq_len: int) -> tuple[LayerKind, ...]:
        """Per layer, how its KV is stored when no sequence exceeds ``max_seq_len`` tokens.

        A sliding layer whose window covers ``max_seq_len`` never drops a token, so it is planned
        and run as a full-attention layer (Mistral's 4096-token window at max_seq_len 2048).
        """
        window_binds = self.sliding_window is not None and self.sliding_window < max_seq_len
        return tuple(
            "sliding" if t == "sliding_attention" and window_binds else "full"
            for t in self.layer_types
        )

    def num_full_layers(self, max_seq_len: int) -> int:
        return self.layer_kinds(max_seq_len).count("full")

    def num_sliding_layers(self, max_seq_len: int) -> int:
        return self.layer_kinds(max_seq_len).count("sliding")


def _architecture_of(cfg: Mapping[str, Any]) -> str:
    names = list(cfg.get("architectures") or [])
    if not names and cfg.get("model_type") in _ARCH_BY_MODEL_TYPE:
        names = [_ARCH_BY_MODEL_TYPE[cfg["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(names) or f"model_type={cfg.get('model_type')!r}"
    raise ModelSourceError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _layer_types(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[str, ...]:
    explicit = cfg.get("layer_types")
    if explicit:
        if len(explicit) != num_layers:
            raise ModelSourceError(
                f"config.json: layer_types has {len(explicit)} entries for {num_layers} layers"
            )
        return tuple(str(t) for t in explicit)
    if model_type == "mistral" and cfg.get("sliding_window"):
        return ("sliding_attention",) * num_layers
    if model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return tuple(
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        )
    return ("full_attention",) * num_layers
