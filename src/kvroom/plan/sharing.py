"""What shared blocks buy: concurrency when every sequence starts with the same prefix.

With prefix caching, ``S = P // B`` full blocks of a common ``P``-token prefix (a system
prompt) are held once, and every full-length sequence holds only its own remaining blocks::

    N = min(batch_size, (num_blocks - S) // (ceil(max_seq_len / B) - S))

``S`` is capped at ``ceil(max_seq_len / B) - 1``: the block of a sequence's last token is
always its own (that token is computed to get logits). Sliding-window layers keep a ring per
sequence that is never shared, so such models get no figure (prefix caching is off for them).
"""

from __future__ import annotations

from kvroom.errors import ConfigError
from kvroom.units import cdiv


def shared_prefix_concurrency(
    *, num_blocks: int, block_size: int, max_seq_len: int, batch_size: int, prefix_len: int
) -> int:
    """Full-length (``max_seq_len``) sequences the pool holds when all share ``prefix_len``
    leading tokens (formula in the module docstring).

    Raises:
        ConfigError: ``prefix_len`` is not in ``[0, max_seq_len]``.
    """
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int):
        raise ConfigError(f"shared prefix length: must be an int, got {prefix_len!r}")
    if not 0 <= prefix_len <= max_seq_len:
        raise ConfigError(
            f"shared prefix length: {prefix_len} is outside [0, max_seq_len={max_seq_len}]"
        )
    per_seq = cdiv(max_seq_len, block_size)
    shared = min(prefix_len // block_size, per_seq - 1)
    if num_blocks < per_seq:
        return 0
    return min(batch_size, (num_blocks - shared) // (per_seq - shared))


def shared_prefix_row(
    *,
    num_blocks: int,
    block_size: int,
    max_seq_len: int,
    batch_size: int,
    has_sliding_layers: bool,
) -> tuple[str, str]:
    """The plan table's line for a shared prefix of half ``max_seq_len`` (whole blocks)."""
    prefix_len = max_seq_len // 2 // block_size * block_size
    label = f"  with a shared prefix of {prefix_len} tokens"
    if has_sliding_layers:
        return label, "n/a (sliding-window layers: no prefix caching)"
    sizes = {"num_blocks": num_blocks, "block_size": block_size, "max_seq_len": max_seq_len}
    held = shared_prefix_concurrency(**sizes, batch_size=batch_size, prefix_len=prefix_len)
    pool = shared_prefix_concurrency(**sizes, batch_size=num_blocks, prefix_len=prefix_len)
    return label, str(held) if held == pool else f"{held} (batch_size; the pool holds {pool})"
