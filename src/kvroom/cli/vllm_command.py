"""``kvroom vllm-args OUT`` and the ``kvroom serve OUT --engine vllm`` path (``serve_with_vllm``).

Both size the pool by the start-up override policy (``replan``, as ``run`` and ``serve`` do)
and never change the artifact.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from kvroom.cli.options import add_prefix_caching_flag, add_startup_flags, config_overrides
from kvroom.integrations.vllm import POOLS, VllmLaunch, cli_flags, prepare
from kvroom.integrations.vllm_serve import child_env, display, run_vllm_serve, serve_command


def add_vllm_args_command(sub: Any) -> None:
    p = sub.add_parser("vllm-args", help="print the vLLM arguments that reproduce an artifact")
    p.add_argument("artifact")
    p.add_argument(
        "--format",
        choices=("cli", "json"),
        default="cli",
        help="cli: `vllm serve` arguments on one line (default); json: vllm.LLM keyword arguments",
    )
    add_vllm_flags(p)
    add_startup_flags(p)
    add_prefix_caching_flag(p)
    p.set_defaults(func=cmd_vllm_args)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The vLLM-side knobs: its block size and the pool argument (see ``engine_args``)."""
    parser.add_argument(
        "--vllm-block-size",
        type=int,
        default=None,
        help="vLLM tokens per block (default: 128 on cpu, 16 on cuda)",
    )
    parser.add_argument(
        "--vllm-pool",
        choices=POOLS,
        default=None,
        help="pass the pool as num_gpu_blocks_override (blocks) or kv_cache_memory_bytes "
        "(bytes); default: bytes on cpu and for sliding-window models, blocks on cuda",
    )


def add_vllm_serve_flags(parser: argparse.ArgumentParser) -> None:
    """For ``kvroom serve``: ``--vllm-python`` and the vLLM-side knobs."""
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of the environment that has vLLM (default: `vllm` on PATH)",
    )
    add_vllm_flags(parser)


def launch_for(args: argparse.Namespace) -> VllmLaunch:
    """The ``VllmLaunch`` for the parsed command line (start-up overrides included).

    ``--[no-]enable-prefix-caching``, when given, is passed on as vLLM's own
    ``enable_prefix_caching``; without it vLLM keeps its default (on, as kvroom's).
    """
    overrides = config_overrides(args)
    device = overrides.pop("device", None)
    caching = getattr(args, "enable_prefix_caching", None)
    if caching is not None:
        overrides["enable_prefix_caching"] = caching
    return prepare(
        args.artifact,
        device=device,
        block_size=getattr(args, "vllm_block_size", None),
        pool=getattr(args, "vllm_pool", None),
        **overrides,
    )


def cmd_vllm_args(args: argparse.Namespace) -> int:
    launch = launch_for(args)
    if args.format == "json":
        print(json.dumps(launch.args, indent=2))
    else:
        print(shlex.join(cli_flags(launch.args)))
    _say(_pool_line(launch))
    return 0


def serve_with_vllm(args: argparse.Namespace, launch: VllmLaunch | None = None) -> int:
    """``kvroom serve OUT --engine vllm``: start ``vllm serve`` with the artifact's flags, stream
    its log, stop it when its KV line disagrees with the plan. Returns vLLM's exit code.

    Reads ``artifact``, ``host``, ``port``, ``served_model_name``, ``vllm_python``,
    ``vllm_block_size``, ``vllm_pool``, ``device``, ``enable_prefix_caching`` and the start-up
    flags from ``args``; the
    ones missing take their defaults. ``launch``, when given, is ``launch_for(args)`` already
    computed.
    """
    launch = launch or launch_for(args)
    command = serve_command(
        launch,
        python=getattr(args, "vllm_python", None),
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 8000),
        served_model_name=getattr(args, "served_model_name", None) or args.artifact,
    )
    _say(_pool_line(launch))
    _say(f"starting: {display(command)}")
    return run_vllm_serve(command, launch.pool, env=child_env(launch))


def _pool_line(launch: VllmLaunch) -> str:
    pool = launch.pool
    return (
        f"{launch.plan.summary_line()} -> vLLM ({launch.target}): {pool.num_blocks} blocks x "
        f"{pool.block_size} tokens = {pool.num_tokens} tokens"
    )


def _say(line: str) -> None:
    sys.stderr.write(f"kvroom: {line}\n")
    sys.stderr.flush()
