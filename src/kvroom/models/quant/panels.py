"""``QuantPanels``: a quantized weight cut into the native GEMM's column panels.

``QuantizedLinear`` is the layout every source loads into (rows of ``W [out, in]``);
``layers.prepare_weight`` turns it into this form where the native kernels are built, and the
row-major copy is dropped, so a weight is held once. Panel ``p`` holds output rows
``32p .. 32p + 31`` ("columns" ``c`` = 0 .. 31 of the panel), per input position ``k``::

    int4  q [out / 32, in, 16] uint8: 4 little-endian words; word d, nibble n holds column
          8 (n // 2) + 4 (n % 2) + d
    int8  q [out / 32, in, 32] uint8: 8 words; word i, byte j holds column 8 j + i
    scales, mins: [out / 32, in / G, 32], column order, the same dtype as in ``QuantizedLinear``

(the order lets the kernel unpack 8 columns at a time with shifts alone: ``quant_panels.h``).

The kernel (``kernels/quant_panels.h``) dequantizes a block of K rows of one panel into L1 and
multiplies it there, so the weight streams from memory at its quantized size.
"""

from __future__ import annotations

import ctypes

import torch

from kvroom.models.kernels import ops
from kvroom.models.quant.linear import QuantizedLinear, QuantizedWeight

PANEL = ops.PANEL
_Y_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Output dtypes the kernel writes (its code for each)."""


class QuantPanels(QuantizedWeight):
    """A ``QuantizedLinear`` in panels, multiplied by the native quantized GEMM."""

    layout = " panels"

    def __init__(self, w: QuantizedLinear) -> None:
        super().__init__()
        assert w.out_features % PANEL == 0, w.out_features
        self.kind, self.group_size = w.kind, w.group_size
        self.in_features, self.out_features = w.in_features, w.out_features
        self.register_buffer("q", _panel_values(w))
        self.register_buffer("scales", _panel_params(w.scales))
        self.register_buffer("mins", None if w.mins is None else _panel_params(w.mins))
        self.register_buffer("input_scale", w.input_scale)
        self._weight_args = (  # the kernel's weight arguments, looked up once (a decode step
            # makes 121 calls: module attribute lookups were a tenth of its Python time)
            self.q.data_ptr(),
            self.scales.data_ptr(),
            0 if self.mins is None else self.mins.data_ptr(),
            4 if self.kind == "int4" else 8,
            self.group_size,
            self.scales.dtype == torch.float16,
        )

    @staticmethod
    def applies(w: QuantizedLinear) -> bool:
        """Whether ``w``'s shape fits panels (whole panels of rows, whole groups)."""
        return w.out_features % PANEL == 0 and w.in_features % w.group_size == 0

    @property
    def device(self) -> torch.device:
        return self.q.device

    # -- products -------------------------------------------------------------------------------
    def matmul(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lib: ctypes.CDLL | None = None,
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` in ``x``'s dtype, accumulated in fp32; with ``out``, add it
        into ``out`` (rounded to ``out``'s dtype first, as ``out.add_`` of the product would)."""
        xf = self._input(x)
        m = xf.shape[0]
        if out is None and x.dtype not in _Y_DTYPES:  # the kernel writes fp32 or bf16
            return self.matmul(xf, bias, lib=lib).to(x.dtype)
        y = torch.empty(m, self.out_features, dtype=x.dtype) if out is None else out
        assert y.shape == (m, self.out_features) and y.stride(-1) == 1, (y.shape, y.stride())
        bias = None if bias is None else bias.float().contiguous()
        self._call(lib, xf, y, bias, accumulate=out is not None, glu=False)
        return y

    def glu(self, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
        """``silu(x @ gate.T) * (x @ up.T)`` for a fused gate_up weight (gate rows first), in
        one pass that never writes the ``[M, 2I]`` product."""
        xf = self._input(x)
        if x.dtype not in _Y_DTYPES:
            return self.glu(xf, lib=lib).to(x.dtype)
        y = torch.empty(xf.shape[0], self.out_features // 2, dtype=x.dtype)
        self._call(lib, xf, y, None, accumulate=False, glu=True)
        return y

    def fuses_glu(self) -> bool:
        """Whether ``glu`` applies: gate and up of whole panels each."""
        return self.out_features % (2 * PANEL) == 0

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = self.input_scale
        if scale is not None:
            xf = xf * scale
        return xf if xf.stride(-1) == 1 else xf.contiguous()

    def _call(
        self,
        lib: ctypes.CDLL | None,
        x: torch.Tensor,
        y: torch.Tensor,
        bias: torch.Tensor | None,
        accumulate: bool,
        glu: bool,
    ) -> None:
        lib = ops.library() if lib is None else lib
        assert lib is not None, "QuantPanels needs the native kernels"
        y_dtype = _Y_DTYPES[y.dtype]
        rc = lib.kvroom_quant_gemm(
            x.data_ptr(), x.stride(0), *self._weight_args,
            0 if bias is None else bias.data_ptr(), y.data_ptr(), y_dtype, y.stride(0),
            x.shape[0], self.in_features, y.shape[1], accumulate, glu,
        )  # fmt: skip
        assert rc == 0, f"kvroom_quant_gemm returned {rc}"

    # -- rows -----------------------------------------------------------------------------------
    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``W[rows]`` (all rows by default), ``[r, in]``, as ``QuantizedLinear``
        computes it (a multiply then an add)."""
        if rows is None:
            rows = torch.arange(self.out_features)
        p, c = rows // PANEL, rows % PANEL
        r, g = rows.shape[0], self.group_size
        byte = self.q[p, :, _BYTE_OF[self.kind][c]]
        if self.kind == "int8":
            w = byte.view(torch.int8).float()
        else:
            high = _HIGH_NIBBLE[c][:, None]
            w = torch.where(high, byte >> 4, byte & 15).float()
            if self.mins is None:
                w.sub_(8.0)
        groups = w.view(r, -1, g)
        groups.mul_(self.scales[p, :, c].float()[..., None])
        if self.mins is not None:
            groups.add_(self.mins[p, :, c].float()[..., None])
        return w

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (an embedding lookup), dequantized, in ``dtype``."""
        return self.dequantize(ids).to(dtype)


def _int4_columns() -> tuple[torch.Tensor, torch.Tensor]:
    """Columns held by the low and the high nibble of each of a row's 16 bytes."""
    byte = torch.arange(PANEL // 2)
    low = 8 * (byte % 4) + byte // 4  # word d = byte // 4, nibble 2 (byte % 4)
    return low, low + 4


def _int8_columns() -> torch.Tensor:
    """Column held by each of a row's 32 bytes (word i = byte // 4, byte j = byte % 4)."""
    byte = torch.arange(PANEL)
    return 8 * (byte % 4) + byte // 4


def _byte_of_column(columns: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(columns)
    out[columns] = torch.arange(columns.shape[0])
    return out


_LOW, _HIGH = _int4_columns()
_BYTE_OF = {
    "int4": _byte_of_column(torch.cat([_LOW, _HIGH])) % (PANEL // 2),
    "int8": _byte_of_column(_int8_columns()),
}
_HIGH_NIBBLE = torch.zeros(PANEL, dtype=torch.bool).index_fill_(0, _HIGH, True)


def _panel_values(w: QuantizedLinear) -> torch.Tensor:
    v = w.values()  # [out, in]: 0..15 (int4) or int8
    panels = v.view(-1, PANEL, w.in_features).transpose(1, 2)  # [P, in, 32]
    if w.kind == "int8":
        return panels[..., _int8_columns()].contiguous().view(torch.uint8)
    return (panels[..., _LOW] | (panels[..., _HIGH] << 4)).contiguous()


def _panel_params(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()  # [P, groups, 32]
