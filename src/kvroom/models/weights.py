"""Load HF-named safetensors into a model built on the ``meta`` device.

The checkpoint keeps HF names; the model's parameters are fewer and fused. For each kvroom
parameter the model class names the HF tensors it is made of (``hf_layer_names``); this module
reads them, applies the load-time transforms, and hands the result to
``load_state_dict(strict=True, assign=True)``:

* ``qkv`` = cat(q, k, v) rows and ``gate_up`` = cat(gate, up) rows (one matmul each);
* q/k rows (and q/k norm weights) permuted per head to the interleaved rotary layout
  (``layers.rope_permutation``);
* RMSNorm weights plus ``norm_offset`` (gemma's ``1 + w``), computed in float32; the input
  norms of attention and MLP folded into the input columns of ``qkv`` / ``gate_up``;
* projections transposed to ``[in, out]``;
* cast to the model dtype, on the target device.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvroom import heap
from kvroom.models.checkpoint import Checkpoint
from kvroom.models.decoder import DecoderModel
from kvroom.models.layers import rope_permutation


def load_weights(model: DecoderModel, folder: str | Path) -> None:
    """Fill ``model`` (built on meta) from the HF safetensors in ``folder``, then ``post_load``.

    The load's resident peak is its end state: tensors are read into memory of their own
    (``Checkpoint``, no file mapping), and under ``heap.loading()`` every transient copy
    (fusing, folding, the dense weight a packed one replaces) is returned when freed.

    Raises:
        ModelSourceError: no safetensors, or a tensor the architecture needs is missing.
    """
    with heap.loading():
        with Checkpoint(Path(folder), model.device) as ckpt:
            custom = getattr(model, "load_tensor", None)  # a model whose layers differ in shape
            state = {
                name: custom(ckpt.get, name) if custom else _load_one(model, ckpt, name)
                for name in model.state_dict()
            }
        model.load_state_dict(state, strict=True, assign=True)
        del state  # post_load frees the dense weights it packs only once nothing else holds them
        model.requires_grad_(False)
        load_extra = getattr(model, "load_extra", None)  # modules outside the decoder (vision)
        if load_extra is not None:
            load_extra(Path(folder))
        model.post_load()


def _load_one(model: DecoderModel, ckpt: Checkpoint, name: str) -> torch.Tensor:
    """Read, fuse and transform the HF tensors behind one kvroom parameter.

    ``Checkpoint`` reads into fresh tensors (no file mapping), so the result owns its bytes,
    and loading never holds the file's pages resident next to the weights (with a mapped
    file it did: 527 MB of extra RSS for SmolLM2 fp32).
    """
    prefix, param = "", name
    if name.startswith("layers."):
        _, index, param = name.split(".", 2)
        prefix = f"{getattr(model, 'hf_decoder_prefix', 'model.')}layers.{index}."
        sources = [prefix + n for n in model.hf_layer_names[param]]
    else:
        sources = [model.hf_top_names()[name]]
    parts = [ckpt.get(s) for s in sources]
    head_dim = model.spec.head_dim
    if param in ("qkv", "qkv_bias"):
        q, k, v = parts
        parts = [_permute_heads(q, head_dim), _permute_heads(k, head_dim), v]
    elif param in ("q_norm", "k_norm"):
        parts = [_permute_heads(parts[0], head_dim)]
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
    if param.endswith("norm"):
        tensor = _norm_weight(model, tensor)
    if param in model.hf_folded_norms:
        tensor = tensor.float() * _norm_weight(
            model, ckpt.get(prefix + model.hf_folded_norms[param])
        )
    tensor = tensor.to(model.dtype).contiguous()
    return tensor.t() if param in _TRANSPOSED else tensor


_TRANSPOSED = ("qkv", "o_proj", "gate_up", "down", "lm_head")
"""Loaded as ``[in, out]`` views of HF's ``[out, in]`` rows; ``post_load`` gives each the form
``layers.matmul`` reads fastest (``layers.prepare_weight``), so no transpose is copied twice."""


def _norm_weight(model: DecoderModel, w: torch.Tensor) -> torch.Tensor:
    """The effective RMSNorm scale, in float32: ``w + norm_offset`` (``1 + w`` for gemma)."""
    return w.float() + model.norm_offset


def _permute_heads(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder the rows of every head from HF's half-split layout to the interleaved one."""
    rows = w.shape[0]
    perm = rope_permutation(head_dim).to(w.device)
    return w.reshape(rows // head_dim, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)
