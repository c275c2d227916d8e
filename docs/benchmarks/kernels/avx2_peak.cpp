// AVX2 (Zen 1-3, Haswell and later): the fp32 FMA peak (12 independent 256-bit chains a thread,
// one and two threads), and the bf16 GEMM's 6-row x 16-column widened-chunk tile (gemm.cpp's
// avx2_wide_tile) on a 128-k chunk in L1, first with its 6 rows of x in L1, then over 516 rows
// of x K apart (every tile of a pass over one panel, as the GEMM reads x): what the tile waits on.
// Usage: g++ -O3 -march=x86-64-v3 -ffp-contract=off -pthread docs/benchmarks/kernels/avx2_peak.cpp -o /tmp/avx2_peak && /tmp/avx2_peak
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

constexpr int kSumsRow = 64, kPanel = 32;

double fma_chains(long iters) {
  __m256 acc[12];
  for (auto& a : acc) a = _mm256_set1_ps(0.f);
  __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    asm volatile("" : "+x"(a), "+x"(b));
  }
  float s = 0;
  for (auto& v : acc) s += _mm256_cvtss_f32(v);
  return s;
}

template <int R>
__attribute__((noinline)) void tile(const float* xf, int64_t xs, const float* wf, int64_t ks, float* sums) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_loadu_ps(sums + r * kSumsRow + 8 * h);
  for (int64_t k = 0; k < ks; ++k, wf += kPanel) {
    const __m256 b0 = _mm256_load_ps(wf), b1 = _mm256_load_ps(wf + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(xf + r * xs + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(sums + r * kSumsRow + 8 * h, acc[r][h]);
}

template <class F>
double seconds(F f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  const long iters = 200000000;
  for (int threads : {1, 2}) {
    const double s = seconds([&] {
      std::vector<std::thread> pool;
      for (int i = 0; i < threads; ++i) pool.emplace_back([&] { volatile double v = fma_chains(iters); (void)v; });
      for (auto& t : pool) t.join();
    });
    std::printf("fp32 FMA peak, %d thread%s: %.1f GFLOP/s\n", threads, threads > 1 ? "s" : "", threads * iters * 12.0 * 16 / s / 1e9);
  }
  alignas(64) static float wf[128 * kPanel];
  for (int i = 0; i < 128 * kPanel; ++i) wf[i] = 0.001f * (i % 7);
  std::vector<float> sums(516 * kSumsRow);
  std::vector<float> x_l1(6 * 128, 0.01f);
  const long reps = 200000;
  double s = seconds([&] {
    for (long i = 0; i < reps; ++i)
      for (int b = 0; b < 2; ++b) tile<6>(x_l1.data(), 128, wf + 16 * b, 128, sums.data() + 16 * b);
  });
  std::printf("6-row tile, x in L1: %.1f GFLOP/s one thread\n", reps * 2.0 * 128 * 6 * 16 * 2 / s / 1e9);
  for (int K : {576, 1536}) {
    const int M = 516;
    std::vector<float> x(size_t(M) * K, 0.01f);
    const long passes = 300;
    s = seconds([&] {
      for (long i = 0; i < passes; ++i)
        for (int c = 0; c < K; c += 128)
          for (int m = 0; m < M; m += 6)
            for (int b = 0; b < 2; ++b) tile<6>(x.data() + size_t(m) * K + c, K, wf + 16 * b, 128, sums.data() + m * kSumsRow + 16 * b);
    });
    std::printf("6-row tile, %d rows of x %d apart: %.1f GFLOP/s one thread\n", M, K, passes * double(M) * K * 32 * 2 / s / 1e9);
  }
}
