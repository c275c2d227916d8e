// y[M, N] = x[M, K] . W[N, K]^T (+ bias) for small M, bf16 in and out, fp32 accumulation.
//
// Decoding a few sequences is a matrix-vector product that streams every weight once per
// step, so the kernel is built around the weight stream: each thread owns a contiguous range of
// output rows (W stays in its checkpoint layout, row-major), reads them one after another, and
// applies each 32-element weight load to all M input rows (M <= 8 per pass) with vdpbf16ps,
// which multiplies bf16 pairs exactly and sums in fp32. Without AVX512_BF16 the same loop
// widens to fp32 and uses FMAs. Each output is the fp32 sum rounded once to bf16.
#include "parallel.h"
#include "vec.h"

namespace pagoda {
namespace {

constexpr int kMaxRows = 8;       // input rows per pass
constexpr int64_t kRowGrain = 16;  // output rows per thread range, a multiple of this

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)

constexpr int kStep = 32;
inline __m512bh load_pairs(const bf16* p, int64_t left) {
  return (__m512bh)_mm512_maskz_loadu_epi16(tail_mask32(left), p);
}

template <int M, int R>
void gemv_block(const bf16* x, int64_t x_stride, const bf16* w, int64_t K, float out[M][R]) {
  __m512 acc[M * R];
#pragma GCC unroll 32
  for (int i = 0; i < M * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) {
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = load_pairs(w + r * K + k, K - k);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_pairs(x + m * x_stride + k, K - k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], wv[r], xv);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < M * R; ++i) out[i / R][i % R] = _mm512_reduce_add_ps(acc[i]);
}

#else

template <int M, int R>
void gemv_block(const bf16* x, int64_t x_stride, const bf16* w, int64_t K, float out[M][R]) {
  Vf acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vzero();
  for (int64_t k = 0; k < K; k += kLanes) {
    const Mask mask = tail_mask(static_cast<int>(std::min<int64_t>(K - k, kLanes)));
    Vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(w + r * K + k, mask);
    for (int m = 0; m < M; ++m) {
      const Vf xv = load(x + m * x_stride + k, mask);
      for (int r = 0; r < R; ++r) acc[m][r] = vfma(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = reduce_add(acc[m][r]);
}

#endif

// Output rows [n0, n1) for M input rows; R weight rows at a time, then one at a time.
template <int M, int R>
void gemv_range(const bf16* x, int64_t x_stride, const bf16* w, const bf16* bias, bf16* y, int64_t y_stride,
                int64_t K, int64_t n0, int64_t n1) {
  auto emit = [&](int64_t n, const float* col, int count, int stride) {
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < count; ++r) {
        const float b = bias ? to_float(bias[n + r]) : 0.f;
        store_one(col[m * stride + r] + b, y + m * y_stride + n + r);
      }
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    float out[M][R];
    gemv_block<M, R>(x, x_stride, w + n * K, K, out);
    emit(n, &out[0][0], R, R);
  }
  for (; n < n1; ++n) {
    float out[M][1];
    gemv_block<M, 1>(x, x_stride, w + n * K, K, out);
    emit(n, &out[0][0], 1, 1);
  }
}

template <int M>
void gemv_pass(const bf16* x, int64_t x_stride, const bf16* w, const bf16* bias, bf16* y, int64_t y_stride,
               int64_t N, int64_t K) {
  // NOTE: one weight row at a time, so each thread reads one strictly sequential stream: with
  // 4 rows interleaved the hardware prefetcher lost track and one thread streamed 11 GB/s
  // instead of 19-21 (30 layers' distinct weights, docs/performance.md, Kernels).
  constexpr int R = 1;
  // NOTE: half the threads: one core streamed 19-22 GB/s here, all the DRAM gives (two
  // threads read no faster), and a second thread only lost time when the other core was busy.
  parallel_ranges(N, kRowGrain, [&](int64_t n0, int64_t n1) {
    gemv_range<M, R>(x, x_stride, w, bias, y, y_stride, K, n0, n1);
  }, std::max(1, num_threads() / 2));
}

void gemv(const bf16* x, int64_t x_stride, const bf16* w, const bf16* bias, bf16* y, int64_t y_stride,
          int64_t M, int64_t N, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const bf16* xm = x + m0 * x_stride;
    bf16* ym = y + m0 * y_stride;
    switch (std::min<int64_t>(M - m0, kMaxRows)) {
      case 1: gemv_pass<1>(xm, x_stride, w, bias, ym, y_stride, N, K); break;
      case 2: gemv_pass<2>(xm, x_stride, w, bias, ym, y_stride, N, K); break;
      case 3: gemv_pass<3>(xm, x_stride, w, bias, ym, y_stride, N, K); break;
      case 4: gemv_pass<4>(xm, x_stride, w, bias, ym, y_stride, N, K); break;
      case 5: gemv_pass<5>(xm, x_stride, w, bias, ym, y_stride, N, K); break;
      case 6: gemv_pass<6>(xm, x_stride, w, bias, ym, y_stride, N, K); break;
      case 7: gemv_pass<7>(xm, x_stride, w, bias, ym, y_stride, N, K); break;
      default: gemv_pass<8>(xm, x_stride, w, bias, ym, y_stride, N, K); break;
    }
  }
}

}  // namespace
}  // namespace pagoda

extern "C" void pagoda_gemv_bf16(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
                                 int64_t y_stride, int64_t M, int64_t N, int64_t K) {
  pagoda::gemv(static_cast<const pagoda::bf16*>(x), x_stride, static_cast<const pagoda::bf16*>(w),
               static_cast<const pagoda::bf16*>(bias), static_cast<pagoda::bf16*>(y), y_stride, M, N, K);
}
