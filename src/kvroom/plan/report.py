"""The plan as ``kvroom plan`` prints it: the budget line by line, and the non-KV terms with
the formula and the measured figures side by side."""

from __future__ import annotations

from kvroom.plan.estimate import MemoryPlan
from kvroom.plan.sharing import shared_prefix_row
from kvroom.units import format_bytes

SCALE_LABELS = {"int8": "float32 scales", "int4": "float16 scales and mins"}
"""What closes each quantized row, by kv_dtype (``models/kv_quant.py``)."""


def plan_table(plan: MemoryPlan) -> str:
    """The breakdown, one figure per line, as printed by ``kvroom plan``."""
    fraction = plan.kvcache_memory_fraction
    measured = plan.runtime_bytes if plan.measured else plan.measured_runtime_bytes
    rows = [
        (
            f"device memory ({_memory_source(plan)})",
            format_bytes(plan.device_memory_bytes),
        ),
        (
            f"x kvcache_memory_fraction {fraction:g}",
            format_bytes(int(plan.device_memory_bytes * fraction)),
        ),
        ("- kvcache_reserve_memory", format_bytes(plan.kvcache_reserve_bytes)),
        ("= usable", format_bytes(plan.usable_bytes)),
        ("- weights", format_bytes(plan.weight_bytes)),
        *_weight_type_rows(plan),
        ("- runtime buffers (formula)", format_bytes(plan.runtime_buffer_bytes)),
        ("- runtime buffers (measured)", "-" if measured is None else format_bytes(measured)),
        ("- sliding-window KV (fixed)", format_bytes(plan.sliding_window_bytes_per_rank)),
        ("= KV budget", format_bytes(plan.kv_budget_bytes)),
        (
            f"/ bytes per block ({plan.kvcache_block_size} tokens, {plan.kv_dtype})",
            format_bytes(plan.kv_bytes_per_block_per_rank),
        ),
        ("= blocks that fit", str(plan.num_fit_blocks)),
        (f"blocks for one full sequence ({plan.max_seq_len} tokens)", str(plan.num_min_blocks)),
        (f"blocks for batch_size={plan.batch_size} full sequences", str(plan.num_full_blocks)),
        ("estimated kvcache_num_blocks", str(plan.estimated_num_blocks)),
        (f"chosen kvcache_num_blocks ({plan.num_blocks_source})", str(plan.num_blocks)),
        ("KV pool", f"{plan.num_tokens} tokens, {format_bytes(plan.kv_bytes)}"),
        ("max concurrency at max_seq_len", str(plan.max_concurrency)),
        shared_prefix_row(
            num_blocks=plan.num_blocks,
            block_size=plan.kvcache_block_size,
            max_seq_len=plan.max_seq_len,
            batch_size=plan.batch_size,
            has_sliding_layers=plan.sliding_window_bytes > 0,
        ),
        ("total at peak: kvroom run / LLM", format_bytes(plan.total_bytes)),
        ("total at peak: kvroom serve", format_bytes(plan.serve_total_bytes)),
    ]
    if plan.vision_bytes:
        budget = rows.index(("= KV budget", format_bytes(plan.kv_budget_bytes)))
        rows.insert(budget, ("- vision encoder + cache (fixed)", format_bytes(plan.vision_bytes)))
    if plan.image_tokens:
        rows.append((f"tokens per image ({plan.image_limit})", str(plan.image_tokens)))
    rows += _kv_group_rows(plan)
    rows = _with_scale_rows(rows, plan)
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value:>14}" for label, value in rows]
    if plan.tensor_parallel_size > 1:
        lines.insert(0, f"(bytes per rank of tensor_parallel_size={plan.tensor_parallel_size})")
    return "\n".join(lines)


def _weight_type_rows(plan: MemoryPlan) -> list[tuple[str, str]]:
    """One row per kind of weight tensor as loaded, when they are not all in the model dtype."""
    tp = plan.tensor_parallel_size
    return [(f"    {kind}", format_bytes(-(-size // tp))) for kind, size in plan.weight_types]


def _with_scale_rows(rows: list[tuple[str, str]], plan: MemoryPlan) -> list[tuple[str, str]]:
    """int8/int4 KV: the bytes per block split into values and scales, below its row."""
    scales = plan.kv_scale_bytes_per_block // plan.tensor_parallel_size
    if not scales:
        return rows
    at = next(i for i, (label, _) in enumerate(rows) if label.startswith("/ bytes per block"))
    values = plan.kv_bytes_per_block_per_rank - scales
    split = [
        (f"    {plan.kv_dtype} K/V values", format_bytes(values)),
        (f"    {SCALE_LABELS[plan.kv_dtype]} (per token, kv head)", format_bytes(scales)),
    ]
    return rows[: at + 1] + split + rows[at + 1 :]


def _kv_group_rows(plan: MemoryPlan) -> list[tuple[str, str]]:
    """One row per pool tensor, shown when the layers do not all keep one KV shape."""
    groups = plan.kv_groups
    if len(groups) <= 1 and not any("K=V" in g or "share" in g for g in groups):
        return []
    return [(f"KV pool tensor {i + 1}", g) for i, g in enumerate(groups)]


def terms_table(plan: MemoryPlan) -> str:
    """Non-KV memory at the peak, the formula and the measured terms side by side."""
    m = plan.measured
    rows: list[tuple[str, str, str]] = [
        (
            "weights (as loaded)" if plan.weight_types else "weights (parameters x dtype bytes)",
            format_bytes(plan.weight_bytes),
            "-",
        ),
        ("runtime buffers (formula)", format_bytes(plan.runtime_buffer_bytes), "-"),
    ]
    rows += [(label, "-", format_bytes(v)) for label, v in (m.rows() if m else [])]
    fixed = m.fixed_bytes(serve=False) if m else None
    rows.append(
        (
            "= besides KV, at the run peak",
            format_bytes(plan.weight_bytes + plan.runtime_buffer_bytes),
            "-" if fixed is None else format_bytes(fixed),
        )
    )
    rows.append(("+ KV pool", format_bytes(plan.kv_bytes), format_bytes(plan.kv_bytes)))
    rows.append(
        (
            "= total at peak (kvroom run / LLM)",
            format_bytes(plan.formula_total_bytes),
            format_bytes(plan.total_bytes) if m else "-",
        )
    )
    if m:
        error = 100.0 * (plan.formula_total_bytes - plan.total_bytes) / plan.total_bytes
        rows.append(("formula vs measured", f"{error:+.1f}%", ""))
        if m.file_backed_bytes:
            files = format_bytes(m.file_backed_bytes)
            rows.append(("  of which mapped files (libraries)", "", files))
    width = max(len(r[0]) for r in rows)
    head = f"{'non-KV memory at peak':<{width}}  {'formula':>12}  {'measured':>12}"
    return "\n".join([head] + [f"{a:<{width}}  {b:>12}  {c:>12}" for a, b, c in rows])


def _memory_source(plan: MemoryPlan) -> str:
    """``cpu, psutil``; a cgroup limit names itself alone (only a CPU has one)."""
    source = plan.device_memory_source
    return source if source.startswith("cgroup-") else f"{plan.device}, {source}"
