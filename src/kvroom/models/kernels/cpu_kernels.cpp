// kvroom CPU kernels, built once per CPU by kernels/build.py (g++ -O3 -march=native -fopenmp)
// and called through ctypes with raw pointers. OpenMP here is torch's own libgomp (same
// SONAME, already loaded), so these loops share torch's thread pool and thread count.
//
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x7fffffu)) {
    *p = static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays NaN
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}

template <typename T>
inline float rounded(float x) {  // x as a T would hold it
  T t;
  store(&t, x);
  return load(t);
}

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
constexpr int VW = 8;   // floats per vector
constexpr int KT = 32;  // keys per tile (KT / VW vectors per score row)
constexpr int QT = 32;  // query positions per work item

inline vf vld(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vst(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vset(float x) { return vf{x, x, x, x, x, x, x, x}; }  // a broadcast (not 0 + x)

// exp(x) (Cephes' expf polynomial, ~1 ulp); x below -87 gives exactly 0, above 88 exp(88).
inline vf vexp(vf x) {
  const vf lo = vset(-87.0f), hi = vset(88.0f);
  vf xc = x < lo ? lo : (x > hi ? hi : x);
  vf fx = xc * 1.44269504088896341f + 12582912.0f;
  fx = fx - 12582912.0f;  // round to nearest
  vf r = xc - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  vf y = vset(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3333452e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  vi n = __builtin_convertvector(fx, vi);
  vf pow2 = (vf)((n + 127) << 23);
  vf z = y * pow2;
  return x < lo ? vf{} : z;
}

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

struct PrefillShape {
  int H, KVH, D, unit_len;
  float scale;
};

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
  const int64_t row = 2LL * KVH * D;
  for (int64_t k0 = 0; k0 < nkeys; k0 += KT) {
    const int kn = static_cast<int>(nkeys - k0 < KT ? nkeys - k0 : KT);
    for (int t = 0; t < KT; ++t) {
      if (t >= kn) {
        for (int d = 0; d < D; ++d) kt[d * KT + t] = 0.f;
        continue;
      }
      const int64_t p = k0 + t;
      const KV* src = cache + (table[p / sh.unit_len] * sh.unit_len + p % sh.unit_len) * row;
      for (int d = 0; d < D; ++d) kt[d * KT + t] = load(src[g * D + d]);
      for (int d = 0; d < D; ++d) v[t * D + d] = load(src[(KVH + g) * D + d]);
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

// the AVX-512 prefill path (``prefill_item16``) takes head dims of whole 16-float vectors
inline bool vector_prefill_dim(int D) {
#if defined(__AVX512F__)
  return D % 16 == 0;
#else
  (void)D;
  return false;
#endif
}

#if defined(__AVX512F__)
template <typename Q, typename KV>
void prefill_item16(const Q* q, int64_t q_stride, const KV* cache, const int64_t* table,
                    int64_t start, int64_t row0, int r0, int nr, Q* out, int g,
                    const PrefillShape& sh, std::vector<float>& buf);
constexpr int QT16 = 16;  // query positions per work item of the AVX-512 path
#endif

template <typename Q, typename KV>
void prefill(const Q* q, int64_t q_stride, const KV* cache, const int64_t* tables,
             int64_t t_stride, const int64_t* starts, const int64_t* q_lens, Q* out, int B,
             const PrefillShape& sh) {
  const bool wide = vector_prefill_dim(sh.D);  // the AVX-512 path: 16 rows per FMA
  const int qt = wide ? QT16 : QT;
  struct Item {
    int b, g, r0;
    int64_t row0;
  };
  std::vector<Item> items;
  int64_t row0 = 0;
  for (int b = 0; b < B; ++b) {
    for (int r0 = 0; r0 < q_lens[b]; r0 += qt)
      for (int g = 0; g < sh.KVH; ++g) items.push_back({b, g, r0, row0});
    row0 += q_lens[b];
  }
  // KV head by KV head, so the threads share one head's K/V rows in cache at a time (1.07-1.10x
  // after 1,000 cached positions); in each, longest items first (the last tiles of the longest
  // contexts), so the dynamic schedule ends with short ones.
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    if (x.g != y.g) return x.g < y.g;
    return starts[x.b] + x.r0 > starts[y.b] + y.r0;
  });
  const int n = static_cast<int>(items.size());
#pragma omp parallel if (n > 1)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) {
      const Item& it = items[i];
      const int nr = static_cast<int>(q_lens[it.b] - it.r0 < qt ? q_lens[it.b] - it.r0 : qt);
#if defined(__AVX512F__)
      if (wide) {
        prefill_item16(q, q_stride, cache, tables + it.b * t_stride, starts[it.b], it.row0,
                       it.r0, nr, out, it.g, sh, buf);
        continue;
      }
#endif
      prefill_item(q, q_stride, cache, tables + it.b * t_stride, starts[it.b], it.row0, it.r0,
                   nr, out, it.g, sh, buf);
    }
  }
}

// out[r, :] = silu(gu[r, :I]) * gu[r, I:], rounding where torch's silu then mul_ would.
// VW values at p as floats, and back (bf16: exact widening; rounding to nearest even, NaN
// kept, as the scalar load/store above do).
typedef uint16_t vh __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(32)));
inline vf vld(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
inline void vst(uint16_t* p, vf x) {
  const vu b = (vu)x;
  const vu nan = ((b & 0x7f800000u) == 0x7f800000u) & ((b & 0x7fffffu) != 0);
  const vu r = nan ? ((b >> 16) | 0x40u) : (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const vh h = __builtin_convertvector(r, vh);
  std::memcpy(p, &h, sizeof h);
}
template <typename T>
inline vf vrounded(vf x) {  // x as a T would hold it
  if constexpr (sizeof(T) == 4) {
    return x;
  } else {
    T t[VW];
    vst(t, x);
    return vld(t);
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

// ---- Paged decode attention on AVX-512: no transposes, K and V read once, in place ----------
//
// Same inputs as ``decode`` below, for head dims 64, 128 and 256 (``vector_decode_dim``);
// an item is a sequence and a run of its KV heads. Per head: each key's G dot products are
// 16-wide FMAs over the K row as it lies in the pool, then one horizontal sum each; the scores
// are kept, so the softmax is exact (max-subtracted, float32, vector exp); then the V rows are
// streamed once into G x D float accumulators, scaled by 1 / sum at the end. The order of
// sums is fixed per item, so results do not depend on threads.
#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void ystore(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void ystore(uint16_t* p, __m512 v) {  // rounded as ``vst`` rounds, 8 at a time
  float f[16];
  _mm512_storeu_ps(f, v);
  vst(p, vld(f));
  vst(p + 8, vld(f + 8));
}
template <typename Y>
inline __m512 yrounded(__m512 v) {  // v as a Y would hold it
  if constexpr (sizeof(Y) == 4) {
    return v;
  } else {
    uint16_t h[16];
    ystore(h, v);
    return ld16(h);
  }
}

constexpr int PF = 4;  // rows ahead to prefetch

inline bool vector_decode_dim(int D) { return D == 64 || D == 128 || D == 256; }

// acc[0..JB)[0..DV) += w[jj][p] * v_p over the rows p of one sequence's units (V of one kv
// head at ``vbase``), the accumulators held in registers.
template <int DV, int JB, typename KV>
inline void weigh_values(const KV* vbase, const int64_t* table, int64_t len, int unit_len,
                         int64_t row, const float* w, int64_t lp, float* acc, int D) {
  __m512 a[JB][DV];
  for (int jj = 0; jj < JB; ++jj)
    for (int c = 0; c < DV; ++c) a[jj][c] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < len; p0 += unit_len) {
    const KV* unit = vbase + table[p0 / unit_len] * unit_len * row;
    const int64_t n = std::min<int64_t>(unit_len, len - p0);
    for (int64_t t = 0; t < n; ++t) {
      const KV* v = unit + t * row;
      __m512 x[DV];
      for (int c = 0; c < DV; ++c) x[c] = ld16(v + 16 * c);
      for (int jj = 0; jj < JB; ++jj) {
        const __m512 wj = _mm512_set1_ps(w[jj * lp + p0 + t]);
        for (int c = 0; c < DV; ++c) a[jj][c] = _mm512_fmadd_ps(wj, x[c], a[jj][c]);
      }
    }
  }
  for (int jj = 0; jj < JB; ++jj)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc + jj * D + 16 * c, a[jj][c]);
}

template <int DV, int JB, typename KV>
inline void weigh_values_of(int jb, const KV* vbase, const int64_t* table, int64_t len,
                            int unit_len, int64_t row, const float* w, int64_t lp, float* acc,
                            int D) {
  if constexpr (JB > 0) {
    if (jb == JB)
      weigh_values<DV, JB>(vbase, table, len, unit_len, row, w, lp, acc, D);
    else
      weigh_values_of<DV, JB - 1>(jb, vbase, table, len, unit_len, row, w, lp, acc, D);
  }
}

// One sequence's query heads g0 * G .. (g0 + gn) * G - 1 (kv heads g0 .. g0 + gn - 1); DV =
// head dim / 16, a compile-time constant so each dot product's FMAs are unrolled.
template <int DV, typename Q, typename KV>
void decode_item16(const Q* q, int64_t q_stride, const KV* cache, const int64_t* table,
                   int64_t len, Q* out, int b, int g0, int gn, int H, int KVH, int unit_len,
                   float scale, float softcap, std::vector<float>& buf) {
  constexpr int D = 16 * DV, JB = DV <= 4 ? 6 : (DV <= 8 ? 3 : 1);  // heads per V pass
  const int G = H / KVH, M = gn * G;
  const int64_t lp = (len + VW - 1) / VW * VW;  // score rows padded to whole vectors
  buf.resize(static_cast<size_t>(M) * (2 * D + lp));
  float* qf = buf.data();   // [M][D] queries in float (pre-scaled unless softcapped)
  float* acc = qf + M * D;  // [M][D]
  float* sc = acc + M * D;  // [M][lp]
  const float qs = softcap > 0.f ? 1.f : scale;
  const Q* qrow = q + b * q_stride + static_cast<int64_t>(g0) * G * D;
  for (int i = 0; i < M * D; ++i) qf[i] = load(qrow[i]) * qs;
  const int64_t row = 2LL * KVH * D;  // elements per pool row (one position)
  const KV* kbase = cache + static_cast<int64_t>(g0) * D;
  for (int64_t p0 = 0; p0 < len; p0 += unit_len) {  // unit by unit: its rows are contiguous
    const KV* unit = kbase + table[p0 / unit_len] * unit_len * row;
    const int64_t n = std::min<int64_t>(unit_len, len - p0);
    const KV* next = p0 + unit_len < len ? kbase + table[p0 / unit_len + 1] * unit_len * row
                                         : nullptr;
    for (int64_t t = 0; t < n; ++t) {
      // fetch the row PF ahead (in this unit or the next): its K to L1, its V to L2 for the
      // second pass; the units lie anywhere in the pool, so the hardware cannot guess them
      const KV* ahead = t + PF < n ? unit + (t + PF) * row
                        : next && p0 + t + PF < len ? next + (t + PF - unit_len) * row
                                                    : nullptr;
      if (ahead) {
        for (int64_t i = 0; i < gn * D; i += 64 / sizeof(KV))
          _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T0);
        for (int64_t i = 0; i < gn * D; i += 64 / sizeof(KV))
          _mm_prefetch(reinterpret_cast<const char*>(ahead + KVH * D + i), _MM_HINT_T1);
      }
      for (int g = 0; g < gn; ++g) {
        const KV* k = unit + t * row + g * D;
        __m512 x[DV];
        for (int c = 0; c < DV; ++c) x[c] = ld16(k + 16 * c);
        for (int j = 0; j < G; ++j) {
          const int m = g * G + j;
          const float* qm = qf + m * D;
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qm), x[0]);
          for (int c = 1; c < DV; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qm + 16 * c), x[c], a);
          sc[m * lp + p0 + t] = _mm512_reduce_add_ps(a);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    float* s = sc + m * lp;
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
    float total = 0.f;
    for (int c = 0; c < VW; ++c) total += sum[c];
    qf[m * D] = 1.f / total;  // the query is spent: keep 1 / sum in its first slot
  }
  for (int g = 0; g < gn; ++g) {
    const KV* vbase = cache + static_cast<int64_t>(KVH + g0 + g) * D;
    for (int j0 = 0; j0 < G; j0 += JB) {
      const int m = g * G + j0;
      weigh_values_of<DV, JB>(std::min(JB, G - j0), vbase, table, len, unit_len, row,
                              sc + m * lp, lp, acc + m * D, D);
    }
  }
  Q* dst = out + static_cast<int64_t>(b) * H * D + static_cast<int64_t>(g0) * G * D;
  for (int m = 0; m < M; ++m) {
    const float inv = qf[m * D];
    for (int i = 0; i < D; ++i) store(dst + m * D + i, acc[m * D + i] * inv);
  }
}

template <typename Q, typename KV>
void decode_item16(int D, const Q* q, int64_t q_stride, const KV* cache, const int64_t* table,
                   int64_t len, Q* out, int b, int g0, int gn, int H, int KVH, int unit_len,
                   float scale, float softcap, std::vector<float>& buf) {
  if (D == 64)
    decode_item16<4>(q, q_stride, cache, table, len, out, b, g0, gn, H, KVH, unit_len, scale,
                     softcap, buf);
  else if (D == 128)
    decode_item16<8>(q, q_stride, cache, table, len, out, b, g0, gn, H, KVH, unit_len, scale,
                     softcap, buf);
  else
    decode_item16<16>(q, q_stride, cache, table, len, out, b, g0, gn, H, KVH, unit_len, scale,
                      softcap, buf);
}
#endif

// ---- Prefill attention on AVX-512: queries transposed, keys read in place ----------------
//
// One item = (chunk, kv head g, QT16 positions): M = QT16 * G query rows (row m = r * G + j:
// position r0 + r, head g * G + j), held transposed (qT[d][m]) so that every FMA works on 16
// rows at once and each key's elements are broadcast straight from its pool row: no transposed
// copy of K. Keys in tiles of KT16 with an online softmax in float32 (scores transposed too,
// sT[t][m]); V rows are broadcast the same way into oT[d][m]. Fixed order of sums per item.
constexpr int KT16 = 64;  // keys per tile
constexpr int KB16 = 8;   // keys (scores) or dims (values) per register block

// exp(x), 16 at a time: the polynomial of ``vexp`` in AVX-512 (2^n by scalef); x below -87
// (a masked score's -inf) gives exactly 0
inline __m512 vexp16(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3333452e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
  const __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(seen, _mm512_scalef_ps(y, fx));
}

// sT[t][mv * 16 ..] = sum_d qT[d][..] * K[t][d] for KB16 keys and MV row vectors; top[mv * 16
// ..] = the max of itself and these scores (the tile's max, where no key is masked)
template <int MV, typename KV>
inline void scores16(const float* qT, int Mp, const KV* const* rows, int D, float* sT,
                     float* top) {
  const KV* krow[KB16];  // in registers, not re-read through the pointer array
  for (int t = 0; t < KB16; ++t) krow[t] = rows[t];
  __m512 acc[KB16][MV];
  for (int t = 0; t < KB16; ++t)
    for (int c = 0; c < MV; ++c) acc[t][c] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m512 qv[MV];
    for (int c = 0; c < MV; ++c) qv[c] = _mm512_loadu_ps(qT + d * Mp + 16 * c);
    for (int t = 0; t < KB16; ++t) {
      const __m512 k = _mm512_set1_ps(load(krow[t][d]));
      for (int c = 0; c < MV; ++c) acc[t][c] = _mm512_fmadd_ps(k, qv[c], acc[t][c]);
    }
  }
  for (int t = 0; t < KB16; ++t)
    for (int c = 0; c < MV; ++c) _mm512_storeu_ps(sT + t * Mp + 16 * c, acc[t][c]);
  for (int c = 0; c < MV; ++c) {
    const __m512 m03 = _mm512_max_ps(_mm512_max_ps(acc[0][c], acc[1][c]),
                                     _mm512_max_ps(acc[2][c], acc[3][c]));
    const __m512 m47 = _mm512_max_ps(_mm512_max_ps(acc[4][c], acc[5][c]),
                                     _mm512_max_ps(acc[6][c], acc[7][c]));
    const __m512 m = _mm512_max_ps(m03, m47);
    _mm512_storeu_ps(top + 16 * c, _mm512_max_ps(_mm512_loadu_ps(top + 16 * c), m));
  }
}

// oT[d0 + dd][mv * 16 ..] = oT[..][..] * alpha[..] + sum_t sT[t][..] * V[t][d0 + dd] for KB16
// dims and MV row vectors (alpha: the online softmax's rescale of what came before)
template <int MV, typename KV>
inline void values16(const float* sT, int Mp, const KV* const* vrow, int kn, int d0,
                     float* oT, const float* alpha) {
  __m512 acc[KB16][MV];
  for (int dd = 0; dd < KB16; ++dd)
    for (int c = 0; c < MV; ++c)
      acc[dd][c] = _mm512_mul_ps(_mm512_loadu_ps(oT + (d0 + dd) * Mp + 16 * c),
                                 _mm512_loadu_ps(alpha + 16 * c));
  for (int t = 0; t < kn; ++t) {
    __m512 pv[MV];
    for (int c = 0; c < MV; ++c) pv[c] = _mm512_loadu_ps(sT + t * Mp + 16 * c);
    for (int dd = 0; dd < KB16; ++dd) {
      const __m512 v = _mm512_set1_ps(load(vrow[t][d0 + dd]));
      for (int c = 0; c < MV; ++c) acc[dd][c] = _mm512_fmadd_ps(v, pv[c], acc[dd][c]);
    }
  }
  for (int dd = 0; dd < KB16; ++dd)
    for (int c = 0; c < MV; ++c) _mm512_storeu_ps(oT + (d0 + dd) * Mp + 16 * c, acc[dd][c]);
}

// the row vectors [v0, v1) in blocks of at most 3 (24 accumulators of the 32 registers)
template <typename F>
inline void row_blocks(int v0, int v1, F&& f) {
  for (int v = v0; v < v1;) {
    const int n = v1 - v >= 3 ? 3 : v1 - v;
    f(v, n);
    v += n;
  }
}

// r[i][j] becomes r[j][i]: 16 x 16 floats transposed in registers (unpacks, then 128-bit lane
// shuffles), for the queries in and the outputs out of their [D][rows] layout
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  const auto pairs = [](__m512 a, __m512 b, bool hi) {
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_castpd_ps(hi ? _mm512_unpackhi_pd(x, y) : _mm512_unpacklo_pd(x, y));
  };
  for (int i = 0; i < 16; i += 4) {
    r[i] = pairs(t[i], t[i + 2], false);
    r[i + 1] = pairs(t[i], t[i + 2], true);
    r[i + 2] = pairs(t[i + 1], t[i + 3], false);
    r[i + 3] = pairs(t[i + 1], t[i + 3], true);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

template <typename Q, typename KV>
void prefill_item16(const Q* q, int64_t q_stride, const KV* cache, const int64_t* table,
                    int64_t start, int64_t row0, int r0, int nr, Q* out, int g,
                    const PrefillShape& sh, std::vector<float>& buf) {
  const int H = sh.H, KVH = sh.KVH, D = sh.D, G = H / KVH, M = nr * G;
  const int MV = (M + 15) / 16, Mp = 16 * MV;  // rows padded to whole vectors
  constexpr bool widen = sizeof(KV) == 2;  // bf16 K/V: each tile's rows widened once
  buf.resize(static_cast<size_t>(Mp) * (2 * D + KT16 + 5) + (widen ? 2 * KT16 * D : 0));
  float* qT = buf.data();      // [D][Mp] queries, scaled
  float* oT = qT + D * Mp;     // [D][Mp]
  float* sT = oT + D * Mp;     // [KT16][Mp] scores, then weights
  float* mx = sT + KT16 * Mp;  // [Mp] running max
  float* l = mx + Mp;          // [Mp] running sum
  float* pos = l + Mp;         // [Mp] each row's position (padding rows: the tile's last)
  float* tmax = pos + Mp;      // [Mp] the tile's max score per row
  float* alpha = tmax + Mp;    // [Mp] the rescale of each row's output by this tile
  float* kv_tile = alpha + Mp;  // bf16: [2][KT16][D] the tile's K, then V rows, as fp32
  const int64_t first = start + r0, nkeys = first + nr;  // keys 0 .. last position of the tile
  for (int m = 0; m < Mp; ++m) {
    pos[m] = static_cast<float>(first + (m < M ? m / G : nr - 1));
    mx[m] = -INFINITY;
    l[m] = 0.f;
  }
  const auto q_row = [&](int m) {  // row m's query: position r0 + m / G, head g * G + m % G
    return q + (row0 + r0 + m / G) * q_stride + static_cast<int64_t>(g * G + m % G) * D;
  };
  const __m512 scale = _mm512_set1_ps(sh.scale);
  for (int m0 = 0; m0 < Mp; m0 += 16)
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = m0 + i < M ? _mm512_mul_ps(ld16(q_row(m0 + i) + d0), scale) : _mm512_setzero_ps();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(qT + (d0 + i) * Mp + m0, r[i]);
    }
  std::memset(oT, 0, sizeof(float) * D * Mp);
  const int64_t row = 2LL * KVH * D;
  // The FMAs broadcast K and V elements straight from their rows: fp32 rows in place; bf16
  // rows widened into ``kv_tile`` first (a bf16 broadcast costs four instructions, one of
  // them on an FMA port; widening first made bf16 1.21x faster on 512-position chunks)
  const float* krow[KT16];
  const float* vrow[KT16];
  for (int64_t k0 = 0; k0 < nkeys; k0 += KT16) {
    const int kn = static_cast<int>(nkeys - k0 < KT16 ? nkeys - k0 : KT16);
    for (int t = 0; t < KT16; ++t) {  // past kn: the last key again, its weights zeroed below
      const int u = t < kn ? t : kn - 1;
      const int64_t p = k0 + u;
      const KV* k = cache + (table[p / sh.unit_len] * sh.unit_len + p % sh.unit_len) * row + g * D;
      if constexpr (widen) {
        float* kw = kv_tile + u * D;
        float* vw = kv_tile + (KT16 + u) * D;
        if (t < kn)
          for (int d = 0; d < D; d += 16) {
            _mm512_storeu_ps(kw + d, ld16(k + d));
            _mm512_storeu_ps(vw + d, ld16(k + KVH * D + d));
          }
        krow[t] = kw;
        vrow[t] = vw;
      } else {
        krow[t] = k;
        vrow[t] = k + KVH * D;
      }
    }
    const int kb = (kn + KB16 - 1) / KB16 * KB16;
    std::fill(tmax, tmax + Mp, -INFINITY);
    for (int t0 = 0; t0 < kb; t0 += KB16)  // keys kn .. kb repeat key kn - 1: the max holds
      row_blocks(0, MV, [&](int v, int n) {
        const float* qb = qT + 16 * v;
        float* sb = sT + t0 * Mp + 16 * v;
        if (n == 3) scores16<3>(qb, Mp, krow + t0, D, sb, tmax + 16 * v);
        else if (n == 2) scores16<2>(qb, Mp, krow + t0, D, sb, tmax + 16 * v);
        else scores16<1>(qb, Mp, krow + t0, D, sb, tmax + 16 * v);
      });
    const bool masked = k0 + kn - 1 > first;  // some key may lie after some query
    for (int c = 0; c < MV; ++c) {
      const __m512 pc = _mm512_loadu_ps(pos + 16 * c), ninf = _mm512_set1_ps(-INFINITY);
      __m512 top = masked ? ninf : _mm512_loadu_ps(tmax + 16 * c);
      if (masked)
        for (int t = 0; t < kn; ++t) {  // key k0 + t hidden from rows at earlier positions
          const __mmask16 hide =
              _mm512_cmp_ps_mask(pc, _mm512_set1_ps(static_cast<float>(k0 + t)), _CMP_LT_OQ);
          const __m512 x = _mm512_mask_blend_ps(hide, _mm512_loadu_ps(sT + t * Mp + 16 * c), ninf);
          _mm512_storeu_ps(sT + t * Mp + 16 * c, x);
          top = _mm512_max_ps(top, x);
        }
      const __m512 old = _mm512_loadu_ps(mx + 16 * c);
      const __m512 best = _mm512_max_ps(old, top);  // finite: key 0 is seen by every row
      const __m512 rescale = vexp16(_mm512_sub_ps(old, best));  // 0 on the first tile
      __m512 sum = _mm512_setzero_ps();
      for (int t = 0; t < kb; ++t) {
        const __m512 e = t < kn ? vexp16(_mm512_sub_ps(_mm512_loadu_ps(sT + t * Mp + 16 * c), best))
                                : _mm512_setzero_ps();
        _mm512_storeu_ps(sT + t * Mp + 16 * c, e);
        sum = _mm512_add_ps(sum, e);
      }
      _mm512_storeu_ps(l + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * c), rescale, sum));
      _mm512_storeu_ps(mx + 16 * c, best);
      _mm512_storeu_ps(alpha + 16 * c, rescale);  // applied as values16 loads oT
    }
    for (int d0 = 0; d0 < D; d0 += KB16)
      row_blocks(0, MV, [&](int v, int n) {
        const float* sb = sT + 16 * v;
        float* ob = oT + 16 * v;
        const float* ab = alpha + 16 * v;
        if (n == 3) values16<3>(sb, Mp, vrow, kn, d0, ob, ab);
        else if (n == 2) values16<2>(sb, Mp, vrow, kn, d0, ob, ab);
        else values16<1>(sb, Mp, vrow, kn, d0, ob, ab);
      });
  }
  for (int m0 = 0; m0 < M; m0 += 16) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(l + m0));
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_mul_ps(_mm512_loadu_ps(oT + (d0 + i) * Mp + m0), inv);
      transpose16(r);
      for (int i = 0; i < 16 && m0 + i < M; ++i) {
        const int m = m0 + i;
        ystore(out + (row0 + r0 + m / G) * static_cast<int64_t>(H) * D +
                   static_cast<int64_t>(g * G + m % G) * D + d0,
               r[i]);
      }
    }
  }
}

template <typename Q, typename KV>
void decode(const Q* q, int64_t q_stride, const KV* cache, const int64_t* tables,
            int64_t t_stride, const int64_t* lens, Q* out, int B, int H, int KVH, int D,
            int unit_len, float scale, float softcap, int serial_max) {
#if defined(__AVX512F__)
  if (vector_decode_dim(D)) {
    // one item per sequence (all its KV heads: each row read whole, in order) while there are
    // sequences enough to share out; else one per (sequence, kv head)
    const int per = B >= 4 * omp_get_max_threads() ? KVH : 1, n = B * (KVH / per);
#pragma omp parallel if (n > serial_max)
    {
      std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
      for (int it = 0; it < n; ++it) {
        const int b = it / (KVH / per), g0 = it % (KVH / per) * per;
        decode_item16(D, q, q_stride, cache, tables + b * t_stride, lens[b], out, b, g0, per,
                      H, KVH, unit_len, scale, softcap, buf);
      }
    }
    return;
  }
#endif
  const int items = B * KVH;
#pragma omp parallel if (items > serial_max)
  {
    std::vector<float> buf;
#pragma omp for schedule(static)
    for (int it = 0; it < items; ++it) {
      const int b = it / KVH, g = it % KVH;
      decode_item(q, q_stride, cache, tables + b * t_stride, lens[b], out, b, g, H, KVH, D,
                  unit_len, scale, softcap, buf);
    }
  }
}

// Skinny fp32 GEMM, y[M, N] = x[M, K] @ W (+ bias), for projections whose weights were packed
// once at load into column panels: panel p holds W[:, 32p : 32p + 32] as K rows of 32 floats,
// so one panel is one sequential stream. Each thread takes a contiguous run of panels; inside a
// panel, rows go up to 12 at a time into 24 AVX-512 accumulators (12 rows x 2 vectors), so a
// panel is read from memory once per step and from cache for every further pass. At decode
// sizes the weights' bytes bound the time and the panels stream at memory speed.
#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

constexpr int PANEL = 32;

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

enum class Fetch { none, whole, spread };  // how the next panel is fetched (panel_rows)

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

template <typename W, typename Y>
inline void panel(const float* x, int64_t x_stride, const W* w, const float* bias, int64_t M,
                  int K, Y* y, int64_t y_stride, const W* next, bool acc) {
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
#endif

template <typename W, typename Y>
int checked_panel_gemm(const float* x, int64_t x_stride, const W* w, const float* bias, Y* y,
                       int64_t y_stride, int64_t M, int K, int64_t N, int accumulate) {
#if defined(__AVX512F__)
  if (N % 32 != 0 || y_stride < N || reinterpret_cast<uintptr_t>(w) % 64 != 0) return -1;
  panel_gemm(x, x_stride, w, bias, y, y_stride, M, K, N, accumulate != 0);
  return 0;
#else
  (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)y_stride, (void)M, (void)K;
  (void)N, (void)accumulate;
  return -1;
#endif
}

template <typename W, typename Y>
int checked_panel_glu(const float* x, int64_t x_stride, const W* w, Y* y, int64_t M, int K,
                      int64_t N) {
#if defined(__AVX512F__)
  if (N % 32 != 0 || reinterpret_cast<uintptr_t>(w) % 64 != 0) return -1;
  panel_glu(x, x_stride, w, y, M, K, N);
  return 0;
#else
  (void)x, (void)x_stride, (void)w, (void)y, (void)M, (void)K, (void)N;
  return -1;
#endif
}

}  // namespace

extern "C" {

// dtype codes: 0 float32, 1 bfloat16. Returns 0, or -1 for a combination not built here.
int kvroom_decode_attention(const void* q, int64_t q_stride, int q_dtype, const void* cache,
                            int kv_dtype, const int64_t* tables, int64_t t_stride,
                            const int64_t* lens, void* out, int B, int H, int KVH, int D,
                            int unit_len, float scale, float softcap, int serial_max) {
  if (q_dtype == 0 && kv_dtype == 0)
    decode(static_cast<const float*>(q), q_stride, static_cast<const float*>(cache), tables,
           t_stride, lens, static_cast<float*>(out), B, H, KVH, D, unit_len, scale, softcap,
           serial_max);
  else if (q_dtype == 0 && kv_dtype == 1)
    decode(static_cast<const float*>(q), q_stride, static_cast<const uint16_t*>(cache), tables,
           t_stride, lens, static_cast<float*>(out), B, H, KVH, D, unit_len, scale, softcap,
           serial_max);
  else if (q_dtype == 1 && kv_dtype == 1)
    decode(static_cast<const uint16_t*>(q), q_stride, static_cast<const uint16_t*>(cache), tables,
           t_stride, lens, static_cast<uint16_t*>(out), B, H, KVH, D, unit_len, scale, softcap,
           serial_max);
  else
    return -1;
  return 0;
}

int kvroom_add_rms_norm(void* h, const void* delta, void* y, const void* w, int dtype,
                        int64_t rows, int64_t n, float eps, int serial_max) {
  if (dtype == 0)
    add_rms_norm(static_cast<float*>(h), static_cast<const float*>(delta), static_cast<float*>(y),
                 static_cast<const float*>(w), rows, n, eps, serial_max);
  else if (dtype == 1)
    add_rms_norm(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(delta),
                 static_cast<uint16_t*>(y), static_cast<const uint16_t*>(w), rows, n, eps,
                 serial_max);
  else
    return -1;
  return 0;
}

// Returns 0, or -1 where this kernel does not apply (dtypes, head_dim not a multiple of 8).
int kvroom_prefill_attention(const void* q, int64_t q_stride, int q_dtype, const void* cache,
                             int kv_dtype, const int64_t* tables, int64_t t_stride,
                             const int64_t* starts, const int64_t* q_lens, void* out, int B,
                             int H, int KVH, int D, int unit_len, float scale) {
  if (D % VW != 0 || H % KVH != 0) return -1;
  const PrefillShape sh{H, KVH, D, unit_len, scale};
  if (q_dtype == 0 && kv_dtype == 0)
    prefill(static_cast<const float*>(q), q_stride, static_cast<const float*>(cache), tables,
            t_stride, starts, q_lens, static_cast<float*>(out), B, sh);
  else if (q_dtype == 0 && kv_dtype == 1)
    prefill(static_cast<const float*>(q), q_stride, static_cast<const uint16_t*>(cache), tables,
            t_stride, starts, q_lens, static_cast<float*>(out), B, sh);
  else if (q_dtype == 1 && kv_dtype == 1)
    prefill(static_cast<const uint16_t*>(q), q_stride, static_cast<const uint16_t*>(cache),
            tables, t_stride, starts, q_lens, static_cast<uint16_t*>(out), B, sh);
  else
    return -1;
  return 0;
}

int kvroom_silu_mul(const void* gu, void* out, int dtype, int64_t rows, int64_t inter,
                    int serial_max) {
  if (dtype == 0)
    silu_mul(static_cast<const float*>(gu), static_cast<float*>(out), rows, inter, serial_max);
  else if (dtype == 1)
    silu_mul(static_cast<const uint16_t*>(gu), static_cast<uint16_t*>(out), rows, inter,
             serial_max);
  else
    return -1;
  return 0;
}

// y[M, N] = x[M, K] (row stride x_stride) @ panels (+ bias), y's rows y_stride apart; with
// accumulate, y += that product instead (rounded first, as torch's matmul then add_). N a
// multiple of 32, panels 64-byte aligned. Returns -1 where the CPU has no AVX-512 (the caller
// keeps oneDNN).
int kvroom_panel_gemm(const float* x, int64_t x_stride, const float* w, const float* bias,
                      float* y, int64_t y_stride, int64_t M, int K, int64_t N, int accumulate) {
  return checked_panel_gemm(x, x_stride, w, bias, y, y_stride, M, K, N, accumulate);
}

// The same for bf16 panels (``[N / 32][K][32]``, each row's columns interleaved: 0, 16, 1,
// 17, ..., 15, 31; see ``wload``) and a bf16 y (x stays fp32, bias fp32).
int kvroom_panel_gemm_bf16(const float* x, int64_t x_stride, const uint16_t* w,
                           const float* bias, uint16_t* y, int64_t y_stride, int64_t M, int K,
                           int64_t N, int accumulate) {
  return checked_panel_gemm(x, x_stride, w, bias, y, y_stride, M, K, N, accumulate);
}

// y[M, N] = silu(x @ W[:, :N]) * (x @ W[:, N:]) for gate_up's panels (2N columns, gate then
// up; N a multiple of 32): the SiLU-GLU fused into the GEMM, as ``silu_mul`` over gate_up's
// product would compute it, bit for bit.
int kvroom_panel_glu(const float* x, int64_t x_stride, const float* w, float* y, int64_t M,
                     int K, int64_t N) {
  return checked_panel_glu(x, x_stride, w, y, M, K, N);
}

int kvroom_panel_glu_bf16(const float* x, int64_t x_stride, const uint16_t* w, uint16_t* y,
                          int64_t M, int K, int64_t N) {
  return checked_panel_glu(x, x_stride, w, y, M, K, N);
}

// 1 where the decode kernel takes its AVX-512 path for this head dim (faster than the prefill
// kernel with one query row), else 0.
int kvroom_decode_vectorized(int D) {
#if defined(__AVX512F__)
  return vector_decode_dim(D);
#else
  (void)D;
  return 0;
#endif
}

// 1 where the prefill kernel takes its AVX-512 path for this head dim, else 0.
int kvroom_prefill_vectorized(int D) { return vector_prefill_dim(D); }

int kvroom_abi_version() { return 7; }

}  // extern "C"
