"""Prefill attention of one fresh prompt, three paths in one run: gathered from the pool under a
mask tensor (torch, a chunk with cached context), the step's own K/V under SDPA's causal mask
(torch, ``PrefillGroup.fresh``), and the native kernel reading K/V in place from the blocks
(``kernels.ops.prefill_attention``, where it is built).

    python benchmarks/prefill_attention.py [--tokens 1500] [--repeats 5]

Shapes default to SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64, block size 16).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from kvroom.models.attention import KindBatch, PrefillGroup, paged_attention
from kvroom.models.kernels import cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    t, d, bs = args.tokens, args.head_dim, args.block_size
    num_blocks = -(-t // bs)
    torch.manual_seed(0)
    cache = torch.zeros(num_blocks, bs, 2, args.kv_heads, d)
    q = torch.randn(t, args.heads, d)
    kv = torch.randn(t, 2, args.kv_heads, d)
    keys = num_blocks * bs
    allowed = torch.arange(keys)[None, :] <= torch.arange(t)[:, None]
    mask = torch.zeros(1, 1, t, keys).masked_fill_(~allowed, float("-inf"))
    gathered = PrefillGroup(0, 1, t, None, torch.arange(num_blocks)[None], mask)
    fresh = dataclasses.replace(gathered, mask=None, fresh=True)
    chunk = {"starts": torch.tensor([0]), "q_lens": torch.tensor([t])}
    native = dataclasses.replace(fresh, **chunk)
    paths = [("gathered + mask", gathered), ("fresh, causal", fresh)]
    if cpu_kernels().native:
        paths.append(("native, in place", native))

    def run(group: PrefillGroup) -> torch.Tensor:
        batch = KindBatch(sliding=False, write_index=torch.arange(t), decode=None, prefill=group)
        return paged_attention(q, kv, cache, batch, d**-0.5)

    ref = run(gathered)
    diff = max((run(group) - ref).abs().max().item() for _, group in paths)
    flops = 4 * t * (t + 1) / 2 * args.heads * d
    print(f"{t} tokens, {args.heads}/{args.kv_heads} heads x {d}; max |difference| {diff:.1e}")
    print(f"causal attention: {flops / 1e9:.2f} GFLOP per layer; load {os.getloadavg()[0]:.1f}")
    for _ in range(2):  # alternate, so all see the same machine
        for name, group in paths:
            start = time.perf_counter()
            for _ in range(args.repeats):
                run(group)
            ms = (time.perf_counter() - start) / args.repeats * 1e3
            rate = flops / ms / 1e6
            print(f"  {name:<16} {ms:7.1f} ms per layer ({rate:.0f} GFLOP/s causal)")


if __name__ == "__main__":
    main()
