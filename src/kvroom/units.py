"""Byte sizes and dtype widths: parsing, formatting and ceil-division. No torch here."""

from __future__ import annotations

import re
from decimal import Decimal

from kvroom.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""Width of each supported dtype, by its torch name."""

KV_QUANT_BITS: dict[str, int] = {"int8": 8, "int4": 4}
"""KV-only integer formats: each (token, kv head) row of K or V holds its values, then 4 bytes
of parameters (int8: -127..127 and a float32 scale; int4: 0..15, two per byte, and a float16
scale and min; ``models/kv_quant.py``)."""

KV_SCALE_BYTES = 4
"""The parameters closing each quantized (token, kv head) row: int8 a float32 scale, int4 a
float16 scale and a float16 min."""

KV_DTYPES: tuple[str, ...] = (*DTYPE_BYTES, *KV_QUANT_BITS)
"""Everything ``kv_dtype`` accepts."""

COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""Dtypes weights and activations can run in; the float8 ones are KV cache dtypes only."""

DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "q8": "int8",
    "q4": "int4",
}

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def cdiv(a: int, b: int) -> int:
    """Ceil division of non-negative ints."""
    return -(-a // b)


def parse_bytes(value: int | str, field: str = "value") -> int:
    """Parse ``2147483648``, ``"2GiB"``, ``"1.5 GB"`` or ``"512M"`` (binary) into bytes.

    Raises:
        ConfigError: the value is negative, a bool, or not a recognised size string.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            f"{field}: expected bytes as an int or a string like '2GiB', got {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field}: must be >= 0 bytes, got {value}")
        return value
    match = _BYTES_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{field}: cannot parse {value!r} as a byte size (e.g. 2147483648, '2GiB', '512MB')"
        )
    return int(Decimal(match.group(1)) * _UNITS[unit])  # exact: float gives 2.01GB - 1


def format_bytes(num_bytes: int | float) -> str:
    """``1536 * 2**20`` -> ``'1.50 GiB'``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one (token, kv head) row of K or V: ``head_dim x width``; int8:
    ``head_dim + 4``, int4: ``head_dim / 2 + 4`` (values, then ``KV_SCALE_BYTES``)."""
    bits = KV_QUANT_BITS.get(kv_dtype)
    if bits is None:
        return head_dim * DTYPE_BYTES[kv_dtype]
    return cdiv(head_dim * bits, 8) + KV_SCALE_BYTES


def kv_scale_row_bytes(kv_dtype: str) -> int:
    """Of ``kv_row_bytes``, the bytes of the scale: 4 for int8/int4, else 0."""
    return KV_SCALE_BYTES if kv_dtype in KV_QUANT_BITS else 0


def mib(num_bytes: int | float) -> str:
    """Bytes as MiB with one decimal, the unit of the KV summary line."""
    return f"{num_bytes / 2**20:.1f} MiB"


def normalize_dtype(
    value: str, field: str = "dtype", supported: tuple[str, ...] = tuple(DTYPE_BYTES)
) -> str:
    """Map ``"bf16"``/``"torch.bfloat16"``/``"bfloat16"`` to the canonical torch name.

    Raises:
        ConfigError: not a dtype name, or not one of ``supported`` (the message lists them).
    """
    if not isinstance(value, str):
        raise ConfigError(f"{field}: expected a dtype name, got {value!r}")
    name = value.strip().lower().removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name in DTYPE_BYTES and name not in supported:
        raise ConfigError(
            f"{field}: {name} cannot hold weights and activations; supported: "
            f"{', '.join(supported)} (float8 is for kv_dtype only)"
        )
    if name not in supported:
        raise ConfigError(f"{field}: unknown dtype {value!r}; supported: {', '.join(supported)}")
    return name
