"""Why a plan's KV pool cannot hold one full-length sequence, said with the term that does not
fit and the settings that would help (the text of ``Memory is not enough``).

The budget is spent in this order (``plan.estimate``)::

    share  = device_memory x kvcache_memory_fraction
    usable = share - kvcache_reserve_memory
    fixed  = weights + runtime + sliding-window KV + vision             (everything but blocks)
    need   = fixed + num_min_blocks x bytes_per_block                   (one full-length sequence)

The first term that does not fit is named: the reserve (usable <= 0), the weights alone, the
fixed terms, or the KV blocks. No message shows a negative figure. The memory that would do is
``(need + reserve) / fraction``, rounded up.
"""

from __future__ import annotations

import math

from kvroom.plan.estimate import MemoryPlan
from kvroom.units import format_bytes


def shortfall_message(plan: MemoryPlan) -> str:
    """``Memory is not enough: ...`` for a plan whose estimate is below ``num_min_blocks``."""
    share = int(plan.device_memory_bytes * plan.kvcache_memory_fraction)
    if plan.usable_bytes <= 0:
        return f"Memory is not enough: {_reserve_takes_all(plan, share)}"
    fixed = _fixed_bytes(plan)
    if plan.weight_bytes > plan.usable_bytes:
        what = f"the weights alone ({format_bytes(plan.weight_bytes)})"
    elif fixed > plan.usable_bytes:
        what = f"{_fixed_terms(plan)} = {format_bytes(fixed)}"
    else:
        return f"Memory is not enough: {_blocks_do_not_fit(plan)}. To fit: {_remedies(plan)}"
    return f"Memory is not enough: {what} exceed the {_usable(plan)}. To fit: {_remedies(plan)}"


def min_device_memory_bytes(plan: MemoryPlan, *, reserve_bytes: int | None = None) -> int:
    """The device memory at which this plan holds one full-length sequence."""
    reserve = plan.kvcache_reserve_bytes if reserve_bytes is None else reserve_bytes
    return math.ceil((_need_bytes(plan) + reserve) / plan.kvcache_memory_fraction)


def _fixed_bytes(plan: MemoryPlan) -> int:
    """Everything the budget holds besides the KV blocks."""
    return (
        plan.weight_bytes
        + plan.runtime_bytes
        + plan.sliding_window_bytes_per_rank
        + plan.vision_bytes
    )


def _need_bytes(plan: MemoryPlan) -> int:
    return _fixed_bytes(plan) + plan.num_min_blocks * plan.kv_bytes_per_block_per_rank


def _usable(plan: MemoryPlan) -> str:
    reserve = plan.kvcache_reserve_bytes
    minus = f" - kvcache_reserve_memory {format_bytes(reserve)}" if reserve else ""
    return (
        f"{format_bytes(plan.usable_bytes)} usable ({format_bytes(plan.device_memory_bytes)} "
        f"device memory x kvcache_memory_fraction {plan.kvcache_memory_fraction:g}{minus})"
    )


def _fixed_terms(plan: MemoryPlan) -> str:
    terms = [
        ("weights", plan.weight_bytes),
        (_runtime_label(plan), plan.runtime_bytes),
        ("sliding-window KV", plan.sliding_window_bytes_per_rank),
        ("vision encoder", plan.vision_bytes),
    ]
    return " + ".join(f"{name} {format_bytes(b)}" for name, b in terms if b)


def _runtime_label(plan: MemoryPlan) -> str:
    measured = plan.measured is not None or plan.measured_runtime_bytes is not None
    return "runtime (measured)" if measured else "runtime buffers"


def _blocks_do_not_fit(plan: MemoryPlan) -> str:
    return (
        f"one full-length sequence (max_seq_len={plan.max_seq_len}) needs "
        f"{plan.num_min_blocks} blocks of {plan.kvcache_block_size} tokens and "
        f"{plan.num_fit_blocks} fit in the KV budget of {format_bytes(plan.kv_budget_bytes)}, "
        f"what the {_usable(plan)} leaves after {_fixed_terms(plan)}"
    )


def _reserve_takes_all(plan: MemoryPlan, share: int) -> str:
    need = _need_bytes(plan)
    if share > need:
        fix = f"reserve at most {format_bytes(share - need)}"
    else:
        fix = (
            f"reserve less, and give kvroom at least "
            f"{format_bytes(min_device_memory_bytes(plan, reserve_bytes=0))} of device memory"
        )
    return (
        f"kvcache_reserve_memory ({format_bytes(plan.kvcache_reserve_bytes)}) leaves nothing of "
        f"the {format_bytes(share)} kvroom may use ({format_bytes(plan.device_memory_bytes)} "
        f"device memory x kvcache_memory_fraction {plan.kvcache_memory_fraction:g}), and the "
        f"weights, runtime and one sequence's KV need {format_bytes(need)}. To fit: {fix}"
    )


def _remedies(plan: MemoryPlan) -> str:
    """The settings that would help, the most direct first."""
    fixes = [
        f"give kvroom at least {format_bytes(min_device_memory_bytes(plan))} of device memory "
        f"(device_memory now {format_bytes(plan.device_memory_bytes)}, "
        f"{plan.device_memory_source})"
    ]
    if plan.kvcache_reserve_bytes:
        fixes.append(
            f"reserve less (kvcache_reserve_memory now {format_bytes(plan.kvcache_reserve_bytes)})"
        )
    if plan.kvcache_memory_fraction < 1:
        fixes.append(f"raise kvcache_memory_fraction (now {plan.kvcache_memory_fraction:g})")
    if plan.weight_bytes <= plan.usable_bytes:
        fixes.append(
            f"lower max_seq_len (now {plan.max_seq_len}) or batch_size (now {plan.batch_size})"
        )
    if _fixed_bytes(plan) <= plan.usable_bytes:
        fixes.append(f"use a smaller kv_dtype (now {plan.kv_dtype})")
    return ", ".join(fixes[:-1]) + (", or " if len(fixes) > 1 else "") + fixes[-1]
