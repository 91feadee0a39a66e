// Weight-only quantized GEMM: y[M, N] = x[M, K] @ W (+ bias) for a weight that stays in the
// integer layout of ``models/quant`` as it streams from memory, cut into column panels as the
// float panels are (``panel_layout.h``), so the same thread sharing runs it.
//
// Panel p holds the output columns 32p .. 32p + 31 (rows of ``QuantizedLinear``). Per K row,
// the 32 values are placed so that the 8-float vector i of columns 8i .. 8i + 7 comes out of
// the row's 32-bit words with shifts and masks alone (no byte shuffles):
//
//   int4  16 bytes = 4 words; word d, nibble n (bits 4n .. 4n + 3) holds column
//         8 (n / 2) + 4 (n % 2) + d: with the 16 bytes loaded into both halves of a vector,
//         lane i shifted right by 8j + 4 (i / 4) gives column 8j + i
//   int8  32 bytes = 8 words; word i, byte j holds column 8j + i
//
// and per group of G K rows, 32 scales (and 32 mins where affine), float16 or float32, in
// column order. w = s * q + m (int4 without mins: s * (q - 8)).
//
// Decode sizes (M <= FUSED_ROWS) multiply the values as they are unpacked, the scales applied
// once per group: y += s * (x . q) + m * sum(x), where x . q and sum(x) run over the group.
// Larger steps dequantize a K block of QKB rows into an L1 buffer of fp32 rows and every pass of
// rows multiplies it there (``panel_rows``, the float panels' pass), the product summed block
// after block in a [M, 32] fp32 buffer. Either way the weights are read from memory once per
// step, at a quarter (int8) or an eighth (int4) of fp32's bytes.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "panels.h"

namespace {

struct QuantWeight {
  const uint8_t* q;    // [P][K][16] (int4) or [P][K][32] (int8)
  const void* scales;  // [P][K / G][32]
  const void* mins;    // the same, or null
  int bits;            // 4 or 8
  int group;           // G, a divisor of K
  bool half;           // scales and mins are float16 (else float32)
};

constexpr int FUSED_ROWS = 2;

// K rows per dequantized block (32 KiB of fp32): at 32 rows, 128, 256 and 576 (a whole
// SmolLM2 panel) measured alike within the noise of a shared machine, all about 0.9-1.1x the
// fp32 panels' time (AVX2, one thread, CPU time; the dequantizing is the difference).
constexpr int QKB = 256;

// One panel row's 32 values as four vectors of 8 floats (vector j: columns 8j .. 8j + 7), int4
// less OFFSET (8: symmetric), or int8.
#if defined(__AVX2__)
template <int BITS, int OFFSET>
inline void row_values(const uint8_t* q, vf (&v)[4]) {
  if constexpr (BITS == 4) {
    const __m256i words =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m256i mask = _mm256_set1_epi32(15), off = _mm256_set1_epi32(OFFSET);
    for (int j = 0; j < 4; ++j) {
      const __m256i shift = _mm256_setr_epi32(8 * j, 8 * j, 8 * j, 8 * j, 8 * j + 4, 8 * j + 4,
                                              8 * j + 4, 8 * j + 4);
      const __m256i lanes = _mm256_and_si256(_mm256_srlv_epi32(words, shift), mask);
      v[j] = (vf)_mm256_cvtepi32_ps(OFFSET ? _mm256_sub_epi32(lanes, off) : lanes);
    }
  } else {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    v[0] = (vf)_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 24), 24));
    v[1] = (vf)_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 16), 24));
    v[2] = (vf)_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 8), 24));
    v[3] = (vf)_mm256_cvtepi32_ps(_mm256_srai_epi32(words, 24));
  }
}
#else
template <int BITS, int OFFSET>
inline void row_values(const uint8_t* q, vf (&v)[4]) {
  for (int c = 0; c < PANEL; ++c) {
    const int j = c / 8, i = c % 8;
    int value;
    if constexpr (BITS == 4) {
      const int word = i % 4, nibble = 2 * j + i / 4;
      value = (q[4 * word + nibble / 2] >> (4 * (nibble % 2)) & 15) - OFFSET;
    } else {
      value = static_cast<int8_t>(q[4 * i + j]);
    }
    v[j][i] = static_cast<float>(value);
  }
}
#endif

// 8 scale values at p (float16 or float32) as floats
inline vf params8(const void* p, bool half) {
  if (!half) return vld(static_cast<const float*>(p));
#if defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
#else
  typedef _Float16 vhf __attribute__((vector_size(16)));
  vhf h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vf);
#endif
}

// group g's 32 scales (and mins) of panel p as four vectors each
template <bool AFFINE>
inline void group_params(const QuantWeight& w, int64_t p, int64_t groups, int64_t g, vf (&s)[4],
                         vf (&m)[4]) {
  const int size = w.half ? 2 : 4;
  const int64_t at = (p * groups + g) * PANEL * size;
  for (int i = 0; i < 4; ++i) {
    s[i] = params8(static_cast<const char*>(w.scales) + at + i * VW * size, w.half);
    m[i] = AFFINE ? params8(static_cast<const char*>(w.mins) + at + i * VW * size, w.half) : vf{};
  }
}

template <int BITS>
constexpr int row_bytes() {
  return BITS == 4 ? PANEL / 2 : PANEL;
}

// rows k0 .. k0 + kb of panel p as fp32 into t ([kb][32])
template <int BITS, bool AFFINE>
inline void dequantize_rows(const QuantWeight& w, int64_t p, int K, int k0, int kb, float* t) {
  constexpr int OFFSET = BITS == 4 && !AFFINE ? 8 : 0;
  const uint8_t* q = w.q + (p * K + k0) * row_bytes<BITS>();
  vf s[4], m[4];
  for (int r = 0, next_group = 0; r < kb; ++r, q += row_bytes<BITS>()) {
    if (r == next_group) {  // a new group (or the block's first row)
      const int64_t g = (k0 + r) / w.group;
      next_group = static_cast<int>((g + 1) * w.group - k0);
      group_params<AFFINE>(w, p, K / w.group, g, s, m);
    }
    vf v[4];
    row_values<BITS, OFFSET>(q, v);
    for (int i = 0; i < 4; ++i) vst(t + r * PANEL + i * VW, AFFINE ? v[i] * s[i] + m[i] : v[i] * s[i]);
  }
}

// o[MR, 32] = x @ panel p for decode sizes: per group, x . q and sum(x) as the values are
// unpacked, then s * (x . q) + m * sum(x). One row keeps two sets of dot products (even and odd
// k), so that 8 FMA chains, not 4, hide the FMA's latency; two rows have 8 already.
template <int BITS, bool AFFINE, int MR>
inline void fused_product(const float* x, int64_t x_stride, const QuantWeight& w, int64_t p,
                          int K, float* o) {
  constexpr int OFFSET = BITS == 4 && !AFFINE ? 8 : 0;
  constexpr int BYTES = row_bytes<BITS>();
  constexpr int SETS = MR == 1 ? 2 : 1;
  const int64_t groups = K / w.group;
  const uint8_t* q = w.q + p * K * BYTES;
  vf acc[MR][4] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vf dot[SETS][MR][4] = {};
    float sum[MR] = {};
    const int k_end = static_cast<int>((g + 1) * w.group);
    for (int k = static_cast<int>(g * w.group); k < k_end; k += SETS) {
      for (int set = 0; set < SETS && k + set < k_end; ++set, q += BYTES) {
        __builtin_prefetch(q + 16 * BYTES, 0, 3);
        vf v[4];
        row_values<BITS, OFFSET>(q, v);
        for (int r = 0; r < MR; ++r) {
          const float xk = x[r * x_stride + k + set];
          const vf xv = vset(xk);
          if constexpr (AFFINE) sum[r] += xk;
          for (int j = 0; j < 4; ++j) dot[set][r][j] += xv * v[j];
        }
      }
    }
    vf s[4], m[4];
    group_params<AFFINE>(w, p, groups, g, s, m);
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) {
        const vf d = SETS == 2 ? dot[0][r][j] + dot[SETS - 1][r][j] : dot[0][r][j];
        acc[r][j] += AFFINE ? d * s[j] + m[j] * sum[r] : d * s[j];
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) vst(o + r * PANEL + j * VW, acc[r][j]);
}

// o[M, 32] = x @ panel p of w, in fp32
template <int BITS, bool AFFINE>
inline void quant_product(const float* x, int64_t x_stride, const QuantWeight& w, int64_t p,
                          int64_t M, int K, float* t, float* o) {
  if (M == 1) return fused_product<BITS, AFFINE, 1>(x, x_stride, w, p, K, o);
  if (M == 2) return fused_product<BITS, AFFINE, 2>(x, x_stride, w, p, K, o);
  static_assert(FUSED_ROWS == 2);
  for (int k0 = 0; k0 < K; k0 += QKB) {  // K blocks dequantized, each multiplied in L1
    const int kb = K - k0 < QKB ? K - k0 : QKB;
    dequantize_rows<BITS, AFFINE>(w, p, K, k0, kb, t);
    passes_of<float>(M, kb, [&](int64_t m, int64_t rows, int64_t, int64_t) {
      rows_of<MR_MAX>(rows, x + m * x_stride + k0, x_stride, t, nullptr, kb, o + m * PANEL,
                      PANEL, static_cast<const float*>(nullptr), 0, 0, k0 > 0);
    });
  }
}

inline void quant_product(const float* x, int64_t x_stride, const QuantWeight& w, int64_t p,
                          int64_t M, int K, float* t, float* o) {
  if (w.bits == 4 && w.mins)
    quant_product<4, true>(x, x_stride, w, p, M, K, t, o);
  else if (w.bits == 4)
    quant_product<4, false>(x, x_stride, w, p, M, K, t, o);
  else if (w.mins)
    quant_product<8, true>(x, x_stride, w, p, M, K, t, o);
  else
    quant_product<8, false>(x, x_stride, w, p, M, K, t, o);
}

// a thread's buffer of at least ``floats``, 64-byte aligned (the AVX-512 pass loads whole lines)
inline float* quant_buffer(int64_t floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats + 16) buf.resize(floats + 16);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((at + 63) & ~static_cast<uintptr_t>(63));
}

// y[:, 32p : 32p + 32] = o (+ bias), or y += o rounded to Y first (``acc``)
template <typename Y>
inline void store_panel(const float* o, const float* bias, int64_t M, Y* y, int64_t y_stride,
                        bool acc) {
  for (int64_t r = 0; r < M; ++r)
    for (int c = 0; c < PANEL; c += VW) {
      vf v = vld(o + r * PANEL + c);
      if (bias) v += vld(bias + c);
      Y* yc = y + r * y_stride + c;
      vst(yc, acc ? vld(yc) + vrounded<Y>(v) : v);
    }
}

template <typename Y>
void quant_gemm(const float* x, int64_t x_stride, const QuantWeight& w, const float* bias, Y* y,
                int64_t y_stride, int64_t M, int K, int64_t N, bool acc) {
  share_panels(N / PANEL, [&](int64_t p, int64_t) {
    float* t = quant_buffer(QKB * PANEL + M * PANEL);
    float* o = t + QKB * PANEL;
    quant_product(x, x_stride, w, p, M, K, t, o);
    store_panel(o, bias ? bias + p * PANEL : nullptr, M, y + p * PANEL, y_stride, acc);
  });
}

// y[M, I] = silu(x @ W[:, :I]) * (x @ W[:, I:]) for gate_up's 2I / 32 panels, I = N
template <typename Y>
void quant_glu(const float* x, int64_t x_stride, const QuantWeight& w, Y* y, int64_t M, int K,
               int64_t N) {
  const int64_t up = N / PANEL;
  share_panels(up, [&](int64_t p, int64_t) {
    float* t = quant_buffer(QKB * PANEL + 2 * M * PANEL);
    float* g = t + QKB * PANEL;
    float* u = g + M * PANEL;
    quant_product(x, x_stride, w, p, M, K, t, g);
    quant_product(x, x_stride, w, p + up, M, K, t, u);
    for (int64_t r = 0; r < M; ++r) {
      Y* yr = y + r * N + p * PANEL;
      if constexpr (sizeof(Y) == 4) {
        silu_mul_span(g + r * PANEL, u + r * PANEL, yr, PANEL);
      } else {
        float f[PANEL];
        silu_mul_span(g + r * PANEL, u + r * PANEL, f, PANEL);
        for (int c = 0; c < PANEL; c += VW) vst(yr + c, vld(f + c));
      }
    }
  });
}

}  // namespace
