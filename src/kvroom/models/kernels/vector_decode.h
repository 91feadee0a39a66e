// Paged decode attention in 8-float vectors (every target without AVX-512; AVX2 on x86-64-v3),
// for head dims 64, 128 and 256: the shape of ``decode_item16`` with half-width vectors. An
// item is a sequence and a run of its KV heads. Per head: each key's G dot products are FMAs
// over the K row as it lies in the pool, one horizontal sum each; the scores are kept, so the
// softmax is exact (max-subtracted, float32, vector exp); the V rows are then streamed into
// register accumulators (at most 12: JB heads x DC vectors of the head dim per sweep), scaled
// by 1 / sum at the end. The order of sums is fixed per item: results do not depend on threads.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

inline bool vector_decode8_dim(int D) { return D == 64 || D == 128 || D == 256; }

// acc[jj][dc .. dc + DC) += w[jj][p] * v_p[dc ..] for JB heads, over the rows p of one
// sequence's units (V of one kv head at ``vbase``)
template <int JB, int DC, typename KV>
inline void weigh_values8(const KV* vbase, const int64_t* table, int64_t len, int unit_len,
                          int64_t row, const float* w, int64_t lp, float* acc, int D, int dc) {
  vf a[JB][DC] = {};
  for (int64_t p0 = 0; p0 < len; p0 += unit_len) {
    const KV* unit = vbase + table[p0 / unit_len] * unit_len * row + dc * VW;
    const int64_t n = std::min<int64_t>(unit_len, len - p0);
    for (int64_t t = 0; t < n; ++t) {
      const KV* v = unit + t * row;
      vf x[DC];
      for (int c = 0; c < DC; ++c) x[c] = vld(v + c * VW);
      for (int jj = 0; jj < JB; ++jj) {
        const vf wj = vset(w[jj * lp + p0 + t]);
        for (int c = 0; c < DC; ++c) a[jj][c] += wj * x[c];
      }
    }
  }
  for (int jj = 0; jj < JB; ++jj)
    for (int c = 0; c < DC; ++c) vst(acc + jj * D + (dc + c) * VW, a[jj][c]);
}

// the heads [j0, j0 + jb) of one kv head: sweeps of 12 / jb vectors of the head dim
template <int DV, typename KV>
inline void weigh_heads8(int jb, const KV* vbase, const int64_t* table, int64_t len,
                         int unit_len, int64_t row, const float* w, int64_t lp, float* acc) {
  constexpr int D = VW * DV;
  const auto sweep = [&](auto jbc, auto dcc) {
    constexpr int JB = decltype(jbc)::value, DC = decltype(dcc)::value;
    for (int dc = 0; dc < DV; dc += DC)
      weigh_values8<JB, DC>(vbase, table, len, unit_len, row, w, lp, acc, D, dc);
  };
  if (jb == 3)
    sweep(std::integral_constant<int, 3>{}, std::integral_constant<int, 4>{});
  else if (jb == 2)
    sweep(std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{});
  else
    sweep(std::integral_constant<int, 1>{}, std::integral_constant<int, 8>{});
}

// the scores of one sequence's M = gn * G query rows against its keys: sc[m][p] = q_m . k_p
template <int DV, typename KV>
inline void scores8(const float* qf, const KV* kbase, const int64_t* table, int64_t len,
                    int unit_len, int64_t row, int gn, int G, float* sc, int64_t lp) {
  constexpr int D = VW * DV;
  for (int64_t p0 = 0; p0 < len; p0 += unit_len) {  // unit by unit: its rows are contiguous
    const KV* unit = kbase + table[p0 / unit_len] * unit_len * row;
    const int64_t n = std::min<int64_t>(unit_len, len - p0);
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < gn; ++g) {
        const KV* k = unit + t * row + g * D;
        for (int j = 0; j < G; ++j) {
          const int m = g * G + j;
          const float* qm = qf + m * D;
          vf a = vld(qm) * vld(k);
          for (int c = 1; c < DV; ++c) a += vld(qm + c * VW) * vld(k + c * VW);
          sc[m * lp + p0 + t] = hsum(a);
        }
      }
  }
}

// One sequence's query heads g0 * G .. (g0 + gn) * G - 1 (kv heads g0 .. g0 + gn - 1)
template <int DV, typename Q, typename KV>
void decode_item8(const Q* q, int64_t q_stride, const KV* cache, const int64_t* table,
                  int64_t len, Q* out, int b, int g0, int gn, int H, int KVH, int unit_len,
                  float scale, float softcap, std::vector<float>& buf) {
  constexpr int D = VW * DV;
  const int G = H / KVH, M = gn * G;
  const int64_t lp = (len + VW - 1) / VW * VW;  // score rows padded to whole vectors
  buf.resize(static_cast<size_t>(M) * (2 * D + lp + 1));
  float* qf = buf.data();   // [M][D] queries in float (pre-scaled unless softcapped)
  float* acc = qf + M * D;  // [M][D]
  float* sc = acc + M * D;  // [M][lp]
  float* inv = sc + M * lp;  // [M]
  const float qs = softcap > 0.f ? 1.f : scale;
  const Q* qrow = q + b * q_stride + static_cast<int64_t>(g0) * G * D;
  for (int i = 0; i < M * D; ++i) qf[i] = load(qrow[i]) * qs;
  const int64_t row = 2LL * KVH * D;  // elements per pool row (one position)
  scores8<DV>(qf, cache + static_cast<int64_t>(g0) * D, table, len, unit_len, row, gn, G, sc, lp);
  for (int m = 0; m < M; ++m) inv[m] = softmax_row(sc + m * lp, len, lp, scale, softcap);
  for (int g = 0; g < gn; ++g) {
    const KV* vbase = cache + static_cast<int64_t>(KVH + g0 + g) * D;
    for (int j0 = 0; j0 < G; j0 += 3) {
      const int m = g * G + j0;
      weigh_heads8<DV>(std::min(3, G - j0), vbase, table, len, unit_len, row, sc + m * lp, lp,
                       acc + m * D);
    }
  }
  Q* dst = out + static_cast<int64_t>(b) * H * D + static_cast<int64_t>(g0) * G * D;
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < D; ++i) store(dst + m * D + i, acc[m * D + i] * inv[m]);
}

template <typename Q, typename KV>
void decode_item8(int D, const Q* q, int64_t q_stride, const KV* cache, const int64_t* table,
                  int64_t len, Q* out, int b, int g0, int gn, int H, int KVH, int unit_len,
                  float scale, float softcap, std::vector<float>& buf) {
  if (D == 64)
    decode_item8<8>(q, q_stride, cache, table, len, out, b, g0, gn, H, KVH, unit_len, scale,
                    softcap, buf);
  else if (D == 128)
    decode_item8<16>(q, q_stride, cache, table, len, out, b, g0, gn, H, KVH, unit_len, scale,
                     softcap, buf);
  else
    decode_item8<32>(q, q_stride, cache, table, len, out, b, g0, gn, H, KVH, unit_len, scale,
                     softcap, buf);
}

}  // namespace
