from __future__ import annotations

import re

import pytest

from kvroom.errors import ConfigError
from kvroom.units import cdiv, format_bytes, mib, normalize_dtype, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("1.5 GB", 1_500_000_000),  # decimal unit: 1.5 x 10**9
        ("512M", 512 * 2**20),  # bare letter is binary
        ("512MB", 512 * 10**6),
        ("512 mib", 512 * 2**20),  # units are case-insensitive
        ("  4 KiB  ", 4 * 2**10),
        ("1.5K", 1536),  # 1.5 x 1024
        ("1T", 2**40),
        ("2048", 2048),
        ("3b", 3),
        ("0", 0),
        ("2.01GB", 2_010_000_000),  # exact; float arithmetic gave 2_009_999_999
        ("1.005 KB", 1005),  # exact; float arithmetic gave 1004
    ],
)
def test_parse_bytes_strings(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("value", [0, 1, 2_147_483_648])
def test_parse_bytes_ints_pass_through(value: int) -> None:
    assert parse_bytes(value) == value


@pytest.mark.parametrize("text", ["", "lots", "2 GiBs", "1e9", "2 PB", "-1GiB", "1,5GB", "GiB"])
def test_parse_bytes_bad_strings(text: str) -> None:
    expected = f"value: cannot parse {text!r} as a byte size (e.g. 2147483648, '2GiB', '512MB')"
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        parse_bytes(text)


def test_parse_bytes_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^kvcache_reserve_memory: cannot parse 'x' "):
        parse_bytes("x", "kvcache_reserve_memory")


def test_parse_bytes_negative_int() -> None:
    with pytest.raises(ConfigError, match=r"^device_memory: must be >= 0 bytes, got -1$"):
        parse_bytes(-1, "device_memory")


@pytest.mark.parametrize("value", [True, False, 1.5, None, [1]])
def test_parse_bytes_rejects_bools_and_non_int_str(value: object) -> None:
    expected = f"value: expected bytes as an int or a string like '2GiB', got {value!r}"
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        parse_bytes(value)  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        parse_bytes("nope")


@pytest.mark.parametrize(("a", "b", "expected"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2)])
def test_cdiv(a: int, b: int, expected: int) -> None:
    assert cdiv(a, b) == expected


@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536 * 2**20, "1.50 GiB"),
        (3 * 2**40, "3.00 TiB"),
        (2**50, "1024.00 TiB"),  # TiB is the largest unit
        (-2048, "-2.00 KiB"),
        (512.0, "512 B"),
    ],
)
def test_format_bytes(num_bytes: int | float, expected: str) -> None:
    assert format_bytes(num_bytes) == expected


def test_mib_one_decimal() -> None:
    assert mib(3 * 2**20) == "3.0 MiB"
    assert mib(737_280) == "0.7 MiB"  # 737280 / 1048576 = 0.703...


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", "float32"),
        ("fp32", "float32"),
        ("float", "float32"),
        (" FP32 ", "float32"),
        ("bf16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("BFloat16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("torch.float16", "float16"),
        ("fp8", "float8_e4m3fn"),
        ("fp8_e4m3", "float8_e4m3fn"),
        ("fp8_e5m2", "float8_e5m2"),
        ("float8_e5m2", "float8_e5m2"),
    ],
)
def test_normalize_dtype(name: str, expected: str) -> None:
    assert normalize_dtype(name) == expected


def test_normalize_dtype_unknown_lists_supported() -> None:
    expected = (
        "dtype: unknown dtype 'int8'; supported: float32, float16, bfloat16, float8_e4m3fn, "
        "float8_e5m2"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        normalize_dtype("int8")


def test_normalize_dtype_not_a_string() -> None:
    with pytest.raises(ConfigError, match=r"^kv_dtype: expected a dtype name, got 4$"):
        normalize_dtype(4, "kv_dtype")  # type: ignore[arg-type]
