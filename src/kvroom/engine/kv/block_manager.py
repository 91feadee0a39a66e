"""Hands out the KV pool's blocks and sliding-window slots to sequences (torch-free).

The pool holds exactly ``num_blocks`` blocks of ``block_size`` tokens for every full-attention
layer. A sequence's block table maps its positions onto them::

    position p  ->  block_table[p // block_size], offset p % block_size

    tokens:  0 1 2 3 | 4 5 6 7 | 8 9
    table:   [  17   ,   3     ,  8  ]        (block_size = 4, 10 tokens -> 3 blocks)

Blocks are reference counted: a block may sit in several tables at once (the ``n`` choices of
one prompt after ``fork``, or sequences whose prefixes hit the prefix cache), and its refcount
is the number of tables holding it. A sequence about to write into a block that someone else
can read (refcount > 1, or registered in the prefix cache) gets a private copy first
(copy-on-write); the copies wait in ``pop_copies()`` for the runner, which runs them before the
step's forward. Only a partially filled block is ever written, so only such a block is copied.

Every block is in exactly one of three states::

    free          refcount 0, no hash          handed out first, lowest id first
    cached-free   refcount 0, hash, in the LRU counts as free; evicted when no free is left
    used          refcount = number of tables

Hybrid models (sliding-window layers) keep a fixed ring of the last ``window`` tokens per running
sequence instead of a growing table; those live in ``num_sliding_slots`` slots, one per running
sequence, assigned at the first allocation and returned on ``free``. A ring cannot be shared or
cached, so such a pool never shares blocks (``shares_blocks`` is False).

The pool may change size while sequences run: ``grow`` appends new ids to the free list;
``shrink`` drops cached-free blocks ``>= N``, then vacates used ids ``>= N`` by moving them to
free low ids (``pool_migration``): a shared block moves once and every table holding it is
rewritten. The engine copies the returned moves' K/V.
"""

from __future__ import annotations

import heapq
from collections import Counter

from kvroom.engine.kv.migration import Migration, plan_migration, remap_tables
from kvroom.engine.kv.prefix_cache import BlockHash, PrefixCache, chain_hashes
from kvroom.errors import ConfigError
from kvroom.units import cdiv


class BlockManager:
    """Owns which block and which sliding slot belong to which sequence id.

    "Cannot allocate now" is an ordinary answer (``None``), never an exception: the scheduler
    reacts by chunking, waiting, or preempting.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_sliding_slots: int = 0,
        *,
        enable_prefix_caching: bool = False,
    ) -> None:
        """
        Args:
            num_blocks: blocks in the pool (the artifact's ``kvcache_num_blocks``).
            block_size: tokens per block.
            num_sliding_slots: sliding-window slots (= max concurrent sequences), 0 when the
                model has no sliding layers.
            enable_prefix_caching: keep computed full blocks findable by their hash chain.

        Raises:
            ConfigError: a size is not a positive int (``num_sliding_slots`` may be 0), or
                prefix caching is asked for a pool with sliding-window slots.
        """
        _check_count("num_blocks", num_blocks, minimum=1)
        _check_count("block_size", block_size, minimum=1)
        _check_count("num_sliding_slots", num_sliding_slots, minimum=0)
        if enable_prefix_caching and num_sliding_slots:
            raise ConfigError(
                "BlockManager.enable_prefix_caching: a model with sliding-window layers keeps "
                "a ring per sequence that cannot be shared; disable prefix caching for it"
            )
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.num_sliding_slots = num_sliding_slots
        self.cache: PrefixCache | None = PrefixCache() if enable_prefix_caching else None
        """The prefix cache, or None when prefix caching is off."""
        self._free_blocks: list[int] = list(range(num_blocks))
        """Plain free ids, a min-heap: the lowest is handed out first (``_take_free``)."""
        self._free_slots: list[int] = list(range(num_sliding_slots))  # a min-heap
        self._tables: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}
        """Used block -> number of tables holding it (free blocks are absent)."""
        self._slots: dict[int, int] = {}
        self._hashes: dict[int, list[BlockHash]] = {}
        """seq id -> hash chain of its leading full blocks, as far as computed."""
        self._copies: list[tuple[int, int]] = []

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free plus cached-free ones."""
        return len(self._free_blocks) + (self.cache.num_free if self.cache else 0)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_free_sliding_slots(self) -> int:
        return len(self._free_slots)

    @property
    def shares_blocks(self) -> bool:
        """Whether sequences may share blocks (``fork``): not with sliding-window rings."""
        return self.num_sliding_slots == 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return cdiv(num_tokens, self.block_size)

    @property
    def table_owners(self) -> frozenset[int]:
        """Ids of the sequences that currently hold blocks."""
        return frozenset(self._tables)

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables[seq_id])

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def sliding_slot(self, seq_id: int) -> int | None:
        """The sequence's slot, or None when the model has no sliding layers."""
        return self._slots.get(seq_id)

    def capacity(self, seq_id: int, num_computed: int = 0) -> int:
        """Tokens ``seq_id`` could hold right now: its own blocks plus every free block.

        A shared block it would write next (position ``num_computed``) costs one free block
        for its copy.
        """
        table = self._tables.get(seq_id, [])
        held = len(table) - self._needs_copy(table, num_computed)
        return (held + self.num_free_blocks) * self.block_size

    # -- changes -------------------------------------------------------------------------

    def allocate(
        self, seq_id: int, num_tokens: int, num_computed: int = 0
    ) -> tuple[int, ...] | None:
        """Make ``seq_id``'s table cover ``num_tokens`` tokens, creating it on first use.

        Positions from ``num_computed`` on are about to be written: a shared block among them
        is replaced by a private copy (queued in ``pop_copies``). A new sequence also takes a
        sliding slot when the model has sliding layers. Tables only grow: asking for fewer
        tokens than already covered adds nothing.

        Returns:
            The whole block table, or None (and no change at all) when there are not enough
            free blocks, or no free sliding slot for a new sequence.
        """
        assert num_tokens > 0, f"seq {seq_id}: allocate({num_tokens})"
        table = self._tables.get(seq_id, [])
        copy = self._needs_copy(table, num_computed)
        missing = max(self.blocks_for(num_tokens) - len(table), 0)
        is_new = seq_id not in self._tables
        if missing + copy > self.num_free_blocks:
            return None
        if is_new and self.num_sliding_slots and not self._free_slots:
            return None
        if copy:
            self._copy_on_write(table, num_computed // self.block_size)
        for _ in range(missing):
            table.append(self._take_free())
        if is_new:
            self._tables[seq_id] = table
            if self.num_sliding_slots:
                self._slots[seq_id] = heapq.heappop(self._free_slots)
        return tuple(table)

    def fork(self, parent: int, child: int, num_tokens: int) -> tuple[int, ...]:
        """Give ``child`` the blocks of ``parent``'s first ``num_tokens`` tokens, shared.

        The child's next write into the last, partially filled shared block copies it.
        """
        assert self.shares_blocks and child not in self._tables, f"fork({parent}, {child})"
        assert num_tokens > 0, f"fork of {num_tokens} tokens"
        shared = self._tables[parent][: self.blocks_for(num_tokens)]
        for block in shared:
            self._refs[block] += 1
        self._tables[child] = list(shared)
        self._hashes[child] = self._hashes.get(parent, [])[: num_tokens // self.block_size]
        return tuple(shared)

    def match_prefix(self, seq_id: int, token_ids: tuple[int, ...]) -> int:
        """Take the cached blocks of ``token_ids``' longest cached prefix into a new table.

        At most ``len(token_ids) - 1`` tokens are matched: the last token is always computed,
        to get the logits of the next one.

        Returns:
            Tokens whose K/V the table now holds (a multiple of ``block_size``; 0 when
            nothing matched, or prefix caching is off, and then no table is created).
        """
        assert seq_id not in self._tables, f"match_prefix for seq {seq_id} that holds blocks"
        if self.cache is None:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        blocks, hashes = self.cache.longest_prefix(token_ids, self.block_size, max_blocks)
        for block in blocks:
            if block not in self._refs:
                self.cache.unpark(block)
            self._refs[block] = self._refs.get(block, 0) + 1
        if blocks:
            self._tables[seq_id] = blocks
            self._hashes[seq_id] = hashes
        return len(blocks) * self.block_size

    def cache_blocks(self, seq_id: int, token_ids: tuple[int, ...], num_computed: int) -> None:
        """Register ``seq_id``'s full blocks among its first ``num_computed`` tokens."""
        if self.cache is None:
            return
        table = self._tables[seq_id]
        known = self._hashes.setdefault(seq_id, [])
        num_full = num_computed // self.block_size
        if len(known) >= num_full:
            return
        first = len(known)
        known[:] = chain_hashes(token_ids, self.block_size, num_full, known)
        for block, block_hash in zip(table[first:num_full], known[first:], strict=True):
            found = self.cache.hash_of(block)
            if found is None:
                self.cache.register(block, block_hash)
            else:
                assert found == block_hash, f"seq {seq_id}: block {block} holds other tokens"

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id``'s table and slot (finish, abort or preemption).

        Its blocks lose one reference each, last block first, so that of a sequence's
        cached blocks the tail is evicted before the prefix others are likelier to share.
        """
        unused = [b for b in self._tables.pop(seq_id) if self._unref(b)]
        for block in unused:
            if not self._is_cached(block):
                heapq.heappush(self._free_blocks, block)
        for block in reversed(unused):
            if self._is_cached(block):
                self.cache.park(block)  # type: ignore[union-attr]
        self._hashes.pop(seq_id, None)
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            heapq.heappush(self._free_slots, slot)

    def pop_copies(self) -> tuple[tuple[int, int], ...]:
        """The copy-on-write (src, dst) copies queued since the last call; each src is read
        before any copy writes (no src is another copy's dst)."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; cached-free blocks become plain free ones.

        Returns:
            The cached-free blocks that were dropped (0 when prefix caching is off).
        """
        if self.cache is None:
            return 0
        dropped = self.cache.reset()
        self._free_blocks.extend(dropped)
        heapq.heapify(self._free_blocks)
        return len(dropped)

    def grow(self, num_blocks: int) -> None:
        """Add blocks ``[num_total_blocks, num_blocks)`` to the free list (usable at once)."""
        assert num_blocks >= self.num_total_blocks, f"grow({num_blocks}) would shrink"
        self._free_blocks.extend(range(self.num_total_blocks, num_blocks))  # all above: heap kept
        self.num_total_blocks = num_blocks

    def shrink(self, num_blocks: int) -> Migration:
        """Keep only block ids ``[0, num_blocks)``, moving used blocks above it into free ones.

        Cached-free blocks above it are forgotten; those below it are evicted (least recently
        freed first) only when the plain free ones cannot take every move. The caller copies
        each move's K/V (src -> dst) before the pool drops the old ids.
        ``num_used_blocks <= num_blocks`` must hold (the scheduler preempts first).
        """
        assert 0 < num_blocks <= self.num_total_blocks, f"shrink({num_blocks})"
        self._make_room_below(num_blocks)
        migration = plan_migration(self._refs, self._free_blocks, num_blocks)
        self._tables = remap_tables(self._tables, migration)
        mapping = migration.mapping
        self._refs = {mapping.get(b, b): n for b, n in self._refs.items()}
        if self.cache is not None:
            self.cache.remap(mapping)
        taken = set(mapping.values())
        self._free_blocks = [b for b in self._free_blocks if b < num_blocks and b not in taken]
        heapq.heapify(self._free_blocks)
        self.num_total_blocks = num_blocks
        return migration

    # -- helpers -------------------------------------------------------------------------

    def _needs_copy(self, table: list[int], position: int) -> bool:
        """Whether writing ``position`` would touch a block another reader can see."""
        index = position // self.block_size
        if index >= len(table):
            return False
        block = table[index]
        return self._refs[block] > 1 or self._is_cached(block)

    def _is_cached(self, block: int) -> bool:
        return self.cache is not None and self.cache.hash_of(block) is not None

    def _copy_on_write(self, table: list[int], index: int) -> None:
        """Replace ``table[index]`` by a fresh block and queue the K/V copy into it."""
        src, dst = table[index], self._take_free()
        self._refs[dst] = 1
        pending = {d: s for s, d in self._copies}
        self._copies.append((pending.get(src, src), dst))  # read what src will hold
        table[index] = dst
        self._release(src)

    def _take_free(self) -> int:
        """The lowest plain free block, else the least recently freed cached one (evicted).

        Lowest first: a workload keeps reusing the same few blocks, whose pages are resident
        and often still in cache (handed out in turn, every new block of a CPU pool not yet
        populated cost page faults: a 512-row step's K/V store took 1.3 ms instead of 0.1),
        and used blocks stay below a shrink's cut, so a shrink moves fewer."""
        if self._free_blocks:
            block = heapq.heappop(self._free_blocks)
        else:
            assert self.cache is not None, "no free block: the caller checked the count"
            evicted = self.cache.evict()
            assert evicted is not None, "no free block: the caller checked the count"
            block = evicted
        self._refs[block] = 1
        return block

    def _unref(self, block: int) -> bool:
        """One table less holds ``block``; True when none does any more."""
        self._refs[block] -= 1
        if self._refs[block]:
            return False
        del self._refs[block]
        return True

    def _release(self, block: int) -> None:
        """``_unref``; at zero the block becomes free or cached-free."""
        if not self._unref(block):
            return
        if self._is_cached(block):
            self.cache.park(block)  # type: ignore[union-attr]
        else:
            heapq.heappush(self._free_blocks, block)

    def _make_room_below(self, num_blocks: int) -> None:
        """Before a shrink: forget cached-free ids ``>= num_blocks``, and evict cached-free
        ones below it until the plain free blocks below it can take every move."""
        if self.cache is None:
            return
        for block in [b for b in self.cache.free_blocks() if b >= num_blocks]:
            self.cache.drop(block)
        num_moves = sum(b >= num_blocks for b in self._refs)
        low_free = sum(b < num_blocks for b in self._free_blocks)
        for _ in range(num_moves - low_free):
            evicted = self.cache.evict()
            assert evicted is not None, "used blocks exceed the shrunk pool"
            heapq.heappush(self._free_blocks, evicted)

    # -- integrity -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the pool is consistent; any failure is a kvroom bug.

        Every used block is in exactly as many tables as its refcount (and at most once per
        table); free, cached-free and used blocks partition ``range(total)``; only cached
        blocks carry hashes; same for sliding slots, one per table.
        """
        held = Counter(b for table in self._tables.values() for b in table)
        assert dict(held) == self._refs, f"refcounts {self._refs} != tables {dict(held)}"
        for table in self._tables.values():
            assert len(set(table)) == len(table), f"a block twice in one table: {table}"
        free = list(self._free_blocks)
        cached = list(self.cache.free_blocks()) if self.cache else []
        every = list(held) + free + cached
        assert len(set(every)) == len(every), "a block is in two states (or freed twice)"
        assert set(every) == set(range(self.num_total_blocks)), "blocks leaked or invented"
        if self.cache is not None:
            self.cache.check_invariants(set(held))
            assert not any(self.cache.hash_of(b) for b in free), "a plain free block is hashed"
        assert all(self._tables.values()), "an empty table is registered"
        assert self._hashes.keys() <= self._tables.keys(), "hashes of a seq without blocks"
        self._check_slots()

    def _check_slots(self) -> None:
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
