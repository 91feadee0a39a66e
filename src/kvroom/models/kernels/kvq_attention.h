// Paged attention over int8 / int4 KV, read in place and dequantized in registers (8-float
// vectors: every x86-64 level; AVX2 on v3). Pool rows (``models/kv_quant.py``), per position
// and entry (K, V) and kv head, R = D * BITS / 8 + 4 bytes:
//
//   int8  [ q_0 .. q_{D-1} : int8                      | scale : float32 ]
//   int4  [ byte i = (q_{2i} + 8) | (q_{2i+1} + 8) << 4 | scale : float32 ]      x = q * scale
//
// Values are read 16 at a time (``load16``): int8 as two vectors of 8 in order; int4 as the 8
// low nibbles (even elements) and the 8 high ones (odd elements), so queries and accumulators
// are held in that order (``lane``) and put back in order at the end. A K row's scale
// multiplies its dot product; a V row's scale folds into its softmax weight.
//
// Decode: one work item per (sequence, kv head), or per sequence when there are enough of them;
// scores kept, exact softmax (``softmax_row``), V streamed per head in sweeps of 8 vectors.
// Prefill: ``prefill_item`` (portable.h) with the K/V tile dequantized into its float buffers
// (``load_kv`` overloads below, picked by the tag types ``KVInt8`` / ``KVInt4``).
#pragma once
#include <omp.h>

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

typedef int8_t vc8 __attribute__((vector_size(8)));
typedef uint8_t vb8 __attribute__((vector_size(8)));

inline int64_t kvq_row_bytes(int D, int bits) { return D * bits / 8 + 4; }

inline float kvq_scale(const uint8_t* row, int D, int bits) {
  float s;
  std::memcpy(&s, row + D * bits / 8, 4);
  return s;
}

// 16 values of a row from byte p: int8 a = 0..7, b = 8..15; int4 a = even, b = odd elements
template <int BITS>
inline void load16(const uint8_t* p, vf& a, vf& b) {
  if constexpr (BITS == 8) {
    vc8 x, y;
    std::memcpy(&x, p, 8);
    std::memcpy(&y, p + 8, 8);
    a = __builtin_convertvector(x, vf);
    b = __builtin_convertvector(y, vf);
  } else {
    vb8 x;
    std::memcpy(&x, p, 8);
    a = __builtin_convertvector(x & 15, vf) - 8.f;
    b = __builtin_convertvector(x >> 4, vf) - 8.f;
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
  const float s = kvq_scale(row, D, BITS);
  for (int c = 0; c < D / 16; ++c) {
    vf a, b;
    load16<BITS>(row + c * 2 * BITS, a, b);
    float tmp[16];
    vst(tmp, a * s);
    vst(tmp + VW, b * s);
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

// acc[lanes of NC chunks from chunk c0] = sum_p w[p] * scale_p * v_p, over one sequence's rows
template <int BITS, int NC>
inline void weigh_values_q(const uint8_t* vbase, const int64_t* table, int64_t len,
                           int unit_len, int64_t row, const float* w, int D, int c0,
                           float* acc) {
  vf a[2 * NC] = {};
  for (int64_t p0 = 0; p0 < len; p0 += unit_len) {
    const uint8_t* unit = vbase + table[p0 / unit_len] * unit_len * row;
    const int64_t n = std::min<int64_t>(unit_len, len - p0);
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* v = unit + t * row;
      const vf wv = vset(w[p0 + t] * kvq_scale(v, D, BITS));
      for (int c = 0; c < NC; ++c) {
        vf x, y;
        load16<BITS>(v + (c0 + c) * 2 * BITS, x, y);
        a[2 * c] += wv * x;
        a[2 * c + 1] += wv * y;
      }
    }
  }
  for (int c = 0; c < 2 * NC; ++c) vst(acc + c0 * 16 + c * VW, a[c]);
}

template <int BITS>
inline void weigh_head_q(const uint8_t* vbase, const int64_t* table, int64_t len, int unit_len,
                         int64_t row, const float* w, int D, float* acc) {
  int c0 = 0;
  for (; c0 + 4 <= D / 16; c0 += 4)
    weigh_values_q<BITS, 4>(vbase, table, len, unit_len, row, w, D, c0, acc);
  for (; c0 < D / 16; ++c0)
    weigh_values_q<BITS, 1>(vbase, table, len, unit_len, row, w, D, c0, acc);
}

// sc[m][p] = scale_p * (q_m . k_p) for the gn * G query rows of kv heads g0 .. g0 + gn - 1
template <int BITS>
inline void scores_q(const float* qf, const uint8_t* kbase, const int64_t* table, int64_t len,
                     int unit_len, int64_t row, int64_t r, int gn, int G, int D, float* sc,
                     int64_t lp) {
  for (int64_t p0 = 0; p0 < len; p0 += unit_len) {
    const uint8_t* unit = kbase + table[p0 / unit_len] * unit_len * row;
    const int64_t n = std::min<int64_t>(unit_len, len - p0);
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < gn; ++g) {
        const uint8_t* k = unit + t * row + g * r;
        const float s = kvq_scale(k, D, BITS);
        for (int j = 0; j < G; ++j) {
          const float* qm = qf + (g * G + j) * D;
          vf a = {};
          for (int c = 0; c < D / 16; ++c) {
            vf x, y;
            load16<BITS>(k + c * 2 * BITS, x, y);
            a += vld(qm + c * 16) * x + vld(qm + c * 16 + VW) * y;
          }
          sc[(g * G + j) * lp + p0 + t] = hsum(a) * s;
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
  buf.resize(static_cast<size_t>(M) * (2 * D + lp + 1));
  float* qf = buf.data();    // [M][D] queries in lane order, pre-scaled unless softcapped
  float* acc = qf + M * D;   // [M][D] in lane order
  float* sc = acc + M * D;   // [M][lp]
  float* inv = sc + M * lp;  // [M]
  const float qs = softcap > 0.f ? 1.f : scale;
  const Q* qrow = q + b * q_stride + static_cast<int64_t>(g0) * G * D;
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < D; ++i) qf[m * D + lane<BITS>(i)] = load(qrow[m * D + i]) * qs;
  const int64_t r = kvq_row_bytes(D, BITS), row = 2 * KVH * r;
  scores_q<BITS>(qf, cache + g0 * r, table, len, unit_len, row, r, gn, G, D, sc, lp);
  for (int m = 0; m < M; ++m) inv[m] = softmax_row(sc + m * lp, len, lp, scale, softcap);
  for (int m = 0; m < M; ++m) {
    const uint8_t* vbase = cache + (KVH + g0 + m / G) * r;
    weigh_head_q<BITS>(vbase, table, len, unit_len, row, sc + m * lp, D, acc + m * D);
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
