"""Crash-safe replacement of a small file: temp file in the same folder, fsync, ``os.replace``,
fsync of the folder, all under a lock, so readers see the old or the new file, never a mix.

The lock is ``flock`` on the folder itself, so nothing is left behind in it. A lock *file*
could not be removed safely after use: a process waiting on it would then hold a lock on the
unlinked file while a newcomer creates and locks a fresh one, and both would write.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvroom.errors import ArtifactError

PAUSE_ENV = "KVROOM_TEST_PAUSE_BEFORE_REPLACE"
"""Test hook: seconds to sleep between the fsynced temp file and ``os.replace``."""


@contextlib.contextmanager
def locked(path: Path, timeout_s: float = 60.0) -> Iterator[None]:
    """Hold the lock of ``path`` (an exclusive ``flock`` of its folder) for a read-modify-write.

    Raises:
        ArtifactError: another process held the lock for ``timeout_s`` seconds.
    """
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ArtifactError(
                        f"{path}: locked by another process for {timeout_s:g} s "
                        "(a concurrent kvroom set?); try again"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically. Call it under ``locked(path)``."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        _pause_for_tests()
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(path.parent)


def _mode_for(path: Path) -> int:
    """Keep the mode of the file being replaced; a new file gets 0o666 minus the umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _pause_for_tests() -> None:
    delay = os.environ.get(PAUSE_ENV)
    if delay:
        time.sleep(float(delay))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
