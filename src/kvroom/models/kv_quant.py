"""int8 and int4 KV rows: quantize on write, dequantize on read, and the Hadamard rotation.

A quantized pool is ``uint8``; each (token, entry, kv head) row of ``D`` values is stored as
``R`` bytes, values then scale, so every byte a block owns (its scales too) moves with it::

    int8  [ q_0 .. q_{D-1} : int8, -127..127        | scale : float32 ]   R = D + 4
    int4  [ (q_0 + 8) | (q_1 + 8) << 4, ...  (D/2)  | scale : float32 ]   R = D / 2 + 4
          q in -7..7, low nibble = even element

    x ~= q * scale,  scale = max|x| / 127 (int8) or / 7 (int4), per row (token, kv head)

Symmetric, round to nearest: the error of each value is at most ``scale / 2``, except where an
int4 row's scale clips its largest values (``CLIP_RATIOS``: the scale of least squared error).

**Rotation** (``KVCodec.rotation``). A normalised Walsh-Hadamard matrix ``H`` (``H = H^T =
H^-1``) over blocks of ``n`` dims (``n`` = the largest power of two dividing ``D``, at least
64) spreads a channel's outliers over the row, so one scale fits it better. ``q.k`` is
unchanged by rotating both, so queries and keys are rotated after RoPE; values are rotated on
write and the attention output rotated back (``softmax(s) (V H) H = softmax(s) V``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

SCALE_BYTES = 4
QMAX = {8: 127, 4: 7}
"""Largest magnitude of a quantized value, per width in bits."""


@dataclass(frozen=True)
class KVCodec:
    """How a quantized pool's rows are encoded; None where the pool holds floats."""

    bits: int
    """8 (int8) or 4 (int4, two values per byte)."""
    rotate: bool
    """Rotate Q, K and V by ``hadamard(head_dim)`` (where the head dim allows it)."""

    def __post_init__(self) -> None:
        assert self.bits in QMAX, f"KVCodec.bits: {self.bits}"

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one stored row: ``head_dim * bits / 8 + 4``."""
        return head_dim * self.bits // 8 + SCALE_BYTES

    def head_dim(self, row_bytes: int) -> int:
        """Inverse of ``row_bytes``."""
        return (row_bytes - SCALE_BYTES) * 8 // self.bits

    def rotation(self, head_dim: int, device: torch.device) -> torch.Tensor | None:
        """The ``[D, D]`` float32 rotation of this head dim, or None (off, or no block of 64
        or more dims divides it)."""
        if not self.rotate or rotation_block(head_dim) is None:
            return None
        return hadamard(head_dim, str(device))


def codec_for(kv_dtype: str, kv_rotation: str) -> KVCodec | None:
    """The codec of a ``kv_dtype``, None for float KV."""
    bits = {"int8": 8, "int4": 4}.get(kv_dtype)
    return None if bits is None else KVCodec(bits, kv_rotation == "hadamard")


def pool_dtype(kv_dtype: str) -> torch.dtype:
    """The pool tensors' torch dtype: ``uint8`` for int8/int4 rows, else ``kv_dtype``."""
    return torch.uint8 if kv_dtype in ("int8", "int4") else getattr(torch, kv_dtype)


def rotation_block(head_dim: int) -> int | None:
    """The largest power of two dividing ``head_dim`` if it is >= 64, else None."""
    block = head_dim & -head_dim
    return block if block >= 64 else None


@cache
def hadamard(head_dim: int, device: str = "cpu") -> torch.Tensor:
    """Block-diagonal normalised Walsh-Hadamard matrix ``[D, D]`` (float32), blocks of
    ``rotation_block(D)``: orthogonal and symmetric, so it is its own inverse."""
    n = rotation_block(head_dim)
    assert n is not None, f"no Hadamard block divides head_dim {head_dim}"
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    h = h / n**0.5
    return torch.block_diag(*[h] * (head_dim // n)).to(device)


def rotate(x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """``x @ h`` over the last dim in float32, back in ``x``'s dtype (a new tensor); ``x``
    itself where ``h`` is None."""
    if h is None:
        return x
    return (x.float() @ h).to(x.dtype)


CLIP_RATIOS = {8: (1.0,), 4: (1.0, 0.9, 0.8, 0.7)}
"""Scales tried per row, as fractions of ``max|x| / qmax``: int4 keeps the one of least squared
error (clipping a row's largest values buys finer steps for the rest)."""


def quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows ``[..., D]`` -> ``uint8`` ``[..., R]`` (the layout in the module docstring)."""
    qmax = QMAX[bits]
    xf = x.float()
    scale = _best_scale(xf, bits)
    q = _levels(xf, scale, qmax)
    if bits == 8:
        data = q.to(torch.int8).view(torch.uint8)
    else:
        nib = (q + 8).to(torch.uint8)
        data = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return torch.cat([data, scale.contiguous().view(torch.uint8)], dim=-1)


def _levels(xf: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    return torch.round(xf / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-qmax, qmax)


def _best_scale(xf: torch.Tensor, bits: int) -> torch.Tensor:
    """Per row, of ``CLIP_RATIOS[bits] x max|x| / qmax``, the scale of least squared error."""
    qmax = QMAX[bits]
    full = xf.abs().amax(-1, keepdim=True) / qmax
    ratios = CLIP_RATIOS[bits]
    if len(ratios) == 1:
        return full
    best, best_err = full, None
    for ratio in ratios:
        scale = full * ratio
        err = (_levels(xf, scale, qmax) * scale - xf).square_().sum(-1, keepdim=True)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best, best_err = torch.where(better, scale, best), torch.minimum(err, best_err)
    return best


def dequantize(rows: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """``uint8`` rows ``[..., R]`` -> ``[..., D]`` in ``dtype``."""
    data, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    scale = scale.contiguous().view(torch.float32)
    if bits == 8:
        q = data.contiguous().view(torch.int8).float()
    else:
        lo = (data & 0x0F).float() - 8
        hi = (data >> 4).float() - 8
        q = torch.stack([lo, hi], dim=-1).flatten(-2)
    return (q * scale).to(dtype)


def error_bound(x: torch.Tensor, rows: torch.Tensor, bits: int) -> torch.Tensor:
    """The largest error per value of ``rows = quantize(x, bits)``: half a step, or what a
    clipped value loses beyond the largest level (``[..., D]``)."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return torch.maximum(scale / 2, x.float().abs() - QMAX[bits] * scale)


def encode(kv: torch.Tensor, pool_dtype: torch.dtype, codec: KVCodec | None) -> torch.Tensor:
    """Rows ``[..., D]`` as the pool stores them: quantized, or cast to ``pool_dtype``."""
    return kv.to(pool_dtype) if codec is None else quantize(kv, codec.bits)


def decode(rows: torch.Tensor, dtype: torch.dtype, codec: KVCodec | None) -> torch.Tensor:
    """Stored rows ``[..., D or R]`` as values in ``dtype`` (inverse of ``encode``)."""
    return rows.to(dtype) if codec is None else dequantize(rows, codec.bits, dtype)


def as_stored(kv: torch.Tensor, pool_dtype: torch.dtype, codec: KVCodec | None) -> torch.Tensor:
    """``kv`` rounded as the pool would round it, in ``kv``'s dtype."""
    if codec is not None:
        return dequantize(quantize(kv, codec.bits), codec.bits, kv.dtype)
    return kv if pool_dtype == kv.dtype else kv.to(pool_dtype).to(kv.dtype)
