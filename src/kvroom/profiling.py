"""Measure the runtime's real non-KV memory at its peak shape (``compile``'s profiling pass).

Runs in a fresh Python process, as a deployment would, so the figure holds what a served
artifact really costs besides its weights and KV pool: the interpreter, torch, and the step's
activations. Method:

- CPU: Linux's peak resident set (``VmHWM`` of ``/proc/self/status``), reset through
  ``/proc/self/clear_refs`` just before the peak steps when the kernel allows it (else the
  peak since start, which can only over-count);
  ``measured = VmHWM - weight_bytes - pool.nbytes``. Resident memory is what the kernel and a
  cgroup limit count, which is what the planner's budget (available RAM, cgroup headroom) is.
- CUDA: ``torch.cuda.max_memory_allocated() - weight_bytes - pool.nbytes``, after
  ``reset_peak_memory_stats`` (the CUDA context is already outside ``mem_get_info``'s free).

The peak shape is the larger of two steps: ``batch_size`` decodes at ``max_seq_len`` context,
and one prefill chunk of ``max_num_batched_tokens`` tokens ending at ``max_seq_len``. Their
block tables all alias the same ``num_min_blocks`` blocks (the contents do not matter, the
gather sizes do), so the pool allocated for profiling stays small.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

from kvroom.artifact.layout import ArtifactInfo, read_info
from kvroom.engine.output import ScheduledSeq, SchedulerOutput
from kvroom.engine.sampling import SamplingParams
from kvroom.errors import KvroomError

PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


class ProfilingError(KvroomError, RuntimeError):
    """The profiling subprocess failed; its stderr tail is in the message."""


def measure_runtime_bytes(folder: Path, timeout_s: float = 600.0) -> int:
    """Run the profiling pass on the artifact at ``folder`` in a fresh process."""
    cmd = [sys.executable, "-m", "kvroom.profiling", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        tail = " ".join(done.stderr.strip().splitlines()[-3:])
        raise ProfilingError(f"profiling pass failed (exit {done.returncode}): {tail}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["measured_runtime_bytes"])


def peak_steps(info: ArtifactInfo, vocab_size: int) -> list[SchedulerOutput]:
    """The two peak-shape steps described in the module docstring."""
    cfg = info.config
    table = tuple(range(cfg.num_min_blocks))
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    decodes = tuple(
        ScheduledSeq(i, (i % vocab_size,), cfg.max_seq_len - 1, table, i, True, greedy)
        for i in range(cfg.batch_size)
    )
    chunk = min(cfg.max_num_batched_tokens, cfg.max_seq_len)
    prompt = tuple(t % vocab_size for t in range(chunk))
    prefill = (ScheduledSeq(0, prompt, cfg.max_seq_len - chunk, table, 0, True, greedy),)
    return [SchedulerOutput(decodes), SchedulerOutput(prefill)]


def _profile(folder: Path) -> int:
    import torch

    from kvroom.runtime import build_runtime

    info = read_info(folder)
    plan = info.plan.with_num_blocks(info.config.num_min_blocks, "profile")
    runtime = build_runtime(info, plan)
    runtime.pool.touch()  # a lazily zeroed CPU pool is resident only where touched
    steps = peak_steps(info, runtime.spec.vocab_size)
    cuda = str(info.config.device).startswith("cuda")
    runtime.runner.execute(steps[1])  # warm-up: one-time allocations are not the peak
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak_rss()
    for step in steps:
        runtime.runner.execute(step)
    if cuda:
        torch.cuda.synchronize()
        peak = int(torch.cuda.max_memory_allocated())
    else:
        peak = _peak_rss()
    return max(peak - info.plan.weight_bytes - runtime.pool.nbytes(), 0)


def _reset_peak_rss() -> None:
    # Where the kernel refuses, VmHWM keeps the peak since start: an over-count, never under.
    with contextlib.suppress(OSError):
        PROC_CLEAR_REFS.write_text("5")


def _peak_rss() -> int:
    for line in PROC_STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise ProfilingError("no VmHWM in /proc/self/status: peak RSS is unknown on this system")


if __name__ == "__main__":
    print(json.dumps({"measured_runtime_bytes": _profile(Path(sys.argv[1]))}))
