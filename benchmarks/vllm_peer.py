"""kvroom against vLLM (CPU backend) on the same workload and the same KV pool.

.venv/bin/python benchmarks/vllm_peer.py artifacts/smollm2-135m \
    --vllm-python /work/vllm-venv/bin/python [--num-requests 32 --new-tokens 64] [--json PATH]

Workload (as ``kvroom bench``): ``kvroom.bench.chat_prompts`` as token ids, greedy, EOS ignored,
``--new-tokens`` each. vLLM runs offline (``vllm.LLM(**args)``, ``args`` from
``kvroom.integrations.vllm.prepare``, so its pool is the plan's) in a subprocess of its own
interpreter, which stays up between runs: the timed generates alternate vLLM, kvroom, vLLM,
kvroom, ... (the machine may be shared; a busy spell then hits both). Each engine first warms
up on 2 prompts x 4 tokens; figures are medians of ``--repeats`` runs. vLLM's start-up is the
import plus ``LLM(...)`` (its first start compiles for minutes; later ones reuse the cache).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvroom.bench import Measurement, bench_kvroom, chat_prompts
from kvroom.integrations.vllm import VllmLaunch, prepare
from kvroom.integrations.vllm_serve import child_env, reported_kv_tokens, stop
from kvroom.llm import LLM

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
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]

    def generate(n, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate(prompts[:n], params, use_tqdm=False)

    generate(2, 4)  # warm-up
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    report({"startup_s": startup_s, "num_gpu_blocks": blocks})
    while sys.stdin.readline():  # one line per timed run; EOF ends
        start = time.perf_counter()
        outs = generate(len(prompts), spec["new_tokens"])
        seconds = time.perf_counter() - start
        report({"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs]})


if __name__ == "__main__":  # vLLM's engine starts worker processes
    main()
"""


class VllmPeer:
    """vLLM's offline engine in a subprocess of ``python``; ``run()`` is one timed generate."""

    def __init__(self, python: str, launch: VllmLaunch, prompts: list[list[int]], new_tokens: int):
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
        spec = {"engine_args": launch.args, "prompts": prompts, "new_tokens": new_tokens}
        self._send(json.dumps(spec))

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

    def run(self, timeout_s: float) -> tuple[float, list[list[int]]]:
        self._send("run")
        out = self.result(timeout_s)
        return out["seconds"], out["token_ids"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # EOF: the script returns and vLLM shuts down
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            stop(self.proc)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None when equal."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    launch = prepare(args.artifact)
    llm = LLM(args.artifact)
    prompts = chat_prompts(llm.tokenizer, args.num_requests)
    peer = VllmPeer(args.vllm_python, launch, prompts, args.new_tokens)
    try:
        ready = peer.result(args.startup_timeout)
        bench_kvroom(llm, prompts[:2], 4)  # warm-up
        secs: dict[str, list[float]] = {"vllm": [], "kvroom": []}
        ids: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            seconds, ids["vllm"] = peer.run(args.run_timeout)
            secs["vllm"].append(seconds)
            start = time.perf_counter()
            _, ids["kvroom"] = bench_kvroom(llm, prompts, args.new_tokens)
            secs["kvroom"].append(time.perf_counter() - start)
    finally:
        peer.close()
    rows = {
        name: Measurement(label, sum(map(len, ids[name])), statistics.median(secs[name]))
        for name, label in (("vllm", "vLLM LLM.generate"), ("kvroom", "kvroom LLM.generate"))
    }
    diffs = [first_difference(k, v) for k, v in zip(ids["kvroom"], ids["vllm"], strict=True)]
    return {
        "artifact": str(args.artifact),
        "num_requests": args.num_requests,
        "new_tokens": args.new_tokens,
        "dtype": llm.runtime.info.config.dtype,
        "threads": {"kvroom": torch.get_num_threads(), "vllm": int(peer.threads)},
        "plan_kv_tokens": launch.plan.num_tokens,
        "vllm_kv_tokens": peer.kv_tokens,
        "vllm_blocks": [ready["num_gpu_blocks"], launch.pool.block_size],
        "vllm_startup_s": ready["startup_s"],
        "rows": {n: asdict(m) | {"tokens_per_s": m.tokens_per_s} for n, m in rows.items()},
        "runs_s": secs,
        "ratio_kvroom_over_vllm": rows["kvroom"].tokens_per_s / rows["vllm"].tokens_per_s,
        "matched": sum(d is None for d in diffs),
        "first_differences": [d for d in diffs if d is not None],
    }


def print_report(r: dict[str, Any]) -> None:
    blocks, size = r["vllm_blocks"]
    print(
        f"workload: {r['num_requests']} chat requests x {r['new_tokens']} new tokens, greedy, "
        f"EOS ignored; {r['dtype']}; threads kvroom {r['threads']['kvroom']}, vLLM "
        f"{r['threads']['vllm']}"
    )
    print(
        f"KV pool: plan {r['plan_kv_tokens']} tokens; vLLM {blocks} blocks x {size} = "
        f"{blocks * size} tokens (its log: {r['vllm_kv_tokens']})"
    )
    print(f"{'engine':<24}{'tokens':>8}{'seconds':>10}{'tok/s':>10}{'kvroom/vLLM':>13}")
    base = r["rows"]["vllm"]["tokens_per_s"]
    for row in r["rows"].values():
        print(
            f"{row['name']:<24}{row['tokens']:>8}{row['seconds']:>10.2f}"
            f"{row['tokens_per_s']:>10.1f}{row['tokens_per_s'] / base:>12.2f}x"
        )
    runs = "; ".join(f"{n} " + ", ".join(f"{s:.2f}" for s in v) for n, v in r["runs_s"].items())
    print(f"median of {len(r['runs_s']['vllm'])} alternating runs each (s: {runs})")
    print(f"vLLM start-up (import + LLM(...)): {r['vllm_startup_s']:.1f} s")
    diffs = (
        f"; others first differ at token {r['first_differences']}" if r["first_differences"] else ""
    )
    print(f"greedy token ids: {r['matched']}/{r['num_requests']} requests identical{diffs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--vllm-python", required=True, help="python of vLLM's virtualenv")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine")
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument("--run-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    results = run(args)
    print_report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
