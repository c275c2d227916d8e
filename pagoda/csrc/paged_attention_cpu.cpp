// Decode attention straight from the paged KV pool, for CPUs.
//
// One query token per sequence; the keys and values are read in place through the block table,
// so nothing is gathered or padded. Work is split over sequences; each loaded K/V row (all KV
// heads, contiguous) serves every query head, so each row is read once.
// Accumulation is in float32 whatever the storage dtype.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct bf16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline void from_float(float f, float* out) { *out = f; }
inline void from_float(float f, _Float16* out) { *out = static_cast<_Float16>(f); }
inline void from_float(float f, bf16* out) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  out->bits = static_cast<uint16_t>(u >> 16);
}

template <typename T>
inline void load_row(const T* src, float* dst, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = to_float(src[i]);
}

template <typename T>
void decode_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx,
                T* out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                int64_t window) {
  // NOTE: one task per sequence reading whole K/V rows (all KV heads, contiguous) keeps the
  // memory access sequential within each slot; every query head is scored per loaded row.
  const int group = num_heads / num_kv_heads;
  const int row_len = num_kv_heads * head_dim;
  const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
  const int64_t n = ctx - start;
  std::vector<float> qf(num_heads * head_dim), row(row_len), scores(num_heads * n), acc(num_heads * head_dim, 0.f);
  load_row(q, qf.data(), num_heads * head_dim);
  for (auto& x : qf) x *= scale;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = start + t;
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    load_row(k_cache + slot * row_len, row.data(), row_len);
    for (int hq = 0; hq < num_heads; ++hq) {
      const float* qh = &qf[hq * head_dim];
      const float* kh = &row[(hq / group) * head_dim];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int i = 0; i < head_dim; ++i) dot += qh[i] * kh[i];
      scores[hq * n + t] = dot;
    }
  }
  std::vector<float> inv_sum(num_heads);
  for (int hq = 0; hq < num_heads; ++hq) {
    float* s = &scores[hq * n];
    const float mx = *std::max_element(s, s + n);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    inv_sum[hq] = 1.f / sum;
  }
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = start + t;
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    load_row(v_cache + slot * row_len, row.data(), row_len);
    for (int hq = 0; hq < num_heads; ++hq) {
      const float p = scores[hq * n + t];
      const float* vh = &row[(hq / group) * head_dim];
      float* a = &acc[hq * head_dim];
#pragma omp simd
      for (int i = 0; i < head_dim; ++i) a[i] += p * vh[i];
    }
  }
  for (int hq = 0; hq < num_heads; ++hq)
    for (int i = 0; i < head_dim; ++i)
      from_float(acc[hq * head_dim + i] * inv_sum[hq], out + hq * head_dim + i);
}

template <typename T>
void decode(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
            const int64_t* context_lens, void* out, int batch, int num_heads, int num_kv_heads,
            int head_dim, int block_size, int max_blocks, float scale, int64_t window) {
  const T* qt = static_cast<const T*>(q);
  T* ot = static_cast<T*>(out);
  const int64_t q_stride = static_cast<int64_t>(num_heads) * head_dim;
#pragma omp parallel for schedule(dynamic, 1)
  for (int b = 0; b < batch; ++b) {
    decode_one(qt + b * q_stride, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),
               block_tables + static_cast<int64_t>(b) * max_blocks, context_lens[b], ot + b * q_stride,
               num_heads, num_kv_heads, head_dim, block_size, scale, window);
  }
}

}  // namespace

#define PAGODA_DECODE(NAME, T)                                                                   \
  extern "C" void NAME(const void* q, const void* k, const void* v, const int64_t* tables,      \
                       const int64_t* lens, void* out, int batch, int num_heads, int num_kv_heads, \
                       int head_dim, int block_size, int max_blocks, float scale, int64_t window) { \
    decode<T>(q, k, v, tables, lens, out, batch, num_heads, num_kv_heads, head_dim, block_size,   \
              max_blocks, scale, window);                                                         \
  }

PAGODA_DECODE(paged_decode_f32, float)
PAGODA_DECODE(paged_decode_bf16, bf16)
PAGODA_DECODE(paged_decode_f16, _Float16)
