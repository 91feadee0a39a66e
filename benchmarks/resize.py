"""Live KV pool resize: how long a grow and a shrink take with 32 running sequences, and what a
resize costs the throughput of the steps around it.

python benchmarks/resize.py ARTIFACT [--num-seqs 32] [--large 4096] [--small 512] [--json F]

The artifact's pool must be able to reach ``--large`` blocks (compile it with
``--kvcache-num-blocks LARGE``, or a batch size that makes ``num_full_blocks`` that large).
Measured, each side by side in one process:

- shrink ``large -> small`` with no block to move (the sequences hold only low ids);
- grow ``small -> large``;
- shrink ``large -> small`` that must move every block of the 32 sequences (they were made
  to hold high ids first);
- decode throughput over the same number of steps with a ``large <-> large/2`` resize every
  ``--resize-every`` steps against none (ratio; 1.0 means free).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import deque
from typing import Any

from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _start(llm: LLM, num_seqs: int, prompt_len: int, max_tokens: int) -> list[str]:
    """Submit ``num_seqs`` requests and step until every one is decoding."""
    engine = llm.runtime.engine
    prompt = [(7 * i) % 200 + 3 for i in range(prompt_len)]
    ids = [engine.add_request(prompt, _params(max_tokens)) for _ in range(num_seqs)]
    while engine.scheduler.num_waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler._running
    ):
        engine.step()
    return ids


def _finish(llm: LLM) -> None:
    engine = llm.runtime.engine
    for rid in list(engine._requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def _hand_out_high_ids_first(llm: LLM) -> None:
    """Order the free list highest id first, so the next sequences hold only ids a shrink
    removes and every one of their blocks must move."""
    bm = llm.runtime.engine.scheduler.block_manager
    bm._free_blocks = deque(sorted(bm._free_blocks, reverse=True))


def time_resizes(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    large, small = args.large, args.small
    llm.resize_kv_cache(large)
    _start(llm, args.num_seqs, args.prompt_len, args.max_tokens)
    used = llm.runtime.engine.stats.num_used_blocks
    plain = llm.resize_kv_cache(small)
    grow = llm.resize_kv_cache(large)
    _finish(llm)
    _hand_out_high_ids_first(llm)
    _start(llm, args.num_seqs, args.prompt_len, args.max_tokens)
    moving = llm.resize_kv_cache(small)
    _finish(llm)
    return {
        "num_used_blocks": used,
        "shrink_no_migration": plain.__dict__,
        "grow": grow.__dict__,
        "shrink_with_migration": moving.__dict__,
        "bytes_per_block": llm.kv_cache_state().bytes_per_block,
    }


def decode_throughput(llm: LLM, args: argparse.Namespace, resize_every: int | None) -> float:
    """Generated tokens per second over ``args.steps`` decode steps of ``num_seqs`` sequences."""
    llm.resize_kv_cache(args.large)
    engine = llm.runtime.engine
    _start(llm, args.num_seqs, args.prompt_len, args.steps + 8)
    sizes = [args.large // 2, args.large]
    tokens = 0
    start = time.perf_counter()
    for step in range(args.steps):
        if resize_every and step % resize_every == resize_every - 1:
            llm.resize_kv_cache(sizes[(step // resize_every) % 2])
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    _finish(llm)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--large", type=int, default=4096)
    parser.add_argument("--small", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--resize-every", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(args.artifact, kvcache_max_blocks=args.large)
    result = time_resizes(llm, args)
    none = decode_throughput(llm, args, None)
    resizing = decode_throughput(llm, args, args.resize_every)
    again = decode_throughput(llm, args, None)
    result["decode_tokens_per_s"] = {
        "no_resize": [none, again],
        f"resize_every_{args.resize_every}_steps": resizing,
        "ratio": resizing / ((none + again) / 2),
    }
    result["load_average"] = os.getloadavg()
    for name in ("shrink_no_migration", "grow", "shrink_with_migration"):
        r = result[name]
        print(
            f"{name:22s} {r['from_blocks']:5d} -> {r['to_blocks']:5d} blocks: "
            f"{r['seconds'] * 1e3:8.1f} ms ({r['num_moved_blocks']} moved, "
            f"{r['num_preempted']} preempted)"
        )
    t = result["decode_tokens_per_s"]
    print(
        f"decode tok/s: no resize {t['no_resize'][0]:.0f} / {t['no_resize'][1]:.0f}, with a "
        f"resize every {args.resize_every} steps {resizing:.0f} (ratio {t['ratio']:.2f}); "
        f"load {result['load_average'][0]:.1f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
