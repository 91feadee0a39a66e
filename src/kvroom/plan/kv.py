"""Bytes of the paged KV cache: one block of the full-attention pool, and the sliding slots.

The pool keeps one tensor per KV group (``ModelSpec.kv_groups``): layers of one kind and one
entry shape. A layer stores ``entries x ceil(kv_heads/tp) x tp x head_dim`` values per token
(entries = 2 for K and V, 1 when K=V); a layer that shares an earlier layer's KV stores none.

int8/int4 KV: each (token, kv head) row of K or V is its packed values then 4 bytes of scale
(int8: a float32 scale; int4: a float16 scale and min; ``units.kv_row_bytes``: ``head_dim + 4``,
``head_dim / 2 + 4``), so a block's bytes count both and the scales move with the block
wherever its bytes go (copy-on-write, resize, migration).
"""

from __future__ import annotations

from kvroom.model_spec import KVGroup, ModelSpec
from kvroom.units import cdiv, kv_row_bytes, kv_scale_row_bytes


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one rank stores: ceil(kv_heads / tp). With kv_heads < tp or not divisible,
    heads are replicated, so a rank may hold more than kv_heads / tp."""
    return cdiv(num_kv_heads, tensor_parallel_size)


def group_bytes_per_token_per_layer(
    group: KVGroup, kv_dtype: str, tensor_parallel_size: int = 1
) -> int:
    """One token in one layer of ``group``, over all ranks:
    entries x ceil(kv_heads / tp) x tp x row bytes (``head_dim x dtype_bytes``, or values +
    scale for int8/int4)."""
    heads = kv_heads_per_rank(group.num_kv_heads, tensor_parallel_size) * tensor_parallel_size
    return group.num_entries * heads * kv_row_bytes(kv_dtype, group.head_dim)


def kv_bytes_per_token_per_layer(
    spec: ModelSpec, kv_dtype: str, tensor_parallel_size: int = 1
) -> int:
    """K and V of one token in one layer of ``spec``'s uniform shape, over all ranks:
    2 x ceil(kv_heads / tp) x tp x row bytes."""
    heads = kv_heads_per_rank(spec.num_kv_heads, tensor_parallel_size) * tensor_parallel_size
    return 2 * heads * kv_row_bytes(kv_dtype, spec.head_dim)


def kv_bytes_per_block(
    spec: ModelSpec, *, max_seq_len: int, block_size: int, kv_dtype: str, tensor_parallel_size: int
) -> int:
    """Sum over full-attention groups: layers x block_size x bytes per token per layer."""
    return sum(
        len(g.layers)
        * block_size
        * group_bytes_per_token_per_layer(g, kv_dtype, tensor_parallel_size)
        for g in spec.kv_groups(max_seq_len)
        if g.kind == "full"
    )


def kv_scale_bytes_per_block(
    spec: ModelSpec, *, max_seq_len: int, block_size: int, kv_dtype: str, tensor_parallel_size: int
) -> int:
    """Of ``kv_bytes_per_block``, the scales (0 unless int8/int4): per full group
    layers x block_size x entries x ceil(kv_heads / tp) x tp x 4."""
    return sum(
        len(g.layers)
        * block_size
        * g.num_entries
        * kv_heads_per_rank(g.num_kv_heads, tensor_parallel_size)
        * tensor_parallel_size
        * kv_scale_row_bytes(kv_dtype)
        for g in spec.kv_groups(max_seq_len)
        if g.kind == "full"
    )


def sliding_window_bytes(
    spec: ModelSpec, *, max_seq_len: int, batch_size: int, kv_dtype: str, tensor_parallel_size: int
) -> int:
    """KV of the sliding-window layers, a constant: each of batch_size sequences keeps
    sliding_window tokens per sliding layer, whatever the pool size.

    sum over sliding groups: layers x batch_size x sliding_window x bytes per token per layer
    """
    groups = [g for g in spec.kv_groups(max_seq_len) if g.kind == "sliding"]
    if not groups:
        return 0
    assert spec.sliding_window is not None  # a layer is "sliding" only when a window is set
    return sum(
        len(g.layers)
        * batch_size
        * spec.sliding_window
        * group_bytes_per_token_per_layer(g, kv_dtype, tensor_parallel_size)
        for g in groups
    )


def describe_kv_groups(spec: ModelSpec, *, max_seq_len: int) -> tuple[str, ...]:
    """One line per pool tensor, for the plan table (``KVGroup.describe``)."""
    return tuple(g.describe() for g in spec.kv_groups(max_seq_len))
