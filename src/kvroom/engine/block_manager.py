"""Hands out the KV pool's blocks and sliding-window slots to sequences (torch-free).

The pool holds exactly ``num_blocks`` blocks of ``block_size`` tokens for every full-attention
layer. A sequence's block table maps its positions onto them::

    position p  ->  block_table[p // block_size], offset p % block_size

    tokens:  0 1 2 3 | 4 5 6 7 | 8 9
    table:   [  17   ,   3     ,  8  ]        (block_size = 4, 10 tokens -> 3 blocks)

Hybrid models (sliding-window layers) keep a fixed ring of the last ``window`` tokens per running
sequence instead of a growing table; those live in ``num_sliding_slots`` slots, one per running
sequence, assigned at the first allocation and returned on ``free``.

No prefix caching: every block belongs to at most one sequence, so a refcount is either 0 (free)
or 1 (in exactly one table), and the manager does not store one.

The pool may change size while sequences run: ``grow`` appends new ids to the free list;
``shrink`` vacates ids ``>= N`` by moving their sequences' entries to free low ids
(``pool_migration``) and returns the moves, whose K/V the engine copies. Shared blocks would
move the same way: one copy per block, every table that holds it rewritten.
"""

from __future__ import annotations

import heapq
from collections import deque

from kvroom.engine.pool_migration import Migration, plan_migration, remap_tables
from kvroom.errors import ConfigError
from kvroom.units import cdiv


class BlockManager:
    """Owns which block and which sliding slot belong to which sequence id.

    "Cannot allocate now" is an ordinary answer (``None``), never an exception: the scheduler
    reacts by chunking, waiting, or preempting.
    """

    def __init__(self, num_blocks: int, block_size: int, num_sliding_slots: int = 0) -> None:
        """
        Args:
            num_blocks: blocks in the pool (the artifact's ``kvcache_num_blocks``).
            block_size: tokens per block.
            num_sliding_slots: sliding-window slots (= max concurrent sequences), 0 when the
                model has no sliding layers.

        Raises:
            ConfigError: a size is not a positive int (``num_sliding_slots`` may be 0).
        """
        _check_count("num_blocks", num_blocks, minimum=1)
        _check_count("block_size", block_size, minimum=1)
        _check_count("num_sliding_slots", num_sliding_slots, minimum=0)
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.num_sliding_slots = num_sliding_slots
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._free_slots: list[int] = list(range(num_sliding_slots))  # a min-heap
        self._tables: dict[int, list[int]] = {}
        self._slots: dict[int, int] = {}

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free_blocks)

    @property
    def num_free_sliding_slots(self) -> int:
        return len(self._free_slots)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return cdiv(num_tokens, self.block_size)

    @property
    def table_owners(self) -> frozenset[int]:
        """Ids of the sequences that currently hold blocks."""
        return frozenset(self._tables)

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables[seq_id])

    def sliding_slot(self, seq_id: int) -> int | None:
        """The sequence's slot, or None when the model has no sliding layers."""
        return self._slots.get(seq_id)

    def capacity(self, seq_id: int) -> int:
        """Tokens ``seq_id`` could hold right now: its own blocks plus every free block."""
        held = len(self._tables.get(seq_id, ()))
        return (held + len(self._free_blocks)) * self.block_size

    # -- changes -------------------------------------------------------------------------

    def allocate(self, seq_id: int, num_tokens: int) -> tuple[int, ...] | None:
        """Make ``seq_id``'s table cover ``num_tokens`` tokens, creating it on first use.

        A new sequence also takes a sliding slot when the model has sliding layers. Tables
        only grow: asking for fewer tokens than already covered changes nothing.

        Returns:
            The whole block table, or None (and no change at all) when there are not enough
            free blocks, or no free sliding slot for a new sequence.
        """
        assert num_tokens > 0, f"seq {seq_id}: allocate({num_tokens})"
        table = self._tables.get(seq_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        is_new = seq_id not in self._tables
        if missing > len(self._free_blocks):
            return None
        if is_new and self.num_sliding_slots and not self._free_slots:
            return None
        table.extend(self._free_blocks.popleft() for _ in range(max(missing, 0)))
        if is_new:
            self._tables[seq_id] = table
            if self.num_sliding_slots:
                self._slots[seq_id] = heapq.heappop(self._free_slots)
        return tuple(table)

    def free(self, seq_id: int) -> None:
        """Return all of ``seq_id``'s blocks and its slot (finish, abort or preemption)."""
        self._free_blocks.extend(self._tables.pop(seq_id))
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            heapq.heappush(self._free_slots, slot)

    def grow(self, num_blocks: int) -> None:
        """Add blocks ``[num_total_blocks, num_blocks)`` to the free list (usable at once)."""
        assert num_blocks >= self.num_total_blocks, f"grow({num_blocks}) would shrink"
        self._free_blocks.extend(range(self.num_total_blocks, num_blocks))
        self.num_total_blocks = num_blocks

    def shrink(self, num_blocks: int) -> Migration:
        """Keep only block ids ``[0, num_blocks)``, moving used blocks above it into free ones.

        The caller copies each move's K/V (src -> dst) before the pool drops the old ids.
        ``num_used_blocks <= num_blocks`` must hold (the scheduler preempts first).
        """
        assert 0 < num_blocks <= self.num_total_blocks, f"shrink({num_blocks})"
        used = [b for table in self._tables.values() for b in table]
        migration = plan_migration(used, self._free_blocks, num_blocks)
        self._tables = remap_tables(self._tables, migration)
        taken = {dst for _, dst in migration.moves}
        self._free_blocks = deque(b for b in self._free_blocks if b < num_blocks and b not in taken)
        self.num_total_blocks = num_blocks
        return migration

    # -- integrity -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the pool is consistent; any failure is a kvroom bug.

        free + used == total; no block is both free and used, or in two tables (so every used
        block has refcount 1); same for sliding slots, one per table.
        """
        used = [b for table in self._tables.values() for b in table]
        free = list(self._free_blocks)
        assert len(set(used)) == len(used), f"a block is in two tables: {self._tables}"
        assert len(set(free)) == len(free), f"a block is freed twice: {free}"
        assert not set(used) & set(free), f"blocks both used and free: {set(used) & set(free)}"
        assert len(used) + len(free) == self.num_total_blocks, "blocks leaked or invented"
        assert set(used) | set(free) == set(range(self.num_total_blocks)), "unknown block id"
        assert all(self._tables.values()), "an empty table is registered"
        slots = list(self._slots.values())
        assert len(set(slots)) == len(slots), f"a sliding slot is shared: {self._slots}"
        assert not set(slots) & set(self._free_slots), "a sliding slot is both used and free"
        assert len(slots) + len(self._free_slots) == self.num_sliding_slots, "slots leaked"
        if self.num_sliding_slots:
            assert self._slots.keys() == self._tables.keys(), "a running seq lacks a slot"
        else:
            assert not self._slots, "slots handed out without sliding layers"


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"BlockManager.{name}: must be an int >= {minimum}, got {value!r}")
