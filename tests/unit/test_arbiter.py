"""The multi-model arbiter's policy over numbers: budget cuts by priority, evictions as the last
resort, blocks toward starved pools with hysteresis, room for a model to load."""

from __future__ import annotations

from kvroom.server.multi.arbiter import Action, ArbiterPolicy, PoolView, decide, make_room

POLICY = ArbiterPolicy(patience_s=1.0, cooldown_s=5.0, evict_idle_s=10.0)
BLOCK = 1024


def pool(name: str, n: int, **kw: object) -> PoolView:
    base = dict(
        name=name,
        num_blocks=n,
        num_used_blocks=0,
        min_blocks=16,
        max_blocks=128,
        bytes_per_block=BLOCK,
        fixed_bytes=100 * BLOCK,
    )
    return PoolView(**(base | kw))  # type: ignore[arg-type]


def test_within_budget_and_no_demand_nothing_moves() -> None:
    pools = [pool("a", 32, idle_s=60.0), pool("b", 32, num_used_blocks=10)]
    assert decide(pools, 64 * BLOCK, POLICY) == []


def test_a_starved_pool_takes_the_idle_pools_blocks_down_to_its_floor() -> None:
    busy = pool("a", 32, num_used_blocks=32, starved_s=2.0)
    idle = pool("b", 32, idle_s=30.0)
    actions = decide([busy, idle], 64 * BLOCK, POLICY)
    assert actions == [
        Action("shrink", "b", 16, "to a (starved)"),
        Action("grow", "a", 48, "requests waiting for blocks for 2.0s"),
    ]


def test_the_spare_budget_is_used_before_any_donor() -> None:
    busy = pool("a", 32, num_used_blocks=32, starved_s=2.0)
    idle = pool("b", 32, idle_s=30.0)
    actions = decide([busy, idle], 80 * BLOCK, POLICY)
    assert actions == [Action("grow", "a", 48, "requests waiting for blocks for 2.0s")]


def test_starvation_must_last_patience_s_before_blocks_move() -> None:
    busy = pool("a", 32, num_used_blocks=32, starved_s=0.5)
    assert decide([busy, pool("b", 32, idle_s=30.0)], 64 * BLOCK, POLICY) == []


def test_a_donor_keeps_its_used_blocks_and_a_quarter_as_headroom() -> None:
    busy = pool("a", 32, num_used_blocks=32, starved_s=2.0)
    working = pool("b", 40, num_used_blocks=20)
    actions = decide([busy, working], 72 * BLOCK, POLICY)
    assert Action("shrink", "b", 25, "to a (starved)") in actions


def test_a_pool_grown_within_cooldown_gives_nothing_back() -> None:
    busy = pool("a", 32, num_used_blocks=32, starved_s=2.0)
    just_grown = pool("b", 48, since_grow_s=1.0, idle_s=1.0)
    assert decide([busy, just_grown], 80 * BLOCK, POLICY) == []


def test_a_pinned_pool_neither_gives_nor_grows() -> None:
    busy = pool("a", 32, num_used_blocks=32, starved_s=2.0, pinned=True)
    pinned_idle = pool("b", 32, idle_s=30.0, pinned=True)
    assert decide([busy, pinned_idle], 64 * BLOCK, POLICY) == []


def test_a_budget_cut_shrinks_the_lowest_priority_first_down_to_its_floor() -> None:
    high = pool("a", 64, priority=2.0, num_used_blocks=40)
    low = pool("b", 64, priority=1.0, num_used_blocks=40)
    actions = decide([high, low], 60 * BLOCK, POLICY)
    assert actions == [
        Action("shrink", "b", 16, "budget cut: shrink by priority"),
        Action("shrink", "a", 44, "budget cut: shrink by priority"),
    ]


def test_when_the_floors_do_not_fit_the_idle_model_is_evicted() -> None:
    busy = pool("a", 64, priority=1.0, num_used_blocks=20)
    idle = pool("b", 64, priority=2.0, idle_s=60.0)
    actions = decide([busy, idle], 24 * BLOCK, POLICY)
    assert actions == [
        Action("shrink", "a", 16, "budget cut: shrink by priority"),
        Action("evict", "b", 0, "budget cut: floors do not fit"),
    ]


def test_a_busy_model_is_never_evicted() -> None:
    a = pool("a", 16, num_used_blocks=16)
    b = pool("b", 16, num_used_blocks=4)
    assert decide([a, b], 20 * BLOCK, POLICY) == []


def test_room_for_a_model_to_load_shrinks_then_evicts_or_says_none() -> None:
    idle = pool("b", 64, idle_s=60.0)
    need = 100 * BLOCK + 16 * BLOCK
    shrink_only = make_room([idle], (64 + 116 - 40) * BLOCK, need, POLICY)
    why = "room for a model to load: shrink by priority"
    assert shrink_only == [Action("shrink", "b", 24, why)]
    evict = make_room([idle], 100 * BLOCK, need, POLICY)
    assert evict is not None and evict[-1].kind == "evict"
    busy = pool("b", 64, num_used_blocks=10)
    assert make_room([busy], 100 * BLOCK, need, POLICY) is None
