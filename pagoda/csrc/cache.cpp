// Writing new K/V into the paged pool, and rotary embedding applied in place.
//
// `reshape_and_cache` (vLLM's name) copies token t's K and V rows (num_kv_heads x head_dim,
// contiguous within the row, rows `k_stride`/`v_stride` elements apart) to pool slot
// slot_mapping[t]; a negative slot is skipped (padding). A one-byte (fp8) pool stores each
// value divided by its per-tensor scale, rounded to nearest even and saturated. The pool is
// [num_blocks * block_size, num_kv_heads, head_dim] per layer, so a slot is one row.
// `rotary_inplace` rotates heads with the neox layout (halves, as Hugging Face's
// rotate_half) and rounds like Hugging Face's `x * cos + rotate_half(x) * sin` in the storage
// dtype: cos/sin cast to T, each product rounded to T, the sum rounded to T.
// `hadamard_inplace` multiplies each head by the normalized Walsh-Hadamard matrix (head_dim a
// power of two, at most kMaxHadamard): butterflies of strides 1, 2, 4, ... in fp32 (on
// 16-lane vectors where head_dim allows), then the scale 1 / sqrt(head_dim), rounded once to
// T; the same operations in the same order as
// pagoda/layers/attention.py's torch version, so both give the same bits. An fp8 pool stores
// K rotated so (Q too): e4m3's error spreads over every channel instead of the few that carry
// most of a key's magnitude.
#include <cmath>
#include <cstring>

#include "parallel.h"
#include "vec.h"

namespace pagoda {
namespace {

constexpr int64_t kParallelTokens = 64;  // below this, copies run on the calling thread

template <typename T, typename C>
void convert_row(const T* src, C* dst, int64_t n, float inv_scale) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, size_t(n) * sizeof(T));
  } else {
    for (int64_t i = 0; i < n; ++i) store_one(to_float(src[i]) * inv_scale, dst + i);
  }
}

template <typename T, typename C>
void reshape_and_cache(const T* k, const T* v, C* k_cache, C* v_cache, const int64_t* slots,
                       int64_t num_tokens, int64_t row_len, int64_t k_stride, int64_t v_stride,
                       float k_scale, float v_scale) {
  const float k_inv = 1.f / k_scale, v_inv = 1.f / v_scale;
  auto copy = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      convert_row(k + t * k_stride, k_cache + slot * row_len, row_len, k_inv);
      convert_row(v + t * v_stride, v_cache + slot * row_len, row_len, v_inv);
    }
  };
  if (num_tokens < kParallelTokens) {
    copy(0, num_tokens);
  } else {
    parallel_ranges(num_tokens, 16, copy);
  }
}

// Token t's heads rotated by one position's cos/sin: each 16-lane chunk of cos/sin rounded to T
// once, then applied to every head.
template <typename T>
void rotate_token(T* x, const float* cos, const float* sin, int num_heads, int half, int64_t head_stride) {
  for (int i = 0; i < half; i += kLanes) {
    const Mask m = tail_mask(half - i);
    const Vf c1 = round_as<T>(load(cos + i, m)), s1 = round_as<T>(load(sin + i, m));
    const Vf c2 = round_as<T>(load(cos + half + i, m)), s2 = round_as<T>(load(sin + half + i, m));
    for (int h = 0; h < num_heads; ++h) {
      T* xh = x + h * head_stride;
      const Vf x1 = load(xh + i, m), x2 = load(xh + half + i, m);
      store(xh + i, round_as<T>(x1 * c1) - round_as<T>(x2 * s1), m);
      store(xh + half + i, round_as<T>(x2 * c2) + round_as<T>(x1 * s2), m);
    }
  }
}

template <typename T>
void rotary_inplace(T* x, const int64_t* positions, const float* cos, const float* sin, int64_t num_tokens,
                    int num_heads, int head_dim, int64_t token_stride, int64_t head_stride) {
  auto rotate = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rotate_token(x + t * token_stride, cos + positions[t] * head_dim, sin + positions[t] * head_dim, num_heads,
                   head_dim / 2, head_stride);
  };
  if (num_tokens < kParallelTokens) {
    rotate(0, num_tokens);
  } else {
    parallel_ranges(num_tokens, 16, rotate);
  }
}

constexpr int kMaxHadamard = 256;

// Butterfly stages of strides 1, 2, 4, ... < n over v[0, n): v[i], v[i + h] = a + b, a - b.
template <typename V>
void butterflies(V* v, int n) {
  for (int h = 1; h < n; h *= 2)
    for (int j = 0; j < n; j += 2 * h)
      for (int i = j; i < j + h; ++i) {
        const V a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
}

template <typename T>
void hadamard_head(T* x, int head_dim, float scale) {
  float v[kMaxHadamard];
  for (int i = 0; i < head_dim; ++i) v[i] = to_float(x[i]);
  butterflies(v, head_dim);
  for (int i = 0; i < head_dim; ++i) store_one(v[i] * scale, x + i);
}

#ifdef PAGODA_AVX512
// Butterfly stage h < 16 inside one vector: lane i pairs with lane i ^ h; the lower lane of a
// pair gets self + partner, the upper partner - self (the scalar loop's a + b and a - b).
inline Vf butterfly_in_vector(Vf x, int h) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 partner = _mm512_permutexvar_ps(_mm512_xor_si512(lanes, _mm512_set1_epi32(h)), x.v);
  const __mmask16 upper = _mm512_test_epi32_mask(lanes, _mm512_set1_epi32(h));
  return {_mm512_mask_mov_ps(_mm512_add_ps(x.v, partner), upper, _mm512_sub_ps(partner, x.v))};
}

// hadamard_head with head_dim a multiple of 16: the same operations on every element, in the
// same order (stages 1-8 inside each vector, then across vectors), so the same bits.
template <typename T>
void hadamard_head_vectors(T* x, int head_dim, float scale) {
  Vf v[kMaxHadamard / kLanes];
  const int n = head_dim / kLanes;
  for (int j = 0; j < n; ++j) v[j] = load(x + j * kLanes);
  for (int h = 1; h < kLanes; h *= 2)
    for (int j = 0; j < n; ++j) v[j] = butterfly_in_vector(v[j], h);
  butterflies(v, n);
  const Vf s = vset1(scale);
  for (int j = 0; j < n; ++j) store(x + j * kLanes, v[j] * s);
}
#endif

template <typename T>
void hadamard_inplace(T* x, int64_t num_tokens, int num_heads, int head_dim, int64_t token_stride,
                      int64_t head_stride) {
  if (head_dim > kMaxHadamard || (head_dim & (head_dim - 1)) != 0) return;  // refused in Python
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  auto rotate = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int h = 0; h < num_heads; ++h) {
        T* head = x + t * token_stride + h * head_stride;
#ifdef PAGODA_AVX512
        if (head_dim % kLanes == 0) {
          hadamard_head_vectors(head, head_dim, scale);
          continue;
        }
#endif
        hadamard_head(head, head_dim, scale);
      }
  };
  if (num_tokens < kParallelTokens) {
    rotate(0, num_tokens);
  } else {
    parallel_ranges(num_tokens, 16, rotate);
  }
}

}  // namespace
}  // namespace pagoda

#define PAGODA_RESHAPE_AND_CACHE(NAME, T, C)                                                       \
  extern "C" void NAME(const void* k, const void* v, void* k_cache, void* v_cache, const int64_t* slots, \
                       int64_t num_tokens, int64_t row_len, int64_t k_stride, int64_t v_stride,         \
                       float k_scale, float v_scale) {                                                  \
    pagoda::reshape_and_cache(static_cast<const T*>(k), static_cast<const T*>(v), static_cast<C*>(k_cache), \
                              static_cast<C*>(v_cache), slots, num_tokens, row_len, k_stride, v_stride,  \
                              k_scale, v_scale);                                                         \
  }

#define PAGODA_CACHE(SUFFIX, T)                                                                       \
  PAGODA_RESHAPE_AND_CACHE(pagoda_reshape_and_cache_##SUFFIX, T, T)                                  \
  PAGODA_RESHAPE_AND_CACHE(pagoda_reshape_and_cache_##SUFFIX##_e4m3, T, pagoda::fp8_e4m3)            \
  PAGODA_RESHAPE_AND_CACHE(pagoda_reshape_and_cache_##SUFFIX##_e5m2, T, pagoda::fp8_e5m2)            \
  extern "C" void pagoda_rotary_##SUFFIX(void* x, const int64_t* positions, const float* cos,        \
                                         const float* sin, int64_t num_tokens, int num_heads,        \
                                         int head_dim, int64_t token_stride, int64_t head_stride) {  \
    pagoda::rotary_inplace(static_cast<T*>(x), positions, cos, sin, num_tokens, num_heads, head_dim, \
                           token_stride, head_stride);                                               \
  }                                                                                                   \
  extern "C" void pagoda_hadamard_##SUFFIX(void* x, int64_t num_tokens, int num_heads, int head_dim,  \
                                           int64_t token_stride, int64_t head_stride) {               \
    pagoda::hadamard_inplace(static_cast<T*>(x), num_tokens, num_heads, head_dim, token_stride,      \
                             head_stride);                                                            \
  }

PAGODA_CACHE(f32, float)
PAGODA_CACHE(bf16, pagoda::bf16)
PAGODA_CACHE(f16, pagoda::f16)
