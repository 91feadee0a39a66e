// AVX-512 loads and stores of fp32 and bf16 rows, 16 floats at a time.
#pragma once
#include <immintrin.h>

#include "common.h"

namespace {

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

}  // namespace
