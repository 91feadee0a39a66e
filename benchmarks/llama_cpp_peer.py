"""kvroom against llama.cpp on the same GGUF file: a single stream, greedy, one run.

.venv/bin/python benchmarks/llama_cpp_peer.py artifacts/smollm2-135m \
    --llama-python /path/to/llama-env/bin/python [--repeats 5] [--json PATH]

The artifact keeps its GGUF weights as shipped (``kvroom compile smollm2-135m``, no
``--dequantize``); llama.cpp (llama-cpp-python, built from source in its own virtualenv) loads
that same ``model.gguf`` with ``n_threads`` = kvroom's thread count, in a subprocess that stays
up between runs. Workloads, as token ids, greedy, EOS ignored, no prompt reuse between runs
(kvroom's prefix cache off, llama.cpp's context reset before each run):

* ``single``: one chat prompt (``kvroom.bench.chat_prompts``) x 128 new tokens, tokens/s;
* ``long``: one prompt of 1,500 tokens x 1 token: seconds to its first token.

Each repeat runs every workload on llama.cpp then on kvroom; figures are medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from kvroom.artifact.layout import GGUF_WEIGHTS
from kvroom.bench import bench_kvroom, chat_prompts
from kvroom.llm import LLM

SINGLE_TOKENS = 128
LONG_LEN = 1500
LLAMA_SCRIPT = """
import json, sys, time
from llama_cpp import Llama

llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
            n_ctx=4096, n_batch=512, verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    llm.reset()
    start = time.perf_counter()
    out = []
    for token in llm.generate(job["prompt"], temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == job["max_tokens"]:
            break
    print(json.dumps({"seconds": time.perf_counter() - start, "ids": out}), flush=True)
"""


class LlamaPeer:
    """llama.cpp in its own interpreter, answering one JSON job per line."""

    def __init__(self, python: str, gguf: Path, threads: int) -> None:
        self.proc = subprocess.Popen(
            [python, "-c", LLAMA_SCRIPT, str(gguf), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return reply["seconds"], reply["ids"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def long_prompt(tokenizer: Any) -> list[int]:
    text = " ".join(f"Note {j}: the {j}th tide rose {j % 7} feet." for j in range(400))
    ids = tokenizer.encode(text)[:LONG_LEN]
    assert len(ids) == LONG_LEN, "filler text too short"
    return ids


def compare(artifact: Path, args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(artifact, enable_prefix_caching=False)
    threads = torch.get_num_threads()
    loads = {
        "single": (chat_prompts(llm.tokenizer, 1)[0], SINGLE_TOKENS),
        "long": (long_prompt(llm.tokenizer), 1),
    }
    peer = LlamaPeer(args.llama_python, artifact / GGUF_WEIGHTS, threads)
    secs: dict[str, dict[str, list[float]]] = {n: {"llama.cpp": [], "kvroom": []} for n in loads}
    ids: dict[str, dict[str, list[int]]] = {n: {} for n in loads}
    try:
        bench_kvroom(llm, [loads["single"][0]], 4)  # warm-up, both engines
        peer.run(loads["single"][0], 4)
        for _ in range(args.repeats):
            for name, (prompt, n) in loads.items():
                seconds, ids[name]["llama.cpp"] = peer.run(prompt, n)
                secs[name]["llama.cpp"].append(seconds)
                start = time.perf_counter()
                _, out = bench_kvroom(llm, [prompt], n)
                secs[name]["kvroom"].append(time.perf_counter() - start)
                ids[name]["kvroom"] = out[0]
                print(
                    f"  {name}: llama.cpp {secs[name]['llama.cpp'][-1]:.3f} s, "
                    f"kvroom {secs[name]['kvroom'][-1]:.3f} s",
                    flush=True,
                )
    finally:
        peer.close()
    figures = {}
    for name, (_, n) in loads.items():
        med = {e: statistics.median(s) for e, s in secs[name].items()}
        a, b = ids[name]["kvroom"], ids[name]["llama.cpp"]
        agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        figures[name] = {"tokens": n, "median_s": med, "runs_s": secs[name], "same_prefix": agree}
    return {"artifact": str(artifact), "threads": threads, "workloads": figures}


def print_report(result: dict[str, Any]) -> None:
    single, long = result["workloads"]["single"], result["workloads"]["long"]
    rate = {e: single["tokens"] / s for e, s in single["median_s"].items()}
    print(f"threads: {result['threads']} (both engines)")
    print(
        f"single 1 x {single['tokens']}: kvroom {rate['kvroom']:.1f} tok/s, llama.cpp "
        f"{rate['llama.cpp']:.1f} tok/s, ratio {rate['kvroom'] / rate['llama.cpp']:.2f}x; "
        f"greedy tokens identical for the first {single['same_prefix']} of {single['tokens']}"
    )
    ttft = long["median_s"]
    print(
        f"first token of {LONG_LEN} tokens: kvroom {ttft['kvroom']:.2f} s, llama.cpp "
        f"{ttft['llama.cpp']:.2f} s, ratio {ttft['llama.cpp'] / ttft['kvroom']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--llama-python", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = compare(args.artifact, args)
    result["repeats"] = args.repeats
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
