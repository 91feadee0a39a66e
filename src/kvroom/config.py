"""``DecoderOnlyConfig``: the knobs of an artifact, validated once, saved as kvroom_config.json.

Serialization never writes a callable: every class declares the attributes it keeps out of the
file in ``_non_save_attributes``, and ``non_save_attributes()`` merges those declarations over the
whole class hierarchy, so a subclass adding its own exclusions cannot re-enable the adjuster.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvroom.device import TARGET_PROFILES
from kvroom.errors import ConfigError
from kvroom.units import (
    COMPUTE_DTYPES,
    KV_DTYPES,
    KV_QUANT_BITS,
    cdiv,
    normalize_dtype,
    parse_bytes,
)

DEVICES = ("cpu", "cuda")
QUANTIZATIONS = ("none", "int8", "int4", "int4-g128")
"""``quantization`` values besides None (the source's own format)."""
KV_ROTATIONS = ("hadamard", "none")
"""``kv_rotation`` values."""

NumBlocksAdjuster = Callable[[int, "DecoderOnlyConfig"], int]


@dataclass(frozen=True)
class DecoderOnlyConfig:
    """How a decoder-only model is prepared and how big its paged KV cache is."""

    max_seq_len: int = 2048
    """Longest sequence (prompt + generated tokens) one request may reach."""
    batch_size: int = 32
    """Most sequences running at once."""
    kvcache_block_size: int = 16
    """Tokens per KV block."""
    kvcache_num_blocks: int | None = None
    """KV blocks in the pool; unset or 0 = estimate from device memory (at start-up also
    auto, or elastic for serve)."""
    max_num_batched_tokens: int = 512
    """Token budget of one engine step; also the largest prefill chunk."""
    dtype: str = "float32"
    """Weight and activation dtype (float32, bfloat16, float16)."""
    kv_dtype: str | None = None
    """KV cache dtype (a dtype, float8_e4m3fn, float8_e5m2, or int8 / int4 with a scale per
    token and kv head); None = same as dtype."""
    kv_rotation: str | None = None
    """int8/int4 KV: hadamard = rotate Q, K and V by a Hadamard matrix before quantizing
    (outliers spread over the head dim), none = off; None = hadamard with int8/int4 KV."""
    quantization: str | None = None
    """Weights: None = as the source ships them (a GGUF keeps its quantized blocks); none =
    dequantized to dtype (--dequantize); int8 = projections int8 per output channel; int4 /
    int4-g128 = projections int4 in groups of 32 / 128, asymmetric."""
    device: str = "cpu"
    """Device the artifact is planned for and run on: cpu, cuda or cuda:N."""
    device_memory: int | str | None = None
    """Memory to plan for: None = probe the device; bytes, '16GiB', or a profile like h100-80gb."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over; the plan is per rank."""
    kvcache_reserve_memory: int | str = 0
    """Bytes left for other processes, subtracted before the KV pool is fitted ('2GiB')."""
    kvcache_memory_fraction: float = 0.9
    """Share of device memory kvroom may use, 0 < f <= 1."""
    kvcache_num_blocks_adjuster: NumBlocksAdjuster | None = field(default=None, compare=False)
    """Called as adjuster(estimated, config) at build time; its int replaces the estimate."""

    _non_save_attributes: ClassVar[tuple[str, ...]] = ("kvcache_num_blocks_adjuster",)

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "batch_size", "kvcache_block_size", "max_num_batched_tokens"):
            _require_positive_int(name, getattr(self, name))
        _require_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        self._normalize_num_blocks()
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype, "dtype", COMPUTE_DTYPES))
        kv_dtype = self.dtype if self.kv_dtype is None else self.kv_dtype
        object.__setattr__(self, "kv_dtype", normalize_dtype(kv_dtype, "kv_dtype", KV_DTYPES))
        self._normalize_kv_rotation()
        validate_device_name(self.device)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization: unknown {self.quantization!r}; one of {', '.join(QUANTIZATIONS)}"
            )
        self._normalize_memory_fields()
        adjuster = self.kvcache_num_blocks_adjuster
        if adjuster is not None and not callable(adjuster):
            raise ConfigError(f"kvcache_num_blocks_adjuster: must be callable, got {adjuster!r}")

    def _normalize_num_blocks(self) -> None:
        n = self.kvcache_num_blocks
        if n is None or (isinstance(n, int) and not isinstance(n, bool) and n == 0):
            object.__setattr__(self, "kvcache_num_blocks", None)
            return
        _require_positive_int("kvcache_num_blocks", n)

    def _normalize_kv_rotation(self) -> None:
        quantized = self.kv_dtype in KV_QUANT_BITS
        rotation = self.kv_rotation
        if rotation is None:
            rotation = "hadamard" if quantized else "none"
        if rotation not in KV_ROTATIONS:
            raise ConfigError(
                f"kv_rotation: unknown {rotation!r}; one of {', '.join(KV_ROTATIONS)}"
            )
        if rotation == "hadamard" and not quantized:
            raise ConfigError(
                f"kv_rotation: hadamard applies to int8/int4 KV only, kv_dtype is "
                f"{self.kv_dtype}; drop --kv-rotation or use --kv-dtype int8|int4"
            )
        object.__setattr__(self, "kv_rotation", rotation)

    def _normalize_memory_fields(self) -> None:
        reserve = parse_bytes(self.kvcache_reserve_memory, "kvcache_reserve_memory")
        object.__setattr__(self, "kvcache_reserve_memory", reserve)
        memory = self.device_memory
        if isinstance(memory, str) and memory.strip().lower() in TARGET_PROFILES:
            object.__setattr__(self, "device_memory", memory.strip().lower())
        elif memory is not None:
            size = parse_bytes(memory, "device_memory")
            if size == 0:
                raise ConfigError("device_memory: must be > 0 bytes, got 0")
            object.__setattr__(self, "device_memory", size)
        f = self.kvcache_memory_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ConfigError(f"kvcache_memory_fraction: must be in (0, 1], got {f!r}")
        object.__setattr__(self, "kvcache_memory_fraction", float(f))

    # -- derived ------------------------------------------------------------------------------
    @property
    def num_min_blocks(self) -> int:
        """Blocks one full-length sequence needs: ceil(max_seq_len / block_size)."""
        return cdiv(self.max_seq_len, self.kvcache_block_size)

    @property
    def num_full_blocks(self) -> int:
        """Blocks for batch_size full-length sequences; a larger pool is never used."""
        return self.num_min_blocks * self.batch_size

    # -- serialization ------------------------------------------------------------------------
    @classmethod
    def non_save_attributes(cls) -> frozenset[str]:
        """Names never written to kvroom_config.json, merged over the class hierarchy."""
        names: set[str] = set()
        for klass in cls.__mro__:
            names.update(klass.__dict__.get("_non_save_attributes", ()))
        return frozenset(names)

    def to_dict(self) -> dict[str, Any]:
        """The saveable fields as JSON-ready values.

        Raises:
            TypeError: a field holds a value JSON cannot represent (the message names it).
        """
        excluded = self.non_save_attributes()
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in excluded:
                continue
            value = getattr(self, f.name)
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                raise TypeError(
                    f"{type(self).__name__}.{f.name}: {value!r} is not JSON-serializable"
                ) from None
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecoderOnlyConfig:
        """Inverse of ``to_dict``; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}")
        return cls(**dict(data))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def validate_device_name(device: object) -> None:
    """Raise ``ConfigError`` unless ``device`` is ``cpu``, ``cuda`` or ``cuda:N``."""
    kind, sep, index = str(device).partition(":")
    if kind not in DEVICES or (sep and not index.isdigit()):
        raise ConfigError(f"device: unknown device {device!r}; use cpu, cuda or cuda:N")


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Qwen3VLModelConfig(DecoderOnlyConfig):
    """A Qwen3-VL artifact: the decoder's knobs plus what images may cost in memory."""

    max_images_per_request: int = 1
    """Most images one request may carry."""
    max_image_pixels: int = 512 * 512
    """Largest image, in pixels after the processor's resize (its ``max_pixels``)."""
    encoder_cache_images: int = 4
    """Vision-encoder outputs kept for reuse (recompute after preemption does not re-encode)."""
    image_processor: Any = field(default=None, compare=False)
    """A ready image processor to use instead of the artifact's (never saved)."""

    _non_save_attributes: ClassVar[tuple[str, ...]] = ("image_processor",)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_images_per_request", "max_image_pixels", "encoder_cache_images"):
            _require_positive_int(name, getattr(self, name))


@dataclass(frozen=True)
class Qwen3VLForConditionalGenerationConfig(Qwen3VLModelConfig):
    """The config ``Qwen3VLForConditionalGeneration`` artifacts are built with. It declares
    its own exclusions; the merge over the MRO keeps every inherited one (the adjuster too)."""

    image_loader: Callable[[Any], Any] | None = field(default=None, compare=False)
    """Turns one ``multi_modal_data`` image item into a PIL image (never saved)."""

    _non_save_attributes: ClassVar[tuple[str, ...]] = ("image_loader",)


CONFIG_CLASSES: dict[str, type[DecoderOnlyConfig]] = {
    cls.__name__: cls
    for cls in (DecoderOnlyConfig, Qwen3VLModelConfig, Qwen3VLForConditionalGenerationConfig)
}
"""Class name (``kvroom_config.json``'s ``config_class``) -> config class."""

CONFIG_CLASS_BY_ARCHITECTURE: dict[str, type[DecoderOnlyConfig]] = {
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGenerationConfig,
}
"""Architectures whose artifacts need more than ``DecoderOnlyConfig``."""


def config_class_for(architecture: str) -> type[DecoderOnlyConfig]:
    return CONFIG_CLASS_BY_ARCHITECTURE.get(architecture, DecoderOnlyConfig)
