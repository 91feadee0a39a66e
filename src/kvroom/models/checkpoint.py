"""Read tensors of ``*.safetensors`` files one at a time, into memory the caller owns.

``safetensors.safe_open`` maps the whole file: every tensor read stays resident as file-backed
pages of that mapping until the handle closes, so loading held the checkpoint twice (the
mapped file and the converted weights: 1.40 GB peak against 0.95 GB resident after load for
SmolLM2 fp32). Here a tensor is ``pread`` from the file straight into a fresh tensor; the
page cache the kernel keeps is not part of the process's resident set, and nothing outlives
the tensor the caller keeps.

File layout (the safetensors format)::

    [8 bytes: little-endian u64 N] [N bytes: JSON header] [data]
    header: {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
             "__metadata__": {...}}           offsets are relative to the start of data
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from kvroom.errors import ModelSourceError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _Entry:
    """Where one tensor lives: file descriptor, absolute byte range, dtype and shape."""

    __slots__ = ("fd", "begin", "end", "dtype", "shape")

    def __init__(self, fd: int, begin: int, end: int, dtype: torch.dtype, shape: list[int]):
        self.fd, self.begin, self.end, self.dtype, self.shape = fd, begin, end, dtype, shape


class Checkpoint:
    """Every ``*.safetensors`` file of a folder; tensors read on demand, never mapped.

    Use as a context manager (or call ``close``): it holds one file descriptor per file.
    """

    def __init__(self, folder: Path, device: torch.device) -> None:
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ModelSourceError(f"{folder}: no *.safetensors weights found")
        self.device = device
        self._fds: list[int] = []
        self._where: dict[str, _Entry] = {}
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            self._fds.append(fd)
            self._where.update(_read_header(fd, file))

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``, in its stored dtype, on the checkpoint's device, owned.

        Raises:
            ModelSourceError: no such tensor, or the file is shorter than its header says.
        """
        entry = self._where.get(name)
        if entry is None:
            raise ModelSourceError(f"checkpoint has no tensor {name!r}")
        buf = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
        view = memoryview(buf.numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(entry.fd, [view[done:]], entry.begin + done)
            if n == 0:
                raise ModelSourceError(f"checkpoint tensor {name!r}: file ends early")
            done += n
        tensor = buf.view(entry.dtype).view(entry.shape)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)


def _read_header(fd: int, file: Path) -> dict[str, _Entry]:
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise ModelSourceError(f"{file}: not a safetensors file (shorter than 8 bytes)")
    (size,) = struct.unpack("<Q", head)
    try:
        header = json.loads(os.pread(fd, size, 8))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{file}: corrupted safetensors header ({exc})") from None
    start = 8 + size
    entries: dict[str, _Entry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ModelSourceError(f"{file}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        if (end - begin) != math.prod(meta["shape"]) * dtype.itemsize:
            raise ModelSourceError(f"{file}: tensor {name!r}: offsets disagree with its shape")
        entries[name] = _Entry(fd, start + begin, start + end, dtype, list(meta["shape"]))
    return entries
