"""The arbiter's policy (pure, torch-free): pools now, budget now -> resizes and evictions.

One tick looks at every loaded model's pool and the bytes the pools may hold together
(``pool_budget = budget - process - weights and runtime of the loaded models``)::

    1. over budget      shrink, lowest priority first (then the longest idle, then pinned
                        pools last), each down to its floor; a shrink keeps every request's
                        KV (migrate, preempt only the newest if used blocks do not fit)
       floors too big   evict idle models, lowest priority first (weights freed; reloaded
                        on the next request), until the rest fits
    2. starved pools    (requests waiting for blocks, or preempted, for ``patience_s``)
                        grow, highest priority first: from the spare budget, then from donors
    3. donors           pools not starved whose free blocks are idle: lowest priority first,
                        the longest idle first; a donor keeps its floor, its used blocks and
                        a quarter of them again as headroom; a pool grown less than
                        ``cooldown_s`` ago gives nothing (hysteresis: no block ping-pong)

A growth step is at most half the pool again (and at least one floor), so the blocks move
toward sustained demand, not toward one burst.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvroom.units import cdiv


@dataclass(frozen=True)
class ArbiterPolicy:
    """How fast and how eagerly blocks move."""

    interval_s: float = 0.5
    """Seconds between ticks."""
    patience_s: float = 1.0
    """A pool must starve this long before blocks move to it."""
    cooldown_s: float = 5.0
    """A pool grown this recently gives no blocks away."""
    evict_idle_s: float = 0.0
    """A model must have been idle this long to be evicted when the floors do not fit."""


@dataclass(frozen=True)
class PoolView:
    """One loaded model's pool, as the arbiter sees it at a tick."""

    name: str
    num_blocks: int
    num_used_blocks: int
    min_blocks: int
    max_blocks: int
    bytes_per_block: int
    fixed_bytes: int
    """Weights and runtime: what evicting the model gives back besides its pool."""
    priority: float = 1.0
    starved_s: float = 0.0
    """How long requests have been waiting for blocks (0: not starved)."""
    idle_s: float = 0.0
    """How long the model has had no request (0 while one runs, waits or is arriving)."""
    since_grow_s: float = float("inf")
    pinned: bool = False
    """An operator pinned its size: it moves only when the budget forces it."""

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def idle(self) -> bool:
        return self.idle_s > 0


@dataclass(frozen=True)
class Action:
    """One decision: resize ``name`` to ``num_blocks``, or evict it."""

    kind: Literal["grow", "shrink", "evict"]
    name: str
    num_blocks: int
    why: str


@dataclass
class _Tick:
    """Sizes as the tick decides them (views are frozen)."""

    sizes: dict[str, int]
    actions: list[Action] = field(default_factory=list)

    def resize(self, view: PoolView, n: int, why: str) -> None:
        kind: Literal["grow", "shrink"] = "grow" if n > self.sizes[view.name] else "shrink"
        self.sizes[view.name] = n
        self.actions = [a for a in self.actions if a.name != view.name]
        if n != view.num_blocks:
            self.actions.append(Action(kind, view.name, n, why))


def decide(pools: list[PoolView], pool_budget_bytes: int, policy: ArbiterPolicy) -> list[Action]:
    """The tick's actions, in the order to apply them (shrinks and evictions first)."""
    tick = _Tick({p.name: p.num_blocks for p in pools})
    over = sum(p.bytes for p in pools) - pool_budget_bytes
    if over > 0:
        _shrink_to_budget(pools, over, tick, policy)
        return tick.actions
    spare = -over
    for view in sorted(pools, key=lambda p: -p.priority):
        if view.starved_s >= policy.patience_s and not view.pinned:
            spare = _grow(view, pools, spare, tick, policy)
    return sorted(tick.actions, key=lambda a: a.kind == "grow")


def make_room(
    pools: list[PoolView], pool_budget_bytes: int, need_bytes: int, policy: ArbiterPolicy
) -> list[Action] | None:
    """Actions that free ``need_bytes`` of the pool budget for a model to load (its fixed
    bytes and floor), as a budget cut would; None when even evictions cannot."""
    tick = _Tick({p.name: p.num_blocks for p in pools})
    over = sum(p.bytes for p in pools) + need_bytes - pool_budget_bytes
    if over <= 0:
        return []
    left = _shrink_to_budget(pools, over, tick, policy, why="room for a model to load")
    return tick.actions if left <= 0 else None


def _shrink_to_budget(
    pools: list[PoolView], over: int, tick: _Tick, policy: ArbiterPolicy, why: str = "budget cut"
) -> int:
    """Shrink by priority down to the floors; then evict idle models until it fits. Returns
    the bytes still over (> 0: even that does not fit)."""
    for view in sorted(pools, key=lambda p: (p.pinned, p.priority, -p.idle_s)):
        if over <= 0:
            return over
        take = min(view.num_blocks - view.min_blocks, cdiv(over, view.bytes_per_block))
        if take > 0:
            tick.resize(view, view.num_blocks - take, f"{why}: shrink by priority")
            over -= take * view.bytes_per_block
    for view in sorted(pools, key=lambda p: (p.priority, -p.idle_s)):
        if over <= 0:
            return over
        if view.idle and view.idle_s >= policy.evict_idle_s:
            give_back = tick.sizes[view.name] * view.bytes_per_block + view.fixed_bytes
            tick.actions = [a for a in tick.actions if a.name != view.name]
            tick.actions.append(Action("evict", view.name, 0, f"{why}: floors do not fit"))
            over -= give_back
    return over


def _grow(
    view: PoolView, pools: list[PoolView], spare: int, tick: _Tick, policy: ArbiterPolicy
) -> int:
    """Grow a starved pool from ``spare`` bytes, then from donors; returns the spare left."""
    step = min(view.max_blocks - view.num_blocks, max(view.min_blocks, view.num_blocks // 2))
    if step <= 0:
        return spare
    from_spare = min(step, spare // view.bytes_per_block)
    got, spare = from_spare, spare - from_spare * view.bytes_per_block
    donors = [d for d in pools if d is not view and _can_give(d, policy)]
    for donor in sorted(donors, key=lambda d: (d.priority, -d.idle_s)):
        if got >= step:
            break
        want_bytes = (step - got) * view.bytes_per_block
        give = min(_spare_blocks(donor, tick), cdiv(want_bytes, donor.bytes_per_block))
        if give <= 0:
            continue
        tick.resize(donor, tick.sizes[donor.name] - give, f"to {view.name} (starved)")
        freed = give * donor.bytes_per_block + spare
        got += freed // view.bytes_per_block
        spare = freed % view.bytes_per_block
    if got > 0:
        n = min(view.max_blocks, view.num_blocks + got)
        tick.resize(view, n, f"requests waiting for blocks for {view.starved_s:.1f}s")
    return spare


def _can_give(donor: PoolView, policy: ArbiterPolicy) -> bool:
    return not donor.pinned and donor.starved_s == 0 and donor.since_grow_s >= policy.cooldown_s


def _spare_blocks(donor: PoolView, tick: _Tick) -> int:
    """Blocks a donor can give now: above its floor, its used blocks and their headroom."""
    keep = max(donor.min_blocks, donor.num_used_blocks + cdiv(donor.num_used_blocks, 4))
    return max(0, tick.sizes[donor.name] - keep)
