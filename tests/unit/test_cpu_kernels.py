"""The native CPU kernels against the torch paths they replace (skipped without a compiler)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_cases import decode_case, prefill_case, prefill_reference, require_native_kernels
from kvroom.models import attention, prefill_attention
from kvroom.models.kernels import CpuKernels, cpu_flags, cpu_kernels, ops
from kvroom.models.layers import rms_norm


@pytest.fixture(autouse=True)
def _native_kernels() -> None:
    require_native_kernels()


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
    q, cache, group, lens = decode_case(dtype, kv_dtype, heads=6, kv_heads=2, lens=[1, 7, 16, 13])
    ref = attention._decode(q, cache, group, 0.25, softcap)
    out = ops.decode_attention(q, cache, group.kv_index, lens, 0.25, softcap)
    assert out is not None
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_decode_attention_many_items_runs_threaded_and_the_same() -> None:
    q, cache, group, lens = decode_case(
        torch.float32, torch.float32, 8, 4, [5, 9, 12, 3, 16, 2, 8, 11]
    )
    ref = attention._decode(q, cache, group, 0.3, None)
    out = ops.decode_attention(q, cache, group.kv_index, lens, 0.3, None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_engine_decode_takes_the_vector_decode_kernel_else_the_prefill_kernel(d, softcap) -> None:
    q, cache, group, lens = decode_case(torch.float32, torch.float32, 6, 2, [1, 7, 16, 13], d=d)
    ref = attention._decode(q, cache, group, 0.25, softcap)  # torch: no lens in the group
    native = dataclasses.replace(group, lens=lens, last_pos=lens - 1, one_row=torch.ones_like(lens))
    out = attention._native_decode(q, cache, native, 0.25, softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    if softcap is None and not ops.decode_vectorized(d):
        kernel = ops.prefill_attention(q, cache, group.kv_index, lens - 1, native.one_row, 0.25)
    else:
        kernel = ops.decode_attention(q, cache, group.kv_index, lens, 0.25, softcap)
    assert torch.equal(out, kernel)


def test_the_vector_decode_path_is_taken_for_common_head_dims() -> None:
    assert [ops.decode_vectorized(d) for d in (64, 128, 256)] == [True] * 3
    assert not ops.decode_vectorized(80)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "tol"),
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.float32, torch.bfloat16, 1e-5),
        (torch.bfloat16, torch.bfloat16, 2**-8),  # fp32 inside, one rounding of the output
    ],
)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("seqs", [3, 12])  # one item per (sequence, kv head); per sequence
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (14, 2)])  # groups of 3 and 7 heads
def test_vector_decode_matches_sdpa_across_units(
    d, dtype, kv_dtype, tol, softcap, seqs, heads, kv_heads
) -> None:
    lens = [1 + (i * 7) % 19 for i in range(seqs)]  # unit 4: rows in 1 to 5 units
    q, cache, group, lens_t = decode_case(dtype, kv_dtype, heads, kv_heads, lens=lens, d=d)
    wide = dataclasses.replace(group, mask=group.mask.float())  # the kernel computes in fp32
    ref = attention._decode(q.float(), cache.float(), wide, 0.25, softcap)
    out = ops.decode_attention(q, cache, group.kv_index, lens_t, 0.25, softcap)
    assert out is not None
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("width", [96, 99])  # whole vectors, and a scalar tail
def test_add_rms_norm_matches_torch(dtype, rows, width) -> None:
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(rows, width, generator=gen).to(dtype)
    delta = torch.randn(rows, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    eps = torch.tensor(1e-6)
    ref_h = h + delta
    ref = rms_norm(ref_h, eps, w)
    out = ops.add_rms_norm(h, delta, 1e-6, w)
    assert out is not None
    assert torch.equal(h, ref_h)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_bf16_residual_add_rounds_exactly_as_torch() -> None:
    """The vector bf16 store rounds to nearest even like torch, NaN and infinities kept."""
    gen = torch.Generator().manual_seed(4)
    h = (torch.randn(3, 64, generator=gen) * 1e3).to(torch.bfloat16)
    delta = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    h[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    ref = h + delta
    assert ops.add_rms_norm(h, delta, 1e-6) is not None
    assert torch.equal(h[:, 3:], ref[:, 3:])
    assert h[0, 0].isnan() and h[0, 1] == float("inf") and h[0, 2] == -float("inf")


def test_sdpa_for_context_prefill_is_part_of_the_description(monkeypatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    text = CpuKernels(isa="amx", bf16_packed=True, native=True, sdpa_context_prefill=True)
    assert text.describe().endswith(
        "fused SiLU-GLU; SDPA for prefill with cached context; "
        "idle threads: OMP_WAIT_POLICY=PASSIVE"
    )


def test_the_choice_is_described_in_one_line(monkeypatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "100000")
    text = CpuKernels(isa="avx2", bf16_packed=False, native=True).describe()
    assert text == (
        "CPU kernels: avx2; bf16 projections: fp32 GEMM on widened bf16 weights; "
        "native paged decode and prefill attention, fused SiLU-GLU; "
        "idle threads: GOMP_SPINCOUNT=100000"
    )


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "atol"),
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.float32, torch.bfloat16, 1e-5),
        (torch.bfloat16, torch.bfloat16, 2e-2),
    ],
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"),
    # AVX-512 path (head dim a multiple of 16): groups of 3, 1, 7 (row vectors 3 + 3 + 1), 4;
    # the generic path: head dims 8 and 24
    [(9, 3, 64), (2, 2, 16), (7, 1, 32), (8, 2, 128), (4, 4, 8), (6, 2, 24)],
)
def test_prefill_attention_matches_causal_attention(dtype, kv_dtype, atol, heads, kv_heads, d):
    chunks = [(0, 37), (50, 19), (3, 2), (0, 70), (96, 33)]  # fresh and with cached context
    q, cache, tables, chunks = prefill_case(dtype, kv_dtype, heads, kv_heads, d, chunks)
    starts = torch.tensor([s for s, _ in chunks])
    q_lens = torch.tensor([n for _, n in chunks])
    out = ops.prefill_attention(q, cache, tables, starts, q_lens, d**-0.5)
    assert out is not None
    ref = prefill_reference(q, cache, tables, chunks, d**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


def test_prefill_attention_declines_head_dims_it_was_not_built_for() -> None:
    q, cache, tables, chunks = prefill_case(torch.float32, torch.float32, 2, 1, 6, [(0, 5)])
    one = torch.tensor([0]), torch.tensor([5])
    assert ops.prefill_attention(q, cache, tables, *one, 0.5) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inter"), [(1, 20), (40, 64)])
def test_silu_mul_matches_torch(dtype, rows, inter) -> None:
    gen = torch.Generator().manual_seed(3)
    gu = (torch.randn(rows, 2 * inter, generator=gen) * 30).to(dtype)  # far into both tails
    gate, up = gu[:, :inter], gu[:, inter:]
    ref = torch.nn.functional.silu(gate).mul_(up)
    out = ops.silu_mul(gu)
    assert out is not None
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-6)
    else:  # the same roundings as torch: at most one bf16 step apart
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-30, rtol=8e-3)


needs_panels = pytest.mark.skipif(not cpu_kernels().panel_gemm, reason="no panel GEMM here")


@needs_panels
@pytest.mark.parametrize("rows", [1, 2, 7, 12, 13, 32, 35, 100, 200, 256, 300, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_gemm_matches_matmul(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=gen)
    x = torch.randn(rows, 300, generator=gen)[:, 50:250]  # strided rows, as views of a step
    b = torch.randn(96, generator=gen) if bias else None
    got = ops.panel_gemm(x, ops.pack_panels(w), b)
    want = x.double() @ w.double() + (0 if b is None else b.double())
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@needs_panels
@pytest.mark.parametrize("columns", [32, 96, 32 * 61])
def test_panel_gemm_is_one_product_whichever_threads_take_the_panels(columns: int) -> None:
    """Threads finish their own runs of panels and then take the others' last panels: with
    more threads than cores (so some wait for a core and others take their panels), and with
    fewer panels than threads, the product is the one thread's, bit for bit."""
    gen = torch.Generator().manual_seed(columns)
    w = ops.pack_panels(torch.randn(160, columns, generator=gen))
    x = torch.randn(40, 160, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = ops.panel_gemm(x, w)
        for n in (2, 3, 5):
            torch.set_num_threads(n)
            for _ in range(5):
                assert torch.equal(ops.panel_gemm(x, w), want), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


@needs_panels
def test_panels_hold_each_column_block_as_one_stream() -> None:
    w = torch.arange(64 * 3, dtype=torch.float32).view(3, 64)
    panels = ops.pack_panels(w)
    assert panels.shape == (2, 3, 32)
    assert torch.equal(panels[1], w[:, 32:])


def test_pack_panels_declines_what_the_kernel_was_not_built_for() -> None:
    assert ops.pack_panels(torch.randn(8, 40)) is None  # width not a multiple of 32
    assert ops.pack_panels(torch.randn(8, 64, dtype=torch.float16)) is None
    bf16 = ops.pack_panels(torch.randn(8, 64, dtype=torch.bfloat16))
    assert (
        (bf16 is not None) == cpu_kernels().panel_gemm_bf16 == cpu_kernels().panels(torch.bfloat16)
    )
    assert cpu_kernels().panels(torch.float32) == cpu_kernels().panel_gemm
    assert not cpu_kernels().panels(torch.float16)


needs_bf16_panels = pytest.mark.skipif(
    not cpu_kernels().panel_gemm_bf16, reason="no native bf16 panel GEMM on this CPU"
)


@needs_bf16_panels
@pytest.mark.parametrize("rows", [1, 13, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panel_gemm_is_the_fp32_product_rounded_once(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=gen).bfloat16()
    x = torch.randn(rows, 300, generator=gen).bfloat16()[:, 50:250]
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    got = ops.panel_gemm(x, ops.pack_panels(w), b)
    want = x.double() @ w.double() + (0 if b is None else b.double())
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    # within half a bf16 ulp of the exact product (plus fp32 summation error)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=2**-8 + 1e-5)


@needs_bf16_panels
def test_bf16_panel_rows_interleave_the_two_halves_of_each_panel() -> None:
    w = torch.arange(64 * 3, dtype=torch.float32).view(3, 64).bfloat16()
    panels = ops.pack_panels(w)
    assert panels.shape == (2, 3, 32) and panels.dtype == torch.bfloat16
    cols = [32 + (i // 2) + 16 * (i % 2) for i in range(32)]  # 32, 48, 33, 49, ...
    assert torch.equal(panels[1], w[:, cols])


@needs_bf16_panels
def test_bf16_panel_gemm_rounds_nan_and_overflow_through() -> None:
    w = torch.ones(2, 32, dtype=torch.bfloat16)
    x = torch.tensor([[3e38, 3e38], [-3e38, -3e38], [float("nan"), 1.0]]).bfloat16()
    got = ops.panel_gemm(x, ops.pack_panels(w))  # fp32 sums: +-6e38 overflow to +-inf
    assert (got[0] == float("inf")).all() and (got[1] == -float("inf")).all()
    assert got[2].isnan().all()


@needs_panels
def test_fp32_projections_are_prepared_as_panels_and_multiply_the_same() -> None:
    from kvroom.models.layers import is_packed, matmul, prepare_weight

    w = torch.randn(48, 64)
    prepared = prepare_weight(w)
    assert prepared.dim() == 3 and is_packed(prepared)
    x = torch.randn(5, 48)
    torch.testing.assert_close(matmul(x, prepared), x @ w, atol=1e-5, rtol=1e-5)


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 13, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_gemm_into_out_adds_the_rounded_product(dtype, rows, bias) -> None:
    """``out=`` adds the product into strided rows in place, as ``out.add_(product)`` would."""
    if dtype == torch.bfloat16 and not cpu_kernels().panel_gemm_bf16:
        pytest.skip("no native bf16 panel GEMM on this CPU")
    gen = torch.Generator().manual_seed(rows)
    panels = ops.pack_panels((torch.randn(160, 64, generator=gen) * 0.1).to(dtype))
    x = torch.randn(rows, 160, generator=gen)
    b = torch.randn(64, generator=gen) if bias else None
    wide = torch.randn(rows, 100, generator=gen).to(dtype)
    h, before = wide[:, 30:94], wide.clone()
    want = h.clone().add_(ops.panel_gemm(x, panels, b))
    assert ops.panel_gemm(x, panels, b, out=h).data_ptr() == h.data_ptr()
    assert torch.equal(h, want)
    assert torch.equal(wide[:, :30], before[:, :30]) and torch.equal(wide[:, 94:], before[:, 94:])


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 11, 12, 32, 37, 300])
def test_panel_glu_is_silu_mul_of_the_gate_up_product_bit_for_bit(dtype, rows) -> None:
    """The GEMM's SiLU-GLU epilogue rounds as ``silu_mul`` over ``panel_gemm``'s product does,
    and agrees with torch's silu(gate) * up."""
    if dtype == torch.bfloat16 and not cpu_kernels().panel_gemm_bf16:
        pytest.skip("no native bf16 panel GEMM on this CPU")
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(160, 2 * 96, generator=gen) * 0.1).to(dtype)
    x = torch.randn(rows, 200, generator=gen)[:, 20:180]  # strided rows
    panels = ops.pack_panels(w)
    got = ops.panel_glu(x, panels)
    assert got.shape == (rows, 96) and got.dtype == dtype
    assert torch.equal(got, ops.silu_mul(ops.panel_gemm(x, panels)))
    gu = (x.double() @ w.double()).to(dtype).float()
    want = torch.nn.functional.silu(gu[:, :96]).to(dtype).float() * gu[:, 96:]
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@needs_panels
def test_silu_projections_take_the_fused_glu_and_others_the_product(monkeypatch) -> None:
    from kvroom.models.layers import glu, prepare_weight

    w = prepare_weight(torch.randn(48, 128))
    x = torch.randn(3, 48)
    calls = []
    monkeypatch.setattr(ops, "silu_mul", lambda gu: calls.append(gu.shape) or None)
    silu = glu(x, w, "silu")  # fused: no [3, 128] product for silu_mul
    assert calls == []
    gelu = glu(x, w, "gelu_tanh")
    gu = x @ torch.cat([w[i] for i in range(w.shape[0])], dim=1)
    want_silu = torch.nn.functional.silu(gu[:, :64]) * gu[:, 64:]
    want_gelu = torch.nn.functional.gelu(gu[:, :64], approximate="tanh") * gu[:, 64:]
    torch.testing.assert_close(silu, want_silu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gelu, want_gelu, atol=1e-5, rtol=1e-5)


def _context_group(tables, chunks) -> prefill_attention.PrefillGroup:
    rows = [0]
    for _, n in chunks:
        rows.append(rows[-1] + n)
    per_chunk = tuple(
        prefill_attention.PrefillChunk(rows[b], n, start, start + n, tables[b : b + 1])
        for b, (start, n) in enumerate(chunks)
    )
    return prefill_attention.PrefillGroup(
        row_start=0,
        num_seqs=len(chunks),
        max_q_len=max(n for _, n in chunks),
        kv_index=tables,
        starts=torch.tensor([s for s, _ in chunks]),
        q_lens=torch.tensor([n for _, n in chunks]),
        chunks=per_chunk,
    )


@pytest.mark.parametrize("large", [False, True])
def test_small_context_chunks_take_the_native_kernel_where_sdpa_wins_large_ones(
    monkeypatch, large
) -> None:
    monkeypatch.setattr(prefill_attention, "_sdpa_context_prefill", lambda q: True)
    monkeypatch.setattr(prefill_attention, "_vector_prefill", lambda q: False)
    chunks = [(5, 30), (0, 12), (40, 8)] + ([(20, 180)] if large else [])  # 180 x 200 scores
    q, cache, tables, chunks = prefill_case(torch.float32, torch.float32, 9, 3, 64, chunks)
    g = _context_group(tables, chunks)
    out = prefill_attention.prefill_full(q, None, cache, g, 0.125, None)
    native = ops.prefill_attention(q, cache, tables, g.starts, g.q_lens, 0.125)
    sdpa = prefill_attention._prefill_chunks(q, cache, g.chunks, 0.125, None)
    if large:  # SDPA's result may differ in the last bit from call to call
        assert not torch.equal(out, native)
        torch.testing.assert_close(out, sdpa, atol=1e-6, rtol=0)
    else:
        assert torch.equal(out, native)
    ref = prefill_reference(q, cache, tables, chunks, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fresh", [False, True])
def test_context_chunks_take_the_vector_path_fresh_ones_sdpa(monkeypatch, fresh) -> None:
    monkeypatch.setattr(prefill_attention, "_sdpa_context_prefill", lambda q: True)
    monkeypatch.setattr(prefill_attention, "_vector_prefill", lambda q: True)
    chunks = [(0, 180), (0, 180)] if fresh else [(20, 180), (5, 30)]
    q, cache, tables, chunks = prefill_case(torch.float32, torch.float32, 9, 3, 64, chunks)
    g = _context_group(tables, chunks)
    if fresh:
        g = dataclasses.replace(g, fresh=True)
    calls = []
    kernel = ops.prefill_attention
    monkeypatch.setattr(
        prefill_attention.native, "prefill_attention", lambda *a: calls.append(1) or kernel(*a)
    )
    # fresh: the step's own K/V rows, which are the pool rows of each table (45 units x 4 = 180)
    own = cache[tables].reshape(-1, *cache.shape[2:]) if fresh else None
    out = prefill_attention.prefill_full(q, own, cache, g, 0.125, None)
    assert calls == ([] if fresh else [1])
    ref = prefill_reference(q, cache, tables, chunks, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_vector_prefill_is_the_avx512_path_of_head_dims_of_16k() -> None:
    built = cpu_kernels().native and "avx512f" in cpu_flags()
    assert ops.prefill_vectorized(64) == built and ops.prefill_vectorized(128) == built
    assert not ops.prefill_vectorized(24) and not ops.prefill_vectorized(8)


@needs_panels
def test_another_build_of_the_source_loads_beside_the_package_one(tmp_path) -> None:
    """``build_library`` (``benchmarks/panel_gemm.py --against``): a second build of the source
    loads in the same process, speaks the same ABI and gives the same product."""
    from kvroom.models.kernels import build

    other = build.build_library(build.SOURCE, tmp_path / "other.so")
    assert other.kvroom_abi_version() == build.ABI_VERSION
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 96, generator=gen), torch.randn(20, 64, generator=gen)
    panels = ops.pack_panels(w)
    calls = []

    class Spy:  # the other build, seen being called
        def kvroom_panel_gemm(self, *args):
            calls.append(args)
            return other.kvroom_panel_gemm(*args)

    assert torch.equal(ops.panel_gemm(x, panels, lib=Spy()), ops.panel_gemm(x, panels))
    assert len(calls) == 1

    class AttentionSpy:  # ``benchmarks/prefill_attention.py context --against``
        def kvroom_prefill_attention(self, *args):
            calls.append(args)
            return other.kvroom_prefill_attention(*args)

    q, cache, tables, chunks = prefill_case(torch.float32, torch.float32, 4, 2, 32, [(5, 20)])
    one = torch.tensor([5]), torch.tensor([20])
    got = ops.prefill_attention(q, cache, tables, *one, 0.25, lib=AttentionSpy())
    assert got is not None and torch.equal(got, ops.prefill_attention(q, cache, tables, *one, 0.25))
    assert len(calls) == 2


def test_a_source_of_another_abi_is_refused(tmp_path) -> None:
    from kvroom.models.kernels import build

    for header in build.sources()[1:]:  # the headers the entry points include
        (tmp_path / header.name).write_bytes(header.read_bytes())
    source = tmp_path / "old.cpp"
    old = build.SOURCE.read_text().replace(
        f"kvroom_abi_version() {{ return {build.ABI_VERSION}; }}",
        "kvroom_abi_version() { return 1; }",
    )
    source.write_text(old)
    with pytest.raises(OSError, match="kernels ABI 1, expected"):
        build.build_library(source, tmp_path / "old.so")


def test_another_build_needs_a_compiler(tmp_path, monkeypatch) -> None:
    from kvroom.models.kernels import build

    monkeypatch.setattr(build, "_compiler", lambda: None)
    with pytest.raises(OSError, match="no C\\+\\+ compiler"):
        build.build_library(build.SOURCE, tmp_path / "other.so")
