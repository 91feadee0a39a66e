"""How many bytes this process can use on a device, and named target devices.

CPU: the headroom under the tightest memory limit of this process's own cgroup and its
ancestors (``kvroom.cgroup``), capped by the RAM available now (psutil); CUDA: the free bytes
from ``torch.cuda.mem_get_info``. An explicit size or a named profile replaces the probe, so one
machine can plan for another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvroom.cgroup import memory_limit
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


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes a plan may count on, and where that figure came from."""

    available_bytes: int
    source: str
    """``psutil``, ``cgroup-v1 /kvtest, limit 2.00 GiB`` (the cgroup holding the limit),
    ``cuda:N``, ``explicit`` or ``profile:<name>``."""


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


def probe_cpu(root: Path = Path("/")) -> DeviceMemory:
    """Bytes available to this process on the host: min(cgroup headroom, available RAM).

    Args:
        root: where ``/proc`` and ``/sys/fs/cgroup`` are read from (a fake tree in tests).
    """
    import psutil

    ram_bytes = int(psutil.virtual_memory().available)
    limit = memory_limit(root)
    if limit is not None and limit.headroom_bytes < ram_bytes:
        return DeviceMemory(limit.headroom_bytes, limit.source)
    return DeviceMemory(ram_bytes, "psutil")


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
