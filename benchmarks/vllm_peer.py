"""kvroom against vLLM (CPU backend): same artifacts, same KV pool, same workloads, one run.

.venv/bin/python benchmarks/vllm_peer.py artifacts/smollm2-135m artifacts/smollm2-135m-bf16 \
    --vllm-python /path/to/vllm-env/bin/python [--repeats 3] [--json PATH]

An artifact whose weights vLLM's CPU backend cannot load (a GGUF kept as shipped) is compared
against vLLM on its dequantized copy, with the same pool: ``ART=DENSE`` (kvroom runs ``ART``,
vLLM ``DENSE``; ``kvroom compile smollm2-135m --dequantize``).

Per artifact, vLLM runs offline (``vllm.LLM(**args)``, ``args`` from
``kvroom.integrations.vllm.prepare``, so its pool is the plan's; prefix caching off in both
engines, so no repeat reuses an earlier run's blocks) in a subprocess of its own interpreter
that stays up between runs. Workloads, greedy and EOS ignored, as token ids:

* ``batch``: ``kvroom.bench.chat_prompts`` x ``--new-tokens`` (32 x 64), tokens/s;
* ``single``: one chat prompt x 128 tokens, tokens/s;
* ``ttft``: 8 distinct prompts of 1,500 tokens, 1 token each: seconds until every prompt has
  its first token (the prefill of 12,000 tokens in the artifact's step budget);
* ``batch_prefill``: the batch's prompts x 1 token: its prefill, so that the batch's decode
  rate is ``(tokens - requests) / (batch - batch_prefill)`` seconds.

Each repeat runs every workload on vLLM then on kvroom, so a busy spell of a shared machine
hits both; figures are medians of ``--repeats``. Each engine first warms up. The matmul ceiling
is timed in the kvroom process next to each batch run: the best of a few fp32 ``torch.mm`` of
``1024 x 1024 x 1024`` (GFLOP/s) divided by the model's FLOPs per token (2 x the projection
and LM-head weights; attention's own FLOPs are left out, which flatters no one), against
which the batch's decode rate (its prefill taken out) is set.
"""

from __future__ import annotations

import os

from kvroom.threads import wait_policy_env

os.environ.update(wait_policy_env())  # kvroom's idle-thread setting (kvroom/threads.py),
# before torch loads; vLLM's subprocess inherits it, so both engines run with the same one.

import argparse
import json
import queue
import statistics
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import psutil
import torch

from kvroom.bench import bench_kvroom, chat_prompts
from kvroom.integrations.vllm import VllmLaunch, prepare
from kvroom.integrations.vllm_serve import child_env, reported_kv_tokens, stop
from kvroom.llm import LLM

TTFT_PROMPTS, TTFT_LEN = 8, 1500
SINGLE_TOKENS = 128
TAG = "KVROOM_PEER "
VLLM_SCRIPT = """
import json, sys, time


def report(obj) -> None:
    print("KVROOM_PEER " + json.dumps(obj), flush=True)


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    start = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(**spec["engine_args"])
    startup_s = time.perf_counter() - start

    def generate(w, n=None, max_tokens=None):
        prompts = [{"prompt_token_ids": ids} for ids in w["prompts"][:n]]
        params = SamplingParams(temperature=0, max_tokens=max_tokens or w["max_tokens"],
                                ignore_eos=True)
        return llm.generate(prompts, params, use_tqdm=False)

    generate(spec["workloads"]["batch"], 2, 4)  # warm-up
    generate(spec["workloads"]["ttft"], 1)
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    report({"startup_s": startup_s, "num_gpu_blocks": blocks})
    while line := sys.stdin.readline().strip():  # one workload name per timed run; EOF ends
        start = time.perf_counter()
        outs = generate(spec["workloads"][line])
        seconds = time.perf_counter() - start
        report({"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs]})


if __name__ == "__main__":  # vLLM's engine starts worker processes
    main()
"""


class VllmPeer:
    """vLLM's offline engine in a subprocess of ``python``; ``run(name)`` is one timed generate."""

    def __init__(self, python: str, launch: VllmLaunch, loads: dict[str, dict[str, Any]]):
        env = child_env(launch)
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # same as kvroom's
        self.threads = env["OMP_NUM_THREADS"]
        self.proc = subprocess.Popen(
            [python, "-c", VLLM_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: deque[str] = deque(maxlen=80)
        self.kv_tokens: int | None = None
        threading.Thread(target=self._pump, daemon=True).start()
        self._send(json.dumps({"engine_args": launch.args, "workloads": loads}))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def result(self, timeout_s: float) -> dict[str, Any]:
        """The next tagged JSON line; other lines are kept as the log (and its KV line read)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError("vLLM exited early:\n" + "".join(self.log))
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])
            self.log.append(line)
            if self.kv_tokens is None:
                self.kv_tokens = reported_kv_tokens(line)
        raise TimeoutError(f"no result from vLLM within {timeout_s} s:\n" + "".join(self.log))

    def run(self, name: str, timeout_s: float) -> tuple[float, list[list[int]]]:
        self._send(name)
        out = self.result(timeout_s)
        return out["seconds"], out["token_ids"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # EOF: the script returns and vLLM shuts down
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            stop(self.proc)


def long_prompts(tokenizer: Any, n: int, length: int) -> list[list[int]]:
    """``n`` distinct prompts of exactly ``length`` token ids (numbered facts, then filler)."""
    out = []
    for i in range(n):
        text = " ".join(
            f"Note {i}.{j}: the {j}th tide of sea {i} rose {j % 7} feet." for j in range(400)
        )
        out.append(tokenizer.encode(text)[:length])
    assert all(len(p) == length for p in out), "filler text too short"
    return out


def workloads(llm: LLM, num_requests: int, new_tokens: int) -> dict[str, dict[str, Any]]:
    chat = chat_prompts(llm.tokenizer, num_requests)
    return {
        "batch": {"prompts": chat, "max_tokens": new_tokens},
        "single": {"prompts": chat[:1], "max_tokens": SINGLE_TOKENS},
        "ttft": {"prompts": long_prompts(llm.tokenizer, TTFT_PROMPTS, TTFT_LEN), "max_tokens": 1},
        "batch_prefill": {"prompts": chat, "max_tokens": 1},
    }


def flops_per_token(llm: LLM) -> float:
    """2 x (qkv + o + gate/up/down weights of every layer + the LM head)."""
    s = llm.runtime.spec
    attn = s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    attn += s.num_heads * s.head_dim * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    return 2.0 * (s.num_layers * (attn + mlp) + s.hidden_size * s.vocab_size)


def matmul_gflops(n: int = 1024, tries: int = 5) -> float:
    """Best fp32 ``torch.mm`` rate of ``tries`` n x n x n products, GFLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) that ``pid`` and its descendants have used so far (0 for
    processes gone meanwhile): what an engine burns while the other one runs."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def run_kvroom(llm: LLM, w: dict[str, Any]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    _, ids = bench_kvroom(llm, w["prompts"], w["max_tokens"])
    return time.perf_counter() - start, ids


def compare(artifact: Path, args: argparse.Namespace, peer_artifact: Path) -> dict[str, Any]:
    """Every workload on both engines, alternating, for one artifact (vLLM on
    ``peer_artifact``: the artifact itself, or its dequantized copy)."""
    launch = prepare(peer_artifact, enable_prefix_caching=False)
    llm = LLM(artifact, enable_prefix_caching=False)  # as vLLM runs here: no reuse between runs
    loads = workloads(llm, args.num_requests, args.new_tokens)
    peer = VllmPeer(args.vllm_python, launch, loads)
    secs: dict[str, dict[str, list[float]]] = {n: {"vllm": [], "kvroom": []} for n in loads}
    ids: dict[str, dict[str, list[list[int]]]] = {n: {} for n in loads}
    gflops: list[float] = []
    idle_cpu: dict[str, list[float]] = {"vllm_during_kvroom": [], "kvroom_during_vllm": []}
    try:
        ready = peer.result(args.startup_timeout)
        bench_kvroom(llm, loads["batch"]["prompts"][:2], 4)  # warm-up
        bench_kvroom(llm, loads["ttft"]["prompts"][:1], 1)
        for _ in range(args.repeats):
            for name, w in loads.items():
                own = own_cpu_seconds()
                seconds, ids[name]["vllm"] = peer.run(name, args.run_timeout)
                secs[name]["vllm"].append(seconds)
                idle_cpu["kvroom_during_vllm"].append(own_cpu_seconds() - own)
                other = tree_cpu_seconds(peer.proc.pid)
                seconds, ids[name]["kvroom"] = run_kvroom(llm, w)
                secs[name]["kvroom"].append(seconds)
                idle_cpu["vllm_during_kvroom"].append(tree_cpu_seconds(peer.proc.pid) - other)
                v, load = secs[name]["vllm"][-1], os.getloadavg()[0]
                print(f"  {artifact.name} {name}: vLLM {v:.2f} s, kvroom {seconds:.2f} s", end="")
                print(
                    f"; load {load:.1f}; CPU s of the idle engine: vLLM "
                    f"{idle_cpu['vllm_during_kvroom'][-1]:.2f}, kvroom "
                    f"{idle_cpu['kvroom_during_vllm'][-1]:.2f}",
                    flush=True,
                )
                if name == "batch":
                    gflops.append(matmul_gflops())
    finally:
        peer.close()
    figures = {}
    for name, w in loads.items():
        tokens = len(w["prompts"]) * w["max_tokens"]
        med = {e: statistics.median(s) for e, s in secs[name].items()}
        same = sum(a == b for a, b in zip(ids[name]["kvroom"], ids[name]["vllm"], strict=True))
        figures[name] = {
            "tokens": tokens,
            "requests": len(w["prompts"]),
            "median_s": med,
            "runs_s": secs[name],
            "same": same,
        }
    ceiling = statistics.median(gflops) * 1e9 / flops_per_token(llm)
    return {
        "artifact": str(artifact),
        "vllm_artifact": str(peer_artifact),
        "dtype": llm.runtime.info.config.dtype,
        "threads": {"kvroom": torch.get_num_threads(), "vllm": int(peer.threads)},
        "plan_kv_tokens": launch.plan.num_tokens,
        "vllm_kv_tokens": peer.kv_tokens,
        "vllm_blocks": [ready["num_gpu_blocks"], launch.pool.block_size],
        "vllm_startup_s": ready["startup_s"],
        "matmul_gflops": gflops,
        "ceiling_tokens_per_s": ceiling,
        "idle_engine_cpu_s": idle_cpu,
        "workloads": figures,
    }


def decode_rate(figures: dict[str, Any], engine: str) -> float:
    """The batch's decode tokens/s: its first tokens and their prefill taken out."""
    batch, prefill = figures["batch"], figures["batch_prefill"]
    seconds = batch["median_s"][engine] - prefill["median_s"][engine]
    return (batch["tokens"] - batch["requests"]) / seconds


LABELS = {
    "batch": "batch 32 x 64 (tok/s)",
    "single": "single 1 x 128 (tok/s)",
    "ttft": "TTFT 8 x 1500 (s)",
    "batch_prefill": "prefill of batch (s)",
}
TIMED_IN_SECONDS = ("ttft", "batch_prefill")
"""Workloads reported in seconds (the others in tokens/s)."""


def table(results: list[dict[str, Any]]) -> list[str]:
    """The side-by-side table: per artifact, every workload, kvroom / vLLM (higher = faster)."""
    lines = [f"{'dtype':<10}{'workload':<26}{'kvroom':>10}{'vLLM':>10}{'kvroom/vLLM':>13}  greedy"]
    for r in results:
        for name, f in r["workloads"].items():
            k, v = f["median_s"]["kvroom"], f["median_s"]["vllm"]
            label = LABELS[name]
            if name in TIMED_IN_SECONDS:
                kv, vv, unit = k, v, ".2f"
            else:
                kv, vv, unit = f["tokens"] / k, f["tokens"] / v, ".1f"
            same = f"{f['same']}/{f['requests']} identical"
            lines.append(
                f"{r['dtype']:<10}{label:<26}{kv:>10{unit}}{vv:>10{unit}}{v / k:>12.2f}x  {same}"
            )
        rate, vllm_rate = (decode_rate(r["workloads"], e) for e in ("kvroom", "vllm"))
        label = "batch decode only (tok/s)"
        lines.append(
            f"{r['dtype']:<10}{label:<26}{rate:>10.1f}{vllm_rate:>10.1f}{rate / vllm_rate:>12.2f}x"
        )
        gf, top = statistics.median(r["matmul_gflops"]), r["ceiling_tokens_per_s"]
        lines.append(
            f"{r['dtype']:<10}matmul ceiling: fp32 mm {gf:.0f} GFLOP/s -> {top:.0f} tok/s; "
            f"batch decode: kvroom at {rate / top:.0%} of it, vLLM at {vllm_rate / top:.0%}"
        )
    return lines


def print_report(results: list[dict[str, Any]], repeats: int) -> None:
    r0 = results[0]
    print(
        f"threads kvroom {r0['threads']['kvroom']}, vLLM {r0['threads']['vllm']}; medians of "
        f"{repeats} alternating runs; kvroom/vLLM > 1 means kvroom is faster (TTFT: vLLM's "
        f"seconds over kvroom's)"
    )
    for r in results:
        blocks, size = r["vllm_blocks"]
        print(
            f"{r['dtype']}: KV pool plan {r['plan_kv_tokens']} tokens; vLLM {blocks} x {size} = "
            f"{blocks * size} (its log: {r['vllm_kv_tokens']}); vLLM start-up "
            f"{r['vllm_startup_s']:.0f} s"
        )
    print("\n".join(table(results)))
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", help="ART, or ART=DENSE (vLLM runs DENSE)")
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("KVROOM_VLLM_PYTHON"),
        help="python of vLLM's virtualenv (default: $KVROOM_VLLM_PYTHON)",
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine")
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument("--run-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if not args.vllm_python:
        parser.error("--vllm-python (or KVROOM_VLLM_PYTHON) is required")
    results = []
    for spec in args.artifacts:  # each artifact's table as soon as it is done
        artifact, _, dense = spec.partition("=")
        results.append(compare(Path(artifact), args, Path(dense or artifact)))
        print("\n".join(table(results[-1:])), flush=True)
    print_report(results, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
