"""Full-precision weight -> ``QuantizedLinear`` with one of ``kvroom.quant_schemes.SCHEMES``.

    int8:            s = max|w| / 127 per row (float32),        q = round(w / s) in [-127, 127]
    int4, int4-g128: per group of G, s = (max - min) / 15,  m = min  (both rounded to float16
                     first, then used to round: q = round((w - m) / s) in [0, 15])

so ``s * q + m`` is the reconstruction the stored scales give (as GGUF's Q4_1 does).
"""

from __future__ import annotations

import torch

from kvroom.models.quant.linear import QuantizedLinear
from kvroom.quant_schemes import SCHEMES


def quantize(w: torch.Tensor, scheme_name: str) -> QuantizedLinear:
    """``w`` ``[out, in]`` (any float dtype) in scheme ``scheme_name``'s layout."""
    scheme = SCHEMES[scheme_name]
    w = w.float()
    if scheme.kind == "int8":
        return _int8_per_row(w)
    return _int4_groups(w, scheme.group_of(w.shape[1]))


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """Divisor for rounding: 1 where a group is constant (its values are all q = 0)."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _int8_per_row(w: torch.Tensor) -> QuantizedLinear:
    scales = w.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(w / _safe(scales)).clamp_(-127, 127).to(torch.int8)
    return QuantizedLinear("int8", q, scales, None, w.shape[1])


def _int4_groups(w: torch.Tensor, group: int) -> QuantizedLinear:
    rows, cols = w.shape
    groups = w.view(rows, cols // group, group)
    low = groups.amin(dim=2)
    scales = ((groups.amax(dim=2) - low) / 15.0).half()
    mins = low.half()
    q = (groups - mins.float()[..., None]) / _safe(scales.float())[..., None]
    q = torch.round(q).clamp_(0, 15).to(torch.uint8).view(rows, cols)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return QuantizedLinear("int4", packed, scales, mins, group)
