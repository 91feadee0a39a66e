"""The kernels' sources build for every x86-64 level whatever CPU runs the tests (a level's code
that does not compile fails here, not on a user's machine), and every level this CPU can run
computes what torch computes."""

from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import pytest
import torch

from gguf_models import random_blocks
from kernel_cases import decode_case, glu_close, prefill_case, prefill_reference, product_bound
from kvroom.models import attention, kv_quant
from kvroom.models.kernels import build, cpu_flags, ops
from kvroom.models.layers import rms_norm
from kvroom.models.quant.gguf_repack import repack
from kvroom.models.quant.panels import QuantPanels

pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels on an x86-64 CPU"),
    pytest.mark.skipif(not build.has_compiler(), reason="no C++ compiler (g++)"),
]

LEVEL_FLAGS = {  # what each level adds to the one below it (/proc/cpuinfo names)
    "x86-64-v2": {"sse4_2", "ssse3", "popcnt", "cx16"},
    "x86-64-v3": {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}


def runs_here(level: str) -> bool:
    levels = list(LEVEL_FLAGS)
    needed = set().union(*(LEVEL_FLAGS[lv] for lv in levels[: levels.index(level) + 1]))
    return needed <= cpu_flags()


@pytest.fixture(scope="session")
def level_build(tmp_path_factory):
    """``level -> path`` of the sources compiled for it, once per session."""
    built: dict[str, Path] = {}

    def compiled(level: str) -> Path:
        if level not in built:
            target = tmp_path_factory.mktemp("levels") / f"kvroom_{level}.so"
            try:
                build.compile_library(build.SOURCE, target, march=level)
            except subprocess.CalledProcessError as exc:
                pytest.fail(f"the kernels do not build for {level}:\n{exc.stderr[-3000:]}")
            built[level] = target
        return built[level]

    return compiled


@pytest.fixture(scope="session")
def level_libs(level_build):
    """``level -> loaded library``, once per session, for the levels this CPU runs."""
    loaded: dict[str, ctypes.CDLL] = {}

    def lib(level: str) -> ctypes.CDLL:
        if level not in loaded:
            loaded[level] = build.load_library(level_build(level))
        return loaded[level]

    return lib


@pytest.fixture(params=list(LEVEL_FLAGS))
def level_lib(request, level_libs) -> ctypes.CDLL:
    """The kernels built for a level this CPU runs, loaded (the others only build, in
    ``test_the_sources_build_for_every_level``)."""
    if not runs_here(request.param):
        pytest.skip(f"this CPU does not run {request.param}")
    return level_libs(request.param)


@pytest.mark.parametrize("level", list(LEVEL_FLAGS))
def test_the_sources_build_for_every_level(level_build, level) -> None:
    assert level_build(level).stat().st_size > 0


DTYPES = [
    (torch.float32, torch.float32, 1e-5),
    (torch.float32, torch.bfloat16, 1e-5),
    (torch.bfloat16, torch.bfloat16, 2e-2),
]


@pytest.mark.parametrize(("dtype", "kv_dtype", "atol"), DTYPES)
@pytest.mark.parametrize(("d", "softcap"), [(16, None), (64, None), (64, 5.0), (128, None)])
def test_decode_attention(level_lib, dtype, kv_dtype, atol, d, softcap) -> None:
    q, cache, group, lens = decode_case(dtype, kv_dtype, 6, 2, [1, 7, 16, 13, 40], d=d)
    want = attention._decode(q, cache, group, d**-0.5, softcap)
    got = ops.decode_attention(q, cache, group.kv_index, lens, d**-0.5, softcap, lib=level_lib)
    assert got is not None
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


@pytest.mark.parametrize(("dtype", "kv_dtype", "atol"), DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (7, 1, 32), (6, 2, 24)])
def test_prefill_attention(level_lib, dtype, kv_dtype, atol, heads, kv_heads, d) -> None:
    chunks = [(0, 37), (50, 19), (3, 2), (96, 33)]
    q, cache, tables, chunks = prefill_case(dtype, kv_dtype, heads, kv_heads, d, chunks)
    starts, q_lens = torch.tensor([s for s, _ in chunks]), torch.tensor([n for _, n in chunks])
    got = ops.prefill_attention(q, cache, tables, starts, q_lens, d**-0.5, lib=level_lib)
    assert got is not None
    want = prefill_reference(q, cache, tables, chunks, d**-0.5)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


QUANT_KV = [  # (query dtype, bits, atol): the reference is float32 over the dequantized K/V
    (torch.float32, 8, 1e-5),
    (torch.float32, 4, 1e-5),
    (torch.bfloat16, 8, 2e-2),
    (torch.bfloat16, 4, 2e-2),
]


def _quantized(cache: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float pool as int8/int4 rows, and those rows dequantized (the reference's pool)."""
    rows = kv_quant.quantize(cache.float(), bits)
    return rows, kv_quant.dequantize(rows, bits, torch.float32)


@pytest.mark.parametrize(("dtype", "bits", "atol"), QUANT_KV)
@pytest.mark.parametrize(("d", "softcap"), [(16, None), (64, None), (64, 5.0), (128, None)])
def test_decode_attention_over_int_kv(level_lib, dtype, bits, atol, d, softcap) -> None:
    q, cache, group, lens = decode_case(torch.float32, torch.float32, 6, 2, [1, 7, 16, 13, 40], d)
    q = q if dtype == torch.float32 else q.to(dtype)
    rows, values = _quantized(cache * 3, bits)
    want = attention._decode(q.float(), values, group, d**-0.5, softcap)
    got = ops.decode_attention_q(q, rows, bits, group.kv_index, lens, d**-0.5, softcap, level_lib)
    assert got is not None and got.dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else 2**-8  # bf16 output: rounded once
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "bits", "atol"), QUANT_KV)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (7, 1, 32)])
def test_prefill_attention_over_int_kv(level_lib, dtype, bits, atol, heads, kv_heads, d) -> None:
    chunks = [(0, 37), (50, 19), (3, 2), (96, 33)]
    q, cache, tables, chunks = prefill_case(dtype, torch.float32, heads, kv_heads, d, chunks)
    rows, values = _quantized(cache * 3, bits)
    starts, q_lens = torch.tensor([s for s, _ in chunks]), torch.tensor([n for _, n in chunks])
    got = ops.prefill_attention_q(q, rows, bits, tables, starts, q_lens, d**-0.5, lib=level_lib)
    assert got is not None
    want = prefill_reference(q.float(), values, tables, chunks, d**-0.5)
    rtol = 1e-5 if dtype == torch.float32 else 2**-8  # bf16 output: rounded once
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(level_lib, dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    h, delta, w = (torch.randn(*s, generator=gen).to(dtype) for s in [(9, 100), (9, 100), (100,)])
    want_h = h + delta
    want = rms_norm(want_h, torch.tensor(1e-6), w)
    got = ops.add_rms_norm(h, delta, 1e-6, w, lib=level_lib)
    assert got is not None
    assert torch.equal(h, want_h)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(level_lib, dtype) -> None:
    gu = (torch.randn(5, 2 * 44, generator=torch.Generator().manual_seed(5)) * 30).to(dtype)
    want = torch.nn.functional.silu(gu[:, :44]).mul_(gu[:, 44:])
    got = ops.silu_mul(gu, lib=level_lib)
    assert got is not None
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 13, 32, 70])
def test_panel_gemm(level_lib, dtype, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(150, 96, generator=gen).to(dtype)
    x = torch.randn(rows, 200, generator=gen)[:, 20:170]  # strided rows, as views of a step
    bias = torch.randn(96, generator=gen)
    got = ops.panel_gemm(x, ops.panels_of(w), bias, lib=level_lib)
    want = x.double() @ w.double() + bias.double()
    assert got.dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=rtol)
    into = torch.randn(rows, 96, generator=gen).to(dtype)
    expected = into.clone().add_(ops.panel_gemm(x, ops.panels_of(w), lib=level_lib))
    ops.panel_gemm(x, ops.panels_of(w), lib=level_lib, out=into)
    assert torch.equal(into, expected)  # the product rounded first, then added


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_panel_glu_is_silu_mul_of_the_product(level_lib, dtype, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(64, 2 * 64, generator=gen) * 0.5).to(dtype)
    x = torch.randn(rows, 64, generator=gen)
    product = ops.panel_gemm(x, ops.panels_of(w), lib=level_lib)
    want = ops.silu_mul(product, lib=level_lib)
    assert torch.equal(ops.panel_glu(x, ops.panels_of(w), lib=level_lib), want)


@pytest.mark.parametrize("rows", [1, 2, 40])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q6_K", "Q8_0"])
def test_quant_gemm(level_lib, type_name, rows) -> None:
    w = repack(random_blocks(type_name, 64, 512, 3), type_name, 64, 512)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(5))
    want, bound = product_bound(x, w.dequantize())
    panels = QuantPanels(w)
    assert ((panels.matmul(x, lib=level_lib).double() - want).abs() <= bound + 1e-30).all()
    assert glu_close(panels.glu(x, lib=level_lib), x, w.dequantize())
