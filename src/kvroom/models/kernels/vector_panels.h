// The portable pass over one panel (every target without AVX-512), in 8-float vectors. Up to 3
// rows sweep the whole panel once (4 x 3 accumulators: one stream at decode sizes); 4 to
// MR_MAX = 6 rows sweep it as two halves of 16 columns (2 x 6 accumulators, the half row's two
// vectors and one broadcast x: 15 of AVX2's 16 registers), which reads a panel from cache half
// as often per row as sweeps of 3 rows would.
#pragma once
#include <cstdint>
#include <cstring>

#include "common.h"
#include "panel_layout.h"

namespace {

constexpr int MR_MAX = 6;
constexpr int HALF = PANEL / 2;

// Half h of a panel row as two vectors, and the columns they hold. fp32: columns 16h .. 16h + 15.
// bf16: the row's 32-byte half h holds columns 8h + i (low 16 bits of lane i) and 16 + 8h + i
// (high 16 bits): a shift and a mask widen them (``panel_layout.h``).
inline void hload(const float* row, int h, vf& a, vf& b) {
  a = vld(row + HALF * h);
  b = vld(row + HALF * h + VW);
}
inline void hload(const uint16_t* row, int h, vf& a, vf& b) {
  vu v;
  std::memcpy(&v, row + HALF * h, sizeof v);
  a = (vf)(v << 16);
  b = (vf)(v & (vu{} + 0xffff0000u));
}
template <typename W>
constexpr int column_a(int h) {
  return sizeof(W) == 4 ? HALF * h : VW * h;
}
template <typename W>
constexpr int column_b(int h) {
  return sizeof(W) == 4 ? HALF * h + VW : HALF + VW * h;
}

// acc[m] += x[m, k] * half h of row k, for every k; the next panel is fetched meanwhile (into
// L2: all of row k's lines in this half's sweep, or one line per k where ``rate`` spreads it)
template <int MR, Fetch F, typename W>
inline void k_loop(const float* x, int64_t x_stride, const W* w, int h, int K, const W* next,
                   int64_t lead, int64_t rate, vf (&a)[MR], vf (&b)[MR]) {
  constexpr int LINE = 64 / sizeof(W);
  const int first = h * HALF / LINE * LINE, last = (h + 1) * HALF;  // this half's lines
  for (int k = 0; k < K; ++k) {
    for (int i = first; i < last; i += LINE) __builtin_prefetch(w + (k + 16) * PANEL + i, 0, 3);
    if constexpr (F == Fetch::whole) {
      for (int i = first; i < last; i += LINE) __builtin_prefetch(next + k * PANEL + i, 0, 2);
    } else if constexpr (F == Fetch::spread) {
      if (h == 0) __builtin_prefetch(next + ((lead + k * rate) >> 16) * LINE, 0, 2);
    }
    vf wa, wb;
    hload(w + k * PANEL, h, wa, wb);
    for (int m = 0; m < MR; ++m) {
      const vf xv = vset(x[m * x_stride + k]);
      a[m] += xv * wa;
      b[m] += xv * wb;
    }
  }
}

// Row k of a panel as four vectors: w[i] holds columns ``column_a/b`` of half i / 2.
template <typename W>
inline void wload(const W* row, vf (&w)[4]) {
  hload(row, 0, w[0], w[1]);
  hload(row, 1, w[2], w[3]);
}
template <typename W>
constexpr int column_of(int i) {
  return i % 2 ? column_b<W>(i / 2) : column_a<W>(i / 2);
}

template <int MR, Fetch F, typename W>
inline void whole_k_loop(const float* x, int64_t x_stride, const W* w, int K, const W* next,
                         int64_t lead, int64_t rate, vf (&acc)[MR][4]) {
  constexpr int LINE = 64 / sizeof(W);
  for (int k = 0; k < K; ++k) {
    for (int i = 0; i < PANEL; i += LINE) __builtin_prefetch(w + (k + 16) * PANEL + i, 0, 3);
    if constexpr (F == Fetch::whole) {
      for (int i = 0; i < PANEL; i += LINE) __builtin_prefetch(next + k * PANEL + i, 0, 2);
    } else if constexpr (F == Fetch::spread) {
      __builtin_prefetch(next + ((lead + k * rate) >> 16) * LINE, 0, 2);
    }
    vf wv[4];
    wload(w + k * PANEL, wv);
    for (int m = 0; m < MR; ++m) {
      const vf xv = vset(x[m * x_stride + k]);
      for (int i = 0; i < 4; ++i) acc[m][i] += xv * wv[i];
    }
  }
}

template <int MR, typename W, typename Y>
inline void whole_panel_rows(const float* x, int64_t x_stride, const W* w, const float* bias,
                             int K, Y* y, int64_t y_stride, const W* next, int64_t lead,
                             int64_t rate, bool acc) {
  vf a[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < 4; ++i) a[m][i] = bias ? vld(bias + column_of<W>(i)) : vf{};
  if (!next)
    whole_k_loop<MR, Fetch::none>(x, x_stride, w, K, next, lead, rate, a);
  else if (rate == 0)
    whole_k_loop<MR, Fetch::whole>(x, x_stride, w, K, next, lead, rate, a);
  else
    whole_k_loop<MR, Fetch::spread>(x, x_stride, w, K, next, lead, rate, a);
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < 4; ++i) {
      Y* yi = y + m * y_stride + column_of<W>(i);
      vst(yi, acc ? vld(yi) + vrounded<Y>(a[m][i]) : a[m][i]);
    }
}

// y[0:MR, 0:32] = x[0:MR, :] @ w (+ bias), or y += that product rounded first (``acc``)
template <int MR, typename W, typename Y>
inline void panel_rows(const float* x, int64_t x_stride, const W* w, const float* bias, int K,
                       Y* y, int64_t y_stride, const W* next, int64_t lead, int64_t rate,
                       bool acc) {
  if constexpr (MR <= 3) {
    whole_panel_rows<MR>(x, x_stride, w, bias, K, y, y_stride, next, lead, rate, acc);
    return;
  }
  for (int h = 0; h < 2; ++h) {
    const int ca = column_a<W>(h), cb = column_b<W>(h);
    vf a[MR], b[MR];
    for (int m = 0; m < MR; ++m) {
      a[m] = bias ? vld(bias + ca) : vf{};
      b[m] = bias ? vld(bias + cb) : vf{};
    }
    if (!next)
      k_loop<MR, Fetch::none>(x, x_stride, w, h, K, next, lead, rate, a, b);
    else if (rate == 0 && (sizeof(W) == 4 || h == 0))
      k_loop<MR, Fetch::whole>(x, x_stride, w, h, K, next, lead, rate, a, b);
    else
      k_loop<MR, Fetch::spread>(x, x_stride, w, h, K, next, lead, rate, a, b);
    for (int m = 0; m < MR; ++m) {
      Y* ya = y + m * y_stride + ca;
      Y* yb = y + m * y_stride + cb;
      vst(ya, acc ? vld(ya) + vrounded<Y>(a[m]) : a[m]);
      vst(yb, acc ? vld(yb) + vrounded<Y>(b[m]) : b[m]);
    }
  }
}

}  // namespace
