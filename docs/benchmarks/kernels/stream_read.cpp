// How fast two threads read a 2 GiB buffer on this machine, by access pattern: the ceiling a
// one-stream decode (weights read once a token) can reach. Prints GB/s (median and best of 7).
// Modes: 0 each thread one contiguous half; 1 the same with a software prefetch D bytes ahead;
// 2 each half as S interleaved sub-streams; 3 chunks of D bytes alternating between the threads;
// 4 as 0 with 256-bit loads widened by vcvtph2ps (llama.cpp's F16 rows). NOHUGE=1: no huge pages.
// Build and run (any AVX-512 CPU):
//   g++ -O2 -march=x86-64-v4 -fopenmp docs/benchmarks/kernels/stream_read.cpp -o /tmp/stream_read
//   for a in "0 0" "1 1024" "1 4096" "2 0 2" "2 0 4" "3 65536" "4 0"; do /tmp/stream_read $a; done
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <sys/mman.h>
#include <vector>
#include <algorithm>

int main(int argc, char** argv) {
  size_t n = size_t(2) << 30;
  char* buf = (char*)mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(buf, n, getenv("NOHUGE") ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
  // NOTE: distinct contents, so that no page of the buffer can be merged with another
  for (size_t i = 0; i < n / 8; ++i) reinterpret_cast<uint64_t*>(buf)[i] = i * 0x9E3779B97F4A7C15ull;
  int mode = atoi(argv[1]); long D = atol(argv[2]); int S = argc > 3 ? atoi(argv[3]) : 1;
  std::vector<double> ts;
  for (int rep = 0; rep < 7; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    float tot = 0;
#pragma omp parallel num_threads(2) reduction(+:tot)
    {
      int t = omp_get_thread_num();
      const char* b = buf + t * (n / 2);
      size_t len = n / 2;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      if (mode == 4) {  // F16 rows as llama.cpp reads them: 256-bit loads widened by vcvtph2ps
        for (size_t i = 0; i < len; i += 128) {
          a0 = _mm512_add_ps(a0, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(b + i))));
          a1 = _mm512_add_ps(a1, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(b + i + 32))));
          a2 = _mm512_add_ps(a2, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(b + i + 64))));
          a3 = _mm512_add_ps(a3, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(b + i + 96))));
        }
      } else if (mode == 3) {  // chunks of D bytes, alternating between the threads
        for (size_t c = t * D; c < n; c += 2 * D)
          for (size_t i = c; i < c + D; i += 256) {
            a0 = _mm512_add_ps(a0, _mm512_load_ps((const float*)(buf + i)));
            a1 = _mm512_add_ps(a1, _mm512_load_ps((const float*)(buf + i + 64)));
            a2 = _mm512_add_ps(a2, _mm512_load_ps((const float*)(buf + i + 128)));
            a3 = _mm512_add_ps(a3, _mm512_load_ps((const float*)(buf + i + 192)));
          }
      } else if (mode <= 1) {
        for (size_t i = 0; i < len; i += 256) {
          if (mode == 1) _mm_prefetch(b + i + D, _MM_HINT_T0);
          if (mode == 1) _mm_prefetch(b + i + D + 128, _MM_HINT_T0);
          a0 = _mm512_add_ps(a0, _mm512_load_ps((const float*)(b + i)));
          a1 = _mm512_add_ps(a1, _mm512_load_ps((const float*)(b + i + 64)));
          a2 = _mm512_add_ps(a2, _mm512_load_ps((const float*)(b + i + 128)));
          a3 = _mm512_add_ps(a3, _mm512_load_ps((const float*)(b + i + 192)));
        }
      } else {
        size_t part = len / S;
        for (size_t i = 0; i < part; i += 128) {
          for (int s = 0; s < S; ++s) {
            const char* p = b + s * part + i;
            a0 = _mm512_add_ps(a0, _mm512_load_ps((const float*)(p)));
            a1 = _mm512_add_ps(a1, _mm512_load_ps((const float*)(p + 64)));
          }
        }
      }
      tot += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ts.push_back(s);
    if (tot == 1.2345f) printf("x");
  }
  std::sort(ts.begin(), ts.end());
  printf("mode %d D %ld S %d: %.1f GB/s (best %.1f)\n", mode, D, S, n / ts[3] / 1e9, n / ts[0] / 1e9);
}
