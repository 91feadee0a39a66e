"""Pure memory math: bytes of weights, runtime buffers and KV blocks, and the fitted plan."""

from kvroom.plan.estimate import MemoryPlan, compute_plan

__all__ = ["MemoryPlan", "compute_plan"]
