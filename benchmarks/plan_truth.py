"""Is the plan the truth? Planned total vs the measured peak of a fresh process, case by case.

For each case: build the artifact (``kvroom.compile``, profiling pass included), then run a
workload that fills every block of the pool (and every sliding ring) in a fresh process, and
compare that process's peak with the plan:

- CPU: the process's peak resident set (``VmHWM``), everything included, against
  ``total_bytes`` (``kvroom.LLM``) or ``serve_total_bytes`` (``kvroom serve``, where the
  peak is read from ``/proc/<pid>/status`` of the server before it is stopped);
- CUDA: ``torch.cuda.max_memory_reserved`` plus the context, where a GPU is present (the
  cases are skipped otherwise).

error = (planned - measured) / measured: the target is 0% <= error <= +3%. The formula's
figure (``formula_total_bytes``, the plan without profiling) is shown with its error too.

    python benchmarks/plan_truth.py                   # the full matrix
    python benchmarks/plan_truth.py --matrix small    # the CI matrix (tests/e2e/test_plan_truth.py)
    python benchmarks/plan_truth.py --json out.json --work artifacts/plan-truth

Before the first case the page cache of the files the deployment maps is dropped
(``--page-cache dropped``, ``kvroom.pagecache``): how many library pages a process maps
depends on how the cache holds them, and after the drop every profile and run sees the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("prefill", "decode", "mixed", "topp", "serve")


@dataclass(frozen=True)
class Case:
    """One artifact and one workload run over it."""

    name: str
    source: str
    """``smollm2-135m`` or ``tiny:<model_type>`` (a random model from tests/tiny_models.py)."""
    config: dict[str, Any]
    workload: str
    """prefill: long prompts, a few tokens out; decode: short prompts, long outputs; mixed:
    twice batch_size requests of mixed lengths over a pool too small for all (preemption);
    topp: temperature + top-p over the whole vocabulary; serve: topp through kvroom serve."""
    tiny: dict[str, Any] = field(default_factory=dict)
    """HF config overrides of a tiny model."""


def _tiny(name: str, model_type: str, workload: str, **config: Any) -> Case:
    base = dict(max_seq_len=64, batch_size=4, kvcache_block_size=16, device_memory="4GiB")
    return Case(name, f"tiny:{model_type}", {**base, **config}, workload)


def _smol(name: str, workload: str, **config: Any) -> Case:
    """The default model; ``quantization="none"`` for its dequantized (fp32/bf16) artifact."""
    return Case(name, "smollm2-135m", dict(config), workload)


SMALL = [
    _tiny("tiny-llama-prefill", "llama", "prefill"),
    _tiny("tiny-qwen3-decode-bs64", "qwen3", "decode", kvcache_block_size=64, batch_size=2),
    _tiny("tiny-mistral-sliding-mixed", "mistral", "mixed", kvcache_num_blocks=10),
    _tiny("tiny-gemma3-sliding-topp", "gemma3_text", "topp", batch_size=8),
    _tiny(
        "tiny-qwen2-bf16-fp8-serve", "qwen2", "serve", dtype="bfloat16", kv_dtype="float8_e4m3fn"
    ),
    _tiny("tiny-llama-budget16-decode", "llama", "decode", max_num_batched_tokens=16),
    _tiny("tiny-llama-int4-decode", "llama", "decode", quantization="int4"),
]
"""About seven cases, every architecture, both sliding models, quantized projections; tiny
enough for CI."""

FULL = [
    *SMALL,
    _tiny(
        "tiny-llama-L1024-bs32",
        "llama",
        "mixed",
        max_seq_len=1024,
        batch_size=32,
        kvcache_num_blocks=512,
    ),
    _tiny("tiny-gemma3-L2048-bs8", "gemma3_text", "prefill", max_seq_len=2048, batch_size=8),
    _smol(
        "smol-fp32-L512-bs8-2GiB",
        "decode",
        max_seq_len=512,
        batch_size=8,
        device_memory="2GiB",
        quantization="none",
    ),
    _smol(
        "smol-fp32-L256-bs32",
        "prefill",
        max_seq_len=256,
        batch_size=32,
        max_num_batched_tokens=2048,
        device_memory="4GiB",
        quantization="none",
    ),
    _smol(
        "smol-bf16-L256-bs8-topp",
        "topp",
        max_seq_len=256,
        batch_size=8,
        dtype="bfloat16",
        device_memory="2GiB",
        quantization="none",
    ),
    _smol(
        "smol-fp8kv-L256-bs8-serve",
        "serve",
        max_seq_len=256,
        batch_size=8,
        kv_dtype="float8_e4m3fn",
        device_memory="2GiB",
        quantization="none",
    ),
    _smol(
        "smol-q4_1-gguf-L512-bs8-1GiB",
        "decode",
        max_seq_len=512,
        batch_size=8,
        device_memory="1GiB",
    ),
    _smol(
        "smol-int8-L256-bs8-mixed",
        "mixed",
        max_seq_len=256,
        batch_size=8,
        kvcache_num_blocks=64,
        device_memory="2GiB",
        quantization="int8",
    ),
    _tiny("tiny-llama-int4kv-mixed", "llama", "mixed", kv_dtype="int4", kvcache_num_blocks=10),
    _smol(
        "smol-int8kv-L512-bs8-decode",
        "decode",
        max_seq_len=512,
        batch_size=8,
        kv_dtype="int8",
        device_memory="2GiB",
        quantization="none",
    ),
    _smol(
        "smol-fp32-L256-bs8-mixed",
        "mixed",
        max_seq_len=256,
        batch_size=8,
        kvcache_num_blocks=64,
        device_memory="2GiB",
        quantization="none",
    ),
]
"""The benchmark: the small matrix plus longer sequences, larger batches and the real model."""


# -- building ---------------------------------------------------------------------------------
def build(case: Case, work: Path) -> Path:
    """The case's artifact under ``work`` (built once per source + config)."""
    from kvroom.compile import compile as compile_artifact

    key = re.sub(r"[^A-Za-z0-9]+", "-", f"{case.source}-{sorted(case.config.items())}")
    out = work / "artifacts" / key.strip("-")
    if (out / "kvroom_config.json").is_file():
        return out
    source = case.source
    if source.startswith("tiny:"):
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import write_tiny_model

        model_type = source.removeprefix("tiny:")
        source = str(write_tiny_model(work / "sources" / model_type, model_type, **case.tiny))
    compile_artifact(source, out, case.config, overwrite=True)
    return out


# -- workloads (run inside the measured process) ----------------------------------------------
def requests_for(workload: str, cfg: Any, vocab: int) -> list[tuple[list[int], dict[str, Any]]]:
    """(prompt ids, sampling kwargs) per request; together they fill every block."""
    b, length = cfg.batch_size, cfg.max_seq_len

    def ids(i: int, n: int) -> list[int]:
        return [3 + (i * 131 + j * 7) % (vocab - 3) for j in range(n)]

    greedy = dict(temperature=0.0, ignore_eos=True)
    topp = dict(temperature=0.8, top_p=0.95, ignore_eos=True)
    if workload == "prefill":
        # enough new tokens that every prompt is prefilled before the first one finishes,
        # so all of them hold their blocks at once
        steps_to_prefill_all = -(-b * length // cfg.max_num_batched_tokens)
        new = min(length // 4, max(8, 2 * steps_to_prefill_all))
        return [(ids(i, length - new), dict(greedy, max_tokens=new)) for i in range(b)]
    if workload == "decode":
        return [(ids(i, 4), dict(greedy, max_tokens=length - 4)) for i in range(b)]
    if workload == "mixed":
        lens = [2 + (i * 37) % (length - 3) for i in range(2 * b)]
        return [(ids(i, n), dict(greedy, max_tokens=length - n)) for i, n in enumerate(lens)]
    half = length // 2
    return [
        (ids(i, half), dict(topp, max_tokens=length - half, seed=i if i % 2 else None))
        for i in range(b)
    ]


def worker(artifact: str, workload: str) -> dict[str, Any]:
    """Run ``workload`` on ``kvroom.LLM(artifact)`` in this (fresh) process; its peak."""
    import kvroom
    from kvroom.engine.params.sampling import SamplingParams

    llm = kvroom.LLM(artifact)
    runtime = llm.runtime
    engine = runtime.engine
    for tokens, kwargs in requests_for(workload, runtime.info.config, runtime.spec.vocab_size):
        engine.add_request(tokens, SamplingParams(**kwargs))
    blocks = engine.scheduler.block_manager
    schedule = engine.scheduler.schedule
    used = [0]

    def schedule_and_count() -> Any:  # blocks in use right after each step is scheduled
        out = schedule()
        used[0] = max(used[0], blocks.num_used_blocks)
        return out

    engine.scheduler.schedule = schedule_and_count
    while engine.has_unfinished():
        engine.step()
    return {**_memory(Path("/proc/self/status")), "max_used_blocks": used[0]}


def _memory(status: Path) -> dict[str, int]:
    values = {}
    for line in status.read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmHWM", "VmRSS"):
            values[key] = int(line.split()[1]) * 1024
    return {"peak_bytes": values["VmHWM"], "rss_bytes": values["VmRSS"]}


def run_offline(artifact: Path, workload: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(artifact), workload]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=_env())
    if done.returncode != 0:
        raise RuntimeError(f"worker failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_served(artifact: Path) -> dict[str, Any]:
    """``kvroom serve`` with the topp workload sent concurrently over HTTP; the server's peak."""
    import threading

    cmd = [sys.executable, "-m", "kvroom", "serve", str(artifact), "--port", "0"]
    cmd.append("--no-access-log")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env()
    )
    try:
        url = _wait_for_url(proc)
        _wait_until_listening(url)
        from kvroom.artifact.layout import read_info
        from kvroom.runtime import read_spec

        info = read_info(artifact)
        vocab = read_spec(artifact).vocab_size
        threads = [
            threading.Thread(target=_post, args=(url, str(artifact), tokens, kwargs))
            for tokens, kwargs in requests_for("topp", info.config, vocab)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {**_memory(Path(f"/proc/{proc.pid}/status")), "max_used_blocks": -1}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _wait_for_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"on (http://\S+) ", line)
        if match:
            return match.group(1)
    raise RuntimeError(f"kvroom serve exited ({proc.wait()}) before it served")


def _wait_until_listening(url: str, timeout_s: float = 300.0) -> None:
    """Poll ``/v1/models`` until the server answers (it prints its address before it listens)."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
                response.read()
            return
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _post(url: str, model: str, tokens: list[int], kwargs: dict[str, Any]) -> None:
    import urllib.request

    body = {"model": model, "prompt": tokens, **{k: v for k, v in kwargs.items() if v is not None}}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=3600) as response:
        response.read()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


# -- comparing --------------------------------------------------------------------------------
def run_case(case: Case, work: Path) -> dict[str, Any]:
    """Build, run, and compare one case (CPU)."""
    from kvroom.artifact.layout import read_info

    artifact = build(case, work)
    plan = read_info(artifact).plan
    served = case.workload == "serve"
    got = run_served(artifact) if served else run_offline(artifact, case.workload)
    planned = plan.serve_total_bytes if served else plan.total_bytes
    measured = got["peak_bytes"]
    terms = plan.measured
    return {
        "case": case.name,
        "workload": case.workload,
        "config": case.config,
        "num_blocks": plan.num_blocks,
        "max_used_blocks": got["max_used_blocks"],
        "planned_bytes": planned,
        "measured_peak_bytes": measured,
        "rss_at_end_bytes": got["rss_bytes"],
        "error_pct": 100.0 * (planned - measured) / measured,
        "formula_bytes": plan.formula_total_bytes,
        "formula_error_pct": 100.0 * (plan.formula_total_bytes - measured) / measured,
        "peak_step_shape": terms.peak_step_shape if terms else "-",
    }


def render(rows: list[dict[str, Any]]) -> str:
    """The table of RESULTS.md, then the worst case each way."""
    head = (
        f"{'case':<30} {'workload':<8} {'blocks':>11} {'planned':>10} {'measured':>10} "
        f"{'error':>7} {'formula':>10} {'f.error':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        used = "" if r["max_used_blocks"] < 0 else f"{r['max_used_blocks']}/"
        lines.append(
            f"{r['case']:<30} {r['workload']:<8} {used + str(r['num_blocks']):>11} "
            f"{_mb(r['planned_bytes']):>10} {_mb(r['measured_peak_bytes']):>10} "
            f"{r['error_pct']:>+6.2f}% {_mb(r['formula_bytes']):>10} "
            f"{r['formula_error_pct']:>+7.1f}%"
        )
    if rows:
        low = min(rows, key=lambda r: r["error_pct"])
        high = max(rows, key=lambda r: r["error_pct"])
        lines.append(f"worst under/closest: {low['case']} {low['error_pct']:+.2f}%")
        lines.append(f"worst over: {high['case']} {high['error_pct']:+.2f}%")
    return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _drop_library_cache() -> None:
    cmd = [sys.executable, "-m", "kvroom.pagecache", "drop"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env())
    print(f"page cache of the deployment's files dropped: {done.stdout.strip()}")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", choices=("small", "full"), default="full")
    parser.add_argument("--cases", default=None, help="comma list of case names to run")
    parser.add_argument("--work", default="artifacts/plan-truth", help="artifacts go here")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument(
        "--page-cache",
        choices=("dropped", "as-is"),
        default="dropped",
        help="dropped (default): the libraries' page cache is dropped first, so every run maps "
        "them from the read-from-disk state (kvroom.pagecache); as-is: left as it is",
    )
    parser.add_argument(
        "--worker", nargs=2, metavar=("ARTIFACT", "WORKLOAD"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    if args.page_cache == "dropped":
        # before this process maps torch: pages a process maps stay in the cache as they are
        _drop_library_cache()
    cases = SMALL if args.matrix == "small" else FULL
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    if cuda_available():
        print("CUDA present: the CPU matrix runs; CUDA cases compare max_memory_reserved + context")
    else:
        print("no CUDA here: CUDA cases skipped")
    rows = []
    for case in cases:
        rows.append(run_case(case, Path(args.work)))
        print(render(rows[-1:]).splitlines()[2], flush=True)
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
