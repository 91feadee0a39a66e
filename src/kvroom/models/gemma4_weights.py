"""Gemma 4 checkpoint names -> ``Gemma4Model`` parameters (the load-time transforms of
``weights.py``, per layer, since head dims and projections differ between layers).

* ``qkv`` = [q | k | v] rows (K=V layers: [q | k]; KV consumers: [q]), q and k rows permuted
  per head to the interleaved rotary layout, ``input_layernorm`` folded into the columns;
* a K=V layer stores its permuted k as V, so its attention output comes out permuted per
  head too: the input columns of ``o_proj`` are permuted the same way (for its consumers too);
* a K=V consumer rebuilds keys with its source's ``k_norm`` weight;
* ``gate_up`` = [gate | up] rows with ``pre_feedforward_layernorm`` folded in;
* projections returned as ``[in, out]`` views; MoE experts keep transformers' layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvroom.models.weights import _permute_heads

Get = Callable[[str], torch.Tensor]

_LAYER_NAMES: dict[str, str] = {
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
    "ple_norm": "post_per_layer_input_norm.weight",
    "layer_scalar": "layer_scalar",
    "ple_gate": "per_layer_input_gate.weight",
    "ple_proj": "per_layer_projection.weight",
    "down": "mlp.down_proj.weight",
    "moe.router_scale": "router.scale",
    "moe.router": "router.proj.weight",
    "moe.expert_scale": "router.per_expert_scale",
    "moe.gate_up": "experts.gate_up_proj",
    "moe.down": "experts.down_proj",
    "moe.pre_norm": "pre_feedforward_layernorm_2.weight",
    "moe.post_norm_1": "post_feedforward_layernorm_1.weight",
    "moe.post_norm_2": "post_feedforward_layernorm_2.weight",
}
"""kvroom layer parameter -> HF tensor under ``layers.{i}.`` (no transform but the transpose)."""

_TRANSPOSED = ("qkv", "o_proj", "gate_up", "down", "ple_gate", "ple_proj", "moe.router")


def load_tensor(model: Any, get: Get, name: str) -> torch.Tensor:
    """``name`` of ``model.state_dict()`` read through ``get(hf_name)``, in the model dtype,
    owning its bytes."""
    p = model.hf_prefix
    if name.startswith("layers."):
        _, index, param = name.split(".", 2)
        tensor = _layer_tensor(model, get, int(index), param)
    else:
        top = {
            "final_norm": "norm.weight",
            "lm_head": "embed_tokens.weight" if model.spec.tie_embeddings else None,
            "ple_table": "embed_tokens_per_layer.weight",
            "ple_model_proj": "per_layer_model_projection.weight",
            "ple_proj_norm": "per_layer_projection_norm.weight",
        }[name]
        tensor = get(p + top) if top is not None else get("lm_head.weight")
        param = name
    out = tensor.to(model.dtype).contiguous().clone()
    return out.t() if param in (*_TRANSPOSED, "lm_head", "ple_model_proj") else out


def _layer_tensor(model: Any, get: Get, i: int, param: str) -> torch.Tensor:
    kv = model.spec.layer_kv[i]
    d = kv.head_dim
    prefix = f"{model.hf_prefix}layers.{i}."
    if param in _LAYER_NAMES:
        return get(prefix + _LAYER_NAMES[param])
    if param == "qkv":
        parts = [_permute_heads(get(prefix + "self_attn.q_proj.weight"), d)]
        if kv.kv_source is None:
            parts.append(_permute_heads(get(prefix + "self_attn.k_proj.weight"), d))
            if not kv.k_eq_v:
                parts.append(get(prefix + "self_attn.v_proj.weight"))
        norm = get(prefix + "input_layernorm.weight").float()
        return torch.cat(parts).float() * norm
    if param in ("q_norm", "k_norm"):
        owner = i if param == "q_norm" or kv.kv_source is None else kv.kv_source
        source = f"{model.hf_prefix}layers.{owner}.self_attn.{param}.weight"
        return _permute_heads(get(source), d)
    if param == "o_proj":
        w = get(prefix + "self_attn.o_proj.weight")
        if kv.k_eq_v:  # columns follow V's (permuted) head layout
            return _permute_heads(w.t(), d).t()
        return w
    if param == "gate_up":
        gate_up = torch.cat(
            [get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")]
        )
        return gate_up.float() * get(prefix + "pre_feedforward_layernorm.weight").float()
    raise KeyError(f"no Gemma 4 checkpoint tensor for layer parameter {param!r}")
