"""The process's own cgroup and its tightest memory limit, over fake trees (``cgroup_trees``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgroup_trees import (
    V1_CPU,
    V1_MEMORY,
    V2,
    V2_UNIFIED,
    GiB,
    MiB,
    v1_files,
    v2_files,
    write_cgroup,
    write_proc,
)
from kvroom.cgroup import CgroupLimit, memory_limit, memory_pressure, own_cgroup

V1_ROOT = "/sys/fs/cgroup/memory"
HOST_V1 = ["4:memory:/a/b", "3:cpu,cpuacct:/", "1:name=systemd:/a/b", "0::/a/b"]


# -- v1 ------------------------------------------------------------------------------------------
def test_v1_nested_parent_binds_first(tmp_path: Path) -> None:
    write_proc(tmp_path, HOST_V1, [V1_CPU, V1_MEMORY])
    write_cgroup(tmp_path, V1_ROOT, v1_files(None, 9 * GiB))
    write_cgroup(tmp_path, f"{V1_ROOT}/a", v1_files(GiB, 600 * MiB, inactive_file=100 * MiB))
    write_cgroup(tmp_path, f"{V1_ROOT}/a/b", v1_files(2 * GiB, 300 * MiB))
    limit = memory_limit(tmp_path)
    # /a: 1 GiB - (600 - 100) MiB = 524 MiB, below /a/b's 2 GiB - 300 MiB
    assert limit == CgroupLimit(1, "/a", GiB, 500 * MiB)
    assert limit.headroom_bytes == 524 * MiB
    assert limit.source == "cgroup-v1 /a, limit 1.00 GiB"


def test_v1_smallest_headroom_not_smallest_limit(tmp_path: Path) -> None:
    write_proc(tmp_path, HOST_V1, [V1_MEMORY])
    write_cgroup(tmp_path, f"{V1_ROOT}/a", v1_files(4 * GiB, 3584 * MiB))  # busy siblings
    write_cgroup(tmp_path, f"{V1_ROOT}/a/b", v1_files(2 * GiB, 512 * MiB))
    assert memory_limit(tmp_path) == CgroupLimit(1, "/a", 4 * GiB, 3584 * MiB)


def test_v1_leaf_limit_and_inactive_file_pages_are_not_usage(tmp_path: Path) -> None:
    write_proc(tmp_path, HOST_V1, [V1_MEMORY])
    write_cgroup(tmp_path, f"{V1_ROOT}/a/b", v1_files(2 * GiB, GiB, inactive_file=768 * MiB))
    limit = memory_limit(tmp_path)
    assert limit == CgroupLimit(1, "/a/b", 2 * GiB, 256 * MiB)
    assert limit.headroom_bytes == 2 * GiB - 256 * MiB


def test_v1_unlimited_everywhere_is_no_limit(tmp_path: Path) -> None:
    write_proc(tmp_path, HOST_V1, [V1_MEMORY])
    write_cgroup(tmp_path, f"{V1_ROOT}/a", v1_files(None, GiB))
    write_cgroup(tmp_path, f"{V1_ROOT}/a/b", v1_files(None, GiB))
    assert memory_limit(tmp_path) is None


def test_v1_hierarchical_limit_above_the_mount_root(tmp_path: Path) -> None:
    """A container without a cgroup namespace sees its own cgroup at the mount point; the limit
    on /docker (above it) shows only in ``hierarchical_memory_limit``."""
    write_proc(tmp_path, ["4:memory:/docker/c1"], [("/docker/c1", V1_ROOT, "cgroup", "rw,memory")])
    files = v1_files(None, 512 * MiB, inactive_file=128 * MiB)
    files["memory.stat"] += f"hierarchical_memory_limit {3 * GiB}\n"
    write_cgroup(tmp_path, V1_ROOT, files)
    assert memory_limit(tmp_path) == CgroupLimit(1, "/docker/c1", 3 * GiB, 384 * MiB)


def test_v1_hierarchical_limit_already_seen_is_not_counted_twice(tmp_path: Path) -> None:
    write_proc(tmp_path, HOST_V1, [V1_MEMORY])
    write_cgroup(tmp_path, f"{V1_ROOT}/a", v1_files(GiB, 100 * MiB))
    files = v1_files(None, 100 * MiB)
    files["memory.stat"] += f"hierarchical_memory_limit {GiB}\n"
    write_cgroup(tmp_path, f"{V1_ROOT}/a/b", files)
    assert memory_limit(tmp_path) == CgroupLimit(1, "/a", GiB, 100 * MiB)


def test_v1_mount_root_is_stripped_from_the_path(tmp_path: Path) -> None:
    write_proc(tmp_path, ["4:memory:/docker/c1/job"], [("/docker/c1", V1_ROOT, "cgroup", "memory")])
    write_cgroup(tmp_path, f"{V1_ROOT}/job", v1_files(None, 0))
    write_cgroup(tmp_path, V1_ROOT, v1_files(2 * GiB, GiB))
    assert memory_limit(tmp_path) == CgroupLimit(1, "/docker/c1", 2 * GiB, GiB)
    own = own_cgroup(tmp_path, version=1)
    assert own is not None and own.directory == tmp_path / V1_ROOT.lstrip("/") / "job"


# -- v2 ------------------------------------------------------------------------------------------
def test_v2_max_leaf_with_a_limit_higher_up(tmp_path: Path) -> None:
    """Slurm: the limit sits on job_7/step_0, the task's own cgroup says ``max``."""
    write_proc(tmp_path, ["0::/slurm/job_7/step_0/task_0"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup/slurm", v2_files(None, 5 * GiB))
    write_cgroup(tmp_path, "/sys/fs/cgroup/slurm/job_7", v2_files(None, GiB))
    step = v2_files(2 * GiB, 512 * MiB, inactive_file=256 * MiB)
    write_cgroup(tmp_path, "/sys/fs/cgroup/slurm/job_7/step_0", step)
    write_cgroup(tmp_path, "/sys/fs/cgroup/slurm/job_7/step_0/task_0", v2_files(None, 400 * MiB))
    limit = memory_limit(tmp_path)
    assert limit == CgroupLimit(2, "/slurm/job_7/step_0", 2 * GiB, 256 * MiB)
    assert limit.source == "cgroup-v2 /slurm/job_7/step_0, limit 2.00 GiB"


def test_v2_nested_takes_the_smallest_headroom(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/user.slice/app.service"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup/user.slice", v2_files(8 * GiB, 7 * GiB))
    write_cgroup(tmp_path, "/sys/fs/cgroup/user.slice/app.service", v2_files(4 * GiB, GiB))
    assert memory_limit(tmp_path) == CgroupLimit(2, "/user.slice", 8 * GiB, 7 * GiB)


def test_v2_usage_above_the_limit_is_no_headroom(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/a"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup/a", v2_files(1000, 1500))
    limit = memory_limit(tmp_path)
    assert limit is not None and limit.headroom_bytes == 0


def test_v2_walk_stops_at_the_mount_point(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/a"], [V2])
    write_cgroup(tmp_path, "/sys/fs", {"memory.max": f"{GiB}\n"})  # not a cgroup: never read
    write_cgroup(tmp_path, "/sys/fs/cgroup/a", v2_files(None, 0))
    assert memory_limit(tmp_path) is None


def test_path_outside_the_namespace_root_uses_the_mount_point(tmp_path: Path) -> None:
    """``/../sibling``: the process left its namespace's root; only that root is visible."""
    write_proc(tmp_path, ["0::/../sibling/x"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup", v2_files(3 * GiB, GiB))
    write_cgroup(tmp_path, "/sys/fs/sibling/x", v2_files(GiB // 2, 0))  # outside the mount
    assert memory_limit(tmp_path) == CgroupLimit(2, "/", 3 * GiB, GiB)


def test_dot_dot_inside_the_path_is_resolved(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/a/../b"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup/b", v2_files(GiB, 0))
    assert memory_limit(tmp_path) == CgroupLimit(2, "/b", GiB, 0)


def test_mount_point_with_a_space(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/a"], [("/", "/cg roups", "cgroup2", "rw")])
    write_cgroup(tmp_path, "/cg roups/a", v2_files(GiB, 0))
    assert memory_limit(tmp_path) == CgroupLimit(2, "/a", GiB, 0)


# -- hybrid, none, unreadable --------------------------------------------------------------------
def test_hybrid_takes_v1_memory_and_v2_pressure(tmp_path: Path) -> None:
    write_proc(tmp_path, HOST_V1, [V1_CPU, V1_MEMORY, V2_UNIFIED])
    write_cgroup(tmp_path, f"{V1_ROOT}/a/b", v1_files(2 * GiB, GiB))
    unified = {"memory.pressure": "some avg10=7.25 avg60=1.00 avg300=0.10 total=9\n"}
    write_cgroup(tmp_path, "/sys/fs/cgroup/unified/a/b", unified)  # no memory controller here
    write_cgroup(tmp_path, "/proc/pressure", {"memory": "some avg10=99.00\n"})
    assert memory_limit(tmp_path) == CgroupLimit(1, "/a/b", 2 * GiB, GiB)
    assert memory_pressure(tmp_path) == 7.25


def test_no_cgroup_at_all(tmp_path: Path) -> None:
    assert memory_limit(tmp_path) is None
    assert own_cgroup(tmp_path, version=1) is None and own_cgroup(tmp_path, version=2) is None
    assert memory_pressure(tmp_path) is None


def test_cgroup_named_but_not_mounted(tmp_path: Path) -> None:
    write_proc(tmp_path, HOST_V1, [V1_CPU])
    write_cgroup(tmp_path, f"{V1_ROOT}/a/b", v1_files(GiB, 0))
    assert memory_limit(tmp_path) is None


@pytest.mark.parametrize("bad", ["oops\n", "-1\n", "", b"\xff\xfe"])
def test_unreadable_limit_is_no_limit_at_that_level(tmp_path: Path, bad: str | bytes) -> None:
    write_proc(tmp_path, ["0::/a/b"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup/a", v2_files(3 * GiB, GiB))
    leaf = write_cgroup(tmp_path, "/sys/fs/cgroup/a/b", v2_files(GiB, 0))
    (leaf / "memory.max").unlink()
    if isinstance(bad, bytes):
        (leaf / "memory.max").write_bytes(bad)
    else:
        (leaf / "memory.max").write_text(bad)
    assert memory_limit(tmp_path) == CgroupLimit(2, "/a", 3 * GiB, GiB)


def test_limit_file_that_cannot_be_read_is_no_limit(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/a"], [V2])
    leaf = write_cgroup(tmp_path, "/sys/fs/cgroup/a", {})
    (leaf / "memory.max").mkdir()  # reading it raises IsADirectoryError, even as root
    assert memory_limit(tmp_path) is None


def test_unreadable_usage_counts_as_zero(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/a"], [V2])
    leaf = write_cgroup(tmp_path, "/sys/fs/cgroup/a", {"memory.max": f"{GiB}\n"})
    (leaf / "memory.current").mkdir()
    (leaf / "memory.stat").write_text("inactive_file garbage\n")
    assert memory_limit(tmp_path) == CgroupLimit(2, "/a", GiB, 0)


def test_garbled_proc_files_are_no_cgroup(tmp_path: Path) -> None:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("nonsense\n4:memory\n0::relative\n")
    (tmp_path / "proc" / "self" / "mountinfo").write_text("half a line - cgroup2\n\n")
    assert memory_limit(tmp_path) is None


# -- pressure ------------------------------------------------------------------------------------
def test_pressure_of_the_own_v2_cgroup(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/a"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup", {"memory.pressure": "some avg10=50.00\n"})
    psi = "some avg10=12.50 avg60=3.00 avg300=1.00 total=99\nfull avg10=1.00 avg60=0 total=1\n"
    write_cgroup(tmp_path, "/sys/fs/cgroup/a", {"memory.pressure": psi})
    assert memory_pressure(tmp_path) == 12.5


def test_pressure_falls_back_to_the_machine(tmp_path: Path) -> None:
    write_proc(tmp_path, HOST_V1, [V1_MEMORY])  # v1 only: no cgroup PSI
    write_cgroup(tmp_path, "/proc/pressure", {"memory": "some avg10=3.50 avg60=0 total=1\n"})
    assert memory_pressure(tmp_path) == 3.5


def test_garbled_pressure_is_none(tmp_path: Path) -> None:
    write_cgroup(tmp_path, "/proc/pressure", {"memory": "full avg10=1.00\nsome avg10=x\n"})
    assert memory_pressure(tmp_path) is None
