"""int8 and int4 KV rows: quantize on write, dequantize on read, and the Hadamard rotation.

A quantized pool is ``uint8``; each (token, entry, kv head) row of ``D`` values is stored as
``R`` bytes, values then their parameters, so every byte a block owns (its scales too) moves
with it::

    int8  [ q_0 .. q_{D-1} : int8, -127..127              | scale : float32 ]   R = D + 4
          x ~= q * scale,  scale = max|x| / 127 (symmetric)

    int4  [ q_0 | q_1 << 4, ...  (D/2), q in 0..15         | scale : float16 |
                                                            min   : float16 ]   R = D / 2 + 4
          x ~= q * scale + min (affine); low nibble = even element

Round to nearest level: the error of each value is at most ``scale / 2``, except where a
row's extreme values are clipped. An int4 row's 16 levels span a range fitted to the row
(``fit_affine``: a little inside its ``[min, max]``, then refitted by least squares to the
levels it picks); its scale and min are float16: the bytes of one float32 scale, for 16
levels over the row's own range instead of a symmetric row's 15 about zero. On the default
model's K/V (rotated) that leaves about 30% less squared error than a symmetric row with a
float32 scale (K: 0.0066 against 0.0091 of the rows' squared norm; ``benchmarks/RESULTS.md``,
"KV at 8 and 4 bits").

**Rotation** (``KVCodec.rotation``). A normalised Walsh-Hadamard matrix ``H`` (``H = H^T =
H^-1``) over blocks of ``n`` dims (``n`` = the largest power of two dividing ``D``, at least
64) spreads a channel's outliers over the row, so one scale fits it better. ``q.k`` is
unchanged by rotating both, so queries and keys are rotated after RoPE; values are rotated on
write and the attention output rotated back (``softmax(s) (V H) H = softmax(s) V``).

**Key shift** (int4, ``KVCodec.shifts_keys``). Keys share a large common part (channels
RoPE barely turns keep their sign across positions): on the default model the mean key's
largest channel is 4 to 8 times the keys' mean magnitude (about 2 times once rotated). Each
layer therefore subtracts a fixed vector ``mu`` per kv head from every key before storing it.
Every query sees all its keys moved by the same ``mu``, so its scores move by the one number
``q.mu`` and the softmax is unchanged (``softmax(s - c) = softmax(s)``; not with a soft-cap,
whose layers keep no shift); only the rounding is better: the 16 levels cover what varies.
``mu`` is the mean key of a short calibration forward of seeded random tokens at start-up
(``engine/key_shift.py``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cache

import torch

from kvroom.models.kernels import ops as native
from kvroom.threads import one_thread

SCALE_BYTES = 4
"""Bytes after a row's values: int8 its float32 scale, int4 its float16 scale and min."""
INT8_QMAX = 127
"""Largest magnitude of an int8 value."""
INT4_LEVELS = 15
"""Steps between an int4 row's lowest and highest level (16 levels, 0..15)."""


@dataclass(frozen=True)
class KVCodec:
    """How a quantized pool's rows are encoded; None where the pool holds floats."""

    bits: int
    """8 (int8) or 4 (int4, two values per byte)."""
    rotate: bool
    """Rotate Q, K and V by ``hadamard(head_dim)`` (where the head dim allows it)."""

    def __post_init__(self) -> None:
        assert self.bits in (8, 4), f"KVCodec.bits: {self.bits}"

    @property
    def shifts_keys(self) -> bool:
        """Keys are stored less a per-layer mean (int4; see "Key shift" above)."""
        return self.bits == 4

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one stored row: ``head_dim * bits / 8 + 4`` (``SCALE_BYTES``)."""
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
    itself where ``h`` is None. ``h`` is ``hadamard(D)``: on the CPU the native kernel applies
    it as butterflies (``kernels/kv_write.h``, the fused decode step's own rotation)."""
    if h is None:
        return x
    block = rotation_block(x.shape[-1])
    native_out = native.hadamard_rows(x, block) if block is not None else None
    if native_out is not None:
        return native_out
    return (x.float() @ h).to(x.dtype)


AFFINE_START = 0.95
"""int4: the fit starts from the row's ``[min, max]`` narrowed to this fraction about its centre
(clipping a row's extremes buys finer steps for the rest)."""
AFFINE_REFITS = 2
"""Least-squares refits of (scale, min) after the start. On the default model's K (rotated),
relative squared error: the plain ``[min, max]`` grid 0.00735, this start 0.00701, refitted
once 0.00672, twice 0.00656; four starts (1.0, 0.9, 0.8, 0.7) refitted twice each, the best
kept, 0.00646 at four times the work."""


def quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows ``[..., D]`` -> ``uint8`` ``[..., R]`` (the layout in the module docstring): the
    native kernel on the CPU (``kernels/kv_write.h``, which the fused decode step shares),
    else ``quantize_torch``."""
    rows = native.kv_quantize(x, bits)
    if rows is not None:
        return rows
    with _serial(x):
        return quantize_torch(x, bits)


def quantize_torch(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``quantize`` in torch ops (any device). int8 gives the native kernel's bytes; int4 may
    differ in a row's last bits of scale or min, where float32 sums round apart."""
    xf = x.float()
    if bits == 8:
        scale = xf.abs().amax(-1, keepdim=True) / INT8_QMAX
        data = _levels(xf, scale, 0.0, -INT8_QMAX, INT8_QMAX).to(torch.int8).view(torch.uint8)
        return torch.cat([data, scale.contiguous().view(torch.uint8)], dim=-1)
    scale, low = fit_affine(xf)
    q = _levels(xf, scale.float(), low.float(), 0, INT4_LEVELS).to(torch.uint8)
    data = q[..., 0::2] | (q[..., 1::2] << 4)
    params = torch.cat([scale, low], dim=-1).contiguous().view(torch.uint8)
    return torch.cat([data, params], dim=-1)


def _levels(
    xf: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | float, lo: int, hi: int
) -> torch.Tensor:
    """``round((x - low) / scale)`` clamped to ``[lo, hi]`` (a zero scale: level ``lo``)."""
    step = scale.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round((xf - low) / step).clamp_(lo, hi)


_HALF_MAX = torch.finfo(torch.float16).max


def _half(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float16, finite (values beyond float16's range are clipped to it)."""
    return t.clamp(-_HALF_MAX, _HALF_MAX).to(torch.float16)


def fit_affine(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``xf`` ``[..., D]`` (float32), a float16 ``(scale, min)`` ``[..., 1]`` each
    that makes ``|q * scale + min - x|^2`` small.

    The start spans ``AFFINE_START`` of the row's range about its centre; ``AFFINE_REFITS``
    times, the levels ``q`` it picks are held and ``(scale, min)`` refitted to them by least
    squares (``scale = cov(q, x) / var(q)``), the levels then picked again by the caller.
    """
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    half = (hi - lo) / 2 * AFFINE_START
    scale, low = _half(2 * half / INT4_LEVELS), _half((hi + lo) / 2 - half)
    for _ in range(AFFINE_REFITS):
        q = _levels(xf, scale.float(), low.float(), 0, INT4_LEVELS)
        scale, low = _refit(xf, q, scale)
    return scale, low


def _refit(
    xf: torch.Tensor, q: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares ``(scale, min)`` of ``x ~= q * scale + min`` for fixed levels ``q``, as
    float16; a row whose levels are all equal keeps ``scale`` and takes its mean as min."""
    qm, xm = q.mean(-1, keepdim=True), xf.mean(-1, keepdim=True)
    dq = q - qm
    var = dq.square().sum(-1, keepdim=True)
    fitted = (dq * (xf - xm)).sum(-1, keepdim=True) / var.clamp_min(1e-12)
    new_scale = torch.where(var > 0, fitted, scale.float())
    return _half(new_scale), _half(xm - new_scale * qm)


def dequantize(rows: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """``uint8`` rows ``[..., R]`` -> ``[..., D]`` in ``dtype``."""
    data, params = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous()
    if bits == 8:
        return (data.contiguous().view(torch.int8).float() * params.view(torch.float32)).to(dtype)
    scale, low = params.view(torch.float16).float().split(1, dim=-1)
    q = torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(-2).float()
    return (q * scale + low).to(dtype)


def error_bound(x: torch.Tensor, rows: torch.Tensor, bits: int) -> torch.Tensor:
    """The largest error per value of ``rows = quantize(x, bits)``: half a step, or what a
    clipped value loses beyond the nearest end level (``[..., D]``)."""
    params = rows[..., -SCALE_BYTES:].contiguous()
    xf = x.float()
    if bits == 8:
        scale = params.view(torch.float32)
        return torch.maximum(scale / 2, xf.abs() - INT8_QMAX * scale)
    scale, low = params.view(torch.float16).float().split(1, dim=-1)
    beyond = torch.maximum(low - xf, xf - (low + INT4_LEVELS * scale))
    return torch.maximum(scale / 2, beyond)


def shift_keys(kv: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """``kv`` ``[T, 2, kv_heads, D]`` with ``shift`` ``[kv_heads, D]`` subtracted from its keys
    (a new tensor); ``kv`` itself where ``shift`` is None."""
    if shift is None:
        return kv
    return torch.cat([kv[:, :1] - shift.to(kv.dtype), kv[:, 1:]], dim=1)


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


def _serial(t: torch.Tensor) -> AbstractContextManager[None]:
    """CPU: one thread for the torch write path's few dozen small ops. A step's rows are small
    (a 256-token chunk of the default model: 256 x 2 x 3 x 64 values), and on 2 cores beside
    other jobs torch's two-thread fork/join per op made quantizing them take 66 ms (int8) and
    273 ms (int4) instead of 0.26 and 1.6 ms on one thread."""
    return one_thread() if t.device.type == "cpu" else nullcontext()
