"""Prefill attention, paths alternating in one run (noisy machines see them under the same load).

    python benchmarks/prefill_attention.py fresh [--tokens 1500] [--repeats 5]
    python benchmarks/prefill_attention.py context [--chunks 512 1024 2048]
        [--contexts 0 16 500 1000 1500] [--dtypes float32 bfloat16] [--rounds 7]
        [--against /path/to/other/cpu_kernels.cpp]
    python benchmarks/prefill_attention.py ttft --artifact artifacts/smollm2-135m-float32
        [--rounds 7]

``fresh``: one prompt at position 0, gathered from the pool (causal, as a chunk), the step's own
K/V under SDPA's causal mask (``PrefillGroup.fresh``), and the native kernel reading K/V in place
(``kernels.ops.prefill_attention``, where it is built).

``context``: one chunk after ``start`` cached positions, its keys gathered from the pool: under a
bottom-right mask tensor in one SDPA call ("masked"), as the cached part unmasked plus the chunk's
own keys under the causal mask, merged by log-sum-exp ("split", what kvroom runs on CPU), and the
native kernel. Prints per-call medians and split/masked, native/masked ratios. ``--against``
builds another version of ``cpu_kernels.cpp`` and times its native kernel too ("other"), with
native/other and the largest difference between the two kernels' outputs.

``ttft``: ``vllm_peer.py``'s TTFT workload (8 prompts of 1,500 tokens, one greedy token each,
no prefix caching) through ``kvroom.LLM``, cached-context chunks split vs masked, alternating.

Shapes default to SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64, block size 16).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

from kvroom.models import prefill_attention
from kvroom.models.attention import KindBatch, paged_attention
from kvroom.models.kernels import cpu_kernels
from kvroom.models.kernels import ops as native
from kvroom.models.kernels.build import build_library
from kvroom.models.prefill_attention import PrefillChunk, PrefillGroup

TTFT_PROMPTS, TTFT_LEN = 8, 1500  # vllm_peer.py's TTFT workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=("fresh", "context", "ttft"), default="fresh")
    parser.add_argument("--artifact", type=Path, help="ttft: compiled artifact to run")
    parser.add_argument("--tokens", type=int, default=1500, help="fresh: prompt length")
    parser.add_argument("--repeats", type=int, default=5, help="fresh: calls per timing")
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 16, 500, 1000, 1500])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7, help="context: timed calls per path")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--against", type=Path, help="context: another cpu_kernels.cpp")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "fresh":
        fresh(args)
        return
    if args.mode == "ttft":
        ttft(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        other = None
        if args.against is not None:
            try:
                other = build_library(args.against, Path(tmp) / "other.so")
            except (OSError, subprocess.CalledProcessError) as exc:
                raise SystemExit(f"--against: {exc}") from None
        print(f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.1f}")
        head = f"{'dtype':<9} {'chunk':>5} {'start':>5}  {'masked':>9} {'split':>9} {'native':>9}"
        head += f"  {'split/m':>7} {'native/m':>8}  max|split-masked|"
        if other is not None:
            head += f"  {'other':>9} {'native/other':>12}  max|native-other|"
        print(head)
        for name in args.dtypes:
            for q_len in args.chunks:
                for start in args.contexts:
                    context(args, getattr(torch, name), q_len, start, other)


def _pool(args: argparse.Namespace, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """A pool holding ``tokens`` random keys and values in blocks ``0 .. n - 1``."""
    n = -(-tokens // args.block_size)
    return torch.randn(n, args.block_size, 2, args.kv_heads, args.head_dim).to(dtype)


@contextmanager
def _masked() -> Iterator[None]:
    """Chunks with cached context take the single masked SDPA call instead of the split."""
    with mock.patch.object(prefill_attention, "_split_applies", lambda *_: False):
        yield


def _timed(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def context(
    args: argparse.Namespace,
    dtype: torch.dtype,
    q_len: int,
    start: int,
    other: ctypes.CDLL | None = None,
) -> None:
    """One chunk of ``q_len`` tokens after ``start`` cached ones, the paths alternating
    (``other``: another build's native kernel too)."""
    cache = _pool(args, start + q_len, dtype)
    q = torch.randn(q_len, args.heads, args.head_dim).to(dtype)
    table = torch.arange(cache.shape[0])[None]
    chunk = PrefillChunk(0, q_len, start, start + q_len, table)
    scale = args.head_dim**-0.5

    def masked() -> torch.Tensor:
        with _masked():
            return prefill_attention._prefill_chunks(q, cache, (chunk,), scale, None)

    def split() -> torch.Tensor:
        return prefill_attention._prefill_chunks(q, cache, (chunk,), scale, None)

    paths: dict[str, Callable[[], torch.Tensor]] = {"masked": masked, "split": split}
    starts, q_lens = torch.tensor([start]), torch.tensor([q_len])
    if native.prefill_attention(q, cache, table, starts, q_lens, scale) is not None:
        paths["native"] = lambda: native.prefill_attention(q, cache, table, starts, q_lens, scale)
        if other is not None:
            paths["other"] = lambda: native.prefill_attention(
                q, cache, table, starts, q_lens, scale, lib=other
            )
    diff = (split().float() - masked().float()).abs().max().item()
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(args.rounds):
        for p, fn in paths.items():
            times[p].append(_timed(fn))
    ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
    cells = [f"{ms.get(p, float('nan')):9.2f}" for p in ("masked", "split", "native")]
    ratio = ms["split"] / ms["masked"]
    nat = ms.get("native", float("nan")) / ms["masked"]
    line = f"{str(dtype)[6:]:<9} {q_len:>5} {start:>5}  {' '.join(cells)}  {ratio:7.3f} {nat:8.3f}"
    line += f"  {diff:17.1e}"
    if "other" in paths:
        apart = (paths["native"]().float() - paths["other"]().float()).abs().max().item()
        line += f"  {ms['other']:9.2f} {ms['native'] / ms['other']:12.3f}  {apart:.1e}"
    print(line, flush=True)


def ttft(args: argparse.Namespace) -> None:
    """Seconds until all 8 x 1,500-token prompts have their first token, both paths."""
    from vllm_peer import long_prompts  # benchmarks/ is on sys.path when run as a script

    from kvroom.bench import bench_kvroom
    from kvroom.llm import LLM

    llm = LLM(args.artifact, enable_prefix_caching=False)
    prompts = long_prompts(llm.tokenizer, TTFT_PROMPTS, TTFT_LEN)

    def masked() -> list[list[int]]:
        with _masked():
            return bench_kvroom(llm, prompts, 1)[1]

    def split() -> list[list[int]]:
        return bench_kvroom(llm, prompts, 1)[1]

    same = masked() == split()  # also the warm-up
    paths = {"masked": masked, "split": split}
    wall: dict[str, list[float]] = {p: [] for p in paths}
    cpu: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(args.rounds):
        for p, fn in paths.items():
            start = time.process_time()
            wall[p].append(_timed(fn))
            cpu[p].append(time.process_time() - start)
    print(f"{args.artifact} ({llm.runtime.info.config.dtype}), {torch.get_num_threads()} threads")
    print(f"TTFT {TTFT_PROMPTS} x {TTFT_LEN}, same first tokens: {same}; medians of {args.rounds}:")
    for name, secs in (("wall", wall), ("cpu", cpu)):
        med = {p: statistics.median(t) for p, t in secs.items()}
        runs = " ".join(f"{p} " + " ".join(f"{x:.2f}" for x in t) for p, t in secs.items())
        print(f"  {name}: masked {med['masked']:.2f} s, split {med['split']:.2f} s,", end="")
        print(f" split/masked {med['split'] / med['masked']:.3f}  ({runs})")


def fresh(args: argparse.Namespace) -> None:
    """One fresh prompt, three paths (the first two in ``paged_attention``)."""
    t, d = args.tokens, args.head_dim
    cache = _pool(args, t, torch.float32)
    q = torch.randn(t, args.heads, d)
    kv = cache.view(-1, 2, args.kv_heads, d)[:t].clone()
    table = torch.arange(cache.shape[0])[None]
    starts, q_lens = torch.tensor([0]), torch.tensor([t])
    chunks = (PrefillChunk(0, t, 0, t, table),)
    gathered = PrefillGroup(0, 1, t, None, table, chunks=chunks)
    own = PrefillGroup(0, 1, t, None, table, fresh=True)

    def run(group: PrefillGroup) -> torch.Tensor:
        batch = KindBatch(sliding=False, write_index=torch.arange(t), decode=None, prefill=group)
        return paged_attention(q, kv, cache, batch, d**-0.5)

    paths: dict[str, Callable[[], torch.Tensor]] = {
        "gathered, causal": lambda: run(gathered),
        "fresh, causal": lambda: run(own),
    }
    if cpu_kernels().native:
        paths["native, in place"] = lambda: native.prefill_attention(
            q, cache, table, starts, q_lens, d**-0.5
        )
    ref = run(gathered)
    diff = max((fn() - ref).abs().max().item() for fn in paths.values())
    flops = 4 * t * (t + 1) / 2 * args.heads * d
    print(f"{t} tokens, {args.heads}/{args.kv_heads} heads x {d}; max |difference| {diff:.1e}")
    print(f"causal attention: {flops / 1e9:.2f} GFLOP per layer; load {os.getloadavg()[0]:.1f}")
    for _ in range(2):  # alternate, so all see the same machine
        for name, fn in paths.items():
            ms = statistics.mean(_timed(fn) for _ in range(args.repeats)) * 1e3
            rate = flops / ms / 1e6
            print(f"  {name:<16} {ms:7.1f} ms per layer ({rate:.0f} GFLOP/s causal)")


if __name__ == "__main__":
    main()
