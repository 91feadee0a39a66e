"""Prefix caching on vs off: a shared-system-prompt workload against ``kvroom serve``.

    .venv/bin/python benchmarks/prefix_cache.py ARTIFACT [--clients 32] [--system-tokens 1024]
        [--max-tokens 64] [--requests 64] [--json out.json]

Every request is one common system prompt of ``--system-tokens`` token ids followed by a short
question of its own (token ids, so the prompt length is exact), streamed from
``/v1/completions`` with greedy sampling and EOS ignored (``--max-tokens`` tokens each) by
``--clients`` closed-loop clients. The server is started twice on 127.0.0.1, one after the
other: with prefix caching (the default) and with ``--no-enable-prefix-caching``. Each start is
warmed up with a *different* system prompt and the cache reset (``POST
/reset_prefix_cache``), so the measured run starts cold and only its own requests warm it.

Reported per mode: time to first token (p50/p90/p99, client side), output tokens/s, requests/s,
the server's ``kvroom_prefix_cache_{queries,hits}_total`` deltas, and the on/off ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from sse_client import RequestTiming, one_request, percentiles, start_server  # noqa: E402


def prompt_ids(system: list[int], index: int) -> list[int]:
    """The common system prompt, then a question of 8..15 tokens unique to ``index``."""
    question = [1000 + (index * 37 + k * 11) % 5000 for k in range(8 + index % 8)]
    return system + question


def system_prompt(num_tokens: int, seed: int) -> list[int]:
    return [100 + (seed * 7919 + k * 131) % 20000 for k in range(num_tokens)]


async def run_clients(url: str, prompts: list[list[int]], clients: int, max_tokens: int):
    """``clients`` closed-loop clients over ``prompts``; (timings, wall seconds)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:

        async def client() -> None:
            while not queue.empty():
                timings.append(await one_request(http, queue.get_nowait(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return timings, time.perf_counter() - start


def counters(url: str) -> dict[str, float]:
    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split(" ")[0]
        if name in ("kvroom_prefix_cache_queries_total", "kvroom_prefix_cache_hits_total"):
            found[name.removeprefix("kvroom_prefix_cache_").removesuffix("_total")] = float(
                line.split()[-1]
            )
    return found


def measure(mode: str, args: argparse.Namespace, log_dir: Path) -> dict:
    flags = [] if mode == "on" else ["--no-enable-prefix-caching"]
    proc, url = start_server(args.artifact, flags + args.server_arg, [], log_dir / f"{mode}.log")
    try:
        warm = [prompt_ids(system_prompt(args.system_tokens, seed=99), i) for i in range(4)]
        asyncio.run(run_clients(url, warm, 4, 4))
        httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
        system = system_prompt(args.system_tokens, seed=1)
        prompts = [prompt_ids(system, i) for i in range(args.requests)]
        before = counters(url)
        timings, wall = asyncio.run(run_clients(url, prompts, args.clients, args.max_tokens))
        after = counters(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    tokens = sum(t.completion_tokens for t in timings)
    return {
        "mode": mode,
        "requests": len(timings),
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "req_s": len(timings) / wall,
        "ttft_ms_p50_p90_p99": percentiles([t.ttft * 1e3 for t in timings]),
        "prompt_tokens": sum(len(p) for p in prompts),
        "cache_queries": after.get("queries", 0) - before.get("queries", 0),
        "cache_hits": after.get("hits", 0) - before.get("hits", 0),
    }


def report(rows: list[dict]) -> None:
    print(
        f"{'caching':>7} {'reqs':>5} {'wall s':>7} {'tok/s':>7} {'req/s':>6} "
        f"{'TTFT p50/p90/p99 ms':>22} {'hit tokens':>11}"
    )
    for r in rows:
        ttft = "/".join(f"{v:.0f}" for v in r["ttft_ms_p50_p90_p99"])
        hits = f"{r['cache_hits']:.0f}/{r['cache_queries']:.0f}"
        print(
            f"{r['mode']:>7} {r['requests']:>5} {r['wall_s']:>7.1f} {r['output_tok_s']:>7.1f} "
            f"{r['req_s']:>6.2f} {ttft:>22} {hits:>11}"
        )
    on, off = rows
    print(
        f"on/off: throughput x{on['output_tok_s'] / off['output_tok_s']:.2f}, "
        f"TTFT p50 x{on['ttft_ms_p50_p90_p99'][0] / off['ttft_ms_p50_p90_p99'][0]:.2f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="artifact folder (kvroom compile ... -o ARTIFACT)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=64, help="requests in all (default 64)")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (EOS ignored)")
    p.add_argument("--server-arg", action="append", default=[], help="extra `serve` flag")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvroom-prefix-bench-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    rows = [measure(mode, args, log_dir) for mode in ("on", "off")]
    print(
        f"{args.requests} requests, {args.clients} clients, system prompt {args.system_tokens} "
        f"tokens, {args.max_tokens}-token answers; cpus {os.cpu_count()}, 1-min load "
        f"{load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
