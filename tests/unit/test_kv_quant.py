"""int8/int4 KV rows: round trip within the format's bound, the layout, the rotation, and paged
attention over a quantized pool equal to attention over its dequantized K/V."""

from __future__ import annotations

import pytest
import torch

from kvroom.models import kv_quant
from kvroom.models.attention import paged_attention
from kvroom.models.attention_index import SeqChunk, build_attention_metadata
from kvroom.models.kernels import cpu_kernels, ops
from kvroom.models.kv_quant import KVCodec

BITS = [8, 4]


QUANTIZERS = {"quantize": kv_quant.quantize, "torch": kv_quant.quantize_torch}
"""The native kernel on the CPU where built, and its torch twin."""
native_only = pytest.mark.skipif(
    not cpu_kernels().native, reason="native kernels not built (KVROOM_NATIVE_KERNELS=0)"
)


@pytest.mark.parametrize("impl", list(QUANTIZERS))
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_is_within_half_a_step(bits: int, impl: str) -> None:
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10 + torch.randn(50, 3, 1)
    x[0, 0] = 0.0  # an all-zero row has scale 0 and must come back as zeros
    x[0, 1] = -3.25  # so must a constant row
    rows = QUANTIZERS[impl](x, bits)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, 64 * bits // 8 + 4)
    back = kv_quant.dequantize(rows, bits, torch.float32)
    bound = kv_quant.error_bound(x, rows, bits) * (1 + 1e-5) + 1e-6
    assert ((back - x).abs() <= bound).all()
    if bits == 8:
        full_step = x.abs().amax(-1, keepdim=True) / kv_quant.INT8_QMAX
    else:
        full_step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / kv_quant.INT4_LEVELS
    assert ((back - x).abs() <= full_step / 2 + 1e-5).float().mean() > 0.9
    assert back[0, 0].eq(0).all()
    assert back[0, 1].eq(-3.25).all()
    assert (back - x).abs().max() > 0  # lossy: the bound is not vacuous


def test_rows_hold_values_then_their_scale() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 7.0]])
    int8 = kv_quant.quantize(x, 8)
    assert int8[0, :4].view(torch.int8).tolist() == [18, -36, 9, 127]
    assert int8[0, 4:].view(torch.float32).item() == pytest.approx(7.0 / 127)
    # int4: 16 levels 0.5 apart from -2; a row on them is stored exactly
    x = torch.tensor([[3.0, -2.0, 5.5, 0.5] + [i * 0.5 - 2 for i in range(16)]])
    int4 = kv_quant.quantize(x, 4)  # q = 10, 0, 15, 5, then 0 .. 15
    assert int4[0, :3].tolist() == [10 | (0 << 4), 15 | (5 << 4), 0 | (1 << 4)]
    assert int4[0, -4:].clone().view(torch.float16).tolist() == [0.5, -2.0]
    assert torch.equal(kv_quant.dequantize(int4, 4, torch.float32), x)


def test_int4_rows_fit_their_own_range() -> None:
    """Values all far from zero: the affine row spends its 16 levels on their range, with
    less error than a symmetric 15-level row over [-max, max] would have."""
    x = 10 + torch.rand(200, 64)
    back = kv_quant.dequantize(kv_quant.quantize(x, 4), 4, torch.float32)
    symmetric_step = x.abs().amax(-1, keepdim=True) / 7
    assert (back - x).abs().max() < 0.05 * symmetric_step.min()


@pytest.mark.parametrize("d", [64, 128, 192])
def test_hadamard_is_an_orthogonal_involution(d: int) -> None:
    h = kv_quant.hadamard(d)
    torch.testing.assert_close(h @ h, torch.eye(d), atol=1e-6, rtol=0)
    torch.testing.assert_close(h, h.T)
    assert kv_quant.rotation_block(d) == (64 if d == 192 else d)
    assert KVCodec(8, True).rotation(32, torch.device("cpu")) is None


def test_rotation_spreads_an_outlier_channel() -> None:
    """One large channel: rotated, the int4 error of the other channels drops."""
    x = torch.randn(256, 64)
    x[:, 3] *= 40
    h = kv_quant.hadamard(64)
    plain = kv_quant.dequantize(kv_quant.quantize(x, 4), 4, torch.float32)
    rotated = kv_quant.dequantize(kv_quant.quantize(x @ h, 4), 4, torch.float32) @ h
    assert (rotated - x).pow(2).mean() < 0.5 * (plain - x).pow(2).mean()


BLOCK, KVH, HEADS, D = 4, 2, 4, 64


def _step(chunks: list[SeqChunk], codec: KVCodec | None):
    meta = build_attention_metadata(
        chunks,
        layer_kinds=["full"],
        block_size=BLOCK,
        sliding_window=None,
        dtype=torch.float32,
        device="cpu",
        kv_codec=codec,
    )
    return meta.layers[0]


def _reference(q, kv, pool_f, chunks, codec, h):
    """Float pool holding the dequantized rows rotated back, queries as they are: what the
    quantized path computes, by the identity (qH).(k'H) = q.(k' H^T H) and out' H."""
    stored = kv_quant.as_stored(kv_quant.rotate(kv, h), torch.float32, codec)
    return paged_attention(q, kv_quant.rotate(stored, h), pool_f, _steps_store(chunks), D**-0.5)


def _steps_store(chunks):
    return _step(chunks, None)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_attention_over_a_quantized_pool_is_attention_over_its_dequantized_kv(
    bits: int, rotate: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh prefill, a chunk with cached context, then mixed decode steps: each step's
    output equals the float path over the dequantized (and unrotated) K/V, through the native
    kernels (where built) and through the torch fallback."""
    ran: list[str] = []
    for name in ("decode_attention_q", "prefill_attention_q"):
        kernel = getattr(ops, name)

        def spy(*args, _kernel=kernel, _name=name, **kwargs):
            out = None if path == "torch" else _kernel(*args, **kwargs)
            ran.extend([_name] if out is not None else [])
            return out

        monkeypatch.setattr(ops, name, spy)
    codec = KVCodec(bits, rotate)
    h = codec.rotation(D, torch.device("cpu"))
    pool_q = torch.zeros(16, BLOCK, 2, KVH, codec.row_bytes(D), dtype=torch.uint8)
    pool_f = torch.zeros(16, BLOCK, 2, KVH, D)
    tables = [[3, 7, 1, 9], [12, 0, 5, 6]]
    gen = torch.Generator().manual_seed(bits + rotate)
    steps = [
        [SeqChunk(0, 6, tables[0], None), SeqChunk(0, 6, tables[1], None)],
        [SeqChunk(6, 5, tables[0], None), SeqChunk(6, 3, tables[1], None)],
        [SeqChunk(11, 1, tables[0], None), SeqChunk(9, 1, tables[1], None)],
        [SeqChunk(12, 1, tables[0], None), SeqChunk(10, 4, tables[1], None)],
    ]
    for chunks in steps:
        t = sum(c.q_len for c in chunks)
        q = torch.randn(t, HEADS, D, generator=gen)
        kv = torch.randn(t, 2, KVH, D, generator=gen) * 3
        got = paged_attention(q, kv, pool_q, _step(chunks, codec), D**-0.5)
        want = _reference(q, kv, pool_f, chunks, codec, h)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert kv_quant.dequantize(pool_q[3, 0], bits, torch.float32).abs().sum() > 0
    native = path == "native" and cpu_kernels().native
    assert set(ran) == ({"decode_attention_q", "prefill_attention_q"} if native else set())


def test_a_key_shift_leaves_attention_alone_and_rounds_keys_finer() -> None:
    """Keys with a large common part (as RoPE'd keys have): stored less that part, an int4
    pool attends as a float pool does over the original keys, far closer than without."""
    codec = KVCodec(4, True)
    chunks = [SeqChunk(0, 12, [3, 7, 1], None)]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(12, HEADS, D, generator=gen)
    kv = torch.randn(12, 2, KVH, D, generator=gen)
    common = torch.randn(KVH, D, generator=gen) * 8
    kv[:, 0] += common
    exact = paged_attention(q, kv, torch.zeros(16, BLOCK, 2, KVH, D), _step(chunks, None), 0.125)
    errors = []
    for shift in (None, common):
        pool = torch.zeros(16, BLOCK, 2, KVH, codec.row_bytes(D), dtype=torch.uint8)
        got = paged_attention(q, kv, pool, _step(chunks, codec), 0.125, key_shift=shift)
        errors.append((got - exact).abs().max().item())
    assert errors[1] < 0.25 * errors[0]
    rows = pool[3, :, 0]  # block 3 holds positions 0..3: their keys, shifted, then rotated
    want = (kv[:4, 0] - common) @ kv_quant.hadamard(D)
    bound = kv_quant.error_bound(want, rows, 4) * (1 + 1e-5) + 1e-5
    assert ((kv_quant.dequantize(rows, 4, torch.float32) - want).abs() <= bound).all()


def test_shift_keys_moves_keys_only_and_copies() -> None:
    kv = torch.randn(5, 2, KVH, D)
    shift = torch.randn(KVH, D)
    moved = kv_quant.shift_keys(kv, shift)
    assert torch.equal(moved[:, 0], kv[:, 0] - shift) and torch.equal(moved[:, 1], kv[:, 1])
    assert moved.data_ptr() != kv.data_ptr() and kv_quant.shift_keys(kv, None) is kv
    assert KVCodec(4, False).shifts_keys and not KVCodec(8, True).shifts_keys


@native_only
@pytest.mark.parametrize("bits", BITS)
def test_native_quantize_stores_what_its_torch_twin_stores(bits: int) -> None:
    """int8: the same bytes; int4: the same levels but where float32 sums round a row's
    scale or min apart, and then within the format's bound all the same."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(400, 3, 128, generator=gen) * 4 + torch.randn(400, 3, 1, generator=gen)
    native_rows = ops.kv_quantize(x, bits)
    assert native_rows is not None
    torch_rows = kv_quant.quantize_torch(x, bits)
    same = (native_rows == torch_rows).all(-1).float().mean().item()
    assert same == 1.0 if bits == 8 else same > 0.95
    back = kv_quant.dequantize(native_rows, bits, torch.float32)
    assert ((back - x).abs() <= kv_quant.error_bound(x, native_rows, bits) * (1 + 1e-5)).all()


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 192])
def test_native_rotation_is_the_hadamard_matmul(dtype: torch.dtype, d: int) -> None:
    """Over a view of a wider row (as q sits in the qkv projection) and in its dtype."""
    qkv = torch.randn(7, 5 * d).to(dtype)
    q = qkv[:, : 3 * d].view(7, 3, d)
    got = kv_quant.rotate(q, kv_quant.hadamard(d))
    want = (q.float() @ kv_quant.hadamard(d)).to(dtype)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert ops.hadamard_rows(q, kv_quant.rotation_block(d) or 0) is not None
