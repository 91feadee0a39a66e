"""Index arithmetic of one step: per-sequence chunks -> ``AttentionMetadata``.

Runs on the CPU over a handful of small tensors, once per step, then moves them to the device;
the layer loop only consumes them. The storage layout the indices address is drawn in
``attention.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from kvroom.models.attention import AttentionMetadata, DecodeGroup, KindBatch
from kvroom.models.kv_quant import KVCodec
from kvroom.models.prefill_attention import PrefillChunk, PrefillGroup


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


def build_attention_metadata(
    chunks: Sequence[SeqChunk],
    *,
    layer_kinds: Sequence[str],
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_codec: KVCodec | None = None,
) -> AttentionMetadata:
    """Index tensors and masks of one step, for rows packed in the order of ``chunks``.

    Args:
        chunks: the step's sequences, every ``q_len == 1`` chunk before every longer one.
        layer_kinds: per layer ``"full"`` or ``"sliding"`` (``ModelSpec.layer_kinds``).
        block_size: tokens per block of the full-attention pool.
        sliding_window: window ``W`` of the sliding layers (needed when any layer slides).
        dtype: dtype of the additive masks (the model's dtype).
        device: where the tensors go.
        kv_codec: the pool's int8/int4 encoding (``KindBatch.kv_codec``); None for float KV.
    """
    num_decode = next((i for i, c in enumerate(chunks) if c.q_len > 1), len(chunks))
    assert all(c.q_len > 1 for c in chunks[num_decode:]), "decodes must come first"
    builder = _Builder(chunks, num_decode, dtype)
    by_kind: dict[str, KindBatch] = {}
    if "full" in layer_kinds:
        assert all(len(c.block_table) * block_size >= c.start_pos + c.q_len for c in chunks), (
            "a block table does not cover its chunk"
        )
        by_kind["full"] = builder.full(block_size)
    if "sliding" in layer_kinds:
        assert sliding_window is not None, "sliding layers need a window"
        assert all(c.sliding_slot is not None for c in chunks), "sliding layers need a slot"
        by_kind["sliding"] = builder.sliding(sliding_window)
    by_kind = {k: replace(_to_device(v, device), kv_codec=kv_codec) for k, v in by_kind.items()}
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

    def _equal_chunks(self) -> bool:
        """Fresh chunks are attended in one SDPA call only when they are equally long: their
        packed rows are then the ``[B, max_q_len]`` layout itself, viewed, not copied (the
        profiling pass's ``prefill_fresh`` step). Ragged ones take the per-chunk path: padded,
        a long prompt among 24 two-token ones would hold 32 x 256 rows for 280."""
        return all(c.q_len == self.max_q for c in self.pre)

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
            chunks = {
                "starts": torch.tensor([c.start_pos for c in self.pre], dtype=torch.long),
                "q_lens": torch.tensor([c.q_len for c in self.pre], dtype=torch.long),
            }
            if all(c.start_pos == 0 for c in self.pre) and self._equal_chunks():
                prefill = self._prefill_group(kv_index, fresh=True, **chunks)
            else:
                prefill = self._prefill_group(kv_index, chunks=self._full_chunks(bs), **chunks)
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
        mask, start = None, None
        if len(lens) == 1:
            kv_len = lens[0]
            units = kv_index[0].tolist()
            if units == list(range(units[0], units[0] + len(units))):
                start = units[0]
        elif min(lens) < kv_len:
            keep = torch.arange(kv_len)[None, :] < torch.tensor(lens)[:, None]
            mask = _additive(keep[:, None, None, :], self.dtype)
        keys = torch.tensor(lens)
        ones = torch.ones(len(lens), dtype=torch.int64)
        return DecodeGroup(len(lens), kv_index, kv_len, mask, start, keys, keys - 1, ones)

    def _full_chunks(self, bs: int) -> tuple[PrefillChunk, ...]:
        """Each chunk with the blocks of its own context (for the paths that gather)."""
        chunks, row = [], 0
        for c in self.pre:
            end = c.start_pos + c.q_len
            index = torch.tensor([c.block_table[: -(-end // bs)]], dtype=torch.long)
            chunks.append(PrefillChunk(row, c.q_len, c.start_pos, end, index))
            row += c.q_len
        return tuple(chunks)

    def _prefill_group(self, kv_index: torch.Tensor | None, **extra: Any) -> PrefillGroup:
        return PrefillGroup(
            row_start=self.num_decode,
            num_seqs=len(self.pre),
            max_q_len=self.max_q,
            kv_index=kv_index,
            **extra,
        )

    def _sliding_prefill(self, w: int) -> PrefillGroup:
        """Per chunk, keys = its old ring entries (oldest first) then its own tokens.

        ::

            keys of seq with chunk [s, s+C):  old: positions s-n_old .. s-1   (n_old = min(s, W-1))
                                              new: positions s .. s+C-1
            query s+j sees position k  iff  s+j-W < k <= s+j
        """
        chunks, row = [], 0
        for c in self.pre:
            n_old = min(c.start_pos, w - 1)
            old = [c.sliding_slot * w + (c.start_pos - n_old + i) % w for i in range(n_old)]
            index = torch.tensor([old], dtype=torch.long) if n_old else None
            chunks.append(PrefillChunk(row, c.q_len, c.start_pos, n_old + c.q_len, index, w))
            row += c.q_len
        src, dst, row = [], [], self.num_decode
        for c in self.pre:
            for p in range(max(c.start_pos, c.start_pos + c.q_len - w), c.start_pos + c.q_len):
                src.append(row + p - c.start_pos)
                dst.append(c.sliding_slot * w + p % w)
            row += c.q_len
        writes = {"write_src": torch.tensor(src), "write_dst": torch.tensor(dst)}
        return self._prefill_group(None, chunks=tuple(chunks), **writes)


def _block_rows(chunks: Sequence[SeqChunk], lens: list[int], bs: int) -> torch.Tensor:
    """``[B, n]`` block tables cut to the blocks holding ``lens`` tokens, right-padded with 0."""
    n = max(-(-length // bs) for length in lens)
    rows = [list(c.block_table[:n]) + [0] * (n - min(n, len(c.block_table))) for c in chunks]
    return torch.tensor(rows, dtype=torch.long)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere: SDPA adds it to the scores once, no bool conversion."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _to_device(batch: KindBatch, device: torch.device | str) -> KindBatch:
    """The same batch with its tensors on ``device`` (CPU: returned as is)."""
    if torch.device(device).type == "cpu":
        return batch

    def move(obj: object) -> object:
        if isinstance(obj, torch.Tensor):
            return obj.to(device, non_blocking=True)
        if isinstance(obj, DecodeGroup | PrefillGroup | PrefillChunk):
            return type(obj)(**{f: move(getattr(obj, f)) for f in obj.__dataclass_fields__})
        if isinstance(obj, tuple):
            return tuple(move(item) for item in obj)
        return obj

    return KindBatch(
        sliding=batch.sliding,
        write_index=move(batch.write_index),
        decode=move(batch.decode),
        prefill=move(batch.prefill),
    )
