"""Several models under one budget: fixed terms paid once or per model, floors, the split by
priority, and the shortfall message that names what to change."""

from __future__ import annotations

import pytest

from kvroom.errors import ConfigError
from kvroom.plan.budget import ModelCost, SharedBudget, budget_table

KiB = 1024


def cost(name: str, **kw: object) -> ModelCost:
    base = dict(
        name=name,
        weight_bytes=100 * KiB,
        runtime_bytes=20 * KiB,
        bytes_per_block=KiB,
        min_blocks=16,
        max_blocks=64,
        shared_bytes=50 * KiB,
    )
    return ModelCost(**(base | kw))  # type: ignore[arg-type]


def test_the_process_is_paid_once_and_the_rest_is_the_shared_pool() -> None:
    budget = SharedBudget(400 * KiB, (cost("a"), cost("b")))
    assert budget.fixed_bytes == 50 * KiB + 2 * 120 * KiB
    assert budget.pool_bytes == 110 * KiB
    assert budget.floor_bytes == 32 * KiB
    assert budget.fits


def test_the_split_gives_floors_then_the_rest_by_priority_capped_at_max_blocks() -> None:
    budget = SharedBudget(400 * KiB, (cost("a", priority=2.0), cost("b")))
    blocks = budget.split()
    assert blocks["a"] == 64  # capped: 52 more would pass its 64
    assert blocks["b"] == 46  # the cap's leftover goes to b
    assert sum(blocks.values()) * KiB <= budget.pool_bytes


def test_a_set_that_does_not_fit_names_the_largest_model_and_the_budget_needed() -> None:
    budget = SharedBudget(300 * KiB, (cost("big", weight_bytes=150 * KiB), cost("small")))
    assert not budget.fits
    assert budget.shortfall_message() == (
        "Memory is not enough: the models need 372.00 KiB (fixed terms and one max_seq_len "
        "sequence each), the budget is 300.00 KiB, 72.00 KiB short. Largest first: big "
        "(170.00 KiB fixed + 16 blocks 16.00 KiB), small (120.00 KiB fixed + 16 blocks "
        "16.00 KiB). To fit: raise --memory-budget/--device-memory to at least 372.00 KiB, "
        "drop big, or compile it with a smaller max_seq_len (a lower floor) or a quantized "
        "dtype (smaller weights)"
    )
    assert budget_table(budget).endswith(budget.shortfall_message())


def test_the_table_shows_each_model_and_the_verdict() -> None:
    table = budget_table(SharedBudget(400 * KiB, (cost("a"), cost("b"))))
    assert "= shared KV pool" in table and table.endswith("the set fits")
    assert [line.split()[0] for line in table.splitlines()[2:4]] == ["a", "b"]


def test_a_bad_priority_is_refused_naming_the_model() -> None:
    with pytest.raises(ConfigError, match=r"^b: priority must be > 0, got 0$"):
        cost("b", priority=0.0)
