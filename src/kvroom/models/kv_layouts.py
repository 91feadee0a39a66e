"""Attention over the two KV layouts Gemma 4 adds: K=V entries, and KV shared between layers.

**K=V** (``attention_k_eq_v``, full-attention layers). One projection ``k`` serves as key and
value; transformers caches ``K = rope(k_norm(k))`` and ``V = v_norm(k)`` as two tensors. Both
norms divide by the same RMS, and ``k_norm`` only adds its weight, so ``K = rope(V * w_k)``
exactly (``(k * r) * w`` in either case). The pool therefore stores V alone (entry ``[1, kvh,
D]``, half the bytes) and the keys are rebuilt from the gathered V: gathered row ``j`` of a
full layer is position ``j`` of the sequence (block tables are in position order), so its
rotation is ``cis(j)``, one table per step shared by every K=V layer.

**KV sharing** (``num_kv_shared_layers``). A consumer layer reads its source layer's pool view
and this step's K/V of that layer; it writes nothing. Full layers store every row before they
attend, so the consumer gathers the same keys. A sliding layer stores a prefill chunk's last
rows only after attending (they may overwrite old ring entries the chunk still needs), so a
source with consumers defers that write until the consumers have run (``without_ring_write``,
``store_ring_write``).

**int8/int4 pools** (``kv_quant``): V of a K=V layer is quantized unrotated (its keys are
rebuilt from it through RoPE, which a rotation would break); a deferred ring write is rotated
as ``paged_attention`` rotates the rows it stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from kvroom.models import kv_quant
from kvroom.models.attention import KindBatch
from kvroom.models.kv_quant import KVCodec
from kvroom.models.prefill_attention import PrefillChunk, PrefillGroup


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """fp8 has no CPU index kernels; a same-width integer view moves the same bytes."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def store_rows(
    flat: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, codec: KVCodec | None = None
) -> None:
    """``flat[index] = rows``, rounded (or quantized) to the pool's format."""
    stored = kv_quant.encode(rows, flat.dtype, codec)
    _bytes_view(flat).index_copy_(0, index, _bytes_view(stored))


def without_ring_write(batch: KindBatch) -> KindBatch:
    """``batch`` with its sliding prefill write (after attention) removed."""
    pre = batch.prefill
    if not batch.sliding or pre is None or pre.write_src is None:
        return batch
    empty = pre.write_src.new_empty(0)
    return replace(batch, prefill=replace(pre, write_src=empty, write_dst=empty))


def store_ring_write(
    cache: torch.Tensor, pre: PrefillGroup, kv: torch.Tensor, codec: KVCodec | None = None
) -> None:
    """The sliding prefill write ``without_ring_write`` removed, done now."""
    assert pre.write_src is not None and pre.write_dst is not None
    flat = cache.view(-1, *cache.shape[2:])
    rows = kv.index_select(0, pre.write_src)
    h = None if codec is None else codec.rotation(rows.shape[-1], rows.device)
    store_rows(flat, pre.write_dst, kv_quant.rotate(rows, h), codec)


def rebuild_keys(values: torch.Tensor, k_weight: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Keys ``rope(V * w_k)`` of gathered values ``[B, L, kvh, D]`` (``cis``: ``[>=L, 1, D/2]``)."""
    b, n, h, d = values.shape
    k = (values * k_weight).float()
    rotated = torch.view_as_complex(k.view(b, n, h, d // 2, 2)) * cis[:n].view(1, n, 1, d // 2)
    return torch.view_as_real(rotated).view(b, n, h, d).to(values.dtype)


def _gather(
    cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, codec: KVCodec | None
) -> torch.Tensor:
    """V of blocks ``index`` ``[B, n]`` -> ``[B, n * block_size, kvh, D]`` in ``dtype``."""
    rows = _bytes_view(cache).index_select(0, index.view(-1)).view(cache.dtype)
    return kv_quant.decode(rows.view(index.shape[0], -1, *cache.shape[3:]), dtype, codec)


def k_eq_v_attention(
    q: torch.Tensor,
    v: torch.Tensor | None,
    cache: torch.Tensor,
    batch: KindBatch,
    k_weight: torch.Tensor,
    key_cis: Callable[[int], torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Store this step's V (unless ``v`` is None: a consumer layer), rebuild K, attend.

    Args:
        q: ``[T, heads, D]`` rotated queries.
        v: ``[T, kvh, D]`` this step's values, or None when a source layer stored them.
        cache: the layer's full-attention view ``[blocks, block_size, 1, kvh, D]``.
        batch: the step's full-attention metadata.
        k_weight: ``[D]`` the k_norm weight (``K = rope(V * w)``).
        key_cis: ``n -> [>= n, 1, D/2]`` rotations of positions ``0 .. n-1``.
        scale: score scale.

    Returns:
        ``[T, heads * D]``.
    """
    assert not batch.sliding, "K=V layers are full-attention layers"
    if v is not None:
        flat = cache.view(-1, *cache.shape[2:])
        store_rows(flat, batch.write_index, v.unsqueeze(1), batch.kv_codec)
    parts = []
    td = batch.decode.num_seqs if batch.decode is not None else 0
    if batch.decode is not None:
        g = batch.decode
        values = _gather(cache, g.kv_index, q.dtype, batch.kv_codec)[:, : g.kv_len]
        cis = key_cis(values.shape[1])
        parts.append(_attend_decode(q[:td], values, k_weight, cis, g.mask, scale))
    if batch.prefill is not None:
        pre = batch.prefill
        parts.append(_attend_prefill(q[td:], cache, pre, k_weight, key_cis, scale, batch.kv_codec))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _attend_decode(
    q: torch.Tensor,
    values: torch.Tensor,
    k_weight: torch.Tensor,
    key_cis: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One query per sequence; the heads of one KV head are its query rows (no repeat)."""
    b, h, d = q.shape
    kvh = values.shape[2]
    k = rebuild_keys(values, k_weight, key_cis).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.view(b, kvh, h // kvh, d), k, values.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.reshape(b, h * d)


def _attend_prefill(
    q: torch.Tensor,
    cache: torch.Tensor,
    g: PrefillGroup,
    k_weight: torch.Tensor,
    key_cis: Callable[[int], torch.Tensor],
    scale: float,
    codec: KVCodec | None,
) -> torch.Tensor:
    """Equally long fresh chunks, viewed ``[B, max_q_len]``, against their gathered blocks in
    one SDPA call; chunk by chunk (``g.chunks``) otherwise."""
    if g.chunks:
        return _attend_chunks(q, cache, g.chunks, k_weight, key_cis, scale, codec)
    _, h, d = q.shape
    assert g.kv_index is not None
    values = _gather(cache, g.kv_index, q.dtype, codec)
    cis = key_cis(values.shape[1])
    q_rows = q.view(g.num_seqs, g.max_q_len, h, d)  # equally long fresh chunks
    k = rebuild_keys(values, k_weight, cis).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q_rows.transpose(1, 2),
        k,
        values.transpose(1, 2),
        scale=scale,
        enable_gqa=h != values.shape[2],
        is_causal=True,  # a fresh group: query j of each chunk sees keys 0..j
    )
    return out.transpose(1, 2).reshape(-1, h * d)


def _attend_chunks(
    q: torch.Tensor,
    cache: torch.Tensor,
    chunks: tuple[PrefillChunk, ...],
    k_weight: torch.Tensor,
    key_cis: Callable[[int], torch.Tensor],
    scale: float,
    codec: KVCodec | None,
) -> torch.Tensor:
    """Each chunk against its own gathered blocks: top-left causal at position 0, its
    causal mask over the cached positions otherwise."""
    h = q.shape[1]
    outs = []
    for c in chunks:
        values = _gather(cache, c.kv_index, q.dtype, codec)[:, : c.kv_len]
        k = rebuild_keys(values, k_weight, key_cis(c.kv_len)).transpose(1, 2)
        qc = q[c.row_start : c.row_start + c.q_len].unsqueeze(0).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qc,
            k,
            values.transpose(1, 2),
            attn_mask=c.mask(q.dtype),
            scale=scale,
            enable_gqa=h != values.shape[2],
            is_causal=c.start_pos == 0,
        )
        outs.append(out.transpose(1, 2).reshape(c.q_len, -1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
