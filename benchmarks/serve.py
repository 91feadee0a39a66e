"""HTTP serving vs offline ``LLM.generate`` on the same requests, in one run.

    .venv/bin/python benchmarks/serve.py ARTIFACT [--concurrency 1,8,32] [--max-tokens 64]

For each concurrency C (``max(8, 3 x C)`` requests, at most ``--num-requests``):

1. offline: the requests through ``LLM.generate`` in this process, C at a time (one call with
   all of them once C reaches the artifact's batch_size);
2. online: ``kvroom serve ARTIFACT --port 0`` (a subprocess on 127.0.0.1, started once), C
   closed-loop clients streaming the same requests over SSE (``/v1/completions``, greedy, EOS
   ignored so every request makes exactly ``--max-tokens`` tokens).

Reported per level: requests/s, output tokens/s, time to first token and inter-token latency
percentiles (client side), offline tokens/s and the ratio. ``--repeat R`` interleaves R rounds
(the machine may be shared) and keeps each level's best ratio. Bounded: at most
``--num-requests`` requests and ``--max-seconds`` per level; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from sse_client import RequestTiming, one_request, percentiles, start_server  # noqa: E402

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short story about a robot learning to paint.",
    "What are the main causes of inflation?",
    "Describe how a bicycle works.",
    "Give three tips for learning a new language.",
    "What is the capital of France, and what is it known for?",
    "Summarise the plot of Romeo and Juliet.",
    "How do plants make their food?",
    "List some healthy breakfast ideas.",
    "Why do we have seasons on Earth?",
    "Write a haiku about the ocean.",
    "What is machine learning?",
    "How does a refrigerator keep food cold?",
    "Describe the water cycle.",
    "What makes a good friend?",
    "Explain how vaccines work.",
]


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    wall_s: float
    timings: list[RequestTiming]
    server_tokens: float
    """Generation tokens the server counted (``/metrics``) during the level."""

    @property
    def output_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.timings)


def workload(num_requests: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]


# -- offline -------------------------------------------------------------------------------


class Offline:
    """The artifact loaded in this process, for ``LLM.generate`` throughput.

    ``LLM.generate`` runs on one persistent worker thread, as the server's engine loop does: with
    more than one torch thread, a CPU run on the main thread and one on a worker thread can
    differ by several times on a loaded machine (their OpenMP teams differ), which would
    otherwise be mistaken for HTTP overhead.
    """

    def __init__(self, artifact: str, threads: int | None) -> None:
        from kvroom.llm import LLM

        self.pool = ThreadPoolExecutor(1, thread_name_prefix="offline-engine")
        self.llm = self.pool.submit(LLM, artifact).result()
        if threads:
            self.pool.submit(torch_threads, threads).result()
        self.batch_size = self.llm.runtime.info.config.batch_size

    def measure(self, prompts: list[str], max_tokens: int, concurrency: int) -> float:
        """Output tok/s of ``prompts`` through ``LLM.generate``, ``concurrency`` at a time.

        All requests have the same length (EOS ignored), so waves of ``concurrency`` prompts are
        what ``concurrency`` closed-loop clients give the engine; from ``batch_size`` up it is one
        call with every prompt (continuous batching does the rest).
        """
        return self.pool.submit(self._measure, prompts, max_tokens, concurrency).result()

    def _measure(self, prompts: list[str], max_tokens: int, concurrency: int) -> float:
        from kvroom.engine.params.sampling import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        wave = len(prompts) if concurrency >= self.batch_size else concurrency
        start = time.perf_counter()
        num_tokens = 0
        for i in range(0, len(prompts), wave):
            num_tokens += sum(
                len(o.token_ids) for o in self.llm.generate(prompts[i : i + wave], params)
            )
        return num_tokens / (time.perf_counter() - start)


def torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


# -- online --------------------------------------------------------------------------------


async def run_level(url: str, prompts: list[str], concurrency: int, args: argparse.Namespace):
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        before = await _generated(http)

        async def client() -> None:
            while not queue.empty():
                timings.append(await one_request(http, queue.get_nowait(), args.max_tokens))

        start = time.perf_counter()
        tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=args.max_seconds)
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - start
        for task in done:
            task.result()  # a failed request fails the benchmark
        server_tokens = await _generated(http) - before
    return LevelResult(concurrency, len(timings), wall, timings, server_tokens)


async def _generated(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    line = next(ln for ln in text.splitlines() if ln.startswith("kvroom_generation_tokens_total"))
    return float(line.split()[-1])


# -- report --------------------------------------------------------------------------------


@dataclass
class Row:
    """One concurrency level: the online run and the offline throughput on the same requests."""

    online: LevelResult
    offline_tok_s: float

    @property
    def tok_s(self) -> float:
        return self.online.output_tokens / self.online.wall_s


def report(rows: list[Row], batch_size: int, args: argparse.Namespace) -> list[dict]:
    print(
        f"\nbest of {args.repeat}; {args.max_tokens} tokens per request; offline = LLM.generate "
        f"on the same requests, C at a time (batch_size {batch_size})"
    )
    print(
        f"{'clients':>7} {'reqs':>5} {'req/s':>7} {'tok/s':>8} {'TTFT p50/p90/p99 ms':>22} "
        f"{'ITL p50/p90/p99 ms':>20} {'offline tok/s':>14} {'ratio':>6}"
    )
    out = []
    for row in rows:
        lv = row.online
        ttft = percentiles([t.ttft * 1e3 for t in lv.timings if t.chunk_times])
        itl = percentiles([x * 1e3 for t in lv.timings for x in t.itls])
        ratio = row.tok_s / row.offline_tok_s
        print(
            f"{lv.concurrency:>7} {lv.num_requests:>5} {lv.num_requests / lv.wall_s:>7.2f} "
            f"{row.tok_s:>8.1f} {'/'.join(f'{v:.0f}' for v in ttft):>22} "
            f"{'/'.join(f'{v:.0f}' for v in itl):>20} {row.offline_tok_s:>14.1f} {ratio:>6.0%}"
        )
        out.append(
            {
                "concurrency": lv.concurrency,
                "requests": lv.num_requests,
                "wall_s": lv.wall_s,
                "req_s": lv.num_requests / lv.wall_s,
                "tok_s": row.tok_s,
                "server_counted_tok_s": lv.server_tokens / lv.wall_s,
                "ttft_ms_p50_p90_p99": ttft,
                "itl_ms_p50_p90_p99": itl,
                "offline_tok_s": row.offline_tok_s,
                "ratio_to_offline": ratio,
            }
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="artifact folder (kvroom compile ... -o ARTIFACT)")
    p.add_argument("--concurrency", default="1,8,32", help="client counts (default 1,8,32)")
    p.add_argument(
        "--num-requests", type=int, default=96, help="cap; each level sends max(8, 3 x C)"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (EOS ignored)")
    p.add_argument("--max-seconds", type=float, default=300, help="time limit per level")
    p.add_argument("--threads", type=int, default=None, help="torch threads, both sides")
    p.add_argument("--repeat", type=int, default=1, help="interleaved repetitions; best ratio kept")
    p.add_argument("--server-arg", action="append", default=[], help="extra `serve` flag")
    p.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the server")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = workload(args.num_requests)
    print(
        f"workload: up to {len(prompts)} requests x {args.max_tokens} tokens; cpus {os.cpu_count()}"
    )
    load_before = os.getloadavg()[0]
    offline = Offline(args.artifact, args.threads)
    warm_up = PROMPTS * 2  # each prompt alone, then all of them together: the shapes to come
    offline.measure(warm_up[: len(PROMPTS)], 4, 1)
    offline.measure(warm_up, 4, len(warm_up))
    env = [*args.server_env, *([f"OMP_NUM_THREADS={args.threads}"] if args.threads else [])]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvroom-serve-bench-{os.getpid()}.log"
    proc, url = start_server(args.artifact, args.server_arg, env, log)
    runs: list[list[Row]] = []
    try:
        warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
        asyncio.run(run_level(url, warm_up[: len(PROMPTS)], 1, warm))
        asyncio.run(run_level(url, warm_up, len(warm_up), warm))
        for rep in range(args.repeat):  # interleaved, so both sides see the same machine
            runs.append([measure_level(url, offline, prompts, c, args) for c in args.levels])
            done = ", ".join(f"{r.tok_s:.1f}/{r.offline_tok_s:.1f}" for r in runs[-1])
            print(f"  run {rep + 1} (online/offline tok/s per level): {done}")
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    best = [
        max(group, key=lambda r: r.tok_s / r.offline_tok_s) for group in zip(*runs, strict=True)
    ]
    summary = {"levels": report(best, offline.batch_size, args), "max_tokens": args.max_tokens}
    summary.update(server_exit_code=rc, loadavg_before=load_before, loadavg_after=os.getloadavg())
    print(
        f"server exit code {rc}; 1-min load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def measure_level(
    url: str, offline: Offline, prompts: list[str], concurrency: int, args: argparse.Namespace
) -> Row:
    """``max(8, 3 x C)`` requests (at most ``--num-requests``): offline, then over HTTP."""
    chosen = prompts[: min(len(prompts), max(8, 3 * concurrency))]
    offline_tok_s = offline.measure(chosen, args.max_tokens, concurrency)
    return Row(asyncio.run(run_level(url, chosen, concurrency, args)), offline_tok_s)


if __name__ == "__main__":
    raise SystemExit(main())
