"""The paged KV pool: every byte of KV the runtime uses, on the device, resizable in place.

Layout: one store per KV group (``ModelSpec.kv_groups``: layers of one kind and one entry
shape ``E = [entries, num_kv_heads, head_dim]``; entries 2 = K at index 0, V at index 1, so a
token's K and V are stored by one ``index_copy_``; entries 1 = K=V, only V is stored)::

    full group     per layer [num_blocks, block_size, *E]   (kv_pages.BlockStore, resizable)
    sliding group  [group_layers, num_sliding_slots, sliding_window, *E]

    full:    position p of a sequence -> block block_table[p // block_size], row p % block_size
    sliding: position p of the sequence in slot s -> ring row p % sliding_window of slot s

Every full group shares the block dimension (block b of a sequence is row b of each), so a
resize or a migration applies to every full group alike. A layer that shares an earlier layer's
KV (Gemma 4 ``num_kv_shared_layers``) gets that layer's tensor and owns no bytes.

A sliding layer whose window covers ``max_seq_len`` is stored (and run) as a full layer
(``ModelSpec.layer_kinds``). The pool is zero-filled: masked-out keys still flow through
``softmax(...) @ V`` with weight 0, and ``0 * NaN`` from uninitialised memory would be NaN.

On CPU the full layers live in an anonymous ``mmap`` that reserves address space for
``max_num_blocks`` blocks (``kv_pages.MappedBlockStore``); the kernel zeroes it page by page,
and a background thread makes every committed page resident with
``madvise(MADV_POPULATE_WRITE)`` (``start_populating``, called after the first step), which
leaves contents alone and so is safe while the engine already writes K/V. Start-up thus does
not wait for a multi-GiB memset (``torch.zeros`` of the default 2.8 GiB pool: 0.8 s here, 2-4 s
on a busy machine), and decode steps do not pay page faults either: left to first touch, a
32-sequence decode step's K/V stores measured 200+ us per layer instead of 40 us.

Live resize (``resize``): the full-attention pool takes any size up to ``max_num_blocks``; the
layer tensors the model holds stay the same objects (``kv_pages`` says how, per device). The
engine moves K/V out of the blocks a shrink removes (``copy_blocks``) before shrinking, between
steps. Sliding-window rings are one per seat (``num_sliding_slots`` = batch size), not per
block: a resize leaves them as they are.

int8/int4 KV (``kv_codec``): the tensors are ``uint8`` and a row of ``hd`` values becomes
``R = kv_codec.row_bytes(hd)`` bytes, values then their scale (``models/kv_quant.py``),
so copy-on-write, migration and resize move scales with their blocks by moving bytes.

Bytes, exactly the planner's formula (per group: ``e`` entries, ``kvh`` kv heads, ``hd x b``
bytes per row, ``R`` for int8/int4; ``plan/kv.py``)::

    nbytes = sum over full groups    layers x num_blocks        x block_size     x e x kvh x hd x b
           + sum over sliding groups layers x num_sliding_slots x sliding_window x e x kvh x hd x b
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvroom.engine.kv import pages as kv_pages
from kvroom.engine.kv.pages import BlockStore, make_block_store, zeros_lazy
from kvroom.errors import ConfigError
from kvroom.model_spec import KVGroup, LayerKind, ModelSpec
from kvroom.models.kv_quant import KVCodec


class KVCachePool:
    """Per-layer tensors over the full-attention block stores and the sliding rings (one per
    KV group)."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        num_blocks: int,
        block_size: int,
        max_seq_len: int,
        num_sliding_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_num_blocks: int | None = None,
        backend: str | None = None,
        kv_codec: KVCodec | None = None,
    ) -> None:
        """Allocate the pool.

        Args:
            spec: the model's shapes.
            num_blocks: blocks of the full-attention pool now.
            block_size: tokens per block.
            max_seq_len: longest sequence served; decides which sliding layers keep a ring.
            num_sliding_slots: concurrent sequences the rings hold (the max batch size).
            dtype: KV dtype.
            device: where the pool lives.
            max_num_blocks: the largest size ``resize`` may reach (address space reserved on
                CPU); default ``num_blocks``.
            backend: ``"mapped"`` or ``"copy"`` (``kv_pages``); default by device.
            kv_codec: int8/int4 rows (``dtype`` is then ``uint8``); None for float KV.

        Raises:
            ConfigError: a count is not positive, or ``max_num_blocks < num_blocks``.
        """
        max_num_blocks = num_blocks if max_num_blocks is None else max_num_blocks
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if value <= 0:
                raise ConfigError(f"KVCachePool.{name}: must be > 0, got {value}")
        if max_num_blocks < num_blocks:
            raise ConfigError(
                f"KVCachePool.max_num_blocks: must be >= num_blocks ({num_blocks}), "
                f"got {max_num_blocks}"
            )
        self.layer_kinds: tuple[LayerKind, ...] = spec.layer_kinds(max_seq_len)
        self.spec_layer_kv = spec.layer_kv
        self.block_size = block_size
        self.max_num_blocks = max_num_blocks
        self.num_sliding_slots = num_sliding_slots
        self.sliding_window = spec.sliding_window if "sliding" in self.layer_kinds else None
        if self.sliding_window is not None and num_sliding_slots <= 0:
            raise ConfigError(
                f"KVCachePool.num_sliding_slots: must be > 0 for sliding layers, "
                f"got {num_sliding_slots}"
            )
        self.groups: tuple[KVGroup, ...] = spec.kv_groups(max_seq_len)
        self.kv_codec = kv_codec
        """How int8/int4 rows are encoded; None: the pool holds ``dtype`` values."""
        dtype = dtype if kv_codec is None else torch.uint8
        full_groups = [g for g in self.groups if g.kind == "full"]
        self._stores: list[BlockStore] = [
            make_block_store(
                len(g.layers),
                self._entry(g),
                block_size=block_size,
                num_blocks=num_blocks,
                max_num_blocks=max_num_blocks,
                dtype=dtype,
                device=device,
                backend=backend,
            )
            for g in full_groups
        ]
        """Full-attention groups, one store each (all share the block ids)."""
        ring = (num_sliding_slots, self.sliding_window or 0)
        self._rings: list[torch.Tensor] = [
            zeros_lazy((len(g.layers), *ring, *self._entry(g)), dtype, device)
            for g in self.groups
            if g.kind == "sliding"
        ]
        self._num_blocks = num_blocks
        self._populating: kv_pages.Populator | None = None
        self._populate_started = False
        self.layers: list[torch.Tensor] = self._layer_views()
        """Per layer its ``[units, unit_len, 2, kv_heads, head_dim]`` tensor (model input).
        The objects never change; a resize changes their first dimension."""

    def _entry(self, g: KVGroup) -> tuple[int, int, int]:
        """One position's shape in a group: ``[entries, kv_heads, head_dim or row bytes]``."""
        row = g.head_dim if self.kv_codec is None else self.kv_codec.row_bytes(g.head_dim)
        return (g.num_entries, g.num_kv_heads, row)

    def _layer_views(self) -> list[torch.Tensor]:
        views: dict[int, torch.Tensor] = {}
        stores, rings = iter(self._stores), iter(self._rings)
        for group in self.groups:
            tensors = next(stores).layers if group.kind == "full" else list(next(rings))
            views.update(zip(group.layers, tensors, strict=True))
        for group in self.groups:
            for i in group.shared_layers:
                source = self.spec_layer_kv[i].kv_source
                assert source is not None
                views[i] = views[source]
        return [views[i] for i in range(len(self.layer_kinds))]

    @property
    def full_tensors(self) -> list[torch.Tensor]:
        """Every full-attention layer's tensor; dimension 0 of each is the block dimension."""
        return [t for store in self._stores for t in store.layers]

    @property
    def num_blocks(self) -> int:
        """Blocks of the full-attention pool now."""
        return self._num_blocks

    @property
    def num_tokens(self) -> int:
        """Token capacity of the full-attention pool."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs across every full-attention layer."""
        return sum(s.num_layers * s.block_bytes for s in self._stores)

    def nbytes(self) -> int:
        """Bytes the pool holds now: committed full-attention blocks plus the rings."""
        return sum(s.nbytes() for s in self._stores) + sum(t.nbytes for t in self._rings)

    # -- resizing --------------------------------------------------------------------------

    def copy_blocks(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each (src, dst) block's K/V in every full-attention layer (a migration)."""
        for store in self._stores:
            store.copy_blocks(moves)

    def resize(self, num_blocks: int) -> None:
        """Change the full-attention pool to ``num_blocks`` blocks in place.

        Blocks below both sizes keep their contents; blocks a grow adds read as zeros (on CPU,
        but for the part of a page they share with kept blocks, which holds earlier K/V, as a
        reused block does); on CPU a shrink returns the removed blocks' pages to the kernel
        before returning.

        Raises:
            ConfigError: ``num_blocks`` is not in ``[1, max_num_blocks]``.
        """
        if not 0 < num_blocks <= self.max_num_blocks:
            raise ConfigError(
                f"kvcache_num_blocks: {num_blocks} is outside [1, {self.max_num_blocks}], the "
                "address space reserved at start-up; restart with a larger "
                "--kvcache-max-blocks (or --kvcache-num-blocks) to go higher"
            )
        restart = self._stop_populating()
        for store in self._stores:
            store.resize(num_blocks)
        self._num_blocks = num_blocks
        if restart:
            self._populating = self._start_populator()

    # -- residency -------------------------------------------------------------------------

    def start_populating(self) -> None:
        """Start faulting the CPU pool's committed pages in on a background thread (once; a
        no-op on CUDA). The runner calls it after its first step, so load-to-first-token
        does not share the CPU with it."""
        if not self._populate_started:
            self._populate_started = True
            self._populating = self._start_populator()

    @property
    def populated(self) -> bool:
        """True once every committed page is resident (always on a non-CPU device)."""
        populating = self._populating
        return self._populate_started and (populating is None or populating.done)

    def touch(self) -> None:
        """Return once every committed page is resident (the profiling pass counts resident
        bytes). Contents are unchanged."""
        self.start_populating()
        if self._populating is None:  # not a CPU pool: allocated resident
            return
        self._populating.join()
        if not self._populating.populated:
            for t in self._resident_tensors():
                t.view(-1).view(torch.uint8)[::4096].add_(0)  # one byte per page, unchanged

    def _resident_tensors(self) -> list[torch.Tensor]:
        return [
            t for t in (*self.full_tensors, *self._rings) if t.device.type == "cpu" and t.nbytes
        ]

    def _start_populator(self) -> kv_pages.Populator | None:
        ranges = [kv_pages.tensor_range(t) for t in self._resident_tensors()]
        return kv_pages.populate_in_background(ranges, keep_alive=self)

    def _stop_populating(self) -> bool:
        """Stop the fault-in thread (a shrink must not fault released pages back in);
        True if one had been started, so the caller restarts it over the new size."""
        if self._populating is not None:
            self._populating.stop()
        return self._populate_started
