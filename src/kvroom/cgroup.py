"""The memory limit of this process's own cgroup, in cgroup v1, v2 and hybrid hierarchies.

Where the process sits: ``/proc/self/cgroup`` names its cgroup in each hierarchy
(``4:memory:/a/b`` in v1, ``0::/a/b`` in v2), and ``/proc/self/mountinfo`` says where each
hierarchy is mounted and which of its cgroups the mount shows at its mount point (the mount's
root: ``/`` on a host or inside a cgroup namespace, ``/docker/<id>`` for a container without
one). The process's directory is mount point + (cgroup path - mount root). A path outside the
mount's root (``/../x``: the process was moved out of its namespace's root) cannot be seen;
the mount point, the nearest cgroup that can, stands in for it.

What it may take: every cgroup from the process's own up to the mount point may hold a limit
(systemd ``MemoryMax=`` on a slice, Slurm's on ``job_N/step_0`` under leaves that say ``max``).
Each limit minus that cgroup's usage is a headroom, and the smallest headroom is what the
process can still take: a parent shared with busy siblings can bind before a child's larger
limit does. v2 reads ``memory.max`` (``max`` = none); v1 reads ``memory.limit_in_bytes``
(2**63 - page size = none) and, from the process's own ``memory.stat``,
``hierarchical_memory_limit``, which also sees ancestors above the mount's root (their usage
is not visible; the topmost visible cgroup's stands in).

Usage is usage less inactive file pages (``memory.current - inactive_file`` in v2,
``memory.usage_in_bytes - total_inactive_file`` in v1): the kernel reclaims those before it
OOM-kills, and Docker, Kubernetes and .NET count usage the same way. Otherwise a model file
just read would make the headroom look small.

Every file is read under ``root`` (default ``/``), so tests build fake trees. A file that is
missing, unreadable or not a number counts as absent: no limit at that level, usage 0.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from kvroom.units import format_bytes

V1_UNLIMITED = 2**60
"""v1 says "no limit" with a huge page-aligned number (2**63 - 4096 on x86-64); any value at or
above this counts as none."""
PROC_CGROUP = "proc/self/cgroup"
PROC_MOUNTINFO = "proc/self/mountinfo"
PROC_PSI_MEMORY = "proc/pressure/memory"


@dataclass(frozen=True)
class CgroupLimit:
    """The limit that binds this process: where it sits, and that cgroup's usage now."""

    version: int
    """1 or 2."""
    path: str
    """The cgroup holding the limit, as ``/proc/self/cgroup`` writes paths (``/kvtest``)."""
    limit_bytes: int
    usage_bytes: int
    """Usage less inactive file pages."""

    @property
    def headroom_bytes(self) -> int:
        return max(self.limit_bytes - self.usage_bytes, 0)

    @property
    def source(self) -> str:
        """``cgroup-v1 /kvtest, limit 2.00 GiB``: what a plan names as its device memory."""
        return f"cgroup-v{self.version} {self.path}, limit {format_bytes(self.limit_bytes)}"


@dataclass(frozen=True)
class Mount:
    """One cgroup hierarchy mounted somewhere (a line of ``/proc/self/mountinfo``)."""

    root: str
    """The cgroup shown at the mount point."""
    mount_point: str
    fstype: str
    """``cgroup`` (v1) or ``cgroup2``."""
    options: frozenset[str]
    """Super options: a v1 mount's controllers are among them (``memory``)."""


@dataclass(frozen=True)
class CgroupDir:
    """A cgroup as a directory under ``root``, with the path ``/proc/self/cgroup`` gives it."""

    path: str
    directory: Path
    mount_dir: Path
    """The mount point of its hierarchy: the highest cgroup this process can see."""


def memory_limit(root: Path = Path("/")) -> CgroupLimit | None:
    """The limit with the smallest headroom on this process's cgroups, or None (no limit).

    Looks at the v1 memory hierarchy and the v2 one, whichever are mounted (hybrid hosts have
    both; the memory controller is in one of them).
    """
    limits = [*_v1_limits(root), *_v2_limits(root)]
    return min(limits, key=lambda limit: limit.headroom_bytes, default=None)


def memory_pressure(root: Path = Path("/")) -> float | None:
    """PSI ``some avg10`` of this process's v2 cgroup, else of the machine, else None.

    v2 keeps ``memory.pressure`` in every cgroup (in a hybrid host too, under the unified
    mount); v1 has none, so there the machine's ``/proc/pressure/memory`` is what there is.
    """
    own = own_cgroup(root, version=2)
    files = [own.directory / "memory.pressure"] if own is not None else []
    for path in [*files, root / PROC_PSI_MEMORY]:
        avg10 = _psi_some_avg10(_read_text(path))
        if avg10 is not None:
            return avg10
    return None


def _psi_some_avg10(text: str | None) -> float | None:
    """``avg10`` of the ``some`` line of a PSI file, or None."""
    for line in (text or "").splitlines():
        if not line.startswith("some "):
            continue
        values = dict(field.split("=", 1) for field in line.split()[1:] if "=" in field)
        try:
            return float(values["avg10"])
        except (KeyError, ValueError):
            return None
    return None


def own_cgroup(root: Path, *, version: int) -> CgroupDir | None:
    """This process's memory cgroup in the v1 hierarchy, or its v2 cgroup; None if not mounted."""
    path = _own_path(_read_text(root / PROC_CGROUP), version)
    if path is None:
        return None
    mount = _mount_for(_read_mounts(root), path, version)
    return None if mount is None else _resolve(root, mount, path)


def ancestry(own: CgroupDir) -> list[CgroupDir]:
    """``own``, its parent, ... up to the mount point: the cgroups that can limit it here."""
    levels = [own]
    while own.mount_dir in levels[-1].directory.parents:
        child = levels[-1]
        parent = CgroupDir(posixpath.dirname(child.path), child.directory.parent, own.mount_dir)
        levels.append(parent)
    return levels


def _v2_limits(root: Path) -> list[CgroupLimit]:
    own = own_cgroup(root, version=2)
    if own is None:
        return []
    limits = []
    for cgroup in ancestry(own):
        limit = _read_limit(cgroup.directory / "memory.max")
        if limit is not None:
            usage = _usage(cgroup.directory, "memory.current", "inactive_file")
            limits.append(CgroupLimit(2, cgroup.path, limit, usage))
    return limits


def _v1_limits(root: Path) -> list[CgroupLimit]:
    own = own_cgroup(root, version=1)
    if own is None:
        return []
    levels = ancestry(own)
    limits = []
    for cgroup in levels:
        limit = _read_limit(cgroup.directory / "memory.limit_in_bytes")
        if limit is not None:
            usage = _usage(cgroup.directory, "memory.usage_in_bytes", "total_inactive_file")
            limits.append(CgroupLimit(1, cgroup.path, limit, usage))
    # Below every visible limit: it sits on an ancestor above the mount's root.
    hierarchical = _limit_or_none(_read_stat(own.directory).get("hierarchical_memory_limit"))
    if hierarchical is not None and hierarchical < min(
        (limit.limit_bytes for limit in limits), default=V1_UNLIMITED
    ):
        top = levels[-1]
        usage = _usage(top.directory, "memory.usage_in_bytes", "total_inactive_file")
        limits.append(CgroupLimit(1, top.path, hierarchical, usage))
    return limits


def _usage(directory: Path, usage_file: str, inactive_key: str) -> int:
    usage = _read_int(directory / usage_file) or 0
    inactive = _read_stat(directory).get(inactive_key, 0)
    return max(usage - inactive, 0)


# -- /proc/self/cgroup and /proc/self/mountinfo --------------------------------------------------
def _own_path(text: str | None, version: int) -> str | None:
    """The process's cgroup path in the v2 hierarchy or in the v1 one holding ``memory``."""
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        _hierarchy, controllers, path = parts
        if (version == 2 and controllers == "") or (
            version == 1 and "memory" in controllers.split(",")
        ):
            return path
    return None


def _read_mounts(root: Path) -> list[Mount]:
    mounts = []
    for line in (_read_text(root / PROC_MOUNTINFO) or "").splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            options = frozenset(tail[2].split(","))
            mounts.append(Mount(_unescape(fields[3]), _unescape(fields[4]), tail[0], options))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_for(mounts: list[Mount], path: str, version: int) -> Mount | None:
    """The hierarchy's mount that shows ``path``: the deepest mount root above it, else any."""
    if version == 2:
        candidates = [m for m in mounts if m.fstype == "cgroup2"]
    else:
        candidates = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.options]
    showing = [m for m in candidates if _relative(path, m.root) is not None]
    return max(showing, key=lambda m: len(m.root), default=None) or next(iter(candidates), None)


def _components(path: str) -> list[str]:
    """``/a/./b/`` -> ``["a", "b"]``; a leading ``..`` is kept (``/../x`` -> ``["..", "x"]``)."""
    normal = posixpath.normpath("./" + path.lstrip("/"))
    return [] if normal == "." else normal.split("/")


def _relative(path: str, mount_root: str) -> list[str] | None:
    """``path``'s components below ``mount_root``, or None when it lies outside it."""
    parts, base = _components(path), _components(mount_root)
    if parts[: len(base)] != base or ".." in parts:
        return None
    return parts[len(base) :]


def _resolve(root: Path, mount: Mount, path: str) -> CgroupDir:
    mount_dir = root / mount.mount_point.lstrip("/")
    base = "/" + "/".join(_components(mount.root))
    rel = _relative(path, mount.root)
    if rel is None:  # outside the mount's root: the mount point is the nearest visible cgroup
        return CgroupDir(base, mount_dir, mount_dir)
    return CgroupDir(posixpath.join(base, *rel), mount_dir.joinpath(*rel), mount_dir)


# -- files -----------------------------------------------------------------------------------------
def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    text = (_read_text(path) or "").strip()
    return int(text) if text.isdigit() else None


def _read_limit(path: Path) -> int | None:
    """A limit file's bytes, or None for ``max``, v1's unlimited value or an unreadable file."""
    return _limit_or_none(_read_int(path))


def _limit_or_none(limit: int | None) -> int | None:
    return limit if limit is not None and limit < V1_UNLIMITED else None


def _read_stat(directory: Path) -> dict[str, int]:
    stat = {}
    for line in (_read_text(directory / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            stat[key] = int(value)
    return stat
