"""Paged attention: the models' input contract (``AttentionMetadata``), storing K/V, decode.

One engine step packs the tokens of every scheduled sequence into rows ``[0, T)``, decodes first::

    rows:  0 .......... Td-1 | Td ....................................... T-1
           one token per seq | prefill chunks (q_len >= 2), seq after seq
           "decode group"    | "prefill group"

Both groups run in one forward; each attention layer handles its two groups with one batched
SDPA call each, so the Python work per layer does not grow with the number of sequences.
All index tensors are built once per step (``attention_index.build_attention_metadata``) and
shared by every layer of the same kind; the layer loop never syncs with the host.

KV storage (owned by ``engine/kv/pool.py``), per layer, with ``E = [2, kv_heads, head_dim]``
(K at ``[0]``, V at ``[1]``, so one ``index_copy_`` stores both)::

    full    layer: [num_blocks, block_size, *E]   position p of a seq -> block_table[p // bs],
                                                   offset p % bs
    sliding layer: [num_slots, window, *E]         position p of the seq in slot s -> ring
                                                   entry (s, p % window)

Full layers store the step's K/V first. Decode rows then attend in one native kernel call
(``kernels/cpu_kernels.cpp``) that walks each sequence's block table and reads K/V in place,
one work item per (sequence, kv head); where it does not apply (CUDA, no compiler, other
dtypes) they gather whole blocks through the block tables (padded to the longest table,
masked) for one SDPA call, as prefill chunks always do. Sliding layers differ for prefill:
a chunk of ``C`` tokens at positions ``[s, s+C)`` needs keys back to ``s-W+1``, which the
chunk itself may overwrite in the ring, so it attends over (old ring entries
``[max(0, s-W+1), s)``) + (its own new K/V) with the window mask, and only then stores its
last ``min(C, W)`` tokens. The prefill group's attention (``PrefillGroup``, both layer kinds)
lives in ``prefill_attention.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvroom.models import kv_quant
from kvroom.models.kernels import ops as native
from kvroom.models.kv_quant import KVCodec
from kvroom.models.prefill_attention import (
    PrefillGroup,
    attend,
    bytes_view,
    gather,
    prefill_full,
    prefill_sliding,
)
from kvroom.threads import one_thread


@dataclass(frozen=True)
class DecodeGroup:
    """The first ``num_seqs`` rows of the step: one query token per sequence."""

    num_seqs: int
    kv_index: torch.Tensor
    """``[B, n]`` pool units to gather per sequence: blocks (full) or its one ring slot."""
    kv_len: int
    """Key positions kept after the gather (the gather is padded to whole units)."""
    mask: torch.Tensor | None
    """``[B, 1, 1, kv_len]`` additive mask hiding padding; None when nothing is padded."""
    kv_start: int | None = None
    """Set when one sequence's units are consecutive (a fresh pool hands them out in order):
    the keys are then the view ``cache[kv_start : kv_start + n]``, no gather at all."""
    lens: torch.Tensor | None = None
    """``[B]`` int64 keys per sequence (the native kernel reads ``kv_index`` and ``lens``)."""
    last_pos: torch.Tensor | None = None
    """``[B]`` int64 ``lens - 1``: each query's position for the native prefill kernel."""
    one_row: torch.Tensor | None = None
    """``[B]`` int64 ones: one query row per sequence for the native prefill kernel."""


@dataclass(frozen=True)
class KindBatch:
    """Everything one layer kind (full or sliding) needs for this step."""

    sliding: bool
    write_index: torch.Tensor
    """Full: flat slot of every row ``[T]``. Sliding: flat ring entry of every decode row."""
    decode: DecodeGroup | None
    prefill: PrefillGroup | None
    kv_codec: KVCodec | None = None
    """int8/int4 pool: how its rows are encoded (and whether Q/K/V are rotated); None: floats."""


@dataclass(frozen=True)
class AttentionMetadata:
    """The model's per-step attention input; built once, shared by all layers."""

    num_tokens: int
    layers: tuple[KindBatch, ...]
    """Per layer, the batch of its kind (the same object for every layer of a kind)."""


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    batch: KindBatch,
    scale: float,
    softcap: float | None = None,
    key_shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's K/V in ``cache`` and attend; returns ``[T, heads * head_dim]``.

    Args:
        q: ``[T, heads, head_dim]`` rotated queries (a view of the qkv projection).
        kv: ``[T, 2, kv_heads, head_dim]`` rotated keys and values (a view as well).
        cache: this layer's pool tensor, ``[units, unit_len, 2, kv_heads, head_dim]`` (an
            int8/int4 pool: ``uint8`` rows of ``kv_quant.KVCodec.row_bytes`` instead).
        batch: the step's metadata for this layer's kind.
        scale: score scale (``head_dim ** -0.5``, or gemma's ``query_pre_attn_scalar ** -0.5``).
        softcap: gemma2-style attention logit soft-capping, None when off.
        key_shift: ``[kv_heads, head_dim]`` subtracted from every key before it is stored or
            attended (an int4 pool's "key shift", ``kv_quant``; not with ``softcap``).
    """
    codec = batch.kv_codec
    if key_shift is not None:
        assert codec is not None and softcap is None, "a key shift needs a quantized pool"
        kv = kv_quant.shift_keys(kv, key_shift)
    h = None if codec is None else codec.rotation(q.shape[-1], q.device)
    q, kv = kv_quant.rotate(q, h), kv_quant.rotate(kv, h)
    flat = cache.view(-1, *cache.shape[2:])
    td = batch.decode.num_seqs if batch.decode is not None else 0
    _store(flat, batch.write_index, kv[:td] if batch.sliding else kv, codec)
    parts = []
    if batch.decode is not None:
        parts.append(_decode(q[:td], cache, batch.decode, scale, softcap, codec))
    if batch.prefill is not None:
        pre = batch.prefill
        if batch.sliding:
            parts.append(prefill_sliding(q[td:], kv, flat, pre, scale, softcap, codec))
            _store(flat, pre.write_dst, kv.index_select(0, pre.write_src), codec)
        else:
            parts.append(prefill_full(q[td:], kv, cache, pre, scale, softcap, codec))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if h is None else kv_quant.rotate(out.view(q.shape), h).view(out.shape)


def _store(
    flat: torch.Tensor, index: torch.Tensor, kv: torch.Tensor, codec: KVCodec | None
) -> None:
    """``flat[index] = kv``, rounded (or quantized) to the pool's format."""
    kv = kv_quant.encode(kv, flat.dtype, codec)
    bytes_view(flat).index_copy_(0, index, bytes_view(kv))


def _native_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    g: DecodeGroup,
    scale: float,
    softcap: float | None,
    codec: KVCodec | None = None,
) -> torch.Tensor | None:
    """The decode kernel where it has its vector path (head dim 64/128/256). Else,
    without a softcap, the tiled prefill kernel with one query row per sequence, faster than
    the decode kernel's scalar path (8 sequences x 1,500 keys, bf16: 1.38 against 5.52 ms); the
    decode kernel serves the rest. An int8/int4 pool: its own kernel (head dims of 16k),
    dequantizing in registers. None: none applies."""
    assert g.lens is not None
    if codec is not None:
        return native.decode_attention_q(q, cache, codec.bits, g.kv_index, g.lens, scale, softcap)
    fast = native.decode_vectorized(q.shape[2])
    if not fast and not softcap and g.last_pos is not None and g.one_row is not None:
        out = native.prefill_attention(q, cache, g.kv_index, g.last_pos, g.one_row, scale)
        if out is not None:
            return out
    return native.decode_attention(q, cache, g.kv_index, g.lens, scale, softcap)


def _decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    g: DecodeGroup,
    scale: float,
    softcap: float | None,
    codec: KVCodec | None = None,
) -> torch.Tensor:
    """One query per sequence. The query heads sharing a KV head become that head's "query
    positions" (``[B, kv_heads, group, D]``), so GQA needs neither ``repeat_kv`` nor a copy."""
    b, h, d = q.shape
    if g.lens is not None:
        out = _native_decode(q, cache, g, scale, softcap, codec)
        if out is not None:
            return out
    if g.kv_start is None:
        keys = gather(cache, g.kv_index, q.dtype, codec)[:, : g.kv_len]
    else:
        run = cache[g.kv_start : g.kv_start + g.kv_index.shape[1]]
        keys = kv_quant.decode(run.view(1, -1, *cache.shape[2:])[:, : g.kv_len], q.dtype, codec)
    kvh = keys.shape[3]
    q = q.view(b, kvh, h // kvh, d)
    if q.device.type == "cpu" and b * kvh <= _SERIAL_MAX_HEADS:
        with one_thread():  # ~40 us of work: a fork/join costs as much
            out = attend(q, keys, g.mask, scale, softcap)
    else:
        out = attend(q, keys, g.mask, scale, softcap)
    return out.reshape(b, h * d)


_SERIAL_MAX_HEADS = 8
"""Decode attention over at most this many (sequence, kv head) pairs runs on one CPU thread."""
