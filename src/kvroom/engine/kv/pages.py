"""Address space and pages of the KV pool: reserve once, commit and release blocks in place.

A ``BlockStore`` holds the full-attention tensors of one entry shape, ``[num_layers,
num_blocks, block_size, *entry]``, with the block dimension (dim 1) resizable. The model gets
one tensor object per layer (``layers``); a resize changes what those objects point at
(``Tensor.set_``), never the objects, so every reference the model or runner holds stays valid.

Two backends, chosen once per device::

    MappedBlockStore (CPU)   one anonymous mmap(MAP_NORESERVE) of max_num_blocks per layer:
                             layer l, block b at  base + (l * max_num_blocks + b) * block_bytes
                             grow:   blocks [old, new) join; pages faulted in on a background
                                     thread (MADV_POPULATE_WRITE, contents untouched)
                             shrink: pages of blocks [new, old) released (MADV_DONTNEED):
                                     resident memory drops at once; they read as zeros again
    CopyBlockStore (CUDA)    one tensor of exactly num_blocks per layer; a resize allocates the
                             new size, copies the kept blocks, points the layer object at it,
                             then frees the old one, layer by layer (peak: pool + one layer);
                             ``torch.cuda.empty_cache`` hands freed memory back to the driver

The CUDA design needs no driver binding (cuda-python's VMM would avoid the copy, at the price of
a dependency and code that cannot be tested on a CPU machine); it runs between engine steps, and
a resize copies at device bandwidth (a 2 GiB pool: a few ms on a current GPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import threading
from collections.abc import Sequence

import torch

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
"""Linux: reserve address space without committing swap or memory for it."""
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
MADV_POPULATE_WRITE = 23
"""Linux >= 5.14: fault pages in writable, as a write would, without writing."""
POPULATE_CHUNK_BYTES = 4 * 2**20
"""Small enough that the address-space lock is never held long against the allocator."""
PAGE_BYTES = mmap.PAGESIZE

Range = tuple[int, int]
"""(address, bytes) of a piece of a mapping."""


def _libc_madvise() -> ctypes._CFuncPtr:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def zeros_lazy(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zero tensor; on CPU backed by an anonymous page-aligned ``mmap`` filled on first touch."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    buf = mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class BlockStore:
    """Full-attention layers of one entry shape whose block count changes in place."""

    def __init__(
        self,
        num_layers: int,
        entry: tuple[int, ...],
        *,
        block_size: int,
        num_blocks: int,
        max_num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.block_shape = (block_size, *entry)
        self.num_blocks = num_blocks
        self.max_num_blocks = max_num_blocks
        self.dtype = dtype
        self.device = device
        self.block_bytes = math.prod(self.block_shape) * dtype.itemsize
        self.layers: list[torch.Tensor] = []
        """One tensor object per layer, ``[num_blocks, block_size, *entry]``."""

    def nbytes(self) -> int:
        """Committed bytes: ``num_layers x num_blocks x block_bytes``."""
        return self.num_layers * self.num_blocks * self.block_bytes

    def resize(self, num_blocks: int) -> None:
        """Make blocks ``[0, num_blocks)`` of every layer usable; contents below both sizes kept."""
        raise NotImplementedError

    def copy_blocks(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each ``src`` block's K/V into ``dst`` in every layer (``moves``: (src, dst))."""
        if not moves:
            return
        src = torch.tensor([s for s, _ in moves], device=self.device)
        dst = torch.tensor([d for _, d in moves], device=self.device)
        for layer in self.layers:
            raw = _raw(layer)
            raw.index_copy_(0, dst, raw.index_select(0, src))

    def ranges(self, start: int, stop: int) -> list[Range]:
        """Address ranges of blocks ``[start, stop)`` in each layer (CPU backends)."""
        return []

    def _point(
        self, layer: torch.Tensor, storage: torch.UntypedStorage, offset: int, num_blocks: int
    ) -> None:
        shape = (num_blocks, *self.block_shape)
        layer.set_(storage, offset, shape, torch.empty(shape, device="meta").stride())


class MappedBlockStore(BlockStore):
    """CPU: one reserved mapping; resizing commits or releases pages, nothing is copied."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        shape = (self.num_layers, self.max_num_blocks, *self.block_shape)
        self._reserved = zeros_lazy(shape, self.dtype, self.device)
        self._storage = self._reserved.untyped_storage()
        self.layers = [torch.empty(0, dtype=self.dtype) for _ in range(self.num_layers)]
        self._repoint()

    def resize(self, num_blocks: int) -> None:
        old, self.num_blocks = self.num_blocks, num_blocks
        self._repoint()
        if num_blocks < old:
            release_pages(self.ranges(num_blocks, old))

    def ranges(self, start: int, stop: int) -> list[Range]:
        base, per_layer = self._reserved.data_ptr(), self.max_num_blocks * self.block_bytes
        return [
            (base + layer * per_layer + start * self.block_bytes, (stop - start) * self.block_bytes)
            for layer in range(self.num_layers)
            if stop > start
        ]

    def _repoint(self) -> None:
        per_layer = self.max_num_blocks * math.prod(self.block_shape)
        for i, layer in enumerate(self.layers):
            self._point(layer, self._storage, i * per_layer, self.num_blocks)


class CopyBlockStore(BlockStore):
    """Any device: one tensor per layer, reallocated on resize (see the module docstring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        shape = (self.num_blocks, *self.block_shape)
        self.layers = [zeros_lazy(shape, self.dtype, self.device) for _ in range(self.num_layers)]

    def resize(self, num_blocks: int) -> None:
        kept = min(self.num_blocks, num_blocks)
        for layer in self.layers:
            new = zeros_lazy((num_blocks, *self.block_shape), self.dtype, self.device)
            new[:kept].copy_(layer[:kept])
            self._point(layer, new.untyped_storage(), 0, num_blocks)
            del new
        self.num_blocks = num_blocks
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def make_block_store(
    num_layers: int,
    entry: tuple[int, ...],
    *,
    block_size: int,
    num_blocks: int,
    max_num_blocks: int,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: str | None = None,
) -> BlockStore:
    """The store for ``device``: ``"mapped"`` on CPU, ``"copy"`` elsewhere (or as asked)."""
    device = torch.device(device)
    backend = backend or ("mapped" if device.type == "cpu" else "copy")
    cls = MappedBlockStore if backend == "mapped" else CopyBlockStore
    return cls(
        num_layers,
        entry,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_blocks=max_num_blocks,
        dtype=dtype,
        device=device,
    )


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 has no CPU index kernels; a same-width integer view moves the same bytes."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def page_inner(addr: int, nbytes: int) -> Range:
    """The whole pages inside ``[addr, addr + nbytes)``: a partly used page is never released."""
    start = -(-addr // PAGE_BYTES) * PAGE_BYTES
    stop = (addr + nbytes) // PAGE_BYTES * PAGE_BYTES
    return start, max(stop - start, 0)


def release_pages(ranges: list[Range]) -> None:
    """Give the pages of ``ranges`` back to the kernel (``MADV_DONTNEED``): resident memory
    drops now, and a later read sees zeros.

    Raises:
        OSError: the kernel refused (never expected on a private anonymous mapping).
    """
    madvise = _libc_madvise()
    for addr, nbytes in ranges:
        start, size = page_inner(addr, nbytes)
        if size and madvise(start, size, MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTNEED) of {size} bytes: {os.strerror(err)}")


class Populator(threading.Thread):
    """Faults pages in, chunk by chunk, off the caller's thread (ctypes calls release the GIL).

    ``populated`` is False where the kernel does not support it; ``stop()`` ends it early (a
    shrink stops it before releasing pages, so it cannot fault released pages back in).
    """

    def __init__(self, ranges: list[Range], keep_alive: object) -> None:
        super().__init__(name="kvroom-kv-populate", daemon=True)
        self.ranges = ranges
        self.keep_alive = keep_alive  # held so the mappings outlive the thread
        self.populated = True
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def run(self) -> None:
        with contextlib.suppress(OSError):  # lowest priority: fill idle CPU, not steal it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        madvise = _libc_madvise()
        for start, nbytes in self.ranges:
            for offset in range(0, nbytes, POPULATE_CHUNK_BYTES):
                if self._stop_event.is_set():
                    return
                size = min(POPULATE_CHUNK_BYTES, nbytes - offset)
                if madvise(start + offset, size, MADV_POPULATE_WRITE) != 0:
                    self.populated = False
                    return

    @property
    def done(self) -> bool:
        return not self.is_alive()


def tensor_range(t: torch.Tensor) -> Range:
    return t.data_ptr(), t.nbytes


def populate_in_background(ranges: list[Range], keep_alive: object) -> Populator | None:
    """Start making ``ranges`` (CPU mappings) resident; None when there is nothing to do."""
    ranges = [r for r in ranges if r[1] > 0]
    if not ranges:
        return None
    thread = Populator(ranges, keep_alive)
    thread.start()
    return thread
