"""How many bytes this process can use on a device, and named target devices.

CPU: the cgroup limit when there is one (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), capped
by the RAM available now (psutil); CUDA: the free bytes from ``torch.cuda.mem_get_info``. An
explicit size or a named profile replaces the probe, so one machine can plan for another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvroom.errors import ConfigError
from kvroom.units import parse_bytes

TARGET_PROFILES: dict[str, int] = {
    "h200-141gb": 143771 * 2**20,
    "h100-80gb": 81559 * 2**20,
    "a100-80gb": 81920 * 2**20,
    "a100-40gb": 40960 * 2**20,
    "l4-24gb": 23034 * 2**20,
}
"""Total device memory of common accelerators, as ``nvidia-smi --query-gpu=memory.total`` reports
it (MiB) for H200 141GB, H100 80GB HBM3, A100-SXM4 80GB/40GB and L4. Names are lower case."""

CGROUP_V2_MAX = Path("/sys/fs/cgroup/memory.max")
CGROUP_V2_CURRENT = Path("/sys/fs/cgroup/memory.current")
CGROUP_V1_LIMIT = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
CGROUP_V1_USAGE = Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")
_V1_UNLIMITED = 2**60  # v1 reports "no limit" as a huge page-aligned number


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes a plan may count on, and where that figure came from."""

    available_bytes: int
    source: str
    """``cgroup-v2``, ``cgroup-v1``, ``psutil``, ``cuda:N``, ``explicit`` or ``profile:<name>``."""


def resolve_device_memory(device: str, device_memory: int | str | None) -> DeviceMemory:
    """The memory to plan for: the explicit value or profile if given, else a probe of ``device``.

    Raises:
        ConfigError: an unknown profile name or an unparsable size.
    """
    if device_memory is None:
        return probe(device)
    if isinstance(device_memory, str) and device_memory.strip().lower() in TARGET_PROFILES:
        name = device_memory.strip().lower()
        return DeviceMemory(TARGET_PROFILES[name], f"profile:{name}")
    try:
        return DeviceMemory(parse_bytes(device_memory, "device_memory"), "explicit")
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or a profile: {', '.join(TARGET_PROFILES)}") from None


def probe(device: str) -> DeviceMemory:
    """Probe the memory this process can use on ``device`` (``cpu``, ``cuda`` or ``cuda:N``)."""
    if device.startswith("cuda"):
        return _probe_cuda(device)
    return probe_cpu()


def probe_cpu(
    v2_max: Path = CGROUP_V2_MAX,
    v2_current: Path = CGROUP_V2_CURRENT,
    v1_limit: Path = CGROUP_V1_LIMIT,
    v1_usage: Path = CGROUP_V1_USAGE,
) -> DeviceMemory:
    """Bytes available to this process on the host: min(cgroup headroom, available RAM)."""
    import psutil

    ram_bytes = int(psutil.virtual_memory().available)
    cgroup = _cgroup_headroom(v2_max, v2_current, "cgroup-v2") or _cgroup_headroom(
        v1_limit, v1_usage, "cgroup-v1"
    )
    if cgroup is not None and cgroup.available_bytes < ram_bytes:
        return cgroup
    return DeviceMemory(ram_bytes, "psutil")


def _cgroup_headroom(limit_file: Path, usage_file: Path, source: str) -> DeviceMemory | None:
    """Limit minus usage of a cgroup, or None when there is no file or no limit."""
    limit = _read_int(limit_file)
    if limit is None or limit >= _V1_UNLIMITED:
        return None
    usage = _read_int(usage_file) or 0
    return DeviceMemory(max(limit - usage, 0), source)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" means no limit


def _probe_cuda(device: str) -> DeviceMemory:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"device: {device!r} requested but CUDA is not available here; "
            "pass --device-memory (bytes or a profile) to plan for a GPU this machine lacks"
        )
    index = torch.device(device).index or 0
    free_bytes, _total = torch.cuda.mem_get_info(index)
    return DeviceMemory(int(free_bytes), f"cuda:{index}")
