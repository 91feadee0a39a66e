"""CPU kernel selection, made once per process and logged once.

``cpu_kernels()`` reads the CPU's flags and decides:

* bf16 projections: oneDNN's prepacked bf16 GEMM where the CPU runs it natively (AMX, or
  AVX-512 BF16) or converts fast enough (AVX-512 BW/VL/DQ, AVX-NE-CONVERT: the ISAs oneDNN's
  bf16 reorder requires); on other CPUs (AVX2 only) oneDNN has no bf16 GEMM at all and torch's
  dense bf16 ``mm`` runs 10-100x slower than fp32, so the weights are widened to fp32 once at
  load and every projection computes in fp32 with bf16 inputs and outputs (2x weight memory).
* the native kernels (``build.library``): paged decode and causal prefill attention reading K/V
  in place from the blocks, the fused residual add + RMSNorm and SiLU-GLU; None means the
  torch paths.
* fp32 projections: the native panel GEMM (``ops.panel_gemm``) on AVX-512 and AVX2 + FMA CPUs,
  unless ``KVROOM_PANEL_GEMM=0``; else oneDNN's prepacked GEMM (``layers.prepare_weight``).
  bf16 projections likewise on AVX-512 CPUs without AMX (bf16 panels widened in registers:
  half the bytes of fp32 ones; 0.6x oneDNN's bf16 decode step at 32 rows on an AVX512-BF16
  CPU); with AMX, oneDNN's tiles. On AVX2 the bf16 panel GEMM builds and passes its tests, and
  alone it is as fast as the fp32 one, but a whole bf16 batch ran at a fraction of the
  widened path's rate in its one measurement: bf16 weights stay widened to fp32 there.
* who attends prefill chunks with cached context: on AVX-512 CPUs torch's flash SDPA over the
  gathered blocks under a mask (its tiles run as oneDNN GEMMs: 2.7x the native kernel in bf16
  with AMX, 1.2x in fp32, ``benchmarks/prefill_attention.py``), else the native kernel, which
  reads the keys in place.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache

import torch

from kvroom import threads
from kvroom.models.kernels.build import cpu_flags, library

log = logging.getLogger("kvroom.kernels")


@dataclass(frozen=True)
class CpuKernels:
    isa: str
    """``amx``, ``avx512_bf16``, ``avx512``, ``avx2`` or ``generic``: the best bf16-relevant ISA."""
    bf16_packed: bool
    """bf16 projections run as oneDNN-packed bf16 GEMMs (else widened to fp32)."""
    native: bool
    """The compiled kernels (``cpu_kernels.cpp``) are loaded."""
    sdpa_context_prefill: bool = False
    """Chunks with cached context attend through torch's flash SDPA over gathered blocks (the
    cached keys unmasked, the chunk's own keys causal, merged by log-sum-exp), not the native
    kernel (whose vector code computes in fp32, slower than oneDNN's GEMM tiles)."""
    vector_prefill: bool = False
    """Chunks with cached context run the native kernel's AVX-512 prefill path where the head
    dim is a multiple of 16 (``ops.prefill_vectorized``): on AVX-512 CPUs without AMX (where
    there is AMX, SDPA keeps its bf16 tiles)."""
    panel_gemm: bool = False
    """fp32 projections run as the native AVX-512 panel GEMM (``ops.panel_gemm``), not oneDNN."""
    quant_gemm: bool = False
    """Quantized weights (``models/quant``) run as the native quantized GEMM over int4 / int8
    panels (``quant/panels.py``), unless ``KVROOM_QUANT_GEMM=0``; else their torch path."""
    panel_gemm_bf16: bool = False
    """bf16 projections run as the native panel GEMM (bf16 panels widened to fp32 in registers,
    half the bytes of fp32 ones), not oneDNN: on AVX-512 and AVX2 CPUs without AMX, whose tiles
    oneDNN uses. On AVX2 the alternative is bf16 weights widened to fp32 at load: twice the
    memory, and a single stream of SmolLM2 at 0.55x the speed (one thread, 30.7-35.4 against
    58.5-59.7 ms per token; a 32 x 64 batch alike, 190 against 177 tokens/s)."""

    def panels(self, dtype: torch.dtype) -> bool:
        """Whether ``dtype`` projections run as the native panel GEMM on this CPU."""
        return (dtype == torch.float32 and self.panel_gemm) or (
            dtype == torch.bfloat16 and self.panel_gemm_bf16
        )

    def _prefill(self) -> str:
        if self.vector_prefill:
            return "; AVX-512 attention for prefill with cached context"
        return "; SDPA for prefill with cached context" if self.sdpa_context_prefill else ""

    def describe(self) -> str:
        bf16 = "oneDNN bf16 GEMM" if self.bf16_packed else "fp32 GEMM on widened bf16 weights"
        attn = (
            "native paged decode and prefill attention, fused SiLU-GLU" + self._prefill()
            if self.native
            else "torch SDPA (no native kernels)"
        )
        fp32 = "; fp32 projections: native panel GEMM" if self.panel_gemm else ""
        if self.quant_gemm:
            fp32 += "; quantized projections: native int4/int8 panel GEMM"
        if self.panel_gemm_bf16:
            bf16 = "native panel GEMM"
        wait = threads.describe()
        return (
            f"CPU kernels: {self.isa}; bf16 projections: {bf16}{fp32}; {attn}; idle threads: {wait}"
        )


def _isa(flags: frozenset[str]) -> str:
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "generic"


def _vector_isa(flags: frozenset[str]) -> bool:
    """AVX-512, or AVX2 with FMA: the ISAs the panel GEMM has a fast pass for."""
    return "avx512f" in flags or {"avx2", "fma"} <= flags


@cache
def cpu_kernels() -> CpuKernels:
    """The kernels this CPU runs; decided and logged once per process."""
    flags = cpu_flags()
    packed = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    isa = _isa(flags)
    panels = library() is not None and os.environ.get("KVROOM_PANEL_GEMM", "1") != "0"
    chosen = CpuKernels(
        isa=isa,
        bf16_packed=packed,
        native=library() is not None,
        sdpa_context_prefill=isa in ("amx", "avx512_bf16", "avx512"),
        vector_prefill=isa in ("avx512_bf16", "avx512"),
        panel_gemm=panels and _vector_isa(flags),
        quant_gemm=library() is not None and os.environ.get("KVROOM_QUANT_GEMM", "1") != "0",
        panel_gemm_bf16=panels and _vector_isa(flags) and isa != "amx",
    )
    log.info(chosen.describe())
    return chosen
