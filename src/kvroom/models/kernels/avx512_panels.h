// The AVX-512 pass over one panel: up to 12 rows into 24 accumulators (12 rows x 2 vectors of
// 16 columns).
#pragma once
#include <immintrin.h>

#include "avx512_common.h"
#include "panel_layout.h"

namespace {

constexpr int MR_MAX = 12;  // rows per pass: 24 accumulators of the 32 AVX-512 registers

// Weights are fp32, or bf16 widened to fp32 as they are loaded (a shift: exact), so every
// product and sum is fp32 either way; bf16 panels stream half the bytes. (AVX512-BF16's pair
// dot product measured 1.3x slower than this at 32 rows on a CPU without AMX: it issues at
// half the FMA rate.) y is fp32, or bf16 rounded to nearest even as torch rounds.

// One k row of a panel as two vectors of 16 columns. A bf16 panel row holds column c in its
// 16-bit slot 2c and column 16 + c in slot 2c + 1, so one 64-byte load and two bit operations
// give both, each bf16 in the high half of an fp32 lane (no shuffle).
inline void wload(const float* p, __m512& w0, __m512& w1) {
  w0 = _mm512_load_ps(p);
  w1 = _mm512_load_ps(p + 16);
}
inline void wload(const uint16_t* p, __m512& w0, __m512& w1) {
  const __m512i v = _mm512_load_si512(p);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  w1 = _mm512_castsi512_ps(_mm512_and_si512(v, high));
}

// The k loop of ``panel_rows``, one per way of fetching the next panel: no branch per k for it,
// and the registers it held are free. With both lines of an fp32 row fetched into L1 (the
// first only, before), 1.04-1.09x at 32 to 512 rows in fp32; bf16 rows are one line: no gain at
// 32-512 rows, 1-6% slower at one row (three runs; the code for one row is the same).
template <int MR, Fetch F, typename W>
inline void k_loop(const float* x, int64_t x_stride, const W* w, int K, const W* next,
                   int64_t lead, int64_t rate, __m512 (&lo)[MR], __m512 (&hi)[MR]) {
  constexpr int LINE = 64 / sizeof(W);
  for (int k = 0; k < K; ++k) {
    for (int i = 0; i < PANEL; i += LINE)  // this panel's row k + 16 into L1
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + 16) * PANEL + i), _MM_HINT_T0);
    if constexpr (F == Fetch::whole) {
      for (int i = 0; i < PANEL; i += LINE)
        _mm_prefetch(reinterpret_cast<const char*>(next + k * PANEL + i), _MM_HINT_T1);
    } else if constexpr (F == Fetch::spread) {
      _mm_prefetch(reinterpret_cast<const char*>(next + ((lead + k * rate) >> 16) * LINE),
                   _MM_HINT_T1);
    }
    __m512 w0, w1;
    wload(w + k * PANEL, w0, w1);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * x_stride + k]);
      lo[m] = _mm512_fmadd_ps(xv, w0, lo[m]);
      hi[m] = _mm512_fmadd_ps(xv, w1, hi[m]);
    }
  }
}

// y[0:MR, 0:32] = x[0:MR, :] @ w (+ bias); ``next`` (the thread's next panel, or null) is
// fetched into L2 meanwhile, so its first pass finds it there rather than in DRAM: every line
// of each k row where rate is 0 (one pass), else one line per k, line (lead + k * rate) >> 16.
template <int MR, typename W, typename Y>
inline void panel_rows(const float* x, int64_t x_stride, const W* w, const float* bias, int K,
                       Y* y, int64_t y_stride, const W* next, int64_t lead, int64_t rate,
                       bool acc) {
  __m512 lo[MR], hi[MR];
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    lo[m] = b0;
    hi[m] = b1;
  }
  if (!next)
    k_loop<MR, Fetch::none>(x, x_stride, w, K, next, lead, rate, lo, hi);
  else if (rate == 0)
    k_loop<MR, Fetch::whole>(x, x_stride, w, K, next, lead, rate, lo, hi);
  else
    k_loop<MR, Fetch::spread>(x, x_stride, w, K, next, lead, rate, lo, hi);
  if (acc)  // y += the product, rounded first as torch's matmul then add_ round it
    for (int m = 0; m < MR; ++m) {
      lo[m] = _mm512_add_ps(ld16(y + m * y_stride), yrounded<Y>(lo[m]));
      hi[m] = _mm512_add_ps(ld16(y + m * y_stride + 16), yrounded<Y>(hi[m]));
    }
  for (int m = 0; m < MR; ++m) {
    ystore(y + m * y_stride, lo[m]);
    ystore(y + m * y_stride + 16, hi[m]);
  }
}

}  // namespace
