"""BlockManager: exact allocation behaviour, and invariants under random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroom.engine.kv.block_manager import BlockManager
from kvroom.errors import ConfigError


def make_bm(num_blocks: int = 6, block_size: int = 4, num_sliding_slots: int = 0) -> BlockManager:
    return BlockManager(num_blocks, block_size, num_sliding_slots)


def test_allocate_covers_tokens_with_ceil_blocks() -> None:
    bm = make_bm()
    assert bm.allocate(1, 5) == (0, 1)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (4, 2)
    assert bm.block_table(1) == (0, 1)
    bm.check_invariants()


def test_allocate_grows_only_when_a_block_boundary_is_crossed() -> None:
    bm = make_bm()
    bm.allocate(1, 4)
    assert bm.allocate(1, 4) == (0,)
    assert bm.allocate(1, 2) == (0,), "asking for fewer tokens never shrinks the table"
    assert bm.allocate(1, 5) == (0, 1)
    assert bm.allocate(1, 9) == (0, 1, 2)
    assert bm.num_used_blocks == 3


def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    bm = make_bm(num_blocks=3)
    bm.allocate(1, 8)
    assert bm.allocate(2, 5) is None
    assert bm.table_owners == {1}
    assert bm.allocate(1, 13) is None
    assert bm.block_table(1) == (0, 1)
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_free_returns_blocks_for_reuse() -> None:
    bm = make_bm(num_blocks=2)
    bm.allocate(1, 8)
    assert bm.allocate(2, 1) is None
    bm.free(1)
    assert bm.num_free_blocks == 2
    assert bm.allocate(2, 8) == (0, 1)
    bm.check_invariants()


def test_capacity_counts_own_blocks_plus_free_ones() -> None:
    bm = make_bm(num_blocks=4)
    bm.allocate(1, 5)
    bm.allocate(2, 1)
    assert bm.capacity(1) == (2 + 1) * 4
    assert bm.capacity(3) == 1 * 4


def test_no_sliding_layers_means_no_slot() -> None:
    bm = make_bm()
    bm.allocate(1, 1)
    assert bm.sliding_slot(1) is None


def test_sliding_slots_are_assigned_lowest_first_and_reused() -> None:
    bm = make_bm(num_sliding_slots=2)
    bm.allocate(1, 1)
    bm.allocate(2, 1)
    assert (bm.sliding_slot(1), bm.sliding_slot(2)) == (0, 1)
    assert bm.allocate(3, 1) is None, "no slot left for a third sequence"
    assert bm.num_free_blocks == 4, "a refused allocation takes no block"
    bm.free(1)
    assert bm.allocate(3, 1) is not None
    assert bm.sliding_slot(3) == 0
    assert bm.num_free_sliding_slots == 0
    bm.check_invariants()


def test_growing_keeps_the_slot() -> None:
    bm = make_bm(num_sliding_slots=1)
    bm.allocate(1, 1)
    bm.allocate(1, 9)
    assert bm.sliding_slot(1) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, r"^BlockManager.num_blocks: must be an int >= 1, got 0$"),
        ({"block_size": True}, r"^BlockManager.block_size: must be an int >= 1, got True$"),
        ({"num_sliding_slots": -1}, r"num_sliding_slots: must be an int >= 0, got -1$"),
    ],
)
def test_bad_sizes_raise_config_error(kwargs: dict[str, int], message: str) -> None:
    args = {"num_blocks": 4, "block_size": 4, "num_sliding_slots": 0} | kwargs
    with pytest.raises(ConfigError, match=message):
        BlockManager(**args)


def test_check_invariants_catches_a_block_in_more_tables_than_its_refcount() -> None:
    bm = make_bm()
    bm.allocate(1, 4)
    bm.allocate(2, 4)
    bm._tables[2][0] = bm._tables[1][0]  # simulate the bug the check exists for
    with pytest.raises(AssertionError, match=r"refcounts \{0: 1, 1: 1\} != tables \{0: 2\}"):
        bm.check_invariants()


def test_check_invariants_catches_a_leak() -> None:
    bm = make_bm()
    bm.allocate(1, 4)
    del bm._tables[1]
    del bm._refs[0]
    with pytest.raises(AssertionError, match="leaked"):
        bm.check_invariants()


def test_grow_adds_free_blocks_at_once() -> None:
    bm = make_bm(num_blocks=2)
    bm.allocate(1, 8)
    assert bm.allocate(2, 1) is None
    bm.grow(5)
    assert (bm.num_total_blocks, bm.num_free_blocks) == (5, 3)
    assert bm.allocate(2, 9) == (2, 3, 4)
    bm.check_invariants()


def test_shrink_moves_high_blocks_into_free_low_ones() -> None:
    bm = make_bm(num_blocks=6)
    bm.allocate(1, 4)  # block 0
    bm.allocate(2, 12)  # blocks 1, 2, 3
    bm.allocate(3, 8)  # blocks 4, 5
    bm.free(2)
    migration = bm.shrink(3)
    assert migration.moves == ((5, 1), (4, 2))
    assert bm.block_table(1) == (0,)
    assert bm.block_table(3) == (2, 1)
    assert (bm.num_total_blocks, bm.num_free_blocks) == (3, 0)
    bm.check_invariants()


def test_the_lowest_free_block_is_handed_out_first_also_after_a_shrink() -> None:
    bm = make_bm(num_blocks=6)
    bm.allocate(1, 8)  # blocks 0, 1
    bm.allocate(2, 4)  # block 2
    bm.free(1)  # free: 0, 1, 3, 4, 5
    bm.allocate(3, 4)
    assert bm.block_table(3) == (0,), "a freed low block is reused before a never-used one"
    bm.shrink(4)  # free: 1, 3
    bm.allocate(4, 8)
    assert bm.block_table(4) == (1, 3)
    bm.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random add / append / finish / abort / preempt / resize against a model of the tables.

    The model also tracks what each block holds (``(seq_id, block index)``, as a K/V copy
    would carry it), so a shrink that moves a block to the wrong place is caught.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=8, block_size=4, num_sliding_slots=3)
        self.tokens: dict[int, int] = {}  # model: seq_id -> tokens covered
        self.content: dict[int, tuple[int, int]] = {}  # block id -> (seq_id, index in table)
        self.total = 8
        self.next_id = 0

    def _expected_free(self) -> int:
        return self.total - sum(-(-n // 4) for n in self.tokens.values())

    def _record(self, seq_id: int) -> None:
        for i, block in enumerate(self.bm.block_table(seq_id)):
            self.content[block] = (seq_id, i)

    @rule(num_blocks=st.integers(1, 16))
    def resize(self, num_blocks: int) -> None:
        if num_blocks >= self.total:
            self.bm.grow(num_blocks)
        else:
            while self.total - self._expected_free() > num_blocks:  # preempt the newest
                newest = max(self.tokens)
                self.bm.free(newest)
                del self.tokens[newest]
            migration = self.bm.shrink(num_blocks)
            for src, dst in migration.moves:
                self.content[dst] = self.content.pop(src)
        self.total = num_blocks

    @rule(num_tokens=st.integers(1, 20))
    def add(self, num_tokens: int) -> None:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        fits = -(-num_tokens // 4) <= self._expected_free() and len(self.tokens) < 3
        table = self.bm.allocate(seq_id, num_tokens)
        assert (table is not None) == fits
        if table is not None:
            assert len(table) == -(-num_tokens // 4)
            self.tokens[seq_id] = num_tokens
            self._record(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(1, 9))
    def append(self, data: st.DataObject, extra: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.bm.block_table(seq_id)
        want = self.tokens[seq_id] + extra
        needed = -(-want // 4) - len(before)
        table = self.bm.allocate(seq_id, want)
        assert (table is not None) == (needed <= self._expected_free())
        if table is not None:
            assert table[: len(before)] == before, "growing must keep the existing blocks"
            self.tokens[seq_id] = want
            self._record(seq_id)
        else:
            assert self.bm.block_table(seq_id) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), why=st.sampled_from(["finish", "abort", "preempt"]))
    def release(self, data: st.DataObject, why: str) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)), label=why)
        self.bm.free(seq_id)
        del self.tokens[seq_id]

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self._expected_free()
        assert self.bm.table_owners == set(self.tokens)
        assert self.bm.num_total_blocks == self.total
        for seq_id in self.tokens:
            table = self.bm.block_table(seq_id)
            assert [self.content[b] for b in table] == [(seq_id, i) for i in range(len(table))]

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.total
        assert self.bm.num_free_sliding_slots == 3


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
