"""The native quantized GEMM over int4 / int8 panels: the panels hold exactly the weight's
values, and the product equals ``x @ dequantize(W).T`` within fp32 accumulation error at decode
and prefill sizes, for every GGUF type and the ``--quantization`` schemes."""

from __future__ import annotations

import pytest
import torch

from gguf_models import random_blocks
from kernel_cases import glu_close, product_bound, require_native_kernels
from kvroom.gguf_file import BLOCK_LAYOUTS
from kvroom.models import layers
from kvroom.models.quant import QuantizedLinear
from kvroom.models.quant.gguf_repack import repack
from kvroom.models.quant.panels import QuantPanels
from kvroom.models.quant.quantize import quantize

ALL_TYPES = sorted(BLOCK_LAYOUTS)


@pytest.fixture(autouse=True)
def _native() -> None:
    require_native_kernels()


def weight(type_name: str, rows: int = 96, cols: int = 512, seed: int = 0) -> QuantizedLinear:
    return repack(random_blocks(type_name, rows, cols, seed), type_name, rows, cols)


def within_accumulation(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> bool:
    want, bound = product_bound(x, dense)
    return bool(((got.double() - want).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_panels_hold_the_weights_values(type_name: str) -> None:
    w = weight(type_name)
    panels = QuantPanels(w)
    assert torch.equal(panels.dequantize(), w.dequantize())
    ids = torch.tensor([0, 5, 17, 31, 32, 95, 5])
    assert torch.equal(panels.embedding(ids, torch.float32), w.dequantize()[ids])
    assert panels.resident_bytes == w.resident_bytes


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 512])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_gemm_equals_dense_product_within_fp32_accumulation(rows: int, type_name: str) -> None:
    w = weight(type_name, rows=96, cols=768)  # K = 768: three blocks of 256, groups of 16-32
    x = torch.randn(rows, 768)
    assert within_accumulation(QuantPanels(w).matmul(x), x, w.dequantize())


@pytest.mark.parametrize(
    ("scheme", "rows"), [("int8", 1), ("int8", 40), ("int4", 1), ("int4-g128", 33)]
)
def test_gemm_of_quantized_full_precision_weights(scheme: str, rows: int) -> None:
    w = quantize(torch.randn(64, 384), scheme)
    x = torch.randn(rows, 384)
    assert within_accumulation(QuantPanels(w).matmul(x), x, w.dequantize())


@pytest.mark.parametrize("rows", [1, 9])
def test_bias_input_scale_bf16_and_accumulate(rows: int) -> None:
    w = weight("Q4_1", rows=64, cols=256)
    scale = torch.rand(256) + 0.5
    scaled = QuantPanels(w.with_input_scale(scale))
    x = torch.randn(rows, 256)
    bias = torch.randn(64)
    dense = w.dequantize()
    want = (x * scale) @ dense.t() + bias
    torch.testing.assert_close(scaled.matmul(x, bias), want, rtol=1e-5, atol=1e-5)
    got = scaled.matmul(x.bfloat16(), bias)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)
    out = torch.randn(rows, 64)
    expected = out + (x * scale) @ dense.t()
    scaled.matmul(x, out=out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_glu_fuses_silu_of_gate_times_up(rows: int) -> None:
    w = weight("Q4_K", rows=128, cols=256)
    x = torch.randn(rows, 256)
    assert glu_close(QuantPanels(w).glu(x), x, w.dequantize())


def test_prepare_weight_turns_quantized_weights_into_panels() -> None:
    w = weight("Q8_0", rows=64, cols=128)
    assert isinstance(layers.prepare_weight(w), QuantPanels)
    ragged = weight("Q8_0", rows=40, cols=128)  # not whole panels: the torch path
    assert layers.prepare_weight(ragged) is ragged


def test_float16_activations_come_back_in_float16() -> None:
    w = weight("Q8_0", rows=64, cols=128)
    x = torch.randn(3, 128).half()
    panels = QuantPanels(w)
    got = panels.matmul(x)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), x.float() @ w.dequantize().t(), rtol=2e-3, atol=2e-2)
    assert panels.glu(x).dtype == torch.float16
