// Paged attention over int8 / int4 KV, read in place and dequantized in registers (8-float
// vectors: every x86-64 level; AVX2 on v3). Pool rows (``models/kv_quant.py``), per position
// and entry (K, V) and kv head, R = D * BITS / 8 + 4 bytes:
//
//   int8  [ q_0 .. q_{D-1} : int8, -127..127            | scale : float32 ]    x = q * scale
//   int4  [ byte i = q_{2i} | q_{2i+1} << 4, q in 0..15 | scale : float16 | min : float16 ]
//                                                                         x = q * scale + min
//
// Values are read 16 at a time (``load16``): int8 as two vectors of 8 in order; int4 as the 8
// low nibbles (even elements) and the 8 high ones (odd elements), so queries and accumulators
// are held in that order (``lane``) and put back in order at the end. A K row's scale
// multiplies its dot product and its min the query's sum (q . (c s + m) = s (q . c) + m sum q);
// a V row's scale folds into its softmax weight, its min into one offset per head added to
// every element at the end (sum_p w_p (c_p s_p + m_p) = sum_p (w_p s_p) c_p + sum_p w_p m_p).
//
// Decode: one work item per (sequence, kv head), or per sequence when there are enough of them;
// scores kept, exact softmax (``softmax_row``), V streamed per head in sweeps of 8 vectors.
// Prefill: ``prefill_item`` (portable.h) with the K/V tile dequantized into its float buffers
// (``load_kv`` overloads below, picked by the tag types ``KVInt8`` / ``KVInt4``).
#pragma once
#include <omp.h>
#if defined(__SSE4_1__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "portable.h"

namespace {

struct KVInt8 {  // tag: a pool of int8 rows (one byte each)
  uint8_t b;
};
struct KVInt4 {  // tag: a pool of int4 rows
  uint8_t b;
};
template <typename KV>
struct KVBits {
  static constexpr int value = 0;
};
template <>
struct KVBits<KVInt8> {
  static constexpr int value = 8;
};
template <>
struct KVBits<KVInt4> {
  static constexpr int value = 4;
};

// 8 signed bytes at p as 8 int32 (one vpmovsxbd on AVX2; GCC's generic conversion of byte
// vectors is element by element)
inline vi widen8(const uint8_t* p) {
#if defined(__AVX2__)
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__SSE4_1__)
  int32_t a, b;
  std::memcpy(&a, p, 4);
  std::memcpy(&b, p + 4, 4);
  const __m128i lo = _mm_cvtepi8_epi32(_mm_cvtsi32_si128(a));
  const __m128i hi = _mm_cvtepi8_epi32(_mm_cvtsi32_si128(b));
  vi r;
  std::memcpy(&r, &lo, 16);
  std::memcpy(reinterpret_cast<char*>(&r) + 16, &hi, 16);
  return r;
#else
  vi r;
  for (int i = 0; i < VW; ++i) r[i] = static_cast<int8_t>(p[i]);
  return r;
#endif
}

inline int64_t kvq_row_bytes(int D, int bits) { return D * bits / 8 + 4; }

// a row's parameters after its values: x = q * scale + min (int8: min 0)
struct RowParams {
  float scale, min;
};

inline float half_at(const uint8_t* p) {
  _Float16 h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

template <int BITS>
inline RowParams kvq_params(const uint8_t* row, int D) {
  if constexpr (BITS == 8) {
    float s;
    std::memcpy(&s, row + D, 4);
    return {s, 0.f};
  } else {
    return {half_at(row + D / 2), half_at(row + D / 2 + 2)};
  }
}

// 16 values of a row from byte p: int8 a = 0..7, b = 8..15; int4 a = even, b = odd elements
template <int BITS>
inline void load16(const uint8_t* p, vf& a, vf& b) {
  if constexpr (BITS == 8) {
    a = __builtin_convertvector(widen8(p), vf);
    b = __builtin_convertvector(widen8(p + 8), vf);
  } else {
    const vi x = widen8(p);  // sign-extended bytes: the masks below take the nibbles back
    a = __builtin_convertvector(x & 15, vf);
    b = __builtin_convertvector((x >> 4) & 15, vf);
  }
}

// where element i of a row sits in the order load16 yields
template <int BITS>
inline int lane(int i) {
  if constexpr (BITS == 8) {
    return i;
  } else {
    const int k = i % 16;
    return i - k + (k % 2) * 8 + k / 2;
  }
}

// a whole row, dequantized, in element order (prefill's tiles): dst[i * stride] = x_i
template <int BITS>
inline void dequant_row(const uint8_t* row, int D, float* dst, int stride) {
  const RowParams pr = kvq_params<BITS>(row, D);
  for (int c = 0; c < D / 16; ++c) {
    vf a, b;
    load16<BITS>(row + c * 2 * BITS, a, b);
    float tmp[16];
    if constexpr (BITS == 8) {
      vst(tmp, a * pr.scale);
      vst(tmp + VW, b * pr.scale);
    } else {
      vst(tmp, a * pr.scale + pr.min);
      vst(tmp + VW, b * pr.scale + pr.min);
    }
    for (int k = 0; k < 16; ++k) dst[(c * 16 + k) * stride] = tmp[lane<BITS>(k)];
  }
}

// prefill_item's tile load for quantized pools: K of position ``slot`` transposed into k (stride
// ks), V into v
template <typename KV>
inline void load_kv_q(const KV* cache, int64_t slot, int KVH, int D, int g, float* k, int ks,
                      float* v) {
  constexpr int BITS = KVBits<KV>::value;
  const int64_t r = kvq_row_bytes(D, BITS);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(cache) + slot * 2 * KVH * r;
  dequant_row<BITS>(src + g * r, D, k, ks);
  dequant_row<BITS>(src + (KVH + g) * r, D, v, 1);
}
inline void load_kv(const KVInt8* c, int64_t slot, int KVH, int D, int g, float* k, int ks,
                    float* v) {
  load_kv_q(c, slot, KVH, D, g, k, ks, v);
}
inline void load_kv(const KVInt4* c, int64_t slot, int KVH, int D, int g, float* k, int ks,
                    float* v) {
  load_kv_q(c, slot, KVH, D, g, k, ks, v);
}

// acc[jj][lanes of NC chunks from chunk c0] = sum_p w[jj][p] * (scale_p * v_p + min_p) for JB
// heads, over one sequence's rows: each V row is widened once for the JB heads
template <int BITS, int JB, int NC>
inline void weigh_values_q(const uint8_t* vbase, const int64_t* table, int64_t len,
                           int unit_len, int64_t row, const float* w, int64_t lp, int D, int c0,
                           float* acc) {
  vf a[JB][2 * NC] = {};
  float off[JB] = {};  // int4: sum_p w_p * min_p, the same for every element
  for (int64_t p0 = 0; p0 < len; p0 += unit_len) {
    const uint8_t* unit = vbase + table[p0 / unit_len] * unit_len * row;
    const int64_t n = std::min<int64_t>(unit_len, len - p0);
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* v = unit + t * row;
      const RowParams pr = kvq_params<BITS>(v, D);
      vf x[2 * NC];
      for (int c = 0; c < NC; ++c) load16<BITS>(v + (c0 + c) * 2 * BITS, x[2 * c], x[2 * c + 1]);
      for (int jj = 0; jj < JB; ++jj) {
        const float wt = w[jj * lp + p0 + t];
        const vf wj = vset(wt * pr.scale);
        for (int c = 0; c < 2 * NC; ++c) a[jj][c] += wj * x[c];
        if constexpr (BITS == 4) off[jj] += wt * pr.min;
      }
    }
  }
  for (int jj = 0; jj < JB; ++jj)
    for (int c = 0; c < 2 * NC; ++c) {
      if constexpr (BITS == 4) a[jj][c] += off[jj];
      vst(acc + jj * D + c0 * 16 + c * VW, a[jj][c]);
    }
}

// the jb (1..3) heads of one kv head: sweeps of 12 / jb accumulators over the head dim
template <int BITS, int JB, int NC>
inline void weigh_sweeps_q(const uint8_t* vbase, const int64_t* table, int64_t len,
                           int unit_len, int64_t row, const float* w, int64_t lp, int D,
                           float* acc) {
  int c0 = 0;
  for (; c0 + NC <= D / 16; c0 += NC)
    weigh_values_q<BITS, JB, NC>(vbase, table, len, unit_len, row, w, lp, D, c0, acc);
  for (; c0 < D / 16; ++c0)
    weigh_values_q<BITS, JB, 1>(vbase, table, len, unit_len, row, w, lp, D, c0, acc);
}

template <int BITS>
inline void weigh_heads_q(int jb, const uint8_t* vbase, const int64_t* table, int64_t len,
                          int unit_len, int64_t row, const float* w, int64_t lp, int D,
                          float* acc) {
  if (jb == 3)
    weigh_sweeps_q<BITS, 3, 2>(vbase, table, len, unit_len, row, w, lp, D, acc);
  else if (jb == 2)
    weigh_sweeps_q<BITS, 2, 2>(vbase, table, len, unit_len, row, w, lp, D, acc);
  else
    weigh_sweeps_q<BITS, 1, 4>(vbase, table, len, unit_len, row, w, lp, D, acc);
}

// sc[m][p] = scale_p * (q_m . k_p) + min_p * qsum_m for the gn * G query rows of kv heads
// g0 .. g0 + gn - 1; each K row is widened once into kf (lane order) for its G heads
template <int BITS>
inline void scores_q(const float* qf, const float* qsum, const uint8_t* kbase,
                     const int64_t* table, int64_t len, int unit_len, int64_t row, int64_t r,
                     int gn, int G, int D, float* sc, int64_t lp, float* kf) {
  for (int64_t p0 = 0; p0 < len; p0 += unit_len) {
    const uint8_t* unit = kbase + table[p0 / unit_len] * unit_len * row;
    const int64_t n = std::min<int64_t>(unit_len, len - p0);
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < gn; ++g) {
        const uint8_t* k = unit + t * row + g * r;
        for (int c = 0; c < D / 16; ++c) {
          vf x, y;
          load16<BITS>(k + c * 2 * BITS, x, y);
          vst(kf + c * 16, x);
          vst(kf + c * 16 + VW, y);
        }
        const RowParams pr = kvq_params<BITS>(k, D);
        for (int j = 0; j < G; ++j) {
          const float* qm = qf + (g * G + j) * D;
          vf a = vld(qm) * vld(kf);
          for (int c = VW; c < D; c += VW) a += vld(qm + c) * vld(kf + c);
          float score = hsum(a) * pr.scale;
          if constexpr (BITS == 4) score += pr.min * qsum[g * G + j];
          sc[(g * G + j) * lp + p0 + t] = score;
        }
      }
  }
}

// One sequence's query heads g0 * G .. (g0 + gn) * G - 1 over int8/int4 K/V
template <int BITS, typename Q>
void decode_item_q(const Q* q, int64_t q_stride, const uint8_t* cache, const int64_t* table,
                   int64_t len, Q* out, int b, int g0, int gn, int H, int KVH, int D,
                   int unit_len, float scale, float softcap, std::vector<float>& buf) {
  const int G = H / KVH, M = gn * G;
  const int64_t lp = (len + VW - 1) / VW * VW;
  buf.resize(static_cast<size_t>(M) * (2 * D + lp + 2) + D);
  float* qf = buf.data();     // [M][D] queries in lane order, pre-scaled unless softcapped
  float* acc = qf + M * D;    // [M][D] in lane order
  float* sc = acc + M * D;    // [M][lp]
  float* inv = sc + M * lp;   // [M]
  float* qsum = inv + M;      // [M] sum of each query row (int4: times each K row's min)
  float* kf = qsum + M;       // [D] one K row, widened
  const float qs = softcap > 0.f ? 1.f : scale;
  const Q* qrow = q + b * q_stride + static_cast<int64_t>(g0) * G * D;
  for (int m = 0; m < M; ++m) {
    qsum[m] = 0.f;
    for (int i = 0; i < D; ++i) {
      qf[m * D + lane<BITS>(i)] = load(qrow[m * D + i]) * qs;
      qsum[m] += qf[m * D + lane<BITS>(i)];
    }
  }
  const int64_t r = kvq_row_bytes(D, BITS), row = 2 * KVH * r;
  scores_q<BITS>(qf, qsum, cache + g0 * r, table, len, unit_len, row, r, gn, G, D, sc, lp, kf);
  for (int m = 0; m < M; ++m) inv[m] = softmax_row(sc + m * lp, len, lp, scale, softcap);
  for (int g = 0; g < gn; ++g) {
    const uint8_t* vbase = cache + (KVH + g0 + g) * r;
    for (int j0 = 0; j0 < G; j0 += 3) {
      const int m = g * G + j0;
      weigh_heads_q<BITS>(std::min(3, G - j0), vbase, table, len, unit_len, row, sc + m * lp,
                          lp, D, acc + m * D);
    }
  }
  Q* dst = out + static_cast<int64_t>(b) * H * D + static_cast<int64_t>(g0) * G * D;
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < D; ++i) store(dst + m * D + i, acc[m * D + lane<BITS>(i)] * inv[m]);
}

// every sequence: one item per sequence while there are enough to share out, else per
// (sequence, kv head)
template <int BITS, typename Q>
void decode_q(const Q* q, int64_t q_stride, const uint8_t* cache, const int64_t* tables,
              int64_t t_stride, const int64_t* lens, Q* out, int B, int H, int KVH, int D,
              int unit_len, float scale, float softcap, int serial_max) {
  const int per = B >= 4 * omp_get_max_threads() ? KVH : 1, n = B * (KVH / per);
#pragma omp parallel if (n > serial_max)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n; ++it) {
      const int b = it / (KVH / per), g0 = it % (KVH / per) * per;
      decode_item_q<BITS>(q, q_stride, cache, tables + b * t_stride, lens[b], out, b, g0, per,
                          H, KVH, D, unit_len, scale, softcap, buf);
    }
  }
}

}  // namespace

namespace {

// the entry points' dispatch: q dtype 0 float32 / 1 bfloat16, kv_bits 8 / 4; -1 where not built
template <typename Q>
int decode_q_bits(const Q* q, int64_t q_stride, const uint8_t* cache, int kv_bits,
                  const int64_t* tables, int64_t t_stride, const int64_t* lens, Q* out, int B,
                  int H, int KVH, int D, int unit_len, float scale, float softcap,
                  int serial_max) {
  if (kv_bits == 8)
    decode_q<8>(q, q_stride, cache, tables, t_stride, lens, out, B, H, KVH, D, unit_len, scale,
                softcap, serial_max);
  else if (kv_bits == 4)
    decode_q<4>(q, q_stride, cache, tables, t_stride, lens, out, B, H, KVH, D, unit_len, scale,
                softcap, serial_max);
  else
    return -1;
  return 0;
}

}  // namespace
