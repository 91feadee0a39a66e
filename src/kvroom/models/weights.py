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

A GGUF artifact (``model.gguf``) keeps its quantized tensors as shipped: ``qkv``/``gate_up``
fuse their parts' rows (``quant.fuse``), the q/k head permutation moves whole rows, and the
folded norm becomes the weight's ``input_scale`` (lossless, unlike scaling its columns). The LM
head stays quantized too: a tied model looks its embedding rows up in the head's table, and
where the native kernels run, the head's product streams it at its quantized size
(``quant/panels.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvroom import heap
from kvroom.artifact.layout import GGUF_WEIGHTS
from kvroom.errors import ModelSourceError
from kvroom.models.checkpoint import Checkpoint
from kvroom.models.decoder import DecoderModel
from kvroom.models.layers import rope_permutation
from kvroom.models.quant import QuantizedLinear
from kvroom.models.quant.fuse import concat_rows
from kvroom.models.quant.gguf_checkpoint import GgufCheckpoint
from kvroom.models.quant.quantize import quantize
from kvroom.quant_schemes import SCHEMES

AnyCheckpoint = Checkpoint | GgufCheckpoint
QUANTIZED_PARAMS = ("qkv", "o_proj", "gate_up", "down", "embed", "lm_head")
"""Parameters kept in the quantized layout when their source tensors are quantized."""


def load_weights(model: DecoderModel, folder: str | Path, quantization: str | None = None) -> None:
    """Fill ``model`` (built on meta) from the HF safetensors in ``folder``, then ``post_load``.

    ``quantization`` (``int8``, ``int4``, ``int4-g128``: ``kvroom.quant_schemes``) quantizes
    each projection of a full-precision checkpoint as it is read; None or ``none`` keeps it.

    The load's resident peak is its end state: tensors are read into memory of their own
    (``Checkpoint``, no file mapping), and under ``heap.loading()`` every transient copy
    (fusing, folding, the dense weight a packed one replaces) is returned when freed.

    Raises:
        ModelSourceError: no safetensors, or a tensor the architecture needs is missing.
    """
    with heap.loading():
        with open_checkpoint(model, Path(folder)) as ckpt:
            custom = getattr(model, "load_tensor", None)  # a model whose layers differ in shape
            scheme = quantization if quantization in SCHEMES else None
            if custom and scheme:
                raise ModelSourceError(
                    f"{model.spec.architecture}: --quantization {scheme} runs on the "
                    "Llama-family decoder only"
                )
            state: dict[str, torch.Tensor] = {}
            for name in model.state_dict():
                value = custom(ckpt.get, name) if custom else _load_one(model, ckpt, name, scheme)
                state.update(_entries(model, name, value))
        model.load_state_dict(state, strict=True, assign=True)
        del state  # post_load frees the dense weights it packs only once nothing else holds them
        model.requires_grad_(False)
        load_extra = getattr(model, "load_extra", None)  # modules outside the decoder (vision)
        if load_extra is not None:
            load_extra(Path(folder))
        model.post_load()


def open_checkpoint(model: DecoderModel, folder: Path) -> AnyCheckpoint:
    """The artifact's weights: ``model.gguf`` (kept as shipped) or HF safetensors.

    Raises:
        ModelSourceError: a GGUF artifact for a model whose layers load their own way.
    """
    path = folder / GGUF_WEIGHTS
    if not path.is_file():
        return Checkpoint(folder, model.device)
    if hasattr(model, "load_tensor"):
        raise ModelSourceError(
            f"{model.spec.architecture}: GGUF weights are kept as shipped only for the "
            "Llama-family decoder; compile with --dequantize"
        )
    spec = model.spec
    return GgufCheckpoint(path, model.device, spec.num_heads, spec.num_kv_heads)


def _entries(
    model: torch.nn.Module, name: str, value: torch.Tensor | QuantizedLinear
) -> dict[str, torch.Tensor]:
    """State-dict entries of one loaded parameter; a quantized one is installed first, as a
    submodule in the parameter's place, and contributes its buffers."""
    if not isinstance(value, QuantizedLinear):
        return {name: value}
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if hasattr(owner, attr):
        delattr(owner, attr)
    setattr(owner, attr, value)
    return {f"{name}.{k}": v for k, v in value.state_dict().items()}


def _load_one(
    model: DecoderModel, ckpt: AnyCheckpoint, name: str, scheme: str | None = None
) -> torch.Tensor | QuantizedLinear:
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
    if any(isinstance(p, QuantizedLinear) for p in parts):
        if param in QUANTIZED_PARAMS and all(isinstance(p, QuantizedLinear) for p in parts):
            return _load_quantized(model, ckpt, param, prefix, parts)
        parts = [p.dequantize() if isinstance(p, QuantizedLinear) else p for p in parts]
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
    if scheme is not None and param in _PROJECTIONS:
        return quantize(tensor, scheme)
    tensor = tensor.to(model.dtype).contiguous()
    return tensor.t() if param in _TRANSPOSED else tensor


def _load_quantized(
    model: DecoderModel, ckpt: AnyCheckpoint, param: str, prefix: str, parts: list
) -> QuantizedLinear:
    """``_load_one`` for quantized parts: rows permuted and fused, the norm as input scale."""
    if param == "qkv":
        q, k, v = parts
        parts = [_permuted_rows(q, model.spec.head_dim), _permuted_rows(k, model.spec.head_dim), v]
    weight = parts[0] if len(parts) == 1 else concat_rows(parts)
    if param in model.hf_folded_norms:
        norm = ckpt.get(prefix + model.hf_folded_norms[param])
        weight = weight.with_input_scale(_norm_weight(model, norm))
    return weight


def _permuted_rows(w: QuantizedLinear, head_dim: int) -> QuantizedLinear:
    """``_permute_heads`` on a quantized weight: whole rows move, values untouched."""
    rows = torch.arange(w.out_features).reshape(-1, head_dim)
    return w.take_rows(rows[:, rope_permutation(head_dim)].reshape(-1))


_PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
"""What ``--quantization int8|int4`` quantizes (``kvroom.quant_schemes``)."""

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
