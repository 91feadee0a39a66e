"""Gemma 4 text (``Gemma4ForCausalLM`` and the decoder of ``Gemma4ForConditionalGeneration``).

What it does beyond Gemma 3 (``transformers/models/gemma4/modeling_gemma4.py``):

* per-layer KV shapes (``ModelSpec.layer_kv``): full-attention layers use ``global_head_dim``
  and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` and one projection as K and V
  (stored once, ``kv_layouts.k_eq_v_attention``); the last ``num_kv_shared_layers`` layers
  attend over an earlier layer's KV and own none;
* q, k and v are RMS-normalised per head (v without weight); scores are not scaled (1.0);
* RMSNorm scales by ``w`` (not ``1 + w``); four norms per layer as in Gemma 3;
* per-layer input embeddings (PLE): a ``[vocab, layers x P]`` table looked up once per step,
  mixed with a projection of the embeddings, and fed to every layer through a gated
  ``P``-wide bottleneck; ``layer_scalar`` scales each layer's output;
* proportional rotary on full layers (``partial_rotary_factor``: the unrotated pairs have
  frequency 0, so the same complex multiply applies);
* an optional MoE block beside the dense MLP (``enable_moe_block``: router, top-k experts);
* final logit soft-capping (``DecoderModel.compute_logits``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvroom.errors import ModelSourceError
from kvroom.model_spec import LayerKV, ModelSpec
from kvroom.models.attention import AttentionMetadata, KindBatch, paged_attention
from kvroom.models.decoder import DecoderModel, _install, meta_param
from kvroom.models.gemma4_moe import Gemma4MoE
from kvroom.models.kv_layouts import k_eq_v_attention, store_ring_write, without_ring_write
from kvroom.models.layers import (
    apply_rope_,
    is_packed,
    matmul,
    mlp,
    prepare_weight,
    rms_norm,
    rope_cis,
    rounded_scalar,
)

_ROPE_KINDS = ("sliding_attention", "full_attention")


class _Step:
    """State one forward shares between layers: K/V that consumer layers read, deferred ring
    writes, and the key rotations of K=V layers."""

    def __init__(self, full_rope: tuple[torch.Tensor, float] | None, device: torch.device) -> None:
        self.kv: dict[int, torch.Tensor] = {}
        self.deferred: list[tuple[torch.Tensor, KindBatch, torch.Tensor]] = []
        self._full_rope, self._device = full_rope, device
        self._key_cis: torch.Tensor | None = None

    def key_cis(self, num_keys: int) -> torch.Tensor:
        """Rotations of positions ``0 .. n-1`` (n >= num_keys) of the full-attention rope,
        computed once per step for the longest gather."""
        if self._key_cis is None or self._key_cis.shape[0] < num_keys:
            assert self._full_rope is not None, "K=V layers are full-attention layers"
            pos = torch.arange(num_keys, device=self._device)
            self._key_cis = rope_cis(pos, *self._full_rope)
        return self._key_cis


class Gemma4Layer(nn.Module):
    """One decoder layer; its projections and norms are named as ``Gemma4Model.load_tensor``
    reads them."""

    projections: ClassVar[tuple[str, ...]] = (
        "qkv",
        "o_proj",
        "gate_up",
        "down",
        "ple_gate",
        "ple_proj",
    )

    def __init__(
        self, c: Any, index: int, kv: LayerKV, has_consumers: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.index, self.kv = index, kv
        self.has_consumers = has_consumers
        self.rope_kind = _ROPE_KINDS.index(c.layer_types[index])
        h, d, nq, nkv = c.hidden_size, kv.head_dim, c.num_attention_heads, kv.num_kv_heads
        self.num_heads, self.n_q = nq, nq * d
        self.num_k_proj = 0 if kv.kv_source is not None else nkv * kv.num_entries
        self.qkv = meta_param(h, (nq * d) + self.num_k_proj * d, dtype=dtype)
        self.q_norm = meta_param(d, dtype=dtype)
        self.k_norm = meta_param(d, dtype=dtype) if kv.kv_source is None or kv.k_eq_v else None
        self.o_proj = meta_param(nq * d, h, dtype=dtype)
        self.post_attn_norm = meta_param(h, dtype=dtype)
        wide = 2 if c.use_double_wide_mlp and kv.kv_source is not None else 1
        inter = c.intermediate_size * wide
        self.gate_up = meta_param(h, 2 * inter, dtype=dtype)
        self.down = meta_param(inter, h, dtype=dtype)
        self.post_mlp_norm = meta_param(h, dtype=dtype)
        p = c.hidden_size_per_layer_input or 0
        self.ple_gate = meta_param(h, p, dtype=dtype) if p else None
        self.ple_proj = meta_param(p, h, dtype=dtype) if p else None
        self.ple_norm = meta_param(h, dtype=dtype) if p else None
        self.layer_scalar = meta_param(1, dtype=dtype)
        self.moe = Gemma4MoE(c, dtype) if c.enable_moe_block else None
        self.eps = torch.empty((), device="meta")
        self._qk_norm_weight: torch.Tensor | None = None

    def post_load(self, eps: torch.Tensor) -> None:
        self.eps = eps
        for name in self.projections:
            if getattr(self, name) is not None:
                _install(self, name, prepare_weight(getattr(self, name)))
        if self.k_norm is not None and not self.kv.k_eq_v:
            nkv = self.kv.num_kv_heads
            w = [self.q_norm.expand(self.num_heads, -1), self.k_norm.expand(nkv, -1)]
            self._qk_norm_weight = torch.cat(w)
        if self.moe is not None:
            self.moe.post_load(eps)

    def forward(
        self,
        h: torch.Tensor,
        cis: torch.Tensor,
        cache: torch.Tensor,
        batch: KindBatch,
        ple: torch.Tensor | None,
        step: _Step,
    ) -> None:
        eps = self.eps
        attn = matmul(self.attention(rms_norm(h, eps), cis, cache, batch, step), self.o_proj)
        h.add_(rms_norm(attn, eps, self.post_attn_norm))
        mlp_out = mlp(rms_norm(h, eps), self.gate_up, self.down, "gelu_tanh")
        if self.moe is not None:
            mlp_out = self.moe(h, mlp_out)
        h.add_(rms_norm(mlp_out, eps, self.post_mlp_norm))
        if ple is not None:
            gate = F.gelu(matmul(h, self.ple_gate), approximate="tanh").mul_(ple[:, self.index])
            h.add_(rms_norm(matmul(gate, self.ple_proj), eps, self.ple_norm))
        h.mul_(self.layer_scalar)

    def attention(
        self, x: torch.Tensor, cis: torch.Tensor, cache: torch.Tensor, batch: KindBatch, step: _Step
    ) -> torch.Tensor:
        """Row layout of the fused projection (one token)::

        own KV:    [ q: heads x D | k: kv_heads x D | v: kv_heads x D ]
        K=V:       [ q: heads x D | k (= v): kv_heads x D ]
        consumer:  [ q: heads x D ]
        """
        kv, d = self.kv, self.kv.head_dim
        qkv = matmul(x, self.qkv)
        t = qkv.shape[0]
        if kv.kv_source is not None or kv.k_eq_v:
            q = qkv[:, : self.n_q].view(t, self.num_heads, d)
            q.copy_(rms_norm(q, self.eps, self.q_norm))
            apply_rope_(q, cis)
        if kv.k_eq_v:
            v = None
            if kv.kv_source is None:
                v = rms_norm(qkv[:, self.n_q :].view(t, kv.num_kv_heads, d), self.eps)
            return k_eq_v_attention(q, v, cache, batch, self.k_norm, step.key_cis, 1.0)
        if kv.kv_source is not None:
            return paged_attention(q, step.kv[kv.kv_source], cache, without_ring_write(batch), 1.0)
        nkv = kv.num_kv_heads
        qk = qkv[:, : self.n_q + nkv * d].view(t, self.num_heads + nkv, d)
        qk.copy_(rms_norm(qk, self.eps, self._qk_norm_weight))
        apply_rope_(qk, cis)
        v = qkv[:, self.n_q + nkv * d :].view(t, nkv, d)
        v.copy_(rms_norm(v, self.eps))
        step_kv = qkv[:, self.n_q :].view(t, 2, nkv, d)
        if not self.has_consumers:
            return paged_attention(qk[:, : self.num_heads], step_kv, cache, batch, 1.0)
        step.kv[self.index] = step_kv
        if batch.sliding and batch.prefill is not None:
            step.deferred.append((cache, batch, step_kv))
        nowrite = without_ring_write(batch)
        return paged_attention(qk[:, : self.num_heads], step_kv, cache, nowrite, 1.0)


class Gemma4Model(DecoderModel):
    """Embedding (+ PLE) -> Gemma 4 layers -> final norm -> tied LM head (soft-capped)."""

    norm_offset: ClassVar[float] = 0.0

    def __init__(
        self, spec: ModelSpec, hf_config: Any, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        nn.Module.__init__(self)
        c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        if getattr(c, "use_bidirectional_attention", None) == "all":
            raise ModelSourceError("use_bidirectional_attention='all' is not supported")
        self.spec, self.hf_config, self.text_config = spec, hf_config, c
        self.dtype, self.device = dtype, torch.device(device)
        multimodal = spec.architecture == "Gemma4ForConditionalGeneration"
        self.hf_prefix = "model.language_model." if multimodal else "model."
        """Prefix of the decoder's tensors in the checkpoint."""
        self.eps_value = float(c.rms_norm_eps)
        self.final_softcap = c.final_logit_softcapping
        v, h = spec.vocab_size, spec.hidden_size
        self.embed = None
        self.final_norm = meta_param(h, dtype=dtype)
        self.lm_head = meta_param(h, v, dtype=dtype)
        sources = {kv.kv_source for kv in spec.layer_kv if kv.kv_source is not None}
        self.layers = nn.ModuleList(
            Gemma4Layer(c, i, kv, i in sources, dtype) for i, kv in enumerate(spec.layer_kv)
        )
        p = c.hidden_size_per_layer_input or 0
        self.ple_dim = p
        n = spec.num_layers
        self.ple_table = meta_param(c.vocab_size_per_layer_input, n * p, dtype=dtype) if p else None
        self.ple_model_proj = meta_param(h, n * p, dtype=dtype) if p else None
        self.ple_proj_norm = meta_param(p, dtype=dtype) if p else None
        self.embed_scale = rounded_scalar(h**0.5, dtype)
        self.ple_scale = rounded_scalar(p**0.5, dtype) if p else 1.0
        self.eps = torch.empty((), device="meta")
        self._rope: dict[int, tuple[torch.Tensor, float]] = {}

    def load_tensor(self, get: Any, name: str) -> torch.Tensor:
        """The kvroom parameter ``name`` from the checkpoint (``get(hf_name)``), unprepared."""
        from kvroom.models.gemma4_weights import load_tensor

        return load_tensor(self, get, name)

    def post_load(self) -> None:
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

        self.device = self.lm_head.device
        head = prepare_weight(self.lm_head)
        if is_packed(head):
            self.embed = nn.Parameter(self.lm_head.t().contiguous(), requires_grad=False)
        _install(self, "lm_head", head)
        if self.ple_model_proj is not None:
            _install(self, "ple_model_proj", prepare_weight(self.ple_model_proj))
        self.eps = torch.tensor(self.eps_value, dtype=torch.float32, device=self.device)
        rotary = Gemma4TextRotaryEmbedding(self.text_config)  # per-type head dims, as HF has them
        self._rope = {
            i: (
                getattr(rotary, f"{kind}_inv_freq").float().to(self.device),
                float(getattr(rotary, f"{kind}_attention_scaling")),
            )
            for i, kind in enumerate(_ROPE_KINDS)
            if kind in self.text_config.layer_types
        }
        for layer in self.layers:
            layer.post_load(self.eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """PLE ``[T, layers, P]``:
        ``(norm(embeds @ W * hidden^-0.5) + table[ids] * sqrt(P)) / sqrt(2)``.

        One lookup and one projection per step for all layers, outside the layer loop.
        """
        t, n, p = input_ids.shape[0], self.spec.num_layers, self.ple_dim
        tokens = F.embedding(input_ids, self.ple_table).mul_(self.ple_scale).view(t, n, p)
        proj = matmul(embeds, self.ple_model_proj) * self.spec.hidden_size**-0.5
        proj = rms_norm(proj.view(t, n, p), self.eps, self.ple_proj_norm)
        return (proj + tokens) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (before the final norm); see ``DecoderModel.forward``."""
        h = self.embed_tokens(input_ids).mul_(self.embed_scale)
        ple = self.per_layer_inputs(input_ids, h) if self.ple_table is not None else None
        cis = {k: rope_cis(positions, f, s) for k, (f, s) in self._rope.items()}
        step = _Step(self._rope.get(1), self.device)
        for layer, cache, batch in zip(self.layers, kv_caches, meta.layers, strict=True):
            layer(h, cis[layer.rope_kind], cache, batch, ple, step)
        for cache, batch, kv in step.deferred:
            assert batch.prefill is not None
            store_ring_write(cache, batch.prefill, kv, batch.kv_codec)
        return h
