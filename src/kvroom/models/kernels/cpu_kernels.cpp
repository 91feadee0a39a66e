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
// One work item per (sequence, kv head): its G = H / kvh query heads share every K/V row read.
// Scores are kept (G x len floats), so K and V are each streamed once, softmax is exact
// (max-subtracted, float32), and the order of sums is fixed: results do not depend on threads.
#include <cmath>
#include <cstdint>
#include <cstring>
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

template <typename Q, typename KV>
void decode(const Q* q, int64_t q_stride, const KV* cache, const int64_t* tables,
            int64_t t_stride, const int64_t* lens, Q* out, int B, int H, int KVH, int D,
            int unit_len, float scale, float softcap, int serial_max) {
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

// h += delta (when delta is not null); y = h * rsqrt(mean(h^2) + eps) [* w], float32 stats.
template <typename T>
void add_rms_norm(T* h, const T* delta, T* y, const T* w, int64_t rows, int64_t n, float eps,
                  int serial_max) {
#pragma omp parallel for schedule(static) if (rows > serial_max)
  for (int64_t r = 0; r < rows; ++r) {
    T* hr = h + r * n;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      float x = load(hr[i]);
      if (delta) {
        x = rounded<T>(x + load(delta[r * n + i]));
        store(hr + i, x);
      }
      ss += x * x;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      float v = load(hr[i]) * inv;
      if (w) v = rounded<T>(v) * load(w[i]);
      store(y + r * n + i, v);
    }
  }
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

int kvroom_abi_version() { return 1; }

}  // extern "C"
