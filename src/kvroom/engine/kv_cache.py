"""The paged KV pool: every byte of KV the runtime will ever use, allocated once on the device.

Layout (``E = [2, num_kv_heads, head_dim]``: K at index 0, V at index 1, so a token's K and V
are stored by one ``index_copy_``)::

    full layers     _full:    [num_full_layers,    num_blocks,        block_size,     *E]
    sliding layers  _sliding: [num_sliding_layers, num_sliding_slots, sliding_window, *E]

    full:    position p of a sequence -> block block_table[p // block_size], row p % block_size
    sliding: position p of the sequence in slot s -> ring row p % sliding_window of slot s

A sliding layer whose window covers ``max_seq_len`` is stored (and run) as a full layer
(``ModelSpec.layer_kinds``). The pool is zero-filled: masked-out keys still flow through
``softmax(...) @ V`` with weight 0, and ``0 * NaN`` from uninitialised memory would be NaN.

On CPU the zeros come from an anonymous ``mmap`` (``zeros_lazy``): the kernel hands out zero
pages on first touch, so start-up does not memset gigabytes (``torch.zeros`` of a 2.8 GiB pool
measured ~2 s) and the resident set grows only as blocks are used, never past ``nbytes``.

Bytes, exactly the planner's formula (``kvh`` = kv heads, ``hd`` = head dim)::

    nbytes = full_layers    x 2 x num_blocks        x block_size     x kvh x hd x dtype_bytes
           + sliding_layers x 2 x num_sliding_slots x sliding_window x kvh x hd x dtype_bytes
"""

from __future__ import annotations

import mmap

import torch

from kvroom.errors import ConfigError
from kvroom.model_spec import LayerKind, ModelSpec


class KVCachePool:
    """Per-layer views over two preallocated tensors (one per layer kind)."""

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
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_sliding_slots = num_sliding_slots
        self.sliding_window = spec.sliding_window if "sliding" in self.layer_kinds else None
        if self.sliding_window is not None and num_sliding_slots <= 0:
            raise ConfigError(
                f"KVCachePool.num_sliding_slots: must be > 0 for sliding layers, "
                f"got {num_sliding_slots}"
            )
        entry = (2, spec.num_kv_heads, spec.head_dim)
        n_full = self.layer_kinds.count("full")
        n_sliding = self.layer_kinds.count("sliding")
        self._full = zeros_lazy((n_full, num_blocks, block_size, *entry), dtype, device)
        ring = (num_sliding_slots, self.sliding_window or 0)
        self._sliding = zeros_lazy((n_sliding, *ring, *entry), dtype, device)
        self.layers: list[torch.Tensor] = self._layer_views()
        """Per layer its ``[units, unit_len, 2, kv_heads, head_dim]`` view (model input)."""

    def _layer_views(self) -> list[torch.Tensor]:
        full, sliding = iter(self._full), iter(self._sliding)
        return [next(full) if k == "full" else next(sliding) for k in self.layer_kinds]

    def touch(self) -> None:
        """Make every page of the pool resident (the profiling pass counts resident bytes)."""
        self._full.zero_()
        self._sliding.zero_()

    def nbytes(self) -> int:
        """Bytes held by the pool: the sum of its tensors' ``nbytes``."""
        return self._full.nbytes + self._sliding.nbytes

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
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
