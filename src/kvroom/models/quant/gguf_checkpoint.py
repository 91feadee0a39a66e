"""A GGUF file read tensor by tensor under HF names, quantized tensors kept as shipped.

The same contract as ``models.checkpoint.Checkpoint`` (``get(hf_name)``, ``in``, a context
manager), so ``models.weights`` loads either. A float tensor comes back as a tensor; a
quantized one as a ``QuantizedLinear`` (``gguf_repack``). Bytes are ``pread`` into memory the
caller owns, never mapped (see ``checkpoint.py`` for why).

Names: gguf-py's ``TensorNameMap`` (the table llama.cpp's converter writes with) maps HF names
to GGUF ones. llama.cpp stores the q/k rows of ``llama`` models permuted; they are permuted
back here, as transformers does, so every tensor arrives in HF's layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from kvroom.errors import ModelSourceError
from kvroom.gguf_file import GgufTensor, read_gguf
from kvroom.models.quant.gguf_repack import repack
from kvroom.models.quant.linear import QuantizedLinear

_DENSE = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_PERMUTED_ARCHS = ("llama",)
"""Architectures whose q/k rows llama.cpp's converter permutes (transformers undoes it)."""


class GgufCheckpoint:
    """One GGUF file; ``get`` returns HF-named tensors in HF layout."""

    def __init__(self, path: Path, device: torch.device, num_heads: int, num_kv_heads: int):
        import gguf

        header = read_gguf(path)
        self.device = device
        self.architecture = header.architecture
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
        self._tensors = {t.name: t for t in header.tensors}
        num_layers = 1 + max((_layer_of(n) for n in self._tensors), default=-1)
        arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == header.architecture), None)
        if arch is None:
            raise ModelSourceError(
                f"GGUF {path.name}: unknown architecture {header.architecture!r}"
            )
        self._names = gguf.get_tensor_name_map(arch, num_layers)
        self._fd = os.open(path, os.O_RDONLY)

    def __enter__(self) -> GgufCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def gguf_name(self, hf_name: str) -> str | None:
        """The GGUF tensor holding HF tensor ``hf_name``, or None."""
        name = self._names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return name if name in self._tensors else None

    def __contains__(self, hf_name: str) -> bool:
        return self.gguf_name(hf_name) is not None

    def is_quantized(self, hf_name: str) -> bool:
        name = self.gguf_name(hf_name)
        return name is not None and self._tensors[name].layout is not None

    def get(self, hf_name: str) -> torch.Tensor | QuantizedLinear:
        """HF tensor ``hf_name``: a float tensor, or a ``QuantizedLinear`` for a quantized one.

        Raises:
            ModelSourceError: no such tensor, or the file ends early.
        """
        name = self.gguf_name(hf_name)
        if name is None:
            raise ModelSourceError(f"GGUF has no tensor for {hf_name!r}")
        t = self._tensors[name]
        raw = self._read(t)
        if t.layout is not None:
            value: torch.Tensor | QuantizedLinear = repack(raw, t.type_name, t.rows, t.cols)
        else:
            dense = torch.from_numpy(raw.view(_DENSE[t.type_name]))
            if t.type_name == "BF16":
                dense = dense.view(torch.bfloat16)
            value = dense.view(t.dims)
        value = self._unpermute(name, value)
        return value if self.device.type == "cpu" else value.to(self.device)

    def _read(self, t: GgufTensor) -> np.ndarray:
        buf = np.empty(t.nbytes, dtype=np.uint8)
        view = memoryview(buf)
        done = 0
        while done < t.nbytes:
            n = os.preadv(self._fd, [view[done:]], t.offset + done)
            if n == 0:
                raise ModelSourceError(f"GGUF tensor {t.name!r}: file ends early")
            done += n
        return buf

    def _unpermute(
        self, name: str, value: torch.Tensor | QuantizedLinear
    ) -> torch.Tensor | QuantizedLinear:
        """Undo llama.cpp's q/k row permutation (rows only: lossless on quantized blocks)."""
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if self.architecture not in _PERMUTED_ARCHS or kind not in self._heads:
            return value
        rows = value.out_features if isinstance(value, QuantizedLinear) else value.shape[0]
        heads = self._heads[kind]
        perm = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2)
        index = perm.reshape(-1)
        if isinstance(value, QuantizedLinear):
            return value.take_rows(index)
        return value.index_select(0, index)


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else -1
