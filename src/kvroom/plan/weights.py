"""Bytes of the weights, from a parameter count read off the checkpoint's headers."""

from __future__ import annotations

from kvroom.units import DTYPE_BYTES, cdiv


def weight_bytes(num_parameters: int, dtype: str, tensor_parallel_size: int = 1) -> int:
    """num_parameters x dtype_bytes / tp (rounded up): the weights one rank holds.

    ``num_parameters`` counts tied embeddings once (the LM head shares the embedding).
    Sharding is taken as even, which slightly under-counts replicated norms (a few KiB).
    """
    return cdiv(num_parameters * DTYPE_BYTES[dtype], tensor_parallel_size)
