"""What a kvroom process holds at its peak, term by term, as the profiling pass measured it.

Every term is a difference of the process's resident set (CPU) or of the CUDA caching
allocator's reserved bytes plus the context (CUDA) between two points of a fresh process that
runs the artifact the way a deployment does (``kvroom.profiling``). None is a margin::

    load peak  = process + tokenizer + weights + load_transient
    steady     = process + tokenizer + weights + engine + warmup + KV pool (+ server)
    run peak   = steady + max(step peaks)
    total      = max(load peak, run peak)

The KV pool is the one term not measured here: it is exactly ``MemoryPlan.kv_bytes`` (the
profiling pass checks that its pool's resident bytes equal its ``nbytes``), so the terms stay
true when the pool is resized (``kvroom set``, ``--kvcache-num-blocks auto``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

STEP_SHAPES = ("decode", "prefill", "prefill_many", "mixed", "prefill_fresh")
"""The peak-shape steps the profiling pass runs (``profiling.peak_steps`` builds them)."""

IN_TURN = "in_turn"
"""The ``step_peak_bytes`` entry of the shapes run in turn from a trimmed heap, untrimmed
between them, as a deployment runs its steps: the pages each step leaves resident add up."""


@dataclass(frozen=True)
class MeasuredTerms:
    """Bytes of each part of a kvroom process, measured; see the module docstring."""

    method: str
    """``cpu-rss`` (VmRSS / VmHWM deltas) or ``cuda`` (reserved bytes + context)."""
    process_bytes: int
    """Interpreter, torch, transformers and kvroom after import (CUDA: the context)."""
    tokenizer_bytes: int
    """The tokenizer, loaded, with its chat template applied once."""
    weights_bytes: int
    """The loaded model as it stays resident (packed projections, a tied head's dense
    embedding, norms, rotary tables)."""
    load_transient_bytes: int
    """How far loading peaked above ``weights_bytes`` (0 when it never exceeds its end)."""
    engine_bytes: int
    """Runner, sampler, scheduler and block manager, besides the pool."""
    warmup_bytes: int
    """Kept after the first steps: kernels and their caches, thread stacks, heap."""
    step_peak_bytes: dict[str, int] = field(default_factory=dict)
    """Per peak shape (``STEP_SHAPES``), how far one step (forward + sampling over the full
    vocabulary) rises above the steady state; and under ``IN_TURN``, how far the shapes run
    one after another do."""
    server_bytes: int = 0
    """``kvroom serve`` only: the HTTP app, its modules, its copy of the tokenizer, and the
    kernels' per-thread state on the engine thread."""
    bf16_projection_bytes: int = 0
    """The bf16 projections' bytes as bf16. CPUs without oneDNN's bf16 GEMM widen them to
    fp32 at load (``models.kernels``), so they weigh twice that there: the one part of
    ``weights_bytes`` that depends on the CPU, not only on the artifact."""
    bf16_widened: bool = False
    """The measuring CPU widened them (``weights_bytes`` holds fp32 copies)."""
    file_backed_bytes: int = 0
    """Of the terms above, the mapped files' pages resident at the end of the pass (CPU,
    ``RssFile``): clean pages, mostly the shared libraries. How many a process maps depends on
    the page cache's state (``kvroom.pagecache``), so this is the part that can differ on a
    machine whose page cache holds the libraries differently."""

    def on_cpu(self, widens_bf16: bool) -> MeasuredTerms:
        """These terms on a CPU that does (or does not) widen bf16 projections: a plan
        measured on one CPU stays true on another (``run``/``serve`` re-fit at start-up)."""
        if widens_bf16 == self.bf16_widened or not self.bf16_projection_bytes:
            return self
        delta = self.bf16_projection_bytes if widens_bf16 else -self.bf16_projection_bytes
        weights = self.weights_bytes + delta
        return dataclasses.replace(self, weights_bytes=weights, bf16_widened=widens_bf16)

    @property
    def step_bytes(self) -> int:
        """The largest step peak."""
        return max(self.step_peak_bytes.values(), default=0)

    @property
    def peak_step_shape(self) -> str:
        if not self.step_peak_bytes:
            return "-"
        return max(self.step_peak_bytes, key=lambda k: self.step_peak_bytes[k])

    @property
    def load_peak_bytes(self) -> int:
        return (
            self.process_bytes + self.tokenizer_bytes + self.weights_bytes
        ) + self.load_transient_bytes

    def fixed_bytes(self, *, serve: bool) -> int:
        """Everything at the run peak except the KV pool."""
        steady = self.process_bytes + self.tokenizer_bytes + self.weights_bytes
        steady += self.engine_bytes + self.warmup_bytes
        return steady + self.step_bytes + (self.server_bytes if serve else 0)

    def total_bytes(self, kv_bytes: int, *, serve: bool) -> int:
        """The process's peak with a pool of ``kv_bytes``."""
        server = self.server_bytes if serve else 0
        return max(self.load_peak_bytes + server, self.fixed_bytes(serve=serve) + kv_bytes)

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) per term, in the order of the module docstring."""
        rows = [
            ("process (interpreter, torch, transformers)", self.process_bytes),
            ("tokenizer and chat template", self.tokenizer_bytes),
            ("weights as loaded", self.weights_bytes),
            ("load transient (above weights, while loading)", self.load_transient_bytes),
            ("engine (runner, scheduler, block manager)", self.engine_bytes),
            ("kept after warm-up (kernels, threads, heap)", self.warmup_bytes),
        ]
        rows += [(f"step peak: {k}", v) for k, v in self.step_peak_bytes.items()]
        rows.append(("server (kvroom serve only)", self.server_bytes))
        return rows

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasuredTerms:
        return cls(**data)
