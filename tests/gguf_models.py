"""Small GGUF files for tests, written with gguf-py. Nothing is downloaded.

- ``random_blocks(type_name, rows, cols)``: valid random blocks of any supported type (gguf-py
  cannot quantize the K-quants, so their bytes are drawn directly, with finite fp16 scales).
- ``write_gguf(path, tensors)``: a GGUF file of named ``(type_name, raw_or_float, rows, cols)``.
- ``gguf_from_hf(folder, path, type_of)``: a tiny HF llama folder's weights as a llama GGUF,
  q/k rows permuted as llama.cpp's converter does, each tensor in ``type_of(gguf_name)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

BLOCK_BYTES = {t.name: gguf.GGML_QUANT_SIZES[t] for t in gguf.GGMLQuantizationType}
"""type name -> (values per block, bytes per block)."""

_SCALE_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
"""Byte offsets of the fp16 scales (d, m / dmin) inside a block."""


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw bytes ``[rows, cols / block * block_bytes]`` of random valid blocks."""
    values, size = BLOCK_BYTES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[type_name]:
        scale = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]], arch: str = "llama") -> Path:
    """A GGUF file holding ``name -> (type_name, data)``: float32 data for F32/F16 and for the
    types gguf-py quantizes, or raw block bytes ``[rows, bytes]`` (uint8)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (type_name, data) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        if data.dtype != np.uint8:
            data = gguf.quants.quantize(data, qtype) if type_name != "F32" else data
        if type_name == "F32":
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_from_hf(folder: Path, path: Path, type_of: Callable[[str], str]) -> Path:
    """The safetensors weights of the tiny llama ``folder`` as a llama GGUF at ``path``."""
    import json

    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for hf_name, data in state.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind in heads:
            data = _permute(data, heads[kind])
        tensors[name] = (type_of(name) if data.ndim == 2 else "F32", data.astype(np.float32))
    return write_gguf(path, tensors)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF's half-split head rows -> interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )
