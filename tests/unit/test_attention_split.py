"""Prefill chunks with cached context, attended as cached part + causal own part (merged by
log-sum-exp), against one SDPA call under the bottom-right mask tensor."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from kvroom.models import prefill_attention
from kvroom.models.prefill_attention import PrefillChunk

UNIT = 16


def _pool_and_chunks(
    spans: list[tuple[int, int]], kv_heads: int, d: int, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, tuple[PrefillChunk, ...]]:
    """A pool holding every chunk's keys in shuffled blocks; ``spans`` are ``(start, q_len)``."""
    gen = torch.Generator().manual_seed(0)
    need = [-(-(s + n) // UNIT) for s, n in spans]
    cache = torch.randn(sum(need) + 3, UNIT, 2, kv_heads, d, generator=gen).to(kv_dtype)
    perm = torch.randperm(cache.shape[0], generator=gen)
    chunks, row, used = [], 0, 0
    for (start, q_len), n in zip(spans, need, strict=True):
        table = perm[used : used + n].contiguous()[None]
        chunks.append(PrefillChunk(row, q_len, start, start + q_len, table))
        row, used = row + q_len, used + n
    return cache, tuple(chunks)


def _queries(rows: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, heads, d]`` strided rows: a view of a packed qkv projection, as in the model."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    return qkv[:, : heads * d].view(rows, heads, d)


def _both(
    q: torch.Tensor, cache: torch.Tensor, chunks: tuple[PrefillChunk, ...], softcap=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(split output, masked-SDPA reference) of ``_prefill_chunks``."""
    scale = q.shape[-1] ** -0.5
    out = prefill_attention._prefill_chunks(q, cache, chunks, scale, softcap)
    with mock.patch.object(prefill_attention, "_split_applies", lambda *_: False):
        ref = prefill_attention._prefill_chunks(q, cache, chunks, scale, softcap)
    return out, ref


SPANS = [
    [(16, 1)],
    [(5, 2)],
    [(1, 3)],
    [(37, 200)],
    [(500, 512)],
    [(1500, 64)],
    [(0, 40), (100, 3), (31, 77)],  # fresh and cached chunks in one step
]


@pytest.mark.parametrize("spans", SPANS, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_split_matches_masked_sdpa_fp32(spans, heads, kv_heads) -> None:
    d = 64
    cache, chunks = _pool_and_chunks(spans, kv_heads, d, torch.float32)
    q = _queries(sum(n for _, n in spans), heads, kv_heads, d, torch.float32)
    out, ref = _both(q, cache, chunks)
    assert out.shape == ref.shape == (q.shape[0], heads * d)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "atol"),
    [
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float16, torch.float16, 4e-3),
        (torch.float32, torch.float16, 1e-5),  # narrower pools are upcast by the gather
        (torch.float32, torch.float8_e4m3fn, 1e-5),
        (torch.bfloat16, torch.float8_e4m3fn, 2e-2),
    ],
)
@pytest.mark.parametrize("spans", [[(16, 1)], [(1, 3)], [(300, 257)], [(0, 9), (64, 100)]], ids=str)
def test_split_matches_masked_sdpa_narrow_dtypes(dtype, kv_dtype, atol, spans) -> None:
    cache, chunks = _pool_and_chunks(spans, 3, 64, kv_dtype)
    q = _queries(sum(n for _, n in spans), 9, 3, 64, dtype)
    out, ref = _both(q, cache, chunks)
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_split_skips_sliding_chunks_and_softcaps() -> None:
    q = _queries(4, 9, 3, 64, torch.float32).unsqueeze(0).transpose(1, 2)
    full = PrefillChunk(0, 4, 10, 14, None)
    assert prefill_attention._split_applies(q, full, None)
    assert not prefill_attention._split_applies(q, PrefillChunk(0, 4, 0, 4, None), None)
    assert not prefill_attention._split_applies(q, PrefillChunk(0, 4, 10, 14, None, window=8), None)
    assert not prefill_attention._split_applies(q, full, 50.0)


def test_softcap_chunks_keep_the_masked_path() -> None:
    cache, chunks = _pool_and_chunks([(40, 7)], 3, 64, torch.float32)
    q = _queries(7, 9, 3, 64, torch.float32)
    out, ref = _both(q, cache, chunks, softcap=30.0)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
