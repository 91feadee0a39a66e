"""The memory probe, against fake cgroup trees and a fake psutil; CUDA through a fake torch."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from cgroup_trees import (
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
from kvroom import device
from kvroom.device import TARGET_PROFILES, DeviceMemory, probe_cpu, resolve_device_memory
from kvroom.errors import ConfigError

RAM_AVAILABLE = 8 * 2**30


@pytest.fixture(autouse=True)
def fake_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=RAM_AVAILABLE))


def test_v2_limit_minus_current(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/kvtest"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup/kvtest", v2_files(2 * GiB, 512 * MiB))
    expected = DeviceMemory(1536 * MiB, "cgroup-v2 /kvtest, limit 2.00 GiB")
    assert probe_cpu(tmp_path) == expected


def test_v1_limit_of_the_own_cgroup(tmp_path: Path) -> None:
    write_proc(tmp_path, ["4:memory:/kvtest", "0::/"], [V1_MEMORY, V2_UNIFIED])
    write_cgroup(tmp_path, "/sys/fs/cgroup/memory", v1_files(None, 5 * GiB))
    write_cgroup(tmp_path, "/sys/fs/cgroup/memory/kvtest", v1_files(3 * GiB, GiB))
    expected = DeviceMemory(2 * GiB, "cgroup-v1 /kvtest, limit 3.00 GiB")
    assert probe_cpu(tmp_path) == expected


def test_limit_above_ram_gives_ram(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/kvtest"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup/kvtest", v2_files(16 * GiB, 0))
    assert probe_cpu(tmp_path) == DeviceMemory(RAM_AVAILABLE, "psutil")  # 16 GiB > 8 GiB RAM


def test_v2_max_means_no_limit(tmp_path: Path) -> None:
    write_proc(tmp_path, ["0::/kvtest"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup/kvtest", v2_files(None, 12345))
    assert probe_cpu(tmp_path) == DeviceMemory(RAM_AVAILABLE, "psutil")


def test_v1_unlimited_gives_psutil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # RAM above the "unlimited" value, so only recognising it as "no limit" gives psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**63))
    write_proc(tmp_path, ["4:memory:/kvtest"], [V1_MEMORY])
    write_cgroup(tmp_path, "/sys/fs/cgroup/memory/kvtest", v1_files(None, GiB))
    assert probe_cpu(tmp_path) == DeviceMemory(2**63, "psutil")


def test_a_limit_on_the_namespace_root_only_is_not_taken_for_the_own_cgroup(
    tmp_path: Path,
) -> None:
    """The old probe read ``/sys/fs/cgroup/memory.max``; the process's own cgroup is elsewhere."""
    write_proc(tmp_path, ["0::/kvtest"], [V2])
    write_cgroup(tmp_path, "/sys/fs/cgroup/other", v2_files(GiB, 0))
    write_cgroup(tmp_path, "/sys/fs/cgroup/kvtest", v2_files(2 * GiB, 0))
    expected = DeviceMemory(2 * GiB, "cgroup-v2 /kvtest, limit 2.00 GiB")
    assert probe_cpu(tmp_path) == expected


def test_no_cgroup_files_gives_psutil(tmp_path: Path) -> None:
    assert probe_cpu(tmp_path) == DeviceMemory(RAM_AVAILABLE, "psutil")


# -- explicit sizes and profiles -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("1.5 GB", 1_500_000_000),
        (1000, 1000),
    ],
)
def test_explicit_size(value: int | str, expected: int) -> None:
    assert resolve_device_memory("cpu", value) == DeviceMemory(expected, "explicit")


@pytest.mark.parametrize(
    ("name", "mib"),
    [
        ("h200-141gb", 143771),
        ("h100-80gb", 81559),
        ("a100-80gb", 81920),
        ("a100-40gb", 40960),
        ("l4-24gb", 23034),
    ],
)
def test_profiles(name: str, mib: int) -> None:
    assert resolve_device_memory("cuda", name) == DeviceMemory(mib * 2**20, f"profile:{name}")


def test_profile_name_is_trimmed_and_lower_cased() -> None:
    got = resolve_device_memory("cpu", " A100-40GB ")
    assert got == DeviceMemory(40960 * 2**20, "profile:a100-40gb")


def test_profile_table_is_exactly_these() -> None:
    assert list(TARGET_PROFILES) == ["h200-141gb", "h100-80gb", "a100-80gb", "a100-40gb", "l4-24gb"]


def test_unknown_profile_lists_profiles() -> None:
    expected = (
        "device_memory: cannot parse 'h300-999gb' as a byte size (e.g. 2147483648, '2GiB', "
        "'512MB'); or a profile: h200-141gb, h100-80gb, a100-80gb, a100-40gb, l4-24gb"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        resolve_device_memory("cpu", "h300-999gb")


def test_none_probes_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    probed = DeviceMemory(5, "cgroup-v2 /kvtest, limit 5 B")
    monkeypatch.setattr(device, "probe_cpu", lambda: probed)
    assert resolve_device_memory("cpu", None) == probed


# -- CUDA (a fake torch module: no real torch import, no GPU) --------------------------------------
def _fake_torch(monkeypatch: pytest.MonkeyPatch, *, available: bool) -> list[int]:
    calls: list[int] = []

    def mem_get_info(index: int) -> tuple[int, int]:
        calls.append(index)
        return 7 * 2**30, 80 * 2**30

    def torch_device(name: str) -> SimpleNamespace:
        _, _, index = name.partition(":")
        return SimpleNamespace(index=int(index) if index else None)

    fake = types.ModuleType("torch")
    fake.cuda = SimpleNamespace(is_available=lambda: available, mem_get_info=mem_get_info)
    fake.device = torch_device
    monkeypatch.setitem(sys.modules, "torch", fake)
    return calls


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    _fake_torch(monkeypatch, available=False)
    expected = (
        f"device: {name!r} requested but CUDA is not available here; "
        "pass --device-memory (bytes or a profile) to plan for a GPU this machine lacks"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        resolve_device_memory(name, None)


def test_cuda_profile_needs_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_torch(monkeypatch, available=False)
    got = resolve_device_memory("cuda", "h100-80gb")
    assert got == DeviceMemory(81559 * 2**20, "profile:h100-80gb")
    assert calls == []


@pytest.mark.parametrize(("name", "index"), [("cuda", 0), ("cuda:0", 0), ("cuda:2", 2)])
def test_cuda_probe_reports_free_bytes(
    monkeypatch: pytest.MonkeyPatch, name: str, index: int
) -> None:
    calls = _fake_torch(monkeypatch, available=True)
    assert resolve_device_memory(name, None) == DeviceMemory(7 * 2**30, f"cuda:{index}")
    assert calls == [index]
