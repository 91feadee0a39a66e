"""GGUF blocks -> ``QuantizedLinear``, losslessly: values, scales and mins exactly the file's.

Each block type is unpacked the way gguf-py's ``quants`` module reads it, stopping before the
multiply: the integer values in element order, and per group the scale (and min) that
``dequantize`` would apply. K-quant group scales are the float32 products ``d * sc`` gguf-py
computes; their mins are ``-(dmin * m)``, so ``s * q + m`` is gguf-py's ``d * q - dm`` to the
bit. Which types map to which layout: ``kvroom.gguf_file.BLOCK_LAYOUTS``.

Block byte layouts (``QK_K`` = 256)::

    Q4_0  [d f16][qs 16]                    q = nibbles: byte j -> values j (low), j+16 (high)
    Q4_1  [d f16][m f16][qs 16]
    Q5_0  [d f16][qh u32][qs 16]            q = nibble | bit j of qh << 4
    Q5_1  [d f16][m f16][qh u32][qs 16]
    Q8_0  [d f16][qs int8 32]
    Q4_K  [d f16][dmin f16][scales 12][qs 128]          8 groups of 32, 6-bit sc and m
    Q5_K  [d f16][dmin f16][scales 12][qh 32][qs 128]
    Q6_K  [ql 128][qh 64][sc int8 16][d f16]            16 groups of 16, q - 32
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvroom.gguf_file import BLOCK_LAYOUTS
from kvroom.models.quant.linear import QuantizedLinear

Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]
"""(values [n_blocks, block], scales [n_blocks, groups], mins or None)."""


def repack(raw: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedLinear:
    """The ``[rows, cols]`` GGUF tensor of block type ``type_name`` from its raw bytes.

    Args:
        raw: the tensor's bytes, uint8, as stored in the file.
    """
    layout = BLOCK_LAYOUTS[type_name]
    unpack, block_bytes = _UNPACKERS[type_name]
    blocks = raw.reshape(-1, block_bytes)
    values, scales, mins = unpack(blocks)
    values = values.reshape(rows, cols)
    groups = cols // layout.group_size
    scale_dtype = np.float16 if layout.scale_bytes == 2 else np.float32
    scales = scales.astype(scale_dtype).reshape(rows, groups)
    mins = None if mins is None else mins.astype(scale_dtype).reshape(rows, groups)
    if layout.kind == "int4":
        packed = values[:, 0::2] | (values[:, 1::2] << np.uint8(4))
        qweight = torch.from_numpy(np.ascontiguousarray(packed))
    else:
        qweight = torch.from_numpy(np.ascontiguousarray(values.view(np.int8)))
    return QuantizedLinear(
        layout.kind,
        qweight,
        torch.from_numpy(scales),
        None if mins is None else torch.from_numpy(mins),
        layout.group_size,
    )


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[n, chunks * 16]`` bytes -> values: per chunk of ``width`` bytes, the low nibbles
    then the high ones (``width`` = 16 in the 32-value blocks, 32 in the K-quants)."""
    n, width = qs.shape[0], 16 if qs.shape[1] == 16 else 32
    shifted = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, n_values: int) -> np.ndarray:
    """Bit ``j`` of a little-endian bit field -> value ``j``'s fifth bit (Q5_0/Q5_1)."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits[:, :n_values]


def _q4_0(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 2:]), _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6], 32) << np.uint8(4))
    return (q.astype(np.int8) - np.int8(16)).view(np.uint8), _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8], 32) << np.uint8(4))
    return q, _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Unpacked:
    return np.ascontiguousarray(b[:, 2:]), _f16(b[:, :2]), None


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per group of 32, scale ``d * sc`` and min ``-(dmin * m)`` in float32."""
    from gguf.quants import Q4_K

    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> Unpacked:
    scales, mins = _k_scales(b)
    return _nibbles(b[:, 16:]), scales, mins


def _q5_k(b: np.ndarray) -> Unpacked:
    scales, mins = _k_scales(b)
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _nibbles(b[:, 48:]) | ((qh & np.uint8(1)).reshape(n, -1) << np.uint8(4))
    return q, scales, mins


def _q6_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    low = ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & np.uint8(0x0F)).reshape(n, -1, 32)
    high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(0x03)).reshape(n, -1, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape(n, -1).view(np.uint8), _f16(b[:, 208:210]) * sc, None


_UNPACKERS: dict[str, tuple[Callable[[np.ndarray], Unpacked], int]] = {
    "Q4_0": (_q4_0, 18),
    "Q4_1": (_q4_1, 20),
    "Q5_0": (_q5_0, 22),
    "Q5_1": (_q5_1, 24),
    "Q8_0": (_q8_0, 34),
    "Q4_K": (_q4_k, 144),
    "Q5_K": (_q5_k, 176),
    "Q6_K": (_q6_k, 210),
}
"""Block type -> (unpacker, bytes per block)."""
