"""The models of a multi-model server under one budget: routing, loading, the arbiter's moves.

``MultiModels`` is the server's ``ModelRouter`` (``server/openai/routing.py``) and the one
place sizes change: the arbiter's ticks, a reload's room-making and an operator's resize all
run under ``self.lock``, so the budget account is never read half-changed. Bytes held::

    held = process (once) + sum over loaded models (weights + runtime + pool)

A request for an evicted model reloads it (off the event loop): room is made as a budget cut
would make it (shrink by priority, then evict idle models), else a 503 names the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

from kvroom.engine.kv.migration import ResizeResult
from kvroom.errors import MemoryNotEnoughError
from kvroom.plan.budget import SharedBudget
from kvroom.server.async_engine import AsyncEngine
from kvroom.server.multi.arbiter import Action, ArbiterPolicy, PoolView, decide, make_room
from kvroom.server.multi.budget_source import FixedBudget
from kvroom.server.multi.metrics import MultiMetrics
from kvroom.server.multi.slot import ModelSlot
from kvroom.server.openai.protocol import ApiError
from kvroom.server.openai.responses import ModelCard
from kvroom.server.openai.routing import model_not_found
from kvroom.server.openai.serving import ServerState
from kvroom.units import format_bytes

logger = logging.getLogger("kvroom")

NUM_DECISIONS_KEPT = 32


class MultiModels:
    """Several ``ModelSlot``s sharing ``budget``; moves blocks by ``policy``."""

    def __init__(self, slots: list[ModelSlot], budget: FixedBudget, policy: ArbiterPolicy) -> None:
        self.slots = {slot.name: slot for slot in slots}
        self.budget = budget
        self.policy = policy
        self.lock = threading.RLock()
        self.decisions: deque[dict[str, Any]] = deque(maxlen=NUM_DECISIONS_KEPT)
        self.metrics = MultiMetrics(self._registries, self.budget_now, self.slots)
        self.shared_bytes = max(slot.cost.shared_bytes for slot in slots)

    # -- the budget ----------------------------------------------------------------------

    def held_bytes(self) -> int:
        loaded = [s for s in self.slots.values() if s.loaded]
        return self.shared_bytes + sum(s.cost.fixed_bytes for s in loaded) + self._pool_bytes()

    def pool_budget_bytes(self) -> int:
        """What the loaded models' pools may hold together now."""
        fixed = sum(s.cost.fixed_bytes for s in self.slots.values() if s.loaded)
        return self.budget.budget_bytes(self.held_bytes()) - self.shared_bytes - fixed

    def budget_now(self) -> tuple[int, int, dict[str, bool]]:
        budget = self.budget.budget_bytes(self.held_bytes())
        fixed = sum(s.cost.fixed_bytes for s in self.slots.values() if s.loaded)
        loaded = {name: s.loaded for name, s in self.slots.items()}
        return budget, budget - self.shared_bytes - fixed, loaded

    # -- start and stop ------------------------------------------------------------------

    def load_all(self) -> None:
        """Load every model with its share of the budget (``SharedBudget.split``).

        Raises:
            MemoryNotEnoughError: the floors do not fit the budget (names what to change).
        """
        costs = tuple(slot.cost for slot in self.slots.values())
        shared = SharedBudget(self.budget.budget_bytes(self.shared_bytes), costs)
        if not shared.fits:
            raise MemoryNotEnoughError(shared.shortfall_message())
        for name, num_blocks in shared.split().items():
            slot = self.slots[name]
            with slot.load_lock:
                slot.load(num_blocks, slot.cost.max_blocks)
            self._record(Action("grow", name, num_blocks, "start"), "load", 0)

    def shutdown(self) -> None:
        for slot in self.slots.values():
            slot.shutdown()

    # -- the arbiter ---------------------------------------------------------------------

    def views(self) -> list[PoolView]:
        now = time.monotonic()
        return [v for s in self.slots.values() if (v := s.view(now)) is not None]

    def tick(self) -> list[Action]:
        """One arbiter decision over every pool, applied; returns what was applied."""
        with self.lock:
            actions = decide(self.views(), self.pool_budget_bytes(), self.policy)
            return [a for a in actions if self.apply(a)]

    def apply(self, action: Action) -> bool:
        """Resize or evict as ``action`` says; one log line and one count. False: skipped
        (the model became busy before it could be evicted)."""
        slot = self.slots[action.name]
        before = slot.stats().num_total_blocks
        if action.kind == "evict":
            if not slot.evict():
                return False
            logger.info(
                "arbiter: evicted %s (%s); reloaded on its next request", slot.name, action.why
            )
        else:
            assert slot.live is not None, "resize of an evicted model"
            why = f"{slot.name}: arbiter {action.kind}, {action.why}"
            slot.live.resize(action.num_blocks, why=why, source="arbiter")
            if action.kind == "grow":
                slot.last_grow = time.monotonic()
        self._record(action, action.kind, before)
        return True

    def resize(self, name: str, num_blocks: int, *, pin: bool, why: str) -> ResizeResult:
        """An operator's resize of one pool (``POST /kv_cache``), within the budget; ``pin``
        keeps the arbiter's hands off it until the budget forces a shrink.

        Raises:
            ApiError: 409 for an evicted model, 400 past the budget.
            KvroomError: refused by the pool (below one sequence, past its reserve).
        """
        slot = self.slot(name)
        with self.lock:
            if slot.live is None:
                raise ApiError(409, f"model '{name}' is evicted; send it a request to load it")
            now = slot.stats().num_total_blocks
            bpb = slot.cost.bytes_per_block
            room = self.pool_budget_bytes() - self._pool_bytes() + now * bpb
            if num_blocks * bpb > room:
                raise ApiError(
                    400,
                    f"num_blocks: {num_blocks} blocks of '{name}' "
                    f"({format_bytes(num_blocks * bpb)}) do not fit the {format_bytes(room)} "
                    "the memory budget leaves it; shrink another model first",
                    param="num_blocks",
                )
            result = slot.live.resize(num_blocks, why=f"{name}: {why}", source="resize")
            slot.pinned = pin
            kind = "grow" if result.to_blocks > now else "shrink"
            self._record(Action(kind, name, result.to_blocks, why), "", now)
            return result

    def _pool_bytes(self) -> int:
        """Bytes of the loaded pools now (read without touching the demand tracking)."""
        loaded = [s for s in self.slots.values() if s.loaded]
        return sum(s.stats().num_total_blocks * s.cost.bytes_per_block for s in loaded)

    def _record(self, action: Action, kind: str, before: int) -> None:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": action.name,
            "action": action.kind if kind != "load" else "load",
            "from_blocks": before,
            "to_blocks": action.num_blocks,
            "why": action.why,
        }
        self.decisions.append(entry)
        if kind:
            self.metrics.moves.labels(kind=kind, model=action.name).inc()

    # -- loading on demand ---------------------------------------------------------------

    def ensure_loaded(self, slot: ModelSlot) -> None:
        """Load an evicted model, making room first (blocking; off the event loop).

        Raises:
            ApiError: 503 when even evicting the idle models leaves too little budget.
        """
        with slot.load_lock:
            if slot.loaded:
                return
            with self.lock:
                need = slot.cost.fixed_bytes + slot.cost.floor_bytes
                actions = make_room(self.views(), self.pool_budget_bytes(), need, self.policy)
                if actions is None or not all(self.apply(a) for a in actions):
                    raise ApiError(
                        503,
                        f"model '{slot.name}' is evicted and cannot be reloaded now: it needs "
                        f"{format_bytes(need)} of the memory budget and the models loaded hold the "
                        "rest; retry later or raise --memory-budget",
                        code="model_not_loaded",
                    )
                spare = self.pool_budget_bytes() - self._pool_bytes() - slot.cost.fixed_bytes
                n = min(
                    slot.cost.max_blocks,
                    max(slot.cost.min_blocks, spare // slot.cost.bytes_per_block),
                )
                slot.load(n, slot.cost.max_blocks)
                logger.info(
                    "arbiter: loaded %s with %d blocks (a request asked for it)", slot.name, n
                )
                self._record(Action("grow", slot.name, n, "a request asked for it"), "load", 0)

    # -- the ModelRouter -----------------------------------------------------------------

    def slot(self, model: str | None) -> ModelSlot:
        if model is None:
            names = ", ".join(f"'{n}'" for n in self.slots)
            raise ApiError(400, f"'model' is required: this server serves {names}", param="model")
        slot = self.slots.get(model)
        if slot is None:
            raise model_not_found(model, list(self.slots))
        return slot

    @contextlib.asynccontextmanager
    async def lease(self, model: str | None) -> AsyncIterator[ServerState]:
        slot = self.slot(model)
        state = slot.acquire()
        while state is None:  # evicted: reload (an arbiter tick may evict it again: retry)
            slot.release()
            await asyncio.to_thread(self.ensure_loaded, slot)
            state = slot.acquire()
        try:
            yield state
        finally:
            slot.release()

    def cards(self) -> list[ModelCard]:
        return [_card(slot) for slot in self.slots.values()]

    def engines(self) -> list[AsyncEngine]:
        return [state.engine for state in self._states()]

    def render_metrics(self) -> tuple[bytes, str]:
        return self.metrics.render()

    def _states(self) -> Iterator[ServerState]:
        for slot in self.slots.values():
            if slot.state is not None:
                yield slot.state

    def _registries(self) -> Iterator[tuple[str, Any]]:
        for slot in self.slots.values():
            yield slot.name, slot.metrics.registry


def _card(slot: ModelSlot) -> ModelCard:
    return ModelCard(id=slot.name, root=slot.entry.artifact, max_model_len=slot.max_seq_len)
