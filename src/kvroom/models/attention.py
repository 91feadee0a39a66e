"""Paged attention: the models' input contract (``AttentionMetadata``) and the torch math.

One engine step packs the tokens of every scheduled sequence into rows ``[0, T)``, decodes first::

    rows:  0 .......... Td-1 | Td ....................................... T-1
           one token per seq | prefill chunks (q_len >= 2), seq after seq
           "decode group"    | "prefill group"

Both groups run in one forward; each attention layer handles its two groups with one batched
SDPA call each, so the Python work per layer does not grow with the number of sequences.
All index tensors are built once per step (``build_attention_metadata``) and shared by every
layer of the same kind; the layer loop never syncs with the host.

KV storage (owned by ``engine/kv_cache.py``), per layer, with ``E = [2, kv_heads, head_dim]``
(K at ``[0]``, V at ``[1]``, so one ``index_copy_`` stores both)::

    full    layer: [num_blocks, block_size, *E]   position p of a seq -> block_table[p // bs],
                                                   offset p % bs
    sliding layer: [num_slots, window, *E]         position p of the seq in slot s -> ring
                                                   entry (s, p % window)

Full layers store the step's K/V first, then gather whole blocks through the block tables
(padded to the longest table, masked). Sliding layers differ for prefill: a chunk of ``C``
tokens at positions ``[s, s+C)`` needs keys back to ``s-W+1``, which the chunk itself may
overwrite in the ring, so it attends over (old ring entries ``[max(0, s-W+1), s)``) + (its own
new K/V) with the window mask, and only then stores its last ``min(C, W)`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvroom.models.layers import softcap_


class SeqChunk(NamedTuple):
    """One sequence's share of a step, as the metadata builder needs it."""

    start_pos: int
    """Position of the first token computed this step (= tokens already cached)."""
    q_len: int
    """Tokens computed this step."""
    block_table: Sequence[int]
    """Full-attention pool blocks; must cover positions ``[0, start_pos + q_len)``."""
    sliding_slot: int | None
    """Ring slot of this sequence in the sliding-window layers, None when there are none."""


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


@dataclass(frozen=True)
class PrefillGroup:
    """Rows ``[row_start, T)``: chunks of two or more tokens, laid out ``[B, max_q_len]``."""

    row_start: int
    num_seqs: int
    max_q_len: int
    pad_index: torch.Tensor | None
    """``[Tp]`` row of each packed token in the padded ``[B * max_q_len]`` layout; None if B=1."""
    kv_index: torch.Tensor | None
    """Full: ``[B, n]`` blocks to gather. Sliding: ``[B, L_old]`` flat ring entries of the old
    keys, None when no chunk has any."""
    mask: torch.Tensor
    """``[B, 1, max_q_len, L]`` additive causal (and window) mask over the gathered keys."""
    write_src: torch.Tensor | None = None
    """Sliding only: step rows whose K/V are stored after attention (last ``min(C, W)``)."""
    write_dst: torch.Tensor | None = None
    """Sliding only: flat ring entries those rows go to."""


@dataclass(frozen=True)
class KindBatch:
    """Everything one layer kind (full or sliding) needs for this step."""

    sliding: bool
    write_index: torch.Tensor
    """Full: flat slot of every row ``[T]``. Sliding: flat ring entry of every decode row."""
    decode: DecodeGroup | None
    prefill: PrefillGroup | None


@dataclass(frozen=True)
class AttentionMetadata:
    """The model's per-step attention input; built once, shared by all layers."""

    num_tokens: int
    layers: tuple[KindBatch, ...]
    """Per layer, the batch of its kind (the same object for every layer of a kind)."""


def build_attention_metadata(
    chunks: Sequence[SeqChunk],
    *,
    layer_kinds: Sequence[str],
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> AttentionMetadata:
    """Index tensors and masks of one step, for rows packed in the order of ``chunks``.

    Args:
        chunks: the step's sequences, every ``q_len == 1`` chunk before every longer one.
        layer_kinds: per layer ``"full"`` or ``"sliding"`` (``ModelSpec.layer_kinds``).
        block_size: tokens per block of the full-attention pool.
        sliding_window: window ``W`` of the sliding layers (needed when any layer slides).
        dtype: dtype of the additive masks (the model's dtype).
        device: where the tensors go.
    """
    num_decode = next((i for i, c in enumerate(chunks) if c.q_len > 1), len(chunks))
    assert all(c.q_len > 1 for c in chunks[num_decode:]), "decodes must come first"
    builder = _Builder(chunks, num_decode, dtype)
    by_kind: dict[str, KindBatch] = {}
    if "full" in layer_kinds:
        by_kind["full"] = builder.full(block_size)
    if "sliding" in layer_kinds:
        assert sliding_window is not None, "sliding layers need a window"
        assert all(c.sliding_slot is not None for c in chunks), "sliding layers need a slot"
        by_kind["sliding"] = builder.sliding(sliding_window)
    by_kind = {k: _to_device(v, device) for k, v in by_kind.items()}
    return AttentionMetadata(
        num_tokens=builder.num_tokens, layers=tuple(by_kind[k] for k in layer_kinds)
    )


class _Builder:
    """CPU-side index arithmetic for one step (a handful of small tensors)."""

    def __init__(self, chunks: Sequence[SeqChunk], num_decode: int, dtype: torch.dtype) -> None:
        self.dec = chunks[:num_decode]
        self.pre = chunks[num_decode:]
        self.dtype = dtype
        self.num_decode = num_decode
        self.num_tokens = num_decode + sum(c.q_len for c in self.pre)
        self.max_q = max((c.q_len for c in self.pre), default=0)
        self.pad_index = self._pad_index()

    def _pad_index(self) -> torch.Tensor | None:
        if len(self.pre) <= 1:
            return None
        rows = [i * self.max_q + j for i, c in enumerate(self.pre) for j in range(c.q_len)]
        return torch.tensor(rows, dtype=torch.long)

    def full(self, bs: int) -> KindBatch:
        """Slot of position p: ``block_table[p // bs] * bs + p % bs``."""
        slots = [
            c.block_table[p // bs] * bs + p % bs
            for c in (*self.dec, *self.pre)
            for p in range(c.start_pos, c.start_pos + c.q_len)
        ]
        decode = None
        if self.dec:
            lens = [c.start_pos + 1 for c in self.dec]
            decode = self._decode_group(lens, _block_rows(self.dec, lens, bs), bs)
        prefill = None
        if self.pre:
            ends = [c.start_pos + c.q_len for c in self.pre]
            kv_index = _block_rows(self.pre, ends, bs)
            allowed = self._causal(kv_index.shape[1] * bs)
            prefill = self._prefill_group(kv_index, allowed)
        write = torch.tensor(slots, dtype=torch.long)
        return KindBatch(sliding=False, write_index=write, decode=decode, prefill=prefill)

    def sliding(self, w: int) -> KindBatch:
        """Ring entry of position p of the seq in slot s: ``s * w + p % w``."""
        write = [c.sliding_slot * w + c.start_pos % w for c in self.dec]
        decode = None
        if self.dec:
            lens = [min(c.start_pos + 1, w) for c in self.dec]
            slots = torch.tensor([[c.sliding_slot] for c in self.dec], dtype=torch.long)
            decode = self._decode_group(lens, slots, w)
        prefill = self._sliding_prefill(w) if self.pre else None
        write_index = torch.tensor(write, dtype=torch.long)
        return KindBatch(sliding=True, write_index=write_index, decode=decode, prefill=prefill)

    def _decode_group(self, lens: list[int], kv_index: torch.Tensor, unit: int) -> DecodeGroup:
        """Gathered length is ``n * unit``; a lone sequence is sliced instead of masked."""
        kv_len = kv_index.shape[1] * unit
        mask = None
        if len(lens) == 1:
            kv_len = lens[0]
        elif min(lens) < kv_len:
            keep = torch.arange(kv_len)[None, :] < torch.tensor(lens)[:, None]
            mask = _additive(keep[:, None, None, :], self.dtype)
        return DecodeGroup(len(lens), kv_index, kv_len, mask)

    def _causal(self, num_keys: int) -> torch.Tensor:
        """``[B, Q, L]``: query j of a chunk starting at s sees cached positions ``<= s + j``."""
        starts = torch.tensor([c.start_pos for c in self.pre])
        q_pos = starts[:, None] + torch.arange(self.max_q)[None, :]
        return torch.arange(num_keys)[None, None, :] <= q_pos[:, :, None]

    def _prefill_group(
        self, kv_index: torch.Tensor | None, allowed: torch.Tensor, **writes: torch.Tensor
    ) -> PrefillGroup:
        return PrefillGroup(
            row_start=self.num_decode,
            num_seqs=len(self.pre),
            max_q_len=self.max_q,
            pad_index=self.pad_index,
            kv_index=kv_index,
            mask=_additive(allowed[:, None], self.dtype),
            **writes,
        )

    def _sliding_prefill(self, w: int) -> PrefillGroup:
        """Keys = old ring entries (oldest first, right-padded) then the chunk's own tokens.

        ::

            keys of seq with chunk [s, s+C):  old: positions s-n_old .. s-1   (n_old = min(s, W-1))
                                              new: positions s .. s+C-1
            query s+j sees position k  iff  s+j-W < k <= s+j
        """
        n_old = [min(c.start_pos, w - 1) for c in self.pre]
        l_old = max(n_old)
        q = torch.arange(self.max_q)[None, :, None]
        o = torch.arange(l_old)[None, None, :]
        n_old_t = torch.tensor(n_old)[:, None, None]
        old_ok = (o < n_old_t) & (o - n_old_t > q - w)
        k = torch.arange(self.max_q)[None, None, :]
        new_ok = (k <= q) & (q - k < w)
        allowed = torch.cat([old_ok, new_ok.expand(len(self.pre), -1, -1)], dim=2)
        old_index = None
        if l_old:
            rows = [
                [
                    c.sliding_slot * w + (c.start_pos - n + i) % w if i < n else 0
                    for i in range(l_old)
                ]
                for c, n in zip(self.pre, n_old, strict=True)
            ]
            old_index = torch.tensor(rows, dtype=torch.long)
        src, dst, row = [], [], self.num_decode
        for c in self.pre:
            for p in range(max(c.start_pos, c.start_pos + c.q_len - w), c.start_pos + c.q_len):
                src.append(row + p - c.start_pos)
                dst.append(c.sliding_slot * w + p % w)
            row += c.q_len
        writes = {"write_src": torch.tensor(src), "write_dst": torch.tensor(dst)}
        return self._prefill_group(old_index, allowed, **writes)


def _block_rows(chunks: Sequence[SeqChunk], lens: list[int], bs: int) -> torch.Tensor:
    """``[B, n]`` block tables cut to the blocks holding ``lens`` tokens, right-padded with 0."""
    n = max(-(-length // bs) for length in lens)
    rows = [list(c.block_table[:n]) + [0] * (n - min(n, len(c.block_table))) for c in chunks]
    return torch.tensor(rows, dtype=torch.long)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere: SDPA adds it to the scores once, no bool conversion."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _to_device(batch: KindBatch, device: torch.device | str) -> KindBatch:
    def move(obj: object) -> object:
        if isinstance(obj, torch.Tensor):
            return obj.to(device, non_blocking=True)
        if isinstance(obj, DecodeGroup | PrefillGroup):
            return type(obj)(**{f: move(getattr(obj, f)) for f in obj.__dataclass_fields__})
        return obj

    return KindBatch(
        sliding=batch.sliding,
        write_index=move(batch.write_index),
        decode=move(batch.decode),
        prefill=move(batch.prefill),
    )


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    batch: KindBatch,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Store this step's K/V in ``cache`` and attend; returns ``[T, heads * head_dim]``.

    Args:
        q: ``[T, heads, head_dim]`` rotated queries (a view of the qkv projection).
        kv: ``[T, 2, kv_heads, head_dim]`` rotated keys and values (a view as well).
        cache: this layer's pool tensor, ``[units, unit_len, 2, kv_heads, head_dim]``.
        batch: the step's metadata for this layer's kind.
        scale: score scale (``head_dim ** -0.5``, or gemma's ``query_pre_attn_scalar ** -0.5``).
        softcap: gemma2-style attention logit soft-capping, None when off.
    """
    flat = cache.view(-1, *cache.shape[2:])
    td = batch.decode.num_seqs if batch.decode is not None else 0
    if batch.sliding:
        flat.index_copy_(0, batch.write_index, kv[:td])
    else:
        flat.index_copy_(0, batch.write_index, kv)
    parts = []
    if batch.decode is not None:
        parts.append(_decode(q[:td], cache, batch.decode, scale, softcap))
    if batch.prefill is not None:
        pre = batch.prefill
        if batch.sliding:
            parts.append(_prefill_sliding(q[td:], kv, flat, pre, scale, softcap))
            flat.index_copy_(0, pre.write_dst, kv.index_select(0, pre.write_src))
        else:
            keys = _gather_units(cache, pre.kv_index)
            parts.append(_prefill(q[td:], keys, pre, scale, softcap))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _gather_units(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` for ``index`` ``[B, n]`` -> ``[B, n * unit_len, 2, kv_heads, head_dim]``."""
    b = index.shape[0]
    return cache.index_select(0, index.view(-1)).view(b, -1, *cache.shape[2:])


def _decode(
    q: torch.Tensor, cache: torch.Tensor, g: DecodeGroup, scale: float, softcap: float | None
) -> torch.Tensor:
    """One query per sequence. The query heads sharing a KV head become that head's "query
    positions" (``[B, kv_heads, group, D]``), so GQA needs neither ``repeat_kv`` nor a copy."""
    b, h, d = q.shape
    keys = _gather_units(cache, g.kv_index)[:, : g.kv_len]
    kvh = keys.shape[3]
    out = _attend(q.view(b, kvh, h // kvh, d), keys, g.mask, scale, softcap)
    return out.reshape(b, h * d)


def _prefill(
    q: torch.Tensor, keys: torch.Tensor, g: PrefillGroup, scale: float, softcap: float | None
) -> torch.Tensor:
    """Chunks padded to ``[B, max_q_len]`` (a view when there is one), attended in one call."""
    tp, h, d = q.shape
    if g.pad_index is None:
        q_pad = q.view(1, tp, h, d)
    else:
        q_pad = q.new_zeros(g.num_seqs * g.max_q_len, h, d).index_copy_(0, g.pad_index, q)
        q_pad = q_pad.view(g.num_seqs, g.max_q_len, h, d)
    out = _attend(q_pad.transpose(1, 2), keys, g.mask, scale, softcap)
    out = out.transpose(1, 2).reshape(-1, h * d)
    return out if g.pad_index is None else out.index_select(0, g.pad_index)


def _prefill_sliding(
    q: torch.Tensor,
    kv: torch.Tensor,
    flat: torch.Tensor,
    g: PrefillGroup,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Keys = old ring entries + the chunk's own K/V, read before the chunk is stored."""
    new = kv[g.row_start :]
    if g.pad_index is None:
        new = new.unsqueeze(0)
    else:
        padded = new.new_zeros(g.num_seqs * g.max_q_len, *new.shape[1:])
        new = padded.index_copy_(0, g.pad_index, new).view(g.num_seqs, g.max_q_len, *new.shape[1:])
    if g.kv_index is not None:
        old = flat.index_select(0, g.kv_index.view(-1)).view(g.num_seqs, -1, *flat.shape[1:])
        new = torch.cat([old, new], dim=1)
    return _prefill(q, new, g, scale, softcap)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA of ``q`` ``[B, Hq, Lq, D]`` over ``keys`` ``[B, L, 2, kv_heads, D]`` (strided views)."""
    k = keys[:, :, 0].transpose(1, 2)
    v = keys[:, :, 1].transpose(1, 2)
    if softcap is None:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap_(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), softcap)
    if mask is not None:
        scores = scores + mask
    return torch.matmul(scores.softmax(dim=-1), v)
