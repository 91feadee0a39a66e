// kvroom CPU kernels, built once per CPU by kernels/build.py (g++ -O3 -march=native -fopenmp,
// or another -march for a given x86-64 level) and called through ctypes with raw pointers.
// OpenMP here is torch's own libgomp (same SONAME, already loaded), so these loops share
// torch's thread pool and thread count.
//
// The code is split by ISA, so that each level's guards are whole files:
//   common.h            scalar and 8-float vector helpers (every target)
//   portable.h          decode and prefill attention, add + RMSNorm, SiLU-GLU (every target)
//   panel_layout.h      the packed weight panels
//   vector_panels.h     one panel pass in 8-float vectors (every target without AVX-512)
//   avx512_*.h          AVX-512 decode and prefill attention and panel pass
//   kvq_attention.h     decode and prefill attention over int8/int4 KV (every target)
//   kv_write.h          the Hadamard rotation and quantization of int8/int4 KV rows
//   panels.h            the panel GEMM's driver (every target)
//   quant_panels.h      the weight-only quantized GEMM over int4 / int8 panels (every target)
//   decode_layers.h     a decode step through every layer in one call (every target)
// This file holds the entry points and chooses, per call, the ISA path that applies.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "panels.h"
#include "portable.h"
#include "quant_panels.h"
#include "kvq_attention.h"
#include "kv_write.h"
#if defined(__AVX512F__)
#include "avx512_attention.h"
#else
#include "vector_decode.h"
#endif

namespace {

// the AVX-512 prefill path (``prefill_item16``) takes head dims of whole 16-float vectors
inline bool vector_prefill_dim(int D) {
#if defined(__AVX512F__)
  return D % 16 == 0;
#else
  (void)D;
  return false;
#endif
}

#if !defined(__AVX512F__)
inline bool vector_decode_dim(int D) { return vector_decode8_dim(D); }
#endif

// query positions per work item of the AVX-512 path (``wide``) or the portable one
inline int prefill_item_rows(bool wide) {
#if defined(__AVX512F__)
  return wide ? QT16 : QT;
#else
  (void)wide;
  return QT;
#endif
}

template <typename Q, typename KV>
void prefill(const Q* q, int64_t q_stride, const KV* cache, const int64_t* tables,
             int64_t t_stride, const int64_t* starts, const int64_t* q_lens, Q* out, int B,
             const PrefillShape& sh) {
  // the AVX-512 path: 16 rows per FMA (float KV only)
  const bool wide = KVBits<KV>::value == 0 && vector_prefill_dim(sh.D);
  const int qt = prefill_item_rows(wide);
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
      if constexpr (KVBits<KV>::value == 0) {
        if (wide) {
          prefill_item16(q, q_stride, cache, tables + it.b * t_stride, starts[it.b], it.row0,
                         it.r0, nr, out, it.g, sh, buf);
          continue;
        }
      }
#endif
      prefill_item(q, q_stride, cache, tables + it.b * t_stride, starts[it.b], it.row0, it.r0,
                   nr, out, it.g, sh, buf);
    }
  }
}

// one item per sequence (all its KV heads: each row read whole, in order) while there are
// sequences enough to share out; else one per (sequence, kv head)
template <typename Item>
void decode_items(int B, int KVH, int serial_max, Item&& item) {
  const int per = B >= 4 * omp_get_max_threads() ? KVH : 1, n = B * (KVH / per);
#pragma omp parallel if (n > serial_max)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n; ++it) item(it / (KVH / per), it % (KVH / per) * per, per, buf);
  }
}

template <typename Q, typename KV>
void decode(const Q* q, int64_t q_stride, const KV* cache, const int64_t* tables,
            int64_t t_stride, const int64_t* lens, Q* out, int B, int H, int KVH, int D,
            int unit_len, float scale, float softcap, int serial_max) {
  if (vector_decode_dim(D)) {
    decode_items(B, KVH, serial_max, [&](int b, int g0, int gn, std::vector<float>& buf) {
#if defined(__AVX512F__)
      decode_item16(D, q, q_stride, cache, tables + b * t_stride, lens[b], out, b, g0, gn, H,
                    KVH, unit_len, scale, softcap, buf);
#else
      decode_item8(D, q, q_stride, cache, tables + b * t_stride, lens[b], out, b, g0, gn, H,
                   KVH, unit_len, scale, softcap, buf);
#endif
    });
    return;
  }
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

template <typename W, typename Y>
int checked_panel_gemm(const float* x, int64_t x_stride, const W* w, const float* bias, Y* y,
                       int64_t y_stride, int64_t M, int K, int64_t N, int accumulate) {
  if (N % PANEL != 0 || y_stride < N || reinterpret_cast<uintptr_t>(w) % 64 != 0) return -1;
  panel_gemm(x, x_stride, w, bias, y, y_stride, M, K, N, accumulate != 0);
  return 0;
}

template <typename W, typename Y>
int checked_panel_glu(const float* x, int64_t x_stride, const W* w, Y* y, int64_t M, int K,
                      int64_t N) {
  if (N % PANEL != 0 || reinterpret_cast<uintptr_t>(w) % 64 != 0) return -1;
  panel_glu(x, x_stride, w, y, M, K, N);
  return 0;
}

template <typename Y>
int checked_quant_gemm(const float* x, int64_t x_stride, const QuantWeight& w, const float* bias,
                       Y* y, int64_t y_stride, int64_t M, int K, int64_t N, int accumulate,
                       int glu) {
  if (N % PANEL != 0 || (w.bits != 4 && w.bits != 8) || w.group <= 0 || K % w.group != 0)
    return -1;
  if (glu)
    quant_glu(x, x_stride, w, y, M, K, N);
  else
    quant_gemm(x, x_stride, w, bias, y, y_stride, M, K, N, accumulate != 0);
  return 0;
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

// 1 where the decode kernel takes its vector path for this head dim (AVX-512, or 8-float
// vectors elsewhere: faster than the prefill kernel with one query row), else 0.
int kvroom_decode_vectorized(int D) { return vector_decode_dim(D); }

// 1 where the prefill kernel takes its AVX-512 path for this head dim, else 0.
int kvroom_prefill_vectorized(int D) { return vector_prefill_dim(D); }

// y[M, N] = x[M, K] @ W (+ bias) for W in quantized panels (``quant_panels.h``: ``q`` the
// values, ``scales`` and ``mins`` (or null) per group of ``group`` K rows, float16 where
// ``half_scales``); with accumulate, y += the product rounded to y's dtype first. With glu,
// y[M, N] = silu(x @ W[:, :N]) * (x @ W[:, N:]) for gate_up's 2N columns (y_stride = N, no
// bias). y_dtype: 0 float32, 1 bfloat16. Returns -1 for a shape or format not built here.
int kvroom_quant_gemm(const float* x, int64_t x_stride, const uint8_t* q, const void* scales,
                      const void* mins, int bits, int group, int half_scales, const float* bias,
                      void* y, int y_dtype, int64_t y_stride, int64_t M, int K, int64_t N,
                      int accumulate, int glu) {
  const QuantWeight w{q, scales, mins, bits, group, half_scales != 0};
  if (y_dtype == 0)
    return checked_quant_gemm(x, x_stride, w, bias, static_cast<float*>(y), y_stride, M, K, N,
                              accumulate, glu);
  if (y_dtype == 1)
    return checked_quant_gemm(x, x_stride, w, bias, static_cast<uint16_t*>(y), y_stride, M, K,
                              N, accumulate, glu);
  return -1;
}

int kvroom_abi_version() { return 12; }

}  // extern "C"

// ---- int8 / int4 KV (kvq_attention.h) --------------------------------------------------------
extern "C" {

// Decode attention over a pool of int8 (kv_bits 8) or int4 (4) rows, each followed by its
// parameters (int8: a float32 scale; int4: a float16 scale and min); q and out float32
// (q_dtype 0) or bfloat16 (1). Returns 0, or -1 where not built (head dim not a multiple of
// 16, H not a multiple of KVH, other dtypes).
int kvroom_decode_attention_q(const void* q, int64_t q_stride, int q_dtype, const void* cache,
                              int kv_bits, const int64_t* tables, int64_t t_stride,
                              const int64_t* lens, void* out, int B, int H, int KVH, int D,
                              int unit_len, float scale, float softcap, int serial_max) {
  if (D % 16 != 0 || H % KVH != 0) return -1;
  const auto* c = static_cast<const uint8_t*>(cache);
  if (q_dtype == 0)
    return decode_q_bits(static_cast<const float*>(q), q_stride, c, kv_bits, tables, t_stride,
                         lens, static_cast<float*>(out), B, H, KVH, D, unit_len, scale, softcap,
                         serial_max);
  if (q_dtype == 1)
    return decode_q_bits(static_cast<const uint16_t*>(q), q_stride, c, kv_bits, tables,
                         t_stride, lens, static_cast<uint16_t*>(out), B, H, KVH, D, unit_len,
                         scale, softcap, serial_max);
  return -1;
}

// Prefill attention (``kvroom_prefill_attention``) over int8 / int4 rows; -1 where not built.
int kvroom_prefill_attention_q(const void* q, int64_t q_stride, int q_dtype, const void* cache,
                               int kv_bits, const int64_t* tables, int64_t t_stride,
                               const int64_t* starts, const int64_t* q_lens, void* out, int B,
                               int H, int KVH, int D, int unit_len, float scale) {
  if (D % 16 != 0 || H % KVH != 0 || (kv_bits != 8 && kv_bits != 4) || q_dtype > 1) return -1;
  const PrefillShape sh{H, KVH, D, unit_len, scale};
  const auto run = [&](auto* tag) {
    using KV = std::remove_pointer_t<decltype(tag)>;
    const auto* c = static_cast<const KV*>(cache);
    if (q_dtype == 0)
      prefill(static_cast<const float*>(q), q_stride, c, tables, t_stride, starts, q_lens,
              static_cast<float*>(out), B, sh);
    else
      prefill(static_cast<const uint16_t*>(q), q_stride, c, tables, t_stride, starts, q_lens,
              static_cast<uint16_t*>(out), B, sh);
  };
  if (kv_bits == 8)
    run(static_cast<KVInt8*>(nullptr));
  else
    run(static_cast<KVInt4*>(nullptr));
  return 0;
}

// x [rows, width] (row stride x_stride elements) rotated into out (out_stride), fp32 (dtype 0)
// or bf16 (1), by blocks of n values (kv_write.h). Returns 0, or -1 where not built.
int kvroom_hadamard_rows(const void* x, int64_t x_stride, void* out, int64_t out_stride,
                         int dtype, int64_t rows, int width, int n) {
  if (n < 2 || n > MAX_ROW || (n & (n - 1)) != 0 || width % n != 0 || dtype > 1) return -1;
  const auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int64_t r = 0; r < rows; ++r) {
      T* dst = static_cast<T*>(out) + r * out_stride;
      std::memcpy(dst, static_cast<const T*>(x) + r * x_stride, sizeof(T) * width);
      hadamard_row_as(dst, width, n);
    }
  };
  if (dtype == 0)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<uint16_t*>(nullptr));
  return 0;
}

// x [rows, D] float32 (contiguous) as int8 (bits 8) or int4 (4) pool rows [rows, R] (kv_write.h)
int kvroom_kv_quantize(const float* x, int64_t rows, int D, int bits, uint8_t* out) {
  if ((bits != 8 && bits != 4) || D % 2 != 0 || D > MAX_ROW) return -1;
  const int64_t R = D * bits / 8 + 4;
  for (int64_t r = 0; r < rows; ++r) quantize_row(x + r * D, D, bits, out + r * R);
  return 0;
}

}  // extern "C"

// ---- a whole decode step (decode_layers.h) ----------------------------------------------------
#include "decode_layers.h"
