"""Decode speed by KV dtype: the attention kernel alone, and batch decode end to end, in one run.

    python benchmarks/kv_speed.py --workdir /path/to/workdir [--rounds 3] [--json out.json]

1. **Kernel**: one decode step's attention over 30 layers (SmolLM2's heads: 9 query, 3 KV,
   head dim 64; blocks of 16; 32 sequences of ``--keys`` keys in scattered blocks, one pool per
   layer, cold as in a step), fp32 queries over bf16, int8 and int4 pools, variants alternating
   round by round; median per layer, by CPU time (one thread: steady on a shared machine).
2. **End to end**: the artifacts ``bfloat16``, ``int8``, ``int8-norot`` and ``int4`` of
   ``kv_quality.py`` (fp32 weights; only the KV differs), each measure in a fresh process
   holding one artifact, the order alternating round by round: 32 prompts of
   ``--prompt-tokens`` tokens x 64 greedy new tokens run once untimed (their blocks into the
   prefix cache), then again, timed, their full blocks from the cache, so the time is mostly
   decode over long contexts; median wall and process CPU seconds of that batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvroom.models import kv_quant
from kvroom.models.kernels import cpu_kernels, ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, SEQS = 9, 3, 64, 16, 30, 32
POOLS = {"bfloat16": 0, "int8": 8, "int4": 4}
ARTIFACTS = ("bfloat16", "int8", "int8-norot", "int4")


def kernel_times(keys: int, rounds: int) -> dict[str, float]:
    """Median CPU microseconds per layer of each pool's decode attention."""
    torch.manual_seed(0)
    per_seq = -(-keys // BLOCK)
    units = SEQS * per_seq + 8
    tables = torch.randperm(units)[: SEQS * per_seq].view(SEQS, per_seq).contiguous()
    lens = torch.full((SEQS,), keys)
    q = torch.randn(SEQS, HEADS, HEAD_DIM)
    pools: dict[str, list[torch.Tensor]] = {}
    for name, bits in POOLS.items():
        make = torch.randn(units, BLOCK, 2, KV_HEADS, HEAD_DIM)
        pools[name] = [
            make.to(torch.bfloat16) if not bits else kv_quant.quantize(make, bits)
            for _ in range(LAYERS)
        ]
    samples: dict[str, list[float]] = {name: [] for name in POOLS}
    torch.set_num_threads(1)
    for _ in range(rounds):
        for name, bits in POOLS.items():
            start = time.process_time()
            for cache in pools[name]:
                if bits:
                    ops.decode_attention_q(q, cache, bits, tables, lens, 0.125, None)
                else:
                    ops.decode_attention(q, cache, tables, lens, 0.125, None)
            samples[name].append((time.process_time() - start) / LAYERS * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def end_to_end(workdir: Path, prompt_tokens: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds of one 32 x 64 batch per artifact (wall, CPU): each measure in a fresh
    process holding that artifact alone, the artifacts' order alternating round by round."""
    samples: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in ARTIFACTS}
    for r in range(rounds):
        for name in ARTIFACTS if r % 2 == 0 else ARTIFACTS[::-1]:
            cmd = [sys.executable, __file__, "--workdir", str(workdir), "--one-batch", name]
            cmd += ["--prompt-tokens", str(prompt_tokens)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            one = json.loads(out.strip().splitlines()[-1])
            print(json.dumps({"round": r, "artifact": name} | one), flush=True)
            samples[name]["wall"].append(one["batch_s"])
            samples[name]["cpu"].append(one["cpu_s"])
    return {
        name: {"batch_s": statistics.median(s["wall"]), "cpu_s": statistics.median(s["cpu"])}
        for name, s in samples.items()
    }


def one_batch(artifact: Path, prompt_tokens: int) -> dict[str, float]:
    """One 32 x 64 greedy batch over prompts already in the prefix cache (their full blocks
    read from the pool), after one untimed batch: seconds of wall and process CPU time."""
    from kvroom import LLM, SamplingParams

    blocks = SEQS * -(-(prompt_tokens + 64) // BLOCK) + 8
    llm = LLM(str(artifact), kvcache_num_blocks=blocks)
    text = (Path(__file__).parents[1] / "README.md").read_text()
    ids = llm.tokenizer.encode(text)
    prompts = [ids[i * 50 : i * 50 + prompt_tokens] for i in range(SEQS)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts, params)  # warm: the prompts' blocks into the prefix cache
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate(prompts, params)
    return {"batch_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--one-batch", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.one_batch:
        print(json.dumps(one_batch(args.workdir / args.one_batch, args.prompt_tokens)))
        return
    if not cpu_kernels().native:
        raise SystemExit("the native kernels are not built here (no compiler?)")
    threads = torch.get_num_threads()
    result: dict[str, object] = {"kernel_us_per_layer": kernel_times(args.keys, args.rounds * 3)}
    result["kernel_keys"] = args.keys
    print(json.dumps(result), flush=True)
    if not args.skip_end_to_end:
        torch.set_num_threads(threads)
        result["end_to_end"] = end_to_end(args.workdir, args.prompt_tokens, args.rounds)
        result["prompt_tokens"] = args.prompt_tokens
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
