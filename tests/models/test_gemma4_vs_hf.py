"""Gemma 4 text against transformers on tiny random configs: dense, K=V, KV-shared, MoE.

Each variant runs prefill, chunked prefill, mixed batches and 16 decode steps through the paged
pool, every sampled row compared with HF's logits at 1e-4 in float32 (the harness of
``test_parity_vs_hf``). Every config has sliding (window 4) and full-attention layers of
different head dims, per-layer input embeddings, proportional rotary and logit soft-capping.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_parity_vs_hf import NEW_TOKENS, _Harness

from kvroom.engine.sched.output import SchedulerOutput

S, F = "sliding_attention", "full_attention"
_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=4,
    max_position_embeddings=256,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=128,
    final_logit_softcapping=30.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.5,
            "rope_theta": 1000.0,
        },
    },
)
VARIANTS: dict[str, dict] = {
    "dense": dict(num_hidden_layers=3, layer_types=[S, S, F]),
    "k_eq_v": dict(
        num_hidden_layers=3,
        layer_types=[S, F, F],
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),
    "kv_shared": dict(
        num_hidden_layers=5,
        layer_types=[S, F, S, S, F],
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    ),
    "moe": dict(
        num_hidden_layers=2,
        layer_types=[S, F],
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
    ),
}


VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16
)


def _hf_model(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if name == "multimodal":  # the decoder of Gemma4ForConditionalGeneration, text prompts
        text = transformers.Gemma4TextConfig(**_BASE, **VARIANTS["k_eq_v"])
        cfg = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=VISION)
        model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    else:
        cfg = transformers.Gemma4TextConfig(**_BASE, **VARIANTS[name])
        model = transformers.Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.state_dict().items():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
            elif "norm" in pname or "scale" in pname or "scalar" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, str]]:
    out = {}
    for name in [*VARIANTS, "multimodal"]:
        model = _hf_model(name)
        folder = tmp_path_factory.mktemp(f"gemma4_{name}")
        model.save_pretrained(folder)
        out[name] = (model, str(folder))
    return out


@pytest.mark.parametrize("variant", [*VARIANTS, "multimodal"])
def test_prefill_then_decode(variant: str, saved: dict) -> None:
    h = _Harness(*saved[variant])
    seq = h.add(prompt_len=11, seed=1)
    h.step(h.chunk(seq, 11))
    h.decode_all(NEW_TOKENS - 1)


@pytest.mark.parametrize("variant", ["dense", "kv_shared"])
def test_chunked_prefill_and_mixed_batch(variant: str, saved: dict) -> None:
    """B prefills in chunks shorter and longer than the window while A decodes (kv_shared has
    K=V and both sharing kinds; the MoE rows are independent of batching)."""
    h = _Harness(*saved[variant])
    a = h.add(prompt_len=6, seed=3)
    b = h.add(prompt_len=13, seed=4)
    h.step(h.chunk(a, 6))
    h.step(h.chunk(b, 5), h.chunk(a, 1))
    h.step(h.chunk(a, 1), h.chunk(b, 3))
    h.step(h.chunk(b, 5), h.chunk(a, 1))
    h.decode_all(6)


def test_k_eq_v_pool_holds_one_tensor_per_token(saved: dict) -> None:
    h = _Harness(*saved["kv_shared"])
    pool = h.runner.pool
    assert [g.describe() for g in pool.groups] == [
        "2 sliding-window layers, 2 KV heads x 16 dims; 1 layer shares earlier KV",
        "1 full-attention layer, K=V, 1 KV head x 32 dims; 1 layer shares earlier KV",
    ]
    assert pool.layers[3] is pool.layers[2] and pool.layers[4] is pool.layers[1]
    assert tuple(pool.layers[1].shape) == (64, 4, 1, 1, 32)


def test_window_covering_max_seq_len(saved: dict) -> None:
    """All layers stored as full: two full groups of different head dims share block ids."""
    h = _Harness(*saved["kv_shared"], max_seq_len=4)
    assert set(h.runner.pool.layer_kinds) == {"full"}
    seq = h.add(prompt_len=3, seed=5)
    h.step(h.chunk(seq, 3))
    _, logits = h.runner.compute_logits(SchedulerOutput((h.chunk(seq, 1),)))
    assert torch.isfinite(logits).all()
