"""Measure what a process running the artifact holds, term by term (``compile``'s profiling pass).

``measure_terms`` runs ``kvroom.profile_process`` in a fresh Python process, which builds the
runtime the way ``kvroom.LLM`` and ``kvroom serve`` do (imports, tokenizer, weights, pool,
engine, server app), reading the process's memory between the stages. The differences are
the named terms of ``kvroom.plan.measured.MeasuredTerms``; none is a margin.

- CPU: resident set (``VmRSS``) and its peak (``VmHWM`` of ``/proc/self/status``); the peak
  is reset through ``/proc/self/clear_refs`` before each stage and step where the kernel
  allows it (else it keeps the peak since start, which can only over-count). Resident memory
  is what a cgroup limit counts, which is what the planner's budget is.
- CUDA: ``torch.cuda.memory_reserved`` and ``max_memory_reserved`` (what the caching allocator
  holds from the device), and the CUDA context (device memory in use minus reserved).

The pool used here is ``num_min_blocks`` long (its bytes are exact and are not a measured
term); the peak-shape steps (``peak_steps``) alias their block tables onto it: contents do
not matter, the gather sizes do. Tables run backwards so no step takes the contiguous
no-gather path a fresh pool can give.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvroom import heap
from kvroom.artifact.layout import ArtifactInfo
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput
from kvroom.errors import KvroomError
from kvroom.plan.measured import STEP_SHAPES, MeasuredTerms

PROC_CLEAR_REFS = Path("/proc/self/clear_refs")

IN_TURN_ROUNDS = 3
"""Rounds over every shape, one after another with no trim between steps, for the
``IN_TURN`` term. One SmolLM2 fp32 artifact (2,048-token budget): the shapes' largest single
step rose 40-46 MiB over three processes, the shapes in turn 44-48 MiB; the three rounds
reach what a deployment's steps leave resident, where one step's transients reuse the pages
an earlier step freed at other addresses or not."""

MEASURED_ROUNDS = 8
"""Measured rounds over the peak shapes (after one warm-up round). Each measured step starts
from a trimmed heap, and where glibc places its transients varies from round to round: the
``prefill_many`` step of one SmolLM2 fp32 artifact (2,048-token budget) rose 77-102 MB over 33
rounds of one process, a spread as wide as between processes (35-56 MB once the sampler and
the MLP held less at once). The plan takes the largest; were the rounds independent draws, a
deployment's step would land above the largest of 8 about 1 time in 9."""


def round_order(names: list[str], round_index: int) -> list[str]:
    """The peak shapes rotated by ``round_index``: each shape follows a different one from
    round to round, so the heap it starts from differs too."""
    k = round_index % len(names)
    return names[k:] + names[:k]


class ProfilingError(KvroomError, RuntimeError):
    """The profiling subprocess failed; its stderr tail is in the message."""


def measure_terms(folder: Path, timeout_s: float = 1800.0) -> MeasuredTerms:
    """Run the profiling pass on the artifact at ``folder`` in a fresh process."""
    cmd = [sys.executable, "-m", "kvroom.profile_process", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        tail = " ".join(done.stderr.strip().splitlines()[-3:])
        raise ProfilingError(f"profiling pass failed (exit {done.returncode}): {tail}")
    return MeasuredTerms.from_dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _chunk_sizes(batch_size: int, max_seq_len: int, budget: int) -> list[int]:
    """Prefill chunks of one step with the most rows and the most chunks: as many sequences as
    the budget seats (two tokens at least each), the longest chunks first."""
    seqs = max(1, min(batch_size, budget // 2))
    sizes = []
    left = budget
    for i in range(seqs):
        size = max(2, min(max_seq_len, left - 2 * (seqs - i - 1)))
        sizes.append(size)
        left -= size
    return sizes


def _fresh_sizes(batch_size: int, max_seq_len: int, budget: int) -> list[int]:
    """New prompts of one length filling the budget: the most rows of equally long fresh
    chunks, which are attended together in one call (``attention_index``)."""
    n = min(max_seq_len, budget)
    return [n] * max(1, min(batch_size, budget // n))


def peak_steps(info: ArtifactInfo, vocab_size: int) -> dict[str, SchedulerOutput]:
    """One step per ``STEP_SHAPES`` entry, every sequence at full context (``max_seq_len``):

    - ``decode``: ``batch_size`` decodes;
    - ``prefill``: one chunk of ``min(max_num_batched_tokens, max_seq_len)`` tokens;
    - ``prefill_many``: the budget split over as many chunks as it seats (``_chunk_sizes``);
    - ``prefill_fresh``: the budget over new prompts of one length (every chunk at position
      0, ``_fresh_sizes``): equally long fresh chunks, attended together in one call;
    - ``mixed``: ``batch_size // 2`` decodes, the rest of the budget split over chunks as
      ``prefill_many`` splits it (a deployment's steps while requests arrive: one of 16
      decodes and 8 chunks, 2,048 tokens, rose up to 49 MiB where ``prefill_many`` rose 43).

    Every sequence samples with temperature and top-p over the whole vocabulary, half of
    them seeded, so the step includes the sampler's largest buffers.
    """
    cfg = info.config
    table = tuple(reversed(range(cfg.num_min_blocks)))
    end = cfg.max_seq_len
    budget = cfg.max_num_batched_tokens

    def seq(i: int, n: int) -> ScheduledSeq:
        params = SamplingParams(
            temperature=0.8, top_p=0.95, max_tokens=1, seed=i if i % 2 else None
        )
        tokens = tuple((i + t) % vocab_size for t in range(n))
        return ScheduledSeq(i, tokens, end - n, table, i, True, params)

    decodes = tuple(seq(i, 1) for i in range(cfg.batch_size))
    many = _chunk_sizes(cfg.batch_size, end, budget)
    num_decodes = max(1, cfg.batch_size // 2) if cfg.batch_size > 1 else 0
    chunks = _chunk_sizes(cfg.batch_size - num_decodes, end, budget - num_decodes)
    mixed = decodes[:num_decodes] + tuple(
        seq(num_decodes + i, n) for i, n in enumerate(chunks) if n <= budget - num_decodes
    )
    steps = {
        "decode": decodes,
        "prefill": (seq(0, min(budget, end)),),
        "prefill_many": tuple(seq(i, n) for i, n in enumerate(many)),
        "mixed": mixed,
        "prefill_fresh": tuple(
            replace(seq(i, n), start_pos=0)
            for i, n in enumerate(_fresh_sizes(cfg.batch_size, end, budget))
        ),
    }
    assert tuple(steps) == STEP_SHAPES
    return {k: SchedulerOutput(v) for k, v in steps.items()}


FILL_TOKEN_COUNTS = 8
"""Warm-up steps of 1..8 tokens: every distinct size compiles and caches a kernel per
projection and the LM head, enough to fill the bounded kernel caches several times over
(``heap.KERNEL_CACHE_CAPACITY`` entries)."""


def fill_steps(info: ArtifactInfo, vocab_size: int) -> list[SchedulerOutput]:
    """Small steps of ``1..FILL_TOKEN_COUNTS`` tokens (decodes up to ``batch_size``, then one
    chunk), so the kernel caches hold as many entries as a long-running server's do."""
    cfg = info.config
    table = tuple(reversed(range(cfg.num_min_blocks)))
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    end = cfg.max_seq_len
    steps = []
    for n in range(1, min(FILL_TOKEN_COUNTS, cfg.max_num_batched_tokens, end) + 1):
        if n <= cfg.batch_size:
            seqs = tuple(
                ScheduledSeq(i, (i % vocab_size,), end - 1, table, i, True, greedy)
                for i in range(n)
            )
        else:
            tokens = tuple(t % vocab_size for t in range(n))
            seqs = (ScheduledSeq(0, tokens, end - n, table, 0, True, greedy),)
        steps.append(SchedulerOutput(seqs))
    return steps


CHURN_START = FILL_TOKEN_COUNTS + 1
CHURN_GROWTH = 1.5
"""Churn sizes grow geometrically from ``CHURN_START``: every size range a long run meets
(decode batches, chunk lengths, mixed steps) runs once, each one a kernel path whose code
pages and heap blocks become resident the first time it runs."""


def _ladder(start: int, stop: int) -> list[int]:
    """``start``, then x``CHURN_GROWTH`` up to ``stop``, which ends the ladder (empty when
    ``stop < start``)."""
    sizes: list[int] = []
    n = start
    while n < stop:
        sizes.append(n)
        n = max(n + 1, int(n * CHURN_GROWTH))
    if stop >= start:
        sizes.append(stop)
    return sizes


def churn_steps(info: ArtifactInfo, vocab_size: int) -> list[SchedulerOutput]:
    """Steps of every size range past the fill steps, all at full context, greedy:

    - one chunk of each ladder size up to the budget, with cached context before it (the
      cached-context prefill of a chunked or preempted prompt);
    - decodes at each ladder batch size up to ``batch_size``;
    - each ladder batch size as ``b - 1`` decodes beside one chunk of ``CHURN_START`` tokens
      (a mixed step), within the budget.
    """
    cfg = info.config
    table = tuple(reversed(range(cfg.num_min_blocks)))
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    end = cfg.max_seq_len
    budget = cfg.max_num_batched_tokens

    def seq(i: int, n: int) -> ScheduledSeq:
        tokens = tuple((i + t) % vocab_size for t in range(n))
        return ScheduledSeq(i, tokens, end - n, table, i, True, greedy)

    steps = [(seq(0, n),) for n in _ladder(CHURN_START, min(budget, end - 1))]
    batches = _ladder(CHURN_START, min(cfg.batch_size, budget))
    steps += [tuple(seq(i, 1) for i in range(b)) for b in batches]
    chunk = min(CHURN_START, end - 1)
    for b in [2, *batches]:
        if b <= cfg.batch_size and b - 1 + chunk <= budget:
            steps.append((*(seq(i, 1) for i in range(b - 1)), seq(b - 1, chunk)))
    return [SchedulerOutput(s) for s in steps]


class CpuProbe:
    """Resident set and its peak, in bytes."""

    def current(self) -> int:
        return _status_bytes("VmRSS")

    def peak(self) -> int:
        return _status_bytes("VmHWM")

    def file_backed(self) -> int:
        """The resident pages of mapped files (``RssFile``)."""
        return _status_bytes("RssFile")

    def reset_peak(self) -> None:
        # Where the kernel refuses, VmHWM keeps the peak since start: an over-count, never under.
        with contextlib.suppress(OSError):
            PROC_CLEAR_REFS.write_text("5")


class CudaProbe:
    """The caching allocator's reserved bytes and their peak, after a synchronize."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def current(self) -> int:
        self.torch.cuda.synchronize()
        return int(self.torch.cuda.memory_reserved())

    def peak(self) -> int:
        self.torch.cuda.synchronize()
        return int(self.torch.cuda.max_memory_reserved())

    def reset_peak(self) -> None:
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()

    def context_bytes(self) -> int:
        free, total = self.torch.cuda.mem_get_info()
        return int(total - free) - self.current()


def _status_bytes(key: str) -> int:
    value = heap.status_bytes(key).get(key)
    if value is None:
        raise ProfilingError(f"no {key} in /proc/self/status: resident memory is unknown here")
    return value
