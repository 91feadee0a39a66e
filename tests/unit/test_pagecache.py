"""The page cache helpers the truth harness uses (``kvroom.pagecache``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvroom.pagecache import drop, mapped_files


def test_mapped_files_keeps_regular_files_once(tmp_path: Path) -> None:
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"\0" * 8192)
    maps = "\n".join(
        [
            f"7f0000000000-7f0000001000 r--p 00000000 fd:00 12 {lib}",
            f"7f0000001000-7f0000002000 r-xp 00001000 fd:00 12 {lib}",
            f"7f0000003000-7f0000004000 r--p 00000000 fd:00 13 {tmp_path}/gone.so (deleted)",
            "7f0000005000-7f0000006000 rw-p 00000000 00:00 0 [heap]",
            "7f0000007000-7f0000008000 rw-p 00000000 00:00 0",
            f"7f0000009000-7f000000a000 r--p 00000000 fd:00 14 {tmp_path}/missing.so",
        ]
    )
    assert mapped_files(maps) == [lib]


def test_drop_names_the_bytes_and_skips_unreadable(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(b"\1" * 10_000)
    assert drop([data, tmp_path / "missing.so"]) == 10_000
    assert data.read_bytes() == b"\1" * 10_000  # dropping the cache never touches the file


def test_cli_lists_torch_and_rejects_unknown_actions() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "kvroom.pagecache", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert any("libtorch_cpu" in line for line in listed)
    bad = subprocess.run(
        [sys.executable, "-m", "kvroom.pagecache", "warm"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage" in bad.stderr
