"""``kvroom serve`` flags of the live pool: ``--admin-key``, elastic mode and its bounds.

``--kvcache-num-blocks elastic`` starts at the memory estimate for this machine (clamped to
``[--kvcache-min-blocks, --kvcache-max-blocks]``; the minimum when the estimate does not fit)
and then lets the elastic controller follow the memory (``engine/kv/elastic.py``), keeping
``--kvcache-reserve-memory`` free (1 GiB when that is 0).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvroom.errors import ConfigError, MemoryNotEnoughError

ELASTIC = "elastic"


def add_live_pool_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin-key",
        default=None,
        help="enable GET/POST /kv_cache for requests with 'Authorization: Bearer KEY' "
        "(without it the admin endpoints answer 404)",
    )
    parser.add_argument(
        "--kvcache-min-blocks",
        type=int,
        default=None,
        help="elastic mode: never shrink below (default: one max_seq_len sequence)",
    )
    parser.add_argument(
        "--kvcache-max-blocks",
        type=int,
        default=None,
        help="largest pool a live resize may reach; address space is reserved for it "
        "(default: num_full_blocks, batch_size full sequences, or the recorded size if larger)",
    )


def open_llm(artifact: str, overrides: dict[str, Any], args: argparse.Namespace) -> Any:
    """The ``LLM`` to serve and the elastic policy (None unless ``elastic``).

    Raises:
        ConfigError: ``--kvcache-min-blocks`` without elastic, or bounds that do not fit the
            artifact.
    """
    from kvroom.llm import LLM

    min_blocks, max_blocks = args.kvcache_min_blocks, args.kvcache_max_blocks
    if overrides.get("kvcache_num_blocks") != ELASTIC:
        if min_blocks is not None:
            raise ConfigError("--kvcache-min-blocks: only used with --kvcache-num-blocks elastic")
        return LLM(artifact, kvcache_max_blocks=max_blocks, **overrides), None
    from kvroom.artifact.layout import read_info

    plan = read_info(artifact).plan
    min_blocks = plan.num_min_blocks if min_blocks is None else min_blocks
    if max_blocks is None:
        max_blocks = max(plan.num_full_blocks, plan.num_blocks, min_blocks)
    if min_blocks < plan.num_min_blocks:
        raise ConfigError(
            f"--kvcache-min-blocks: {min_blocks} is below one max_seq_len={plan.max_seq_len} "
            f"sequence ({plan.num_min_blocks} blocks)"
        )
    start = min(max(_estimate(artifact, overrides), min_blocks), max_blocks)
    llm = LLM(
        artifact, kvcache_max_blocks=max_blocks, **(overrides | {"kvcache_num_blocks": start})
    )
    return llm, elastic_policy(llm.runtime.plan, min_blocks, max_blocks)


def _estimate(artifact: str, overrides: dict[str, Any]) -> int:
    from kvroom.artifact.resize import startup_plan
    from kvroom.models.layers import widens_bf16_weights

    knobs = ("device_memory", "kvcache_reserve_memory", "kvcache_memory_fraction")
    here = None if overrides.get("device") not in (None, "cpu") else widens_bf16_weights
    try:
        _, plan = startup_plan(
            artifact, "auto", widens_bf16=here, **{k: overrides.get(k) for k in knobs}
        )
    except MemoryNotEnoughError:
        return 0
    return plan.num_blocks


def elastic_policy(plan: Any, min_blocks: int, max_blocks: int) -> Any:
    from kvroom.engine.kv.elastic import DEFAULT_RESERVE_BYTES, ElasticPolicy

    return ElasticPolicy(
        min_num_blocks=min_blocks,
        max_num_blocks=max_blocks,
        bytes_per_block=plan.kv_bytes_per_block_per_rank,
        reserve_bytes=plan.kvcache_reserve_bytes or DEFAULT_RESERVE_BYTES,
    )
