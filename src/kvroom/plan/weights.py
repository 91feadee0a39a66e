"""Bytes of the weights as loaded: a parameter count in the model dtype, or the resident bytes
per kind of tensor where the weights stay quantized (read off the checkpoint's headers)."""

from __future__ import annotations

from collections.abc import Mapping

from kvroom.units import DTYPE_BYTES, cdiv


def weight_bytes(
    num_parameters: int,
    dtype: str,
    tensor_parallel_size: int = 1,
    weight_types: Mapping[str, int] | None = None,
) -> int:
    """The weights one rank holds: ``sum(weight_types)`` when given (quantized tensors count
    their values, scales and mins), else ``num_parameters x dtype_bytes``; over tp, rounded up.

    ``num_parameters`` counts tied embeddings once (the LM head shares the embedding).
    Sharding is taken as even, which slightly under-counts replicated norms (a few KiB).
    """
    total = sum(weight_types.values()) if weight_types else num_parameters * DTYPE_BYTES[dtype]
    return cdiv(total, tensor_parallel_size)
