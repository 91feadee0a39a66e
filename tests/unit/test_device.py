"""The memory probe, against fake cgroup files and a fake psutil; CUDA through a fake torch."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from kvroom import device
from kvroom.device import TARGET_PROFILES, DeviceMemory, probe_cpu, resolve_device_memory
from kvroom.errors import ConfigError

RAM_AVAILABLE = 8 * 2**30
V1_UNLIMITED = 9_223_372_036_854_771_712  # what cgroup v1 reports with no limit: 2**63 - 4096


@pytest.fixture(autouse=True)
def fake_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=RAM_AVAILABLE))


@pytest.fixture
def cgroup(tmp_path: Path):
    """Write fake cgroup files; return probe_cpu bound to them (files not written do not exist)."""
    paths = {
        "v2_max": tmp_path / "memory.max",
        "v2_current": tmp_path / "memory.current",
        "v1_limit": tmp_path / "memory.limit_in_bytes",
        "v1_usage": tmp_path / "memory.usage_in_bytes",
    }

    def probe(**contents: str) -> DeviceMemory:
        for name, text in contents.items():
            paths[name].write_text(text)
        return probe_cpu(**paths)

    return probe


def test_v2_limit_minus_current(cgroup) -> None:
    got = cgroup(v2_max=f"{2 * 2**30}\n", v2_current=f"{512 * 2**20}\n")
    assert got == DeviceMemory(1536 * 2**20, "cgroup-v2")  # 2 GiB - 512 MiB


def test_v2_without_current_is_the_limit(cgroup) -> None:
    assert cgroup(v2_max=f"{2**30}\n") == DeviceMemory(2**30, "cgroup-v2")


def test_v2_usage_above_limit_is_zero(cgroup) -> None:
    assert cgroup(v2_max="1000\n", v2_current="1500\n") == DeviceMemory(0, "cgroup-v2")


def test_v2_limit_above_ram_gives_ram(cgroup) -> None:
    got = cgroup(v2_max=f"{16 * 2**30}\n", v2_current="0\n")
    assert got == DeviceMemory(RAM_AVAILABLE, "psutil")  # 16 GiB headroom > 8 GiB RAM


def test_v2_max_means_no_limit(cgroup) -> None:
    assert cgroup(v2_max="max\n", v2_current="12345\n") == DeviceMemory(RAM_AVAILABLE, "psutil")


def test_v2_max_falls_back_to_v1(cgroup) -> None:
    got = cgroup(v2_max="max\n", v1_limit=f"{3 * 2**30}\n", v1_usage=f"{2**30}\n")
    assert got == DeviceMemory(2 * 2**30, "cgroup-v1")  # 3 GiB - 1 GiB


def test_v1_limit(cgroup) -> None:
    got = cgroup(v1_limit=f"{3 * 2**30}\n", v1_usage=f"{2**30}\n")
    assert got == DeviceMemory(2 * 2**30, "cgroup-v1")


def test_v1_unlimited_gives_psutil(cgroup, monkeypatch: pytest.MonkeyPatch) -> None:
    # RAM above the "unlimited" value, so only recognising it as "no limit" gives psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**63))
    got = cgroup(v1_limit=f"{V1_UNLIMITED}\n", v1_usage=f"{2**30}\n")
    assert got == DeviceMemory(2**63, "psutil")


def test_v2_wins_over_v1(cgroup) -> None:
    got = cgroup(v2_max=f"{2**30}\n", v1_limit=f"{2**29}\n")
    assert got == DeviceMemory(2**30, "cgroup-v2")


def test_no_cgroup_files_gives_psutil(cgroup) -> None:
    assert cgroup() == DeviceMemory(RAM_AVAILABLE, "psutil")


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
    monkeypatch.setattr(device, "probe_cpu", lambda: DeviceMemory(5, "cgroup-v2"))
    assert resolve_device_memory("cpu", None) == DeviceMemory(5, "cgroup-v2")


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
