"""A decode step through every decoder layer in one native call (``kernels/decode_layers.h``).

At one sequence a 135M model's step is as much Python as arithmetic: about ten dispatched ops
per layer (two norms, four projections, the rotary, the cache write, attention) at 10-30 us
each, against a few milliseconds of GEMM for all 30 layers. ``FusedDecode`` runs those same
kernels, in the same order, from C: same results, without the dispatches.

It applies where every piece has its native kernel: plain ``DecoderLayer`` s (Llama, Mistral,
Qwen2/3 without q/k norms or softcaps, SiLU), projections in native panels (quantized, or
float panels of the activations' dtype), a CPU decode kernel for the head dim, and a step of
decode rows only over full-attention pools: float, or int8/int4 rows, whose key shift,
rotation and quantization run the same native functions ``kv_quant`` calls
(``kernels/kv_write.h``). Anything else (prefill rows, sliding layers, other models) runs the
layers from Python. ``KVROOM_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from kvroom.models import kv_quant
from kvroom.models.attention import AttentionMetadata, KindBatch
from kvroom.models.kernels import ops as native
from kvroom.models.kernels.build import library
from kvroom.models.quant.panels import QuantPanels

PROJECTION_FIELDS = 8
"""kind, weight, scales, mins, bits, group, float16 scales, input scale (``decode_layers.h``)."""
LAYER_FIELDS = 4 * PROJECTION_FIELDS + 3
"""qkv, o_proj, gate_up, down, then the qkv and o_proj biases, then the key shift."""
KEY_SHIFT_FIELD = 4 * PROJECTION_FIELDS + 2
QUANT, PANELS = 0, 1
"""Projection kinds: quantized panels; float panels of the activations' dtype."""
MAX_ROWS = 256
"""Rows up to which a step runs fused (the Python MLP splits larger steps into passes)."""
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class FusedDecode:
    """The native whole-step decode of one model: its layers' weights as descriptors."""

    def __init__(
        self,
        layers: Sequence[Any],
        dtype: torch.dtype,
        descriptors: torch.Tensor,
        keep: list[torch.Tensor],
    ) -> None:
        cfg = layers[0].cfg
        self.cfg = cfg
        self.dtype = dtype
        self.eps = layers[0].eps_value
        self.descriptors = descriptors
        self._keep = keep  # fp32 biases and input scales the descriptors point into
        self._key_shifts: list[torch.Tensor] = []
        self._work = torch.empty(0, dtype=torch.float32)

    @classmethod
    def of(cls, layers: Sequence[Any], dtype: torch.dtype) -> FusedDecode | None:
        """The fused step of ``layers`` (plain ``DecoderLayer`` s, not a subclass with its own
        forward, after ``post_load``), or None where it does not apply to this model."""
        lib = library()
        if os.environ.get("KVROOM_FUSED_DECODE", "1") == "0" or lib is None:
            return None
        if dtype not in _DTYPES or not layers or not _plain_layers(layers):
            return None
        keep: list[torch.Tensor] = []
        rows = [_layer_fields(layer, dtype, keep) for layer in layers]
        if any(row is None for row in rows):
            return None
        return cls(layers, dtype, torch.tensor(rows, dtype=torch.int64), keep)

    def set_key_shifts(self, shifts: Sequence[torch.Tensor | None]) -> None:
        """Each layer's key shift (``[kv_heads, D]``, or None), subtracted from its keys as
        ``kv_quant.shift_keys`` does: in the activations' dtype."""
        self._key_shifts = []
        for i, shift in enumerate(shifts):
            pointer = 0
            if shift is not None:
                kept = shift.detach().to(self.dtype).float().contiguous()
                self._key_shifts.append(kept)
                pointer = kept.data_ptr()
            self.descriptors[i, KEY_SHIFT_FIELD] = pointer

    def run(
        self,
        h: torch.Tensor,
        cis: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        meta: AttentionMetadata,
    ) -> bool:
        """Run every layer over ``h`` (``[B, hidden]``, updated in place) and store this step's
        K/V; False, having done nothing, where the step is not a plain decode step."""
        batch = _decode_batch(meta, h.shape[0])
        if batch is None or not self._pools_apply(h, kv_caches, batch):
            return False
        lib = library()
        assert lib is not None and batch.decode is not None and batch.decode.lens is not None
        c, b = self.cfg, h.shape[0]
        caches = torch.tensor([t.data_ptr() for t in kv_caches], dtype=torch.int64)
        rotations = torch.view_as_real(cis).contiguous()  # [B, 1, D/2, 2]: cos, sin
        tables, codec = batch.decode.kv_index, batch.kv_codec
        kv_dtype = _DTYPES[kv_caches[0].dtype] if codec is None else codec.bits
        block = kv_quant.rotation_block(c.head_dim) if codec is not None and codec.rotate else None
        rc = lib.kvroom_decode_layers(
            self.descriptors.data_ptr(), len(kv_caches), caches.data_ptr(), kv_dtype,
            h.data_ptr(), _DTYPES[h.dtype], rotations.data_ptr(), tables.data_ptr(),
            tables.stride(0), batch.decode.lens.data_ptr(), batch.write_index.data_ptr(), b,
            c.hidden, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate,
            kv_caches[0].shape[1], c.scale, self.eps, self._work_for(b).data_ptr(),
            native.SERIAL_MAX_ITEMS, native.serial_rows(c.hidden), block or 0,
        )  # fmt: skip
        assert rc == 0, f"kvroom_decode_layers returned {rc}"
        return True

    def _pools_apply(
        self, h: torch.Tensor, kv_caches: Sequence[torch.Tensor], batch: KindBatch
    ) -> bool:
        c = self.cfg
        first, codec = kv_caches[0], batch.kv_codec
        if codec is None:
            kv = _DTYPES.get(first.dtype)
            entry = c.head_dim
            pools = kv is not None and not (h.dtype == torch.bfloat16 and kv == 0)
        else:
            entry = codec.row_bytes(c.head_dim)
            pools = first.dtype == torch.uint8 and c.head_dim % 16 == 0
        return (
            pools
            and h.dtype == self.dtype
            and h.is_contiguous()
            and len(kv_caches) == self.descriptors.shape[0]
            and all(t.dtype == first.dtype and t.is_contiguous() for t in kv_caches)
            and tuple(first.shape[2:]) == (2, c.num_kv_heads, entry)
        )

    def _work_for(self, rows: int) -> torch.Tensor:
        """Scratch for ``rows`` rows: one buffer, grown to the largest step seen (its layout is
        per row, so a larger one serves a smaller step)."""
        lib = library()
        assert lib is not None
        c = self.cfg
        floats = lib.kvroom_decode_layers_work(
            rows, c.hidden, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate
        )
        if self._work.numel() < floats:
            self._work = torch.empty(floats, dtype=torch.float32)
        return self._work


def _plain_layers(layers: Sequence[Any]) -> bool:
    """Layers of one config and one rope kind, no q/k norm, no softcap, SiLU, a head dim the
    decode kernel vectorizes (the caller checks they are plain ``DecoderLayer`` s)."""
    cfg = layers[0].cfg
    return (
        all(layer.cfg == cfg for layer in layers)
        and all(layer.rope_kind == 0 for layer in layers)
        and not cfg.qk_norm
        and cfg.attn_softcap is None
        and cfg.act == "silu"
        and cfg.num_heads % cfg.num_kv_heads == 0
        and native.decode_vectorized(cfg.head_dim)
    )


def _decode_batch(meta: AttentionMetadata, rows: int) -> KindBatch | None:
    """The step's one batch where it is decode rows only, over full-attention pools, the same
    for every layer; else None."""
    batch = meta.layers[0]
    d = batch.decode
    if (
        rows > MAX_ROWS
        or batch.sliding
        or batch.prefill is not None
        or d is None
        or d.lens is None
        or d.num_seqs != rows
        or any(b is not batch for b in meta.layers)
    ):
        return None
    return batch


def _layer_fields(layer: Any, dtype: torch.dtype, keep: list[torch.Tensor]) -> list[int] | None:
    c = layer.cfg
    q_n, qkv_n = c.num_heads * c.head_dim, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    shapes = {
        "qkv": (c.hidden, qkv_n),
        "o_proj": (q_n, c.hidden),
        "gate_up": (c.hidden, 2 * c.intermediate),
        "down": (c.intermediate, c.hidden),
    }
    fields: list[int] = []
    for name, (k, n) in shapes.items():
        projection = _projection_fields(getattr(layer, name), dtype, k, n, keep)
        if projection is None or (name == "gate_up" and not _splits_glu(getattr(layer, name))):
            return None
        fields += projection
    for bias in (layer.qkv_bias, layer.o_bias):
        fields.append(_kept(bias, keep))
    return [*fields, 0]  # no key shift until ``set_key_shifts``


def _projection_fields(
    w: Any, dtype: torch.dtype, k: int, n: int, keep: list[torch.Tensor]
) -> list[int] | None:
    if isinstance(w, QuantPanels):
        if (w.in_features, w.out_features) != (k, n):
            return None
        q, scales, mins, bits, group, half = w._weight_args
        return [QUANT, q, scales, mins, bits, group, int(half), _kept(w.input_scale, keep)]
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or tuple(w.shape) != (n // 32, k, 32):
        return None
    if w.dtype != dtype:
        return None
    return [PANELS, w.data_ptr(), 0, 0, 0, 0, 0, 0]


def _splits_glu(w: Any) -> bool:
    """gate_up's panels split into gate and up panels (the GLU kernels' condition)."""
    if isinstance(w, QuantPanels):
        return w.fuses_glu()
    return w.shape[0] % 2 == 0


def _kept(t: torch.Tensor | None, keep: list[torch.Tensor]) -> int:
    """A float32 contiguous copy of ``t`` kept alive, as a pointer; 0 for None."""
    if t is None:
        return 0
    t = t.detach().float().contiguous()
    keep.append(t)
    return t.data_ptr()
