"""Paged attention of the prefill group: chunks of two or more tokens per sequence.

``attention.paged_attention`` stores the step's K/V, then hands its prefill rows here. Full
layers: the native kernel reads each chunk's keys in place from the pool where it is the faster;
else SDPA, fresh chunks over the step's own K/V under the causal mask, chunks with cached
context over their gathered blocks. Sliding layers: each chunk over its old ring entries and its
own K/V, before the chunk is stored (the storage layout is drawn in ``attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvroom.models import kv_quant
from kvroom.models.kernels import cpu_kernels
from kvroom.models.kernels import ops as native
from kvroom.models.kv_quant import KVCodec
from kvroom.models.layers import softcap_


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill chunk attended on its own, where keys come from the pool: no padding to
    the step's longest chunk and no ``[B, Q, L]`` mask, so a step holds at most one chunk's
    keys and mask at a time (``kv_len <= max_seq_len``), whatever the batch."""

    row_start: int
    """First row of the chunk among the step's prefill rows (packed)."""
    q_len: int
    start_pos: int
    """Cached positions before the chunk."""
    kv_len: int
    """Keys it attends to: ``start_pos + q_len`` (full layers); old ring entries + ``q_len``
    (sliding layers)."""
    kv_index: torch.Tensor | None
    """Full: ``[1, n]`` blocks holding positions ``0 .. kv_len - 1``. Sliding: ``[1, n_old]``
    flat ring entries of its old keys (oldest first), None when it has none."""
    window: int | None = None
    """Sliding layers' window; None for full attention."""

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``[1, 1, q_len, kv_len]`` additive mask, built when attended (one chunk at a time);
        None for a full-attention chunk at position 0 (SDPA's causal mask does it)."""
        q = torch.arange(self.q_len)[:, None]
        if self.window is None:
            if self.start_pos == 0:
                return None
            allowed = torch.arange(self.kv_len)[None, :] <= self.start_pos + q
        else:
            # old key i is position s - n_old + i; own key k is position s + k
            n_old = self.kv_len - self.q_len
            old_ok = torch.arange(n_old)[None, :] - n_old > q - self.window
            k = torch.arange(self.q_len)[None, :]
            allowed = torch.cat([old_ok, (k <= q) & (q - k < self.window)], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        return mask[None, None]


@dataclass(frozen=True)
class PrefillGroup:
    """Rows ``[row_start, T)``: chunks of two or more tokens, ``num_seqs`` of them, the longest
    ``max_q_len`` (every one of them when ``fresh``)."""

    row_start: int
    num_seqs: int
    max_q_len: int
    kv_index: torch.Tensor | None
    """Full: ``[B, n]`` blocks to gather. Sliding: ``[B, L_old]`` flat ring entries of the old
    keys, None when no chunk has any."""
    write_src: torch.Tensor | None = None
    """Sliding only: step rows whose K/V are stored after attention (last ``min(C, W)``)."""
    write_dst: torch.Tensor | None = None
    """Sliding only: flat ring entries those rows go to."""
    starts: torch.Tensor | None = None
    """Full only: ``[B]`` int64 first position of each chunk (the native kernel's input)."""
    q_lens: torch.Tensor | None = None
    """Full only: ``[B]`` int64 tokens of each chunk."""
    fresh: bool = False
    """Full only: every chunk starts at position 0, so its keys are its own K/V: attention
    reads them from the step (no gather from the pool) under SDPA's causal mask; a layout
    that gathers (K=V) gets the same keys from ``kv_index``, top-left causal."""
    chunks: tuple[PrefillChunk, ...] = ()
    """Sliding, and full with cached context: the chunks one by one, for the paths that
    attend over gathered keys (the native kernel reads ``kv_index``, ``starts``, ``q_lens``)."""


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """fp8 has no CPU index kernels; a same-width integer view moves the same bytes."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def gather(
    cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, codec: KVCodec | None
) -> torch.Tensor:
    """``cache[index]`` for ``index`` ``[B, n]`` -> ``[B, n * unit_len, *entry]`` in ``dtype``."""
    rows = bytes_view(cache).index_select(0, index.view(-1)).view(cache.dtype)
    return kv_quant.decode(rows.view(index.shape[0], -1, *cache.shape[2:]), dtype, codec)


def prefill_full(
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    g: PrefillGroup,
    scale: float,
    softcap: float | None,
    codec: KVCodec | None = None,
) -> torch.Tensor:
    """Full-attention chunks, whose K/V are stored already: the native kernel reading every
    key in place from the pool (no gather, no mask tensor) where it is the faster
    (``_native_prefill``), else SDPA: fresh chunks over the step's own K/V under the causal
    mask, chunks with cached context over their gathered blocks (``_prefill_chunks``)."""
    in_place = g.starts is not None and g.q_lens is not None and softcap is None
    if in_place and codec is not None and not g.fresh:
        out = native.prefill_attention_q(
            q, cache, codec.bits, g.kv_index, g.starts, g.q_lens, scale
        )
        if out is not None:
            return out
    elif in_place and _native_prefill(q, g):
        out = native.prefill_attention(q, cache, g.kv_index, g.starts, g.q_lens, scale)
        if out is not None:
            return out
    if g.fresh:
        keys = _per_seq(kv_quant.as_stored(kv[g.row_start :], cache.dtype, codec), g)
        return _prefill(q, keys, g, scale, softcap)
    return _prefill_chunks(q, cache, g.chunks, scale, softcap, codec)


NATIVE_MAX_CHUNK_SCORES = 128 * 256
"""Chunks of at most this many scores (``q_len x kv_len``) each are attended by the native
kernel in one call even where SDPA wins on large chunks: SDPA then runs per chunk (a gather, one
or two calls and a concatenation each), which costs more than the kernel on many small chunks
(32 chat prompts of ~40 tokens in a 512-token budget: 1.87 against 2.01 s to first tokens)."""


def _small_chunks(g: PrefillGroup) -> bool:
    return all(c.q_len * c.kv_len <= NATIVE_MAX_CHUNK_SCORES for c in g.chunks)


def _native_prefill(q: torch.Tensor, g: PrefillGroup) -> bool:
    """Chunks with cached context: the native kernel, where its AVX-512 path takes this head dim
    (``_vector_prefill``), or where SDPA is not the faster (``sdpa_context_prefill``), or where
    every chunk is small (all of them in one call). Fresh chunks keep SDPA: torch's flash kernel
    beats the generic native path by ~20%, and the AVX-512 path, 1.7x faster per fresh chunk,
    left the profiled step shapes below what a run's first prefill steps reached (SmolLM2 fp32,
    32 x 248-token prompts: plan 1,422 MB, peaks 1,406-1,437 MB over seven runs)."""
    if g.fresh:
        return False
    return _vector_prefill(q) or not _sdpa_context_prefill(q) or _small_chunks(g)


def _vector_prefill(q: torch.Tensor) -> bool:
    """This CPU attends chunks with cached context fastest through the native kernel's AVX-512
    path, which this head dim takes (``kernels.vector_prefill``, ``ops.prefill_vectorized``)."""
    return (
        q.device.type == "cpu"
        and cpu_kernels().vector_prefill
        and native.prefill_vectorized(q.shape[-1])
    )


def _sdpa_context_prefill(q: torch.Tensor) -> bool:
    """This CPU attends chunks with cached context faster through SDPA (``kernels``)."""
    return q.device.type == "cpu" and cpu_kernels().sdpa_context_prefill


def _prefill_chunks(
    q: torch.Tensor,
    cache: torch.Tensor,
    chunks: tuple[PrefillChunk, ...],
    scale: float,
    softcap: float | None,
    codec: KVCodec | None = None,
) -> torch.Tensor:
    """Each chunk over its gathered blocks (its own K/V are stored already), under its mask;
    on CPU a chunk with cached context is attended in two parts instead (``_attend_split``)."""
    outs = []
    for c in chunks:
        keys = gather(cache, c.kv_index, q.dtype, codec)[:, : c.kv_len]
        qc = q[c.row_start : c.row_start + c.q_len].unsqueeze(0).transpose(1, 2)
        if _split_applies(qc, c, softcap):
            out = _attend_split(qc, keys, c.start_pos, scale)
        else:
            causal = c.start_pos == 0
            out = attend(qc, keys, c.mask(q.dtype), scale, softcap, causal=causal)
        outs.append(out.transpose(1, 2).reshape(c.q_len, -1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _split_applies(q: torch.Tensor, c: PrefillChunk, softcap: float | None) -> bool:
    """A full-attention chunk with cached context, no softcap, on CPU's flash kernel."""
    return (
        c.start_pos > 0
        and c.window is None
        and softcap is None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _attend_split(q: torch.Tensor, keys: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """A chunk at positions ``[start, start + Lq)`` over ``keys`` ``[1, start + Lq, 2, kv_heads,
    D]`` as two flash calls merged by their log-sum-exp: every query over the cached keys
    ``[0, start)`` unmasked, and over its own keys under the square causal mask. Under one
    bottom-right mask tensor the kernel scores the whole ``Lq x (start + Lq)`` rectangle and
    adds the mask; here the causal part skips the blocks above the diagonal and no mask is
    built. Returns ``[1, Hq, Lq, D]`` like ``attend``."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    k = keys[:, :, 0].transpose(1, 2)
    v = keys[:, :, 1].transpose(1, 2)
    old, lse_old = flash(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
    own, lse_own = flash(q, k[:, :, start:], v[:, :, start:], 0.0, True, scale=scale)
    w_old = torch.sigmoid_(lse_old.sub_(lse_own)).unsqueeze(-1)
    if q.dtype == torch.float32:
        return own.lerp_(old, w_old)
    return own.float().lerp_(old.float(), w_old).to(q.dtype)


def _prefill(
    q: torch.Tensor,
    keys: torch.Tensor,
    g: PrefillGroup,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Equally long fresh chunks viewed as ``[B, max_q_len]``, attended in one call over their
    own keys, viewed the same way, under SDPA's causal mask."""
    _, h, d = q.shape
    q_rows = q.view(g.num_seqs, g.max_q_len, h, d)
    out = attend(q_rows.transpose(1, 2), keys, None, scale, softcap, causal=True)
    return out.transpose(1, 2).reshape(-1, h * d)


def prefill_sliding(
    q: torch.Tensor,
    kv: torch.Tensor,
    flat: torch.Tensor,
    g: PrefillGroup,
    scale: float,
    softcap: float | None,
    codec: KVCodec | None = None,
) -> torch.Tensor:
    """Per chunk, keys = its old ring entries + its own K/V, read before the chunk is stored.

    The chunk's own K/V are rounded to the pool dtype as if they had been stored, so a prompt
    gives the same logits however it is chunked.
    """
    own = kv_quant.as_stored(kv[g.row_start :], flat.dtype, codec)
    outs = []
    for c in g.chunks:
        rows = slice(c.row_start, c.row_start + c.q_len)
        keys = own[rows].unsqueeze(0)
        if c.kv_index is not None:
            old = gather(flat.unsqueeze(1), c.kv_index, kv.dtype, codec)
            keys = torch.cat([old, keys], dim=1)
        qc = q[rows].unsqueeze(0).transpose(1, 2)
        out = attend(qc, keys, c.mask(q.dtype), scale, softcap)
        outs.append(out.transpose(1, 2).reshape(c.q_len, -1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _per_seq(rows: torch.Tensor, g: PrefillGroup) -> torch.Tensor:
    """Equally long chunks' packed rows ``[Tp, ...]`` viewed ``[B, max_q_len, ...]``."""
    return rows.view(g.num_seqs, g.max_q_len, *rows.shape[1:])


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA of ``q`` ``[B, Hq, Lq, D]`` over ``keys`` ``[B, L, 2, kv_heads, D]`` (strided views)."""
    k = keys[:, :, 0].transpose(1, 2)
    v = keys[:, :, 1].transpose(1, 2)
    if softcap is None:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa, is_causal=causal
        )
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap_(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), softcap)
    if mask is not None:
        scores = scores + mask
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)
