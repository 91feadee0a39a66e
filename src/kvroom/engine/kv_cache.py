"""The paged KV pool: every byte of KV the runtime will ever use, allocated once on the device.

Layout: one tensor per KV group (``ModelSpec.kv_groups``: layers of one kind and one entry
shape ``E = [entries, num_kv_heads, head_dim]``; entries 2 = K at index 0, V at index 1, so a
token's K and V are stored by one ``index_copy_``; entries 1 = K=V, only V is stored)::

    full group     [group_layers, num_blocks,        block_size,     *E]
    sliding group  [group_layers, num_sliding_slots, sliding_window, *E]

    full:    position p of a sequence -> block block_table[p // block_size], row p % block_size
    sliding: position p of the sequence in slot s -> ring row p % sliding_window of slot s

Every full group shares the block dimension (block b of a sequence is row b of each). A layer
that shares an earlier layer's KV (Gemma 4 ``num_kv_shared_layers``) gets that layer's view and
owns no bytes.

A sliding layer whose window covers ``max_seq_len`` is stored (and run) as a full layer
(``ModelSpec.layer_kinds``). The pool is zero-filled: masked-out keys still flow through
``softmax(...) @ V`` with weight 0, and ``0 * NaN`` from uninitialised memory would be NaN.

On CPU the zeros come from an anonymous ``mmap`` (``zeros_lazy``), which the kernel zeroes
page by page, and a background thread makes every page resident with
``madvise(MADV_POPULATE_WRITE)`` (``populate_in_background``, started after the first step),
which leaves contents alone and so is safe while the engine already writes K/V. Start-up thus
does not wait for a multi-GiB memset (``torch.zeros`` of the default 2.8 GiB pool: 0.8 s
here, 2-4 s on a busy machine), and decode steps do not pay page faults either: left to first
touch, a 32-sequence decode step's K/V stores measured 200+ us per layer instead of 40 us.

Bytes, exactly the planner's formula (per group: ``e`` entries, ``kvh`` kv heads, ``hd`` head
dim; ``plan/kv.py``)::

    nbytes = sum over full groups    layers x num_blocks        x block_size     x e x kvh x hd x b
           + sum over sliding groups layers x num_sliding_slots x sliding_window x e x kvh x hd x b
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import threading

import torch

from kvroom.errors import ConfigError
from kvroom.model_spec import KVGroup, LayerKind, ModelSpec


class KVCachePool:
    """Per-layer views over preallocated tensors (one per KV group)."""

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
    ) -> None:
        """Allocate the pool.

        Args:
            spec: the model's shapes.
            num_blocks: blocks of the full-attention pool.
            block_size: tokens per block.
            max_seq_len: longest sequence served; decides which sliding layers keep a ring.
            num_sliding_slots: concurrent sequences the rings hold (the max batch size).
            dtype: KV dtype.
            device: where the pool lives.

        Raises:
            ConfigError: a count is not positive.
        """
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if value <= 0:
                raise ConfigError(f"KVCachePool.{name}: must be > 0, got {value}")
        self.layer_kinds: tuple[LayerKind, ...] = spec.layer_kinds(max_seq_len)
        self.spec_layer_kv = spec.layer_kv
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_sliding_slots = num_sliding_slots
        self.sliding_window = spec.sliding_window if "sliding" in self.layer_kinds else None
        if self.sliding_window is not None and num_sliding_slots <= 0:
            raise ConfigError(
                f"KVCachePool.num_sliding_slots: must be > 0 for sliding layers, "
                f"got {num_sliding_slots}"
            )
        self.groups: tuple[KVGroup, ...] = spec.kv_groups(max_seq_len)
        ring = (num_sliding_slots, self.sliding_window or 0)
        self._tensors: list[torch.Tensor] = [
            zeros_lazy(
                (
                    len(g.layers),
                    *((num_blocks, block_size) if g.kind == "full" else ring),
                    g.num_entries,
                    g.num_kv_heads,
                    g.head_dim,
                ),
                dtype,
                device,
            )
            for g in self.groups
        ]
        self._populating: _Populator | None = None
        self._populate_started = False
        self.layers: list[torch.Tensor] = self._layer_views()
        """Per layer its ``[units, unit_len, entries, kv_heads, head_dim]`` view (model input);
        a layer sharing KV gets its source's view."""

    def _layer_views(self) -> list[torch.Tensor]:
        views: dict[int, torch.Tensor] = {}
        for group, tensor in zip(self.groups, self._tensors, strict=True):
            views.update(zip(group.layers, tensor, strict=True))
        for group in self.groups:
            for i in group.shared_layers:
                source = self.spec_layer_kv[i].kv_source
                assert source is not None
                views[i] = views[source]
        return [views[i] for i in range(len(self.layer_kinds))]

    def start_populating(self) -> None:
        """Start faulting the CPU pool's pages in on a background thread (once; a no-op on
        CUDA). The runner calls it after its first step, so load-to-first-token does not
        share the CPU with it."""
        if not self._populate_started:
            self._populate_started = True
            self._populating = populate_in_background(self._tensors)

    def touch(self) -> None:
        """Return once every page of the pool is resident (the profiling pass counts resident
        bytes). Contents are unchanged."""
        self.start_populating()
        if self._populating is None:  # not a CPU pool: allocated resident
            return
        self._populating.join()
        if not self._populating.populated:
            for t in self._tensors:
                t.view(-1).view(torch.uint8)[::4096].add_(0)  # one byte per page, unchanged

    @property
    def full_tensors(self) -> list[torch.Tensor]:
        """The full-attention groups' tensors; dimension 1 of each is the block dimension."""
        return [t for g, t in zip(self.groups, self._tensors, strict=True) if g.kind == "full"]

    def nbytes(self) -> int:
        """Bytes held by the pool: the sum of its tensors' ``nbytes``."""
        return sum(t.nbytes for t in self._tensors)

    @property
    def num_tokens(self) -> int:
        """Token capacity of the full-attention pool."""
        return self.num_blocks * self.block_size


def zeros_lazy(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zero tensor; on CPU backed by an anonymous page-aligned ``mmap`` filled on first touch."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


MADV_POPULATE_WRITE = 23
"""Linux >= 5.14: fault pages in writable, as a write would, without writing."""
POPULATE_CHUNK_BYTES = 4 * 2**20
"""Small enough that the address-space lock is never held long against the allocator."""


class _Populator(threading.Thread):
    """Faults the CPU pool's pages in, chunk by chunk, off the caller's thread (ctypes calls
    release the GIL). ``populated`` is False where the kernel does not support it."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__(name="kvroom-kv-populate", daemon=True)
        self.tensors = tensors  # held so the mappings outlive the thread
        self.populated = True

    def run(self) -> None:
        with contextlib.suppress(OSError):  # lowest priority: fill idle CPU, not steal it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for t in self.tensors:
            start, nbytes = t.data_ptr(), t.nbytes
            for offset in range(0, nbytes, POPULATE_CHUNK_BYTES):
                size = min(POPULATE_CHUNK_BYTES, nbytes - offset)
                if madvise(start + offset, size, MADV_POPULATE_WRITE) != 0:
                    self.populated = False
                    return


def populate_in_background(tensors: list[torch.Tensor]) -> _Populator | None:
    """Start making the pages of CPU ``zeros_lazy`` tensors resident; None elsewhere."""
    cpu = [t for t in tensors if t.device.type == "cpu" and t.nbytes > 0]
    if not cpu:
        return None
    thread = _Populator(cpu)
    thread.start()
    return thread
