"""Decode attention, the decode kernel against the tiled prefill kernel, alternating in one run.

    .venv/bin/python benchmarks/decode_attention.py [--dtype float32|bfloat16] [--seqs 32]
        [--rounds 7]

One query row per sequence over its pool blocks, read in place, as a decode step runs it:
SmolLM2-135M's heads (9 query, 3 KV, head dim 64), blocks of 16, sequences of 40-125 keys in
scattered blocks, each of 30 layers with its own pool (cold, as in a step). Prints each path's
median time per layer and the largest difference between their outputs. Needs the native
kernels (``kvroom.models.kernels``); the decode kernel's vector path takes head dims
64/128/256 (16-float vectors on AVX-512, 8-float ones elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvroom.models.kernels import cpu_kernels, ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by CPU time, not the wall clock (with OMP_NUM_THREADS=1: steady under load)",
    )
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not cpu_kernels().native:
        raise SystemExit("the native kernels are not built here (no compiler?)")
    dtype = getattr(torch, args.dtype)
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.manual_seed(0)
    lens = torch.tensor([40 + (i * 37) % 86 for i in range(args.seqs)])
    per_seq = int(-(-lens.max() // BLOCK))
    units = args.seqs * per_seq + 8
    pools = [torch.randn(units, BLOCK, 2, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    tables = torch.randperm(units)[: args.seqs * per_seq].view(args.seqs, per_seq).contiguous()
    qkv = torch.randn(args.seqs, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(args.seqs, HEADS, HEAD_DIM)  # strided, as in a step
    one = torch.ones_like(lens)
    scale = HEAD_DIM**-0.5
    paths = {
        "decode kernel": lambda pool: ops.decode_attention(q, pool, tables, lens, scale, None),
        "prefill kernel": lambda pool: ops.prefill_attention(q, pool, tables, lens - 1, one, scale),
    }
    outs = {name: fn(pools[0]) for name, fn in paths.items()}
    diff = (outs["decode kernel"].float() - outs["prefill kernel"].float()).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            start = clock()
            for pool in pools:
                fn(pool)
            times[name].append((clock() - start) / LAYERS)
    vector = ops.decode_vectorized(HEAD_DIM)
    print(f"{args.dtype}, {args.seqs} sequences of 40-125 keys; vector decode path: {vector}")
    for name, ts in times.items():
        print(f"{name:15s} {statistics.median(ts) * 1e3:7.3f} ms per layer")
    print(f"max |decode - prefill| = {diff:.1e}")


if __name__ == "__main__":
    main()
