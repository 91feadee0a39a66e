"""Inputs and references shared by the native-kernel tests (the package build and each level)."""

from __future__ import annotations

import os

import pytest
import torch

from kvroom.models.attention import DecodeGroup
from kvroom.models.kernels import build, cpu_kernels


def require_native_kernels() -> None:
    """Skip where the kernels cannot be had (no compiler, or turned off); fail where they could
    and did not build, so a build broken on this CPU never passes as a skip."""
    if cpu_kernels().native:
        return
    if os.environ.get("KVROOM_NATIVE_KERNELS", "1") == "0":
        pytest.skip("native kernels turned off (KVROOM_NATIVE_KERNELS=0)")
    if not build.has_compiler():
        pytest.skip("no C++ compiler (g++): the native kernels cannot be built")
    pytest.fail(f"the native kernels did not build (see the build log in {build.cache_dir()})")


def decode_case(
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    lens: list[int],
    d: int = 16,
):
    gen = torch.Generator().manual_seed(0)
    unit = 4
    units = max(40, len(lens) * -(-max(lens) // unit))
    cache = torch.randn(units, unit, 2, kv_heads, d, generator=gen).to(kv_dtype)
    n = max(-(-x // unit) for x in lens)
    perm = torch.randperm(units, generator=gen)[: len(lens) * n].view(len(lens), n)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, : heads * d].view(len(lens), heads, d)  # strided rows, as in the model
    keep = torch.arange(n * unit)[None, :] < torch.tensor(lens)[:, None]
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))
    group = DecodeGroup(len(lens), perm.contiguous(), n * unit, mask[:, None, None, :])
    return q, cache, group, torch.tensor(lens)


def prefill_case(dtype, kv_dtype, heads, kv_heads, d, chunks):
    """Chunks ``(start, q_len)`` over scattered pool blocks, their K/V stored as the model does."""
    gen = torch.Generator().manual_seed(2)
    unit, units = 4, 200
    cache = torch.randn(units, unit, 2, kv_heads, d, generator=gen).to(kv_dtype)
    ends = [s + n for s, n in chunks]
    n = max(-(-e // unit) for e in ends)
    tables = torch.randperm(units, generator=gen)[: len(chunks) * n].view(len(chunks), n)
    tp = sum(q for _, q in chunks)
    qkv = torch.randn(tp, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, : heads * d].view(tp, heads, d)  # strided rows, as in the model
    return q, cache, tables.contiguous(), chunks


def prefill_reference(q, cache, tables, chunks, scale):
    """Per chunk: gather its keys, SDPA under the causal mask with its offset, in float64."""
    outs, row = [], 0
    kvh = cache.shape[3]
    for b, (start, n) in enumerate(chunks):
        keys = cache[tables[b]].reshape(-1, 2, kvh, cache.shape[4])[: start + n].double()
        k, v = keys[:, 0].transpose(0, 1), keys[:, 1].transpose(0, 1)
        qb = q[row : row + n].double().transpose(0, 1)
        group = qb.shape[0] // kvh
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        allowed = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
        scores = (qb @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1))
        row += n
    return torch.cat(outs)


def product_bound(x: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ dense.T`` in float64, and the fp32 accumulation error bound of each element."""
    xd, wd = x.double(), dense.double()
    bound = x.shape[1] * torch.finfo(torch.float32).eps * (xd.abs() @ wd.abs().t())
    return xd @ wd.t(), bound


def glu_close(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> bool:
    """``got`` is ``silu(gate) * up`` of ``x @ dense.T`` (gate the first half of the columns)
    within what the products' fp32 accumulation errors carry through (silu' <= 1.1)."""
    full, err = product_bound(x, dense)
    half = full.shape[1] // 2
    gate, up = full[:, :half], full[:, half:]
    silu = torch.nn.functional.silu(gate)
    want = silu * up
    bound = 1.1 * err[:, :half] * up.abs() + silu.abs() * err[:, half:] + 1e-6 * want.abs()
    return bool(((got.double() - want).abs() <= bound + 1e-30).all())
