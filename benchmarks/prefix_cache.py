"""Prefix caching on vs off, and vLLM: a shared-system-prompt workload, the same client.

    .venv/bin/python benchmarks/prefix_cache.py ARTIFACT [--clients 32] [--system-tokens 1024]
        [--max-tokens 64] [--requests 64] [--vllm-python /path/to/vllm-env/bin/python]
        [--json out.json]

Every request is one common system prompt of ``--system-tokens`` token ids followed by a short
question of its own (token ids, so the prompt length is exact), streamed from
``/v1/completions`` with greedy sampling and EOS ignored (``--max-tokens`` tokens each) by
``--clients`` closed-loop clients. The servers take turns on 127.0.0.1, one at a time:
``kvroom serve`` with prefix caching (the default), ``vllm serve`` on the same artifact and
pool when ``--vllm-python`` is given (started as ``kvroom serve --engine vllm`` starts it; its
prefix caching on, vLLM's default), and ``kvroom serve --no-enable-prefix-caching``. Each start
is warmed up with a *different* system prompt and the cache reset (``POST
/reset_prefix_cache``; vLLM gets ``VLLM_SERVER_DEV_MODE=1`` for it), so the measured run starts
cold and only its own requests warm it.

Reported per server: time to first token (p50/p90/p99, client side), output tokens/s,
requests/s, the server's prefix-cache query and hit deltas (tokens: kvroom's
``kvroom_prefix_cache_*_total``, vLLM's ``vllm:prefix_cache_*_total``), the 1-minute load
average around the run, and the ratios kvroom on / off and kvroom on / vLLM.
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

import httpx

from kvroom.threads import choose_wait_policy

sys.path.insert(0, str(Path(__file__).parent))
from sse_client import (  # noqa: E402
    RequestTiming,
    one_request,
    percentiles,
    start_server,
    start_vllm_server,
)

MODEL = "bench"
"""The served model name, the same on every server."""
CACHE_METRICS = ("kvroom_prefix_cache_", "vllm:prefix_cache_")
LABELS = {"on": "kvroom on", "off": "kvroom off", "vllm": "vllm"}
VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # for POST /reset_prefix_cache
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # both cores compute, as kvroom's (a loop shares them)
}


def prompt_ids(system: list[int], index: int) -> list[int]:
    """The common system prompt, then a question of 8..15 tokens unique to ``index``."""
    question = [1000 + (index * 37 + k * 11) % 5000 for k in range(8 + index % 8)]
    return system + question


def system_prompt(num_tokens: int, seed: int) -> list[int]:
    return [100 + (seed * 7919 + k * 131) % 20000 for k in range(num_tokens)]


async def run_clients(
    url: str, prompts: list[list[int]], clients: int, max_tokens: int, model: str
) -> tuple[list[RequestTiming], float]:
    """``clients`` closed-loop clients over ``prompts``; (timings, wall seconds)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:

        async def client() -> None:
            while not queue.empty():
                timings.append(await one_request(http, queue.get_nowait(), max_tokens, model))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return timings, time.perf_counter() - start


def counters(url: str) -> dict[str, float]:
    """Prefix-cache queries and hits (tokens) from ``/metrics``: kvroom's or vLLM's names."""
    found: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split(" ")[0].split("{")[0]
        for prefix in CACHE_METRICS:
            if name in (f"{prefix}queries_total", f"{prefix}hits_total"):
                key = name.removeprefix(prefix).removesuffix("_total")
                found[key] = found.get(key, 0.0) + float(line.split()[-1])
    return found


def start(mode: str, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    """The server of ``mode``: kvroom with caching on or off, or vLLM (its default, on); every
    server inherits kvroom's idle-thread setting (``kvroom.threads``), chosen once here."""
    choose_wait_policy()
    name = ["--served-model-name", MODEL]
    if mode == "vllm":
        env = dict(VLLM_ENV, **dict(item.split("=", 1) for item in args.vllm_env))
        return start_vllm_server(args.artifact, args.vllm_python, name, env, log)
    flags = [] if mode == "on" else ["--no-enable-prefix-caching"]
    return start_server(args.artifact, [*flags, *name, *args.server_arg], [], log)


def measure(mode: str, args: argparse.Namespace, log_dir: Path) -> dict:
    proc, url = start(mode, args, log_dir / f"{mode}.log")
    load = os.getloadavg()[0]
    try:
        warm = [prompt_ids(system_prompt(args.system_tokens, seed=99), i) for i in range(4)]
        asyncio.run(run_clients(url, warm, 4, 4, MODEL))
        httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
        system = system_prompt(args.system_tokens, seed=1)
        prompts = [prompt_ids(system, i) for i in range(args.requests)]
        before = counters(url)
        timings, wall = asyncio.run(run_clients(url, prompts, args.clients, args.max_tokens, MODEL))
        after = counters(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(180)
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
        "loadavg_1m_before_after": [load, os.getloadavg()[0]],
    }


def report(rows: list[dict]) -> None:
    print(
        f"{'server':>10} {'reqs':>5} {'wall s':>7} {'tok/s':>7} {'req/s':>6} "
        f"{'TTFT p50/p90/p99 ms':>22} {'hit tokens':>13} {'load 1m':>11}"
    )
    for r in rows:
        ttft = "/".join(f"{v:.0f}" for v in r["ttft_ms_p50_p90_p99"])
        hits = f"{r['cache_hits']:.0f}/{r['cache_queries']:.0f}"
        load = "->".join(f"{v:.2f}" for v in r["loadavg_1m_before_after"])
        print(
            f"{LABELS[r['mode']]:>10} {r['requests']:>5} {r['wall_s']:>7.1f} "
            f"{r['output_tok_s']:>7.1f} {r['req_s']:>6.2f} {ttft:>22} {hits:>13} {load:>11}"
        )
    by_mode = {r["mode"]: r for r in rows}
    for a, b in (("on", "off"), ("on", "vllm")):
        if a in by_mode and b in by_mode:
            print(f"{LABELS[a]} / {LABELS[b]}: {ratios(by_mode[a], by_mode[b])}")


def ratios(a: dict, b: dict) -> str:
    tput = a["output_tok_s"] / b["output_tok_s"]
    (a50, a90, _), (b50, b90, _) = a["ttft_ms_p50_p90_p99"], b["ttft_ms_p50_p90_p99"]
    p50, p90 = a50 / b50, a90 / b90
    return f"throughput x{tput:.2f}, TTFT p50 x{p50:.2f}, p90 x{p90:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="artifact folder (kvroom compile ... -o ARTIFACT)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=64, help="requests in all (default 64)")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (EOS ignored)")
    p.add_argument("--server-arg", action="append", default=[], help="extra kvroom `serve` flag")
    p.add_argument(
        "--vllm-python", default=None, help="python of a vLLM virtualenv: also run `vllm serve`"
    )
    p.add_argument(
        "--vllm-env", action="append", default=[], help="KEY=VALUE for vLLM (over the defaults)"
    )
    p.add_argument(
        "--modes", default=None, help="comma list of on, off, vllm (default: on, off[, vllm])"
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    default = "on,vllm,off" if args.vllm_python else "on,off"
    args.modes = (args.modes or default).split(",")
    if "vllm" in args.modes and not args.vllm_python:
        p.error("--modes vllm needs --vllm-python")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvroom-prefix-bench-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"server logs under {log_dir}", flush=True)
    rows = []
    for mode in args.modes:
        rows.append(measure(mode, args, log_dir))
        print(f"  {LABELS[mode]}: {rows[-1]['wall_s']:.1f} s", flush=True)
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
