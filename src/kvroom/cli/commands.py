"""The sub-commands, each a thin function over the Python API."""

from __future__ import annotations

import argparse
import json
import sys

from kvroom.cli.multi_serve import add_multi_flags, refuse_multi_flags
from kvroom.cli.options import add_config_flags, add_dequantize_flag, config_overrides
from kvroom.plan.report import plan_table, terms_table


def build_parser(parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="kvroom",
        description="Prepare decoder-only LLMs with a paged KV cache fitted to the memory at hand.",
        epilog="Upstream spellings of get and set: kvroom --get-kvcache-num-blocks OUT, "
        "kvroom --set-kvcache-num-blocks N OUT.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=parser_class)

    p = sub.add_parser("plan", help="print the memory plan of a model or artifact, writing nothing")
    p.add_argument(
        "model",
        nargs="+",
        help="HF folder, .gguf file, built-in name (smollm2-135m), or an artifact folder "
        "(its measured terms and the formula, side by side); several: the budget table of "
        "the set under one memory budget (as `kvroom serve A B C` would share it)",
    )
    add_config_flags(p)
    add_dequantize_flag(p)
    add_multi_flags(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("compile", help="build an artifact folder from a model")
    p.add_argument("model", help="HF folder, .gguf file, or built-in name (smollm2-135m)")
    p.add_argument("-o", "--output", required=True, help="artifact folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    add_config_flags(p)
    add_dequantize_flag(p)
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("get", help="print an artifact's kvcache_num_blocks")
    p.add_argument("artifact")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("set", help="resize an artifact's KV pool in place (N or auto)")
    p.add_argument("artifact")
    p.add_argument("num_blocks", help="number of blocks, or 'auto' to re-estimate for here")
    p.add_argument("--device-memory", default=None, help="plan 'auto' for this much memory")
    p.set_defaults(func=cmd_set)

    from kvroom.cli.runtime_commands import add_runtime_commands

    add_runtime_commands(sub)
    from kvroom.cli.resize_command import add_resize_command

    add_resize_command(sub)
    return parser


def cmd_plan(args: argparse.Namespace) -> int:
    from kvroom.artifact.layout import config_path

    if len(args.model) > 1:
        from kvroom.cli.plan_set import cmd_plan_set

        return cmd_plan_set(args)
    refuse_multi_flags(args)
    args.model = args.model[0]

    if config_path(args.model).is_file():
        return _plan_artifact(args)
    from kvroom.compile import plan_model

    planned = plan_model(args.model, config_overrides(args))
    plan = planned.plan
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    print(
        f"model: {args.model} ({planned.spec.architecture}, "
        f"{planned.source.num_parameters:,} parameters)"
    )
    print(plan_table(plan))
    print(
        f"{plan.num_blocks} blocks x {plan.kvcache_block_size} tokens = {plan.num_tokens} tokens"
        f" = {plan.max_concurrency} full-length sequences"
    )
    return 0


def _plan_artifact(args: argparse.Namespace) -> int:
    """An artifact's recorded plan (re-fitted when a memory flag is given), with the
    measured terms and the formula side by side."""
    from kvroom.artifact.layout import read_info
    from kvroom.artifact.resize import replan

    info = read_info(args.model)
    knobs = config_overrides(args)
    memory = {k: knobs.get(k) for k in ("device_memory", "kvcache_reserve_memory")}
    memory["kvcache_memory_fraction"] = knobs.get("kvcache_memory_fraction")
    plan = replan(info, knobs.get("kvcache_num_blocks"), source="override", **memory)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    print(f"artifact: {args.model} ({info.model.get('architecture')})")
    print(plan_table(plan))
    print()
    print(terms_table(plan))
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from kvroom.compile import compile

    info = compile(args.model, args.output, config_overrides(args), overwrite=args.overwrite)
    print(f"wrote {args.output}: {info.plan.summary_line()}")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    from kvroom.artifact.layout import read_info

    info = read_info(args.artifact)
    if args.json:
        print(json.dumps(info.plan.to_dict(), indent=2))
    else:
        print(info.num_blocks)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    from kvroom.artifact.resize import set_kvcache_num_blocks

    plan = set_kvcache_num_blocks(args.artifact, args.num_blocks, device_memory=args.device_memory)
    print(plan.num_blocks)
    sys.stderr.write(f"kvroom: {args.artifact}: {plan.summary_line()}\n")
    return 0
