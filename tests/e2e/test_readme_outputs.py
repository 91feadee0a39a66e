"""The README's output blocks are what the commands they show print today
(``scripts/readme_outputs.py``: numbers masked, the plan block exactly)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "readme_outputs.py"


def load_script():
    spec = importlib.util.spec_from_file_location("readme_outputs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.real_model
def test_readme_blocks_match_the_commands(smol_artifact: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--artifact", str(smol_artifact)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_numbers_may_differ_words_may_not(capsys) -> None:
    script = load_script()
    readme = "$ kvroom get A\n4096\n$ kvroom set A 64\nkvroom: error: set: 64 blocks is below\n"
    same = "$ kvroom get A\n256\n$ kvroom set A 64\nkvroom: error: set: 64 blocks is below\n"
    other = "$ kvroom get A\n256\n$ kvroom set A 64\nkvroom: error: Memory is not enough\n"
    assert script.check({"get-set": readme}, {"get-set": same}) == 0
    assert script.check({"get-set": readme}, {"get-set": other}) == 1
    assert "+kvroom: error: Memory is not enough" in capsys.readouterr().out


def test_the_plan_block_is_compared_exactly() -> None:
    script = load_script()
    assert script.check({"plan": "weights 513.13 MiB\n"}, {"plan": "weights 513.13 MiB\n"}) == 0
    assert script.check({"plan": "weights 513.13 MiB\n"}, {"plan": "weights 600.00 MiB\n"}) == 1


def test_generated_text_is_not_compared() -> None:
    script = load_script()
    readme = "$ kvroom run A --prompt q\nkvroom: KV cache: 4096 blocks\nParis.\n"
    now = f"$ kvroom run A --prompt q\nkvroom: KV cache: 3378 blocks\n{script.GENERATED}Lyon.\n"
    assert script.check({"run": readme}, {"run": now}) == 0
