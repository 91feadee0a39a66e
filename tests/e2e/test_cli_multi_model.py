"""``kvroom plan A B`` (the budget table of a set) and the flags of several models, in-process:
user errors are one line on stderr and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroom.cli import main


def test_plan_of_a_set_prints_the_table_and_whether_it_fits(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    art = str(tiny_artifact)
    assert main(["plan", art, art, "--memory-budget", "2MiB", "--priority", f"{art}=3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "2 models, memory budget (2.00 MiB, --memory-budget)"
    rows = {line.split()[0]: line.split() for line in lines[3:5]}
    assert set(rows) == {art, f"{art}#2"}
    # pool: 2 MiB - 2 x 988.19 KiB fixed = 73344 B; floors 16 + 16 blocks of 1 KiB, the
    # 40576 B left split 3:1 -> 29 + 9 blocks, then the 1664 B left over -> 1 more to the first
    assert (rows[art][-4], rows[f"{art}#2"][-4]) == ("46", "25")
    assert lines[-1] == "the set fits"


def test_plan_of_a_set_that_does_not_fit_names_what_to_change(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    art = str(tiny_artifact)
    assert main(["plan", art, art, "--device-memory", "1MiB"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("Memory is not enough: the models need 1.96 MiB")
    assert "raise --memory-budget/--device-memory to at least 1.96 MiB" in last


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--persist"], "--persist: sizes one model's pool; with several artifacts the arbiter"),
        (["--min-blocks", "zz=20"], "--min-blocks: 'zz=20' is not NAME=VALUE for a served model"),
        (["--priority", "a=high"], "--priority: 'a=high': 'high' is not a number"),
        (["--served-model-name", "a"], "--served-model-name: 1 name(s) for 2 artifacts"),
    ],
)
def test_serving_several_refuses_bad_flags_in_one_line(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    art = str(tiny_artifact)
    names = [] if "--served-model-name" in extra else ["--served-model-name", "a"] * 1
    names += [] if names == [] else ["--served-model-name", "b"]
    assert main(["serve", art, art, "--port", "0", *names, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvroom: error: {message}")


def test_one_model_refuses_the_shared_budget_flags(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(tiny_artifact), "--memory-budget", "1GiB"]) == 2
    assert capsys.readouterr().err == (
        "kvroom: error: --memory-budget: only used with several models\n"
    )
