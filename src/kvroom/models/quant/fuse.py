"""Fuse quantized weights along their output rows (``qkv`` = [q; k; v], ``gate_up``), losslessly.

Parts of one fused projection may come in different layouts: a "Q4_K_M" GGUF keeps ``q``/``k``
in Q4_K (int4, group 32, affine, float32 scales) and ``v`` in Q6_K (int8, group 16, symmetric).
They are brought to one layout first, each step exact:

* int4 -> int8: the values fit (symmetric int4's ``q - 8`` becomes the int8 value);
* symmetric -> affine: mins of zero (``s * q + 0`` is ``s * q``);
* group G -> a divisor g of G: every scale (and min) repeated ``G / g`` times;
* float16 scales -> float32 (a widening);
* symmetric int4 -> affine int4: ``s * (q - 8)`` is ``s * q + (-8 s)``, exact (``s`` is an
  fp16 times a small integer, so every product fits float32's 24 bits).
"""

from __future__ import annotations

import math

import torch

from kvroom.models.quant.linear import QuantizedLinear


def concat_rows(parts: list[QuantizedLinear]) -> QuantizedLinear:
    """One weight whose rows are ``parts``' rows in order, in their common layout."""
    kind = "int8" if any(p.kind == "int8" for p in parts) else "int4"
    affine = any(p.mins is not None for p in parts)
    group = math.gcd(*(p.group_size for p in parts))
    wide = any(p.scales.dtype == torch.float32 for p in parts)
    scale_dtype = torch.float32 if wide else torch.float16
    if affine and kind == "int4" and any(p.mins is None for p in parts):
        scale_dtype = torch.float32  # their mins -8 s: exact in float32, may overflow float16
    same = [_convert(p, kind, affine, group, scale_dtype) for p in parts]
    mins = torch.cat([p.mins for p in same if p.mins is not None]) if affine else None
    return QuantizedLinear(
        kind,
        torch.cat([p.qweight for p in same]),
        torch.cat([p.scales for p in same]),
        mins,
        group,
    )


def _convert(
    p: QuantizedLinear, kind: str, affine: bool, group: int, scale_dtype: torch.dtype
) -> QuantizedLinear:
    qweight, mins = p.qweight, p.mins
    if p.kind != kind:  # int4 -> int8
        values = p.values()
        qweight = values.to(torch.int8) if mins is not None else values.view(torch.int8) - 8
    scales = p.scales.to(scale_dtype)
    mins = None if mins is None else mins.to(scale_dtype)
    if affine and mins is None:
        mins = torch.zeros_like(scales)
    repeat = p.group_size // group
    if repeat > 1:
        scales = scales.repeat_interleave(repeat, dim=1)
        mins = None if mins is None else mins.repeat_interleave(repeat, dim=1)
    if kind == "int4" and p.mins is None and affine:  # symmetric int4 as affine: m = -8 s
        mins = scales * -8.0
    return QuantizedLinear(kind, qweight, scales, mins, group)
