from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from kvroom.config import DecoderOnlyConfig
from kvroom.errors import ConfigError


def _exact(message: str) -> str:
    return f"^{re.escape(message)}$"


def _keep(n: int, cfg: DecoderOnlyConfig) -> int:
    return n


# -- defaults and normalisation -------------------------------------------------------------------
def test_defaults() -> None:
    cfg = DecoderOnlyConfig()
    assert (cfg.max_seq_len, cfg.batch_size, cfg.kvcache_block_size) == (2048, 32, 16)
    assert cfg.kvcache_num_blocks is None
    assert cfg.dtype == cfg.kv_dtype == "float32"
    assert cfg.kvcache_reserve_memory == 0
    assert cfg.kvcache_memory_fraction == 0.9
    assert cfg.device_memory is None


def test_kv_dtype_defaults_to_normalised_dtype() -> None:
    assert DecoderOnlyConfig(dtype="bf16").kv_dtype == "bfloat16"


def test_kv_dtype_explicit_is_normalised() -> None:
    cfg = DecoderOnlyConfig(dtype="bf16", kv_dtype="fp8")
    assert (cfg.dtype, cfg.kv_dtype) == ("bfloat16", "float8_e4m3fn")


def test_zero_num_blocks_means_estimate() -> None:
    assert DecoderOnlyConfig(kvcache_num_blocks=0).kvcache_num_blocks is None
    assert DecoderOnlyConfig(kvcache_num_blocks=12).kvcache_num_blocks == 12


def test_fraction_int_one_becomes_float() -> None:
    cfg = DecoderOnlyConfig(kvcache_memory_fraction=1)
    assert cfg.kvcache_memory_fraction == 1.0
    assert isinstance(cfg.kvcache_memory_fraction, float)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:7"])
def test_known_devices(device: str) -> None:
    assert DecoderOnlyConfig(device=device).device == device


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512 MB", 512 * 10**6),
        (4096, 4096),
    ],
)
def test_reserve_memory_normalises_to_bytes(value: int | str, expected: int) -> None:
    assert DecoderOnlyConfig(kvcache_reserve_memory=value).kvcache_reserve_memory == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("h100-80gb", "h100-80gb"),
        (" H100-80GB ", "h100-80gb"),  # profile names are trimmed and lower-cased
        ("l4-24gb", "l4-24gb"),
        ("16GiB", 16 * 2**30),
        ("1.5 GB", 1_500_000_000),
        (123, 123),
        (None, None),
    ],
)
def test_device_memory_normalises(value: int | str | None, expected: int | str | None) -> None:
    assert DecoderOnlyConfig(device_memory=value).device_memory == expected


def test_frozen() -> None:
    cfg = DecoderOnlyConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 4  # type: ignore[misc]


# -- every bad value names the field and the value ------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "max_seq_len",
        "batch_size",
        "kvcache_block_size",
        "max_num_batched_tokens",
        "tensor_parallel_size",
    ],
)
@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8", None])
def test_sizes_must_be_positive_ints(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=_exact(f"{name}: must be a positive int, got {value!r}")):
        DecoderOnlyConfig(**{name: value})


@pytest.mark.parametrize("value", [-1, -16, True, False, 2.5, "8"])
def test_bad_num_blocks(value: object) -> None:
    expected = f"kvcache_num_blocks: must be a positive int, got {value!r}"
    with pytest.raises(ConfigError, match=_exact(expected)):
        DecoderOnlyConfig(kvcache_num_blocks=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.01, 2, True, False, "0.5", float("nan")])
def test_bad_memory_fraction(value: object) -> None:
    expected = f"kvcache_memory_fraction: must be in (0, 1], got {value!r}"
    with pytest.raises(ValueError, match=_exact(expected)):
        DecoderOnlyConfig(kvcache_memory_fraction=value)  # type: ignore[arg-type]


def test_unknown_dtype() -> None:
    with pytest.raises(ConfigError, match=r"^dtype: unknown dtype 'int4'; supported: float32, "):
        DecoderOnlyConfig(dtype="int4")


@pytest.mark.parametrize("value", ["float8_e4m3fn", "fp8", "float8_e5m2"])
def test_float8_holds_kv_only(value: str) -> None:
    expected = r"^dtype: float8_e\w+ cannot hold weights and activations; supported: float32, "
    with pytest.raises(ConfigError, match=expected + r"bfloat16, float16 \(float8 is for kv_"):
        DecoderOnlyConfig(dtype=value)
    assert DecoderOnlyConfig(kv_dtype=value).kv_dtype.startswith("float8_e")


def test_unknown_kv_dtype() -> None:
    with pytest.raises(ConfigError, match=r"^kv_dtype: unknown dtype 'int3'; supported: float32, "):
        DecoderOnlyConfig(kv_dtype="int3")


@pytest.mark.parametrize(("kv_dtype", "rotation"), [("int8", "hadamard"), ("q4", "hadamard")])
def test_quantized_kv_is_rotated_by_default(kv_dtype: str, rotation: str) -> None:
    cfg = DecoderOnlyConfig(kv_dtype=kv_dtype)
    assert cfg.kv_dtype in ("int8", "int4") and cfg.kv_rotation == rotation
    assert DecoderOnlyConfig(kv_dtype=kv_dtype, kv_rotation="none").kv_rotation == "none"
    assert DecoderOnlyConfig(dtype="bf16").kv_rotation == "none"


def test_kv_rotation_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"^kv_rotation: unknown 'walsh'; one of hadamard, none$"):
        DecoderOnlyConfig(kv_dtype="int8", kv_rotation="walsh")
    with pytest.raises(ConfigError, match=r"^kv_rotation: hadamard applies to int8/int4 KV only"):
        DecoderOnlyConfig(kv_rotation="hadamard")


@pytest.mark.parametrize("device", ["tpu", "CUDA", "cuda:x", "cuda:", "cuda:-1", "", "cpu:"])
def test_unknown_device(device: str) -> None:
    expected = f"device: unknown device {device!r}; use cpu, cuda or cuda:N"
    with pytest.raises(ConfigError, match=_exact(expected)):
        DecoderOnlyConfig(device=device)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("lots", "kvcache_reserve_memory: cannot parse 'lots' as a byte size"),
        ("-1GiB", "kvcache_reserve_memory: cannot parse '-1GiB' as a byte size"),
        (-1, "kvcache_reserve_memory: must be >= 0 bytes, got -1"),
        (True, "kvcache_reserve_memory: expected bytes as an int or a string like '2GiB', got"),
        (None, "kvcache_reserve_memory: expected bytes as an int or a string like '2GiB', got"),
    ],
)
def test_bad_reserve_memory(value: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}"):
        DecoderOnlyConfig(kvcache_reserve_memory=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("lots", "device_memory: cannot parse 'lots' as a byte size"),
        ("h300-999gb", "device_memory: cannot parse 'h300-999gb' as a byte size"),
        (0, "device_memory: must be > 0 bytes, got 0"),
        ("0GiB", "device_memory: must be > 0 bytes, got 0"),
        (-1, "device_memory: must be >= 0 bytes, got -1"),
        (True, "device_memory: expected bytes as an int or a string like '2GiB', got True"),
    ],
)
def test_bad_device_memory(value: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}"):
        DecoderOnlyConfig(device_memory=value)  # type: ignore[arg-type]


def test_quantization_names_the_choices() -> None:
    expected = "quantization: unknown 'int3'; one of none, int8, int4, int4-g128"
    with pytest.raises(ConfigError, match=_exact(expected)):
        DecoderOnlyConfig(quantization="int3")
    assert DecoderOnlyConfig(quantization="none").quantization == "none"


@pytest.mark.parametrize("value", [8, "halve", [1]])
def test_adjuster_must_be_callable(value: object) -> None:
    expected = f"kvcache_num_blocks_adjuster: must be callable, got {value!r}"
    with pytest.raises(ConfigError, match=_exact(expected)):
        DecoderOnlyConfig(kvcache_num_blocks_adjuster=value)  # type: ignore[arg-type]


# -- derived --------------------------------------------------------------------------------------
def test_derived_block_counts_round_up() -> None:
    cfg = DecoderOnlyConfig(max_seq_len=30, kvcache_block_size=4, batch_size=3)
    assert cfg.num_min_blocks == 8  # ceil(30 / 4) = ceil(7.5)
    assert cfg.num_full_blocks == 24  # 8 x 3


def test_derived_block_counts_exact_division() -> None:
    cfg = DecoderOnlyConfig(max_seq_len=2048, kvcache_block_size=16, batch_size=32)
    assert cfg.num_min_blocks == 128  # 2048 / 16
    assert cfg.num_full_blocks == 4096  # 128 x 32


# -- serialization --------------------------------------------------------------------------------
def test_to_dict_is_every_field_but_the_adjuster(make_config) -> None:
    cfg = make_config(kvcache_num_blocks_adjuster=_keep, kvcache_reserve_memory="1KiB")
    assert cfg.to_dict() == {
        "max_seq_len": 32,
        "batch_size": 2,
        "kvcache_block_size": 4,
        "kvcache_num_blocks": None,
        "max_num_batched_tokens": 16,
        "dtype": "float32",
        "kv_dtype": "float32",
        "kv_rotation": "none",
        "quantization": None,
        "device": "cpu",
        "device_memory": None,
        "tensor_parallel_size": 1,
        "kvcache_reserve_memory": 1024,
        "kvcache_memory_fraction": 0.9,
    }


def test_to_json_is_sorted_to_dict(make_config) -> None:
    cfg = make_config(kvcache_num_blocks_adjuster=_keep)
    text = cfg.to_json()
    assert json.loads(text) == cfg.to_dict()
    assert text.index('"batch_size"') < text.index('"device"') < text.index('"max_seq_len"')


def test_round_trip(make_config) -> None:
    cfg = make_config(
        kvcache_num_blocks=12,
        dtype="bf16",
        kv_dtype="fp8",
        device="cuda:1",
        device_memory="h100-80gb",
        kvcache_reserve_memory="1GiB",
        kvcache_memory_fraction=0.8,
        tensor_parallel_size=2,
        kvcache_num_blocks_adjuster=_keep,
    )
    restored = DecoderOnlyConfig.from_dict(cfg.to_dict())
    assert restored == dataclasses.replace(cfg, kvcache_num_blocks_adjuster=None)
    assert restored.kvcache_num_blocks_adjuster is None  # compare=False: == alone cannot tell
    assert DecoderOnlyConfig.from_dict(json.loads(cfg.to_json())) == restored


def test_round_trip_keeps_byte_device_memory(make_config) -> None:
    cfg = make_config(device_memory="16GiB")
    assert DecoderOnlyConfig.from_dict(cfg.to_dict()).device_memory == 16 * 2**30


def test_from_dict_unknown_keys_are_named() -> None:
    expected = "DecoderOnlyConfig: unknown field(s) max_seqlen, zeta"
    with pytest.raises(ConfigError, match=_exact(expected)):
        DecoderOnlyConfig.from_dict({"max_seq_len": 8, "zeta": 1, "max_seqlen": 8})


def test_from_dict_validates() -> None:
    with pytest.raises(ConfigError, match=_exact("batch_size: must be a positive int, got 0")):
        DecoderOnlyConfig.from_dict({"batch_size": 0})


@dataclass(frozen=True)
class MultimodalConfig(DecoderOnlyConfig):
    image_size: int = 224
    load_visual_runtime: Callable[[], object] | None = field(default=None, compare=False)

    _non_save_attributes: ClassVar[tuple[str, ...]] = ("load_visual_runtime",)


@dataclass(frozen=True)
class ForgetfulConfig(DecoderOnlyConfig):
    """Overrides the declaration with nothing: the adjuster must stay excluded anyway."""

    _non_save_attributes: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class LeakyConfig(DecoderOnlyConfig):
    """Holds a callable it does not declare excluded."""

    load_visual_runtime: Callable[[], object] | None = None


def _load_visual() -> object:
    return object()


def test_subclass_exclusions_merge_over_the_mro() -> None:
    assert MultimodalConfig.non_save_attributes() == {
        "kvcache_num_blocks_adjuster",
        "load_visual_runtime",
    }
    assert DecoderOnlyConfig.non_save_attributes() == {"kvcache_num_blocks_adjuster"}


def test_subclass_to_dict_excludes_both_callables() -> None:
    cfg = MultimodalConfig(
        image_size=336, load_visual_runtime=_load_visual, kvcache_num_blocks_adjuster=_keep
    )
    data = cfg.to_dict()
    assert "kvcache_num_blocks_adjuster" not in data
    assert "load_visual_runtime" not in data
    assert data["image_size"] == 336
    assert len(data) == 15  # the 14 saved base fields + image_size
    json.dumps(data)


def test_subclass_round_trip() -> None:
    cfg = MultimodalConfig(
        image_size=336, load_visual_runtime=_load_visual, kvcache_num_blocks_adjuster=_keep
    )
    restored = MultimodalConfig.from_dict(cfg.to_dict())
    assert restored == cfg
    assert restored.image_size == 336
    assert restored.load_visual_runtime is None
    assert restored.kvcache_num_blocks_adjuster is None


def test_subclass_cannot_re_enable_the_adjuster() -> None:
    cfg = ForgetfulConfig(kvcache_num_blocks_adjuster=_keep)
    assert "kvcache_num_blocks_adjuster" not in cfg.to_dict()


def test_undeclared_callable_field_is_a_type_error_naming_it() -> None:
    cfg = LeakyConfig(load_visual_runtime=_load_visual)
    with pytest.raises(
        TypeError, match=r"^LeakyConfig\.load_visual_runtime: <function _load_visual at .*> is not"
    ):
        cfg.to_dict()


def test_undeclared_field_holding_none_serializes() -> None:
    assert LeakyConfig().to_dict()["load_visual_runtime"] is None
