from __future__ import annotations

import re
from typing import Any

import pytest

from kvroom.errors import KvroomError, ModelSourceError
from kvroom.model_spec import SUPPORTED_ARCHITECTURES, ModelSpec

SUPPORTED = ", ".join(SUPPORTED_ARCHITECTURES)


def smollm2_135m() -> dict[str, Any]:
    """HuggingFaceTB/SmolLM2-135M config.json (the keys kvroom reads, plus a few it ignores)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000,
        "torch_dtype": "bfloat16",
    }


def tiny(model_type: str, architecture: str, **overrides: Any) -> dict[str, Any]:
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "num_hidden_layers": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 128,
        "max_position_embeddings": 256,
    }
    cfg.update(overrides)
    return cfg


def test_smollm2_135m_fields() -> None:
    assert ModelSpec.from_hf_config(smollm2_135m()) == ModelSpec(
        architecture="LlamaForCausalLM",
        model_type="llama",
        num_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        layer_types=("full_attention",) * 30,
        sliding_window=None,
        tie_embeddings=True,
        max_position_embeddings=8192,
        attention_bias=False,
        qk_norm=False,
    )


def test_smollm2_135m_every_layer_is_full() -> None:
    spec = ModelSpec.from_hf_config(smollm2_135m())
    assert spec.layer_kinds(2048) == ("full",) * 30
    assert (spec.num_full_layers(2048), spec.num_sliding_layers(2048)) == (30, 0)


def test_head_dim_derived_when_missing() -> None:
    cfg = smollm2_135m()
    del cfg["head_dim"]
    assert ModelSpec.from_hf_config(cfg).head_dim == 64  # 576 // 9


def test_head_dim_derived_when_null() -> None:
    cfg = tiny("llama", "LlamaForCausalLM", hidden_size=96, head_dim=None)
    assert ModelSpec.from_hf_config(cfg).head_dim == 24  # 96 // 4


def test_kv_heads_default_to_heads() -> None:
    cfg = tiny("llama", "LlamaForCausalLM")
    del cfg["num_key_value_heads"]
    assert ModelSpec.from_hf_config(cfg).num_kv_heads == 4


def test_tie_defaults_per_model_type() -> None:
    assert ModelSpec.from_hf_config(tiny("llama", "LlamaForCausalLM")).tie_embeddings is False
    gemma = tiny("gemma3_text", "Gemma3ForCausalLM")
    assert ModelSpec.from_hf_config(gemma).tie_embeddings is True


def test_flags_per_model_type() -> None:
    qwen2 = ModelSpec.from_hf_config(tiny("qwen2", "Qwen2ForCausalLM"))
    qwen3 = ModelSpec.from_hf_config(tiny("qwen3", "Qwen3ForCausalLM"))
    llama = ModelSpec.from_hf_config(tiny("llama", "LlamaForCausalLM"))
    assert (qwen2.attention_bias, qwen2.qk_norm) == (True, False)
    assert (qwen3.attention_bias, qwen3.qk_norm) == (False, True)
    assert (llama.attention_bias, llama.qk_norm) == (False, False)


def test_qwen2_sliding_window_key_alone_keeps_layers_full() -> None:
    # Qwen2 config.json files carry sliding_window with use_sliding_window false.
    cfg = tiny("qwen2", "Qwen2ForCausalLM", sliding_window=32768, use_sliding_window=False)
    assert ModelSpec.from_hf_config(cfg).layer_types == ("full_attention",) * 4


def test_architecture_from_model_type_when_architectures_missing() -> None:
    cfg = tiny("qwen3", "unused")
    del cfg["architectures"]
    spec = ModelSpec.from_hf_config(cfg)
    assert (spec.architecture, spec.model_type) == ("Qwen3ForCausalLM", "qwen3")


def test_first_supported_architecture_wins() -> None:
    cfg = tiny("mistral", "Unknown")
    cfg["architectures"] = ["Unknown", "MistralForCausalLM"]
    assert ModelSpec.from_hf_config(cfg).architecture == "MistralForCausalLM"


def test_unsupported_architecture_lists_supported() -> None:
    cfg = tiny("gpt2", "GPT2LMHeadModel")
    expected = f"unsupported architecture GPT2LMHeadModel; supported: {SUPPORTED}"
    with pytest.raises(ModelSourceError, match=f"^{re.escape(expected)}$"):
        ModelSpec.from_hf_config(cfg)


def test_unsupported_without_architectures_names_model_type() -> None:
    cfg = tiny("gpt2", "unused")
    del cfg["architectures"]
    expected = f"unsupported architecture model_type='gpt2'; supported: {SUPPORTED}"
    with pytest.raises(ModelSourceError, match=f"^{re.escape(expected)}$"):
        ModelSpec.from_hf_config(cfg)


def test_model_source_error_is_a_user_error() -> None:
    with pytest.raises(KvroomError, match="unsupported architecture"):
        ModelSpec.from_hf_config(tiny("gpt2", "GPT2LMHeadModel"))
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelSpec.from_hf_config(tiny("gpt2", "GPT2LMHeadModel"))


# -- gemma3: layer_types -------------------------------------------------------------------------
def test_gemma3_explicit_layer_types() -> None:
    types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    cfg = tiny("gemma3_text", "Gemma3ForCausalLM", layer_types=types, sliding_window=8)
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.layer_types == tuple(types)
    assert spec.sliding_window == 8
    assert spec.layer_kinds(32) == ("sliding", "sliding", "sliding", "full")
    assert (spec.num_full_layers(32), spec.num_sliding_layers(32)) == (1, 3)


def test_gemma3_pattern_default_six() -> None:
    cfg = tiny("gemma3_text", "Gemma3ForCausalLM", num_hidden_layers=12, sliding_window=512)
    types = ModelSpec.from_hf_config(cfg).layer_types
    # every 6th layer (index 5 and 11) is full
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11]
    assert types.count("sliding_attention") == 10


def test_gemma3_pattern_from_config() -> None:
    cfg = tiny("gemma3_text", "Gemma3ForCausalLM", sliding_window_pattern=2, sliding_window=8)
    assert ModelSpec.from_hf_config(cfg).layer_types == (
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    )


def test_layer_types_length_mismatch() -> None:
    cfg = tiny("gemma3_text", "Gemma3ForCausalLM", layer_types=["full_attention"] * 3)
    expected = "config.json: layer_types has 3 entries for 4 layers"
    with pytest.raises(ModelSourceError, match=f"^{re.escape(expected)}$"):
        ModelSpec.from_hf_config(cfg)


def test_window_covering_max_seq_len_plans_sliding_layers_as_full() -> None:
    cfg = tiny("gemma3_text", "Gemma3ForCausalLM", num_hidden_layers=6, sliding_window=512)
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.layer_kinds(1024) == ("sliding",) * 5 + ("full",)
    assert spec.layer_kinds(512) == ("full",) * 6


# -- mistral: a bare sliding_window --------------------------------------------------------------
def test_mistral_window_makes_every_layer_sliding_attention() -> None:
    spec = ModelSpec.from_hf_config(tiny("mistral", "MistralForCausalLM", sliding_window=4096))
    assert spec.layer_types == ("sliding_attention",) * 4
    assert spec.sliding_window == 4096


@pytest.mark.parametrize(
    ("max_seq_len", "kind"),
    [
        (2048, "full"),  # window 4096 > max_seq_len: never drops a token
        (4096, "full"),  # window == max_seq_len: still covers every token
        (4097, "sliding"),
        (8192, "sliding"),
    ],
)
def test_mistral_layer_kinds(max_seq_len: int, kind: str) -> None:
    spec = ModelSpec.from_hf_config(tiny("mistral", "MistralForCausalLM", sliding_window=4096))
    assert spec.layer_kinds(max_seq_len) == (kind,) * 4


def test_mistral_without_window_is_full() -> None:
    spec = ModelSpec.from_hf_config(tiny("mistral", "MistralForCausalLM", sliding_window=None))
    assert spec.layer_types == ("full_attention",) * 4
    assert spec.sliding_window is None
    assert spec.layer_kinds(100_000) == ("full",) * 4
