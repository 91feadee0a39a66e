"""Fake ``/proc/self`` and ``/sys/fs/cgroup`` trees under a temporary root, for the cgroup probe.

A tree is written the way the kernel shows it: ``/proc/self/cgroup`` lines, ``mountinfo`` lines
(with the optional fields and the non-cgroup mounts around them), and the cgroup files.
"""

from __future__ import annotations

from pathlib import Path

GiB = 2**30
MiB = 2**20
V1_UNLIMITED = 9_223_372_036_854_771_712
"""What cgroup v1 reports with no limit: 2**63 - 4096."""

V1_MEMORY = ("/", "/sys/fs/cgroup/memory", "cgroup", "rw,memory")
V1_CPU = ("/", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct")
V2 = ("/", "/sys/fs/cgroup", "cgroup2", "rw,nsdelegate")
V2_UNIFIED = ("/", "/sys/fs/cgroup/unified", "cgroup2", "rw")
"""Mounts as ``(root, mount point, fstype, super options)``."""


def write_proc(root: Path, cgroup_lines: list[str], mounts: list[tuple[str, str, str, str]]):
    """``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (a proc and a tmpfs mount first)."""
    proc = root / "proc" / "self"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "cgroup").write_text("".join(f"{line}\n" for line in cgroup_lines))
    lines = [
        "22 28 0:20 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw",
        "31 23 0:28 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755",
    ]
    for number, (mount_root, mount_point, fstype, options) in enumerate(mounts, start=40):
        lines.append(
            f"{number} 31 0:{number} {_escape(mount_root)} {_escape(mount_point)} "
            f"rw,nosuid,relatime shared:{number} - {fstype} {fstype} {options}"
        )
    (proc / "mountinfo").write_text("".join(f"{line}\n" for line in lines))


def write_cgroup(root: Path, directory: str, files: dict[str, str]) -> Path:
    """Files of one cgroup directory (``/sys/fs/cgroup/memory/a``), created with its parents."""
    folder = root / directory.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def v1_files(limit: int | None, usage: int, *, inactive_file: int = 0) -> dict[str, str]:
    """A v1 memory cgroup: ``None`` is no limit (v1's huge value)."""
    return {
        "memory.limit_in_bytes": f"{V1_UNLIMITED if limit is None else limit}\n",
        "memory.usage_in_bytes": f"{usage}\n",
        "memory.stat": f"cache 0\nrss {usage}\ntotal_inactive_file {inactive_file}\n",
    }


def v2_files(limit: int | None, current: int, *, inactive_file: int = 0) -> dict[str, str]:
    """A v2 cgroup with the memory controller: ``None`` is ``max``."""
    return {
        "memory.max": "max\n" if limit is None else f"{limit}\n",
        "memory.current": f"{current}\n",
        "memory.stat": f"anon {current}\nfile 0\ninactive_file {inactive_file}\n",
    }


def _escape(path: str) -> str:
    return path.replace("\\", "\\134").replace(" ", "\\040")
