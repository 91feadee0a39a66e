"""pool_migration: the pure plan of which blocks move where when the pool shrinks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroom.engine.kv.migration import Migration, plan_migration, remap_tables


def test_highest_used_blocks_go_to_the_lowest_free_ones() -> None:
    # ids 0..6, N = 4: used 0, 2, 5, 6; free 1, 3, 4 (the module docstring's picture)
    m = plan_migration(used=[0, 2, 5, 6], free=[4, 3, 1], num_blocks=4)
    assert m.moves == ((6, 1), (5, 3))
    assert remap_tables({7: [0, 6], 8: [2, 5]}, m) == {7: [0, 1], 8: [2, 3]}


def test_nothing_moves_when_every_used_block_is_already_low() -> None:
    assert plan_migration(used=[0, 1], free=[2, 3, 4], num_blocks=3).moves == ()


def test_too_many_used_blocks_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"^plan_migration: 3 blocks are in use, more than the 2"):
        plan_migration(used=[0, 1, 2], free=[3], num_blocks=2)


@given(
    total=st.integers(1, 40),
    data=st.data(),
)
def test_any_shrink_that_fits_vacates_the_high_ids_without_collisions(
    total: int, data: st.DataObject
) -> None:
    ids = data.draw(st.permutations(range(total)))
    num_used = data.draw(st.integers(0, total))
    used, free = ids[:num_used], ids[num_used:]
    n = data.draw(st.integers(max(num_used, 1), total))
    m = plan_migration(used, free, n)
    assert isinstance(m, Migration)
    after = m.remap(used)
    assert all(b < n for b in after), "a used block is left at or above N"
    assert len(set(after)) == len(after), "two blocks moved onto one id"
    assert {s for s, _ in m.moves} == {b for b in used if b >= n}
    assert not {d for _, d in m.moves} & set(used), "a move overwrote a used block"
