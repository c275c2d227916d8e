// Peak issue rate of vdpbf16ps and vpdpbusd (AVX512_VNNI) against fp32 FMAs (512-bit, 24 independent accumulators, in
// registers), one and two threads: what bounds the GEMM's tiles once arithmetic binds.
// Usage: g++ -O2 -march=x86-64-v4 -mavx512bf16 -mavx512vnni -pthread docs/benchmarks/kernels/instruction_peak.cpp -o /tmp/peak && /tmp/peak
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
template <int A>
double run_bf16(long iters) {
  __m512 acc[A];
  for (int i = 0; i < A; ++i) acc[i] = _mm512_set1_ps(0.f);
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f00);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 32
    for (int i = 0; i < A; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    asm volatile("" : "+v"(a), "+v"(b));
  }
  float s = 0; for (int i = 0; i < A; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}
template <int A>
double run_vnni(long iters) {
  __m512i acc[A];
  for (int i = 0; i < A; ++i) acc[i] = _mm512_setzero_si512();
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(2);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 32
    for (int i = 0; i < A; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    asm volatile("" : "+v"(a), "+v"(b));
  }
  long s = 0; for (int i = 0; i < A; ++i) s += _mm512_reduce_add_epi32(acc[i]);
  return double(s);
}
template <int A>
double run_fma(long iters) {
  __m512 acc[A];
  for (int i = 0; i < A; ++i) acc[i] = _mm512_set1_ps(0.f);
  __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.5f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 32
    for (int i = 0; i < A; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    asm volatile("" : "+v"(a), "+v"(b));
  }
  float s = 0; for (int i = 0; i < A; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}
int main() {
  const long iters = 20000000;
  for (int threads : {1, 2}) {
    for (int kind = 0; kind < 3; ++kind) {
      auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&] { volatile double r = kind == 2 ? run_vnni<24>(iters) : kind ? run_fma<24>(iters) : run_bf16<24>(iters); (void)r; });
      for (auto& t : ts) t.join();
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double ops = double(threads) * iters * 24 * (kind == 2 ? 128 : kind ? 32 : 64);  // 2 x multiply-adds
      std::printf("%-16s threads=%d: %6.1f G%s/s (%.2f instructions/ns a thread)\n",
                  kind == 2 ? "int8 vpdpbusd" : kind ? "fp32 vfmadd" : "bf16 vdpbf16ps", threads, ops / s / 1e9,
                  kind == 2 ? "OP" : "FLOP", iters * 24 / s / 1e9);
    }
  }
}
