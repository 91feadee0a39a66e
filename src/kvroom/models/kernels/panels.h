// The panel GEMM's driver, the same on every ISA: rows in passes, panels shared out among the
// threads. A pass over one panel (``panel_rows<MR>``, at most ``MR_MAX`` rows) comes from the
// ISA's header: AVX-512 intrinsics, or 8-float vectors everywhere else (AVX2 on x86-64-v3).
#pragma once
#include <omp.h>

#include <atomic>
#include <type_traits>
#include <cstdint>
#include <vector>

#include "panel_layout.h"
#include "portable.h"
#if defined(__AVX512F__)
#include "avx512_panels.h"
#else
#include "vector_panels.h"
#endif

namespace {
template <int MR, typename W, typename Y>
inline void rows_of(int64_t rows, const float* x, int64_t x_stride, const W* w,
                    const float* bias, int K, Y* y, int64_t y_stride, const W* next,
                    int64_t lead, int64_t rate, bool acc = false) {
  if constexpr (MR > 0) {
    if (rows == MR)
      panel_rows<MR>(x, x_stride, w, bias, K, y, y_stride, next, lead, rate, acc);
    else
      rows_of<MR - 1>(rows, x, x_stride, w, bias, K, y, y_stride, next, lead, rate, acc);
  }
}

// M rows in equal passes of at most MR_MAX (32 rows = 11 + 11 + 10): pass(m, rows, lead, rate)
// for each, where (lead, rate) spread the fetch of the next panel over all passes (rate: lines
// per k, 16.16 fixed point): 1.2x at 32 and 64 rows against fetching it all in the first pass,
// whose burst outran what memory delivers while the later passes fetched nothing.
template <typename W, typename Pass>
inline void passes_of(int64_t M, int K, Pass&& pass) {
  const int64_t passes = (M + MR_MAX - 1) / MR_MAX;
  const int64_t lines = K * PANEL * static_cast<int64_t>(sizeof(W)) / 64;
  const int64_t rate = passes > 1 ? (lines << 16) / (passes * K) : 0;
  int64_t m = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t rows = (M - m) / (passes - p);
    pass(m, rows, p * K * rate, rate);
    m += rows;
  }
}

// Large steps (``blocked``: fp32 results, at least BLOCKED_ROWS rows) sweep a panel in K blocks
// of KB rows, each block (16 KiB of fp32) read from L1 by every pass of rows, not from L2: a
// layer's four SmolLM2 projections took 14.0 instead of 20.4 ms at 128 rows, 63.3 instead of
// 79.7 at 512 (AVX2, one thread, CPU time; oneDNN 14.1 and 59.7). The product goes to ``t``
// ([M, 32], fp32, one buffer per thread), summed block after block.
constexpr int KB = 128;
constexpr int64_t BLOCKED_ROWS = 64;

inline bool blocked(int64_t M, int K) {
#if defined(__AVX512F__)
  (void)M, (void)K;
  return false;  // measured on AVX2 only: the AVX-512 pass keeps its single sweep
#else
  return M >= BLOCKED_ROWS && K > KB;
#endif
}

template <typename W>
inline void blocked_product(const float* x, int64_t x_stride, const W* w, const float* bias,
                            int64_t M, int K, float* t) {
  for (int k0 = 0; k0 < K; k0 += KB) {
    const int kb = K - k0 < KB ? K - k0 : KB;
    passes_of<W>(M, kb, [&](int64_t m, int64_t rows, int64_t lead, int64_t rate) {
      rows_of<MR_MAX>(rows, x + m * x_stride + k0, x_stride, w + k0 * PANEL,
                      k0 ? nullptr : bias, kb, t + m * PANEL, PANEL,
                      static_cast<const W*>(nullptr), lead, rate, k0 > 0);
    });
  }
}

inline std::vector<float>& blocked_buffer(int64_t floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(floats);
  return buf;
}

template <typename W, typename Y>
inline void panel(const float* x, int64_t x_stride, const W* w, const float* bias, int64_t M,
                  int K, Y* y, int64_t y_stride, const W* next, bool acc) {
  if (std::is_same_v<Y, float> && blocked(M, K)) {
    float* t = blocked_buffer(M * PANEL).data();
    blocked_product(x, x_stride, w, bias, M, K, t);
    for (int64_t r = 0; r < M; ++r)  // y = t, or y += t (the product, then the add)
      for (int c = 0; c < PANEL; c += VW) {
        Y* yc = y + r * y_stride + c;
        vst(yc, acc ? vld(yc) + vld(t + r * PANEL + c) : vld(t + r * PANEL + c));
      }
    return;
  }
  passes_of<W>(M, K, [&](int64_t m, int64_t rows, int64_t lead, int64_t rate) {
    rows_of<MR_MAX>(rows, x + m * x_stride, x_stride, w, bias, K, y + m * y_stride, y_stride,
                    next, lead, rate, acc);
  });
}

// y[:, 32p : 32p + 32] = silu(x @ gate panel p) * (x @ up panel p): per pass, the gate block
// goes to a buffer, the up block to y, and ``silu_mul_span`` combines them there while both are
// in L1, rounded as gate_up's output then ``silu_mul`` would round them. The [M, 2I] product
// is never written, and no separate SiLU-GLU pass runs (a parallel one, for large steps).
template <typename W, typename Y>
inline void glu_panel(const float* x, int64_t x_stride, const W* gate, const W* up, int64_t M,
                      int K, Y* y, int64_t y_stride, const W* next_gate, const W* next_up) {
  if constexpr (std::is_same_v<Y, float>) {
    if (blocked(M, K)) {
      float* g = blocked_buffer(2 * M * PANEL).data();
      float* u = g + M * PANEL;
      blocked_product(x, x_stride, gate, nullptr, M, K, g);
      blocked_product(x, x_stride, up, nullptr, M, K, u);
      for (int64_t r = 0; r < M; ++r)
        silu_mul_span(g + r * PANEL, u + r * PANEL, y + r * y_stride, PANEL);
      return;
    }
  }
  Y g[MR_MAX * PANEL];
  passes_of<W>(M, K, [&](int64_t m, int64_t rows, int64_t lead, int64_t rate) {
    const float* xm = x + m * x_stride;
    Y* ym = y + m * y_stride;
    rows_of<MR_MAX>(rows, xm, x_stride, gate, nullptr, K, g, PANEL, next_gate, lead, rate);
    rows_of<MR_MAX>(rows, xm, x_stride, up, nullptr, K, ym, y_stride, next_up, lead, rate);
    for (int64_t r = 0; r < rows; ++r)
      silu_mul_span(g + r * PANEL, ym + r * y_stride, ym + r * y_stride, PANEL);
  });
}

// A contiguous run of panels, [front, back) packed in one word: its thread takes panels from
// the front, a thread done with its own run takes them from the back.
class PanelRun {
 public:
  void reset(int64_t front, int64_t back) {
    span_.store(static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back),
                std::memory_order_relaxed);
  }
  int64_t take_front() { return take(true); }
  int64_t take_back() { return take(false); }

 private:
  int64_t take(bool front) {  // the panel taken, or -1 once the run is empty
    uint64_t s = span_.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = s >> 32, b = s & 0xffffffffu;
      if (f >= b) return -1;
      const uint64_t next = front ? (f + 1) << 32 | b : f << 32 | (b - 1);
      if (span_.compare_exchange_weak(s, next, std::memory_order_relaxed))
        return static_cast<int64_t>(front ? f : b - 1);
    }
  }
  alignas(64) std::atomic<uint64_t> span_{0};
};

// Each thread a contiguous run of panels, so its next panel is the one after (fetched while it
// works on this one). A thread that is through its run takes the last panels of the others:
// where another process holds one of the cores for a while (a client on the same machine), the
// thread that kept its core does that core's share instead of waiting for it at the barrier.
template <typename F>
void share_panels(int64_t panels, F&& run_panel) {  // run_panel(p, next panel or -1)
  const int team = omp_get_max_threads();
  std::vector<PanelRun> runs(team);
  for (int t = 0; t < team; ++t) runs[t].reset(panels * t / team, panels * (t + 1) / team);
#pragma omp parallel
  {
    const int t = omp_get_thread_num();
    const int64_t end = panels * (t + 1) / team;
    for (int64_t p; (p = runs[t].take_front()) >= 0;) run_panel(p, p + 1 < end ? p + 1 : -1);
    for (int i = 1; i <= team; ++i) {  // the others' runs (all, if the team came short)
      PanelRun& other = runs[(t + i) % team];
      for (int64_t p; (p = other.take_back()) >= 0;) run_panel(p, p - 1);
    }
  }
}

template <typename W, typename Y>
void panel_gemm(const float* x, int64_t x_stride, const W* w, const float* bias, Y* y,
                int64_t y_stride, int64_t M, int K, int64_t N, bool acc) {
  const int64_t panel_size = static_cast<int64_t>(K) * PANEL;
  share_panels(N / PANEL, [&](int64_t p, int64_t next) {
    panel(x, x_stride, w + p * panel_size, bias ? bias + p * PANEL : nullptr, M, K,
          y + p * PANEL, y_stride, next >= 0 ? w + next * panel_size : nullptr, acc);
  });
}

// y[M, I] = silu(x @ W[:, :I]) * (x @ W[:, I:]) for gate_up's 2I / 32 panels, I = N.
template <typename W, typename Y>
void panel_glu(const float* x, int64_t x_stride, const W* w, Y* y, int64_t M, int K,
               int64_t N) {
  const int64_t panel_size = static_cast<int64_t>(K) * PANEL, up = N / PANEL * panel_size;
  share_panels(N / PANEL, [&](int64_t p, int64_t next) {
    const W* g = w + p * panel_size;
    const W* ng = next >= 0 ? w + next * panel_size : nullptr;
    glu_panel(x, x_stride, g, g + up, M, K, y + p * PANEL, N, ng, ng ? ng + up : nullptr);
  });
}
}  // namespace
