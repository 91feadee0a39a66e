// Portable building blocks of every kernel: scalar fp32/bf16 loads and stores, and 8-float
// vectors (GCC vector extensions: one AVX2 register on x86-64-v3, two SSE ones on v2, the low
// half of an AVX-512 one on v4), with their bf16 widening, rounding and exp.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

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

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(32)));
constexpr int VW = 8;  // floats per vector

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

// VW values at p as floats, and back (bf16: exact widening; rounding to nearest even, NaN
// kept, as the scalar load/store above do).
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

// a horizontal sum, in a fixed order
inline float hsum(vf v) {
  float s = 0.f;
  for (int c = 0; c < VW; ++c) s += v[c];
  return s;
}

struct PrefillShape {
  int H, KVH, D, unit_len;
  float scale;
};

}  // namespace
