"""One served model of a multi-model server: its artifact, its cost, and, while loaded, its
engine thread and pool.

A slot is loaded (an ``LLM``, a ``ServerState`` whose engine thread runs, a ``LivePool``) or
evicted (nothing but its name, cost and metrics: the weights and the pool are freed). Its
metrics registry outlives evictions, so counters never go back. The arbiter reads a slot
through ``view``: demand (requests waiting for blocks, preemptions), idleness and its size.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvroom.engine.engine import EngineStats
from kvroom.plan.budget import ModelCost
from kvroom.server.admin import LivePool
from kvroom.server.app import build_state
from kvroom.server.metrics import ServerMetrics
from kvroom.server.multi.arbiter import PoolView
from kvroom.server.openai.serving import ServerState

IDLE_STATS = EngineStats(0, 0, 0, 0, 0, 0, 0, 0)
"""What an evicted model reports."""


@dataclass(frozen=True)
class ModelEntry:
    """One model as the operator asked for it."""

    artifact: str
    name: str
    """The served model name (``--served-model-name``; default the artifact path)."""
    min_blocks: int | None = None
    """The pool's floor (``--min-blocks NAME=N``; default one max_seq_len sequence)."""
    priority: float = 1.0
    """``--priority NAME=P``: weight in the split; the lowest shrinks and is evicted first."""


class ModelSlot:
    """A served model, loaded or evicted; ``lock`` guards its leases and its state."""

    def __init__(
        self, entry: ModelEntry, cost: ModelCost, max_seq_len: int, load_options: dict[str, Any]
    ) -> None:
        self.entry = entry
        self.cost = cost
        self.max_seq_len = max_seq_len
        self.load_options = load_options
        """``LLM`` keywords (device, prefix caching) and ``build_state``'s (tools, media)."""
        self.state: ServerState | None = None
        self.live: LivePool | None = None
        self.metrics = ServerMetrics(self.stats)
        self.lock = threading.Lock()
        self.load_lock = threading.Lock()
        """Held while loading, so concurrent first requests load the model once."""
        self.leases = 0
        self.pinned = False
        self.num_loads = 0
        self.num_evictions = 0
        self._last_active = time.monotonic()
        self._starved_since: float | None = None
        self._preemptions_seen = 0
        self.last_grow = -float("inf")

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def loaded(self) -> bool:
        return self.state is not None

    def stats(self) -> EngineStats:
        state = self.state
        return IDLE_STATS if state is None else state.engine.stats

    # -- loading ---------------------------------------------------------------------------

    def load(self, num_blocks: int, max_blocks: int) -> None:
        """Load the artifact with a pool of ``num_blocks`` (room for ``max_blocks``) and start
        its engine thread. Call with ``load_lock`` held, never on the event loop."""
        from kvroom.llm import LLM

        llm_options = {k: self.load_options[k] for k in ("device", "enable_prefix_caching")}
        llm = LLM(
            self.entry.artifact,
            kvcache_num_blocks=num_blocks,
            kvcache_max_blocks=max_blocks,
            **llm_options,
        )
        state, live = build_state(
            llm,
            served_model_name=self.name,
            allowed_local_media_path=self.load_options.get("allowed_local_media_path"),
            tool_options=self.load_options.get("tool_options"),
            metrics=self.metrics,
        )
        state.engine.start()
        with self.lock:
            self.state, self.live = state, live
            self.num_loads += 1
            self._preemptions_seen = 0
            self._last_active = time.monotonic()

    def evict(self) -> bool:
        """Stop the engine and free the weights and the pool, if nothing uses the model:
        no lease and nothing queued (asked on the engine thread, after its queued commands).
        Returns whether it was evicted."""
        with self.lock:
            state = self.state
            if state is None or self.leases:
                return False
            if state.engine.run_between_steps(lambda engine: engine.has_unfinished()):
                return False
            self.state, self.live = None, None
            self.num_evictions += 1
        state.engine.shutdown()
        state.tokenizers.shutdown()
        del state
        _free_memory()
        return True

    def shutdown(self) -> None:
        state = self.state
        if state is not None:
            state.engine.shutdown()
            state.tokenizers.shutdown()

    # -- leases ----------------------------------------------------------------------------

    def acquire(self) -> ServerState | None:
        """Take a lease; the state if loaded (else the caller loads it and tries again)."""
        with self.lock:
            self.leases += 1
            self._last_active = time.monotonic()
            return self.state

    def release(self) -> None:
        with self.lock:
            self.leases -= 1
            self._last_active = time.monotonic()

    # -- what the arbiter sees -------------------------------------------------------------

    def view(self, now: float) -> PoolView | None:
        """The pool for the arbiter (None while evicted); updates demand and idleness."""
        state = self.state
        if state is None:
            return None
        s = state.engine.stats
        busy = self.leases or s.num_running or s.num_waiting
        if busy:
            self._last_active = now
        waiting_for_blocks = s.num_waiting > 0 and s.num_running < state.max_num_seqs
        preempted = s.num_preemptions > self._preemptions_seen
        self._preemptions_seen = s.num_preemptions
        if waiting_for_blocks or preempted:
            self._starved_since = self._starved_since if self._starved_since else now
        else:
            self._starved_since = None
        return PoolView(
            name=self.name,
            num_blocks=s.num_total_blocks,
            num_used_blocks=s.num_used_blocks,
            min_blocks=self.cost.min_blocks,
            max_blocks=self.cost.max_blocks,
            bytes_per_block=self.cost.bytes_per_block,
            fixed_bytes=self.cost.fixed_bytes,
            priority=self.cost.priority,
            starved_s=0.0 if self._starved_since is None else max(now - self._starved_since, 1e-9),
            idle_s=0.0 if busy else max(now - self._last_active, 1e-9),
            since_grow_s=now - self.last_grow,
            pinned=self.pinned,
        )


def _free_memory() -> None:
    """Collect the evicted model's cycles and give the freed heap back to the kernel."""
    from kvroom import heap

    gc.collect()
    heap.trim()
