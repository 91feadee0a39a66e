"""Drop the page cache of the files a deployment maps (its shared libraries).

A process's resident set counts the file pages it has mapped (``RssFile``), and how many of a
library's pages one page fault maps depends on how the page cache holds that library: on
kernels whose filesystem keeps large folios (ext4 since Linux 6.16), a fault maps the whole
folio it hits. A file written in large pieces (as ``pip install`` or an image extraction
writes a library) sits in the cache in large folios; a file read back from disk sits in small
ones. Measured with the imports of ``kvroom.LLM`` (torch, transformers, kvroom) on Linux 6.18,
ext4: 80 MB of file pages after libtorch was read from disk, 151 MB after it was written in
one piece, the anonymous memory 170.2 MB in both. Writing a file in 64 KiB pieces does not
build large folios; writing it in one piece does, and so did reading the dropped files back
through in 1 MiB reads on another day (a tiny model's run then peaked at 430 MB instead of
305 MB): readahead decides, so the harness leaves the first reads to the processes it measures.

``drop`` puts the libraries in the read-from-disk state (the pages no process maps leave the
cache and come back small), so runs measured after it do not depend on how the libraries were
installed: the truth harness does it before it starts. The pages are clean: the kernel
reclaims them before it kills a process for memory.

    python -m kvroom.pagecache drop    # prints {"files": N, "bytes": B} as JSON
    python -m kvroom.pagecache list    # the files, one per line

``drop`` lists the files in a child process that imports the deployment and exits, so the
dropping process maps none of them: the kernel keeps the pages a process maps.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

PROC_MAPS = Path("/proc/self/maps")
DEPLOYMENT_MODULES = (
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "safetensors",
    "kvroom.llm",
    "kvroom.server.app",
    "uvicorn",
    "uvloop",  # what `serve` runs where installed
    "httptools",
)


def deployment_files() -> list[Path]:
    """The regular files this process maps after importing what ``LLM`` and ``serve`` import
    and loading the native kernels."""
    for name in DEPLOYMENT_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    from kvroom.models.kernels.build import library

    library()
    return mapped_files(PROC_MAPS.read_text())


def mapped_files(maps: str) -> list[Path]:
    """The paths of the regular files in a ``/proc/<pid>/maps`` listing, each once."""
    paths = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith(")"):
            paths.add(Path(fields[5]))  # "(deleted)" files and pseudo-files like [heap] left out
    return sorted(p for p in paths if p.is_file())


def drop(paths: list[Path]) -> int:
    """Ask the kernel to drop each file's cached pages (those no process maps); bytes named."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def listed_files(timeout_s: float = 300.0) -> list[Path]:
    """``deployment_files`` of a child process (``python -m kvroom.pagecache list``)."""
    cmd = [sys.executable, "-m", "kvroom.pagecache", "list"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
    return [Path(line) for line in done.stdout.splitlines() if line]


def main(argv: list[str]) -> int:
    if argv not in (["drop"], ["list"]):
        print("usage: python -m kvroom.pagecache drop|list", file=sys.stderr)
        return 2
    if argv == ["list"]:
        print("\n".join(str(p) for p in deployment_files()))
        return 0
    paths = listed_files()
    print(json.dumps({"files": len(paths), "bytes": drop(paths)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
