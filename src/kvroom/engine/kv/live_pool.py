"""The policy side of a live resize (torch-free): what size a request means, and the pool's state.

``resolve_resize`` turns what an operator asked for into a plan, by the same rules as at
start-up (``adjust.validate_num_blocks``: an int >= ``num_min_blocks``; ``"auto"``: re-fitted to
the memory there is now). While serving, the probe sees the process's own weights, runtime and
KV pool as used, so "auto" counts them back in::

    device_memory_now = available_now + weights + runtime + kv_bytes_now
    auto              = min(num_full_blocks, floor(kv_budget(device_memory_now) / block_bytes))

``KVCacheState`` is what ``GET /kv_cache`` and ``LLM.kv_cache_state`` report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvroom.adjust import require_estimate_fits, validate_num_blocks
from kvroom.device import DeviceMemory, probe
from kvroom.engine.kv.migration import ResizeResult, check_reserve
from kvroom.errors import ConfigError
from kvroom.plan import MemoryPlan

AUTO = "auto"


class PoolCounts(Protocol):
    """The pool's counters in an engine's stats (``EngineStats`` has them)."""

    num_total_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_kv_resizes: int


def resolve_resize(
    plan: MemoryPlan,
    requested: object,
    *,
    kv_bytes_now: int,
    max_num_blocks: int,
    memory: DeviceMemory | None = None,
    source: str = "resize",
) -> MemoryPlan:
    """The running ``plan`` with the pool size ``requested`` (an int, or ``"auto"``).

    Args:
        plan: the plan the engine runs with now.
        requested: the new ``kvcache_num_blocks``: an int or ``"auto"``.
        kv_bytes_now: bytes the KV pool holds now (counted back in for "auto").
        max_num_blocks: the pool's reserve; "auto" is capped at it, an int above it refused.
        memory: the memory available now (default: probe ``plan.device``).
        source: ``"resize"`` (an operator: sizes above the start-up estimate are warned
            about, as ``set`` does), ``"elastic"`` (the controller, which just measured the
            memory) or ``"arbiter"`` (a multi-model server's budget): only the minimum applies.

    Raises:
        ConfigError: not an int or "auto", <= 0, below ``num_min_blocks``, or above
            ``max_num_blocks``.
        MemoryNotEnoughError: "auto" finds too little memory.
    """
    if requested == AUTO:
        memory = memory or probe(plan.device)
        held = plan.weight_bytes + plan.runtime_bytes + kv_bytes_now
        fitted = plan.refit(
            DeviceMemory(memory.available_bytes + held, f"{memory.source} + held"),
            kvcache_memory_fraction=plan.kvcache_memory_fraction,
            kvcache_reserve_bytes=plan.kvcache_reserve_bytes,
        )
        require_estimate_fits(fitted)
        return fitted.with_num_blocks(min(fitted.estimated_num_blocks, max_num_blocks), "auto")
    if isinstance(requested, str) and requested.strip().isdigit():
        requested = int(requested)
    if isinstance(requested, str):
        raise ConfigError(f"num_blocks: must be an integer or 'auto', got {requested!r}")
    if isinstance(requested, int) and not isinstance(requested, bool):
        check_reserve(requested, max_num_blocks)
    if (
        source in ("elastic", "arbiter")
        and isinstance(requested, int)
        and requested >= plan.num_min_blocks
    ):
        return plan.with_num_blocks(requested, source)
    n = validate_num_blocks(requested, plan, source=source)
    return plan.with_num_blocks(n, source)


@dataclass(frozen=True)
class KVCacheState:
    """The pool now, for the admin API (bytes and blocks as the engine sees them)."""

    num_blocks: int
    block_size: int
    max_num_blocks: int
    """The address space reserved at start-up: the largest size a resize may reach."""
    num_min_blocks: int
    """The smallest size a resize may reach (one max_seq_len sequence)."""
    num_used_blocks: int
    num_free_blocks: int
    bytes: int
    """Bytes of the pool now (its full-attention blocks plus any sliding rings)."""
    bytes_per_block: int
    num_resizes: int
    last_resize: ResizeResult | None
    plan: MemoryPlan
    """The plan the pool size came from (``num_blocks_source``: estimate, override, resize...)."""
    populated: bool = False
    """True once every committed page is resident (CPU: the background fault-in finished)."""

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def of(
        cls,
        plan: MemoryPlan,
        stats: PoolCounts,
        *,
        max_num_blocks: int,
        last_resize: ResizeResult | None,
        populated: bool = False,
    ) -> KVCacheState:
        return cls(
            num_blocks=stats.num_total_blocks,
            block_size=plan.kvcache_block_size,
            max_num_blocks=max_num_blocks,
            num_min_blocks=plan.num_min_blocks,
            num_used_blocks=stats.num_used_blocks,
            num_free_blocks=stats.num_free_blocks,
            bytes=stats.num_total_blocks * plan.kv_bytes_per_block_per_rank
            + plan.sliding_window_bytes_per_rank,
            bytes_per_block=plan.kv_bytes_per_block_per_rank,
            num_resizes=stats.num_kv_resizes,
            last_resize=last_resize,
            plan=plan,
            populated=populated,
        )

    def to_dict(self) -> dict[str, Any]:
        last = self.last_resize
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
            "bytes": self.bytes,
            "bytes_per_block": self.bytes_per_block,
            "num_used_blocks": self.num_used_blocks,
            "num_free_blocks": self.num_free_blocks,
            "min_num_blocks": self.num_min_blocks,
            "max_num_blocks": self.max_num_blocks,
            "num_resizes": self.num_resizes,
            "last_resize": None if last is None else last.__dict__.copy(),
            "populated": self.populated,
            "source": self.plan.num_blocks_source,
            "plan": self.plan.to_dict(),
        }
