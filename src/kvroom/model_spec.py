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
    "Gemma4ForCausalLM": "gemma4_text",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
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
_TEXT_CONFIG_TYPES = ("gemma4", "qwen3_vl")
"""Multimodal model types whose decoder facts live under ``text_config``."""

LayerKind = Literal["full", "sliding"]

PROCESSOR_MIN_PIXELS = 56 * 56
PROCESSOR_MAX_PIXELS = 28 * 28 * 1280
"""Size limits of transformers' Qwen2-VL image processor where its config names none."""


@dataclass(frozen=True)
class VisionSpec:
    """Shapes of a vision tower (Qwen3-VL), as the planner needs them."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    depth: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_deepstack: int
    """Early decoder layers that get deepstack features (one ``[tokens, out_hidden]`` each)."""
    processor_min_pixels: int = PROCESSOR_MIN_PIXELS
    """The image processor's ``min_pixels`` (``size.shortest_edge``): smaller images are scaled
    up to it."""
    processor_max_pixels: int = PROCESSOR_MAX_PIXELS
    """The image processor's ``max_pixels`` (``size.longest_edge``): larger images are scaled
    down to it."""

    @classmethod
    def from_hf(
        cls, v: Mapping[str, Any], image_processor: Mapping[str, Any] | None = None
    ) -> VisionSpec:
        """From the ``vision_config`` and the image processor's config (None: the processor's
        defaults, as transformers builds it without a config file)."""
        low, high = _processor_pixels(image_processor or {})
        return cls(
            hidden_size=int(v.get("hidden_size", 1152)),
            intermediate_size=int(v.get("intermediate_size", 4304)),
            num_heads=int(v.get("num_heads", 16)),
            depth=int(v.get("depth", 27)),
            patch_size=int(v.get("patch_size", 16)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            out_hidden_size=int(v.get("out_hidden_size", 3584)),
            num_deepstack=len(v.get("deepstack_visual_indexes", (8, 16, 24))),
            processor_min_pixels=low,
            processor_max_pixels=high,
        )


def _processor_pixels(proc: Mapping[str, Any]) -> tuple[int, int]:
    """(min, max) pixels of an image processor config: ``min_pixels``/``max_pixels`` at the top
    override ``size``'s ``shortest_edge``/``longest_edge`` (as transformers applies them)."""
    size = proc.get("size") or {}
    low = proc.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    high = proc.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    pixels = (low or PROCESSOR_MIN_PIXELS, high or PROCESSOR_MAX_PIXELS)
    if not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in pixels):
        raise ModelSourceError(
            f"image processor config: min_pixels/max_pixels must be positive ints, got {pixels}"
        )
    return pixels


@dataclass(frozen=True)
class LayerKV:
    """How one decoder layer keeps its KV (Gemma 4 varies these per layer)."""

    num_kv_heads: int
    head_dim: int
    k_eq_v: bool = False
    """One tensor per token is stored (Gemma 4 ``attention_k_eq_v``): V; K is derived from it."""
    kv_source: int | None = None
    """Layer whose KV this one attends over (KV sharing); None = it stores its own."""

    @property
    def num_entries(self) -> int:
        """Tensors stored per token and head: 2 (K and V), 1 when K=V."""
        return 1 if self.k_eq_v else 2


@dataclass(frozen=True)
class KVGroup:
    """Layers whose KV has one entry shape, stored in one pool tensor.

    ``layers`` each own a slice of the tensor; ``shared_layers`` read the slice of an earlier
    layer of the group and own none.
    """

    kind: LayerKind
    num_kv_heads: int
    head_dim: int
    num_entries: int
    layers: tuple[int, ...]
    shared_layers: tuple[int, ...] = ()

    def describe(self) -> str:
        """For the plan table, e.g.
        ``2 full-attention layers, K=V, 1 KV head x 512 dims; 4 layers share earlier KV``."""
        n = len(self.layers)
        kind = "full-attention" if self.kind == "full" else "sliding-window"
        heads = f"{self.num_kv_heads} KV head{'s' if self.num_kv_heads != 1 else ''}"
        text = f"{n} {kind} layer{'s' if n != 1 else ''}"
        if self.num_entries == 1:
            text += ", K=V"
        text += f", {heads} x {self.head_dim} dims"
        if self.shared_layers:
            m = len(self.shared_layers)
            text += f"; {m} layer{'s' if m != 1 else ''} share{'s' if m == 1 else ''} earlier KV"
        return text


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
    layer_kv: tuple[LayerKV, ...] = ()
    """Per layer its KV shape and sharing; empty = every layer ``num_kv_heads x head_dim``."""
    vision: VisionSpec | None = None
    """The vision tower of a model that takes images (Qwen3-VL); None for text models."""

    def __post_init__(self) -> None:
        if not self.layer_kv:
            uniform = LayerKV(self.num_kv_heads, self.head_dim)
            object.__setattr__(self, "layer_kv", (uniform,) * self.num_layers)
        if len(self.layer_kv) != self.num_layers:
            raise ModelSourceError(
                f"layer_kv: {len(self.layer_kv)} entries for {self.num_layers} layers"
            )

    @classmethod
    def from_hf_config(
        cls, cfg: Mapping[str, Any], image_processor: Mapping[str, Any] | None = None
    ) -> ModelSpec:
        """Build from a ``config.json`` mapping (and, for a model that takes images, its image
        processor's config: ``sources.read_image_processor_config``).

        Raises:
            ModelSourceError: the architecture is not supported (the message lists those that are).
        """
        architecture = _architecture_of(cfg)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        vision = None
        if model_type == "qwen3_vl":
            vision = VisionSpec.from_hf(cfg["vision_config"], image_processor)
        if model_type in _TEXT_CONFIG_TYPES:
            cfg = _text_config(cfg)
            model_type = str(cfg.get("model_type") or f"{model_type}_text")
        missing = [k for k in _REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ModelSourceError(f"config.json: missing {', '.join(missing)} ({architecture})")
        num_layers = int(cfg["num_hidden_layers"])
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        window = cfg.get("sliding_window")
        layer_types = _layer_types(cfg, model_type, num_layers)
        gemma = model_type in ("gemma3_text", "gemma4_text")
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
            layer_types=layer_types,
            sliding_window=int(window) if window else None,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "gemma3_text", "gemma4_text", "qwen3_vl_text"),
            layer_kv=_gemma4_layer_kv(cfg, layer_types) if model_type == "gemma4_text" else (),
            vision=vision,
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

    def kv_groups(self, max_seq_len: int) -> tuple[KVGroup, ...]:
        """Layers grouped by (kind, KV heads, head dim, entries), in order of first layer.

        A layer with a ``kv_source`` joins its source's group as a shared layer.
        """
        kinds = self.layer_kinds(max_seq_len)
        owners: dict[tuple[object, ...], list[int]] = {}
        shared: dict[tuple[object, ...], list[int]] = {}
        key_of: dict[int, tuple[object, ...]] = {}
        for i, kv in enumerate(self.layer_kv):
            if kv.kv_source is not None:
                shared.setdefault(key_of[kv.kv_source], []).append(i)
                continue
            key = (kinds[i], kv.num_kv_heads, kv.head_dim, kv.num_entries)
            key_of[i] = key
            owners.setdefault(key, []).append(i)
        return tuple(
            KVGroup(k[0], k[1], k[2], k[3], tuple(v), tuple(shared.get(k, ())))  # type: ignore[arg-type]
            for k, v in owners.items()
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
    if model_type in ("gemma3_text", "gemma4_text"):
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
        if model_type == "gemma4_text":
            types[-1] = "full_attention"  # as transformers forces it
        return tuple(types)
    return ("full_attention",) * num_layers


def _text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's config of a multimodal model; top-level keys fill what it leaves out."""
    text = dict(cfg.get("text_config") or {})
    if not text:
        raise ModelSourceError(f"config.json: {cfg.get('model_type')} without text_config")
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return text


def _gemma4_layer_kv(cfg: Mapping[str, Any], layer_types: tuple[str, ...]) -> tuple[LayerKV, ...]:
    """Gemma 4: full-attention layers use ``global_head_dim`` (and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads`` and one stored tensor); the last ``num_kv_shared_layers``
    layers read the KV of the last earlier layer of their type.

    A config saved by transformers carries the per-layer values as ``per_layer_config``.
    """
    n = len(layer_types)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    heads, head_dim = int(cfg.get("num_key_value_heads") or 1), int(cfg.get("head_dim") or 256)
    overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    if not overrides:
        glob = {"head_dim": int(cfg.get("global_head_dim") or 512)}
        if k_eq_v and cfg.get("num_global_key_value_heads"):
            glob["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
        overrides = {i: glob for i, t in enumerate(layer_types) if t == "full_attention"}
    num_shared = int(cfg.get("num_kv_shared_layers") or 0)
    first_shared = n - num_shared
    out: list[LayerKV] = []
    for i, t in enumerate(layer_types):
        o = overrides.get(i, {})
        source = None
        if i >= first_shared:
            earlier = [j for j in range(first_shared) if layer_types[j] == t]
            if not earlier:
                raise ModelSourceError(
                    f"config.json: layer {i} ({t}) shares KV but no earlier layer has its type"
                )
            source = earlier[-1]
        out.append(
            LayerKV(
                num_kv_heads=int(o.get("num_key_value_heads", heads)),
                head_dim=int(o.get("head_dim", head_dim)),
                k_eq_v=k_eq_v and t == "full_attention",
                kv_source=source,
            )
        )
    return tuple(out)
