"""Which KV blocks move where when the pool shrinks (pure, torch-free).

A shrink to ``N`` blocks keeps block ids ``[0, N)``. Every used block with an id ``>= N`` moves
to a free block below ``N``; its K/V is copied there (``KVCachePool.copy_blocks``) and the block
tables are rewritten, both between engine steps::

    before (N = 4):  ids   0  1  2  3 | 4  5  6
                     used  a  .  b  . | .  c  a'      (. = free)
    moves:           6 -> 1, 5 -> 3   (highest source to lowest free target)
    after:           ids   0  1  2  3
                     used  a  a' b  c

``ResizeResult`` is what one resize did, as logged and returned by the admin API.

The plan exists only when the used blocks fit (``num_used <= N``); making them fit (preempting
sequences) is the scheduler's decision, not this module's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvroom.errors import ConfigError


@dataclass(frozen=True)
class Migration:
    """The block moves of one shrink: ``moves[i] = (src, dst)``, ``src >= N > dst``."""

    num_blocks: int
    """The pool size after the shrink (``N``)."""
    moves: tuple[tuple[int, int], ...]

    @property
    def mapping(self) -> dict[int, int]:
        return dict(self.moves)

    def remap(self, table: Iterable[int]) -> list[int]:
        """A block table with every moved block replaced by its new id."""
        mapping = self.mapping
        return [mapping.get(b, b) for b in table]


def plan_migration(used: Iterable[int], free: Iterable[int], num_blocks: int) -> Migration:
    """Moves that vacate ids ``>= num_blocks``: highest used ids into the lowest free ids.

    Args:
        used: ids of every block in some table.
        free: ids of every free block.
        num_blocks: the size to shrink to.

    Raises:
        ValueError: more blocks are used than ``num_blocks`` holds (preempt first).
    """
    used_ids = set(used)
    if len(used_ids) > num_blocks:
        raise ValueError(
            f"plan_migration: {len(used_ids)} blocks are in use, more than the {num_blocks} "
            "a shrink keeps; preempt sequences first"
        )
    sources = sorted((b for b in used_ids if b >= num_blocks), reverse=True)
    targets = sorted(b for b in free if b < num_blocks)[: len(sources)]
    assert len(targets) == len(sources), "free and used blocks do not add up"
    return Migration(num_blocks, tuple(zip(sources, targets, strict=True)))


def remap_tables(tables: Mapping[int, list[int]], migration: Migration) -> dict[int, list[int]]:
    """Every table of ``tables`` (seq id -> blocks) with ``migration`` applied."""
    return {seq_id: migration.remap(table) for seq_id, table in tables.items()}


@dataclass(frozen=True)
class PoolResize:
    """What the scheduler did to fit a new pool size; the engine copies ``moves`` next."""

    from_blocks: int
    to_blocks: int
    moves: tuple[tuple[int, int], ...] = ()
    """(src, dst) block copies, every src >= to_blocks (a shrink only)."""
    preempted: tuple[int, ...] = ()
    """Sequences that lost their KV because the used blocks did not fit (newest first)."""


@dataclass(frozen=True)
class ResizeResult:
    """One live resize of the KV pool, as logged and returned by the admin API."""

    from_blocks: int
    to_blocks: int
    num_moved_blocks: int
    """Blocks whose K/V was copied to a lower id (a shrink)."""
    num_preempted: int
    """Sequences preempted (to be recomputed) because the used blocks did not fit."""
    seconds: float

    @classmethod
    def of(cls, done: PoolResize, seconds: float) -> ResizeResult:
        return cls(done.from_blocks, done.to_blocks, len(done.moves), len(done.preempted), seconds)


def check_reserve(num_blocks: int, max_num_blocks: int) -> None:
    """Raise ``ConfigError`` when a resize would go past the address space reserved."""
    if num_blocks > max_num_blocks:
        raise ConfigError(
            f"kvcache_num_blocks: {num_blocks} is above the {max_num_blocks} blocks of address "
            "space reserved at start-up; restart with a larger --kvcache-max-blocks (or "
            "--kvcache-num-blocks) to go higher"
        )
