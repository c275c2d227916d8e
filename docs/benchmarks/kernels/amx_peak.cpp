// AMX-BF16 issue rates on this CPU (Sapphire Rapids and later): tdpbf16ps on tiles already
// loaded (the tile unit's peak), and the GEMM's 2 x 2 step (two A tiles of x, two B tiles of a
// panel, four products) with its loads from L1 (x and panel reused) or with A over 256 rows x K
// (x from L2, as an AMX pass of `gemm.cpp` reads it). One and two threads; FLOP = 2 x multiply-adds.
// Usage: g++ -O2 -march=x86-64-v4 -pthread docs/benchmarks/kernels/amx_peak.cpp -o /tmp/amx_peak && /tmp/amx_peak [K]
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <unistd.h>
#include <sys/syscall.h>
struct Cfg { uint8_t palette=1, start=0; uint8_t res[14]={}; uint16_t colsb[16]={}; uint8_t rows[16]={}; };
__attribute__((target("amx-tile,amx-bf16"))) void cfg() {
  static Cfg c; for (int t=0;t<8;++t){c.rows[t]=16;c.colsb[t]=64;}
  asm volatile("" ::: "memory"); _tile_loadconfig(&c);
}
// mode 0: tdp only; mode 1: 2x2 with loads from L1 buffers; mode 2: A from big buffer (L2), B from L1 panel
__attribute__((target("amx-tile,amx-bf16"))) double run(int mode, long iters, const uint16_t* big, long bigrows, const uint16_t* panel, long K) {
  cfg();
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  asm volatile("" ::: "memory");
  _tile_loadd(4, big, 2*K); _tile_loadd(5, big, 2*K); _tile_loadd(6, panel, 128); _tile_loadd(7, panel+32, 128);
  long flops = 0;
  if (mode == 0) {
    for (long i=0;i<iters;++i){ _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);}
    flops = iters*4L*16*16*32*2;
  } else {
    long pairs = K/2;
    long steps = 0;
    while (steps < iters) {
      for (long m0 = 0; m0 < bigrows; m0 += 32) {
        const uint16_t* x = mode==1 ? big : big + m0*K;
        _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
        for (long p=0;p<pairs;p+=16) {
          const uint16_t* wp = panel + p*64;
          _tile_loadd(6, wp, 128); _tile_loadd(7, wp+32, 128);
          _tile_loadd(4, x+2*p, 2*K);
          _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);
          _tile_loadd(5, x+16*K+2*p, 2*K);
          _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);
          ++steps;
        }
        static thread_local float sums[32*32];
        _tile_stored(0,sums,128);_tile_stored(1,sums+16,128);_tile_stored(2,sums+512,128);_tile_stored(3,sums+528,128);
      }
    }
    flops = steps*4L*16*16*32*2;
  }
  _tile_release();
  return double(flops);
}
int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) { std::puts("no AMX tile data (CPU or kernel)"); return 1; }
  long K = argc > 1 ? atol(argv[1]) : 576;
  long rows = 256;
  for (int threads : {1, 2}) for (int mode : {0,1,2}) {
    std::vector<std::thread> ts; std::vector<double> fl(threads);
    auto t0 = std::chrono::steady_clock::now();
    for (int t=0;t<threads;++t) ts.emplace_back([&,t]{
      std::vector<uint16_t> big(rows*K, 0x3f80), panel(32*K, 0x3f00);
      fl[t] = run(mode, 2000000, big.data(), rows, panel.data(), K);});
    for (auto& t: ts) t.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
    double f=0; for (double x: fl) f+=x;
    printf("K=%ld mode %d (%s) threads %d: %.0f GFLOP/s\n", K, mode, mode==0?"tdp only":mode==1?"2x2 loads L1":"2x2 A from 256-row x", threads, f/s/1e9);
  }
}
