"""``models/layers.py``: projection packing and the bytes it holds per CPU kind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvroom.models.kernels import cpu_kernels
from kvroom.models.layers import (
    add_mlp_,
    glu,
    is_packed,
    matmul,
    mlp,
    packed_bf16_bytes,
    prepare_weight,
    widens_bf16_weights,
)

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="oneDNN packing only"
)


class _TwoProjections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = prepare_weight(torch.randn(16, 48).to(torch.bfloat16))
        self.down = prepare_weight(torch.randn(48, 16).to(torch.bfloat16))
        self.norm = nn.Parameter(torch.ones(16, dtype=torch.bfloat16))  # dense: not counted


@needs_onednn
def test_packed_bf16_bytes_are_the_projections_as_bf16_whatever_the_cpu() -> None:
    model = _TwoProjections()
    widened = widens_bf16_weights()
    if not widened and not cpu_kernels().bf16_packed:
        # bf16 panels (not for 48 columns) and no oneDNN bf16 GEMM: a plain bf16 matrix
        assert model.up.dtype == torch.bfloat16 and not is_packed(model.up)
        assert packed_bf16_bytes(model) == 0
        return
    assert model.up.is_mkldnn and model.down.is_mkldnn
    assert packed_bf16_bytes(model) == 2 * (16 * 48 * 2)
    assert model.up.dtype == (torch.float32 if widened else torch.bfloat16)


@needs_onednn
def test_a_packed_bf16_projection_computes_the_product() -> None:
    w = torch.randn(16, 48).to(torch.bfloat16)
    x = torch.randn(3, 16).to(torch.bfloat16)
    got = matmul(x, prepare_weight(w))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x.float() @ w.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [513, 1300])  # above MLP_CHUNK_ROWS: 2 and 3 parts
def test_mlp_in_row_chunks_equals_the_whole_chunk(rows: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, 16)
    gate_up = prepare_weight(torch.randn(16, 48))
    down = prepare_weight(torch.randn(24, 16))
    whole = matmul(glu(x, gate_up, "silu"), down)
    torch.testing.assert_close(mlp(x, gate_up, down, "silu"), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 513])
@pytest.mark.parametrize(("hidden", "inter"), [(64, 96), (16, 24)])  # native panels, oneDNN
def test_add_mlp_adds_into_the_residual_as_add_of_mlp_does(dtype, rows, hidden, inter) -> None:
    """The down projection adds into ``h`` in the GEMM's epilogue where the weights are panels,
    rounded as ``h.add_(mlp(...))`` rounds: the same residual, bit for bit."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    gate_up = prepare_weight((torch.randn(hidden, 2 * inter, generator=gen) * 0.2).to(dtype))
    down = prepare_weight((torch.randn(inter, hidden, generator=gen) * 0.2).to(dtype))
    h = torch.randn(rows, hidden, generator=gen).to(dtype)
    want = h.clone().add_(mlp(x, gate_up, down, "silu"))
    add_mlp_(h, x, gate_up, down, "silu")
    assert torch.equal(h, want)
