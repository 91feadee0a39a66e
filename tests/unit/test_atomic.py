"""kvroom.atomic: crash-safe replacement under a lock, and what ``kvroom set`` does with it
when several processes race or one is killed mid-write."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvroom import atomic
from kvroom.artifact.layout import KVROOM_CONFIG, read_info
from kvroom.artifact.resize import get_kvcache_num_blocks, set_kvcache_num_blocks
from kvroom.atomic import PAUSE_ENV, atomic_write_text, locked
from kvroom.errors import ArtifactError
from tiny_models import compile_tiny_artifact, write_tiny_llama

TMP_GLOB = f".{KVROOM_CONFIG}.*.tmp"


# -- atomic_write_text / locked ----------------------------------------------------------------


def test_write_creates_and_replaces(tmp_path):
    path = tmp_path / "f.json"
    atomic_write_text(path, "one")
    assert path.read_text() == "one"
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]  # no temp file left


def test_write_keeps_the_mode_of_the_replaced_file(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    path.chmod(0o604)
    atomic_write_text(path, "new")
    assert path.stat().st_mode & 0o777 == 0o604


def test_new_file_gets_the_umask_mode(tmp_path):
    old_umask = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "f.json", "x")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o640


def test_failed_replace_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    path.write_text("old")

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(atomic.os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_pause_hook_sleeps_before_replace(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setenv(PAUSE_ENV, "0.25")
    monkeypatch.setattr(atomic.time, "sleep", slept.append)
    atomic_write_text(tmp_path / "f.json", "x")
    assert slept == [0.25]


def test_locked_is_exclusive_and_times_out_with_an_artifact_error(tmp_path):
    path = tmp_path / "f.json"
    with locked(path):
        assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob(".*.lock"))
        # A second holder in another process (flock is per open file, so a subprocess is honest).
        code = (
            "import sys; from pathlib import Path; from kvroom.atomic import locked\n"
            "from kvroom.errors import ArtifactError\n"
            "try:\n"
            f"    with locked(Path({str(path)!r}), timeout_s=0.2): sys.exit(0)\n"
            "except ArtifactError as e: print(e); sys.exit(3)\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == (
        f"{path}: locked by another process for 0.2 s (a concurrent kvroom set?); try again"
    )
    with locked(path, timeout_s=0.2):  # released on exit
        pass


# -- kvroom set across processes -----------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("atomic")
    return compile_tiny_artifact(write_tiny_llama(root / "src"), root / "artifact")


@pytest.fixture
def art(compiled, tmp_path) -> Path:
    return Path(shutil.copytree(compiled, tmp_path / "artifact"))


def kvroom_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvroom", *args]


def env_with(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != PAUSE_ENV}
    env.update(extra)
    return env


def assert_valid(folder: Path) -> int:
    doc = json.loads((folder / KVROOM_CONFIG).read_text())
    info = read_info(folder)
    n = info.num_blocks
    assert doc["kvcache_num_blocks"] == doc["plan"]["num_blocks"] == n
    assert info.config.kvcache_num_blocks == n
    assert info.plan.num_blocks_source == "set"
    assert info.plan.estimated_num_blocks == 64
    return n


def test_concurrent_sets_leave_one_value(art):
    values = [20, 24, 28, 32, 36, 40]
    env = env_with(**{PAUSE_ENV: "0.1"})  # widen the window between write and replace
    procs = [
        subprocess.Popen(
            kvroom_cmd("set", str(art), str(n)),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in values
    ]
    results = [(p.wait(timeout=60), *p.communicate()) for p in procs]
    for (rc, out, err), n in zip(results, values, strict=True):
        assert rc == 0, err
        assert out == f"{n}\n"
    final = assert_valid(art)
    assert final in values
    assert get_kvcache_num_blocks(art) == final
    assert not list(art.glob(TMP_GLOB))


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


def test_set_killed_mid_write_leaves_the_old_file(art):
    set_kvcache_num_blocks(art, 48)
    before = (art / KVROOM_CONFIG).read_bytes()
    proc = subprocess.Popen(
        kvroom_cmd("set", str(art), "20"),
        env=env_with(**{PAUSE_ENV: "30"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: bool(list(art.glob(TMP_GLOB))) or proc.poll() is not None)
        assert proc.poll() is None, "kvroom set exited before the pause"
        tmp = list(art.glob(TMP_GLOB))
        assert len(tmp) == 1
        # set holds the lock while it writes
        with (
            pytest.raises(ArtifactError, match="locked by another process"),
            locked(art / KVROOM_CONFIG, timeout_s=0.1),
        ):
            pass
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (art / KVROOM_CONFIG).read_bytes() == before
    assert get_kvcache_num_blocks(art) == 48
    assert assert_valid(art) == 48
    # The kernel released the dead process's lock: the next set goes through.
    set_kvcache_num_blocks(art, 30)
    assert assert_valid(art) == 30


def test_set_leaves_no_lock_file_in_the_artifact(art):
    before = sorted(p.name for p in art.iterdir())
    set_kvcache_num_blocks(art, 48)
    assert sorted(p.name for p in art.iterdir()) == before
