"""One parametrised Llama-family decoder: llama, mistral, qwen2 and qwen3.

The four differ only by flags, read once into ``LayerConfig``:

    ============  ==========  =======  ===========================
    family        qkv bias    qk norm  other
    ============  ==========  =======  ===========================
    llama         optional    no       o_proj bias with attn bias
    mistral       no          no       sliding window (all layers)
    qwen2         yes         no       per-layer sliding (layer_types)
    qwen3         optional    yes      RMSNorm per head of q and k
    ============  ==========  =======  ===========================

Sliding layers need no flag here: the layer kind (full or ring KV) comes with the step's
``AttentionMetadata``, because whether a window binds depends on the deployment's
``max_seq_len`` (``ModelSpec.layer_kinds``).

Parameters are created on the ``meta`` device and replaced by ``weights.load_weights``
(``load_state_dict(assign=True)``), so construction allocates nothing. Projections are fused at
load time: ``qkv`` = [q | k | v] and ``gate_up`` = [gate | up] output columns, one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kvroom.errors import ModelSourceError
from kvroom.model_spec import ModelSpec
from kvroom.models.attention import AttentionMetadata, KindBatch, paged_attention
from kvroom.models.fused_decode import FusedDecode
from kvroom.models.layers import (
    Quantized,
    add_mlp_,
    add_rms_norm,
    apply_rope_,
    embedding,
    is_packed,
    matmul,
    prepare_weight,
    rms_norm,
    rope_cis,
    rope_inv_freq,
    softcap_,
)

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class LayerConfig:
    """Shapes and flags of one decoder layer."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    act: str
    """``silu`` or ``gelu_tanh``."""
    scale: float
    """Attention score scale."""
    attn_softcap: float | None = None


def meta_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


class DecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP, updating the residual stream ``h`` in place.

    Projection weights are loaded ``[in, out]`` (``torch.mm(x, w)``): MKL's plain GEMM path
    streams a decode step's weights ~25% faster than ``F.linear``'s transposed one. On CPU
    ``post_load`` then swaps them for oneDNN-prepacked copies (``layers.prepare_weight``), which
    are faster again. The input norms' weights are folded into ``qkv`` and ``gate_up`` at load
    (``weights.py``).
    """

    projections: ClassVar[tuple[str, ...]] = ("qkv", "o_proj", "gate_up", "down")

    def __init__(self, cfg: LayerConfig, rope_kind: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope_kind = rope_kind
        """Index of this layer's rotary table in the model's per-step ``cis`` list."""
        h, d, nq, nkv = cfg.hidden, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.n_q, self.n_qk = nq * d, (nq + nkv) * d
        self.qkv = meta_param(h, (nq + 2 * nkv) * d, dtype=dtype)
        self.qkv_bias = meta_param((nq + 2 * nkv) * d, dtype=dtype) if cfg.qkv_bias else None
        self.q_norm = meta_param(d, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = meta_param(d, dtype=dtype) if cfg.qk_norm else None
        self.o_proj = meta_param(nq * d, h, dtype=dtype)
        self.o_bias = meta_param(h, dtype=dtype) if cfg.o_bias else None
        self.gate_up = meta_param(h, 2 * cfg.intermediate, dtype=dtype)
        self.down = meta_param(cfg.intermediate, h, dtype=dtype)
        self.eps = torch.empty((), device="meta")
        self.eps_value = 0.0
        self._qk_norm_weight: torch.Tensor | None = None
        self.key_shift: torch.Tensor | None = None
        """``[kv_heads, D]`` subtracted from every key an int4 pool stores (``kv_quant``, "Key
        shift"); set once by ``DecoderModel.set_key_shift``, None until then."""

    def post_load(self, eps: torch.Tensor) -> None:
        """Share the model's eps tensor; derive ``[heads + kv_heads, D]`` q/k norm weights so
        q and k normalise in one pass."""
        self.eps = eps
        self.eps_value = float(eps)
        for name in self.projections:
            _install(self, name, prepare_weight(getattr(self, name)))
        if self.q_norm is not None and self.k_norm is not None:
            c = self.cfg
            w = [self.q_norm.expand(c.num_heads, -1), self.k_norm.expand(c.num_kv_heads, -1)]
            self._qk_norm_weight = torch.cat(w)

    def forward(
        self, h: torch.Tensor, cis: torch.Tensor, cache: torch.Tensor, batch: KindBatch
    ) -> None:
        x = self.attention(add_rms_norm(h, None, self.eps, self.eps_value), cis, cache, batch)
        x = add_rms_norm(h, matmul(x, self.o_proj, self.o_bias), self.eps, self.eps_value)
        add_mlp_(h, x, self.gate_up, self.down, self.cfg.act)

    def attention(
        self, x: torch.Tensor, cis: torch.Tensor, cache: torch.Tensor, batch: KindBatch
    ) -> torch.Tensor:
        """qkv projection -> (qk norm) -> rotary in place -> paged attention (before o_proj).

        Row layout of the fused projection output (one token)::

            [ q: heads x D | k: kv_heads x D | v: kv_heads x D ]
             '---- qk: rotated together ----'
                           '--- kv: [2, kv_heads, D], stored by one index_copy_ ---'
        """
        c = self.cfg
        qkv = matmul(x, self.qkv, self.qkv_bias)
        t = qkv.shape[0]
        qk = qkv[:, : self.n_qk].view(t, c.num_heads + c.num_kv_heads, c.head_dim)
        if self._qk_norm_weight is not None:
            qk.copy_(rms_norm(qk, self.eps, self._qk_norm_weight))
        apply_rope_(qk, cis)
        kv = qkv[:, self.n_q :].view(t, 2, c.num_kv_heads, c.head_dim)
        q = qk[:, : c.num_heads]
        return paged_attention(q, kv, cache, batch, c.scale, c.attn_softcap, self.key_shift)


class DecoderModel(nn.Module):
    """Embedding -> N decoder layers -> final norm -> LM head (tied or not).

    A tied model loads one ``[hidden, vocab]`` matrix (``lm_head``); the embedding looks up
    its columns. Where ``post_load`` packs the head for oneDNN, the embedding keeps its own
    dense ``[vocab, hidden]`` copy (the profiling pass counts it as runtime memory).
    """

    layer_cls: ClassVar[type[DecoderLayer]] = DecoderLayer
    norm_offset: ClassVar[float] = 0.0
    """Added to every RMSNorm weight at load time (gemma stores ``w`` and scales by ``1 + w``)."""
    hf_layer_names: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "q_norm": ("self_attn.q_norm.weight",),
        "k_norm": ("self_attn.k_norm.weight",),
        "o_proj": ("self_attn.o_proj.weight",),
        "o_bias": ("self_attn.o_proj.bias",),
        "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "down": ("mlp.down_proj.weight",),
    }
    """kvroom parameter of a layer -> the HF tensors (under ``model.layers.{i}.``) it fuses."""
    hf_folded_norms: ClassVar[dict[str, str]] = {
        "qkv": "input_layernorm.weight",
        "gate_up": "post_attention_layernorm.weight",
    }
    """Projection -> the HF norm whose weight is folded into its input columns."""

    def __init__(
        self, spec: ModelSpec, hf_config: Any, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.spec = spec
        self.hf_config = hf_config
        self.dtype = dtype
        self.device = torch.device(device)
        self.eps_value = float(hf_config.rms_norm_eps)
        self.final_softcap: float | None = getattr(hf_config, "final_logit_softcapping", None)
        self.rope_kinds: tuple[str | None, ...] = self._rope_kinds()
        v, h = spec.vocab_size, spec.hidden_size
        self.embed = None if spec.tie_embeddings else meta_param(v, h, dtype=dtype)
        self.final_norm = meta_param(h, dtype=dtype)
        self.lm_head = meta_param(h, v, dtype=dtype)
        cfg = self._layer_config()
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, self._rope_kind_of(i), dtype) for i in range(spec.num_layers)
        )
        self.eps = torch.empty((), device="meta")
        self._rope: list[tuple[torch.Tensor, float]] = []
        self._fused: FusedDecode | None = None

    def hf_top_names(self) -> dict[str, str]:
        """Top-level kvroom parameter -> HF tensor (a tied head reads the embedding)."""
        head = "model.embed_tokens.weight" if self.spec.tie_embeddings else "lm_head.weight"
        return {
            "embed": "model.embed_tokens.weight",
            "final_norm": "model.norm.weight",
            "lm_head": head,
        }

    def _layer_config(self) -> LayerConfig:
        s, c = self.spec, self.hf_config
        act = getattr(c, "hidden_act", None) or getattr(c, "hidden_activation", None)
        if act not in _ACTIVATIONS:
            raise ModelSourceError(f"hidden activation {act!r} is not supported")
        if getattr(c, "mlp_bias", False):
            raise ModelSourceError("mlp_bias=True is not supported")
        return LayerConfig(
            hidden=s.hidden_size,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            intermediate=s.intermediate_size,
            qkv_bias=s.attention_bias,
            o_bias=s.attention_bias and s.model_type != "qwen2",
            qk_norm=s.qk_norm,
            act=_ACTIVATIONS[act],
            scale=s.head_dim**-0.5,
            attn_softcap=getattr(c, "attn_logit_softcapping", None),
        )

    def _rope_kinds(self) -> tuple[str | None, ...]:
        """Distinct rotary tables; ``None`` = the config's single ``rope_parameters``."""
        return (None,)

    def _rope_kind_of(self, layer: int) -> int:
        return 0

    def post_load(self) -> None:
        """Build what is derived from loaded weights or the config, on the weights' device."""
        self.device = self.lm_head.device
        head = prepare_weight(self.lm_head)
        if self.embed is None and is_packed(head) and not isinstance(head, Quantized):
            self.embed = nn.Parameter(self.lm_head.t().contiguous(), requires_grad=False)
        _install(self, "lm_head", head)
        self.eps = torch.tensor(self.eps_value, dtype=torch.float32, device=self.device)
        self._rope = []
        for kind in self.rope_kinds:
            inv_freq, scale = rope_inv_freq(self.hf_config, self.spec.head_dim, kind)
            self._rope.append((inv_freq.to(self.device), scale))
        for layer in self.layers:
            layer.post_load(self.eps)
        plain = all(type(layer) is DecoderLayer for layer in self.layers)
        self._fused = FusedDecode.of(self.layers, self.dtype) if plain else None

    def key_shift_layers(self) -> list[int]:
        """Layers that can take a key shift: ``DecoderLayer`` attention without a soft-cap (a
        soft-cap is not invariant to the shift; other layer classes do not take one)."""
        return [
            i
            for i, layer in enumerate(self.layers)
            if isinstance(layer, DecoderLayer) and layer.cfg.attn_softcap is None
        ]

    def set_key_shift(self, shift: torch.Tensor) -> None:
        """Give each of ``key_shift_layers`` its ``shift[layer]`` (``[layers, kv_heads, D]``)."""
        for i in self.key_shift_layers():
            layer = self.layers[i]
            assert isinstance(layer, DecoderLayer)
            layer.key_shift = shift[i].to(self.device)
        if self._fused is not None:
            self._fused.set_key_shifts([getattr(layer, "key_shift", None) for layer in self.layers])

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` rows of the embedding (columns of the tied head), a fresh tensor."""
        if self.embed is None and isinstance(self.lm_head, Quantized):
            return embedding(input_ids, self.lm_head, self.dtype)  # the tied head's table
        if self.embed is None:
            return self.lm_head.t().index_select(0, input_ids)
        return embedding(input_ids, self.embed, self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (before the final norm) of the step's packed rows.

        Args:
            input_ids: ``[T]`` token ids, rows packed as ``meta`` describes.
            positions: ``[T]`` position of each row in its sequence.
            kv_caches: per layer, its pool tensor (``KVCachePool.layers``).
            meta: the step's attention metadata.
        """
        h = self.embed_tokens(input_ids)
        cis = [rope_cis(positions, inv_freq, scale) for inv_freq, scale in self._rope]
        if self._fused is not None and self._fused.run(h, cis[0], kv_caches, meta):
            return h  # a decode step, every layer in one native call
        for layer, cache, batch in zip(self.layers, kv_caches, meta.layers, strict=True):
            layer(h, cis[layer.rope_kind], cache, batch)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` of the selected rows of ``forward``'s output."""
        x = rms_norm(hidden, self.eps, self.final_norm)
        logits = _head_matmul(x, self.lm_head).float()
        if self.final_softcap is not None:
            softcap_(logits, self.final_softcap)
        return logits


_HEAD_CHUNK = 1024
"""Vocabulary columns per LM-head GEMM when several rows sample (see ``_head_matmul``)."""


def _head_matmul(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """``x @ head`` for the ``[hidden, vocab]`` head (or its packed form).

    One row is a GEMV and streams the head once either way. For a batch, MKL's blocking over
    a 49k-column operand is poor on CPU; 1024-column slices that stay in cache measured ~20%
    faster at 32 rows. GPUs and packed heads get the single call.
    """
    if x.shape[0] == 1 or x.device.type != "cpu" or is_packed(head):
        return matmul(x, head)
    out = x.new_empty(x.shape[0], head.shape[1])
    for start in range(0, head.shape[1], _HEAD_CHUNK):
        end = start + _HEAD_CHUNK
        torch.mm(x, head[:, start:end], out=out[:, start:end])
    return out


def _install(module: nn.Module, name: str, weight: torch.Tensor) -> None:
    """Replace parameter ``name`` by ``weight``: a dense one stays a Parameter; a packed one
    becomes a plain attribute (it is not a Parameter any more) and the dense copy is freed."""
    delattr(module, name)
    if is_packed(weight):
        setattr(module, name, weight)
    else:
        setattr(module, name, nn.Parameter(weight, requires_grad=False))
