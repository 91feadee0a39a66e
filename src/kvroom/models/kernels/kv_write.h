// The write side of an int8 / int4 KV pool (``models/kv_quant.py`` holds the format and its
// torch twin): the Hadamard rotation of rows and their quantization. ``kv_quant`` calls these
// on the CPU, and the fused decode step (decode_layers.h) calls the same functions, so both
// paths store the same bytes.
//
//   rotation: each block of n values (n the largest power of two dividing D, >= 64) times
//             the normalised Walsh-Hadamard matrix: the butterflies, then 1 / sqrt(n);
//   int8:     scale = max|x| / 127, q = round(x / scale) in -127..127;
//   int4:     16 levels over a range fitted to the row: 0.95 of [min, max] about its centre,
//             then AFFINE_REFITS least-squares refits of (scale, min) to the levels picked;
//             scale and min as float16.
// Rounding is half to even, as torch.round.
#pragma once
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

constexpr float INT8_QMAX = 127.0f;
constexpr float INT4_LEVELS = 15.0f;
constexpr float AFFINE_START = 0.95f;  // kv_quant.AFFINE_START
constexpr int AFFINE_REFITS = 2;       // kv_quant.AFFINE_REFITS
constexpr int MAX_ROW = 512;           // the longest row a stack buffer takes

// Not inlined, here and in quantize_row: the fused step and the Python path then run the same
// machine code (no call site contracts these sums differently), so they store the same bytes.

// x[0 .. width) rotated in place, block by block of n values
__attribute__((noinline)) void hadamard_row(float* x, int width, int n) {
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  for (int b = 0; b < width; b += n) {
    float* y = x + b;
    for (int len = 1; len < n; len <<= 1)
      for (int i = 0; i < n; i += 2 * len)
        for (int j = i; j < i + len; ++j) {
          const float u = y[j], v = y[j + len];
          y[j] = u + v;
          y[j + len] = u - v;
        }
    for (int j = 0; j < n; ++j) y[j] *= norm;
  }
}

// a T row rotated in place, block by block (each result rounded to T, as torch's
// ``(x.float() @ h).to(T)``)
template <typename T>
inline void hadamard_row_as(T* x, int width, int n) {
  float buf[MAX_ROW];
  for (int b = 0; b < width; b += n) {
    for (int i = 0; i < n; ++i) buf[i] = load(x[b + i]);
    hadamard_row(buf, n, n);
    for (int i = 0; i < n; ++i) store(x + b + i, buf[i]);
  }
}

inline float half_clipped(float x) {  // x as a finite float16 holds it
  const float m = 65504.0f;
  return static_cast<float>(static_cast<_Float16>(std::min(std::max(x, -m), m)));
}

inline float level(float x, float low, float step, float lo, float hi) {
  return std::min(std::max(std::nearbyint((x - low) / step), lo), hi);
}

inline void quantize_row8(const float* x, int D, uint8_t* row) {
  float amax = 0.f;
  for (int i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / INT8_QMAX, step = std::max(scale, FLT_MIN);
  for (int i = 0; i < D; ++i) {
    const auto q = static_cast<int8_t>(level(x[i], 0.f, step, -INT8_QMAX, INT8_QMAX));
    std::memcpy(row + i, &q, 1);
  }
  std::memcpy(row + D, &scale, 4);
}

// (scale, min) refitted by least squares to the levels (scale, low) picks; a row whose levels
// are all equal keeps its scale and takes its mean as min
inline void refit4(const float* x, int D, float& scale, float& low) {
  const float step = std::max(scale, FLT_MIN);
  float q[MAX_ROW];
  double qs = 0, xs = 0;
  for (int i = 0; i < D; ++i) {
    q[i] = level(x[i], low, step, 0.f, INT4_LEVELS);
    qs += q[i];
    xs += x[i];
  }
  const double qm = qs / D, xm = xs / D;
  double var = 0, cov = 0;
  for (int i = 0; i < D; ++i) {
    var += (q[i] - qm) * (q[i] - qm);
    cov += (q[i] - qm) * (x[i] - xm);
  }
  const double fitted = var > 0 ? cov / std::max(var, 1e-12) : scale;
  scale = half_clipped(static_cast<float>(fitted));
  low = half_clipped(static_cast<float>(xm - fitted * qm));
}

inline void quantize_row4(const float* x, int D, uint8_t* row) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < D; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const float half = (hi - lo) / 2 * AFFINE_START;
  float scale = half_clipped(2 * half / INT4_LEVELS), low = half_clipped((hi + lo) / 2 - half);
  for (int r = 0; r < AFFINE_REFITS; ++r) refit4(x, D, scale, low);
  const float step = std::max(scale, FLT_MIN);
  for (int i = 0; i < D; i += 2) {
    const auto a = static_cast<uint8_t>(level(x[i], low, step, 0.f, INT4_LEVELS));
    const auto b = static_cast<uint8_t>(level(x[i + 1], low, step, 0.f, INT4_LEVELS));
    row[i / 2] = static_cast<uint8_t>(a | (b << 4));
  }
  const _Float16 params[2] = {static_cast<_Float16>(scale), static_cast<_Float16>(low)};
  std::memcpy(row + D / 2, params, 4);
}

__attribute__((noinline)) void quantize_row(const float* x, int D, int bits, uint8_t* row) {
  if (bits == 8)
    quantize_row8(x, D, row);
  else
    quantize_row4(x, D, row);
}

// The fused step's K/V write: per row b, its KVH keys then KVH values (T, at kv + b *
// row_stride) into pool entry write_index[b] ([2, KVH, R] bytes): keys less shift ([KVH, D]
// float32 holding T values; null: none) rounded to T, rows rotated in place (block > 0) and
// rounded to T, then quantized; kv itself is left as it was.
template <typename T>
void store_kv_q(T* kv, int64_t row_stride, const float* shift, int block, uint8_t* pool,
                const int64_t* write_index, int B, int KVH, int D, int bits) {
  const int64_t R = D * bits / 8 + 4, entry = 2 * KVH * R;
  float buf[MAX_ROW];
  for (int b = 0; b < B; ++b) {
    for (int r = 0; r < 2 * KVH; ++r) {
      T* src = kv + b * row_stride + static_cast<int64_t>(r) * D;
      const bool key = r < KVH;
      for (int i = 0; i < D; ++i) {
        buf[i] = load(src[i]);
        if (key && shift != nullptr) buf[i] = rounded<T>(buf[i] - shift[r * D + i]);
      }
      if (block > 0) {
        hadamard_row(buf, D, block);
        for (int i = 0; i < D; ++i) buf[i] = rounded<T>(buf[i]);
      }
      quantize_row(buf, D, bits, pool + write_index[b] * entry + r * R);
    }
  }
}

}  // namespace
