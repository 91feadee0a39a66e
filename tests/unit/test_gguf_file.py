"""``gguf_file``: headers read and checked (types, truncation) and the bytes kvroom will hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gguf_models import random_blocks, write_gguf
from kvroom.errors import ModelSourceError
from kvroom.gguf_file import BLOCK_LAYOUTS, read_gguf, resident_bytes_by_type


def _model(tmp_path: Path, head: bool = False) -> Path:
    tensors = {
        "token_embd.weight": ("Q8_0", random_blocks("Q8_0", 10, 64)),
        "blk.0.attn_q.weight": ("Q4_1", random_blocks("Q4_1", 8, 64)),
        "blk.0.ffn_down.weight": ("Q6_K", random_blocks("Q6_K", 4, 256)),
        "blk.0.attn_norm.weight": ("F32", np.ones(64, dtype=np.float32)),
    }
    if head:
        tensors["output.weight"] = ("Q4_0", random_blocks("Q4_0", 10, 64))
    return write_gguf(tmp_path / "m.gguf", tensors)


def test_header_gives_types_shapes_and_architecture(tmp_path: Path) -> None:
    header = read_gguf(_model(tmp_path))
    assert header.architecture == "llama"
    by_name = {t.name: t for t in header.tensors}
    q = by_name["blk.0.attn_q.weight"]
    assert (q.type_name, q.rows, q.cols, q.dims) == ("Q4_1", 8, 64, (8, 64))
    assert q.nbytes == 8 * 2 * 20
    assert by_name["blk.0.attn_norm.weight"].dims == (64,)


def test_resident_bytes_per_kind_tied_head_is_the_quantized_embedding(tmp_path: Path) -> None:
    header = read_gguf(_model(tmp_path))
    got = resident_bytes_by_type(header.tensors, "float32")
    assert got == {
        "int8 (Q8_0)": 10 * 64 + 10 * 2 * 2,
        "int4 (Q4_1)": 8 * 32 + 8 * 2 * 2 * 2,
        "int8 (Q6_K)": 4 * 256 + 4 * 16 * 4,
        "float32": 64 * 4,  # the norm; the tied head is the Q8_0 embedding
    }


def test_untied_head_and_the_embedding_both_stay_quantized(tmp_path: Path) -> None:
    header = read_gguf(_model(tmp_path, head=True))
    got = resident_bytes_by_type(header.tensors, "bfloat16")
    assert got["int4 (Q4_0)"] == BLOCK_LAYOUTS["Q4_0"].resident_bytes(10, 64)
    assert got["bfloat16"] == 64 * 2
    assert got["int8 (Q8_0)"] == BLOCK_LAYOUTS["Q8_0"].resident_bytes(10, 64)


def test_unsupported_block_type_is_named_with_the_supported(tmp_path: Path) -> None:
    raw = np.random.default_rng(0).integers(0, 255, (2, 66), dtype=np.uint8)
    path = write_gguf(tmp_path / "iq.gguf", {"blk.0.attn_q.weight": ("IQ2_XXS", raw)})
    with pytest.raises(ModelSourceError) as err:
        read_gguf(path)
    message = str(err.value)
    assert "block type IQ2_XXS is not supported" in message
    assert "supported: F32, F16, BF16, Q4_0, Q4_1, Q4_K, Q5_0" in message
    assert "\n" not in message


def test_truncated_file_is_an_error(tmp_path: Path) -> None:
    path = _model(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelSourceError, match="truncated"):
        read_gguf(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelSourceError, match="cannot read GGUF"):
        read_gguf(path)
