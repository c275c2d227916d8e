// Sixteen-float vectors for pagoda's CPU kernels, with an AVX-512, an AVX2 and a portable body.
//
// Kernels are written once against `Vf` (16 x fp32) and the load/store helpers below, which
// convert from and to the storage dtypes (fp32, bf16, fp16) on the fly. The AVX-512 body is
// compiled when the build enables AVX-512 F/BW/VL, the AVX2 body (two 8-float halves) with
// AVX2, FMA and F16C; the portable body is plain loops that any
// x86-64 (or other) compiler vectorizes as far as its target allows.
// Invariants: every rounding to bf16 is round-to-nearest-even with NaN kept NaN (as torch);
// no helper fuses a multiply and an add unless its name says fma (the build passes
// -ffp-contract=off so that elementwise kernels round where torch rounds).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGODA_AVX2 1
#include <immintrin.h>
#endif

namespace pagoda {

struct bf16 {
  uint16_t bits;
};
using f16 = _Float16;
// One-byte KV cache elements (torch's float8_e4m3fn and float8_e5m2), read and written with a
// scale by the kernels that take them; `to_float` gives the stored value itself.
struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(f16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// NOTE: both fp8 formats widen exactly through f16: e5m2 is the top byte of an f16, and the
// e4m3 bits shifted into an f16's exponent and mantissa give the value times 2^-8 (subnormals
// included), which one multiply undoes. e4m3fn's NaN (0x7F) reads as 480; writes never make it.
inline uint16_t e4m3_to_f16_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x7Fu) << 7) | ((b & 0x80u) << 8));
}
inline float f16_from_bits(uint16_t bits) {
  f16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}
inline float to_float(fp8_e5m2 x) { return f16_from_bits(static_cast<uint16_t>(x.bits << 8)); }
inline float to_float(fp8_e4m3 x) { return f16_from_bits(e4m3_to_f16_bits(x.bits)) * 256.f; }

inline void store_one(float f, float* out) { *out = f; }
inline void store_one(float f, f16* out) { *out = static_cast<f16>(f); }
// fp32 bits rounded to bf16's (the upper half), to nearest even; a NaN stays a NaN (quieted).
// Branch-free, so that loops of it vectorize.
inline uint32_t round_bf16_bits(uint32_t u) {
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? (u | 0x00400000u) & 0xFFFF0000u : rounded;
}
inline void store_one(float f, bf16* out) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  out->bits = static_cast<uint16_t>(round_bf16_bits(u) >> 16);
}

// *out = bf16(*out + bf16(delta)): torch's `y += delta.to(bf16)` on bf16 y (branch-free, so
// loops of it vectorize): a LoRA update (decoder.cpp), an expert's weighted output (moe.cpp).
inline void add_rounded(float delta, bf16* out) {
  bf16 d;
  store_one(delta, &d);
  store_one(to_float(*out) + to_float(d), out);
}

// f as fp8 with kMant mantissa bits and exponent bias kBias: round to nearest even,
// saturating at the largest finite value (`max_bits` as fp32 bits, `max_code` its fp8 code:
// 448 for e4m3fn, 57344 for e5m2), NaN kept NaN: a cache write never makes an infinity.
template <int kMant, int kBias>
inline uint8_t fp8_bits(float f, uint32_t max_bits, uint8_t max_code) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return sign | 0x7F;
  if (u >= max_bits) return sign | max_code;
  if (u < (uint32_t(128 - kBias) << 23)) {  // below the smallest normal: subnormal steps
    float a;
    std::memcpy(&a, &u, sizeof(a));
    return sign | static_cast<uint8_t>(std::nearbyint(a * std::ldexp(1.f, kBias - 1 + kMant)));
  }
  constexpr int kShift = 23 - kMant;
  u += ((1u << (kShift - 1)) - 1u) + ((u >> kShift) & 1u);
  return sign | static_cast<uint8_t>(((u - (uint32_t(127 - kBias) << 23)) >> kShift) & 0x7Fu);
}
inline void store_one(float f, fp8_e4m3* out) { out->bits = fp8_bits<3, 7>(f, 0x43E00000u, 0x7E); }
inline void store_one(float f, fp8_e5m2* out) { out->bits = fp8_bits<2, 15>(f, 0x47600000u, 0x7B); }

// The value `f` takes once stored as T (a no-op for float).
template <typename T>
inline float round_as(float f) {
  T t;
  store_one(f, &t);
  return to_float(t);
}

constexpr int kLanes = 16;

#ifdef PAGODA_AVX512

struct Vf {
  __m512 v;
};
using Mask = __mmask16;

inline Mask tail_mask(int n) { return n >= kLanes ? Mask(0xFFFF) : Mask((1u << n) - 1u); }
// The first n (32 at most) of 32 16-bit lanes: a bf16 row's tail.
inline __mmask32 tail_mask32(int64_t n) { return n >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << n) - 1u); }
inline Vf vzero() { return {_mm512_setzero_ps()}; }
inline Vf vset1(float x) { return {_mm512_set1_ps(x)}; }
inline Vf operator+(Vf a, Vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vf operator-(Vf a, Vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vf operator*(Vf a, Vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vf vdiv(Vf a, Vf b) { return {_mm512_div_ps(a.v, b.v)}; }
// a / b for a finite non-zero b, within an ulp or so of the quotient: a 14-bit reciprocal and one
// Newton step on the quotient (4 cheap instructions where vdivps takes 16 cycles a vector on
// Intel cores: the SiLU's bottleneck).
inline Vf vdiv_near(Vf a, Vf b) {
  const __m512 r = _mm512_rcp14_ps(b.v), q = _mm512_mul_ps(a.v, r);
  return {_mm512_fmadd_ps(_mm512_fnmadd_ps(b.v, q, a.v), r, q)};
}
inline Vf vfma(Vf a, Vf b, Vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vf vmax(Vf a, Vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float reduce_add(Vf a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vf a) { return _mm512_reduce_max_ps(a.v); }
// Lanes not in `keep` become `fill`.
inline Vf select(Mask keep, Vf a, float fill) { return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), keep, a.v)}; }
// The lanes where a == b (ordered), and where a is NaN.
inline Mask equal(Vf a, Vf b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
inline Mask greater(Vf a, Vf b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
inline Mask is_nan(Vf a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }

inline Vf load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vf load(const float* p, Mask m) { return {_mm512_maskz_loadu_ps(m, p)}; }
inline Vf widen_bf16(__m256i raw) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline Vf load(const bf16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vf load(const bf16* p, Mask m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
inline Vf load(const f16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline Vf load(const f16* p, Mask m) { return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p))}; }

inline Vf load(const fp8_e5m2* p, Mask m = 0xFFFF) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  return {_mm512_cvtph_ps(_mm256_slli_epi16(w, 8))};
}
inline Vf load(const fp8_e4m3* p, Mask m = 0xFFFF) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  return {_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f))};
}

// fp32 -> bf16 rounded to nearest even, NaNs kept NaN (quieted). With AVX512_BF16 one
// vcvtneps2bf16 (which also flushes fp32 denormals, below 1.2e-38, to zero); else integer steps.
inline __m256i narrow_bf16(Vf a) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(a.v);
#else
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
#endif
}
inline void store(float* p, Vf a) { _mm512_storeu_ps(p, a.v); }
inline void store(float* p, Vf a, Mask m) { _mm512_mask_storeu_ps(p, m, a.v); }
inline void store(bf16* p, Vf a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(a)); }
inline void store(bf16* p, Vf a, Mask m) { _mm256_mask_storeu_epi16(p, m, narrow_bf16(a)); }
inline void store(f16* p, Vf a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store(f16* p, Vf a, Mask m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
}

// exp(x) to ~2 ulp (Cephes' expf polynomial); exp(-inf) = 0, large inputs saturate to inf.
inline Vf vexp(Vf x) {
  __m512 a = _mm512_min_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.72f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), a);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return {_mm512_scalef_ps(p, n)};
}

#elif defined(PAGODA_AVX2)  // two 8-float AVX2 halves: Zen 2/3, Haswell to Alder Lake clients

struct Vf {
  __m256 lo, hi;
};
using Mask = uint32_t;

inline Mask tail_mask(int n) { return n >= kLanes ? Mask(0xFFFF) : Mask((1u << n) - 1u); }
inline Vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vf operator+(Vf a, Vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vf operator-(Vf a, Vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vf operator*(Vf a, Vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vf vdiv(Vf a, Vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vf vdiv_near(Vf a, Vf b) { return vdiv(a, b); }
inline Vf vfma(Vf a, Vf b, Vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vf vmax(Vf a, Vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float reduce8(__m256 v, __m128 (*op)(__m128, __m128)) {
  __m128 r = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = op(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(op(r, _mm_shuffle_ps(r, r, 1)));
}
inline float reduce_add(Vf a) {
  return reduce8(_mm256_add_ps(a.lo, a.hi), [](__m128 x, __m128 y) { return _mm_add_ps(x, y); });
}
inline float reduce_max(Vf a) {
  return reduce8(_mm256_max_ps(a.lo, a.hi), [](__m128 x, __m128 y) { return _mm_max_ps(x, y); });
}
// Lane i of the result is all ones where bit i of `m` is set (the low 8 lanes for shift 0).
inline __m256 lane_mask(Mask m, int shift) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i sel = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m >> shift)), bits);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(sel, bits));
}
inline Vf select(Mask keep, Vf a, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, lane_mask(keep, 0)), _mm256_blendv_ps(f, a.hi, lane_mask(keep, 8))};
}
inline Mask lanes_of(__m256 lo, __m256 hi) {
  return static_cast<Mask>(_mm256_movemask_ps(lo)) | static_cast<Mask>(_mm256_movemask_ps(hi)) << 8;
}
inline Mask equal(Vf a, Vf b) {
  return lanes_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ));
}
inline Mask is_nan(Vf a) { return lanes_of(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)); }
inline Mask greater(Vf a, Vf b) {
  return lanes_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ));
}

inline Vf widen_bf16(__m128i lo, __m128i hi) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
}
inline __m128i load128(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline Vf load_full(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Vf load_full(const bf16* p) { return widen_bf16(load128(p), load128(p + 8)); }
inline Vf load_full(const f16* p) { return {_mm256_cvtph_ps(load128(p)), _mm256_cvtph_ps(load128(p + 8))}; }
inline Vf f16_halves(__m128i bytes, bool e4m3) {
  __m256i w = _mm256_cvtepu8_epi16(bytes);
  if (e4m3) {
    w = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  } else {
    w = _mm256_slli_epi16(w, 8);
  }
  Vf r{_mm256_cvtph_ps(_mm256_castsi256_si128(w)), _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1))};
  return e4m3 ? r * vset1(256.f) : r;
}
inline Vf load_full(const fp8_e5m2* p) { return f16_halves(load128(p), false); }
inline Vf load_full(const fp8_e4m3* p) { return f16_halves(load128(p), true); }
// NOTE: a partial vector goes through a zeroed buffer: tails are rare (one per row at most),
// and no lane past the mask is ever read.
template <typename T>
inline Vf load(const T* p, Mask m = 0xFFFF) {
  if (m == 0xFFFF) return load_full(p);
  T tmp[kLanes];
  std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
  for (int i = 0; i < kLanes; ++i)
    if ((m >> i) & 1u) tmp[i] = p[i];
  return load_full(tmp);
}

inline __m256i narrow_bf16_half(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, quiet, nan);
}
inline __m256i narrow_bf16(Vf a) {
  const __m256i packed = _mm256_packus_epi32(narrow_bf16_half(a.lo), narrow_bf16_half(a.hi));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}
inline void store_full(float* p, Vf a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void store_full(bf16* p, Vf a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(a)); }
inline void store_full(f16* p, Vf a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT));
}
template <typename T>
inline void store(T* p, Vf a, Mask m = 0xFFFF) {
  if (m == 0xFFFF) return store_full(p, a);
  T tmp[kLanes];
  store_full(tmp, a);
  for (int i = 0; i < kLanes; ++i)
    if ((m >> i) & 1u) p[i] = tmp[i];
}

// exp(x) to ~2 ulp (the same Cephes polynomial as the AVX-512 body); 2^n applied in two halves
// so that results down to the subnormals come out right.
inline __m256 vexp_half(__m256 x) {
  const __m256 a = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(88.72f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), a);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
inline Vf vexp(Vf x) { return {vexp_half(x.lo), vexp_half(x.hi)}; }

#else  // portable body

struct Vf {
  float v[kLanes];
};
using Mask = uint32_t;

inline Mask tail_mask(int n) { return n >= kLanes ? Mask(0xFFFF) : Mask((1u << n) - 1u); }
template <typename F>
inline Vf vmap(F f) {
  Vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = f(i);
  return r;
}
inline Vf vset1(float x) { return vmap([&](int) { return x; }); }
inline Vf vzero() { return vset1(0.f); }
inline Vf operator+(Vf a, Vf b) { return vmap([&](int i) { return a.v[i] + b.v[i]; }); }
inline Vf operator-(Vf a, Vf b) { return vmap([&](int i) { return a.v[i] - b.v[i]; }); }
inline Vf operator*(Vf a, Vf b) { return vmap([&](int i) { return a.v[i] * b.v[i]; }); }
inline Vf vdiv(Vf a, Vf b) { return vmap([&](int i) { return a.v[i] / b.v[i]; }); }
inline Vf vdiv_near(Vf a, Vf b) { return vdiv(a, b); }
inline Vf vfma(Vf a, Vf b, Vf c) { return vmap([&](int i) { return std::fma(a.v[i], b.v[i], c.v[i]); }); }
inline Vf vmax(Vf a, Vf b) { return vmap([&](int i) { return std::max(a.v[i], b.v[i]); }); }
inline float reduce_add(Vf a) {
  float s = 0.f;
  for (float x : a.v) s += x;
  return s;
}
inline float reduce_max(Vf a) { return *std::max_element(a.v, a.v + kLanes); }
inline Vf select(Mask keep, Vf a, float fill) { return vmap([&](int i) { return (keep >> i) & 1u ? a.v[i] : fill; }); }
inline Mask lanes_where(Vf a, Vf b, bool (*pred)(float, float)) {
  Mask m = 0;
  for (int i = 0; i < kLanes; ++i) m |= static_cast<Mask>(pred(a.v[i], b.v[i])) << i;
  return m;
}
inline Mask equal(Vf a, Vf b) { return lanes_where(a, b, [](float x, float y) { return x == y; }); }
inline Mask is_nan(Vf a) { return lanes_where(a, a, [](float x, float) { return std::isnan(x); }); }
inline Mask greater(Vf a, Vf b) { return lanes_where(a, b, [](float x, float y) { return x > y; }); }
template <typename T>
inline Vf load(const T* p, Mask m = 0xFFFF) {
  return vmap([&](int i) { return (m >> i) & 1u ? to_float(p[i]) : 0.f; });
}
template <typename T>
inline void store(T* p, Vf a, Mask m = 0xFFFF) {
  for (int i = 0; i < kLanes; ++i)
    if ((m >> i) & 1u) store_one(a.v[i], p + i);
}
inline Vf vexp(Vf x) { return vmap([&](int i) { return std::exp(x.v[i]); }); }

#endif

// `a` rounded to T and back (identity for float): where torch stores an intermediate as T.
template <typename T>
inline Vf round_as(Vf a) {
  if constexpr (std::is_same_v<T, float>) {
    return a;
  } else {
    alignas(64) T tmp[kLanes];
    store(tmp, a);
    return load(tmp);
  }
}

// The gated MLPs' first factor as their kernels store it (rounded to T): SiLU, g / (1 + e^-g),
// and GELU's tanh form, g / (1 + e^(-2 sqrt(2 / pi) (g + 0.044715 g^3))) (= g (1 + tanh(...)) / 2).
// One definition for the elementwise kernels and the GEMM's fused epilogue (gemm.cpp), so that
// both round alike.
template <typename T>
inline Vf silu_as(Vf g) {
  return round_as<T>(vdiv_near(g, vset1(1.f) + vexp(vzero() - g)));
}
template <typename T>
inline Vf gelu_tanh_as(Vf g) {
  const Vf c = vset1(-2.f * 0.7978845608028654f), k = vset1(0.044715f);
  return round_as<T>(vdiv_near(g, vset1(1.f) + vexp(c * (g + k * (g * (g * g))))));
}

// A compiler barrier for the AMX intrinsics: GCC's tileloadd (and ldtilecfg's argument) is an
// asm statement that declares no memory read, so stores just made to what a tile loads (a
// buffer filled a line before) may be sunk past the load or dropped as dead. Call it between
// writing a tile's source memory and loading it.
inline void tile_sources_written() { asm volatile("" : : : "memory"); }

#if defined(PAGODA_AVX512)
// AMX's tile configuration (palette 1), as ldtilecfg reads it: rows and bytes a row per tile;
// a tile left at 0 / 0 is unconfigured. For the AMX functions of gemm.cpp and attention.cpp,
// which each load their own at every call (other code, oneDNN's included, shares the threads).
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int tile_rows, int bytes) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
};

__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& c) {
  tile_sources_written();  // NOTE: without it GCC 12 at -O3 dropped the stores that filled `c`
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }
#endif

}  // namespace pagoda
