"""``kvroom serve A B C``: several artifacts in one server, one memory budget.

Each artifact is served under its name (``--served-model-name`` once per artifact, in order;
default its path as given). The budget is ``--memory-budget``, else ``--device-memory`` less
``--kvcache-reserve-memory`` (0 unless given), else the memory this process may use (its
cgroup's headroom or the machine's available memory), followed live, less the reserve (1 GiB
unless given).
Per-model settings name the model: ``--min-blocks chat=64``, ``--priority chat=2``.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvroom.errors import ConfigError

REFUSED_WITH_SEVERAL = {
    "kvcache_num_blocks": "--kvcache-num-blocks",
    "kvcache_memory_fraction": "--kvcache-memory-fraction",
    "kvcache_min_blocks": "--kvcache-min-blocks",
    "kvcache_max_blocks": "--kvcache-max-blocks",
    "persist": "--persist",
}
"""Single-model pool flags: with several models the arbiter sizes the pools."""
MULTI_ONLY = {"memory_budget": "--memory-budget", "min_blocks": "--min-blocks"}
MULTI_ONLY |= {"priority": "--priority"}


def add_multi_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="several artifacts: the memory all models share (weights, runtime, KV pools), "
        "e.g. 8GiB (default: --device-memory less --kvcache-reserve-memory, else what this "
        "process's cgroup or the machine allows, followed live, less the reserve, 1 GiB "
        "unless given)",
    )
    parser.add_argument(
        "--min-blocks",
        action="append",
        default=[],
        metavar="NAME=N",
        help="several artifacts: model NAME's pool never shrinks below N blocks (default one "
        "max_seq_len sequence); repeat per model",
    )
    parser.add_argument(
        "--priority",
        action="append",
        default=[],
        metavar="NAME=P",
        help="several artifacts: weight of model NAME (default 1): a larger share of the pool, "
        "shrunk and evicted after the lower ones; repeat per model",
    )


def single_artifact(args: argparse.Namespace) -> None:
    """One artifact: the flags as ``kvroom serve ART`` has always read them."""
    names = args.served_model_name or []
    if len(names) > 1:
        raise ConfigError(f"--served-model-name: given {len(names)} times for one artifact")
    refuse_multi_flags(args)
    args.artifact = args.artifact[0]
    args.served_model_name = names[0] if names else None


def refuse_multi_flags(args: argparse.Namespace) -> None:
    """One model: the flags of a shared budget are a mistake, said in one line."""
    for dest, flag in MULTI_ONLY.items():
        if getattr(args, dest) not in (None, []):
            raise ConfigError(f"{flag}: only used with several models")


def open_models(args: argparse.Namespace) -> Any:
    """The models of ``args`` under their budget, loaded (``MultiModels``).

    Raises:
        ConfigError: a single-model flag, names that do not match the artifacts, a served
            name twice, per-model settings for a model not served.
        MemoryNotEnoughError: the floors do not fit the budget.
    """
    from kvroom.server.multi.app import build_models

    _refuse_single_model_flags(args)
    entries = model_entries(args)
    options = {"device": args.device, "enable_prefix_caching": args.enable_prefix_caching}
    options = {k: v for k, v in options.items() if v is not None}
    options["allowed_local_media_path"] = args.allowed_local_media_path
    options["tool_options"] = _tool_options(args)
    models = build_models(entries, budget_source(args), load_options=options)
    models.load_all()
    return models


def model_entries(args: argparse.Namespace) -> list[Any]:
    from kvroom.server.multi.slot import ModelEntry

    artifacts: list[str] = args.artifact
    names = args.served_model_name or []
    if names and len(names) != len(artifacts):
        raise ConfigError(
            f"--served-model-name: {len(names)} name(s) for {len(artifacts)} artifacts; "
            "give one per artifact, in the order of the artifacts"
        )
    names = names or artifacts
    floors = per_model(args.min_blocks, "--min-blocks", names, int)
    priorities = per_model(args.priority, "--priority", names, float)
    return [
        ModelEntry(art, name, floors.get(name), priorities.get(name, 1.0))
        for art, name in zip(artifacts, names, strict=True)
    ]


def budget_source(args: argparse.Namespace) -> Any:
    from kvroom.engine.kv.elastic import DEFAULT_RESERVE_BYTES
    from kvroom.server.multi.budget_source import FixedBudget, MemoryBudget
    from kvroom.units import parse_bytes

    """``--memory-budget``; else ``--device-memory`` less the reserve (0 unless given); else
    this process's memory followed live, less the reserve (1 GiB unless given)."""
    reserve = args.kvcache_reserve_memory
    given = None if reserve is None else parse_bytes(reserve, "--kvcache-reserve-memory")
    if args.memory_budget is not None:
        return FixedBudget(parse_bytes(args.memory_budget, "--memory-budget"))
    if args.device_memory is not None:
        memory = parse_bytes(args.device_memory, "--device-memory")
        return FixedBudget(memory - (given or 0), "--device-memory less the reserve")
    return MemoryBudget(DEFAULT_RESERVE_BYTES if given is None else given)


def per_model(
    given: list[str], flag: str, names: list[str], kind: type[int] | type[float]
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in given:
        name, sep, text = item.rpartition("=")
        if not sep or name not in names:
            served = ", ".join(names)
            raise ConfigError(f"{flag}: {item!r} is not NAME=VALUE for a served model ({served})")
        try:
            values[name] = kind(text)
        except ValueError:
            raise ConfigError(f"{flag}: {item!r}: {text!r} is not a number") from None
    return values


def _refuse_single_model_flags(args: argparse.Namespace) -> None:
    if args.engine != "kvroom":
        raise ConfigError("--engine vllm: serves one artifact; give one")
    for dest, flag in REFUSED_WITH_SEVERAL.items():
        if getattr(args, dest, None) not in (None, False):
            raise ConfigError(
                f"{flag}: sizes one model's pool; with several artifacts the arbiter sizes "
                "them (use --memory-budget, --min-blocks NAME=N, --priority NAME=P)"
            )


def _tool_options(args: argparse.Namespace) -> Any:
    from kvroom.cli.options import tool_options

    return tool_options(args)
