"""BlockManager with shared blocks: refcounts, fork + copy-on-write, the prefix cache, its
eviction order, resize, and a state machine that checks every table's K/V on a fake pool."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroom.engine.kv.block_manager import BlockManager
from kvroom.errors import ConfigError


def make_bm(num_blocks: int = 8, enable_prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, 4, enable_prefix_caching=enable_prefix_caching)


def computed(bm: BlockManager, seq_id: int, tokens: tuple[int, ...]) -> None:
    """Cover ``tokens`` for ``seq_id`` and register its full blocks, as a step would."""
    assert bm.allocate(seq_id, len(tokens)) is not None
    bm.cache_blocks(seq_id, tokens, len(tokens))


PROMPT = tuple(range(10))  # blocks [0..3] [4..7] and a partial [8, 9]


def test_a_second_sequence_reuses_the_cached_full_blocks_but_not_the_last_token() -> None:
    bm = make_bm()
    computed(bm, 1, PROMPT)
    assert bm.match_prefix(2, PROMPT + (50,)) == 8
    assert bm.block_table(2) == bm.block_table(1)[:2]
    assert [bm.refcount(b) for b in bm.block_table(1)] == [2, 2, 1]
    assert bm.match_prefix(3, PROMPT[:8]) == 4, "the last token is always computed"
    assert bm.match_prefix(4, (99,) + PROMPT[1:]) == 0 and 4 not in bm.table_owners
    bm.check_invariants()


def test_freed_cached_blocks_count_as_free_and_are_hit_later() -> None:
    bm = make_bm(num_blocks=4)
    computed(bm, 1, PROMPT)
    bm.free(1)
    assert (bm.num_free_blocks, bm.cache.num_free) == (4, 2)  # type: ignore[union-attr]
    assert bm.match_prefix(2, PROMPT) == 8
    assert bm.num_free_blocks == 2
    bm.check_invariants()


def test_plain_free_blocks_go_first_then_the_least_recently_freed_cached_one() -> None:
    bm = make_bm(num_blocks=4)
    computed(bm, 1, PROMPT[:8])  # blocks 0, 1: cached
    bm.free(1)  # LRU, oldest first: 1 (the tail), then 0
    assert bm.allocate(2, 8) == (2, 3)
    assert bm.allocate(3, 4) == (1,), "the tail block of seq 1 is evicted first"
    assert bm.match_prefix(4, PROMPT) == 4, "its first block is still cached"
    bm.check_invariants()


def test_fork_shares_the_prompt_and_copies_the_partial_block_on_write() -> None:
    bm = make_bm()
    computed(bm, 1, PROMPT)
    parent = bm.block_table(1)
    assert bm.fork(1, 2, 9) == parent
    assert bm.capacity(2, 9) == (3 - 1 + 5) * 4, "the shared partial block costs a copy"
    table = bm.allocate(2, 10, num_computed=9)
    assert table == (*parent[:2], 3)
    assert bm.pop_copies() == ((parent[2], 3),) and bm.pop_copies() == ()
    assert bm.allocate(1, 11, num_computed=10) == parent, "no longer shared: written in place"
    assert bm.pop_copies() == ()
    bm.check_invariants()


def test_a_copy_of_a_block_copied_in_the_same_step_reads_the_original() -> None:
    bm = make_bm()
    computed(bm, 1, PROMPT)
    bm.fork(1, 2, 9)
    bm.allocate(1, 11, num_computed=10)  # seq 1 copies its partial block 2 -> 3
    bm.fork(1, 3, 9)  # seq 3 shares block 3, whose K/V is still in flight
    bm.allocate(3, 10, num_computed=9)  # and copies it: from block 2
    assert bm.pop_copies() == ((2, 3), (2, 4))
    bm.check_invariants()


def test_writing_into_a_cached_block_copies_it() -> None:
    bm = make_bm()
    computed(bm, 1, PROMPT[:8])  # block 1 is full and cached
    bm.fork(1, 2, 6)
    bm.free(1)  # seq 2 alone holds block 1, but the cache can still hand it out
    assert bm.allocate(2, 7, num_computed=6) == (0, 2)
    assert bm.pop_copies() == ((1, 2),)
    assert bm.cache.num_free == 1  # type: ignore[union-attr]
    bm.check_invariants()


def test_reset_prefix_cache_drops_the_cached_free_blocks_only() -> None:
    bm = make_bm()
    computed(bm, 1, PROMPT)
    computed(bm, 2, (7,) * 9)
    bm.free(2)
    assert bm.reset_prefix_cache() == 2
    assert bm.match_prefix(3, PROMPT) == 0 and bm.match_prefix(4, (7,) * 9) == 0
    assert bm.num_free_blocks == 5 and bm.cache.num_free == 0  # type: ignore[union-attr]
    bm.check_invariants()
    assert make_bm(enable_prefix_caching=False).reset_prefix_cache() == 0


def test_shrink_moves_a_shared_block_once_and_drops_cached_free_blocks_above() -> None:
    bm = make_bm(num_blocks=8)
    bm.allocate(9, 24)  # blocks 0-5, a placeholder
    computed(bm, 1, (1,) * 8)  # blocks 6, 7: cached
    bm.fork(1, 2, 5)
    bm.free(9)
    computed(bm, 3, (3,) * 4)  # block 0 (plain free first)
    bm.free(3)  # block 0 is cached-free, below N
    migration = bm.shrink(4)
    assert migration.moves == ((7, 1), (6, 2))
    assert bm.block_table(1) == bm.block_table(2) == (2, 1)
    assert bm.match_prefix(4, (1,) * 9) == 8, "moved blocks keep their hashes"
    assert bm.match_prefix(5, (3,) * 5) == 4, "the cached block below N is kept"
    bm.check_invariants()


def test_shrink_evicts_cached_free_blocks_below_n_when_it_needs_their_room() -> None:
    bm = make_bm(num_blocks=4)
    computed(bm, 1, (1,) * 8)  # blocks 0, 1
    bm.free(1)
    bm.allocate(2, 16)  # evicts both cached blocks: 2, 3, 1, 0
    bm.free(2)
    computed(bm, 3, (3,) * 4)
    computed(bm, 4, (4,) * 8)
    bm.free(3)
    assert bm.shrink(2).moves  # block 3 must move into a block a cached one held
    bm.check_invariants()


def test_caching_refuses_sliding_window_slots() -> None:
    with pytest.raises(ConfigError, match="sliding-window layers keeps a ring per sequence"):
        BlockManager(8, 4, num_sliding_slots=2, enable_prefix_caching=True)
    assert not BlockManager(8, 4, num_sliding_slots=2).shares_blocks


class SharingMachine(RuleBasedStateMachine):
    """Random add (with cache hits) / fork / append / free / reset / resize.

    A fake pool holds the token each position's K/V was computed from; copies and moves are
    applied to it as the engine would. After every rule each table must read back exactly its
    sequence's tokens, so a wrong hit, a missed copy-on-write or a wrong move is caught.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm = make_bm(num_blocks=10)
        self.pool: dict[int, list[int | None]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _read(self, seq_id: int, n: int) -> list[int | None]:
        table = self.bm.block_table(seq_id)
        return [self.pool.get(table[p // 4], [None] * 4)[p % 4] for p in range(n)]

    def _compute(self, seq_id: int, tokens: list[int], start: int) -> bool:
        table = self.bm.allocate(seq_id, len(tokens), start)
        if table is None:
            if seq_id in self.bm.table_owners and seq_id not in self.tokens:
                self.bm.free(seq_id)
            return False
        copies = self.bm.pop_copies()
        read = [list(self.pool.get(src, [None] * 4)) for src, _ in copies]
        for (_, dst), content in zip(copies, read, strict=True):
            self.pool[dst] = content
        for p in range(start, len(tokens)):
            self.pool.setdefault(table[p // 4], [None] * 4)[p % 4] = tokens[p]
        self.bm.cache_blocks(seq_id, tuple(tokens), len(tokens))
        self.tokens[seq_id] = tokens
        return True

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14))
    def add(self, tokens: list[int]) -> None:
        seq_id = self._new_id()
        hit = self.bm.match_prefix(seq_id, tuple(tokens))
        assert hit % 4 == 0 and hit <= len(tokens) - 1
        if hit:
            assert self._read(seq_id, hit) == tokens[:hit], "a cache hit with other tokens"
        self._compute(seq_id, tokens, hit)

    @precondition(lambda self: any(len(t) > 1 for t in self.tokens.values()))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def fork(self, data: st.DataObject, extra: list[int]) -> None:
        parent = data.draw(st.sampled_from([s for s, t in self.tokens.items() if len(t) > 1]))
        n = data.draw(st.integers(1, len(self.tokens[parent]) - 1))
        child = self._new_id()
        self.bm.fork(parent, child, n)
        self._compute(child, self.tokens[parent][:n] + extra, n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def append(self, data: st.DataObject, extra: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self._compute(seq_id, self.tokens[seq_id] + extra, len(self.tokens[seq_id]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id]

    @rule()
    def reset(self) -> None:
        self.bm.reset_prefix_cache()

    @rule(num_blocks=st.integers(4, 14))
    def resize(self, num_blocks: int) -> None:
        if num_blocks >= self.bm.num_total_blocks:
            self.bm.grow(num_blocks)
            return
        while self.bm.num_used_blocks > num_blocks:
            newest = max(self.tokens)
            self.bm.free(newest)
            del self.tokens[newest]
        moves = self.bm.shrink(num_blocks).moves
        read = [list(self.pool.get(src, [None] * 4)) for src, _ in moves]
        for (_, dst), content in zip(moves, read, strict=True):
            self.pool[dst] = content

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        assert self.bm.table_owners == set(self.tokens)
        for seq_id, tokens in self.tokens.items():
            assert self._read(seq_id, len(tokens)) == tokens, f"seq {seq_id}'s K/V"
        held = {b for s in self.tokens for b in self.bm.block_table(s)}
        assert self.bm.num_free_blocks == self.bm.num_total_blocks - len(held)

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_total_blocks


TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
