"""``models/layers.py``: projection packing and the bytes it holds per CPU kind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvroom.models.layers import (
    glu,
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
    assert model.up.is_mkldnn and model.down.is_mkldnn
    assert packed_bf16_bytes(model) == 2 * (16 * 48 * 2)
    widened = widens_bf16_weights()
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
