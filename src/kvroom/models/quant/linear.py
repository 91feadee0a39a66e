"""``QuantizedLinear``: a weight in the layout of ``models/quant`` and its product with ``x``.

The product dequantizes a tile of rows at a time into float32 and multiplies it with one GEMM,
so no full float copy of a large weight ever exists (a tile is at most 2 MiB). PyTorch's
own weight-only kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) were
measured against this on an AVX2 CPU and lost at every row count, 1.1x to 90x
(``benchmarks/quant_gemm.py``, figures in ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import torch
from torch import nn

TILE_VALUES = 1 << 19
"""Weight values dequantized per GEMM (2 MiB of float32). SmolLM2's gate_up (3072x576, one
thread, CPU time): 2^15 values per tile took 11.6 ms at 1 row, 2^17 4.4 ms, 2^19 2.7 ms, the
whole weight 2.1 ms (per-tile op overhead dominates small tiles); at 32 rows 2^19 was the
fastest (5.1 ms; dense fp32 4.8 ms); at 512 rows all were within 10% of dense fp32."""


class QuantizedWeight(nn.Module):
    """What every form of a quantized weight reports: its bytes and its description."""

    kind: str
    group_size: int
    in_features: int
    out_features: int
    layout = ""
    """How the values are arranged, after the kind in the description ("" for rows)."""

    @property
    def resident_bytes(self) -> int:
        """Bytes this weight holds (values, scales, mins, input scale)."""
        return sum(b.nbytes for b in self.buffers())

    def extra_repr(self) -> str:
        affine = "affine" if self.mins is not None else "symmetric"
        return (
            f"{self.kind}{self.layout}, out={self.out_features}, in={self.in_features}, "
            f"group={self.group_size}, {affine}, scales={self.scales.dtype}"
        )


class QuantizedLinear(QuantizedWeight):
    """A ``[out, in]`` weight in kvroom's quantized layout (see ``kvroom.models.quant``)."""

    def __init__(
        self,
        kind: str,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        group_size: int,
        input_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        rows, width = qweight.shape
        in_features = width * 2 if kind == "int4" else width
        expected = (
            torch.uint8 if kind == "int4" else torch.int8,
            (rows, in_features // group_size),
        )
        assert (qweight.dtype, tuple(scales.shape)) == expected, (kind, qweight.dtype, scales.shape)
        assert mins is None or mins.shape == scales.shape
        self.kind = kind
        self.group_size = group_size
        self.in_features = in_features
        self.out_features = rows
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("input_scale", input_scale)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    # -- values ---------------------------------------------------------------------------------
    def values(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """Integer values ``q`` of ``rows`` as stored (uint8 0..15 for int4, int8 for int8),
        ``[r, in]``."""
        q = self.qweight[rows] if isinstance(rows, slice) else self.qweight.index_select(0, rows)
        if self.kind == "int8":
            return q
        return torch.stack((q & 15, q >> 4), dim=-1).view(q.shape[0], self.in_features)

    def dequantize(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """float32 ``W[rows]``: ``s * q (+ m)`` per group, a multiply then an add, exactly as
        gguf-py's ``dequantize`` computes the GGUF types this layout holds.

        The values are written straight into the float32 result and scaled in place (two
        vectorized passes; ``addcmul`` over the integer values measured 1.6x slower)."""
        q = self.qweight[rows] if isinstance(rows, slice) else self.qweight.index_select(0, rows)
        r, g = q.shape[0], self.group_size
        w = torch.empty(r, self.in_features, dtype=torch.float32, device=q.device)
        if self.kind == "int8":
            w.copy_(q)
        else:
            pairs = w.view(r, -1, 2)
            torch.bitwise_and(q, 15, out=pairs[..., 0])
            torch.bitwise_right_shift(q, 4, out=pairs[..., 1])
        s, m = self._group_params(rows)
        groups = w.view(r, -1, g)
        if self.kind == "int4" and m is None:
            groups.sub_(8.0)
        groups.mul_(s[..., None])
        if m is not None:
            groups.add_(m[..., None])
        return w

    def _group_params(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        def take(t: torch.Tensor) -> torch.Tensor:
            return (t[rows] if isinstance(rows, slice) else t.index_select(0, rows)).float()

        return take(self.scales), None if self.mins is None else take(self.mins)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (an embedding lookup), dequantized, in ``dtype``."""
        return self.dequantize(ids).to(dtype)

    # -- product --------------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for ``x [T, in]``, accumulated in float32, in ``x``'s dtype."""
        xf = x.float()
        if self.input_scale is not None:
            xf = xf * self.input_scale
        out = xf.new_empty(xf.shape[0], self.out_features)
        step = max(16, TILE_VALUES // self.in_features)
        for start in range(0, self.out_features, step):
            rows = slice(start, min(start + step, self.out_features))
            torch.mm(xf, self.dequantize(rows).t(), out=out[:, rows])
        if bias is not None:
            out += bias
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    # -- load-time transforms -------------------------------------------------------------------
    def take_rows(self, index: torch.Tensor) -> QuantizedLinear:
        """The same weight with its rows reordered (a row permutation is lossless)."""
        mins = None if self.mins is None else self.mins.index_select(0, index)
        return QuantizedLinear(
            self.kind,
            self.qweight.index_select(0, index),
            self.scales.index_select(0, index),
            mins,
            self.group_size,
            self.input_scale,
        )

    def with_input_scale(self, scale: torch.Tensor) -> QuantizedLinear:
        """This weight with ``x`` scaled per column first (``W @ diag(scale)``, exactly)."""
        return QuantizedLinear(
            self.kind, self.qweight, self.scales, self.mins, self.group_size, scale.float()
        )
