// What an AMX product costs with the tile traffic around it, on one thread (Sapphire Rapids and
// later): `tdpbf16ps` into one sums tile with nothing loaded (the unit's rate), with one or two
// operand tiles loaded from L1 for each product, with sums tiles switched between products, and
// with a sums tile stored and zeroed every two or four products (a 16 x 16 block of attention
// scores over head_dim 64 or 128). Ticks of the time-stamp counter a product (rdtsc; its rate is
// printed); the peak is 16 cycles a product (16 x 16 x 32 multiply-adds). Also 1 KB tile loads
// alone, ticks a load.
// Usage: g++ -O2 -march=x86-64-v4 docs/benchmarks/kernels/amx_tile_costs.cpp -o /tmp/amx_tile_costs && /tmp/amx_tile_costs
#include <immintrin.h>
#include <x86intrin.h>
#include <cstdint>
#include <cstdio>
#include <unistd.h>
#include <sys/syscall.h>
struct Cfg { uint8_t palette = 1, start = 0; uint8_t res[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
__attribute__((target("amx-tile"))) void configure() {
  static Cfg c;
  for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
}
alignas(64) uint16_t src[8][16 * 32];
#define CASE(name, body, products)                                                     \
  {                                                                                    \
    const uint64_t a = __rdtsc();                                                      \
    for (int i = 0; i < kReps; ++i) { body }                                           \
    printf("%-62s %6.1f ticks a product\n", name, (__rdtsc() - a) / double(products) / kReps); \
  }
__attribute__((target("amx-tile,amx-bf16"))) void run() {
  constexpr int kReps = 100000;
  _tile_loadd(0, src[0], 64); _tile_loadd(1, src[1], 64); _tile_loadd(2, src[2], 64); _tile_loadd(3, src[3], 64);
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  CASE("one sums tile, operands in tiles", _tile_dpbf16ps(4, 0, 1);, 1)
  CASE("tile loads alone (1 KB from L1; ticks a load)", _tile_loadd(0, src[0], 64); _tile_loadd(1, src[1], 64);
       _tile_loadd(2, src[2], 64); _tile_loadd(3, src[3], 64);, 4)
  CASE("one sums tile, B loaded for each product", _tile_loadd(1, src[1], 64); _tile_dpbf16ps(4, 0, 1);
       _tile_loadd(2, src[2], 64); _tile_dpbf16ps(4, 0, 2);, 2)
  CASE("one sums tile, A and B loaded for each product", _tile_loadd(0, src[0], 64); _tile_loadd(1, src[1], 64);
       _tile_dpbf16ps(4, 0, 1); _tile_loadd(2, src[2], 64); _tile_loadd(3, src[3], 64); _tile_dpbf16ps(4, 2, 3);, 2)
  CASE("two sums tiles alternating, operands in tiles", _tile_dpbf16ps(4, 0, 1); _tile_dpbf16ps(5, 0, 2);, 2)
  CASE("four sums tiles (2 x 2), operands in tiles", _tile_dpbf16ps(4, 0, 1); _tile_dpbf16ps(5, 0, 2);
       _tile_dpbf16ps(6, 3, 1); _tile_dpbf16ps(7, 3, 2);, 4)
  CASE("2 x 2 block, its four operand tiles loaded each step", _tile_loadd(0, src[0], 64); _tile_loadd(1, src[1], 64);
       _tile_loadd(2, src[2], 64); _tile_dpbf16ps(4, 0, 1); _tile_dpbf16ps(5, 0, 2); _tile_loadd(3, src[3], 64);
       _tile_dpbf16ps(6, 3, 1); _tile_dpbf16ps(7, 3, 2);, 4)
  CASE("one sums tile stored and zeroed every 2 products", _tile_dpbf16ps(4, 0, 1); _tile_dpbf16ps(4, 2, 3);
       _tile_stored(4, src[6], 64); _tile_zero(4);, 2)
  CASE("... every 4, A and B loaded for each product", _tile_loadd(0, src[0], 64); _tile_loadd(1, src[1], 64);
       _tile_dpbf16ps(4, 0, 1); _tile_loadd(2, src[2], 64); _tile_loadd(3, src[3], 64); _tile_dpbf16ps(4, 2, 3);
       _tile_dpbf16ps(4, 0, 1); _tile_dpbf16ps(4, 2, 3); _tile_stored(4, src[6], 64); _tile_zero(4);, 4)
}
__attribute__((target("amx-tile"))) void release() { _tile_release(); }
int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    printf("Linux refused the tile data (no AMX here?)\n");
    return 1;
  }
  const uint64_t t0 = __rdtsc();
  usleep(200000);
  printf("time-stamp counter: %.2f GHz\n", (__rdtsc() - t0) / 0.2e9);
  configure();
  for (int round = 0; round < 2; ++round) run();
  release();
}
