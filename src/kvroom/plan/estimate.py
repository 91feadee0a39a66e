"""Fit the KV pool into a memory budget, and the ``MemoryPlan`` that records every figure.

Budget, all per rank::

    usable    = device_memory x kvcache_memory_fraction - kvcache_reserve_memory
    kv_budget = usable - weights - runtime (measured if known, else the formula) - sliding_window
    total     = what the process holds at its peak (``total_bytes``)
    fit       = floor(kv_budget / (kv_bytes_per_block / tp))     (exact: integer division)
    estimate  = min(num_full_blocks, fit)

``fit`` may be below ``num_min_blocks``; deciding that this is an error is the policy's job
(``kvroom.adjust``), so a plan can still be printed for a budget that does not fit.

With measured terms (``plan.measured``, from compile's profiling pass), "weights + runtime" is
everything a ``kvroom serve`` process holds at its run peak besides the KV pool, so the pool
that fits leaves room for the server too; ``total_bytes`` is the peak of a process running
the artifact (``kvroom run``, ``kvroom.LLM``), ``serve_total_bytes`` that of ``kvroom serve``.
Without them, both are the formula's ``weights + runtime buffers + KV``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvroom.config import DecoderOnlyConfig
from kvroom.device import DeviceMemory
from kvroom.model_spec import ModelSpec
from kvroom.plan.buffers import runtime_buffer_bytes
from kvroom.plan.kv import (
    describe_kv_groups,
    kv_bytes_per_block,
    kv_scale_bytes_per_block,
    sliding_window_bytes,
)
from kvroom.plan.measured import MeasuredTerms
from kvroom.plan.weights import weight_bytes
from kvroom.units import mib


@dataclass(frozen=True)
class MemoryPlan:
    """Every figure behind a KV pool size. Bytes are per rank."""

    device: str
    device_memory_bytes: int
    device_memory_source: str
    kvcache_memory_fraction: float
    kvcache_reserve_bytes: int
    weight_bytes: int
    runtime_buffer_bytes: int
    """The formula of ``kvroom.plan.buffers``."""
    measured_runtime_bytes: int | None
    """Non-KV runtime memory measured by a profiling pass; used instead of the formula when set."""
    sliding_window_bytes: int
    """Sliding-window KV over all ranks (``ceil(kv_heads/tp) x tp`` heads)."""
    kv_bytes_per_block: int
    """One block over all ranks (``ceil(kv_heads/tp) x tp`` heads); a rank holds 1/tp of it."""
    kvcache_block_size: int
    max_seq_len: int
    batch_size: int
    kv_dtype: str
    tensor_parallel_size: int
    num_min_blocks: int
    num_full_blocks: int
    num_fit_blocks: int
    """Blocks the budget holds, uncapped; negative budgets give 0."""
    estimated_num_blocks: int
    """min(num_full_blocks, num_fit_blocks)."""
    num_blocks: int
    """The pool size chosen (estimate, adjuster, manual value, or a later set/override)."""
    num_blocks_source: str
    """estimate | adjuster | manual | set | auto | override."""
    measured: MeasuredTerms | None = None
    """The profiling pass's terms (``kvroom.plan.measured``); None: the formula is used."""
    vision_bytes: int = 0
    """Vision encoder peak + encoder cache (``plan.vision``); 0 for text models."""
    image_tokens: int = 0
    """Tokens the largest image takes (``plan.vision``); 0 for text models."""
    image_limit: str = ""
    """Which limit bounds an image's pixels (``ImageBudget.describe``); empty for text models."""
    weight_types: tuple[tuple[str, int], ...] = ()
    """``(kind, bytes)`` per kind of tensor as loaded (``int4 (Q4_1)``, ``float32``...), summing
    to ``weight_bytes`` x tp; empty when every weight is in the model dtype."""
    kv_scale_bytes_per_block: int = 0
    """Of ``kv_bytes_per_block``, the int8/int4 scales (one float32 per token, kv head, K or V);
    0 for float KV."""
    kv_groups: tuple[str, ...] = ()
    """One line per KV pool tensor (``plan.kv.describe_kv_groups``), e.g. ``2 full-attention
    layers, K=V, 1 KV head x 512 dims; 4 layers share earlier KV``."""

    # -- derived ------------------------------------------------------------------------------
    @property
    def usable_bytes(self) -> int:
        return int(self.device_memory_bytes * self.kvcache_memory_fraction) - (
            self.kvcache_reserve_bytes
        )

    @property
    def runtime_bytes(self) -> int:
        """Runtime memory the fit subtracts besides the weights: from the measured terms
        (everything of a serving process but weights and KV), else the older single measured
        figure, else the formula."""
        if self.measured is not None:
            return self.measured.fixed_bytes(serve=True) - self.weight_bytes
        if self.measured_runtime_bytes is not None:
            return self.measured_runtime_bytes
        return self.runtime_buffer_bytes

    @property
    def kv_bytes_per_block_per_rank(self) -> int:
        return self.kv_bytes_per_block // self.tensor_parallel_size

    @property
    def sliding_window_bytes_per_rank(self) -> int:
        return self.sliding_window_bytes // self.tensor_parallel_size

    @property
    def kv_budget_bytes(self) -> int:
        """Per rank: usable - weights - runtime - this rank's sliding-window slots."""
        fixed = self.weight_bytes + self.runtime_bytes + self.sliding_window_bytes_per_rank
        fixed += self.vision_bytes
        return self.usable_bytes - fixed

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.kvcache_block_size

    @property
    def kv_bytes(self) -> int:
        """Bytes of one rank's KV allocation: its block pool plus its sliding-window slots."""
        per_rank = self.num_blocks * self.kv_bytes_per_block_per_rank
        return per_rank + self.sliding_window_bytes_per_rank

    @property
    def max_concurrency(self) -> int:
        """Full-length sequences the pool holds at once (also bounded by batch_size)."""
        return min(self.batch_size, self.num_blocks // self.num_min_blocks)

    @property
    def formula_total_bytes(self) -> int:
        """weights + runtime buffers (formula) + KV: the estimate without profiling."""
        return self.weight_bytes + self.runtime_buffer_bytes + self.kv_bytes

    @property
    def total_bytes(self) -> int:
        """The peak of a process running the artifact (``kvroom run``, ``kvroom.LLM``)."""
        if self.measured is not None:
            return self.measured.total_bytes(self.kv_bytes, serve=False) + self.vision_bytes
        return self.weight_bytes + self.runtime_bytes + self.kv_bytes

    @property
    def serve_total_bytes(self) -> int:
        """The peak of ``kvroom serve`` (``total_bytes`` plus the server's own memory)."""
        if self.measured is not None:
            return self.measured.total_bytes(self.kv_bytes, serve=True) + self.vision_bytes
        return self.total_bytes

    # -- changes ------------------------------------------------------------------------------
    def with_num_blocks(self, num_blocks: int, source: str) -> MemoryPlan:
        return dataclasses.replace(self, num_blocks=num_blocks, num_blocks_source=source)

    def refit(
        self,
        memory: DeviceMemory,
        *,
        kvcache_memory_fraction: float,
        kvcache_reserve_bytes: int,
        device: str | None = None,
    ) -> MemoryPlan:
        """The same model needs fitted to another budget; the result is an estimate again."""
        plan = dataclasses.replace(
            self,
            device=device or self.device,
            device_memory_bytes=memory.available_bytes,
            device_memory_source=memory.source,
            kvcache_memory_fraction=kvcache_memory_fraction,
            kvcache_reserve_bytes=kvcache_reserve_bytes,
        )
        fit = (
            max(plan.kv_budget_bytes, 0) // plan.kv_bytes_per_block_per_rank
            if plan.kv_bytes_per_block
            else (plan.num_full_blocks if plan.kv_budget_bytes >= 0 else 0)
        )
        estimate = min(plan.num_full_blocks, fit)
        return dataclasses.replace(
            plan,
            num_fit_blocks=fit,
            estimated_num_blocks=estimate,
            num_blocks=estimate,
            num_blocks_source="estimate",
        )

    def with_measured_runtime(self, measured_bytes: int) -> MemoryPlan:
        """Re-fit with a measured runtime figure in place of the formula."""
        return self._refit_same(dataclasses.replace(self, measured_runtime_bytes=measured_bytes))

    def on_cpu(self, widens_bf16: bool) -> MemoryPlan:
        """This plan on a CPU that does (or does not) widen bf16 projections at load: the
        measured weights follow the CPU, the pool size stays."""
        terms = self.measured.on_cpu(widens_bf16) if self.measured else None
        if terms is None or terms is self.measured:
            return self
        return self.with_measured(terms).with_num_blocks(self.num_blocks, self.num_blocks_source)

    def with_measured(self, terms: MeasuredTerms) -> MemoryPlan:
        """Re-fit with the profiling pass's terms in place of the formula."""
        return self._refit_same(dataclasses.replace(self, measured=terms))

    def _refit_same(self, plan: MemoryPlan) -> MemoryPlan:
        return plan.refit(
            DeviceMemory(self.device_memory_bytes, self.device_memory_source),
            kvcache_memory_fraction=self.kvcache_memory_fraction,
            kvcache_reserve_bytes=self.kvcache_reserve_bytes,
        )

    # -- output -------------------------------------------------------------------------------
    def summary_line(self, *, pin_hint: bool = False) -> str:
        """``KV cache: N blocks x B tokens = T tokens (X MiB); max concurrency at max_seq_len: K``
        (with ``pin_hint``: ``; pin with --kvcache-num-blocks N``)."""
        line = (
            f"KV cache: {self.num_blocks} blocks x {self.kvcache_block_size} tokens = "
            f"{self.num_tokens} tokens ({mib(self.kv_bytes)}); "
            f"max concurrency at max_seq_len: {self.max_concurrency}"
        )
        return f"{line}; pin with --kvcache-num-blocks {self.num_blocks}" if pin_hint else line

    DERIVED_KEYS: ClassVar[tuple[str, ...]] = (
        "total_bytes",
        "serve_total_bytes",
        "formula_total_bytes",
        "kv_bytes",
    )
    """Written by ``to_dict`` for readers of the JSON; recomputed, never read back."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (sequences as lists) and the derived totals."""
        data = dataclasses.asdict(self)
        data["kv_groups"] = list(self.kv_groups)
        data["weight_types"] = [list(pair) for pair in self.weight_types]
        data.update({key: getattr(self, key) for key in self.DERIVED_KEYS})
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryPlan:
        data = {k: v for k, v in data.items() if k not in cls.DERIVED_KEYS}
        if isinstance(data.get("measured"), dict):
            data["measured"] = MeasuredTerms.from_dict(data["measured"])
        if "kv_groups" in data:
            data["kv_groups"] = tuple(data["kv_groups"])
        if "weight_types" in data:
            data["weight_types"] = tuple((str(k), int(v)) for k, v in data["weight_types"])
        return cls(**data)


def compute_plan(
    spec: ModelSpec,
    cfg: DecoderOnlyConfig,
    *,
    num_parameters: int,
    memory: DeviceMemory,
    measured_runtime_bytes: int | None = None,
    weight_types: Mapping[str, int] | None = None,
) -> MemoryPlan:
    """The plan for ``spec`` under ``cfg`` in ``memory``, its pool set to the estimate.

    ``weight_types``: bytes per kind of tensor as loaded (a GGUF kept as shipped,
    ``kvroom.gguf_file.resident_bytes_by_type``); the weights term is then their sum instead
    of ``num_parameters`` x the dtype width.

    Pure: no device probe, no file access. ``cfg.kvcache_num_blocks`` and the adjuster are
    applied afterwards by ``kvroom.adjust.resolve_num_blocks``.
    """
    assert cfg.kv_dtype is not None  # normalised by DecoderOnlyConfig
    shape = dict(
        max_seq_len=cfg.max_seq_len,
        kv_dtype=cfg.kv_dtype,
        tensor_parallel_size=cfg.tensor_parallel_size,
    )
    needs = MemoryPlan(
        device=cfg.device,
        device_memory_bytes=memory.available_bytes,
        device_memory_source=memory.source,
        kvcache_memory_fraction=cfg.kvcache_memory_fraction,
        kvcache_reserve_bytes=int(cfg.kvcache_reserve_memory),
        weight_bytes=weight_bytes(
            num_parameters, cfg.dtype, cfg.tensor_parallel_size, weight_types
        ),
        weight_types=tuple(sorted((weight_types or {}).items())),
        runtime_buffer_bytes=runtime_buffer_bytes(
            spec,
            batch_size=cfg.batch_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            dtype=cfg.dtype,
            **shape,
        ),
        measured_runtime_bytes=measured_runtime_bytes,
        sliding_window_bytes=sliding_window_bytes(spec, batch_size=cfg.batch_size, **shape),
        kv_bytes_per_block=kv_bytes_per_block(spec, block_size=cfg.kvcache_block_size, **shape),
        kv_scale_bytes_per_block=kv_scale_bytes_per_block(
            spec, block_size=cfg.kvcache_block_size, **shape
        ),
        kvcache_block_size=cfg.kvcache_block_size,
        max_seq_len=cfg.max_seq_len,
        batch_size=cfg.batch_size,
        kv_dtype=cfg.kv_dtype,
        tensor_parallel_size=cfg.tensor_parallel_size,
        num_min_blocks=cfg.num_min_blocks,
        num_full_blocks=cfg.num_full_blocks,
        num_fit_blocks=0,
        estimated_num_blocks=0,
        num_blocks=0,
        num_blocks_source="estimate",
        kv_groups=describe_kv_groups(spec, max_seq_len=cfg.max_seq_len),
        **_vision_fields(spec, cfg),
    )
    return needs.refit(
        memory,
        kvcache_memory_fraction=cfg.kvcache_memory_fraction,
        kvcache_reserve_bytes=int(cfg.kvcache_reserve_memory),
    )


def _vision_fields(spec: ModelSpec, cfg: DecoderOnlyConfig) -> dict[str, Any]:
    """The plan's image fields (``plan.vision.plan_vision``); none for a text model."""
    if spec.vision is None:
        return {}
    from kvroom.plan.vision import plan_vision

    images = plan_vision(
        spec.vision,
        max_images_per_request=getattr(cfg, "max_images_per_request", 1),
        max_image_pixels=getattr(cfg, "max_image_pixels", 512 * 512),
        encoder_cache_images=getattr(cfg, "encoder_cache_images", 4),
        max_seq_len=cfg.max_seq_len,
        dtype=cfg.dtype,
    )
    return {
        "vision_bytes": images.nbytes,
        "image_tokens": images.tokens_per_image,
        "image_limit": images.budget.describe(),
    }
