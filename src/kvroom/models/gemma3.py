"""Gemma3 text: only what it does differently from the Llama-family decoder.

* four norms per layer: the attention and MLP outputs are normalised again before the
  residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``), and the MLP input
  uses ``pre_feedforward_layernorm``;
* RMSNorm scales by ``1 + w``: folded into the weights at load (``norm_offset``), so the kernel
  is the plain ``rms_norm``;
* the embedding is multiplied by ``sqrt(hidden)`` (rounded to the model dtype, as HF does);
* hybrid layers: sliding-window layers use ``rope_parameters["sliding_attention"]`` (local
  theta) and full layers ``rope_parameters["full_attention"]``; which layers keep a ring KV is
  decided by the metadata, as for every model;
* scores are scaled by ``query_pre_attn_scalar ** -0.5``; activation ``gelu_pytorch_tanh``;
  optional logit soft-capping (attention and final).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch

from kvroom.model_spec import ModelSpec
from kvroom.models.attention import KindBatch
from kvroom.models.decoder import DecoderLayer, DecoderModel, LayerConfig, meta_param
from kvroom.models.layers import matmul, mlp, rms_norm, rounded_scalar

_ROPE_KINDS = ("sliding_attention", "full_attention")


class Gemma3Layer(DecoderLayer):
    """Sandwich norms: ``h += post_norm(block(pre_norm(h)))`` for attention and MLP."""

    def __init__(self, cfg: LayerConfig, rope_kind: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, rope_kind, dtype)
        self.post_attn_norm = meta_param(cfg.hidden, dtype=dtype)
        self.post_mlp_norm = meta_param(cfg.hidden, dtype=dtype)

    def forward(
        self, h: torch.Tensor, cis: torch.Tensor, cache: torch.Tensor, batch: KindBatch
    ) -> None:
        eps = self.eps
        attn = matmul(self.attention(rms_norm(h, eps), cis, cache, batch), self.o_proj)
        h.add_(rms_norm(attn, eps, self.post_attn_norm))
        mlp_out = mlp(rms_norm(h, eps), self.gate_up, self.down, self.cfg.act)
        h.add_(rms_norm(mlp_out, eps, self.post_mlp_norm))


class Gemma3Model(DecoderModel):
    layer_cls: ClassVar[type[DecoderLayer]] = Gemma3Layer
    norm_offset: ClassVar[float] = 1.0
    hf_layer_names: ClassVar[dict[str, tuple[str, ...]]] = {
        **DecoderModel.hf_layer_names,
        "post_attn_norm": ("post_attention_layernorm.weight",),
        "post_mlp_norm": ("post_feedforward_layernorm.weight",),
    }
    hf_folded_norms: ClassVar[dict[str, str]] = {
        "qkv": "input_layernorm.weight",
        "gate_up": "pre_feedforward_layernorm.weight",
    }

    def __init__(
        self, spec: ModelSpec, hf_config: Any, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__(spec, hf_config, dtype, device)
        self.embed_scale = rounded_scalar(spec.hidden_size**0.5, dtype)

    def _layer_config(self) -> LayerConfig:
        scale = float(self.hf_config.query_pre_attn_scalar) ** -0.5
        return replace(super()._layer_config(), scale=scale)

    def _rope_kinds(self) -> tuple[str | None, ...]:
        return _ROPE_KINDS

    def _rope_kind_of(self, layer: int) -> int:
        return _ROPE_KINDS.index(self.spec.layer_types[layer])

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids).mul_(self.embed_scale)
