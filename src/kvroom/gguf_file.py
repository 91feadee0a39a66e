"""A GGUF file's tensors as kvroom keeps them: which block types run, and their resident bytes.

Torch-free, headers only (gguf-py's reader maps the file; no tensor data is touched here), so
the plan can count the weights as loaded before anything is loaded. The repacking itself is
``models/quant/gguf_repack.py``; the layout it produces is described in ``models/quant``.

A GGUF block type maps to one of kvroom's weight layouts, losslessly::

    type   layout  group  mins  scale dtype   file bytes / 32 values   resident / 32 values
    Q4_0   int4    32     no    float16       18                       18
    Q4_1   int4    32     yes   float16       20                       20
    Q4_K   int4    32     yes   float32       18                       24
    Q5_0   int8    32     no    float16       22                       34
    Q5_1   int8    32     yes   float16       24                       36
    Q5_K   int8    32     yes   float32       22                       40
    Q6_K   int8    16     no    float32       26.25                    40
    Q8_0   int8    32     no    float16       34                       34

K-quant scales are products ``d * sc`` of an fp16 and a 6-bit integer: exact in float32, not
in float16, hence their wider scales. F32/F16/BF16 tensors are taken in the model dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvroom.errors import ModelSourceError
from kvroom.units import DTYPE_BYTES


@dataclass(frozen=True)
class BlockLayout:
    """How kvroom holds one GGUF block type: ``kind`` int4/int8, group size, mins or not."""

    kind: str
    group_size: int
    has_mins: bool
    scale_bytes: int

    def resident_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a ``[rows, cols]`` weight in this layout: values, scales and mins."""
        value_bytes = rows * cols // 2 if self.kind == "int4" else rows * cols
        groups = rows * (cols // self.group_size)
        return value_bytes + groups * self.scale_bytes * (2 if self.has_mins else 1)


BLOCK_LAYOUTS: dict[str, BlockLayout] = {
    "Q4_0": BlockLayout("int4", 32, False, 2),
    "Q4_1": BlockLayout("int4", 32, True, 2),
    "Q4_K": BlockLayout("int4", 32, True, 4),
    "Q5_0": BlockLayout("int8", 32, False, 2),
    "Q5_1": BlockLayout("int8", 32, True, 2),
    "Q5_K": BlockLayout("int8", 32, True, 4),
    "Q6_K": BlockLayout("int8", 16, False, 4),
    "Q8_0": BlockLayout("int8", 32, False, 2),
}
"""GGUF block type -> the layout its blocks are repacked into (values exactly the file's)."""

DENSE_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*DENSE_TYPES, *BLOCK_LAYOUTS)


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: name, block type, ``[rows, cols]`` and where its bytes are."""

    name: str
    type_name: str
    rows: int
    cols: int
    offset: int
    """Absolute byte offset of the tensor's data in the file."""
    nbytes: int
    dims: tuple[int, ...]
    """Shape in PyTorch order (GGUF lists it innermost first)."""

    @property
    def layout(self) -> BlockLayout | None:
        """The quantized layout it keeps, or None for a dense (float) tensor."""
        return BLOCK_LAYOUTS.get(self.type_name)


@dataclass(frozen=True)
class GgufHeader:
    """What kvroom reads of a GGUF file before loading it: its architecture and tensors."""

    architecture: str
    tensors: list[GgufTensor]


def read_gguf(path: Path) -> GgufHeader:
    """The header of the GGUF file ``path``, checked: every type supported, every byte there.

    Raises:
        ModelSourceError: not a readable GGUF file, a tensor whose data lies past the end of
            the file (truncated), or a block type kvroom does not run (named, with the list).
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        tensors = [_tensor(t) for t in reader.tensors]
        arch_field = reader.fields["general.architecture"]
        architecture = bytes(arch_field.parts[arch_field.data[0]]).decode()
    except ModelSourceError:
        raise
    except Exception as exc:  # gguf-py raises many types for a bad file
        raise ModelSourceError(f"cannot read GGUF {path} (truncated or corrupted): {exc}") from None
    size = os.path.getsize(path)
    for t in tensors:
        if t.offset + t.nbytes > size:
            raise ModelSourceError(
                f"GGUF {path} is truncated: tensor {t.name!r} ends at byte "
                f"{t.offset + t.nbytes}, the file has {size}"
            )
    require_supported(path, tensors)
    return GgufHeader(architecture, tensors)


def require_supported(path: Path, tensors: list[GgufTensor]) -> None:
    """Raise ModelSourceError naming the first unsupported block types, with the supported."""
    bad = sorted({t.type_name for t in tensors if t.type_name not in SUPPORTED_TYPES})
    if bad:
        raise ModelSourceError(
            f"GGUF {path.name}: block type {', '.join(bad)} is not supported as shipped; "
            f"supported: {', '.join(SUPPORTED_TYPES)} (or compile with --dequantize)"
        )


def resident_bytes_by_type(tensors: list[GgufTensor], dtype: str) -> dict[str, int]:
    """Bytes each kind of tensor takes once loaded: ``{"int4 (Q4_1)": .., "float32": ..}``.

    Quantized tensors stay as shipped, the LM head included (a tied model's embedding and head
    are one table); float tensors are held in ``dtype`` (the model dtype).
    """
    width = DTYPE_BYTES[dtype]
    out: dict[str, int] = {}
    for t in tensors:
        if t.layout is not None:
            key = f"{t.layout.kind} ({t.type_name})"
            out[key] = out.get(key, 0) + t.layout.resident_bytes(t.rows, t.cols)
        else:
            out[dtype] = out.get(dtype, 0) + t.rows * t.cols * width
    return out


_HF_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_shapes(tensors: list[GgufTensor]) -> dict[str, tuple[int, ...]]:
    """Shapes by name, decoder projections under their HF names (``model.layers.{i}...``) so
    ``quant_schemes`` can plan a GGUF source re-quantized with ``--quantization``."""
    out: dict[str, tuple[int, ...]] = {}
    for t in tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in _HF_PROJECTIONS:
            out[f"model.layers.{parts[1]}.{_HF_PROJECTIONS[parts[2]]}.weight"] = t.dims
        else:
            out[t.name] = t.dims
    return out


def _tensor(t: object) -> GgufTensor:
    shape = [int(n) for n in t.shape]  # type: ignore[attr-defined]  # ggml order: cols first
    cols = shape[0]
    rows = 1
    for n in shape[1:]:
        rows *= n
    return GgufTensor(
        name=str(t.name),  # type: ignore[attr-defined]
        type_name=t.tensor_type.name,  # type: ignore[attr-defined]
        rows=rows,
        cols=cols,
        offset=int(t.data_offset),  # type: ignore[attr-defined]
        nbytes=int(t.n_bytes),  # type: ignore[attr-defined]
        dims=tuple(reversed(shape)),
    )
