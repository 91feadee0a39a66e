"""Python entry points of the native kernels; each returns None where it does not apply, and
the caller then runs its torch path (``attention.py``, ``layers.py``)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from kvroom.models.kernels import cpu_kernels
from kvroom.models.kernels.build import library

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

SERIAL_MAX_ITEMS = 8
"""Work items (decode: sequence x kv head; norm: rows) up to which a kernel runs on one thread:
below it the OpenMP fork/join costs more than it saves, and on a shared machine the join may
wait a whole scheduler slice for the other core."""

SERIAL_MAX_ELEMENTS = 1 << 17
"""Elements up to which the row-wise kernels (add + RMSNorm, SiLU-GLU) run on one thread. Two
threads saved little even on a quiet machine (32 rows: the norm over 576 columns 11.1 against
13.2 us, SiLU-GLU over 1,536 28.6 against 27.2 us), and under a server's load the join waited
for the other thread to wake: sampled in ``kvroom serve`` at 32 clients, the two took 35% of
the engine thread's time, where one thread runs them in about 1.5 ms of a 60 ms step."""


def serial_rows(columns: int) -> int:
    return max(SERIAL_MAX_ITEMS, SERIAL_MAX_ELEMENTS // max(columns, 1))


@cache
def decode_vectorized(head_dim: int) -> bool:
    """Whether ``decode_attention`` runs its vector path for this head dim (64, 128, 256): each
    key row read once in place, no transposes. AVX-512: 3x the prefill kernel with one query
    row, 32 sequences of about 80 keys; AVX2 (8-float vectors): 2.3x fp32, 2.7x bf16. Else the
    prefill kernel is the faster of the two."""
    lib = library()
    return lib is not None and bool(lib.kvroom_decode_vectorized(head_dim))


@cache
def prefill_vectorized(head_dim: int) -> bool:
    """Whether ``prefill_attention`` runs its AVX-512 path for this head dim (queries held
    transposed, 16 rows per FMA, keys read in place): 1.3-1.7x torch's flash SDPA on SmolLM2's
    chunks of 512 positions, fresh or after 500-1,000 cached ones (fp32)."""
    lib = library()
    return lib is not None and bool(lib.kvroom_prefill_vectorized(head_dim))


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    softcap: float | None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor | None:
    """``[B, H * D]`` attention of one query per sequence over its pool units, read in place.

    Args:
        q: ``[B, H, D]`` queries, head and dim dense (rows may be strided).
        cache: the layer's pool ``[units, unit_len, 2, kv_heads, D]``, contiguous.
        tables: ``[B, n]`` int64 pool units per sequence, contiguous.
        lens: ``[B]`` int64 keys per sequence.
        lib: another build of the kernels (``build.build_library``) instead of the package's.
    """
    qd, kd = _DTYPES.get(q.dtype), _DTYPES.get(cache.dtype)
    b, h, d = q.shape
    if (
        q.device.type != "cpu"
        or qd is None
        or kd is None
        or (qd, kd) == (1, 0)
        or q.stride(2) != 1
        or q.stride(1) != d
        or not cache.is_contiguous()
        or not _native(lib)
    ):
        return None
    lib = library() if lib is None else lib
    assert lib is not None
    out = torch.empty(b, h * d, dtype=q.dtype)
    rc = lib.kvroom_decode_attention(
        q.data_ptr(), q.stride(0), qd, cache.data_ptr(), kd, tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), out.data_ptr(), b, h, cache.shape[3], d, cache.shape[1], scale,
        softcap or 0.0, SERIAL_MAX_ITEMS,
    )  # fmt: skip
    assert rc == 0, f"kvroom_decode_attention returned {rc}"
    return out


def prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor | None:
    """``[Tp, H * D]`` causal attention of packed prefill chunks over their pool blocks.

    The chunks' own K/V must be stored already: query ``j`` of chunk ``b`` (position
    ``starts[b] + j``) sees keys ``0 .. starts[b] + j`` read in place through ``tables[b]``, so a
    fresh prompt and a chunk with cached context take the same path (no gather, no mask).

    Args:
        q: ``[Tp, H, D]`` queries, rows packed chunk after chunk (rows may be strided).
        cache: the layer's pool ``[units, unit_len, 2, kv_heads, D]``, contiguous.
        tables: ``[B, n]`` int64 pool units per chunk, contiguous.
        starts: ``[B]`` int64 first position of each chunk.
        q_lens: ``[B]`` int64 rows of each chunk (they sum to ``Tp``).
        lib: another build of the kernels (``build.build_library``) instead of the package's.
    """
    qd, kd = _DTYPES.get(q.dtype), _DTYPES.get(cache.dtype)
    t, h, d = q.shape
    if (
        q.device.type != "cpu"
        or qd is None
        or kd is None
        or (qd, kd) == (1, 0)
        or q.stride(2) != 1
        or q.stride(1) != d
        or not cache.is_contiguous()
        or not _native(lib)
    ):
        return None
    lib = library() if lib is None else lib
    assert lib is not None
    out = torch.empty(t, h * d, dtype=q.dtype)
    rc = lib.kvroom_prefill_attention(
        q.data_ptr(), q.stride(0), qd, cache.data_ptr(), kd, tables.data_ptr(), tables.stride(0),
        starts.data_ptr(), q_lens.data_ptr(), out.data_ptr(), starts.shape[0], h, cache.shape[3],
        d, cache.shape[1], scale,
    )  # fmt: skip
    return out if rc == 0 else None


def add_rms_norm(
    h: torch.Tensor,
    delta: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor | None:
    """``h += delta`` in place, then ``rms_norm(h) [* weight]`` as a new tensor; None where the
    native kernel does not apply (the caller then does both in torch)."""
    dt = _DTYPES.get(h.dtype)
    if (
        h.device.type != "cpu"
        or dt is None
        or h.dim() != 2
        or not h.is_contiguous()
        or (delta is not None and (delta.dtype != h.dtype or not delta.is_contiguous()))
        or (weight is not None and (weight.dtype != h.dtype or not weight.is_contiguous()))
        or not _native(lib)
    ):
        return None
    lib = library() if lib is None else lib
    assert lib is not None
    y = torch.empty_like(h)
    rc = lib.kvroom_add_rms_norm(
        h.data_ptr(), 0 if delta is None else delta.data_ptr(), y.data_ptr(),
        0 if weight is None else weight.data_ptr(), dt, h.shape[0], h.shape[1], eps,
        serial_rows(h.shape[1]),
    )  # fmt: skip
    assert rc == 0, f"kvroom_add_rms_norm returned {rc}"
    return y


def silu_mul(gu: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """``silu(gu[:, :I]) * gu[:, I:]`` as a new ``[T, I]`` tensor in one pass (torch: a silu
    over a strided view, then a multiply); None where the native kernel does not apply."""
    dt = _DTYPES.get(gu.dtype)
    if gu.device.type != "cpu" or dt is None or gu.dim() != 2 or not gu.is_contiguous():
        return None
    if not _native(lib):
        return None
    lib = library() if lib is None else lib
    assert lib is not None
    rows, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gu.dtype)
    serial = serial_rows(2 * inter)
    rc = lib.kvroom_silu_mul(gu.data_ptr(), out.data_ptr(), dt, rows, inter, serial)
    assert rc == 0, f"kvroom_silu_mul returned {rc}"
    return out


PANEL = 32
"""Output columns per panel of a ``pack_panels`` weight (two AVX-512 vectors of fp32, four AVX2
ones)."""


def pack_panels(w: torch.Tensor) -> torch.Tensor | None:
    """A ``[in, out]`` fp32 or bf16 weight as ``[out / 32, in, 32]`` column panels (its dtype;
    bf16 rows hold columns 0, 16, 1, 17, ...) for ``panel_gemm``; None where the native GEMM
    does not apply (another dtype or device, ``out`` not a multiple of 32, a CPU without the
    kernel: ``cpu_kernels().panel_gemm``, ``panel_gemm_bf16``)."""
    if w.device.type != "cpu" or w.dim() != 2 or w.shape[1] % PANEL:
        return None
    if not cpu_kernels().panels(w.dtype):
        return None
    return panels_of(w)


def panels_of(w: torch.Tensor) -> torch.Tensor:
    """``w`` (``[in, out]``, fp32 or bf16, ``out`` a multiple of 32) in the panel layout,
    whatever this CPU runs (``pack_panels`` asks it first)."""
    k, n = w.shape
    if w.dtype == torch.bfloat16:  # columns 0, 16, 1, 17, ...: the kernel's two-vector load
        return w.view(k, n // PANEL, 2, PANEL // 2).permute(1, 0, 3, 2).reshape(-1, k, PANEL)
    return w.view(k, n // PANEL, PANEL).permute(1, 0, 2).contiguous()


def panel_gemm(
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: torch.Tensor | None = None,
    lib: ctypes.CDLL | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W (+ bias)`` for ``panels = pack_panels(W)``, computed in fp32 (bf16 weights are
    widened as they stream, exactly); ``x`` ``[M, in]`` with dense rows. Returns a new
    ``[M, out]`` tensor of the panels' dtype (bf16: rounded once, from the fp32 result), or of
    ``x``'s where fp32 panels meet a narrower ``x``. ``out``: add the product into this
    ``[M, out]`` tensor of the panels' dtype instead (dense rows; the product rounded first, as
    ``out.add_(x @ W)`` rounds it) and return it. ``lib``: another build of the kernels
    (``build.build_library``) instead of the package's."""
    lib = library() if lib is None else lib
    assert lib is not None
    dtype, x = x.dtype, _dense_fp32(x)
    p, k, _ = panels.shape
    m = x.shape[0]
    y = torch.empty(m, p * PANEL, dtype=panels.dtype) if out is None else out
    assert y.dtype == panels.dtype and y.shape == (m, p * PANEL) and y.stride(-1) == 1
    if bias is not None:
        bias = bias.float().contiguous()
    gemm = lib.kvroom_panel_gemm if panels.dtype == torch.float32 else lib.kvroom_panel_gemm_bf16
    rc = gemm(
        x.data_ptr(), x.stride(0), panels.data_ptr(), 0 if bias is None else bias.data_ptr(),
        y.data_ptr(), y.stride(0), m, k, p * PANEL, out is not None,
    )  # fmt: skip
    assert rc == 0, f"kvroom panel GEMM ({panels.dtype}) returned {rc}"
    return y if out is not None else _narrowed(y, dtype)


def panel_glu(
    x: torch.Tensor, panels: torch.Tensor, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """``silu(x @ W[:, :I]) * (x @ W[:, I:])`` for ``panels = pack_panels(W)`` of a ``[in, 2I]``
    gate_up weight (``I`` a multiple of 32): ``silu_mul(panel_gemm(x, panels))`` bit for bit, in
    one pass that never writes the ``[M, 2I]`` product. Returns a new ``[M, I]`` tensor of the
    panels' dtype (fp32 panels meeting a narrower ``x``: ``x``'s)."""
    lib = library() if lib is None else lib
    assert lib is not None
    dtype, x = x.dtype, _dense_fp32(x)
    p, k, _ = panels.shape
    y = torch.empty(x.shape[0], p // 2 * PANEL, dtype=panels.dtype)
    glu = lib.kvroom_panel_glu if panels.dtype == torch.float32 else lib.kvroom_panel_glu_bf16
    rc = glu(x.data_ptr(), x.stride(0), panels.data_ptr(), y.data_ptr(), x.shape[0], k, y.shape[1])
    assert rc == 0, f"kvroom panel GLU ({panels.dtype}) returned {rc}"
    return _narrowed(y, dtype)


def _native(lib: ctypes.CDLL | None) -> bool:
    """Another build was given, or the package's kernels are loaded."""
    return lib is not None or cpu_kernels().native


def _narrowed(y: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """``y`` in ``x``'s dtype where ``x`` was narrower than fp32 (fp32 panels meeting bf16
    ``x``; with bf16 panels a no-op), else as the panels made it."""
    return y if x_dtype == torch.float32 else y.to(x_dtype)


def _dense_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the panel kernels read it: fp32, each row's elements adjacent."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


# -- int8 / int4 KV (kvq_attention.h) -----------------------------------------------------------


def decode_attention_q(
    q: torch.Tensor,
    cache: torch.Tensor,
    bits: int,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    softcap: float | None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor | None:
    """``decode_attention`` over an int8 (``bits`` 8) or int4 (4) pool ``[units, unit_len, 2,
    kv_heads, R]`` of ``uint8`` rows (``models/kv_quant.py``), dequantized in registers; None
    where the kernel does not apply (head dim not a multiple of 16, other dtypes or devices)."""
    b, h, d = q.shape
    if not _quant_kv_applies(q, cache, lib):
        return None
    lib = library() if lib is None else lib
    assert lib is not None
    out = torch.empty(b, h * d, dtype=q.dtype)
    rc = lib.kvroom_decode_attention_q(
        q.data_ptr(), q.stride(0), _DTYPES[q.dtype], cache.data_ptr(), bits, tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), out.data_ptr(), b, h, cache.shape[3], d,
        cache.shape[1], scale, softcap or 0.0, SERIAL_MAX_ITEMS,
    )  # fmt: skip
    return out if rc == 0 else None


def prefill_attention_q(
    q: torch.Tensor,
    cache: torch.Tensor,
    bits: int,
    tables: torch.Tensor,
    starts: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor | None:
    """``prefill_attention`` over an int8/int4 pool (see ``decode_attention_q``); None where
    the kernel does not apply."""
    t, h, d = q.shape
    if not _quant_kv_applies(q, cache, lib):
        return None
    lib = library() if lib is None else lib
    assert lib is not None
    out = torch.empty(t, h * d, dtype=q.dtype)
    rc = lib.kvroom_prefill_attention_q(
        q.data_ptr(), q.stride(0), _DTYPES[q.dtype], cache.data_ptr(), bits, tables.data_ptr(),
        tables.stride(0), starts.data_ptr(), q_lens.data_ptr(), out.data_ptr(), starts.shape[0],
        h, cache.shape[3], d, cache.shape[1], scale,
    )  # fmt: skip
    return out if rc == 0 else None


def _quant_kv_applies(q: torch.Tensor, cache: torch.Tensor, lib: ctypes.CDLL | None) -> bool:
    """CPU, float32/bf16 queries with dense heads, a contiguous ``uint8`` pool, kernels
    loaded."""
    d = q.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and cache.dtype == torch.uint8
        and q.stride(2) == 1
        and q.stride(1) == d
        and cache.is_contiguous()
        and _native(lib)
    )


def hadamard_rows(
    x: torch.Tensor, block: int, lib: ctypes.CDLL | None = None
) -> torch.Tensor | None:
    """``x`` ``[..., D]`` times the block-diagonal normalised Walsh-Hadamard matrix (blocks of
    ``block``) over its last dim, as a new contiguous tensor in ``x``'s dtype (``kv_write.h``);
    None where the kernel does not apply (other devices or dtypes)."""
    lib = library() if lib is None else lib
    if lib is None or x.device.type != "cpu" or x.dtype not in _DTYPES or x.dim() < 2:
        return None
    rows = x.flatten(1) if x.dim() > 2 else x  # a view where the inner dims are contiguous
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    n, width = rows.shape
    rc = lib.kvroom_hadamard_rows(
        rows.data_ptr(), rows.stride(0), out.data_ptr(), width, _DTYPES[x.dtype], n, width, block
    )
    return out if rc == 0 else None


def kv_quantize(x: torch.Tensor, bits: int, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """Rows ``[..., D]`` as int8 (``bits`` 8) or int4 (4) pool rows ``uint8 [..., R]``
    (``kv_write.h``; ``kv_quant.quantize_torch`` is its torch twin); None where the kernel does
    not apply (other devices)."""
    lib = library() if lib is None else lib
    if lib is None or x.device.type != "cpu":
        return None
    d = x.shape[-1]
    xf = x.detach().float().contiguous()
    out = torch.empty(*x.shape[:-1], d * bits // 8 + 4, dtype=torch.uint8)
    rc = lib.kvroom_kv_quantize(xf.data_ptr(), xf.numel() // max(d, 1), d, bits, out.data_ptr())
    return out if rc == 0 else None
