// A decode step through every layer of a Llama-family decoder in one call
// (``kvroom_decode_layers``): the same kernels, in the same order, as ``DecoderLayer.forward``
// calls them from Python one by one, so the result is the same, without ~10 Python dispatches
// per layer (a third of a single stream's time on a 135M model).
//
// Per layer:  x = rms(h); qkv = x Wqkv (+b); rope(q, k); pool[slot] = k, v;
//             a = attention(q, pool); h += a Wo (+b); x = rms(h); h += down(silu(x Wg) * x Wu)
// An int8 / int4 pool (kv_write.h): k less the layer's key shift, q, k, v rotated, k and v
// quantized into the pool, attention read in place, its output rotated back.
//
// Weights come as a descriptor per layer (int64 fields, ``models/fused_decode.py``): per
// projection its kind, pointers and quantization format. Included by cpu_kernels.cpp after its
// entry points, which this calls.
#pragma once

namespace {

enum ProjectionKind : int64_t { QUANT = 0, PANELS = 1 };  // PANELS: of the activations' dtype

constexpr int PROJ_FIELDS = 8;  // kind, weight, scales, mins, bits, group, half scales, in scale
// qkv, o, gate_up, down; the qkv and o biases; the key shift ([KVH, D] float32, or 0)
constexpr int LAYER_FIELDS = 4 * PROJ_FIELDS + 3;
constexpr int KEY_SHIFT_FIELD = 4 * PROJ_FIELDS + 2;

// kv_dtype: 0 fp32, 1 bf16, 8 int8, 4 int4 pools; rot_block: the Hadamard block (0: none)
struct StepShape {
  int B, hidden, H, KVH, D, inter, unit_len, dtype, kv_dtype, rot_block;
  float scale, eps;
  int serial_items, serial_rows;
};

template <typename T>
T* ptr(int64_t field) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(field));
}

// x [M, K] (the activations' dtype) as the GEMMs read it: fp32, times the input scale if any
const float* gemm_input(const void* x, int dtype, int64_t M, int K, const float* in_scale,
                        float* xf) {
  if (dtype == 0 && in_scale == nullptr) return static_cast<const float*>(x);
  for (int64_t i = 0; i < M * K; ++i) {
    const float v = dtype == 0 ? static_cast<const float*>(x)[i]
                               : load(static_cast<const uint16_t*>(x)[i]);
    xf[i] = in_scale == nullptr ? v : v * in_scale[i % K];
  }
  return xf;
}

// y = x @ W (+ bias) for one projection; accumulate: y += it; glu: y = silu(x Wg) * (x Wu)
int project(const int64_t* P, const void* x, const float* bias, void* y, int64_t M, int K,
            int64_t N, bool accumulate, bool glu, const StepShape& s, float* xf) {
  const float* in = gemm_input(x, s.dtype, M, K, ptr<const float>(P[7]), xf);
  switch (P[0]) {
    case QUANT:
      return kvroom_quant_gemm(in, K, ptr<const uint8_t>(P[1]), ptr<const void>(P[2]),
                               ptr<const void>(P[3]), static_cast<int>(P[4]),
                               static_cast<int>(P[5]), static_cast<int>(P[6]), bias, y, s.dtype,
                               N, M, K, N, accumulate, glu);
    case PANELS:
      if (s.dtype == 0)
        return glu ? kvroom_panel_glu(in, K, ptr<const float>(P[1]), static_cast<float*>(y), M,
                                      K, N)
                   : kvroom_panel_gemm(in, K, ptr<const float>(P[1]), bias,
                                       static_cast<float*>(y), N, M, K, N, accumulate);
      return glu ? kvroom_panel_glu_bf16(in, K, ptr<const uint16_t>(P[1]),
                                         static_cast<uint16_t*>(y), M, K, N)
                 : kvroom_panel_gemm_bf16(in, K, ptr<const uint16_t>(P[1]), bias,
                                          static_cast<uint16_t*>(y), N, M, K, N, accumulate);
    default:
      return -1;
  }
}

// rotate pairs (2i, 2i+1) of each of n heads per row by cis [M, D/2] (cos, sin): as torch's
// complex multiply, each product rounded on its own (no FMA), so fp32 matches it bit for bit
inline float rounded_product(float a, float b) {
  float p = a * b;
  __asm__("" : "+x"(p));  // p is rounded here: the sum it enters cannot fuse it into an FMA
  return p;
}

template <typename T>
void rope_rows(T* x, int64_t row_stride, int M, int n, int D, const float* cis) {
  for (int m = 0; m < M; ++m) {
    const float* c = cis + static_cast<int64_t>(m) * D;
    for (int j = 0; j < n; ++j) {
      T* v = x + m * row_stride + static_cast<int64_t>(j) * D;
      for (int i = 0; i < D / 2; ++i) {
        const float a = load(v[2 * i]), b = load(v[2 * i + 1]);
        const float cs = c[2 * i], sn = c[2 * i + 1];
        const float ac = rounded_product(a, cs), bs = rounded_product(b, sn);
        const float as = rounded_product(a, sn), bc = rounded_product(b, cs);
        store(v + 2 * i, ac - bs);
        store(v + 2 * i + 1, as + bc);
      }
    }
  }
}

// pool rows write_index[b] (entries [2, KVH, D]) = this step's k, v of row b
template <typename T, typename KV>
void store_kv(const T* kv, int64_t row_stride, KV* pool, const int64_t* write_index, int B,
              int64_t entry) {
  for (int b = 0; b < B; ++b) {
    const T* src = kv + b * row_stride;
    KV* dst = pool + write_index[b] * entry;
    for (int64_t i = 0; i < entry; ++i) store(dst + i, load(src[i]));
  }
}

// store this step's K/V in a float pool and attend: attn [B, H * D]
template <typename T>
int attend_float(T* qkv, void* cache, const int64_t* tables, int64_t t_stride,
                 const int64_t* lens, const int64_t* write_index, const StepShape& s, T* attn) {
  const int64_t qkv_n = static_cast<int64_t>(s.H + 2 * s.KVH) * s.D;
  const int64_t q_n = static_cast<int64_t>(s.H) * s.D;
  const int64_t entry = 2 * static_cast<int64_t>(s.KVH) * s.D;
  if (s.kv_dtype == 0)
    store_kv(qkv + q_n, qkv_n, static_cast<float*>(cache), write_index, s.B, entry);
  else
    store_kv(qkv + q_n, qkv_n, static_cast<uint16_t*>(cache), write_index, s.B, entry);
  return kvroom_decode_attention(qkv, qkv_n, s.dtype, cache, s.kv_dtype, tables, t_stride, lens,
                                 attn, s.B, s.H, s.KVH, s.D, s.unit_len, s.scale, 0.0f,
                                 s.serial_items);
}

// the same over an int8 / int4 pool: as ``paged_attention`` runs it (kv_write.h)
template <typename T>
int attend_quantized(const int64_t* L, T* qkv, void* cache, const int64_t* tables,
                     int64_t t_stride, const int64_t* lens, const int64_t* write_index,
                     const StepShape& s, T* attn) {
  const int64_t qkv_n = static_cast<int64_t>(s.H + 2 * s.KVH) * s.D;
  const int q_n = s.H * s.D;
  store_kv_q(qkv + q_n, qkv_n, ptr<const float>(L[KEY_SHIFT_FIELD]), s.rot_block,
             static_cast<uint8_t*>(cache), write_index, s.B, s.KVH, s.D, s.kv_dtype);
  if (s.rot_block > 0)
    for (int b = 0; b < s.B; ++b) hadamard_row_as(qkv + b * qkv_n, q_n, s.rot_block);
  const int rc = kvroom_decode_attention_q(qkv, qkv_n, s.dtype, cache, s.kv_dtype, tables,
                                           t_stride, lens, attn, s.B, s.H, s.KVH, s.D,
                                           s.unit_len, s.scale, 0.0f, s.serial_items);
  if (s.rot_block > 0)
    for (int b = 0; b < s.B; ++b)
      hadamard_row_as(attn + static_cast<int64_t>(b) * q_n, q_n, s.rot_block);
  return rc;
}

template <typename T>
int layer_step(const int64_t* L, void* cache, void* h_, const float* cis, const int64_t* tables,
               int64_t t_stride, const int64_t* lens, const int64_t* write_index,
               const StepShape& s, float* work) {
  T* h = static_cast<T*>(h_);
  const int64_t B = s.B, qkv_n = static_cast<int64_t>(s.H + 2 * s.KVH) * s.D;
  const int64_t q_n = static_cast<int64_t>(s.H) * s.D, widest = std::max<int64_t>(
      std::max<int64_t>(qkv_n, s.inter), s.hidden);
  // scratch, in floats (a bf16 buffer uses the first half of its slot)
  float* xf = work;
  T* x = reinterpret_cast<T*>(xf + B * widest);
  T* qkv = reinterpret_cast<T*>(xf + 2 * B * widest);
  T* attn = reinterpret_cast<T*>(xf + 3 * B * widest);
  const float eps = s.eps;
  int rc = kvroom_add_rms_norm(h, nullptr, x, nullptr, s.dtype, B, s.hidden, eps, s.serial_rows);
  rc |= project(L, x, ptr<const float>(L[4 * PROJ_FIELDS]), qkv, B, s.hidden, qkv_n, false,
                false, s, xf);
  if (rc != 0) return rc;
  rope_rows(qkv, qkv_n, s.B, s.H + s.KVH, s.D, cis);
  rc = s.kv_dtype <= 1 ? attend_float(qkv, cache, tables, t_stride, lens, write_index, s, attn)
                       : attend_quantized(L, qkv, cache, tables, t_stride, lens, write_index, s,
                                          attn);
  T* o = qkv;  // q, k, v are read: o_proj's output takes their place
  rc |= project(L + PROJ_FIELDS, attn, ptr<const float>(L[4 * PROJ_FIELDS + 1]), o, B,
                static_cast<int>(q_n), s.hidden, false, false, s, xf);
  rc |= kvroom_add_rms_norm(h, o, x, nullptr, s.dtype, B, s.hidden, eps, s.serial_rows);
  if (rc != 0) return rc;
  T* g = attn;  // free again: the GLU's [B, inter] goes there
  rc = project(L + 2 * PROJ_FIELDS, x, nullptr, g, B, s.hidden, s.inter, false, true, s, xf);
  rc |= project(L + 3 * PROJ_FIELDS, g, nullptr, h, B, s.inter, s.hidden, true, false, s, xf);
  return rc;
}

}  // namespace

extern "C" {

// One decode step (one row per sequence, B rows) through n_layers layers, h [B, hidden] (fp32
// dtype 0 or bf16 1) updated in place. layers: n_layers x LAYER_FIELDS descriptors; caches: each
// layer's pool [units, unit_len, 2, KVH, D] (kv_dtype 0 fp32, 1 bf16), or of uint8 rows
// [.., R] (kv_dtype 8 int8, 4 int4; rot_block their Hadamard block, 0: none); cis [B, D/2, 2] (cos,
// sin); tables/lens/write_index as the decode kernel and ``paged_attention`` take them; work:
// decode_layers_work_floats(...) floats. Returns 0, or non-zero where a kernel does not apply
// (then h is partly updated: the caller checks applicability first).
int kvroom_decode_layers(const int64_t* layers, int n_layers, const int64_t* caches, int kv_dtype,
                         void* h, int dtype, const float* cis, const int64_t* tables,
                         int64_t t_stride, const int64_t* lens, const int64_t* write_index,
                         int B, int hidden, int H, int KVH, int D, int inter, int unit_len,
                         float scale, float eps, float* work, int serial_items, int serial_rows,
                         int rot_block) {
  if (dtype == 1 && kv_dtype == 0) return -1;
  if (kv_dtype > 1 && (D > MAX_ROW || (rot_block > 0 && D % rot_block != 0))) return -1;
  const StepShape s{B,     hidden,   H,         KVH,   D,   inter,        unit_len,
                    dtype, kv_dtype, rot_block, scale, eps, serial_items, serial_rows};
  for (int l = 0; l < n_layers; ++l) {
    const int64_t* L = layers + static_cast<int64_t>(l) * LAYER_FIELDS;
    void* cache = ptr<void>(caches[l]);
    const int rc = dtype == 0 ? layer_step<float>(L, cache, h, cis, tables, t_stride, lens,
                                                  write_index, s, work)
                              : layer_step<uint16_t>(L, cache, h, cis, tables, t_stride, lens,
                                                     write_index, s, work);
    if (rc != 0) return rc;
  }
  return 0;
}

// floats of scratch ``kvroom_decode_layers`` needs for B rows
int64_t kvroom_decode_layers_work(int B, int hidden, int H, int KVH, int D, int inter) {
  const int64_t qkv_n = static_cast<int64_t>(H + 2 * KVH) * D;
  const int64_t widest = std::max<int64_t>(std::max<int64_t>(qkv_n, int64_t{inter}), hidden);
  return 4 * B * widest;
}

}  // extern "C"
