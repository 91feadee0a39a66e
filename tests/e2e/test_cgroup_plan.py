"""Inside a real memory cgroup, ``kvroom plan`` plans for that cgroup's limit, not the host's
RAM, and an ``auto`` pool sized at start-up there can be filled without the process being
OOM-killed.

Each test makes a child of its own memory cgroup (v1 or v2, whichever holds the memory
controller) with a 2 GiB limit, starts kvroom in it and removes it after. They need root and
a writable memory controller; elsewhere they skip and say why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvroom.cgroup import CgroupDir, own_cgroup
from kvroom.units import parse_bytes

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

LIMIT_BYTES = 2 * 2**30


@dataclass(frozen=True)
class ChildCgroup:
    version: int
    path: str
    """As ``/proc/self/cgroup`` names it, and so as the plan should."""
    directory: Path


@pytest.fixture
def child_cgroup() -> Iterator[ChildCgroup]:
    version, own = _own_memory_cgroup()
    name = f"kvroom-test-{os.getpid()}"
    directory = own.directory / name
    try:
        directory.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {own.directory}: {exc}")
    try:
        limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
        try:
            (directory / limit_file).write_text(f"{LIMIT_BYTES}\n")
        except OSError as exc:
            pytest.skip(f"cannot set {directory / limit_file}: {exc}")
        yield ChildCgroup(version, f"{own.path.rstrip('/')}/{name}", directory)
    finally:
        directory.rmdir()


def _own_memory_cgroup() -> tuple[int, CgroupDir]:
    v1 = own_cgroup(Path("/"), version=1)
    if v1 is not None:
        return 1, v1
    v2 = own_cgroup(Path("/"), version=2)
    if v2 is None:
        pytest.skip("no cgroup v1 memory or cgroup v2 hierarchy is mounted here")
    subtree = v2.directory / "cgroup.subtree_control"
    try:
        if "memory" not in subtree.read_text().split():
            subtree.write_text("+memory\n")
    except OSError as exc:
        pytest.skip(f"cannot enable the v2 memory controller in {subtree}: {exc}")
    return 2, v2


def test_plan_inside_a_2gib_cgroup_plans_for_2gib(child_cgroup: ChildCgroup) -> None:
    pytest.importorskip("gguf")
    join_then_plan = 'echo $$ > "$0" && exec "$@"'
    done = subprocess.run(
        ["sh", "-c", join_then_plan, str(child_cgroup.directory / "cgroup.procs")]
        + [sys.executable, "-m", "kvroom", "plan", "smollm2-135m"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = _rows(done.stdout)
    label = f"device memory (cgroup-v{child_cgroup.version} {child_cgroup.path}, limit 2.00 GiB)"
    assert label in rows, done.stdout
    assert 0 < parse_bytes(rows[label].replace(" ", "")) <= LIMIT_BYTES
    pool = rows["KV pool"].split(", ")[1]  # "N tokens, X GiB"
    assert parse_bytes(pool.replace(" ", "")) < LIMIT_BYTES


FILL_SCRIPT = """
import sys
from kvroom import LLM, SamplingParams

llm = LLM(sys.argv[1], kvcache_num_blocks="auto")
pool = llm.runtime.pool
for layer in pool.layers:  # every page of the pool resident, as a full pool holds it
    layer.fill_(1.0)
greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
llm.generate(["Tell me about the sea."] * 8, greedy)
print(pool.num_blocks, pool.nbytes())
"""


def test_a_filled_auto_pool_is_not_oom_killed_in_a_2gib_cgroup(
    child_cgroup: ChildCgroup, smol_artifact: Path
) -> None:
    join_then_run = 'echo $$ > "$0" && exec "$@"'
    done = subprocess.run(
        ["sh", "-c", join_then_run, str(child_cgroup.directory / "cgroup.procs")]
        + [sys.executable, "-c", FILL_SCRIPT, str(smol_artifact)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    blocks, pool_bytes = map(int, done.stdout.split())
    assert pool_bytes > LIMIT_BYTES // 4, done.stdout  # auto took the room there was
    assert _oom_kills(child_cgroup) == 0


def _oom_kills(child: ChildCgroup) -> int:
    """OOM kills in the cgroup (v1 ``memory.oom_control``, v2 ``memory.events``)."""
    name = "memory.oom_control" if child.version == 1 else "memory.events"
    for line in (child.directory / name).read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    pytest.skip(f"{name} does not count OOM kills on this kernel")


def _rows(table: str) -> dict[str, str]:
    """``label   value`` lines of the plan table."""
    rows = {}
    for line in table.splitlines():
        match = re.match(r"^(.*?\S)\s{2,}(\S.*)$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows
