"""Building blocks shared by every decoder: RMSNorm, rotary embedding, gated MLP.

They are plain functions over tensors, not ``nn.Module`` s: a decode step of a 135M model is
bound by per-op Python overhead as much as by FLOPs, so a layer calls ``rms_norm(x, w, eps)``
directly instead of going through ``Module.__call__`` for every norm and projection.

Rotary layout. HF rotates the two halves of a head (``rotate_half``): dimension ``i`` pairs with
``i + D/2``. At load time (``weights.py``) the q/k projection rows of every head are permuted so
that the pair lands side by side::

    HF head dims:      [x0 x1 ... x(D/2-1) | y0 y1 ... y(D/2-1)]     pair i = (x_i, y_i)
    kvroom head dims:  [x0 y0 x1 y1 ... x(D/2-1) y(D/2-1)]          pair i = dims (2i, 2i+1)

The rotation of pair i by angle ``p * inv_freq[i]`` is then one complex multiply over a
``view_as_complex`` of q and k together, done in place: one kernel instead of HF's ~8.
Attention scores are dot products over head dims, so permuting q and k the same way leaves
them unchanged; the K stored in the cache is permuted too, consistently.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvroom.errors import ModelSourceError
from kvroom.models.kernels import cpu_kernels
from kvroom.models.kernels import ops as native
from kvroom.models.quant import QuantizedLinear
from kvroom.models.quant.panels import QuantPanels

Quantized = QuantizedLinear | QuantPanels
Weight = torch.Tensor | Quantized
"""A projection as the decoder holds it: a (packed) tensor, or a quantized weight."""

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
"""Rope variants whose frequencies do not depend on the sequence length at run time."""


def rms_norm(
    x: torch.Tensor, eps: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) [* weight]`` over the last dim, statistics in float32.

    Four kernels (``vector_norm``, ``addcmul``, ``rsqrt_``, ``mul``) instead of the seven
    that ``F.rms_norm`` dispatches on CPU: at decode a norm is launch-bound, and there are two
    per layer. Input norms carry no weight here: ``weights.py`` folds them into the columns of
    the projection that follows (``W @ (w * x) == (W * w) @ x``).

    Args:
        x: ``[..., n]`` activations.
        eps: 0-dim float32 tensor (a tensor so ``addcmul`` adds it without another kernel).
        weight: ``[n]`` scale, or None when it was folded away.
    """
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    scale = torch.addcmul(eps, norm, norm, value=1.0 / x.shape[-1]).rsqrt_()
    y = torch.mul(x, scale)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if weight is None else y.mul_(weight)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, eps: torch.Tensor, eps_value: float
) -> torch.Tensor:
    """``h += delta`` (in place, when given), then ``rms_norm(h, eps)``: one native kernel
    call on CPU (``kernels/cpu_kernels.cpp``) instead of five torch ops, else torch."""
    out = native.add_rms_norm(h, delta, eps_value)
    if out is not None:
        return out
    if delta is not None:
        h.add_(delta)
    return rms_norm(h, eps)


def prepare_weight(w: Weight) -> Weight:
    """A ``[in, out]`` projection in the form ``matmul`` reads fastest.

    A quantized weight (``models/quant``) becomes the native quantized GEMM's panels
    (``quant.panels.QuantPanels``) where the kernels are built and its shape fits, else it is
    returned as is (its torch path dequantizes a tile of rows at a time).

    On CPU, fp32 weights whose width is a multiple of 32 become the native panel GEMM's column
    panels (``kernels.ops.pack_panels``, a 3-D tensor) where this CPU runs it (AVX-512, AVX2):
    at decode sizes it streams the weights faster than oneDNN (SmolLM2's 30 layers and head,
    weights cold, AVX-512: 0.72x oneDNN's time at one row, 0.87x at 32, 0.89x at 128; AVX2, one
    thread: 0.77x, 0.80x, 1.0x; ``benchmarks/panel_gemm.py``). Other weights on CPU where
    oneDNN runs: oneDNN's prepacked layout, which streams far better than MKL's plain GEMM over
    a row-major matrix (measured on an AMD 2-core CPU for SmolLM2's 30 layers: 39 ms instead of
    87 ms per step at 32 rows).
    bf16 weights become bf16 panels on AVX-512 and AVX2 CPUs without AMX (widened to fp32 in
    registers as they stream; a SmolLM2 decode step at 32 rows took 0.6x its time with oneDNN's
    bf16 GEMM on AVX-512, a single stream 0.55x the time of weights widened at load on AVX2);
    else they are packed as bf16 where the CPU runs oneDNN's bf16 GEMM, else widened to fp32 and
    packed (``kernels.cpu_kernels``; ``matmul`` then computes in fp32 and rounds the output to
    bf16). A bf16 shape that is not whole panels, on a CPU with bf16 panels but not oneDNN's
    bf16 GEMM, stays a plain matrix.

    Elsewhere (CUDA, other dtypes, no oneDNN): ``w`` as a row-major ``[in, out]`` matrix.
    """
    if isinstance(w, QuantizedLinear):
        return QuantPanels(w) if _runs_quant_panels(w) else w
    if isinstance(w, QuantPanels):
        return w
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return w.contiguous()
    if (panels := native.pack_panels(w)) is not None:
        return panels
    if w.dtype == torch.bfloat16 and widens_bf16_weights():
        w = w.float()
    elif w.dtype == torch.bfloat16 and not cpu_kernels().bf16_packed:
        return w.contiguous()  # bf16 panels elsewhere, but not this shape: torch's own GEMM
    elif w.dtype not in (torch.float32, torch.bfloat16):
        return w.contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None)


def _runs_quant_panels(w: QuantizedLinear) -> bool:
    return w.qweight.device.type == "cpu" and cpu_kernels().quant_gemm and QuantPanels.applies(w)


def is_packed(w: Weight) -> bool:
    """``w`` is a projection in a kernel's own layout (oneDNN's, the native GEMM's panels, or
    quantized), not a plain ``[in, out]`` matrix: it has no transpose to serve as an embedding."""
    return isinstance(w, Quantized) or w.is_mkldnn or w.dim() == 3


def _is_panels(w: Weight) -> bool:
    return isinstance(w, torch.Tensor) and w.dim() == 3


def embedding(input_ids: torch.Tensor, table: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``input_ids`` of an embedding table (dense ``[vocab, hidden]`` or quantized)."""
    if isinstance(table, Quantized):
        return table.embedding(input_ids, dtype)
    return F.embedding(input_ids, table)


def widens_bf16_weights() -> bool:
    """True where ``prepare_weight`` widens bf16 projections to fp32 (this CPU has oneDNN but
    neither its bf16 GEMM nor the native bf16 panels): they then take twice their bf16 bytes."""
    kernels = cpu_kernels()
    return (
        torch.backends.mkldnn.is_available()
        and not kernels.bf16_packed
        and not kernels.panels(torch.bfloat16)
    )


def packed_bf16_bytes(model: torch.nn.Module) -> int:
    """Bytes, as bf16, of the projections ``prepare_weight`` packed in a bf16 ``model`` (the
    part whose size depends on the CPU: see ``widens_bf16_weights``); 0 for other dtypes."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and is_packed(value) and id(value) not in seen:
                seen.add(id(value))
                total += value.numel() * 2
    return total


def matmul(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)`` for a ``[in, out]`` weight from ``prepare_weight``."""
    if isinstance(w, Quantized):
        return w.matmul(x, bias)
    if w.dim() == 3:
        return native.panel_gemm(x, w, bias)
    if w.is_mkldnn:
        if w.dtype != x.dtype:  # widened bf16 weight: fp32 GEMM, output rounded to x's dtype
            b = None if bias is None else bias.to(w.dtype)
            y = torch.ops.mkldnn._linear_pointwise(x.to(w.dtype), w, b, "none", [], "")
            return y.to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)


def matmul_add_(out: torch.Tensor, x: torch.Tensor, w: Weight) -> None:
    """``out += x @ w`` for a ``prepare_weight`` weight, the product rounded to ``out``'s dtype
    first as ``out.add_(matmul(x, w))`` rounds it; in the native GEMM's epilogue where it runs."""
    if isinstance(w, QuantPanels) and out.dtype in (torch.float32, torch.bfloat16):
        if out.stride(-1) == 1:
            w.matmul(x, out=out)
        else:
            out.add_(w.matmul(x))
    elif _is_panels(w) and out.dtype == w.dtype and out.stride(-1) == 1:
        native.panel_gemm(x, w, out=out)
    else:
        out.add_(matmul(x, w))


def glu(x: torch.Tensor, gate_up: Weight, act: str) -> torch.Tensor:
    """``act(gate(x)) * up(x)``, gate and up fused into one ``[hidden, 2I]`` matmul.

    The activation writes a fresh contiguous ``[T, I]`` tensor and the product lands in it:
    ``down`` then reads a dense operand (a strided view of ``gate_up``'s output measured ~10%
    slower as a GEMV input on CPU). The caller adds ``down`` straight into the residual.
    """
    if act == "silu" and isinstance(gate_up, QuantPanels) and gate_up.fuses_glu():
        return gate_up.glu(x)
    if act == "silu" and _is_panels(gate_up) and gate_up.shape[0] % 2 == 0:
        return native.panel_glu(x, gate_up)  # the GEMM's panels: SiLU-GLU in its epilogue
    gu = matmul(x, gate_up)
    if act == "silu" and (fused := native.silu_mul(gu)) is not None:
        return fused
    inter = gu.shape[-1] // 2
    gate, up = gu[:, :inter], gu[:, inter:]
    out = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return out.mul_(up)


MLP_CHUNK_ROWS = 256
"""Rows per gate/up + down pass: the MLP's intermediate of a long prefill chunk (``[T, 2I]``
where gate_up's product is written, ``[T, I]`` where the native GEMM applies the SiLU-GLU
itself) would otherwise be the step's largest transient (25 MB and 12.5 MB for 2,048 SmolLM2
tokens in fp32), and the larger a step's transients the more their resident footprint varies
with where the heap places them. 256 rows keep it small and the GEMMs about as efficient as
whole chunks (a 2,048-token prefill took 1.01x the time of 512-row passes)."""


def _row_parts(rows: int) -> list[slice]:
    """``rows`` in equal parts of at most ``MLP_CHUNK_ROWS`` (fewer GEMM shapes to cache)."""
    size = rows if rows <= MLP_CHUNK_ROWS else -(-rows // -(-rows // MLP_CHUNK_ROWS))
    return [slice(start, start + size) for start in range(0, rows, size)]


def mlp(x: torch.Tensor, gate_up: Weight, down: Weight, act: str) -> torch.Tensor:
    """``down(glu(x))`` as a new tensor, ``MLP_CHUNK_ROWS`` rows at a time."""
    first, *rest = _row_parts(x.shape[0])
    part = matmul(glu(x[first], gate_up, act), down)
    if not rest:
        return part
    out = part.new_empty(x.shape[0], part.shape[1])
    out[first].copy_(part)
    del part
    for rows in rest:
        out[rows].copy_(matmul(glu(x[rows], gate_up, act), down))
    return out


def add_mlp_(h: torch.Tensor, x: torch.Tensor, gate_up: Weight, down: Weight, act: str) -> None:
    """``h += down(glu(x))``, ``MLP_CHUNK_ROWS`` rows at a time; the native GEMM adds ``down``'s
    product into ``h`` itself (no output to copy, no separate add)."""
    for rows in _row_parts(x.shape[0]):
        matmul_add_(h[rows], glu(x[rows], gate_up, act), down)


def rope_permutation(head_dim: int) -> torch.Tensor:
    """Index map from HF's half-split head layout to kvroom's interleaved one (see module doc).

    ``new[2i] = old[i]`` and ``new[2i+1] = old[i + D/2]``.
    """
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def rope_inv_freq(
    hf_config: Any, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale of a HF rope configuration.

    ``layer_type`` selects the per-layer-type entry of ``rope_parameters`` (gemma3 runs a
    different theta on sliding and full layers).

    Raises:
        ModelSourceError: a rope type whose frequencies change with the sequence length
            (``dynamic``, ``longrope``), or partial rotary embeddings.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = hf_config.rope_parameters
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ModelSourceError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelSourceError(
            "partial rotary embeddings (partial_rotary_factor < 1) are not supported"
        )
    if rope_type == "default":
        base = float(params["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (base**exponents), 1.0
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kwargs)
    return inv_freq.float().cpu(), float(scale)


def rope_cis(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-token rotations ``scale * exp(i * p * inv_freq)`` as complex64 ``[T, 1, D/2]``.

    Computed once per step and shared by every layer of the same rope kind; the angle product
    is done in float32 exactly as HF does, so fp32 results match bit for bit up to the
    complex multiply.
    """
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angles), torch.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.complex(cos, sin)[:, None, :]


def apply_rope_(x: torch.Tensor, cis: torch.Tensor) -> None:
    """Rotate ``x`` ``[T, N, D]`` (a view into the qkv output) in place by ``cis`` ``[T, 1, D/2]``.

    float32 rotates through a complex view of ``x`` itself (one kernel, no copy). Other dtypes
    have no complex counterpart on every device, so they are rotated in float32 and copied back.
    """
    t, n, d = x.shape
    if x.dtype == torch.float32:
        torch.view_as_complex(x.view(t, n, d // 2, 2)).mul_(cis)
        return
    rotated = torch.view_as_complex(x.float().view(t, n, d // 2, 2)) * cis
    x.copy_(torch.view_as_real(rotated).view(t, n, d))


def softcap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in place (gemma's logit soft-capping)."""
    return x.div_(cap).tanh_().mul_(cap)


def rounded_scalar(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as HF multiplies by a 0-dim tensor of the model dtype."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))
