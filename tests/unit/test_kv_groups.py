"""Per-layer KV shapes (Gemma 4): ModelSpec's layer groups, their plan bytes and the pool.

A Gemma-4-E2B-like shape by hand (hub spelling: ``global_head_dim``,
``num_global_key_value_heads``), and for every variant the plan's bytes equal the pool's.
"""

from __future__ import annotations

import pytest
import torch

from kvroom.config import DecoderOnlyConfig
from kvroom.device import DeviceMemory
from kvroom.engine.kv.pool import KVCachePool
from kvroom.errors import ModelSourceError
from kvroom.model_spec import ModelSpec
from kvroom.plan import compute_plan
from kvroom.plan.kv import kv_bytes_per_block, sliding_window_bytes

S, F = "sliding_attention", "full_attention"


def gemma4_config(**overrides: object) -> dict:
    """12 layers, 5:1 sliding, sliding 2 KV heads x 256, full K=V 1 KV head x 512, the last 4
    layers share earlier KV (as ``config.json`` on the hub spells it)."""
    cfg = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "num_hidden_layers": 12,
        "hidden_size": 1536,
        "intermediate_size": 6144,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 4,
        "vocab_size": 262144,
        "sliding_window": 512,
        "max_position_embeddings": 131072,
        "layer_types": [S, S, S, S, S, F] * 2,
    }
    return cfg | overrides


def test_layer_groups_of_a_hub_config() -> None:
    spec = ModelSpec.from_hf_config(gemma4_config())
    assert [kv.kv_source for kv in spec.layer_kv] == [None] * 8 + [7, 7, 7, 5]
    assert [g.describe() for g in spec.kv_groups(4096)] == [
        "7 sliding-window layers, 2 KV heads x 256 dims; 3 layers share earlier KV",
        "1 full-attention layer, K=V, 1 KV head x 512 dims; 1 layer shares earlier KV",
    ]


def test_plan_bytes_by_hand() -> None:
    """block   = 1 K=V layer x 16 tokens x (1 x 1 head x 512 x 2 B)          = 16 KiB
    sliding = 7 layers x 8 seqs x 512 window x (2 x 2 heads x 256 x 2 B)     = 56 MiB"""
    spec = ModelSpec.from_hf_config(gemma4_config())
    shape = dict(max_seq_len=4096, kv_dtype="bfloat16", tensor_parallel_size=1)
    assert kv_bytes_per_block(spec, block_size=16, **shape) == 16 * 1024
    assert sliding_window_bytes(spec, batch_size=8, **shape) == 7 * 8 * 512 * 2048
    without = ModelSpec.from_hf_config(gemma4_config(attention_k_eq_v=False))
    # without K=V: K and V, and num_global_key_value_heads does not apply (transformers)
    assert kv_bytes_per_block(without, block_size=16, **shape) == 16 * 2 * 2 * 512 * 2


def test_window_covering_max_seq_len_makes_two_full_groups() -> None:
    spec = ModelSpec.from_hf_config(gemma4_config())
    kinds = {(g.kind, g.head_dim) for g in spec.kv_groups(512)}
    assert kinds == {("full", 256), ("full", 512)}


def test_multimodal_config_reads_text_config() -> None:
    text = gemma4_config()
    del text["architectures"]
    top = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4"}
    spec = ModelSpec.from_hf_config(top | {"text_config": text, "tie_word_embeddings": True})
    assert spec.model_type == "gemma4_text" and spec.tie_embeddings
    assert spec.layer_kv == ModelSpec.from_hf_config(gemma4_config()).layer_kv


def test_shared_layer_type_without_a_source_is_refused() -> None:
    cfg = gemma4_config(num_hidden_layers=3, layer_types=[S, S, F], num_kv_shared_layers=1)
    with pytest.raises(ModelSourceError, match="layer 2 .full_attention. shares KV but no earlier"):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "max_seq_len"),
    [
        ({}, 2048),
        ({"attention_k_eq_v": False}, 2048),
        ({"num_kv_shared_layers": 0}, 2048),
        ({}, 256),
    ],
)
def test_pool_bytes_equal_the_plan(overrides: dict, max_seq_len: int) -> None:
    small = dict(hidden_size=64, head_dim=8, global_head_dim=16, sliding_window=512)
    spec = ModelSpec.from_hf_config(gemma4_config(**small, **overrides))
    cfg = DecoderOnlyConfig(
        max_seq_len=max_seq_len, batch_size=2, kvcache_block_size=16, kvcache_num_blocks=8
    )
    plan = compute_plan(spec, cfg, num_parameters=1000, memory=DeviceMemory(2**30, "explicit"))
    kinds = spec.layer_kinds(max_seq_len)
    pool = KVCachePool(
        spec,
        num_blocks=plan.num_blocks,
        block_size=16,
        max_seq_len=max_seq_len,
        num_sliding_slots=2 if "sliding" in kinds else 0,
        dtype=torch.float32,
        device="cpu",
    )
    assert pool.nbytes() == plan.kv_bytes
    assert len(pool.layers) == 12
