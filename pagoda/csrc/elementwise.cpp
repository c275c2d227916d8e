// Row-wise kernels between the matrix products: RMSNorm (plain and fused with the residual
// add) and SiLU-and-multiply, rounding where Hugging Face's modules round.
//
// RMSNorm: h = float(x); h *= 1 / sqrt(mean(h^2) + eps); out = weight * T(h) (a T product).
// Fused: residual = T(x + residual) first, then x = RMSNorm(residual): vLLM's
// fused_add_rms_norm, equal to Hugging Face's `h = residual + h; norm(h)` (the sum commutes).
// Gemma's RMSNorm: h as above, out = T(h * scale) with scale = 1 + weight in fp32 (one rounding,
// as Hugging Face's Gemma3RMSNorm); fused with the residual add as the plain one.
// SiLU-and-mul: out = T(T(silu(gate)) * up) over x = [gate | up].
// GELU(tanh)-and-mul (Gemma's GeGLU): out = T(T(gelu(gate)) * up), with
// gelu(g) = 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3): torch's
// approximate='tanh' function, without the cancellation of 1 + tanh(u) that makes torch's values
// for g below about -4 (under 1e-4 in size) inexact; elsewhere the two agree to the rounding.
// Rows are contiguous, `stride` elements apart; every row is handled by one thread.
#include "parallel.h"
#include "vec.h"

namespace pagoda {
namespace {

constexpr int64_t kParallelRows = 8;

template <typename F>
void over_rows(int64_t rows, F&& fn) {
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  };
  if (rows < kParallelRows) {
    body(0, rows);
  } else {
    parallel_ranges(rows, 1, body);
  }
}

template <typename T>
float inv_rms(const T* x, int n, float eps) {
  Vf acc = vzero();
  for (int i = 0; i < n; i += kLanes) {
    const Vf h = load(x + i, tail_mask(n - i));
    acc = vfma(h, h, acc);
  }
  return 1.f / std::sqrt(reduce_add(acc) / static_cast<float>(n) + eps);
}

template <typename T>
void normalize_row(const T* x, const T* weight, T* out, int n, float eps) {
  const Vf inv = vset1(inv_rms(x, n, eps));
  for (int i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(n - i);
    store(out + i, load(weight + i, m) * round_as<T>(load(x + i, m) * inv), m);
  }
}

template <typename T>
void gemma_normalize_row(const T* x, const float* scale, T* out, int n, float eps) {
  const Vf inv = vset1(inv_rms(x, n, eps));
  for (int i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(n - i);
    store(out + i, (load(x + i, m) * inv) * load(scale + i, m), m);
  }
}

template <typename T>
void add_rows(T* residual, const T* x, int n) {
  for (int i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(n - i);
    store(residual + i, load(x + i, m) + load(residual + i, m), m);
  }
}

template <typename T>
void silu_mul_row(const T* x, T* out, int n) {
  for (int i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(n - i);
    store(out + i, silu_as<T>(load(x + i, m)) * load(x + n + i, m), m);
  }
}

template <typename T>
void gelu_tanh_mul_row(const T* x, T* out, int n) {
  for (int i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(n - i);
    store(out + i, gelu_tanh_as<T>(load(x + i, m)) * load(x + n + i, m), m);
  }
}

}  // namespace
}  // namespace pagoda

namespace pagoda {
namespace {

// A norm over `rows` strided rows (`row`: the plain or Gemma form, W its weight's type).
template <typename T, typename W, typename Row>
void norm_rows(const void* x, const void* weight, void* out, int64_t rows, int n, int64_t x_stride,
               int64_t out_stride, float eps, Row row) {
  over_rows(rows, [&](int64_t r) {
    row(static_cast<const T*>(x) + r * x_stride, static_cast<const W*>(weight), static_cast<T*>(out) + r * out_stride,
        n, eps);
  });
}

// residual = x + residual, then x = norm(residual), over contiguous rows.
template <typename T, typename W, typename Row>
void fused_add_norm_rows(void* x, void* residual, const void* weight, int64_t rows, int n, float eps, Row row) {
  over_rows(rows, [&](int64_t r) {
    T* xr = static_cast<T*>(x) + r * n;
    T* res = static_cast<T*>(residual) + r * n;
    add_rows(res, xr, n);
    row(res, static_cast<const W*>(weight), xr, n, eps);
  });
}

}  // namespace
}  // namespace pagoda

#define PAGODA_ELEMENTWISE(SUFFIX, T)                                                                   \
  extern "C" void pagoda_rms_norm_##SUFFIX(const void* x, const void* weight, void* out, int64_t rows,     \
                                           int n, int64_t x_stride, int64_t out_stride, float eps) {     \
    pagoda::norm_rows<T, T>(x, weight, out, rows, n, x_stride, out_stride, eps, pagoda::normalize_row<T>); \
  }                                                                                                     \
  extern "C" void pagoda_fused_add_rms_norm_##SUFFIX(void* x, void* residual, const void* weight,        \
                                                     int64_t rows, int n, float eps) {                  \
    pagoda::fused_add_norm_rows<T, T>(x, residual, weight, rows, n, eps, pagoda::normalize_row<T>);       \
  }                                                                                                     \
  extern "C" void pagoda_gemma_rms_norm_##SUFFIX(const void* x, const void* scale, void* out, int64_t rows, \
                                                 int n, int64_t x_stride, int64_t out_stride, float eps) { \
    pagoda::norm_rows<T, float>(x, scale, out, rows, n, x_stride, out_stride, eps,                       \
                                pagoda::gemma_normalize_row<T>);                                        \
  }                                                                                                     \
  extern "C" void pagoda_fused_add_gemma_rms_norm_##SUFFIX(void* x, void* residual, const void* scale,   \
                                                           int64_t rows, int n, float eps) {            \
    pagoda::fused_add_norm_rows<T, float>(x, residual, scale, rows, n, eps, pagoda::gemma_normalize_row<T>); \
  }                                                                                                     \
  extern "C" void pagoda_silu_and_mul_##SUFFIX(const void* x, void* out, int64_t rows, int n) {         \
    pagoda::over_rows(rows, [&](int64_t r) {                                                            \
      pagoda::silu_mul_row(static_cast<const T*>(x) + r * 2 * n, static_cast<T*>(out) + r * n, n);      \
    });                                                                                                 \
  }                                                                                                     \
  extern "C" void pagoda_gelu_tanh_and_mul_##SUFFIX(const void* x, void* out, int64_t rows, int n) {    \
    pagoda::over_rows(rows, [&](int64_t r) {                                                            \
      pagoda::gelu_tanh_mul_row(static_cast<const T*>(x) + r * 2 * n, static_cast<T*>(out) + r * n, n); \
    });                                                                                                 \
  }

PAGODA_ELEMENTWISE(f32, float)
PAGODA_ELEMENTWISE(bf16, pagoda::bf16)
PAGODA_ELEMENTWISE(f16, pagoda::f16)
