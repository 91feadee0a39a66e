"""Several models under one memory budget: what each costs, and how the shared pool is split.

Every loaded model holds fixed bytes (its weights and runtime terms) and a KV pool of whole
blocks; the process itself (interpreter, torch: the measured ``process`` term) is paid once::

    fixed(m)   = weights(m) + runtime(m) - shared(m)      runtime: plan.runtime_bytes + sliding
    shared     = max over models of shared(m)             + vision (the measured process term)
    pool       = budget - shared - sum fixed(m)           the shared KV pool, in bytes
    floor(m)   = min_blocks(m) x bytes_per_block(m)       one max_seq_len sequence by default
    fits       = pool >= sum floor(m)

Past the floors the pool is split by ``priority`` (a weight: a model of priority 2 starts with
twice the blocks of one of priority 1 past its floor), each capped at ``max_blocks`` (what its
batch can use). Pure math over plain numbers: ``kvroom plan A B C`` prints it and the
multi-model server starts from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroom.errors import ConfigError
from kvroom.plan.estimate import MemoryPlan
from kvroom.units import format_bytes


@dataclass(frozen=True)
class ModelCost:
    """One model's share of the budget, in bytes and blocks."""

    name: str
    """The served model name."""
    weight_bytes: int
    runtime_bytes: int
    """Everything besides weights and KV blocks (runtime terms, sliding-window slots, vision),
    less ``shared_bytes``."""
    bytes_per_block: int
    min_blocks: int
    """The floor: the pool never shrinks below (one ``max_seq_len`` sequence by default)."""
    max_blocks: int
    """The most blocks it can use (``batch_size`` full sequences)."""
    priority: float = 1.0
    """Weight in the split; the lowest priority shrinks (and is evicted) first."""
    shared_bytes: int = 0
    """The process's own bytes (interpreter, torch), paid once for the whole set."""

    def __post_init__(self) -> None:
        if self.min_blocks <= 0 or self.bytes_per_block <= 0:
            raise ConfigError(
                f"{self.name}: min_blocks ({self.min_blocks}) and bytes_per_block "
                f"({self.bytes_per_block}) must be > 0"
            )
        if self.priority <= 0:
            raise ConfigError(f"{self.name}: priority must be > 0, got {self.priority:g}")

    @property
    def fixed_bytes(self) -> int:
        return self.weight_bytes + self.runtime_bytes

    @property
    def floor_bytes(self) -> int:
        return self.min_blocks * self.bytes_per_block

    @classmethod
    def of(
        cls,
        name: str,
        plan: MemoryPlan,
        *,
        min_blocks: int | None = None,
        priority: float = 1.0,
    ) -> ModelCost:
        """The cost of a model planned as ``plan`` (per rank), floor ``min_blocks``.

        Raises:
            ConfigError: ``min_blocks`` below one ``max_seq_len`` sequence.
        """
        floor = plan.num_min_blocks if min_blocks is None else min_blocks
        if floor < plan.num_min_blocks:
            raise ConfigError(
                f"--min-blocks {name}={floor}: below one max_seq_len={plan.max_seq_len} "
                f"sequence ({plan.num_min_blocks} blocks)"
            )
        shared = plan.measured.process_bytes if plan.measured is not None else 0
        runtime = plan.runtime_bytes + plan.sliding_window_bytes_per_rank + plan.vision_bytes
        return cls(
            name=name,
            weight_bytes=plan.weight_bytes,
            runtime_bytes=runtime - shared,
            bytes_per_block=plan.kv_bytes_per_block_per_rank,
            min_blocks=floor,
            max_blocks=max(plan.num_full_blocks, floor),
            priority=priority,
            shared_bytes=shared,
        )


@dataclass(frozen=True)
class SharedBudget:
    """A set of models under ``budget_bytes``; see the module docstring."""

    budget_bytes: int
    models: tuple[ModelCost, ...]

    @property
    def shared_bytes(self) -> int:
        return max((m.shared_bytes for m in self.models), default=0)

    @property
    def fixed_bytes(self) -> int:
        return self.shared_bytes + sum(m.fixed_bytes for m in self.models)

    @property
    def pool_bytes(self) -> int:
        """The shared KV pool: what is left once every model's fixed bytes are paid."""
        return self.budget_bytes - self.fixed_bytes

    @property
    def floor_bytes(self) -> int:
        return sum(m.floor_bytes for m in self.models)

    @property
    def fits(self) -> bool:
        return self.pool_bytes >= self.floor_bytes

    @property
    def need_bytes(self) -> int:
        """The smallest budget that fits every floor."""
        return self.fixed_bytes + self.floor_bytes

    def split(self) -> dict[str, int]:
        """Blocks per model: its floor, plus the rest of the pool by priority, capped."""
        blocks = {m.name: m.min_blocks for m in self.models}
        spare = self.pool_bytes - self.floor_bytes
        open_models = [m for m in self.models if m.max_blocks > m.min_blocks]
        while spare > 0 and open_models:
            total = sum(m.priority for m in open_models)
            given = 0
            for m in open_models:
                add = int(spare * m.priority / total) // m.bytes_per_block
                add = min(add, m.max_blocks - blocks[m.name])
                blocks[m.name] += add
                given += add * m.bytes_per_block
            open_models = [m for m in open_models if blocks[m.name] < m.max_blocks]
            if given == 0:
                break
            spare -= given
        return blocks

    def shortfall_message(self) -> str:
        """``Memory is not enough: ...`` naming the models and settings that would fit it."""
        short = self.need_bytes - self.budget_bytes
        by_floor = sorted(self.models, key=lambda m: m.fixed_bytes + m.floor_bytes, reverse=True)
        largest = ", ".join(
            f"{m.name} ({format_bytes(m.fixed_bytes)} fixed + {m.min_blocks} blocks "
            f"{format_bytes(m.floor_bytes)})"
            for m in by_floor
        )
        return (
            f"Memory is not enough: the models need {format_bytes(self.need_bytes)} "
            f"(fixed terms and one max_seq_len sequence each), the budget is "
            f"{format_bytes(self.budget_bytes)}, {format_bytes(short)} short. Largest first: "
            f"{largest}. To fit: raise --memory-budget/--device-memory to at least "
            f"{format_bytes(self.need_bytes)}, drop {by_floor[0].name}, or compile it with a "
            "smaller max_seq_len (a lower floor) or a quantized dtype (smaller weights)"
        )


def budget_table(budget: SharedBudget) -> str:
    """One row per model (weights, runtime, floor, starting pool) and the totals."""
    blocks = budget.split() if budget.fits else {m.name: m.min_blocks for m in budget.models}
    width = max([len("model"), *(len(m.name) for m in budget.models)])
    head = f"{'model':<{width}}  {'weights':>11}  {'runtime':>11}  {'floor':>18}  {'pool':>18}"
    lines = [head, "-" * len(head)]
    for m in budget.models:
        n = blocks[m.name]
        floor = f"{m.min_blocks} = {format_bytes(m.floor_bytes)}"
        pool = f"{n} = {format_bytes(n * m.bytes_per_block)}"
        lines.append(
            f"{m.name:<{width}}  {format_bytes(m.weight_bytes):>11}  "
            f"{format_bytes(m.runtime_bytes):>11}  {floor:>18}  {pool:>18}"
        )
    lines.append("-" * len(head))
    rows = [
        ("memory budget", budget.budget_bytes),
        ("- process (paid once)", budget.shared_bytes),
        ("- weights and runtime of every model", budget.fixed_bytes - budget.shared_bytes),
        ("= shared KV pool", budget.pool_bytes),
        ("  of which floors (one max_seq_len sequence each)", budget.floor_bytes),
    ]
    label = max(len(r[0]) for r in rows)
    lines += [f"{name:<{label}}  {format_bytes(value):>11}" for name, value in rows]
    verdict = "fits" if budget.fits else budget.shortfall_message()
    lines.append(f"the set {verdict}" if budget.fits else verdict)
    return "\n".join(lines)
