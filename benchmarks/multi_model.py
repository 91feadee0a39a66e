"""Two models, one memory budget: one multi-model server vs two elastic servers vs two fixed
halves, under skewed load (90/10, then flipped).

    .venv/bin/python benchmarks/multi_model.py ARTIFACT [--pool-blocks 80] [--requests 24]
        [--concurrency 8] [--max-tokens 128] [--json out.json]

ARTIFACT is served twice, as ``m1`` and ``m2`` (two copies of one model: the same weights
loaded twice, as two fine-tunes of one base would be). The budget is the same in all three::

    budget = process + 2 x (weights + runtime) + pool_blocks x bytes_per_block

1. ``one-budget``: ``kvroom serve ARTIFACT ARTIFACT --memory-budget BUDGET``: the arbiter
   moves blocks toward the model with requests waiting for blocks;
2. ``two-elastic``: two ``kvroom serve ARTIFACT --kvcache-num-blocks elastic`` processes, each
   keeping ``available_now - budget`` free: both grow into the same free memory;
3. ``two-halves``: two processes with ``--kvcache-num-blocks pool_blocks / 2`` each.

The load is closed-loop (``--concurrency`` clients), ``--requests`` per phase: phase 1 sends
90% of them to ``m1`` and 10% to ``m2``, phase 2 the other way round. Greedy, EOS ignored, so
every request makes ``--max-tokens`` tokens. Reported per setup and phase: output tokens/s and
the p50/p99 time to first token (client side), and the pool sizes at the end of each phase.
Bounded: every server is stopped at the end; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from sse_client import ADDRESS, RequestTiming, healthy, one_request, percentiles  # noqa: E402

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short story about a robot learning to paint.",
    "What are the main causes of inflation?",
    "Describe how a bicycle works.",
    "Give three tips for learning a new language.",
    "How do plants make their food?",
]
MODELS = ("m1", "m2")


def start(argv: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """``python -m kvroom serve ...`` on a free port; (process, base URL) once healthy."""
    full = [sys.executable, "-m", "kvroom", "serve", *argv, "--port", "0", "--no-access-log"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        match = ADDRESS.search(log_path.read_text(errors="replace"))
        if match and healthy(match.group(1)):
            return proc, match.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}:\n{log_path.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start:\n{log_path.read_text()}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def phase_models(num_requests: int, busy: str) -> list[str]:
    """90% of the requests to ``busy``, 10% to the other, interleaved."""
    other = MODELS[1] if busy == MODELS[0] else MODELS[0]
    return [other if i % 10 == 9 else busy for i in range(num_requests)]


async def run_phase(urls: dict[str, str], models: list[str], args: argparse.Namespace) -> dict:
    """Closed loop: ``concurrency`` clients take the next request until none is left."""
    queue = list(enumerate(models))
    timings: list[RequestTiming] = []
    clients = {m: httpx.AsyncClient(base_url=urls[m], timeout=600) for m in MODELS}

    async def worker() -> None:
        while queue:
            i, model = queue.pop(0)
            prompt = PROMPTS[i % len(PROMPTS)]
            timings.append(await one_request(clients[model], prompt, args.max_tokens, model))

    start_s = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - start_s
    for client in clients.values():
        await client.aclose()
    ttft = [t.ttft * 1e3 for t in timings]
    return {
        "requests": len(timings),
        "wall_s": wall,
        "tok_s": sum(t.completion_tokens for t in timings) / wall,
        "ttft_ms_p50_p99": percentiles(ttft, (50, 99)),
    }


def pool_sizes(urls: dict[str, str]) -> dict[str, int]:
    """Each model's KV blocks now, from ``/metrics`` (labelled or not)."""
    sizes: dict[str, int] = {}
    for model, url in urls.items():
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if not line.startswith("kvroom_kv_cache_num_blocks"):
                continue
            if "{" not in line or f'model="{model}"' in line:
                sizes[model] = int(float(line.split()[-1]))
    return sizes


def budget_terms(artifact: str, pool_blocks: int) -> dict[str, int]:
    from kvroom.artifact.layout import read_info
    from kvroom.plan.budget import ModelCost

    plan = read_info(artifact).plan
    cost = ModelCost.of("m", plan)
    if pool_blocks < 2 * cost.min_blocks:
        raise SystemExit(f"--pool-blocks: at least two floors, {2 * cost.min_blocks}")
    budget = cost.shared_bytes + 2 * cost.fixed_bytes + pool_blocks * cost.bytes_per_block
    return {"budget_bytes": budget, "half_blocks": pool_blocks // 2, "floor": cost.min_blocks}


def setups(artifact: str, terms: dict[str, int]) -> dict[str, list[list[str]]]:
    """argv per server, per setup (one server, or one per model)."""
    import psutil

    names = ["--served-model-name", "m1", "--served-model-name", "m2"]
    reserve = int(psutil.virtual_memory().available) - terms["budget_bytes"]
    elastic = ["--kvcache-num-blocks", "elastic", "--kvcache-reserve-memory", str(reserve)]
    elastic += ["--kvcache-min-blocks", str(terms["floor"])]
    half = ["--kvcache-num-blocks", str(terms["half_blocks"])]
    return {
        "one-budget": [[artifact, artifact, *names, "--memory-budget", str(terms["budget_bytes"])]],
        "two-elastic": [[artifact, "--served-model-name", m, *elastic] for m in MODELS],
        "two-halves": [[artifact, "--served-model-name", m, *half] for m in MODELS],
    }


def measure(name: str, servers: list[list[str]], args: argparse.Namespace, tmp: Path) -> dict:
    procs, urls = [], {}
    try:
        for i, argv in enumerate(servers):
            proc, url = start(argv, tmp / f"{name}-{i}.log")
            procs.append(proc)
            for m in MODELS if len(servers) == 1 else (MODELS[i],):
                urls[m] = url
        result: dict = {"setup": name, "phases": []}
        for busy in MODELS:
            phase = asyncio.run(run_phase(urls, phase_models(args.requests, busy), args))
            phase |= {"busy": busy, "blocks_after": pool_sizes(urls)}
            result["phases"].append(phase)
            print(
                f"{name:12s} busy={busy}: {phase['tok_s']:7.1f} tok/s, TTFT p50/p99 "
                f"{phase['ttft_ms_p50_p99'][0]:7.0f} / {phase['ttft_ms_p50_p99'][1]:7.0f} ms, "
                f"blocks {phase['blocks_after']}",
                flush=True,
            )
        return result
    finally:
        for proc in procs:
            stop(proc)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--pool-blocks", type=int, default=80, help="the two pools' blocks together")
    p.add_argument("--requests", type=int, default=24, help="requests per phase")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--setups", default="one-budget,two-elastic,two-halves")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    terms = budget_terms(args.artifact, args.pool_blocks)
    print(
        f"budget {terms['budget_bytes'] / 2**20:.1f} MiB: {args.pool_blocks} KV blocks for "
        f"both models (floor {terms['floor']} each); load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    plans = setups(args.artifact, terms)
    results = []
    with TemporaryDirectory() as tmp:
        for name in args.setups.split(","):
            results.append(measure(name, plans[name], args, Path(tmp)))
    report = {"args": vars(args), "terms": terms, "results": results}
    report["loadavg_after"] = list(os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
