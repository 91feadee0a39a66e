"""Bytes of the paged KV cache: one block of the full-attention pool, and the sliding slots."""

from __future__ import annotations

from kvroom.model_spec import ModelSpec
from kvroom.units import DTYPE_BYTES, cdiv


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one rank stores: ceil(kv_heads / tp). With kv_heads < tp or not divisible,
    heads are replicated, so a rank may hold more than kv_heads / tp."""
    return cdiv(num_kv_heads, tensor_parallel_size)


def kv_bytes_per_token_per_layer(
    spec: ModelSpec, kv_dtype: str, tensor_parallel_size: int = 1
) -> int:
    """K and V of one token in one layer, over all ranks:
    2 x ceil(kv_heads / tp) x tp x head_dim x dtype_bytes."""
    heads = kv_heads_per_rank(spec.num_kv_heads, tensor_parallel_size) * tensor_parallel_size
    return 2 * heads * spec.head_dim * DTYPE_BYTES[kv_dtype]


def kv_bytes_per_block(
    spec: ModelSpec, *, max_seq_len: int, block_size: int, kv_dtype: str, tensor_parallel_size: int
) -> int:
    """full_attention_layers x 2 x block_size x ceil(kv_heads/tp) x tp x head_dim x dtype_bytes."""
    layers = spec.num_full_layers(max_seq_len)
    return layers * block_size * kv_bytes_per_token_per_layer(spec, kv_dtype, tensor_parallel_size)


def sliding_window_bytes(
    spec: ModelSpec, *, max_seq_len: int, batch_size: int, kv_dtype: str, tensor_parallel_size: int
) -> int:
    """KV of the sliding-window layers, a constant: each of batch_size sequences keeps
    sliding_window tokens per sliding layer, whatever the pool size.

    sliding_layers x batch_size x sliding_window x (2 x ceil(kv_heads/tp) x tp x head_dim x bytes)
    """
    layers = spec.num_sliding_layers(max_seq_len)
    if layers == 0:
        return 0
    assert spec.sliding_window is not None  # a layer is "sliding" only when a window is set
    per_token = kv_bytes_per_token_per_layer(spec, kv_dtype, tensor_parallel_size)
    return layers * batch_size * spec.sliding_window * per_token
