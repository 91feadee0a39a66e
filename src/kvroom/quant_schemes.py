"""Weight-only quantization of full-precision checkpoints (``--quantization int8|int4|int4-g128``).

Torch-free: the schemes, which tensors they quantize, and the bytes those take once loaded, so
the plan counts them from safetensors headers. The quantizer is ``models/quant/quantize.py``;
its output is the layout of ``models/quant``.

    scheme      layout  group                 zero point     scales and mins
    int8        int8    the whole row         symmetric      float32, one per output channel
    int4        int4    32                    asymmetric     float16 (as GGUF's Q4_1)
    int4-g128   int4    128                   asymmetric     float16

Only the decoder's projections are quantized (q/k/v/o, gate/up/down), as HF's and vLLM's
weight-only schemes do; embeddings, the LM head and norms stay in the model dtype. The artifact
keeps the full-precision safetensors (transformers and vLLM load it as before) and kvroom
quantizes each projection as it loads it, so the resident weights are the quantized ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvroom.units import DTYPE_BYTES

PROJECTION_SUFFIXES = tuple(
    f"{part}_proj.weight" for part in ("q", "k", "v", "o", "gate", "up", "down")
)
"""HF tensor names (under a decoder layer) that a scheme quantizes."""


@dataclass(frozen=True)
class Scheme:
    """One weight-only scheme: layout kind, group size (None: the whole row), zero points."""

    kind: str
    group_size: int | None
    asymmetric: bool
    scale_bytes: int

    def group_of(self, cols: int) -> int:
        return cols if self.group_size is None else self.group_size

    def resident_bytes(self, rows: int, cols: int) -> int:
        """Values, scales and mins of a ``[rows, cols]`` weight."""
        values = rows * cols // 2 if self.kind == "int4" else rows * cols
        groups = rows * (cols // self.group_of(cols))
        return values + groups * self.scale_bytes * (2 if self.asymmetric else 1)


SCHEMES: dict[str, Scheme] = {
    "int8": Scheme("int8", None, False, 4),
    "int4": Scheme("int4", 32, True, 2),
    "int4-g128": Scheme("int4", 128, True, 2),
}


def is_projection(name: str) -> bool:
    """``name`` is a decoder projection's HF weight (what a scheme quantizes)."""
    return ".layers." in f".{name}" and name.endswith(PROJECTION_SUFFIXES)


def resident_bytes_by_type(
    shapes: dict[str, tuple[int, ...]], scheme_name: str, dtype: str
) -> dict[str, int]:
    """Bytes per kind of tensor once loaded with ``scheme_name`` (``{"int4 (int4)": ..}``).

    Args:
        shapes: HF tensor name -> shape, as the checkpoint's headers give them (a tied LM
            head already left out).
    """
    scheme = SCHEMES[scheme_name]
    width = DTYPE_BYTES[dtype]
    out: dict[str, int] = {}
    for name, shape in shapes.items():
        quantized = is_projection(name) and len(shape) == 2
        if quantized and shape[1] % scheme.group_of(shape[1]) == 0:
            key = f"{scheme.kind} ({scheme_name})"
            out[key] = out.get(key, 0) + scheme.resident_bytes(*shape)
        else:
            size = 1
            for n in shape:
                size *= n
            out[dtype] = out.get(dtype, 0) + size * width
    return out


def safetensors_shapes(files: list[Path], tied_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from safetensors headers (a tied ``lm_head.weight`` left out)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if not (tied_embeddings and key == "lm_head.weight"):
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes
