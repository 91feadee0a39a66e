"""The native CPU kernels against the torch paths they replace (skipped without a compiler)."""

from __future__ import annotations

import pytest
import torch

from kvroom.models import attention
from kvroom.models.attention import DecodeGroup
from kvroom.models.kernels import CpuKernels, cpu_kernels, ops
from kvroom.models.layers import rms_norm

pytestmark = pytest.mark.skipif(not cpu_kernels().native, reason="native kernels not built")


def _case(dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, lens: list[int]):
    gen = torch.Generator().manual_seed(0)
    unit, d, units = 4, 16, 40
    cache = torch.randn(units, unit, 2, kv_heads, d, generator=gen).to(kv_dtype)
    n = max(-(-x // unit) for x in lens)
    perm = torch.randperm(units, generator=gen)[: len(lens) * n].view(len(lens), n)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, : heads * d].view(len(lens), heads, d)  # strided rows, as in the model
    keep = torch.arange(n * unit)[None, :] < torch.tensor(lens)[:, None]
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))
    group = DecodeGroup(len(lens), perm.contiguous(), n * unit, mask[:, None, None, :])
    return q, cache, group, torch.tensor(lens)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "atol"),
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.float32, torch.bfloat16, 1e-5),
        (torch.bfloat16, torch.bfloat16, 2e-2),
    ],
)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_decode_attention_matches_sdpa(dtype, kv_dtype, atol, softcap) -> None:
    q, cache, group, lens = _case(dtype, kv_dtype, heads=6, kv_heads=2, lens=[1, 7, 16, 13])
    ref = attention._decode(q, cache, group, 0.25, softcap)
    out = ops.decode_attention(q, cache, group.kv_index, lens, 0.25, softcap)
    assert out is not None
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_decode_attention_many_items_runs_threaded_and_the_same() -> None:
    q, cache, group, lens = _case(torch.float32, torch.float32, 8, 4, [5, 9, 12, 3, 16, 2, 8, 11])
    ref = attention._decode(q, cache, group, 0.3, None)
    out = ops.decode_attention(q, cache, group.kv_index, lens, 0.3, None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
def test_add_rms_norm_matches_torch(dtype, rows) -> None:
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(rows, 96, generator=gen).to(dtype)
    delta = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    eps = torch.tensor(1e-6)
    ref_h = h + delta
    ref = rms_norm(ref_h, eps, w)
    out = ops.add_rms_norm(h, delta, 1e-6, w)
    assert out is not None
    assert torch.equal(h, ref_h)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_the_choice_is_described_in_one_line() -> None:
    text = CpuKernels(isa="avx2", bf16_packed=False, native=True).describe()
    assert text == (
        "CPU kernels: avx2; bf16 projections: fp32 GEMM on widened bf16 weights; "
        "native paged decode attention"
    )
