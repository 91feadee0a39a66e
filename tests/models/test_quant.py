"""Quantized weights: GGUF blocks repack bit for bit, fusing is lossless, the GEMM is exact to
fp32 accumulation, and a GGUF checkpoint serves HF names in HF layout."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_models import random_blocks, write_gguf
from kvroom.gguf_file import BLOCK_LAYOUTS
from kvroom.models.quant import QuantizedLinear
from kvroom.models.quant.fuse import concat_rows
from kvroom.models.quant.gguf_checkpoint import GgufCheckpoint
from kvroom.models.quant.gguf_repack import repack

ALL_TYPES = sorted(BLOCK_LAYOUTS)
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
"""Types gguf-py quantizes; the K-quants are tested on random valid blocks."""


def reference(raw: np.ndarray, type_name: str) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))


def weight(type_name: str, rows: int = 6, cols: int = 512, seed: int = 0) -> QuantizedLinear:
    return repack(random_blocks(type_name, rows, cols, seed), type_name, rows, cols)


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_random_blocks_dequantize_bit_for_bit(type_name: str) -> None:
    raw = random_blocks(type_name, 6, 512)
    got = repack(raw, type_name, 6, 512).dequantize()
    assert torch.equal(got, reference(raw, type_name))


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_gguf_py_quantized_weights_dequantize_bit_for_bit(type_name: str) -> None:
    data = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType[type_name])
    assert torch.equal(repack(raw, type_name, 8, 64).dequantize(), reference(raw, type_name))


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_layout_keeps_the_planned_bytes(type_name: str) -> None:
    w = weight(type_name)
    layout = BLOCK_LAYOUTS[type_name]
    assert (w.kind, w.group_size) == (layout.kind, layout.group_size)
    assert w.resident_bytes == layout.resident_bytes(6, 512)


def test_rows_of_a_fused_weight_are_its_parts_exactly() -> None:
    parts = [weight("Q4_K", 4, seed=1), weight("Q4_0", 2, seed=2), weight("Q6_K", 3, seed=3)]
    fused = concat_rows(parts)
    assert fused.kind == "int8" and fused.group_size == 16
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    same = concat_rows([weight("Q4_1", 2, seed=4), weight("Q4_1", 3, seed=5)])
    assert (same.kind, same.scales.dtype) == ("int4", torch.float16)


def test_int4_symmetric_and_affine_fuse_as_affine_int4() -> None:
    parts = [weight("Q4_0", 2, seed=6), weight("Q4_1", 2, seed=7)]
    fused = concat_rows(parts)
    assert fused.kind == "int4" and fused.mins is not None
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_take_rows_and_input_scale() -> None:
    w = weight("Q8_0", 5)
    index = torch.tensor([4, 0, 3, 1, 2])
    assert torch.equal(w.take_rows(index).dequantize(), w.dequantize()[index])
    scale = torch.rand(512) + 0.5
    x = torch.randn(3, 512)
    got = w.with_input_scale(scale).matmul(x)
    torch.testing.assert_close(got, (x * scale) @ w.dequantize().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 32, 512])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"])
def test_gemm_equals_dense_product_within_fp32_accumulation(rows: int, type_name: str) -> None:
    w = weight(type_name, rows=300, cols=512)  # 300 rows: more than one tile, a ragged last
    x = torch.randn(rows, 512)
    dense = w.dequantize()
    expected = (x.double() @ dense.double().t()).float()
    got = w.matmul(x)
    bound = 512 * torch.finfo(torch.float32).eps * (x.abs() @ dense.abs().t())
    assert ((got - expected).abs() <= bound + 1e-30).all()


def test_gemm_keeps_bf16_activations_and_adds_bias() -> None:
    w = weight("Q4_1", rows=8, cols=64)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    bias = torch.randn(8)
    got = w.matmul(x, bias)
    assert got.dtype == torch.bfloat16
    expected = x.float() @ w.dequantize().t() + bias
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


def test_embedding_rows(tmp_path) -> None:
    w = weight("Q8_0", rows=10, cols=64)
    ids = torch.tensor([3, 3, 9])
    assert torch.equal(w.embedding(ids, torch.float32), w.dequantize()[ids])


def test_gguf_checkpoint_serves_hf_names_unpermuted(tmp_path) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((16, 32)).astype(np.float32)  # 2 heads of 8 rows
    norm = rng.standard_normal(32).astype(np.float32)
    path = write_gguf(
        tmp_path / "m.gguf",
        {
            "blk.0.attn_q.weight": ("Q8_0", _llama_permute(q, 2)),
            "blk.0.attn_norm.weight": ("F32", norm),
            "blk.0.ffn_down.weight": ("Q6_K", random_blocks("Q6_K", 4, 256)),
        },
    )
    with GgufCheckpoint(path, torch.device("cpu"), num_heads=2, num_kv_heads=1) as ckpt:
        got = ckpt.get("model.layers.0.self_attn.q_proj.weight")
        assert isinstance(got, QuantizedLinear)
        expected = reference(gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0), "Q8_0")
        assert torch.equal(got.dequantize(), expected)
        assert torch.equal(
            ckpt.get("model.layers.0.input_layernorm.weight"), torch.from_numpy(norm)
        )
        assert ckpt.get("model.layers.0.mlp.down_proj.weight").kind == "int8"
        assert "model.layers.1.mlp.down_proj.weight" not in ckpt


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


@pytest.mark.parametrize(
    ("scheme", "kind", "group", "bound"),
    [
        ("int8", "int8", 512, 1 / 254),
        ("int4", "int4", 32, 1 / 30),
        ("int4-g128", "int4", 128, 1 / 30),
    ],
)
def test_quantize_full_precision_weights(scheme: str, kind: str, group: int, bound: float) -> None:
    from kvroom.models.quant.quantize import quantize
    from kvroom.quant_schemes import SCHEMES

    w = torch.randn(64, 512)
    w[3] = 0.25  # a constant row: scale 0 must not divide
    q = quantize(w, scheme)
    assert (q.kind, q.group_size) == (kind, group)
    assert q.resident_bytes == SCHEMES[scheme].resident_bytes(64, 512)
    err = (q.dequantize() - w).abs()
    if kind == "int8":
        assert (err <= w.abs().amax(1, keepdim=True) * bound * 1.001).all()
    else:
        span = w.view(64, -1, group)
        width = (span.amax(2) - span.amin(2)).repeat_interleave(group, 1)
        assert (err <= width * bound + 2e-3).all()  # half a step, plus fp16 rounding of s, m
    assert torch.equal(q.dequantize()[3], torch.full((512,), 0.25))
