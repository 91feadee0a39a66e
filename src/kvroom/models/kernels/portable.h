// The portable kernels: scalar code the compiler vectorizes, and 8-float vector code
// (``common.h``). They build for every x86-64 level (and any other target GCC has) and serve
// every shape the ISA-specific kernels do not take.
#pragma once
#include <algorithm>
#include <vector>

#include "common.h"

namespace {

// Paged decode attention, one query token per sequence, K/V read in place from the pool:
//
//   cache  [units, unit_len, 2, kvh, D]   K at [.., 0, g, :], V at [.., 1, g, :]
//   q      [B, H, D] with row stride q_stride (a view into the qkv projection output)
//   tables [B, n] pool units per sequence (row stride t_stride); position p of sequence b is
//          row p % unit_len of unit tables[b][p / unit_len]
//   lens   [B] keys per sequence
//   out    [B, H * D] contiguous
//
// One work item per (sequence, kv head): its G = H / kvh query heads share every K/V row read
// (the AVX-512 path below takes a whole sequence per item where there are enough of them).
// Scores are kept (G x len floats), so K and V are each streamed once, softmax is exact
// (max-subtracted, float32), and the order of sums is fixed: results do not depend on threads.

template <typename KV>
inline float dot(const float* a, const KV* b, int d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < d; ++i) s += a[i] * load(b[i]);
  return s;
}

template <typename Q, typename KV>
void decode_item(const Q* q, int64_t q_stride, const KV* cache, const int64_t* table,
                 int64_t len, Q* out, int b, int g, int H, int KVH, int D, int unit_len,
                 float scale, float softcap, std::vector<float>& buf) {
  const int G = H / KVH;
  buf.resize(static_cast<size_t>(G) * (D + D + len));
  float* qf = buf.data();     // [G, D] queries in float, pre-scaled
  float* acc = qf + G * D;    // [G, D]
  float* sc = acc + G * D;    // [G, len]
  for (int j = 0; j < G; ++j) {
    const Q* src = q + b * q_stride + static_cast<int64_t>(g * G + j) * D;
    for (int i = 0; i < D; ++i) qf[j * D + i] = load(src[i]) * (softcap > 0.f ? 1.f : scale);
  }
  const int64_t row = 2LL * KVH * D;  // elements per pool row (one position)
  for (int64_t p = 0; p < len; ++p) {
    const KV* k = cache + (table[p / unit_len] * unit_len + p % unit_len) * row + g * D;
    for (int j = 0; j < G; ++j) {
      float s = dot(qf + j * D, k, D);
      if (softcap > 0.f) s = softcap * std::tanh(s * scale / softcap);
      sc[j * len + p] = s;
    }
  }
  for (int j = 0; j < G; ++j) {
    float* s = sc + j * len;
    float m = -INFINITY;
    for (int64_t p = 0; p < len; ++p) m = s[p] > m ? s[p] : m;
    float sum = 0.f;
    for (int64_t p = 0; p < len; ++p) {
      s[p] = std::exp(s[p] - m);
      sum += s[p];
    }
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < len; ++p) s[p] *= inv;
  }
  std::memset(acc, 0, sizeof(float) * G * D);
  for (int64_t p = 0; p < len; ++p) {
    const KV* v = cache + (table[p / unit_len] * unit_len + p % unit_len) * row + (KVH + g) * D;
    for (int j = 0; j < G; ++j) {
      const float w = sc[j * len + p];
      float* a = acc + j * D;
#pragma omp simd
      for (int i = 0; i < D; ++i) a[i] += w * load(v[i]);
    }
  }
  for (int j = 0; j < G; ++j) {
    Q* dst = out + (static_cast<int64_t>(b) * H + g * G + j) * D;
    for (int i = 0; i < D; ++i) store(dst + i, acc[j * D + i]);
  }
}

// a row of decode scores -> weights in place (softcapped first where asked; exact softmax,
// float32, padding up to lp weighted 0), 1 / sum returned
inline float softmax_row(float* s, int64_t len, int64_t lp, float scale, float softcap) {
  if (softcap > 0.f)
    for (int64_t p = 0; p < len; ++p) s[p] = softcap * std::tanh(s[p] * scale / softcap);
  for (int64_t p = len; p < lp; ++p) s[p] = -INFINITY;  // exp gives exactly 0
  vf top = vld(s);
  for (int64_t p = VW; p < lp; p += VW) {
    const vf x = vld(s + p);
    top = x > top ? x : top;
  }
  float mx = top[0];
  for (int c = 1; c < VW; ++c) mx = top[c] > mx ? top[c] : mx;
  vf sum = {};
  for (int64_t p = 0; p < lp; p += VW) {
    const vf e = vexp(vld(s + p) - mx);
    vst(s + p, e);
    sum += e;
  }
  return 1.f / hsum(sum);
}

// ---- Paged prefill attention: causal chunks, K/V read in place from the pool ----------------
//
//   q      [Tp, H, D] packed rows of B chunks, chunk b = q_lens[b] rows at positions
//          starts[b] .. starts[b] + q_lens[b) - 1 (row stride q_stride)
//   out    [Tp, H * D] contiguous
//
// The chunk's own K/V are in the pool already (stored before attention), so one path serves
// a fresh prompt and a chunk with cached context alike: query at position p sees keys 0..p.
// Work item = (chunk, kv head, tile of QT positions); its G query heads share every K/V tile.
// Flash-style: keys in tiles of KT, repacked (K transposed) into a small float buffer, scores
// by register-blocked FMAs, online softmax in float32, exact order (thread-independent). On
// AVX-512, head dims of 16k take ``prefill_item16`` instead (queries transposed, no repacking).

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
constexpr int KT = 32;  // keys per tile (KT / VW vectors per score row)
constexpr int QT = 32;  // query positions per work item

// s[NR rows][KT] = qf[NR rows][D] . kt[D][KT]
template <int NR>
inline void scores(const float* qf, int D, const float* kt, float* s) {
  vf acc[NR][KT / VW] = {};
  for (int d = 0; d < D; ++d) {
    vf k[KT / VW];
    for (int c = 0; c < KT / VW; ++c) k[c] = vld(kt + d * KT + c * VW);
    for (int r = 0; r < NR; ++r) {
      const vf a = vset(qf[r * D + d]);
      for (int c = 0; c < KT / VW; ++c) acc[r][c] += a * k[c];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < KT / VW; ++c) vst(s + r * KT + c * VW, acc[r][c]);
}

// o[NR rows][NV vectors at dv] += p[NR rows][0..kn) . v[0..kn)[D]
template <int NR, int NV>
inline void accumulate(const float* p, int kn, const float* v, int D, float* o, int dv) {
  vf acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = vld(o + r * D + dv + c * VW);
  for (int t = 0; t < kn; ++t) {
    vf x[NV];
    for (int c = 0; c < NV; ++c) x[c] = vld(v + t * D + dv + c * VW);
    for (int r = 0; r < NR; ++r) {
      const vf w = vset(p[r * KT + t]);
      for (int c = 0; c < NV; ++c) acc[r][c] += w * x[c];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) vst(o + r * D + dv + c * VW, acc[r][c]);
}

template <int NR>
inline void accumulate_rows(const float* p, int kn, const float* v, int D, float* o) {
  int dv = 0;
  for (; dv + 4 * VW <= D; dv += 4 * VW) accumulate<NR, 4>(p, kn, v, D, o, dv);
  for (; dv < D; dv += VW) accumulate<NR, 1>(p, kn, v, D, o, dv);
}

// one position of the pool into prefill_item's tile buffers: K transposed into k (stride ks),
// V into v (int8/int4 pools: the overloads in kvq_attention.h)
template <typename KV>
inline void load_kv(const KV* cache, int64_t slot, int KVH, int D, int g, float* k, int ks,
                    float* v) {
  const KV* src = cache + slot * 2LL * KVH * D;
  for (int d = 0; d < D; ++d) k[d * ks] = load(src[g * D + d]);
  for (int d = 0; d < D; ++d) v[d] = load(src[(KVH + g) * D + d]);
}

template <typename Q, typename KV>
void prefill_item(const Q* q, int64_t q_stride, const KV* cache, const int64_t* table,
                  int64_t start, int64_t row0, int r0, int nr, Q* out, int g,
                  const PrefillShape& sh, std::vector<float>& buf) {
  const int H = sh.H, KVH = sh.KVH, D = sh.D, G = H / KVH, M = nr * G;
  buf.resize(static_cast<size_t>(M) * (2 * D + KT + 2) + 2 * KT * D);
  float* qf = buf.data();  // [M][D], row m = r * G + j: position r0 + r, head g * G + j
  float* o = qf + M * D;   // [M][D]
  float* s = o + M * D;    // [M][KT]
  float* mx = s + M * KT;  // [M]
  float* l = mx + M;       // [M]
  float* kt = l + M;       // [D][KT]
  float* v = kt + KT * D;  // [KT][D]
  for (int r = 0; r < nr; ++r)
    for (int j = 0; j < G; ++j) {
      const Q* src = q + (row0 + r0 + r) * q_stride + static_cast<int64_t>(g * G + j) * D;
      float* dst = qf + (r * G + j) * D;
      for (int i = 0; i < D; ++i) dst[i] = load(src[i]) * sh.scale;
    }
  std::memset(o, 0, sizeof(float) * M * D);
  for (int m = 0; m < M; ++m) mx[m] = -INFINITY, l[m] = 0.f;
  const int64_t first = start + r0, nkeys = first + nr;  // keys 0 .. last position of the tile
  for (int64_t k0 = 0; k0 < nkeys; k0 += KT) {
    const int kn = static_cast<int>(nkeys - k0 < KT ? nkeys - k0 : KT);
    for (int t = 0; t < KT; ++t) {
      if (t >= kn) {
        for (int d = 0; d < D; ++d) kt[d * KT + t] = 0.f;
        continue;
      }
      const int64_t p = k0 + t;
      const int64_t slot = table[p / sh.unit_len] * sh.unit_len + p % sh.unit_len;
      load_kv(cache, slot, KVH, D, g, kt + t, KT, v + t * D);
    }
    int m = 0;
    for (; m + 3 <= M; m += 3) scores<3>(qf + m * D, D, kt, s + m * KT);
    if (M - m == 2) scores<2>(qf + m * D, D, kt, s + m * KT);
    if (M - m == 1) scores<1>(qf + m * D, D, kt, s + m * KT);
    const bool masked = k0 + KT - 1 > first;  // some key may lie after some query
    for (m = 0; m < M; ++m) {
      float* sr = s + m * KT;
      const int64_t see = start + r0 + m / G - k0;  // keys t <= see are visible
      if (masked)
        for (int t = 0; t < KT; ++t)
          if (t > see) sr[t] = -INFINITY;
      vf top = vld(sr);
      for (int c = 1; c < KT / VW; ++c) {
        const vf x = vld(sr + c * VW);
        top = x > top ? x : top;
      }
      float best = mx[m];
      for (int c = 0; c < VW; ++c) best = top[c] > best ? top[c] : best;
      const float alpha = std::exp(mx[m] - best);  // 0 on the first tile (mx = -inf)
      vf sum = {};
      for (int c = 0; c < KT / VW; ++c) {
        const vf e = vexp(vld(sr + c * VW) - best);
        vst(sr + c * VW, e);
        sum += e;
      }
      float total = 0.f;
      for (int c = 0; c < VW; ++c) total += sum[c];
      l[m] = l[m] * alpha + total;
      mx[m] = best;
      if (alpha != 1.f)
        for (int d = 0; d < D; d += VW) vst(o + m * D + d, vld(o + m * D + d) * alpha);
    }
    for (m = 0; m + 3 <= M; m += 3) accumulate_rows<3>(s + m * KT, kn, v, D, o + m * D);
    if (M - m == 2) accumulate_rows<2>(s + m * KT, kn, v, D, o + m * D);
    if (M - m == 1) accumulate_rows<1>(s + m * KT, kn, v, D, o + m * D);
  }
  for (int r = 0; r < nr; ++r)
    for (int j = 0; j < G; ++j) {
      const int m = r * G + j;
      const float inv = 1.f / l[m];
      Q* dst = out + (row0 + r0 + r) * static_cast<int64_t>(H) * D +
               static_cast<int64_t>(g * G + j) * D;
      for (int i = 0; i < D; ++i) store(dst + i, o[m * D + i] * inv);
    }
}

// h += delta (when delta is not null); y = h * rsqrt(mean(h^2) + eps) [* w], float32 stats
// summed in VW lanes, in a fixed order.
template <typename T>
void add_rms_norm(T* h, const T* delta, T* y, const T* w, int64_t rows, int64_t n, float eps,
                  int serial_max) {
#pragma omp parallel for schedule(static) if (rows > serial_max)
  for (int64_t r = 0; r < rows; ++r) {
    T* hr = h + r * n;
    const T* dr = delta ? delta + r * n : nullptr;
    T* yr = y + r * n;
    vf acc = {};
    float ss = 0.f;
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
      vf x = vld(hr + i);
      if (dr) {
        x = vrounded<T>(x + vld(dr + i));
        vst(hr + i, x);
      }
      acc += x * x;
    }
    for (; i < n; ++i) {
      float x = load(hr[i]);
      if (dr) {
        x = rounded<T>(x + load(dr[i]));
        store(hr + i, x);
      }
      ss += x * x;
    }
    for (int c = 0; c < VW; ++c) ss += acc[c];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (i = 0; i + VW <= n; i += VW) {
      vf v = vld(hr + i) * inv;
      if (w) v = vrounded<T>(v) * vld(w + i);
      vst(yr + i, v);
    }
    for (; i < n; ++i) {
      float v = load(hr[i]) * inv;
      if (w) v = rounded<T>(v) * load(w[i]);
      store(yr + i, v);
    }
  }
}

// out = silu(g) * u per row of gu = [g | u]; bf16 rounds silu(g) before the product, as
// torch's two ops do.
template <typename T>
inline void silu_mul_span(const T* g, const T* u, T* o, int64_t n) {  // o may be u
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    const vf x = vld(g + i);
    vst(o + i, vrounded<T>(x / (1.0f + vexp(-x))) * vld(u + i));
  }
  for (; i < n; ++i) {
    const float x = load(g[i]);
    store(o + i, rounded<T>(x / (1.0f + std::exp(-x))) * load(u[i]));
  }
}

template <typename T>
void silu_mul(const T* gu, T* out, int64_t rows, int64_t inter, int serial_max) {
#pragma omp parallel for schedule(static) if (rows > serial_max)
  for (int64_t r = 0; r < rows; ++r)
    silu_mul_span(gu + r * 2 * inter, gu + r * 2 * inter + inter, out + r * inter, inter);
}

}  // namespace
