"""The plan is the truth: for the small matrix of ``benchmarks/plan_truth.py``, a fresh process
that fills every block never exceeds the plan's total, and the plan is at most 3% above it.

Marked ``plan_truth`` (``pytest -m plan_truth`` runs it alone); it is part of the default run.
Before any test runs, ``tests/conftest.py`` drops the libraries' page cache, as the benchmark
does by default.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plan_truth", ROOT / "benchmarks" / "plan_truth.py")
assert spec is not None and spec.loader is not None
plan_truth = importlib.util.module_from_spec(spec)
sys.modules["plan_truth"] = plan_truth
spec.loader.exec_module(plan_truth)

pytestmark = [pytest.mark.plan_truth, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plan-truth")


@pytest.mark.parametrize("case", plan_truth.SMALL, ids=lambda c: c.name)
def test_planned_total_is_within_0_and_3_percent_of_the_peak(case, work: Path) -> None:
    row = plan_truth.run_case(case, work)
    table = plan_truth.render([row])
    assert row["max_used_blocks"] in (-1, row["num_blocks"]), f"not every block filled\n{table}"
    assert row["planned_bytes"] >= row["measured_peak_bytes"], f"plan under the peak\n{table}"
    assert row["planned_bytes"] <= 1.03 * row["measured_peak_bytes"], f"plan >3% over\n{table}"
