"""``models/checkpoint.py``: tensors read without a file mapping equal what safetensors reads."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvroom.errors import ModelSourceError
from kvroom.models.checkpoint import Checkpoint


def _write(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def test_reads_every_tensor_equal_to_safetensors(tmp_path: Path) -> None:
    _write(tmp_path)
    expected = load_file(str(tmp_path / "model.safetensors"))
    with Checkpoint(tmp_path, torch.device("cpu")) as ckpt:
        for name, want in expected.items():
            got = ckpt.get(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)
        assert "a" in ckpt and "zz" not in ckpt


def test_missing_tensor_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no \\*.safetensors weights found"):
        Checkpoint(tmp_path, torch.device("cpu"))
    _write(tmp_path)
    ckpt = Checkpoint(tmp_path, torch.device("cpu"))
    with ckpt, pytest.raises(ModelSourceError, match="checkpoint has no tensor 'zz'"):
        ckpt.get("zz")


def test_truncated_file_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    ckpt = Checkpoint(tmp_path, torch.device("cpu"))
    with ckpt, pytest.raises(ModelSourceError, match="file ends early"):
        for name in ("a", "b", "c"):
            ckpt.get(name)


def test_corrupted_header_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ModelSourceError, match="corrupted safetensors header"):
        Checkpoint(tmp_path, torch.device("cpu"))
