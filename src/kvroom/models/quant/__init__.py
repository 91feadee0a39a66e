"""Quantized weights: one layout for every source, the weight object the decoder multiplies by.

The layout (``QuantizedLinear``, the one place it is defined). A weight ``W [out, in]`` is cut
along ``in`` into groups of ``G`` values (``G`` divides ``in``); each row keeps its own scale
(and, when affine, its own min) per group::

    kind  qweight                                        value q      W[n, k]
    int4  uint8 [out, in / 2]: byte j of row n holds     0..15        mins:    s * q + m
          q[n, 2j] (low nibble), q[n, 2j + 1] (high)                  no mins: s * (q - 8)
    int8  int8  [out, in]                                -128..127    mins:    s * q + m
                                                                      no mins: s * q

    scales, mins: [out, in / G], float16 or float32     s = scales[n, k // G], m = mins[n, k // G]

computed in float32, a multiply then an add (no fused multiply-add), which is how gguf-py's
``dequantize`` computes every supported GGUF type: a repacked GGUF tensor dequantizes to the
same bits. ``input_scale`` (float32 ``[in]``, optional) multiplies the input's columns before
the product: a folded RMSNorm weight (a dense weight absorbs it; a quantized one cannot without
re-rounding).

Sources: ``gguf_repack`` (GGUF blocks, lossless) and ``quantize`` (full-precision weights).
"""

from kvroom.models.quant.linear import QuantizedLinear

__all__ = ["QuantizedLinear"]
