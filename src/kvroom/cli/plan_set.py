"""``kvroom plan A B C``: the budget table of several models sharing one memory budget.

Each model is an artifact (its recorded plan) or a source (planned by the formula). The budget
is read as ``kvroom serve A B C`` reads it (``--memory-budget``, else ``--device-memory`` less
``--kvcache-reserve-memory``, else this machine's memory less the reserve), so the table says
whether that serve command would start.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvroom.cli.multi_serve import budget_source, per_model
from kvroom.cli.options import config_overrides
from kvroom.plan.budget import ModelCost, SharedBudget, budget_table


def cmd_plan_set(args: argparse.Namespace) -> int:
    """Print the table (or ``--json``); exit 0 whether or not the set fits (a plan is a
    report; ``serve`` refuses a set that does not)."""
    names = _unique(args.model)
    floors = per_model(args.min_blocks, "--min-blocks", names, int)
    priorities = per_model(args.priority, "--priority", names, float)
    source = budget_source(args)
    costs = tuple(
        ModelCost.of(
            name,
            _plan_of(model, args),
            min_blocks=floors.get(name),
            priority=priorities.get(name, 1.0),
        )
        for name, model in zip(names, args.model, strict=True)
    )
    budget = SharedBudget(source.budget_bytes(0), costs)
    if args.json:
        print(json.dumps(_as_dict(budget), indent=2))
        return 0
    print(f"{len(names)} models, memory budget ({source.describe()})")
    print(budget_table(budget))
    return 0


def _unique(models: list[str]) -> list[str]:
    """The models as named in the table: a model given twice is ``NAME`` then ``NAME#2``."""
    names: list[str] = []
    for model in models:
        name, k = model, 1
        while name in names:
            k += 1
            name = f"{model}#{k}"
        names.append(name)
    return names


def _plan_of(model: str, args: argparse.Namespace) -> Any:
    from kvroom.artifact.layout import config_path

    if config_path(model).is_file():
        from kvroom.artifact.resize import startup_plan
        from kvroom.models.layers import widens_bf16_weights

        return startup_plan(model, widens_bf16=widens_bf16_weights)[1]
    from kvroom.compile import plan_model

    return plan_model(model, config_overrides(args), apply_policy=False).plan


def _as_dict(budget: SharedBudget) -> dict[str, Any]:
    blocks = budget.split() if budget.fits else {}
    return {
        "budget_bytes": budget.budget_bytes,
        "shared_bytes": budget.shared_bytes,
        "pool_bytes": budget.pool_bytes,
        "floor_bytes": budget.floor_bytes,
        "fits": budget.fits,
        "message": None if budget.fits else budget.shortfall_message(),
        "models": [
            {
                "name": m.name,
                "weight_bytes": m.weight_bytes,
                "runtime_bytes": m.runtime_bytes,
                "bytes_per_block": m.bytes_per_block,
                "min_blocks": m.min_blocks,
                "max_blocks": m.max_blocks,
                "priority": m.priority,
                "num_blocks": blocks.get(m.name),
            }
            for m in budget.models
        ],
    }
