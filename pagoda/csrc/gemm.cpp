// y[M, N] = x[M, K] . W[N, K]^T (+ bias) for small M over a packed weight (bf16, or int8 codes
// with per-column scales): bf16 in and out, fp32 accumulation, the weight read from memory once
// per call for all M rows.
//
// Weight layout (written once at load by pagoda_gemm_pack_bf16): output columns in panels of
// 32 (N padded with zero columns to a multiple of 32, K with a zero to an even count). A panel
// is [K/2][2 blocks][16 columns][2 k-values]: for each k-pair, one 64-byte vector holds a
// block's 16 columns at both k-values, which is what vdpbf16ps takes, and a panel is read as
// one sequential stream of 128 bytes per k-pair.
// A tile of rows x blocks keeps its sums in fp32 registers: each row's k-pair is broadcast to
// all lanes, and every weight vector loaded serves all the tile's rows.
// - Up to kTileRows rows: one tile of all rows x one panel, straight through K, the weight
//   streaming in from memory as it goes.
// - More rows: near-equal tiles of up to kTileRows rows x one panel (from kWideFrom rows: up to
//   kWideRows rows x two panels, which wastes fewer loads per multiply once the arithmetic
//   dominates) over K in chunks of kChunkPairs k-pairs, L1-resident while every tile passes over
//   them; the partial sums wait in a small fp32 buffer between chunks.
// Where memory would otherwise idle while a tile computes (one tile of 6+ rows, or the first
// tile over a chunk), the tile prefetches the stream kPrefetchPairs ahead into L2, so that the
// weight's transfer and the arithmetic overlap. Threads split the panels (pairs of panels).
// The AVX2 build widens the weight to fp32 in registers (a shift or a mask per vector) and
// multiplies with FMAs, in tiles of up to 4 rows x 16 columns; from a row count measured at load
// it widens each chunk of a panel to fp32 once instead, for tiles of 6 rows x 16 columns that
// multiply it with plain FMAs (`avx2_wide_panel`). The portable build runs the same loops in
// plain code (slow: layers route around it).
// Each output is the fp32 sum (+ bias) rounded once to bf16.
//
// int8 variant (pagoda_qgemm_int8, quantized weights with one scale per output column). On the
// AVX-512 and AVX2 builds (format 2) x is rounded to int8 codes per row and group of 32 along K
// (as for int4 below), the weight's codes are stored + 128 as u8, a panel by quads of k ([K/4][32
// columns][4 codes]: one 64-byte vector holds a block's 16 columns x 4 k's, what vpdpbusd takes),
// and a tile (up to kInt8TileRows rows) sums each group in int32 registers, started at -128 * the
// group's sum of x codes, then scales it by x's step into fp32 sums held in registers. The AVX2
// tile gets the same integer sums from vpmaddubsw (|q| times x's codes with q's sign) and keeps
// its fp32 sums in L1 (`int8_rows_avx2`). With group scales (kPackedInt8Groups: GGUF's Q8_0 and
// Q5_0, one f16 scale per column and group of 32 along K, per panel [G][32]) each group's sum
// times x's step is multiplied by the column's scale before it adds in, as int4's d. y is W
// times the rounded x, up to fp32 sums. The AVX2 and VNNI builds also take fp32 group scales d by groups
// of 16 or 32 (GGUF's Q6_K; kPackedInt8F32Groups), or d and offsets m (w = q * d + m: Q5_K,
// Q5_1, and layers mixing Q4_K and Q6_K; kPackedInt8F32GroupsOffsets): x is then rounded by the
// weight's groups, and each group adds d * (dx * sum) + m * dx * sum xq; on AVX2 their codes, in
// [-32, 31], are stored + 32 and multiplied as unsigned bytes (`narrow_quads`), on VNNI any code
// + 128 (`is_narrow`). On CPUs
// with AMX, steps from a row count measured at load
// (`pagoda_gemm_set_amx_integer_rows`) widen each panel's codes to bf16 instead and multiply x as it
// is on the tile units (`AmxInt8`). The portable build (format 0) keeps the bf16 layout with
// one two's complement byte an element, decoded a chunk at a time into bf16 (exact) for the bf16
// tiles. Codes are in [-127, 127] (what per-channel quantization gives). The scale multiplies each
// column's fp32 sum once, before the bias and the one rounding.
//
// int4 variant (pagoda_qgemm_int4, w = q * d + m with q in [0, 15] and f16 d, m per group of gs
// along K): a panel's two k-pairs p, p + 1 (p even) are 64 bytes, 16-bit lane 2c + e holding, from
// its low nibble up, the codes of column c at p, column 16 + c at p, column c at p + 1, column
// 16 + c at p + 1 (k-pair element e). So each byte of 32-bit lane c holds column c's code in its
// low nibble and column 16 + c's in its high one, the four bytes for k = 2p, 2p + 2, 2p + 1,
// 2p + 3: a mask gives one block's u8 codes for 4 k's a lane, a shift and the mask the other's.
// x is quantized once per call like llama.cpp's Q8_0 activations: per row and group, int8 codes
// xq = round(x / dx), dx = max |x| / 127, stored in that same k order, and sx = dx * sum xq. A
// tile (up to kInt4TileRows rows) sums q * xq per group in int32 registers (vpdpbusd, 4
// products a lane per instruction, twice vdpbf16ps's), then adds d * dx * sum + m * sx per
// column to its fp32 sums in L1. More rows than one tile take K in chunks that stay in L1 while
// every tile reads them again. So y is W times the rounded x (dx * xq), up to fp32 sums and the
// one bf16 rounding (tests/test_quantization_kernels.py).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "gemm.h"
#include "parallel.h"
#include "vec.h"

namespace pagoda {
namespace {

constexpr int kBlock = 16;              // output columns per vector
constexpr int kPanel = 2 * kBlock;      // output columns per panel
constexpr int kPanelPair = 2 * kPanel;  // elements of a panel per k-pair (128 bytes)
#if defined(PAGODA_AVX2)
constexpr int kTileRows = 16;           // the AVX2 tile runs groups of 4 rows: tiles of 4 groups
#else
constexpr int kTileRows = 12;           // 12 x 2 accumulators + 2 weight vectors of 32 registers
#endif
constexpr int kWideRows = 6;            // wide tiles: 6 x 4 accumulators over 2 panels
#if defined(PAGODA_AVX2)
constexpr int64_t kWideFrom = int64_t{1} << 62;  // two panels only split the AVX2 tile's groups
#else
constexpr int64_t kWideFrom = 96;       // rows from which wide tiles are used
#endif
constexpr int kPrefetchRows = 6;        // one tile of fewer rows is bound by memory alone (by default)
constexpr int64_t kChunkPairs = 64;     // 8 KB of a panel
constexpr int64_t kMaxRowsPerPass = 768;  // rows sharing one pass over the weight
constexpr int64_t kMaxWidenedFma = int64_t{1} << 22;  // floats of x the FMA tiles widen at once (16 MB)

// NOTE: one chunk ahead, so that the first tile over a chunk fetches the next. Measured on the
// 30 layers' distinct weights, one thread (docs/performance.md, Small-M GEMM): a prefetch
// into L2 made one tile of 6-12 rows 10-20% faster, and of 1-5 rows slower (the hardware
// prefetcher alone keeps a plain stream at full speed; the prefetches only cost issue slots).
constexpr int64_t kPrefetchPairs = kChunkPairs;
// The row count from which one tile prefetches: kPrefetchRows (Zen 4), or fewer where a stream
// measured at load reads faster with it (`pagoda_gemm_set_prefetch_rows`, gemm_tiles.py): on the
// Intel AMX CPU a one-row pass over the 1B shape's weights read 17.8 GB/s with it, 16.1 without.
std::atomic<int64_t> g_prefetch_rows{kPrefetchRows};

int64_t padded_cols(int64_t N) { return (N + kPanel - 1) / kPanel * kPanel; }
int64_t num_pairs(int64_t K) { return (K + 1) / 2; }

// How int8 panels hold their codes (see the top of this file): 2, code + 128 as u8 by quads of k
// for vpdpbusd; 0, two's complement in the bf16 layout (the portable build).
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
#if !defined(__AVX512VNNI__)
#error "the AVX512_BF16 builds take AVX512_VNNI too (pagoda/layers/cpu_kernels/build.py)"
#endif
#define PAGODA_VNNI 1
#endif
#if defined(PAGODA_VNNI) || defined(PAGODA_AVX2)
#define PAGODA_INT8_QUADS 1  // format 2: vpdpbusd, or vpmaddubsw on AVX2
constexpr int kInt8Format = 2;
#else
constexpr int kInt8Format = 0;
#endif

// A tile's running sums: row m, column c of its (up to two) panels at sums[m * kSumsRow + c].
using Sums = float*;
constexpr int kSumsRow = 2 * kPanel;

struct Rows {
  const bf16* x;  // the tile's first row
  int64_t stride;
  int64_t K;
  const float* xf = nullptr;  // AVX2: the same rows widened to fp32 once per call (all K), or null
  int64_t xf_stride = 0;
};

// x's rows [0, R) over k-pairs [p0, p1) as fp32 pairs (x[K] read as 0 for an odd K), so that
// the tiles broadcast straight from memory.
inline const float* widen_rows(const Rows& rows, int R, int64_t p0, int64_t p1) {
  static thread_local std::vector<float> xf;
  const int64_t n = 2 * (p1 - p0);
  xf.resize(R * n);
  for (int r = 0; r < R; ++r) {
    const bf16* x = rows.x + r * rows.stride + 2 * p0;
    const int64_t valid = std::min(n, rows.K - 2 * p0);
    for (int64_t i = 0; i < n; i += kLanes) store(xf.data() + r * n + i, load(x + i, tail_mask(static_cast<int>(std::clamp<int64_t>(valid - i, 0, kLanes)))), tail_mask(static_cast<int>(std::min<int64_t>(n - i, kLanes))));
  }
  return xf.data();
}

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)

// A weight vector: 16 columns at a k-pair, 32 bf16 values at `src`.
inline __m512bh weight_vector(const bf16* src) { return (__m512bh)_mm512_loadu_si512(src); }

// Rows [0, MR) of `rows` x NP panels (`w`, then `panel_stride` elements on) over k-pairs
// [p0, p1); adds into `sums` (from zero when `first`); with PF, prefetches kPrefetchPairs ahead.
template <int MR, bool PF, int NP = 1>
void tile(const Rows& rows, const bf16* w, int64_t p0, int64_t p1, bool first, Sums sums, int64_t panel_stride = 0) {
  constexpr int NB = 2 * NP;
  __m512 acc[MR][NB];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) acc[m][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + m * kSumsRow + b * kBlock);
  auto step = [&](int64_t p, auto pair_of) {
    const bf16* wp = w + p * kPanelPair;
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const bf16* src = wp + (b / 2) * panel_stride + (b % 2) * 2 * kBlock;
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
      wv[b] = weight_vector(src);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_of(rows.x + m * rows.stride + 2 * p)));
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv[b], xv);
    }
  };
  // NOTE: an odd K's last pair reads x[K - 1] alone: the element after it may be another row's
  // or past the tensor, and NaN times the zero padding would still be NaN.
  const int64_t full = std::min(p1, rows.K / 2);
  for (int64_t p = p0; p < full; ++p) step(p, [](const bf16* q) {
    uint32_t v;
    std::memcpy(&v, q, sizeof(v));
    return v;
  });
  if (full < p1) step(full, [](const bf16* q) { return static_cast<uint32_t>(q->bits); });
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(sums + m * kSumsRow + b * kBlock, acc[m][b]);
}

// The same contract on fp32 FMAs: each 64-byte weight vector (16 columns at a k-pair) widened
// to fp32 in registers, the k-pair's even k by a shift, its odd k by a mask, two FMAs per row
// against x widened once per call (`Rows::xf`). Products are exact either way (bf16 x bf16
// fits fp32); only the order of the fp32 additions differs from vdpbf16ps's.
// NOTE: on some AVX512_BF16 CPUs vdpbf16ps issues at a quarter of the FMA rate (an Intel Xeon
// with avx512_fp16, no AMX exposed: 84 vs 170 GFLOP/s a thread, 2026-12-02), so once a tile's
// arithmetic binds, two FMAs beat one dot product; on Zen 4 it is the other way round. Which
// one runs from how many rows is measured at load (`pagoda_gemm_set_fma_rows`).
template <int MR, bool PF, int NP = 1>
void tile_fma(const Rows& rows, const bf16* w, int64_t p0, int64_t p1, bool first, Sums sums, int64_t panel_stride = 0) {
  constexpr int NB = 2 * NP;
  const int64_t n = rows.xf_stride;
  const float* xp = rows.xf + 2 * p0;
  __m512 acc[MR][NB];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) acc[m][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + m * kSumsRow + b * kBlock);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = p0; p < p1; ++p, xp += 2) {
    const bf16* wp = w + p * kPanelPair;
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const bf16* src = wp + (b / 2) * panel_stride + (b % 2) * 2 * kBlock;
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
      const __m512i u = _mm512_loadu_si512(src);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(u, high));
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
        acc[m][b] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xp[m * n + 1]), _mm512_fmadd_ps(we, _mm512_set1_ps(xp[m * n]), acc[m][b]));
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(sums + m * kSumsRow + b * kBlock, acc[m][b]);
}

#elif defined(PAGODA_AVX2)

constexpr int kAvx2Rows = 4;  // 4 rows x 2 vectors of sums + 4 weight vectors + 2 broadcasts


// A tile's R rows x V vectors of running sums read from `sums` (zeros when `first`), and written back.
template <int R, int V>
inline void load_sums(__m256 (&acc)[R][V], const float* sums, bool first) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * kSumsRow + 8 * j);
}
template <int R, int V>
inline void store_sums(const __m256 (&acc)[R][V], float* sums) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) _mm256_storeu_ps(sums + r * kSumsRow + 8 * j, acc[r][j]);
}

// R rows x one block of 16 columns over k-pairs [p0, p1): a 256-bit load holds 8 columns at
// both k's of a pair (bf16 k0 in each 32-bit lane's low half, k1 in its high half), widened to
// fp32 by a shift and a mask, then two FMAs per row and vector.
template <int R, bool PF>
void avx2_block(const float* xf, int64_t xf_stride, const bf16* w, int64_t p0, int64_t p1, float* sums, bool first) {
  __m256 acc[R][2];
  load_sums(acc, sums, first);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const float* xp = xf;
  for (int64_t p = p0; p < p1; ++p, xp += 2) {
    const bf16* src = w + p * kPanelPair;
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
    __m256 we[2], wo[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * h));
      we[h] = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
      wo[h] = _mm256_castsi256_ps(_mm256_and_si256(u, high));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(xp + r * xf_stride), b = _mm256_broadcast_ss(xp + r * xf_stride + 1);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(wo[h], b, _mm256_fmadd_ps(we[h], a, acc[r][h]));
    }
  }
  store_sums(acc, sums);
}

// R rows x a whole panel (both blocks, 32 columns) over k-pairs [p0, p1): the panel's 128 bytes
// of a k-pair read in order, so that one or two rows stream the weight as one sequential run.
// NOTE: a block at a time (above) reads every other 64-byte line of a panel, then the lines
// between: one row streamed 7 GB/s a thread that way (docs/performance.md, Roofline).
template <int R, bool PF>
void avx2_panel(const float* xf, int64_t xf_stride, const bf16* w, int64_t p0, int64_t p1, float* sums, bool first) {
  constexpr int V = kPanelPair / 16;  // 256-bit weight vectors per k-pair
  __m256 acc[R][V];
  load_sums(acc, sums, first);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const float* xp = xf;
  for (int64_t p = p0; p < p1; ++p, xp += 2) {
    const bf16* src = w + p * kPanelPair;
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * j));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(u, high));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(xp + r * xf_stride + 1),
                                    _mm256_fmadd_ps(we, _mm256_broadcast_ss(xp + r * xf_stride), acc[r][j]));
    }
  }
  store_sums(acc, sums);
}
constexpr int kAvx2PanelRows = 2;  // rows a whole-panel pass takes at once
constexpr int64_t kMaxWidened = int64_t{1} << 21;  // floats of x widened once per call (8 MB)
// NOTE: tiles of up to 4 rows read whole panels, two rows a pass (the second pass from L2); from
// 6 rows the block tiles' 4 rows per widened weight vector win (linear_paths.py on Zen 3: 1-2
// rows 2.2x faster, 3-4 rows 1.2-1.5x, 6-16 rows 10-25% slower as whole panels).
constexpr int kAvx2PanelTileRows = 4;

using Avx2BlockFn = void (*)(const float*, int64_t, const bf16*, int64_t, int64_t, float*, bool);
constexpr Avx2BlockFn kAvx2Panels[2][kAvx2PanelRows] = {{avx2_panel<1, false>, avx2_panel<2, false>},
                                                        {avx2_panel<1, true>, avx2_panel<2, true>}};
constexpr Avx2BlockFn kAvx2Blocks[2][kAvx2Rows] = {
    {avx2_block<1, false>, avx2_block<2, false>, avx2_block<3, false>, avx2_block<4, false>},
    {avx2_block<1, true>, avx2_block<2, true>, avx2_block<3, true>, avx2_block<4, true>}};

// From kAvx2WideFrom rows: each chunk of a panel widened to fp32 once ([k][32 columns], 16 KB,
// L1-resident), then tiles of 6 rows x 16 columns multiply it with plain fp32 FMAs: per k, two
// weight loads and 6 broadcasts feed 12 FMAs, and no tile widens the weight again.
constexpr int kAvx2WideRows = 6;  // 6 x 2 accumulators + 2 weight vectors + a broadcast

// R rows x 16 columns of a widened chunk (column block at wf, k stride kPanel) over ks k's, the
// rows' x packed at xt as [k][R] (`pack_x_tiles`).
template <int R>
void avx2_wide_tile(const float* xt, const float* wf, int64_t ks, float* sums, bool first) {
  __m256 acc[R][2];
  load_sums(acc, sums, first);
  for (int64_t k = 0; k < ks; ++k, wf += kPanel, xt += R) {
    const __m256 b0 = _mm256_load_ps(wf), b1 = _mm256_load_ps(wf + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(xt + r);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  store_sums(acc, sums);
}

// NOTE: the first tile over a chunk widens it (`avx2_wide_tile_widening`) with 2 weight vectors,
// a broadcast and the mask beside its 2 x R sums: at most 5 rows, or GCC 12 spills sums.
constexpr int kAvx2WideningRows = 5;

// The first tile over a chunk: the same sums, widening the chunk as it reads it (block at w:
// k-pairs [0, pairs) of one 16-column block, kPanelPair elements apart) and storing it at wf for
// the tiles after it, so that the stores overlap its FMAs.
template <int R>
void avx2_wide_tile_widening(const float* xt, const bf16* w, float* wf, int64_t pairs, float* sums, bool first) {
  __m256 acc[R][2];
  load_sums(acc, sums, first);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p, w += kPanelPair, wf += 2 * kPanel, xt += 2 * R) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
#pragma GCC unroll 2
    for (int e = 0; e < 2; ++e) {
      __m256 b[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * h));
        b[h] = _mm256_castsi256_ps(e ? _mm256_and_si256(u, high) : _mm256_slli_epi32(u, 16));
        _mm256_store_ps(wf + e * kPanel + 8 * h, b[h]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(xt + e * R + r);
        acc[r][0] = _mm256_fmadd_ps(a, b[0], acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, b[1], acc[r][1]);
      }
    }
  }
  store_sums(acc, sums);
}

using Avx2WideFn = void (*)(const float*, const float*, int64_t, float*, bool);
using Avx2WideningFn = void (*)(const float*, const bf16*, float*, int64_t, float*, bool);
constexpr Avx2WideningFn kAvx2WideningTiles[kAvx2WideningRows] = {
    avx2_wide_tile_widening<1>, avx2_wide_tile_widening<2>, avx2_wide_tile_widening<3>, avx2_wide_tile_widening<4>,
    avx2_wide_tile_widening<5>};
constexpr Avx2WideFn kAvx2WideTiles[kAvx2WideRows] = {avx2_wide_tile<1>, avx2_wide_tile<2>, avx2_wide_tile<3>,
                                                       avx2_wide_tile<4>, avx2_wide_tile<5>, avx2_wide_tile<6>};

// The AVX-512 tile's contract, in groups of up to kAvx2Rows rows x one block at a time (the
// weight chunk is re-read from L1 by each group; only the first prefetches).
template <int MR, bool PF, int NP = 1>
void tile(const Rows& rows, const bf16* w, int64_t p0, int64_t p1, bool first, Sums sums, int64_t panel_stride = 0) {
  const int64_t n = rows.xf ? rows.xf_stride : 2 * (p1 - p0);
  const float* xf = rows.xf ? rows.xf + 2 * p0 : widen_rows(rows, MR, p0, p1);
  if (MR <= kAvx2PanelTileRows) {
    for (int m0 = 0; m0 < MR; m0 += kAvx2PanelRows) {
      const int r = std::min(kAvx2PanelRows, MR - m0);
      for (int j = 0; j < NP; ++j)
        kAvx2Panels[PF && m0 == 0][r - 1](xf + m0 * n, n, w + j * panel_stride, p0, p1, sums + m0 * kSumsRow + j * kPanel, first);
    }
    return;
  }
  for (int m0 = 0; m0 < MR; m0 += kAvx2Rows) {
    const int r = std::min(kAvx2Rows, MR - m0);
    for (int b = 0; b < 2 * NP; ++b) {
      const bf16* wb = w + (b / 2) * panel_stride + (b % 2) * 2 * kBlock;
      kAvx2Blocks[PF && m0 == 0][r - 1](xf + m0 * n, n, wb, p0, p1, sums + m0 * kSumsRow + b * kBlock, first);
    }
  }
}

#else

template <int MR, bool PF, int NP = 1>
void tile(const Rows& rows, const bf16* w, int64_t p0, int64_t p1, bool first, Sums sums, int64_t panel_stride = 0) {
  for (int m = 0; first && m < MR; ++m) std::fill(sums + m * kSumsRow, sums + m * kSumsRow + NP * kPanel, 0.f);
  for (int64_t p = p0; p < p1; ++p) {
    for (int m = 0; m < MR; ++m) {
      const bf16* xp = rows.x + m * rows.stride + 2 * p;
      const float x0 = to_float(xp[0]), x1 = 2 * p + 1 < rows.K ? to_float(xp[1]) : 0.f;
      for (int c = 0; c < NP * kPanel; ++c) {
        const bf16* wc = w + (c / kPanel) * panel_stride + p * kPanelPair + (c % kPanel) * 2;
        sums[m * kSumsRow + c] += to_float(wc[0]) * x0 + to_float(wc[1]) * x1;
      }
    }
  }
}

#endif

using TileFn = void (*)(const Rows&, const bf16*, int64_t, int64_t, bool, Sums, int64_t);

template <bool PF, int NP, int... I>
constexpr std::array<TileFn, kTileRows> make_tiles(std::integer_sequence<int, I...>) {
  return {tile<I + 1, PF, NP>...};
}
constexpr std::array<std::array<TileFn, kTileRows>, 2> kTiles{
    make_tiles<false, 1>(std::make_integer_sequence<int, kTileRows>()),
    make_tiles<true, 1>(std::make_integer_sequence<int, kTileRows>())};
constexpr std::array<std::array<TileFn, kTileRows>, 2> kWideTiles{
    make_tiles<false, 2>(std::make_integer_sequence<int, kWideRows>()),
    make_tiles<true, 2>(std::make_integer_sequence<int, kWideRows>())};
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
template <bool PF, int NP, int... I>
constexpr std::array<TileFn, kTileRows> make_fma_tiles(std::integer_sequence<int, I...>) {
  return {tile_fma<I + 1, PF, NP>...};
}
constexpr std::array<std::array<TileFn, kTileRows>, 2> kFmaTiles{
    make_fma_tiles<false, 1>(std::make_integer_sequence<int, kTileRows>()),
    make_fma_tiles<true, 1>(std::make_integer_sequence<int, kTileRows>())};
constexpr std::array<std::array<TileFn, kTileRows>, 2> kFmaWideTiles{
    make_fma_tiles<false, 2>(std::make_integer_sequence<int, kWideRows>()),
    make_fma_tiles<true, 2>(std::make_integer_sequence<int, kWideRows>())};
#endif
// Steps of at least this many rows take the FMA tiles (AVX-512 build) or the widened chunks (AVX2
// build; set at load by measurement, `pagoda_gemm_set_fma_rows`); never by default.
std::atomic<int64_t> g_fma_rows{int64_t{1} << 62};

// The tiles for a pass of M rows (fma: the FMA tiles, which read x widened once per call).
struct Tiles {
  bool fma;
  TileFn tile(int rows, bool prefetch) const {
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
    if (fma) return kFmaTiles[prefetch][rows - 1];
#endif
    return kTiles[prefetch][rows - 1];
  }
  TileFn wide(int rows, bool prefetch) const {
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
    if (fma) return kFmaWideTiles[prefetch][rows - 1];
#endif
    return kWideTiles[prefetch][rows - 1];
  }
};

struct Problem {
  const bf16* x;
  int64_t xs;
  const float* scales;  // per output column (quantized weights), or null
  const bf16* bias;
  bf16* y;
  int64_t ys, M, N, K;
  const float* xf = nullptr;  // see Rows
  int64_t xf_stride = 0;
  bool fma = false;  // the FMA tiles (`Tiles`), over xf; on AVX2 the widened chunks (`avx2_wide_panel`)
  // A gated MLP's epilogue (`emit_gated`; AMX passes only): 0, or a GatedAct over N / 2 gate
  // columns, y then [M, N / 2].
  int64_t gated = 0;

  Rows rows(int64_t m0) const { return {x + m0 * xs, xs, K, xf ? xf + m0 * xf_stride : nullptr, xf_stride}; }
};

// The rows cut into near-equal tiles of at most kTileRows; tile t is rows [start[t], start[t + 1]).
struct Tiling {
  int count;
  std::array<int64_t, kMaxRowsPerPass / kWideRows + 2> start;

  Tiling(int64_t M, int max_rows) : count(static_cast<int>((M + max_rows - 1) / max_rows)) {
    for (int t = 0; t <= count; ++t) start[t] = M * t / count;
  }
  // The same with the first tile (the smallest) of at most first_max rows: one tile more where needed.
  Tiling(int64_t M, int max_rows, int first_max) : Tiling(M, max_rows) {
    if (M / count <= first_max) return;
    ++count;
    for (int t = 0; t <= count; ++t) start[t] = M * t / count;
  }
  int rows(int t) const { return static_cast<int>(start[t + 1] - start[t]); }
};

// Rows [m0, m0 + rows) of the panel at column c0: the sums (times the column scales) plus bias, rounded to bf16; columns
// past N dropped.
void emit(const Problem& P, const float* sums, int64_t m0, int rows, int64_t c0, int64_t cols) {
  for (int m = 0; m < rows; ++m) {
    bf16* out = P.y + (m0 + m) * P.ys;
    for (int64_t c = c0; c < std::min(c0 + cols, P.N); c += kBlock) {
      const Mask mask = tail_mask(static_cast<int>(std::min<int64_t>(P.N - c, kBlock)));
      Vf v = load(sums + m * kSumsRow + (c - c0));
      if (P.scales) v = v * load(P.scales + c, mask);
      if (P.bias) v = v + load(P.bias + c, mask);
      store(out + c, v, mask);
    }
  }
}

// The gated epilogue of gate panel `c0 / kPanel` and its up panel (P.N / 2 columns on): each
// factor as `emit` would store it (scaled, biased, rounded to bf16), then act(gate) * up as the
// elementwise kernels compute it (vec.h), rounded once more.
template <int64_t kAct>
void emit_gated(const Problem& P, const float* gate, const float* up, int64_t m0, int rows, int64_t c0) {
  const int64_t half = P.N / 2;
  const auto factor = [&](const float* sums, int64_t c) {
    Vf v = load(sums);
    if (P.scales) v = v * load(P.scales + c);
    if (P.bias) v = v + load(P.bias + c);
    return round_as<bf16>(v);
  };
  for (int m = 0; m < rows; ++m) {
    bf16* out = P.y + (m0 + m) * P.ys;
    for (int64_t c = c0; c < c0 + kPanel; c += kBlock) {
      const int64_t at = m * kSumsRow + (c - c0);
      const Vf g = factor(gate + at, c);
      const Vf a = kAct == kSiluGate ? silu_as<bf16>(g) : gelu_tanh_as<bf16>(g);
      store(out + c, a * factor(up + at, half + c));
    }
  }
}

// Where the tiles read a chunk of panels: k-pair p of the first panel at w + p * kPanelPair,
// the next panel panel_stride elements on.
struct View {
  const bf16* w;
  int64_t panel_stride;
};

// bf16 panels, read in place (a single tile streams the whole of K, prefetching itself).
struct Bf16Panels {
  static constexpr bool kInPlace = true;
  const bf16* packed;
  int64_t pairs;
  View chunk(int64_t index, int /*np*/, int64_t /*p0*/, int64_t /*p1*/, bool /*prefetch*/) const {
    return {packed + index * kPanel * 2 * pairs, kPanel * 2 * pairs};
  }
};

#if !defined(PAGODA_INT8_QUADS)
// int8 panels (format 0), decoded a chunk at a time into a bf16 buffer that every tile then
// reads: exact, every int8 is a bf16.
struct Int8Panels {
  static constexpr bool kInPlace = false;
  const int8_t* codes;
  int64_t pairs;
  bf16* buffer;  // 2 * kChunkPairs * kPanelPair elements
  View chunk(int64_t index, int np, int64_t p0, int64_t p1, bool /*prefetch*/) const {
    for (int j = 0; j < np; ++j) {
      const int8_t* panel = codes + (index + j) * kPanel * 2 * pairs;
      bf16* out = buffer + j * kChunkPairs * kPanelPair;
      for (int64_t i = p0 * kPanelPair; i < p1 * kPanelPair; ++i)
        store_one(static_cast<float>(panel[i]), out + i - p0 * kPanelPair);
    }
    // NOTE: offset back by p0 so that the tiles index the chunk by its absolute k-pairs.
    return {buffer - p0 * kPanelPair, kChunkPairs * kPanelPair};
  }
};
#endif

// All M rows over panel `index`: one tile straight through K, or every tile over each chunk.
template <class Source>
void panel(const Problem& P, const Source& src, const Tiling& tiling, int64_t index, float* sums) {
  const int64_t pairs = num_pairs(P.K), c0 = index * kPanel;
  const bool single = tiling.count == 1;
#if defined(PAGODA_AVX2)
  // NOTE: a single AVX2 tile of more than kAvx2PanelTileRows rows is several passes over its
  // weight (groups of 4 rows x a block): in chunks, so that every pass after the first reads L1.
  const bool streams = single && Source::kInPlace && tiling.rows(0) <= kAvx2PanelTileRows;
#else
  const bool streams = single && Source::kInPlace;
#endif
  const int64_t chunk = streams ? pairs : kChunkPairs;
  for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
    const int64_t p1 = std::min(pairs, p0 + chunk);
    const bool single_prefetches = tiling.rows(0) >= g_prefetch_rows.load(std::memory_order_relaxed);
    const View v = src.chunk(index, 1, p0, p1, !single || single_prefetches);
    for (int t = 0; t < tiling.count; ++t) {
      const bool prefetch = Source::kInPlace && (single ? single_prefetches : t == 0);
      Tiles{P.fma}.tile(tiling.rows(t), prefetch)(P.rows(tiling.start[t]), v.w, p0, p1, p0 == 0,
                                        sums + tiling.start[t] * kSumsRow, 0);
    }
  }
  for (int t = 0; t < tiling.count; ++t)
    emit(P, sums + tiling.start[t] * kSumsRow, tiling.start[t], tiling.rows(t), c0, kPanel);
}

// Panels 2 * index and 2 * index + 1 in wide tiles, over each chunk.
template <class Source>
void panel_pair(const Problem& P, const Source& src, const Tiling& tiling, int64_t index, float* sums) {
  const int64_t pairs = num_pairs(P.K), c0 = index * 2 * kPanel;
  for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
    const int64_t p1 = std::min(pairs, p0 + kChunkPairs);
    const View v = src.chunk(2 * index, 2, p0, p1, true);
    for (int t = 0; t < tiling.count; ++t)
      Tiles{P.fma}.wide(tiling.rows(t), Source::kInPlace && t == 0)(P.rows(tiling.start[t]), v.w, p0,
                                                               p1, p0 == 0, sums + tiling.start[t] * kSumsRow,
                                                               v.panel_stride);
  }
  for (int t = 0; t < tiling.count; ++t)
    emit(P, sums + tiling.start[t] * kSumsRow, tiling.start[t], tiling.rows(t), c0, 2 * kPanel);
}

#if defined(PAGODA_AVX2) || (defined(PAGODA_AVX512) && defined(__AVX512BF16__))
// x's rows widened to fp32 once for the whole call (`Problem::xf`), all K.
inline void widen_x(Problem& P) {
  P.xf_stride = 2 * num_pairs(P.K);
  P.xf = widen_rows(Rows{P.x, P.xs, P.K}, static_cast<int>(P.M), 0, num_pairs(P.K));
}
#endif

#if defined(PAGODA_AVX2)
// How the widened-chunk steps cut M rows into tiles: pack_x_tiles lays x out by these tiles and
// avx2_wide_panel runs them, so both take it from here.
inline Tiling avx2_wide_tiling(int64_t M) { return Tiling(M, kAvx2WideRows, kAvx2WideningRows); }

// x packed once per call for the widened-chunk tiles (`avx2_wide_tiling`): chunk by chunk of
// kChunkPairs k-pairs (the chunk at k-pair p0 from 2 * p0 * M), tile t of the chunk (rows [s, s +
// r)) from s * n as [k][r] (n: the chunk's k's); x[K] read as 0 for an odd K. The buffer keeps the
// largest pass's M x K floats (768 x 8192: 25 MB for the 1B shape's prefill).
// NOTE: read in place, a tile's rows are K floats apart, each chunk of x six strided runs; packed,
// a chunk's x is one contiguous block next to its widened weight (gemm_ab.py 1.01-1.07x, Zen 3).
inline const float* pack_x_tiles(const Problem& P, const Tiling& tiling) {
  static thread_local std::vector<float> xt;
  const int64_t pairs = num_pairs(P.K);
  xt.resize(P.M * 2 * pairs);
  for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
    const int64_t k0 = 2 * p0, n = 2 * (std::min(pairs, p0 + kChunkPairs) - p0);
    for (int t = 0; t < tiling.count; ++t) {
      const int rows = tiling.rows(t);
      float* out = xt.data() + k0 * P.M + tiling.start[t] * n;
      for (int r = 0; r < rows; ++r) {
        const bf16* x = P.x + (tiling.start[t] + r) * P.xs;
        for (int64_t k = 0; k < n; ++k) out[k * rows + r] = k0 + k < P.K ? to_float(x[k0 + k]) : 0.f;
      }
    }
  }
  return xt.data();
}

// All M rows over panel `index` on the widened chunks (see kAvx2WideRows), x packed at P.xf.
template <class Source>
void avx2_wide_panel(const Problem& P, const Source& src, int64_t index, float* sums) {
  alignas(64) static thread_local float wf[2 * kChunkPairs * kPanel];
  const int64_t pairs = num_pairs(P.K), c0 = index * kPanel;
  const Tiling tiling = avx2_wide_tiling(P.M);
  for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
    const int64_t p1 = std::min(pairs, p0 + kChunkPairs), n = 2 * (p1 - p0);
    const bf16* w = src.chunk(index, 1, p0, p1, true).w + p0 * kPanelPair;
    for (int t = 0; t < tiling.count; ++t) {
      const float* xt = P.xf + 2 * p0 * P.M + tiling.start[t] * n;
      for (int b = 0; b < 2; ++b) {
        float* s = sums + tiling.start[t] * kSumsRow + b * kBlock;
        if (t == 0)
          kAvx2WideningTiles[tiling.rows(t) - 1](xt, w + 2 * kBlock * b, wf + b * kBlock, p1 - p0, s, p0 == 0);
        else
          kAvx2WideTiles[tiling.rows(t) - 1](xt, wf + b * kBlock, n, s, p0 == 0);
      }
    }
  }
  emit(P, sums, 0, static_cast<int>(P.M), c0, kPanel);
}
#endif

// `make_source(buffer)` gives each thread its Source (`buffer`: that thread's decode buffer).
template <class MakeSource>
void gemm_pass(const Problem& problem, MakeSource make_source) {
#if defined(PAGODA_AVX2)
  // NOTE: x widened once per call, not once per panel and chunk: per panel it was 6% of a
  // 16-row step (perf, SmolLM2 at 16 streams). The register tiles take it up to kMaxWidened
  // floats (the buffer stays allocated; bigger passes widen per chunk as before); the widened
  // chunks always take it packed (`pack_x_tiles`).
  Problem P = problem;
  P.fma = P.M >= g_fma_rows.load(std::memory_order_relaxed);  // the widened chunks (avx2_wide_panel)
  if (P.fma)
    P.xf = pack_x_tiles(P, avx2_wide_tiling(P.M));
  else if (P.M * 2 * num_pairs(P.K) <= kMaxWidened)
    widen_x(P);
#elif defined(PAGODA_AVX512) && defined(__AVX512BF16__)
  Problem P = problem;
  using Source = decltype(make_source(static_cast<bf16*>(nullptr)));
  if (Source::kInPlace && P.M >= g_fma_rows.load(std::memory_order_relaxed) &&
      P.M * 2 * num_pairs(P.K) <= kMaxWidenedFma) {
    widen_x(P);
    P.fma = true;
  }
#else
  const Problem& P = problem;
#endif
  const int64_t panels = padded_cols(P.N) / kPanel;
  const bool wide = P.M >= kWideFrom;
  const Tiling tiling(P.M, wide ? kWideRows : kTileRows);
  const int64_t items = wide ? (panels + 1) / 2 : panels;
  parallel_ranges(items, 1, [&](int64_t i0, int64_t i1) {
    static thread_local std::vector<float> sums;
    static thread_local std::vector<bf16> buffer(2 * kChunkPairs * kPanelPair);
    sums.resize(P.M * kSumsRow);
    const auto src = make_source(buffer.data());
    for (int64_t i = i0; i < i1; ++i) {
#if defined(PAGODA_AVX2)
      if (P.fma) {
        avx2_wide_panel(P, src, i, sums.data());
        continue;
      }
#endif
      if (!wide)
        panel(P, src, tiling, i, sums.data());
      else if (2 * i + 1 < panels)
        panel_pair(P, src, tiling, i, sums.data());
      else
        panel(P, src, Tiling(P.M, kTileRows), 2 * i, sums.data());
    }
  });
}

}  // namespace

// Elements of the packed weight for an N x K matrix (zero-initialize it before packing).
int64_t gemm_packed_size(int64_t N, int64_t K) { return padded_cols(N) * 2 * num_pairs(K); }

// ---------------------------------------------------------------- int4, group-wise scales

constexpr int kInt4PairBytes = kPanel;  // a panel's k-pair: 32 bytes of two nibbles
constexpr int kInt5HighBytes = 16;      // int5: a step of two k-pairs' fifth bits (two 64-bit masks)
constexpr int kInt5StepBytes = 128;     // int5 expanded (expand_int5): a step's two code vectors
enum Int4Codes : int { kNibbles = 0, kInt5Bits = 1, kInt5Bytes = 2 };  // what an int4 tile reads
// How int4-layout panels scale their columns, per panel and group (a tile's template argument):
// f16 d[32] then m[32] (int4), f16 d[32] alone with m = -16 d taken in the integer sums (int5 of
// GGUF's Q5_0), or fp32 d[32] then m[32] (int5 of Q5_K and Q5_1, whose d and m f16 cannot hold).
enum Int4Scales : int { kF16Dm = 0, kF16Sym = 1, kF32Dm = 2 };
constexpr int64_t int4_group_bytes(int sc) { return sc == kF16Dm ? 4 * kPanel : sc == kF16Sym ? 2 * kPanel : 8 * kPanel; }
constexpr int kInt4TileRows = 6;        // 6 x 2 group sums + 6 x 2 fp32 sums + 2 code vectors + a mask + x

// Where each group of 4 k's keeps its x codes: the order of the codes in a code vector's
// 32-bit lane (k 0, 2, 1, 3: see the top of this file). Its own inverse.
constexpr int kInt4Order[4] = {0, 2, 1, 3};

// x as the int4 tiles read it, a row at a time: per group of gs, int8 codes xq (x * 127 / max |x|
// rounded to nearest even) in kInt4Order by 4 k's, their step dx = max |x| / 127, and sx = dx *
// sum xq, the rounded x's sum (for the offsets).
// NOTE: the offsets take the rounded x too, so that every weight meets the same x: the result is
// the exact product of w and the rounded x. With x's exact sum instead, the error would be that
// of q * d, which is all of one sign, not w's (perplexity +1.3% instead of +0.2%, SmolLM2 Q4_1).
struct Int4Rows {
  int8_t* xq;      // [rows, K]
  float* dx;       // [rows, G]
  float* sx;       // [rows, G]
  int32_t* total;  // [rows, G]: sum xq (int5's offset, -16 d, taken in the integer sums)
  int64_t K, G;
  Int4Rows from(int64_t m) const { return {xq + m * K, dx + m * G, sx + m * G, total + m * G, K, G}; }
  // Row m's 4 x codes of k-pairs p, p + 1 (kInt4Order), as the 32-bit lane the tiles broadcast.
  int32_t quad(int m, int64_t p) const {
    int32_t q;
    std::memcpy(&q, xq + m * K + 2 * p, sizeof(q));
    return q;
  }
};

struct Int4Problem {
  const uint8_t* codes;
  const void* scales;  // per panel and group, as `scale_kind` says (Int4Scales)
  Int4Rows x;
  int64_t group_pairs;
  const uint8_t* high = nullptr;  // int5 (kPackedInt5, kPackedInt5F32): the codes' fifth bits, kInt5HighBytes a step
  int scale_kind = kF16Dm;
};

// 16 values of x, already times 127 / max |x| of their group, rounded to nearest even as int8
// codes at q (in kInt4Order by 4 k's when `kReorder`, else in k order); returns their sum.
// NOTE: |v| <= 127, so no packing below saturates.
template <bool kReorder>
int32_t store_codes(const Vf& v, int8_t* q) {
#if defined(PAGODA_AVX512)
  const __m512i r = _mm512_cvtps_epi32(kReorder ? _mm512_permute_ps(v.v, 0xD8) : v.v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(r));
  return _mm512_reduce_add_epi32(r);
#elif defined(PAGODA_AVX2)
  const __m256i lo = _mm256_cvtps_epi32(kReorder ? _mm256_permute_ps(v.lo, 0xD8) : v.lo);
  const __m256i hi = _mm256_cvtps_epi32(kReorder ? _mm256_permute_ps(v.hi, 0xD8) : v.hi);
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);  // 16 in order
  const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(bytes));
  const __m256i s8 = _mm256_add_epi32(lo, hi);
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
#else
  alignas(64) float f[kBlock];
  store(f, v);
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const auto r = static_cast<int8_t>(std::clamp(std::nearbyint(f[j]), -127.f, 127.f));
    q[kReorder ? (j & ~3) + kInt4Order[j & 3] : j] = r;
    sum += r;
  }
  return sum;
#endif
}

// Row m's x codes, scales and sums for every group (`out`: its buffers).
void quantize_row(const bf16* x, int64_t gs, const Int4Rows& out) {
  for (int64_t g = 0; g < out.G; ++g) {
    const bf16* xg = x + g * gs;
    Vf amax = vzero();
    for (int64_t i = 0; i < gs; i += kBlock) {
      const Vf v = load(xg + i);
      amax = vmax(amax, vmax(v, vzero() - v));
    }
    const float a = reduce_max(amax);
    const float inv = a > 0.f ? 127.f / a : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < gs; i += kBlock) sum += store_codes<true>(load(xg + i) * vset1(inv), out.xq + g * gs + i);
    out.dx[g] = a / 127.f;
    out.sx[g] = out.dx[g] * static_cast<float>(sum);
    out.total[g] = sum;
  }
}

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)

// int5 (kPackedInt5: GGUF's Q5_0, w = (q - 16) d, q in [0, 31]): the int4 layout's nibbles, then
// a plane of the codes' fifth bits, per panel and step of two k-pairs two 64-bit masks: bit j of
// mask b the fifth bit of the code in byte j of block b's code vector (see the top of this file).
// Its scales are d alone, f16 [panel][group][32 columns] (m = -16 d implied): the AMX widening
// computes m (exact), and the integer products take it: their sums start at -16 sum xq, so that
// each group's sum is that of (q - 16) xq, exact, scaled as the int8 panels scale Q5_0's codes
// (the same bits as those).
// Adds 16 where the bit is set, to both blocks' codes of k-pairs p, p + 1 (p even); `prefetch`
// brings the plane's line as far on as the codes' into L2, once a line.
inline void add_fifth_bits(const uint8_t* hb, int64_t p, bool prefetch, __m512i& v0, __m512i& v1) {
  const uint8_t* at = hb + (p / 2) * kInt5HighBytes;
  if (prefetch && (p & 7) == 0)  // NOTE: a line holds 4 steps' bits
    _mm_prefetch(reinterpret_cast<const char*>(at + (kPrefetchPairs / 2) * kInt5HighBytes), _MM_HINT_T1);
  uint64_t m[2];
  std::memcpy(m, at, sizeof m);
  const __m512i sixteen = _mm512_set1_epi8(16);
  v0 = _mm512_mask_add_epi8(v0, _cvtu64_mask64(m[0]), v0, sixteen);
  v1 = _mm512_mask_add_epi8(v1, _cvtu64_mask64(m[1]), v1, sixteen);
}

// Both blocks' u8 codes of k-pairs p, p + 1 (p even) of the panel at w: the nibbles, and with
// HB their fifth bits from hb; PF prefetches the stream ahead into L2.
template <bool HB, bool PF>
inline void load_codes(const uint8_t* w, const uint8_t* hb, int64_t p, __m512i& v0, __m512i& v1) {
  const uint8_t* src = w + p * kInt4PairBytes;
  if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * kInt4PairBytes), _MM_HINT_T1);
  const __m512i raw = _mm512_loadu_si512(src), low = _mm512_set1_epi8(0x0F);
  v0 = _mm512_and_si512(raw, low);
  v1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
  if constexpr (HB) add_fifth_bits(hb, p, PF, v0, v1);
}

// An int5 panel's k-pairs [p0, p1) (p0 even) as whole-byte codes, both blocks' code vectors of
// each two k-pairs (kInt5StepBytes) in turn at out, for tiles that read them many times (more
// rows than one tile): the fifth bits added once, not once a tile.
void expand_int5(const uint8_t* codes, const uint8_t* hb, int64_t p0, int64_t p1, uint8_t* out) {
  for (int64_t p = p0; p < p1; p += 2) {
    __m512i v0, v1;
    load_codes<true, true>(codes, hb, p, v0, v1);
    uint8_t* dst = out + ((p - p0) / 2) * kInt5StepBytes;
    _mm512_storeu_si512(dst, v0);
    _mm512_storeu_si512(dst + 64, v1);
  }
}

// Rows [0, MR) x one int4 panel over k-pairs [p0, p1) (whole groups); adds into `sums` (from zero
// when `first`). Each group: integer sums of q * xq in registers (vpdpbusd: 4 k's of a column a
// lane, u8 codes times s8 x codes), then sums += d * dx * that + m * sx, per column. One 64-byte
// load holds two k-pairs' codes: a mask gives the first block's 16 columns x 4 k's, a shift
// and the mask the second's.
// NOTE: one or two rows keep separate sums for alternate steps, so that four chains of
// vpdpbusd hide its latency.
// HB: int5 (kInt5Bits: the fifth bits from hb; kInt5Bytes: w the chunk's codes as expand_int5
// wrote them, from k-pair p0 on); SC: the scales at dm (Int4Scales).
template <int MR, bool PF, int HB, int SC>
void int4_tile(const Int4Rows& x, int64_t group_pairs, const uint8_t* w, const uint8_t* hb, const uint8_t* dm,
               int64_t p0, int64_t p1, bool first, Sums sums) {
  constexpr int kSplit = MR <= 2 ? 2 : 1;
  __m512 acc[MR][2];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < 2; ++b) acc[m][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + m * kSumsRow + b * kBlock);
  int64_t g = p0 / group_pairs;
  for (int64_t g0 = p0; g0 < p1; g0 += group_pairs, ++g) {
    __m512i part[MR][2 * kSplit];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
      for (int i = 0; i < 2 * kSplit; ++i)
        part[m][i] = SC == kF16Sym && i < 2 ? _mm512_set1_epi32(-16 * x.total[m * x.G + g]) : _mm512_setzero_si512();
    auto step = [&](int64_t p, int half) {
      __m512i v0, v1;
      if constexpr (HB == kInt5Bytes) {
        const uint8_t* src = w + ((p - p0) / 2) * kInt5StepBytes;
        v0 = _mm512_loadu_si512(src);
        v1 = _mm512_loadu_si512(src + 64);
      } else {
        load_codes<HB == kInt5Bits, PF>(w, hb, p, v0, v1);
      }
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = _mm512_set1_epi32(x.quad(m, p));
        __m512i* acc = part[m] + 2 * half;
        acc[0] = _mm512_dpbusd_epi32(acc[0], v0, xv);
        acc[1] = _mm512_dpbusd_epi32(acc[1], v1, xv);
      }
    };
    // NOTE: group_pairs is a multiple of 8 (gs of 16s), so steps come in pairs.
    for (int64_t p = g0; p < g0 + group_pairs; p += 4) {
      step(p, 0);
      step(p + 2, kSplit - 1);
    }
    const uint8_t* at = dm + g * int4_group_bytes(SC);
    __m512 d[2], off[2];
    for (int b = 0; b < 2; ++b) {
      if constexpr (SC == kF32Dm) {
        d[b] = _mm512_loadu_ps(reinterpret_cast<const float*>(at) + b * kBlock);
        off[b] = _mm512_loadu_ps(reinterpret_cast<const float*>(at) + kPanel + b * kBlock);
      } else {
        const auto* s = reinterpret_cast<const uint16_t*>(at);
        d[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b * kBlock)));
        if constexpr (SC == kF16Dm)
          off[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kPanel + b * kBlock)));
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512 scale = _mm512_set1_ps(x.dx[m * x.G + g]), xs = _mm512_set1_ps(x.sx[m * x.G + g]);
      for (int b = 0; b < 2; ++b) {
        __m512i sum = part[m][b];
        if constexpr (kSplit == 2) sum = _mm512_add_epi32(sum, part[m][2 + b]);
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale);
        // NOTE: kF32Dm in the int8 panels' order (m then d), so that Q5_K's sums are theirs
        if constexpr (SC == kF16Sym)
          acc[m][b] = _mm512_fmadd_ps(d[b], t, acc[m][b]);
        else if constexpr (SC == kF32Dm)
          acc[m][b] = _mm512_fmadd_ps(d[b], t, _mm512_fmadd_ps(off[b], xs, acc[m][b]));
        else
          acc[m][b] = _mm512_fmadd_ps(off[b], xs, _mm512_fmadd_ps(d[b], t, acc[m][b]));
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < 2; ++b) _mm512_storeu_ps(sums + m * kSumsRow + b * kBlock, acc[m][b]);
}

#elif defined(PAGODA_AVX2)

// The AVX2 build multiplies the same panels on vpmaddubsw, as llama.cpp's AVX2 Q4_0 dot products
// do: u8 codes times s8 x codes, adjacent products summed into int16 (a step's 4 k's give each
// column two words of at most 2 * 15 * 127, so 8 steps, 32 k's, add up exactly in int16), then
// vpmaddwd by ones moves a column's two words into its int32 lane. A step's 64 bytes are two
// 32-byte halves, each the codes of 8 columns (low nibbles) and of the 8 columns 16 on (high).
// Group sums are then scaled as on AVX-512 (same operations, same order: the same fp32 sums).
// NOTE: 3 rows a pass (3 x 2 word sums + 2 code vectors + the raw codes + x + the mask): on Zen 3
// 1.1-1.2x faster than 2 from 16 rows, 4 no faster (docs/performance.md, "AVX2 int4").
constexpr int kInt4Avx2Rows = 3;
constexpr int kInt4Avx2Cols[4] = {0, kBlock, 8, kBlock + 8};  // each code vector's first column

// R rows (at most kInt4Avx2Rows) x one int4 panel over k-pairs [p0, p1), whole groups; adds into sums.
template <int R, bool PF>
void int4_rows_avx2(const Int4Rows& x, int64_t group_pairs, const uint8_t* w, const uint16_t* dm, int64_t p0,
                    int64_t p1, Sums sums) {
  constexpr int64_t kExactPairs = 16;  // k-pairs whose words add up exactly in int16
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  int64_t g = p0 / group_pairs;
  for (int64_t g0 = p0; g0 < p1; g0 += group_pairs, ++g) {
    __m256i part[R][4];
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < 4; ++j) part[m][j] = _mm256_setzero_si256();
    // NOTE: one 32-byte half of the steps at a time (the second re-read from L1), so that the
    // word sums stay in registers: both halves at once left two of 8 on the stack, a
    // store-to-load chain a step.
    for (int h = 0; h < 2; ++h)
      for (int64_t s0 = g0; s0 < g0 + group_pairs; s0 += kExactPairs) {
        __m256i words[R][2];
        for (int m = 0; m < R; ++m) words[m][0] = words[m][1] = _mm256_setzero_si256();
        for (int64_t p = s0; p < std::min(g0 + group_pairs, s0 + kExactPairs); p += 2) {
          const uint8_t* src = w + p * kInt4PairBytes + 32 * h;
          if constexpr (PF)
            if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * kInt4PairBytes), _MM_HINT_T1);
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
          const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
#pragma GCC unroll 4
          for (int m = 0; m < R; ++m) {
            const __m256i xv = _mm256_set1_epi32(x.quad(m, p));
            words[m][0] = _mm256_add_epi16(words[m][0], _mm256_maddubs_epi16(lo, xv));
            words[m][1] = _mm256_add_epi16(words[m][1], _mm256_maddubs_epi16(hi, xv));
          }
        }
        for (int m = 0; m < R; ++m)
          for (int e = 0; e < 2; ++e)
            part[m][2 * h + e] = _mm256_add_epi32(part[m][2 * h + e], _mm256_madd_epi16(words[m][e], ones));
      }
    const uint16_t* s = dm + g * 2 * kPanel;
    __m256 d[4], off[4];
    for (int j = 0; j < 4; ++j) {
      d[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + kInt4Avx2Cols[j])));
      off[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + kPanel + kInt4Avx2Cols[j])));
    }
    for (int m = 0; m < R; ++m) {
      const __m256 scale = _mm256_set1_ps(x.dx[m * x.G + g]), xs = _mm256_set1_ps(x.sx[m * x.G + g]);
      for (int j = 0; j < 4; ++j) {
        float* out = sums + m * kSumsRow + kInt4Avx2Cols[j];
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(part[m][j]), scale);
        _mm256_storeu_ps(out, _mm256_fmadd_ps(off[j], xs, _mm256_fmadd_ps(d[j], t, _mm256_loadu_ps(out))));
      }
    }
  }
}

// Rows [0, MR) x one int4 panel, kInt4Avx2Rows rows at a time (the first pass prefetches).
template <int MR, bool PF, int HB, int SC>
void int4_tile(const Int4Rows& x, int64_t group_pairs, const uint8_t* w, const uint8_t*, const uint8_t* scales,
               int64_t p0, int64_t p1, bool first, Sums sums) {
  static_assert(HB == kNibbles && SC == kF16Dm, "int5 panels: the VNNI build only");
  const auto* dm = reinterpret_cast<const uint16_t*>(scales);
  if (first)
    for (int m = 0; m < MR; ++m) std::fill(sums + m * kSumsRow, sums + m * kSumsRow + kPanel, 0.f);
  using Pass = void (*)(const Int4Rows&, int64_t, const uint8_t*, const uint16_t*, int64_t, int64_t, Sums);
  constexpr Pass kPasses[2][kInt4Avx2Rows] = {
      {int4_rows_avx2<1, false>, int4_rows_avx2<2, false>, int4_rows_avx2<3, false>},
      {int4_rows_avx2<1, PF>, int4_rows_avx2<2, PF>, int4_rows_avx2<3, PF>}};
  for (int m0 = 0; m0 < MR;) {
    const int rows = std::min(kInt4Avx2Rows, MR - m0);
    kPasses[m0 == 0][rows - 1](x.from(m0), group_pairs, w, dm, p0, p1, sums + m0 * kSumsRow);
    m0 += rows;
  }
}

#else

template <int MR, bool PF, int HB, int SC>
void int4_tile(const Int4Rows& x, int64_t group_pairs, const uint8_t* w, const uint8_t*, const uint8_t* scales,
               int64_t p0, int64_t p1, bool first, Sums sums) {
  static_assert(HB == kNibbles && SC == kF16Dm, "int5 panels: the VNNI build only");
  const auto* dm = reinterpret_cast<const uint16_t*>(scales);
  if (first)
    for (int m = 0; m < MR; ++m) std::fill(sums + m * kSumsRow, sums + m * kSumsRow + kPanel, 0.f);
  for (int64_t g0 = p0; g0 < p1; g0 += group_pairs) {
    const int64_t g = g0 / group_pairs;
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < kPanel; ++c) {
        int32_t part = 0;
        for (int64_t p = g0; p < g0 + group_pairs; ++p) {
          for (int e = 0; e < 2; ++e) {
            const uint8_t b8 = w[(p & ~int64_t{1}) * kInt4PairBytes + ((c % kBlock) * 2 + e) * 2 + (p & 1)];
            const int q = c < kBlock ? (b8 & 15) : (b8 >> 4);
            const int64_t k = 2 * p + e;
            part += q * x.xq[m * x.K + (k & ~int64_t{3}) + kInt4Order[k & 3]];
          }
        }
        const float d = f16_from_bits(dm[g * 2 * kPanel + c]), mm = f16_from_bits(dm[g * 2 * kPanel + kPanel + c]);
        sums[m * kSumsRow + c] += d * (static_cast<float>(part) * x.dx[m * x.G + g]) + mm * x.sx[m * x.G + g];
      }
  }
}

#endif

using Int4TileFn = void (*)(const Int4Rows&, int64_t, const uint8_t*, const uint8_t*, const uint8_t*, int64_t,
                            int64_t, bool, Sums);

template <bool PF, int HB, int SC, int... I>
constexpr std::array<Int4TileFn, kInt4TileRows> make_int4_tiles(std::integer_sequence<int, I...>) {
  return {int4_tile<I + 1, PF, HB, SC>...};
}
template <int HB, int SC>
constexpr std::array<std::array<Int4TileFn, kInt4TileRows>, 2> kInt4Tiles{
    make_int4_tiles<false, HB, SC>(std::make_integer_sequence<int, kInt4TileRows>()),
    make_int4_tiles<true, HB, SC>(std::make_integer_sequence<int, kInt4TileRows>())};

// Whether this build takes int5 panels (kPackedInt5): the VNNI one.
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
constexpr bool kInt5Panels = true;
#else
constexpr bool kInt5Panels = false;
void expand_int5(const uint8_t*, const uint8_t*, int64_t, int64_t, uint8_t*) { std::abort(); }
#endif

// How an int4-layout weight scales its columns (Int4Scales).
inline int int4_scales(const GemmWeight& w) {
  return w.kind == kPackedInt5 ? kF16Sym : w.kind == kPackedInt5F32 ? kF32Dm : kF16Dm;
}

// An int5 weight's plane of fifth bits (after every panel's nibbles), or null for int4.
inline const uint8_t* int5_high(const GemmWeight& w) {
  if (w.kind != kPackedInt5 && w.kind != kPackedInt5F32) return nullptr;
  const int64_t panels = (w.n + kPanel - 1) / kPanel;
  return static_cast<const uint8_t*>(w.data) + panels * kInt4PairBytes * (w.k / 2);
}

// All M rows over int4 panel `index`: each chunk of K (whole groups) by every tile in turn, the
// chunk's codes L1-resident after the first.
void int4_panel(const Problem& P, const Int4Problem& Q, const Tiling& tiling, int64_t index, float* sums) {
  const int64_t pairs = P.K / 2, c0 = index * kPanel;
  const uint8_t* w = Q.codes + index * kInt4PairBytes * pairs;
  const uint8_t* hb = Q.high == nullptr ? nullptr : Q.high + index * (pairs / 2) * kInt5HighBytes;
  const uint8_t* dm = static_cast<const uint8_t*>(Q.scales) + index * Q.x.G * int4_group_bytes(Q.scale_kind);
  const bool single = tiling.count == 1;
  const int64_t chunk = single ? pairs : std::max<int64_t>(kChunkPairs, Q.group_pairs);
  // NOTE: int5 over several tiles: each chunk's codes expanded to bytes once (expand_int5), so
  // that the tiles read them as they are instead of each adding the fifth bits again
  const bool expand = kInt5Panels && hb != nullptr && !single;
  // NOTE: the builds without int5 panels name only int4's tiles here (kInt5Panels false)
  constexpr int kBits = kInt5Panels ? kInt5Bits : kNibbles, kBytes = kInt5Panels ? kInt5Bytes : kNibbles;
  constexpr int kSym = kInt5Panels ? kF16Sym : kF16Dm, kF32 = kInt5Panels ? kF32Dm : kF16Dm;
  const bool f32 = Q.scale_kind == kF32Dm;
  const auto& tiles = !kInt5Panels || hb == nullptr ? kInt4Tiles<kNibbles, kF16Dm>
                      : expand ? (f32 ? kInt4Tiles<kBytes, kF32> : kInt4Tiles<kBytes, kSym>)
                               : (f32 ? kInt4Tiles<kBits, kF32> : kInt4Tiles<kBits, kSym>);
  thread_local std::vector<uint8_t> bytes;
  if (expand) bytes.resize((chunk / 2) * kInt5StepBytes);
  for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
    const int64_t p1 = std::min(pairs, p0 + chunk);
    if (expand) expand_int5(w, hb, p0, p1, bytes.data());
    for (int t = 0; t < tiling.count; ++t) {
      // NOTE: the first tile over a chunk prefetches, and so does a single tile of any size:
      // unlike bf16's one-row tile, the integer tiles read memory 6-10% faster with it at one
      // row (docs/performance.md, Integer dot products).
      const bool prefetch = (single || t == 0) && !expand;
      tiles[prefetch][tiling.rows(t) - 1](Q.x.from(tiling.start[t]), Q.group_pairs, expand ? bytes.data() : w, hb,
                                          dm, p0, p1, p0 == 0, sums + tiling.start[t] * kSumsRow);
    }
  }
  for (int t = 0; t < tiling.count; ++t)
    emit(P, sums + tiling.start[t] * kSumsRow, tiling.start[t], tiling.rows(t), c0, kPanel);
}

void int4_pass(const Problem& P, const Int4Problem& Q) {
  const int64_t panels = padded_cols(P.N) / kPanel;
  const Tiling tiling(P.M, kInt4TileRows);
  parallel_ranges(panels, 1, [&](int64_t i0, int64_t i1) {
    static thread_local std::vector<float> sums;
    sums.resize(P.M * kSumsRow);
    for (int64_t i = i0; i < i1; ++i) int4_panel(P, Q, tiling, i, sums.data());
  });
}

// Each pass of up to kMaxRowsPerPass rows through `run_pass`.
template <class RunPass>
void all_passes(const bf16* x, int64_t xs, const float* scales, const bf16* bias, bf16* y, int64_t ys, int64_t M,
                int64_t N, int64_t K, RunPass run_pass) {
  if (N <= 0) return;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsPerPass)
    run_pass(Problem{x + m0 * xs, xs, scales, bias, y + m0 * ys, ys, std::min(kMaxRowsPerPass, M - m0), N, K});
}

#if defined(PAGODA_VNNI) && defined(__x86_64__)
// ---------------------------------------------------------------- bf16 on AMX tiles
//
// CPUs with AMX (Sapphire Rapids and later) multiply the same bf16 panels on their tile units:
// a B tile is 16 k-pairs of one 16-column block (the panel's k-pair rows, 128 bytes apart: the
// layout above is already the pairs-interleaved one tdpbf16ps takes), an A tile 16 rows of x over
// those 32 k's, read in place. A block of up to 32 rows x one panel keeps its 2 x 2 sums tiles
// (16 x 16 fp32 each) through all of K, then leaves them in the sums buffer for `emit`. Threads
// split the panels; within a panel the row blocks follow one another, so a panel read from
// memory once serves every row (it stays in L2). Compiled for the AMX instructions function by
// function (the build's flags stay AVX-512's) and run only where the CPU has AMX-BF16 and Linux
// grants the tile data (`amx_usable`), from the row count measured at load
// (`pagoda_gemm_set_amx_rows`). K a multiple of 32 (every model seen; others keep the vector tiles).

constexpr int kAmxPairs = 16;      // k-pairs per tile step: a B tile's 16 rows
constexpr int kAmxBlockRows = 32;  // rows per block: two A tiles
// NOTE: rows a pass: each pass reads every panel once. 256 when a 512-row pass lost 1.6x to two
// of 256 (an earlier kernel, docs/performance.md "A fifth CPU"); since panels stay in L1 for a
// pass's blocks and the next one is prefetched, 512 rows read the weights half as often and win
// even where x's rows outgrow L2 ("Prefill: the softmax's exp2 ...").
constexpr int64_t kAmxPassRows = 512;
std::atomic<int64_t> g_amx_rows{int64_t{1} << 62};
std::atomic<int64_t> g_amx_int8_rows{int64_t{1} << 62};  // likewise for int8 panels (`AmxInt8`)
std::atomic<int64_t> g_amx_int4_rows{int64_t{1} << 62};  // and int4 panels (`AmxInt4`)

// Tiles 0-3: sums of row tile a (0, 1) x block b (0, 1) at 2a + b; 4, 5: x's row tiles; 6, 7: the
// panel's blocks. rows1 == 0 leaves row tile 1 unconfigured.
void configure_tiles(int rows0, int rows1) {
  TileConfig c;
  const int rows[2] = {rows0, rows1};
  for (int a = 0; a < 2; ++a) {
    for (int t : {2 * a, 2 * a + 1, 4 + a}) c.set(t, rows[a], rows[a] ? 64 : 0);
    c.set(6 + a, kAmxPairs, 64);
  }
  load_tile_config(c);
}

// A finished block's epilogue (`emit`, or `emit_gated` of its gate and up sums), run a few rows
// at a time while the next block's tiles multiply: the vector units idle while tdpbf16ps runs
// (16 cycles each), and the epilogue was ~10% of a prefill run after its block.
struct Epilogue {
  const Problem* P = nullptr;
  const float* sums = nullptr;  // [rows, kSumsRow]; gated: the gate panel's
  const float* up = nullptr;    // gated: the up panel's
  int64_t m0 = 0, c0 = 0;
  int rows = 0, done = 0, per_step = 0;

  void run(int count) {
    const int end = std::min(rows, done + count);
    if (end <= done) return;
    const int64_t at = int64_t{done} * kSumsRow;
    if (P->gated == kSiluGate)
      emit_gated<kSiluGate>(*P, sums + at, up + at, m0 + done, end - done, c0);
    else if (P->gated == kGeluTanhGate)
      emit_gated<kGeluTanhGate>(*P, sums + at, up + at, m0 + done, end - done, c0);
    else
      emit(*P, sums + at, m0 + done, end - done, c0, kPanel);
    done = end;
  }
  void step() { run(per_step); }
  void finish() { run(rows); }
};

// The memory the next panel(s) read, prefetched into L2 a few lines at each k-step of this
// panel's blocks: a pass's first block reads a panel from memory once and the rest from cache,
// a burst that the hardware's prefetchers do not run ahead of (SmolLM2's 30 layers of linears at
// 512 rows: 8.7 ms a pass slower than one layer's weights kept in cache, gemm_layers.py).
// NOTE: from 4 blocks a pass; with 2 (64 rows) the panels stream without a pause and the
// prefetches only took issue slots (5% slower).
constexpr int64_t kPrefetchBlocks = 4;
struct PanelPrefetch {
  static constexpr int kMaxRanges = 4;  // a gated pass's two parts, int5's two streams each
  const char* at[kMaxRanges] = {};
  int64_t lines[kMaxRanges] = {};
  int ranges = 0, per_step = 0;

  void add(const void* p, int64_t bytes) {
    at[ranges] = static_cast<const char*>(p);
    lines[ranges++] = (bytes + 63) / 64;
  }
  // Spreads the ranges' lines over `steps` calls of step().
  void spread(int64_t steps) {
    int64_t total = 0;
    for (int r = 0; r < ranges; ++r) total += lines[r];
    per_step = static_cast<int>((total + steps - 1) / std::max<int64_t>(steps, 1));
  }
  void step() {
    for (int k = 0, r = 0; k < per_step && r < ranges; ++k) {
      while (r < ranges && lines[r] == 0) ++r;
      if (r == ranges) return;
      _mm_prefetch(at[r], _MM_HINT_T1);
      at[r] += 64;
      --lines[r];
    }
  }
};

// x's rows [0, 16 or 32) (stride xs elements) x one panel over all k-pairs, `step_at(p)` giving
// its k-pairs [p, p + 16) (rows kPanelPair elements apart); the sums at sums[m * kSumsRow + c].
// Each k-step also runs a step of the previous block's epilogue (`pending`, other sums) and of
// the next panel's prefetch (`ahead`).
template <bool kTwoRowTiles, class StepAt>
__attribute__((target("amx-tile,amx-bf16"))) void amx_block(const bf16* x, int64_t xs, const StepAt& step_at,
                                                            int64_t pairs, float* sums, Epilogue& pending,
                                                            PanelPrefetch& ahead) {
  constexpr int64_t kPairBytes = kPanelPair * 2;
  const int64_t x_bytes = xs * 2;
  tile_sources_written();  // x
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwoRowTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t p = 0; p < pairs; p += kAmxPairs) {
    const bf16* wp = step_at(p);
    tile_sources_written();  // a step just widened
    _tile_loadd(6, wp, kPairBytes);
    _tile_loadd(7, wp + 2 * kBlock, kPairBytes);
    _tile_loadd(4, x + 2 * p, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(5, x + 16 * xs + 2 * p, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    pending.step();
    ahead.step();
  }
  constexpr int64_t kSumsBytes = kSumsRow * 4;
  _tile_stored(0, sums, kSumsBytes);
  _tile_stored(1, sums + kBlock, kSumsBytes);
  if constexpr (kTwoRowTiles) {
    _tile_stored(2, sums + 16 * kSumsRow, kSumsBytes);
    _tile_stored(3, sums + 16 * kSumsRow + kBlock, kSumsBytes);
  }
}

// Where the AMX blocks read panels in the bf16 layout: `panel(i, slot)` all of panel i (valid
// until the thread's next call with that slot, 0 or 1), `step(i, p)` its k-pairs [p, p + 16)
// (until the next call). bf16 panels in place.
struct AmxBf16 {
  const bf16* packed;
  int64_t panel_size;
  const bf16* panel(int64_t i, int /*slot*/) const { return packed + i * panel_size; }
  const bf16* step(int64_t i, int64_t p) const { return panel(i, 0) + p * kPanelPair; }
  // What panel i reads from memory (PanelPrefetch).
  void source_of(int64_t i, PanelPrefetch& ahead) const { ahead.add(panel(i, 0), panel_size * 2); }
};

// Rows [0, P.M) (at most kAmxPassRows) x every panel of `source`: one block of rows reads each
// panel a step at a time (a source that widens integer codes widens just that step, into L1),
// more blocks read it whole (widened once into L2 for all of them).
// A gated problem (P.gated) pairs gate panel i with up panel i + N / 2 / kPanel: both blocks'
// sums, then `emit_gated`.
template <class Source>
void amx_pass(const Problem& P, const Source& source) {
  const int64_t pairs = num_pairs(P.K);
  const int parts = P.gated ? 2 : 1;
  const int64_t panels = P.gated ? P.N / 2 / kPanel : padded_cols(P.N) / kPanel;
  const bool stepwise = P.M <= kAmxBlockRows;
  const int64_t steps = parts * (pairs / kAmxPairs);  // k-steps a block (all its parts)
  const int64_t blocks = (P.M + kAmxBlockRows - 1) / kAmxBlockRows;
  parallel_ranges(panels, 1, [&](int64_t i0, int64_t i1) {
    // NOTE: [buffer][part]: a block's sums, and the previous block's, whose epilogue is pending.
    alignas(64) static thread_local float sums[2][2][kAmxBlockRows * kSumsRow];
    int configured = 0;  // rows the tiles are configured for (ldtilecfg per call: other code shares the thread)
    int buffer = 0;
    Epilogue pending;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t index[2] = {i, i + panels};
      const bf16* w[2] = {};
      for (int part = 0; part < parts && !stepwise; ++part) w[part] = source.panel(index[part], part);
      PanelPrefetch ahead;
      if (blocks >= kPrefetchBlocks && i + 1 < i1) {
        for (int part = 0; part < parts; ++part) source.source_of(index[part] + 1, ahead);
        ahead.spread(blocks * steps);
      }
      for (int64_t m0 = 0; m0 < P.M; m0 += kAmxBlockRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kAmxBlockRows, P.M - m0));
        if (rows != configured) configure_tiles(std::min(rows, 16), std::max(rows - 16, 0));
        configured = rows;
        float* block[2] = {sums[buffer][0], sums[buffer][1]};
        for (int part = 0; part < parts; ++part) {
          const auto step_at = [&](int64_t p) {
            return stepwise ? source.step(index[part], p) : w[part] + p * kPanelPair;
          };
          if (rows > 16)
            amx_block<true>(P.x + m0 * P.xs, P.xs, step_at, pairs, block[part], pending, ahead);
          else
            amx_block<false>(P.x + m0 * P.xs, P.xs, step_at, pairs, block[part], pending, ahead);
        }
        pending.finish();
        const int per_step = static_cast<int>((rows + steps - 1) / steps);
        pending = Epilogue{&P, block[0], block[1], m0, i * kPanel, rows, 0, per_step};
        buffer ^= 1;
      }
    }
    pending.finish();
    release_tiles();
  });
}

// P's rows in passes of at most kAmxPassRows.
template <class Source>
void amx_passes(const Problem& P, const Source& source) {
  for (int64_t m0 = 0; m0 < P.M; m0 += kAmxPassRows) {
    Problem part = P;
    part.x += m0 * P.xs;
    part.y += m0 * P.ys;
    part.M = std::min(kAmxPassRows, P.M - m0);
    amx_pass(part, source);
  }
}

// Index vectors of a zero-masked vpermb (kLowBytes) that leaves in dword j of vector [h][half]
// the source byte byte_of(h, half, j), zero-extended: how the widening reads codes.
using LowByteIndex = std::array<std::array<std::array<uint8_t, 64>, 2>, 2>;
constexpr __mmask64 kLowBytes = 0x1111111111111111ull;

template <class ByteOf>
LowByteIndex low_byte_index(ByteOf byte_of) {
  LowByteIndex t{};
  for (int h = 0; h < 2; ++h)
    for (int half = 0; half < 2; ++half)
      for (int j = 0; j < 16; ++j) t[h][half][4 * j] = static_cast<uint8_t>(byte_of(h, half, j));
  return t;
}

// A thread's widened bf16 panel (two: a gated product's gate and up panels), or step (16 k-pairs).
inline bf16* widened_panel(int64_t pairs, int slot) {
  static thread_local std::vector<bf16> panel[2];
  panel[slot].resize(pairs * kPanelPair);
  return panel[slot].data();
}

inline bf16* widened_step() {
  alignas(64) static thread_local bf16 step[kAmxPairs * kPanelPair];
  return step;
}

// Whether this CPU has AMX-BF16 and Linux lets this process use the tile data (asked once).
bool amx_usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
    if ((d & (kAmxBf16 | kAmxTile)) != (kAmxBf16 | kAmxTile)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

bool takes_amx(const Problem& P, const std::atomic<int64_t>& from_rows = g_amx_rows) {
  return P.M >= from_rows.load(std::memory_order_relaxed) && P.K % (2 * kAmxPairs) == 0 && amx_usable();
}
#endif

void gemm(const bf16* x, int64_t xs, const bf16* packed, const bf16* bias, bf16* y, int64_t ys, int64_t M, int64_t N,
          int64_t K) {
  all_passes(x, xs, nullptr, bias, y, ys, M, N, K, [&](const Problem& P) {
#if defined(PAGODA_VNNI) && defined(__x86_64__)
    if (takes_amx(P)) {
      amx_passes(P, AmxBf16{packed, kPanel * 2 * num_pairs(P.K)});
      return;
    }
#endif
    gemm_pass(P, [&](bf16*) { return Bf16Panels{packed, num_pairs(K)}; });
  });
}

#if defined(PAGODA_VNNI) && defined(__x86_64__)
// Index vectors of a vpermps that give dword j of half `half` of a widened block (column
// 8 * half + j / 2, element j % 2) its column's value from a vector of the block's 16 columns.
using ColumnSpread = std::array<std::array<int32_t, 16>, 2>;
inline const ColumnSpread& column_spread() {
  alignas(64) static const ColumnSpread spread = [] {
    ColumnSpread t{};
    for (int half = 0; half < 2; ++half)
      for (int j = 0; j < 16; ++j) t[half][j] = 8 * half + j / 2;
    return t;
  }();
  return spread;
}

// int4 panels on AMX, as int8's (`AmxInt8`): a panel widened to bf16, w = q * d + m per
// group in fp32 (one FMA) rounded to bf16, and the bf16 tile blocks multiply x as it is (not
// rounded to int8 codes). Source: two k-pairs p, p + 1 (p even) in 64 bytes, 32-bit lane c
// holding block 0's column c in its bytes' low nibbles and block 1's in the high ones, for k =
// 2p, 2p + 2, 2p + 1, 2p + 3 (see the top of this file). Writes k-pairs [p0, p1) of the panel at
// `codes` (scales `dm`) to out[(p - p0) * kPanelPair ...].
// int5 panels (`high`: the fifth bits' plane, see add_fifth_bits) add 16 to a code whose bit is set.
__attribute__((target("avx512vbmi"))) void widen_int4_pairs(const uint8_t* codes, const uint8_t* high,
                                                           const uint8_t* scales, int sc, int64_t p0, int64_t p1,
                                                           int64_t group_pairs, bf16* out) {
  // NOTE: dword j of a half (column 8 * half + j / 2, element j % 2) of k-pair p + h takes byte
  // 4 (j / 2) + 2 (j % 2) + h + 32 half; `spread` repeats a column's d or m for its two elements.
  alignas(64) static const LowByteIndex idx =
      low_byte_index([](int h, int half, int j) { return 4 * (j / 2) + 2 * (j % 2) + h + 32 * half; });
  const ColumnSpread& spread = column_spread();
  const __m512i low = _mm512_set1_epi8(0x0F);
  // NOTE: groups hold an even count of k-pairs (gs a multiple of 16), so pairs of k-pairs never straddle two.
  for (int64_t g0 = p0; g0 < p1;) {
    const int64_t g = g0 / group_pairs, g1 = std::min(p1, (g + 1) * group_pairs);
    const uint8_t* at = scales + g * int4_group_bytes(sc);
    const auto* s = reinterpret_cast<const uint16_t*>(at);
    const auto* f = reinterpret_cast<const float*>(at);
    __m512 d[2][2], m[2][2];  // [block][half]
    for (int b = 0; b < 2; ++b) {
      const __m512 db = sc == kF32Dm ? _mm512_loadu_ps(f + b * kBlock)
                                     : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b * kBlock)));
      const __m512 mb =
          sc == kF16Sym  ? _mm512_mul_ps(db, _mm512_set1_ps(-16.f))  // NOTE: Q5_0's m = -16 d (exact), not stored
          : sc == kF32Dm ? _mm512_loadu_ps(f + kPanel + b * kBlock)
                         : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kPanel + b * kBlock)));
      for (int half = 0; half < 2; ++half) {
        const __m512i at = _mm512_load_si512(spread[half].data());
        d[b][half] = _mm512_permutexvar_ps(at, db);
        m[b][half] = _mm512_permutexvar_ps(at, mb);
      }
    }
    for (int64_t p = g0; p < g1; p += 2) {
      const __m512i raw = _mm512_loadu_si512(codes + p * kInt4PairBytes);
      __m512i v[2] = {_mm512_and_si512(raw, low), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low)};
      if (high != nullptr) add_fifth_bits(high, p, false, v[0], v[1]);
      for (int b = 0; b < 2; ++b) {
        for (int h = 0; h < 2; ++h) {
          __m512 w[2];
          for (int half = 0; half < 2; ++half) {
            const __m512i q = _mm512_maskz_permutexvar_epi8(kLowBytes, _mm512_load_si512(idx[h][half].data()), v[b]);
            w[half] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d[b][half], m[b][half]);
          }
          const __m512bh pair = _mm512_cvtne2ps_pbh(w[1], w[0]);
          _mm512_storeu_si512(out + (p - p0 + h) * kPanelPair + b * 2 * kBlock, reinterpret_cast<const __m512i&>(pair));
        }
      }
    }
    g0 = g1;
  }
}

// int4 (and int5: `high`, the fifth bits' plane) panels for the AMX blocks (gs / 2 k-pairs a group).
struct AmxInt4 {
  const uint8_t* codes;
  const void* scales;
  int64_t pairs, group_pairs;
  const uint8_t* high = nullptr;
  int scale_kind = kF16Dm;
  const uint8_t* codes_of(int64_t i) const { return codes + i * kInt4PairBytes * pairs; }
  const uint8_t* high_of(int64_t i) const {
    return high == nullptr ? nullptr : high + i * (pairs / 2) * kInt5HighBytes;
  }
  void source_of(int64_t i, PanelPrefetch& ahead) const {
    ahead.add(codes_of(i), kInt4PairBytes * pairs);
    if (high != nullptr) ahead.add(high_of(i), (pairs / 2) * kInt5HighBytes);
  }
  const uint8_t* scales_of(int64_t i) const {
    return static_cast<const uint8_t*>(scales) + i * (pairs / group_pairs) * int4_group_bytes(scale_kind);
  }
  const bf16* panel(int64_t i, int slot) const {
    bf16* out = widened_panel(pairs, slot);
    widen_int4_pairs(codes_of(i), high_of(i), scales_of(i), scale_kind, 0, pairs, group_pairs, out);
    return out;
  }
  const bf16* step(int64_t i, int64_t p) const {
    bf16* out = widened_step();
    widen_int4_pairs(codes_of(i), high_of(i), scales_of(i), scale_kind, p, p + kAmxPairs, group_pairs, out);
    return out;
  }
};
#endif

// K a multiple of gs, gs a multiple of 16. x is quantized once per call (quantize_row), the
// rows split over the threads.
void qgemm_int4(const bf16* x, int64_t xs, const uint8_t* codes, const uint8_t* high, const void* scales,
                int scale_kind, int64_t gs, const bf16* bias, bf16* y, int64_t ys, int64_t M, int64_t N, int64_t K) {
  const int64_t G = K / gs;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dx, sx;
  thread_local std::vector<int32_t> total;
  all_passes(x, xs, nullptr, bias, y, ys, M, N, K, [&](const Problem& P) {
#if defined(PAGODA_VNNI) && defined(__x86_64__)
    if (takes_amx(P, g_amx_int4_rows)) {
      amx_passes(P, AmxInt4{codes, scales, P.K / 2, gs / 2, high, scale_kind});
      return;
    }
#endif
    xq.resize(P.M * K);
    dx.resize(P.M * G);
    sx.resize(P.M * G);
    total.resize(P.M * G);
    const Int4Rows rows{xq.data(), dx.data(), sx.data(), total.data(), K, G};
    parallel_ranges(P.M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) quantize_row(P.x + m * P.xs, gs, rows.from(m));
    }, P.M * K >= (1 << 14) ? 1 << 30 : 1);
    int4_pass(P, Int4Problem{codes, scales, rows, gs / 2, high, scale_kind});
  });
}

// ---------------------------------------------------------------- int8 scales (every build)
constexpr int kInt8Group = 32;  // x's rounding group along K (8 quads), but fp32 group scales'

// How an int8 panel's columns are scaled (a template argument of the tiles): per column after
// the sums (`emit`), or per group along K: f16 scales d by groups of 32 (GGUF's Q8_0 and Q5_0),
// or fp32 scales d by groups of 16 or 32, with fp32 offsets m (w = q * d + m) or without (the
// AVX2 and VNNI builds: GGUF's Q6_K, Q5_K, Q5_1 and the layers whose sources mix kinds). Per panel
// and group, fp32 d holds its 32 columns, then (with offsets) m its 32.
// The AVX2 build also takes f16 groups of narrow codes (kF16GroupsNarrow: GGUF's Q5_0, codes in
// [-16, 15]), stored + 32 like the fp32 kinds' (`narrow_quads`).
// The AVX2 build's fp32 kinds are narrow; kF32GroupsWide and kF32GroupsOffsetsWide are its wide
// ones (a layer mixing Q8_0 with offset kinds), which the VNNI build's plain fp32 kinds are.
enum Int8Scales : int {
  kColumnScales = 0, kF16Groups = 1, kF32Groups = 2, kF32GroupsOffsets = 3, kF16GroupsNarrow = 4,
  kF32GroupsWide = 5, kF32GroupsOffsetsWide = 6
};

// Floats of group values per panel and group (fp32 kinds).
constexpr bool has_offsets(int S) { return S == kF32GroupsOffsets || S == kF32GroupsOffsetsWide; }
constexpr int64_t group_floats(int S) { return has_offsets(S) ? 2 * kPanel : kPanel; }
constexpr bool is_f32_groups(int S) {
  return S == kF32Groups || S == kF32GroupsOffsets || S == kF32GroupsWide || S == kF32GroupsOffsetsWide;
}
constexpr bool is_f16_groups(int S) { return S == kF16Groups || S == kF16GroupsNarrow; }
// Whether the codes are narrow, stored + 32 (else + 128): the AVX2 build's fp32-group kinds (its
// vpmaddubsw sums them in int16) and f16 kind for Q5_0. vpdpbusd's int32 sums take any code, so
// the VNNI build stores every kind + 128, and its fp32 groups take wide codes too (a layer mixing
// Q8_0 with offset kinds: Q5_K_M's qkv).
#if defined(PAGODA_AVX2)
constexpr bool is_narrow(int S) { return S == kF32Groups || S == kF32GroupsOffsets || S == kF16GroupsNarrow; }
#else
constexpr bool is_narrow(int S) { return S == kF16GroupsNarrow; }
#endif

// The scale kinds this build's tiles take: fp32 groups on the AVX2 and VNNI builds, f16 groups of
// narrow codes and the wide fp32 kinds on the AVX2 build alone (vpdpbusd takes every code wide).
#if defined(PAGODA_AVX2)
constexpr int kInt8ScaleKinds = 7;
#elif defined(PAGODA_VNNI)
constexpr int kInt8ScaleKinds = 4;
#else
constexpr int kInt8ScaleKinds = 2;
#endif

// An int8 panel's group scales: `kind` (Int8Scales), `values` for all panels (null for per-column
// scales), x's rounding group along K.
struct Int8GroupScales {
  int kind;
  const void* values;
  int64_t group;
  // Panel `index`'s values (G groups along K).
  const void* of(int64_t index, int64_t G) const {
    if (is_f16_groups(kind)) return static_cast<const uint16_t*>(values) + index * G * kPanel;
    if (is_f32_groups(kind)) return static_cast<const float*>(values) + index * G * group_floats(kind);
    return nullptr;
  }
};

// An int8 panel weight's scales as qgemm_int8 takes them (`GemmWeight::kind`): per column
// (values null; the fp32 column scales are passed apart) or by groups.
Int8GroupScales int8_scales(const GemmWeight& w) {
  switch (w.kind) {
    case kPackedInt8Groups: return {kF16Groups, w.scales, kInt8Group};
    case kPackedInt8GroupsNarrow: return {kF16GroupsNarrow, w.scales, kInt8Group};
    case kPackedInt8F32Groups: return {kF32Groups, w.scales, w.group_size};
    case kPackedInt8F32GroupsOffsets: return {kF32GroupsOffsets, w.scales, w.group_size};
    case kPackedInt8F32GroupsWide: return {kF32GroupsWide, w.scales, w.group_size};
    case kPackedInt8F32GroupsOffsetsWide: return {kF32GroupsOffsetsWide, w.scales, w.group_size};
    default: return {kColumnScales, nullptr, kInt8Group};
  }
}

#if defined(PAGODA_INT8_QUADS)
// ---------------------------------------------------------------- int8 by quads of k (format 2)

constexpr int kQuadBytes = 4 * kPanel;  // a panel's quad of k: 32 columns x 4 codes
constexpr int kInt8TileRows = 6;        // 6 x 2 group sums + 6 x 2 fp32 sums + 2 code vectors + x
constexpr int64_t kChunkQuads = 64;     // 8 KB of a panel
constexpr int64_t kGroupQuads = kInt8Group / 4;

int64_t num_quads(int64_t K) { return (K + 3) / 4; }

// x as the int8 tiles read it, a row at a time: per group of `group` along K (32, or the
// weight's fp32 groups; the last one shorter), int8 codes xq (x * 127 / max |x| rounded to
// nearest even; zero past K), their step dx, -128 * sum xq (what the codes' + 128 adds to each
// group's integer sum on vpdpbusd) and sx = dx * sum xq (what an offset m multiplies).
struct Int8Rows {
  int8_t* xq;       // [rows, G * group]
  float* dx;        // [rows, G]
  int32_t* offset;  // [rows, G]
  float* sx;        // [rows, G]
  int64_t G;
  int64_t group;
  Int8Rows from(int64_t m) const { return {xq + m * G * group, dx + m * G, offset + m * G, sx + m * G, G, group}; }
  // Row m's 4 x codes of quad q, as the 32-bit lane the tiles broadcast.
  int32_t quad(int m, int64_t q) const {
    int32_t v;
    std::memcpy(&v, xq + m * G * group + 4 * q, sizeof(v));
    return v;
  }
};

void quantize_row_int8(const bf16* x, int64_t K, const Int8Rows& out) {
  for (int64_t g = 0; g < out.G; ++g) {
    const int64_t k0 = g * out.group, n = std::min<int64_t>(out.group, K - k0);
    Vf amax = vzero();
    for (int64_t i = 0; i < n; i += kBlock) {
      const Vf v = load(x + k0 + i, tail_mask(static_cast<int>(n - i)));
      amax = vmax(amax, vmax(v, vzero() - v));
    }
    const float a = reduce_max(amax);
    const float inv = a > 0.f ? 127.f / a : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < out.group; i += kBlock) {
      const Mask mask = i < n ? tail_mask(static_cast<int>(n - i)) : Mask(0);
      sum += store_codes<false>(load(x + k0 + i, mask) * vset1(inv), out.xq + k0 + i);
    }
    out.dx[g] = a / 127.f;
    out.offset[g] = -128 * sum;
    out.sx[g] = out.dx[g] * static_cast<float>(sum);
  }
}

#if defined(PAGODA_VNNI)
// Rows [0, MR) x one int8 panel over quads [q0, q1) (q0 a group's first); adds into `sums`
// (from zero when `first`). Each group: integer sums of (q + 128) * xq in registers, started at
// -128 * sum xq (narrow codes: (q + 32) * xq from -32 * sum xq), then sums += dx * that, or with
// the weight's group scales d (f16 [G][32]; fp32 by x's groups of 16 or 32, [G][d, m][32])
// sums += d * (dx * that), after sums += m * sx where there are offsets: the AVX2 build's fp32
// operations in its order; per-column scales wait for `emit`.
template <int MR, bool PF, int S>
void int8_tile(const Int8Rows& x, const uint8_t* w, const void* scales, int64_t q0, int64_t q1, bool first,
               Sums sums) {
  static_assert(S != kF16GroupsNarrow, "vpdpbusd takes Q5_0's codes wide (kF16Groups)");
  const int64_t group_quads = is_f32_groups(S) ? x.group / 4 : kGroupQuads;
  __m512 acc[MR][2];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < 2; ++b) acc[m][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + m * kSumsRow + b * kBlock);
  for (int64_t g0 = q0; g0 < q1; g0 += group_quads) {
    const int64_t g = g0 / group_quads, end = std::min(q1, g0 + group_quads);
    __m512i part[MR][2];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
      part[m][0] = part[m][1] = _mm512_set1_epi32(is_narrow(S) ? x.offset[m * x.G + g] / 4 : x.offset[m * x.G + g]);
    for (int64_t q = g0; q < end; ++q) {
      const uint8_t* src = w + q * kQuadBytes;
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(src + kChunkQuads * kQuadBytes), _MM_HINT_T1);
      const __m512i v0 = _mm512_loadu_si512(src), v1 = _mm512_loadu_si512(src + 4 * kBlock);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = _mm512_set1_epi32(x.quad(m, q));
        part[m][0] = _mm512_dpbusd_epi32(part[m][0], v0, xv);
        part[m][1] = _mm512_dpbusd_epi32(part[m][1], v1, xv);
      }
    }
    if constexpr (S != kColumnScales) {  // as int4_tile: t = sum * dx, then sums += d * t
      __m512 dv[2], mv[2];
      for (int b = 0; b < 2; ++b) {
        if constexpr (is_f16_groups(S)) {
          const uint16_t* d = static_cast<const uint16_t*>(scales) + g * kPanel + b * kBlock;
          dv[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
        } else {
          const float* d = static_cast<const float*>(scales) + g * group_floats(S) + b * kBlock;
          dv[b] = _mm512_loadu_ps(d);
          if constexpr (has_offsets(S)) mv[b] = _mm512_loadu_ps(d + kPanel);
        }
      }
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const __m512 step = _mm512_set1_ps(x.dx[m * x.G + g]);
        for (int b = 0; b < 2; ++b) {
          if constexpr (has_offsets(S))
            acc[m][b] = _mm512_fmadd_ps(mv[b], _mm512_set1_ps(x.sx[m * x.G + g]), acc[m][b]);
          acc[m][b] = _mm512_fmadd_ps(dv[b], _mm512_mul_ps(_mm512_cvtepi32_ps(part[m][b]), step), acc[m][b]);
        }
      }
    } else {
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const __m512 step = _mm512_set1_ps(x.dx[m * x.G + g]);
        for (int b = 0; b < 2; ++b) acc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[m][b]), step, acc[m][b]);
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < 2; ++b) _mm512_storeu_ps(sums + m * kSumsRow + b * kBlock, acc[m][b]);
}

#else

// The AVX2 build multiplies the same panels on vpmaddubsw, which takes one u8 operand: as in
// llama.cpp's AVX2 Q8_0 dot products, but with the weight's sign moved onto x, so that the
// weight's work is shared by the rows: |q| (u8; q back from + 128 by an xor) times x's codes
// with q's sign (vpsignb), adjacent products summed into int16 (at most 2 * 127 * 127: exact),
// vpmaddwd by ones moves a column's two words into its int32 lane. These are the integer sums
// vpdpbusd's give after the -128 offset, and the group's scaling is the AVX-512 tile's
// operation: the same fp32 sums, bit for bit. The sums wait in L1 (`sums`) between groups.
// A 32-byte vector of a quad holds 8 columns x 4 k's.
#ifndef PAGODA_INT8_AVX2_ROWS
#define PAGODA_INT8_AVX2_ROWS 3
#endif
#ifndef PAGODA_INT8_AVX2_VECTORS
#define PAGODA_INT8_AVX2_VECTORS 2
#endif
constexpr int kInt8Avx2Rows = PAGODA_INT8_AVX2_ROWS;  // rows a pass
// A quad's vectors (of 4) an R-row pass. NOTE: one row takes all four at once: 1.24-1.25x two in
// cache, 1.05-1.09x streamed over SmolLM2's layers (docs/performance.md, "AVX2 int8").
template <int R>
constexpr int kInt8Avx2Vectors = R == 1 ? 4 : PAGODA_INT8_AVX2_VECTORS;

// Prefetches quad q's 64-byte lines of vectors [v0, v0 + V) a chunk ahead (each line once).
template <int V>
inline void prefetch_quad(const uint8_t* w, int64_t q, int v0) {
  for (int line = v0 / 2; v0 % 2 == 0 && line < (v0 + V + 1) / 2; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(w + (q + kChunkQuads) * kQuadBytes + 64 * line), _MM_HINT_T1);
}

// Codes stored + 128 ([-127, 127]): R rows' integer sums of quads [g0, end) (one group), V of a
// quad's vectors from v0, into part (from zero): |q| times x's codes with q's sign.
template <int R, int V, bool PF>
inline void wide_quads(const Int8Rows& x, const uint8_t* w, int64_t g0, int64_t end, int v0, __m256i (&part)[R][V]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < V; ++j) part[m][j] = _mm256_setzero_si256();
  for (int64_t q = g0; q < end; ++q) {
    const uint8_t* src = w + q * kQuadBytes + 32 * v0;
    if constexpr (PF) prefetch_quad<V>(w, q, v0);
    __m256i code[V], mag[V];
    for (int j = 0; j < V; ++j) {
      code[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * j)), flip);
      mag[j] = _mm256_abs_epi8(code[j]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const __m256i xv = _mm256_set1_epi32(x.quad(m, q));
      for (int j = 0; j < V; ++j) {
        const __m256i words = _mm256_maddubs_epi16(mag[j], _mm256_sign_epi8(xv, code[j]));
        part[m][j] = _mm256_add_epi32(part[m][j], _mm256_madd_epi16(words, ones));
      }
    }
  }
}

// Narrow codes, stored + 32 ([-32, 31]: the fp32-group panels, GGUF's k-quants), straight into
// vpmaddubsw as u8 (no sign moved onto x): a word holds two products of at most 63 * 127, so two
// quads' words add in int16 exactly and widen into int32 once a pair; part starts at -32 * the
// group's sum of x codes (what the + 32 adds), offset / 4.
template <int R, int V, bool PF>
inline void narrow_quads(const Int8Rows& x, const uint8_t* w, int64_t g0, int64_t end, int v0, int64_t g,
                         __m256i (&part)[R][V]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < V; ++j) part[m][j] = _mm256_set1_epi32(x.offset[m * x.G + g] / 4);
  // NOTE: a group is 4 or 8 quads and a chunk 64, so [g0, end) holds whole pairs.
  for (int64_t q = g0; q < end; q += 2) {
    const uint8_t* src = w + q * kQuadBytes + 32 * v0;
    if constexpr (PF) {
      prefetch_quad<V>(w, q, v0);
      prefetch_quad<V>(w, q + 1, v0);
    }
    __m256i code[2][V];
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < V; ++j)
        code[i][j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * kQuadBytes + 32 * j));
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const __m256i x0 = _mm256_set1_epi32(x.quad(m, q)), x1 = _mm256_set1_epi32(x.quad(m, q + 1));
      for (int j = 0; j < V; ++j) {
        const __m256i words = _mm256_add_epi16(_mm256_maddubs_epi16(code[0][j], x0), _mm256_maddubs_epi16(code[1][j], x1));
        part[m][j] = _mm256_add_epi32(part[m][j], _mm256_madd_epi16(words, ones));
      }
    }
  }
}

// R rows x one int8 panel over quads [q0, q1) (q0 a group's first), V of a quad's 4 vectors at a
// time (the group's others re-read from L1); adds into sums. Group scales (S, `scales` this
// panel's): f16 d as int8_tile's, sums += d * (dx * sum); fp32 d likewise, by x's groups (16 or
// 32); with offsets, sums += d * (dx * sum) + m * sx, the fp32 operations in that order.
template <int R, bool PF, int S>
void int8_rows_avx2(const Int8Rows& x, const uint8_t* w, const void* scales, int64_t q0, int64_t q1, Sums sums) {
  constexpr int V = kInt8Avx2Vectors<R>;
  const int64_t group_quads = is_f32_groups(S) ? x.group / 4 : kGroupQuads;
  for (int64_t g0 = q0; g0 < q1; g0 += group_quads) {
    const int64_t g = g0 / group_quads, end = std::min(q1, g0 + group_quads);
    for (int v0 = 0; v0 < 4; v0 += V) {
      __m256i part[R][V];
      if constexpr (is_narrow(S))
        narrow_quads<R, V, PF>(x, w, g0, end, v0, g, part);
      else
        wide_quads<R, V, PF>(x, w, g0, end, v0, part);
      __m256 dv[V], mv[V];
      for (int j = 0; j < V; ++j) {
        if constexpr (is_f16_groups(S)) {
          const uint16_t* d = static_cast<const uint16_t*>(scales) + g * kPanel + 8 * (v0 + j);
          dv[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
        } else if constexpr (is_f32_groups(S)) {
          const float* d = static_cast<const float*>(scales) + g * group_floats(S) + 8 * (v0 + j);
          dv[j] = _mm256_loadu_ps(d);
          if constexpr (has_offsets(S)) mv[j] = _mm256_loadu_ps(d + kPanel);
        }
      }
      for (int m = 0; m < R; ++m) {
        const __m256 step = _mm256_set1_ps(x.dx[m * x.G + g]);
        for (int j = 0; j < V; ++j) {
          float* out = sums + m * kSumsRow + 8 * (v0 + j);
          const __m256 sum = _mm256_cvtepi32_ps(part[m][j]);
          __m256 before = _mm256_loadu_ps(out);
          if constexpr (has_offsets(S)) before = _mm256_fmadd_ps(mv[j], _mm256_set1_ps(x.sx[m * x.G + g]), before);
          _mm256_storeu_ps(out, S != kColumnScales ? _mm256_fmadd_ps(dv[j], _mm256_mul_ps(sum, step), before)
                                                   : _mm256_fmadd_ps(sum, step, before));
        }
      }
    }
  }
}

using Int8PassFn = void (*)(const Int8Rows&, const uint8_t*, const void*, int64_t, int64_t, Sums);
template <bool PF, int S, int... I>
constexpr std::array<Int8PassFn, kInt8Avx2Rows> make_int8_passes(std::integer_sequence<int, I...>) {
  return {int8_rows_avx2<I + 1, PF, S>...};
}
template <bool PF, int S>
constexpr std::array<Int8PassFn, kInt8Avx2Rows> kInt8Passes =
    make_int8_passes<PF, S>(std::make_integer_sequence<int, kInt8Avx2Rows>());

// Rows [0, MR) x one int8 panel over quads [q0, q1): kInt8Avx2Rows rows at a time over each chunk
// of kChunkQuads (L1-resident for the passes after the first, which prefetches).
template <int MR, bool PF, int S>
void int8_tile(const Int8Rows& x, const uint8_t* w, const void* scales, int64_t q0, int64_t q1, bool first,
               Sums sums) {
  if (first)
    for (int m = 0; m < MR; ++m) std::fill(sums + m * kSumsRow, sums + m * kSumsRow + kPanel, 0.f);
  for (int64_t c0 = q0; c0 < q1; c0 += kChunkQuads) {
    const int64_t c1 = std::min(q1, c0 + kChunkQuads);
    for (int m0 = 0; m0 < MR; m0 += kInt8Avx2Rows) {
      const int rows = std::min(kInt8Avx2Rows, MR - m0);
      (m0 == 0 ? kInt8Passes<PF, S> : kInt8Passes<false, S>)[rows - 1](x.from(m0), w, scales, c0, c1,
                                                                        sums + m0 * kSumsRow);
    }
  }
}
#endif

using Int8TileFn = void (*)(const Int8Rows&, const uint8_t*, const void*, int64_t, int64_t, bool, Sums);

template <bool PF, int S, int... I>
constexpr std::array<Int8TileFn, kInt8TileRows> make_int8_tiles(std::integer_sequence<int, I...>) {
  return {int8_tile<I + 1, PF, S>...};
}
template <int S>
constexpr std::array<std::array<Int8TileFn, kInt8TileRows>, 2> make_int8_tile_table() {
  return {make_int8_tiles<false, S>(std::make_integer_sequence<int, kInt8TileRows>()),
          make_int8_tiles<true, S>(std::make_integer_sequence<int, kInt8TileRows>())};
}
template <int... S>
constexpr std::array<std::array<std::array<Int8TileFn, kInt8TileRows>, 2>, sizeof...(S)> make_int8_tile_tables(
    std::integer_sequence<int, S...>) {
  return {make_int8_tile_table<S>()...};
}
// [scale kind][prefetch][rows - 1]
constexpr auto kInt8Tiles = make_int8_tile_tables(std::make_integer_sequence<int, kInt8ScaleKinds>());

// All M rows over int8 panel `index`: one tile straight through K, or every tile over each chunk.
void int8_panel(const Problem& P, const uint8_t* codes, const Int8GroupScales& scales, const Int8Rows& x,
                const Tiling& tiling, int64_t index, float* sums) {
  const int64_t quads = num_quads(P.K);
  const uint8_t* w = codes + index * kQuadBytes * quads;
  const void* d = scales.of(index, x.G);
  const auto& tiles = kInt8Tiles[scales.kind];
  const bool single = tiling.count == 1;
  const int64_t chunk = single ? quads : kChunkQuads;
  for (int64_t q0 = 0; q0 < quads; q0 += chunk) {
    const int64_t q1 = std::min(quads, q0 + chunk);
    for (int t = 0; t < tiling.count; ++t) {
      const bool prefetch = single || t == 0;  // as int4_panel
      tiles[prefetch][tiling.rows(t) - 1](x.from(tiling.start[t]), w, d, q0, q1, q0 == 0,
                                          sums + tiling.start[t] * kSumsRow);
    }
  }
  for (int t = 0; t < tiling.count; ++t)
    emit(P, sums + tiling.start[t] * kSumsRow, tiling.start[t], tiling.rows(t), index * kPanel, kPanel);
}

void int8_pass(const Problem& P, const uint8_t* codes, const Int8GroupScales& scales) {
  const int64_t G = (P.K + scales.group - 1) / scales.group;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dx, sx;
  thread_local std::vector<int32_t> offset;
  xq.resize(P.M * G * scales.group);
  dx.resize(P.M * G);
  sx.resize(P.M * G);
  offset.resize(P.M * G);
  const Int8Rows rows{xq.data(), dx.data(), offset.data(), sx.data(), G, scales.group};
  parallel_ranges(P.M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row_int8(P.x + m * P.xs, P.K, rows.from(m));
  }, P.M * P.K >= (1 << 14) ? 1 << 30 : 1);
  const Tiling tiling(P.M, kInt8TileRows);
  parallel_ranges(padded_cols(P.N) / kPanel, 1, [&](int64_t i0, int64_t i1) {
    static thread_local std::vector<float> sums;
    sums.resize(P.M * kSumsRow);
    for (int64_t i = i0; i < i1; ++i) int8_panel(P, codes, scales, rows, tiling, i, sums.data());
  });
}
#if defined(PAGODA_VNNI) && defined(__x86_64__)
// int8 panels on AMX: the codes widened to the bf16 panel layout, a panel at a time into L2 or a
// step at a time into L1 (`amx_pass`), and the bf16 blocks multiply x as it is on it (no
// rounding of x to int8 codes: tdpbf16ps does 8x the multiply-adds of vpdpbusd a cycle, and the
// groups' rescaling would cost more than the products; so these rows' outputs are W times x
// itself, up to fp32 sums). Per-column scales (S kColumnScales) wait for `emit`: the codes widen
// exactly (every code is a bf16). Group scales (kF16Groups, GGUF's Q8_0 and Q5_0; kF32Groups and
// kF32GroupsOffsets, its k-quants, codes stored + 32) apply as they widen: w = q * d (+ m) in
// fp32 (one multiply or FMA) rounded once to bf16, as the int4 panels' (`widen_int4_pairs`).
// Writes quads [q0, q1) of the panel at `codes` (its group values at `values`, `group_quads`
// quads a group) to out[(2 (q - q0) + h) * kPanelPair ...]. Source quad q, block b: 16 columns
// x 4 codes + 128 (or + 32) at 4c + i; destination k-pair 2q + h, block b: 16 columns x 2 at
// 2c + e, code i = 2h + e.
template <int S>
__attribute__((target("avx512vbmi"))) void widen_int8_quads(const uint8_t* codes, const void* values, int64_t q0,
                                                           int64_t q1, int64_t group_quads, bf16* out) {
  // NOTE: dword j of a half (column 8 * half + j / 2, element j % 2) of k-pair 2q + h takes byte
  // 4 (j / 2) + j % 2 + 2h + 32 half.
  alignas(64) static const LowByteIndex idx =
      low_byte_index([](int h, int half, int j) { return 4 * (j / 2) + j % 2 + 2 * h + 32 * half; });
  const ColumnSpread& spread = column_spread();
  const __m512i bias = _mm512_set1_epi32(is_narrow(S) ? 32 : 128);
  for (int64_t g0 = q0; g0 < q1;) {
    const int64_t g = S == kColumnScales ? 0 : g0 / group_quads;
    const int64_t g1 = S == kColumnScales ? q1 : std::min(q1, (g + 1) * group_quads);
    __m512 d[2][2] = {}, m[2][2] = {};  // [block][half]
    if constexpr (S != kColumnScales) {
      for (int b = 0; b < 2; ++b) {
        __m512 db, mb = _mm512_setzero_ps();
        if constexpr (is_f16_groups(S)) {
          const uint16_t* v = static_cast<const uint16_t*>(values) + g * kPanel + b * kBlock;
          db = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
        } else {
          const float* v = static_cast<const float*>(values) + g * group_floats(S) + b * kBlock;
          db = _mm512_loadu_ps(v);
          if constexpr (has_offsets(S)) mb = _mm512_loadu_ps(v + kPanel);
        }
        for (int half = 0; half < 2; ++half) {
          const __m512i at = _mm512_load_si512(spread[half].data());
          d[b][half] = _mm512_permutexvar_ps(at, db);
          m[b][half] = _mm512_permutexvar_ps(at, mb);
        }
      }
    }
    for (int64_t q = g0; q < g1; ++q) {
      for (int b = 0; b < 2; ++b) {
        const __m512i v = _mm512_loadu_si512(codes + q * kQuadBytes + b * 4 * kBlock);
        for (int h = 0; h < 2; ++h) {
          __m512 w[2];
          for (int half = 0; half < 2; ++half) {
            const __m512i index = _mm512_load_si512(idx[h][half].data());
            const __m512 code =
                _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_maskz_permutexvar_epi8(kLowBytes, index, v), bias));
            if constexpr (S == kColumnScales)
              w[half] = code;
            else if constexpr (has_offsets(S))
              w[half] = _mm512_fmadd_ps(code, d[b][half], m[b][half]);
            else
              w[half] = _mm512_mul_ps(code, d[b][half]);
          }
          const __m512bh pair = _mm512_cvtne2ps_pbh(w[1], w[0]);
          _mm512_storeu_si512(out + (2 * (q - q0) + h) * kPanelPair + b * 2 * kBlock,
                              reinterpret_cast<const __m512i&>(pair));
        }
      }
    }
    g0 = g1;
  }
}

// int8 panels of scale kind S for the AMX blocks.
template <int S>
struct AmxInt8 {
  const uint8_t* codes;
  Int8GroupScales scales;
  int64_t quads, G;
  const uint8_t* codes_of(int64_t i) const { return codes + i * kQuadBytes * quads; }
  void source_of(int64_t i, PanelPrefetch& ahead) const { ahead.add(codes_of(i), kQuadBytes * quads); }
  int64_t group_quads() const { return scales.group / 4; }
  const bf16* panel(int64_t i, int slot) const {
    bf16* out = widened_panel(2 * quads, slot);
    widen_int8_quads<S>(codes_of(i), scales.of(i, G), 0, quads, group_quads(), out);
    return out;
  }
  const bf16* step(int64_t i, int64_t p) const {
    bf16* out = widened_step();
    widen_int8_quads<S>(codes_of(i), scales.of(i, G), p / 2, p / 2 + kAmxPairs / 2, group_quads(), out);
    return out;
  }
};

// The AMX passes of int8 panels of any scale kind this build takes.
void amx_int8_passes(const Problem& P, const uint8_t* codes, const Int8GroupScales& groups) {
  const int64_t quads = num_quads(P.K), G = P.K / groups.group;
  switch (groups.kind) {
    case kF16Groups: amx_passes(P, AmxInt8<kF16Groups>{codes, groups, quads, G}); break;
    case kF32Groups: amx_passes(P, AmxInt8<kF32Groups>{codes, groups, quads, G}); break;
    case kF32GroupsOffsets: amx_passes(P, AmxInt8<kF32GroupsOffsets>{codes, groups, quads, G}); break;
    default: amx_passes(P, AmxInt8<kColumnScales>{codes, groups, quads, G});
  }
}
#endif
#endif

// int8 panels times x: `scales` fp32 per column, or (format 2 only) group scales (`groups`: f16
// per panel, group of 32 along K and column; or, on the AVX2 and VNNI builds, fp32 by groups of 16 or 32,
// with offsets or without), K a multiple of the group; on AMX tiles (VNNI build, the measured
// rows) the codes widened to bf16, group scales (and offsets) applied as they widen.
void qgemm_int8(const bf16* x, int64_t xs, const int8_t* codes, const float* scales, const Int8GroupScales& groups,
                const bf16* bias, bf16* y, int64_t ys, int64_t M, int64_t N, int64_t K) {
  const bool grouped = groups.kind != kColumnScales;
  all_passes(x, xs, grouped ? nullptr : scales, bias, y, ys, M, N, K, [&](const Problem& P) {
#if defined(PAGODA_VNNI)
    if (takes_amx(P, g_amx_int8_rows))
      amx_int8_passes(P, reinterpret_cast<const uint8_t*>(codes), groups);
    else
      int8_pass(P, reinterpret_cast<const uint8_t*>(codes), groups);
#elif defined(PAGODA_INT8_QUADS)
    int8_pass(P, reinterpret_cast<const uint8_t*>(codes), groups);
#else
    (void)grouped;  // NOTE: ops.py builds no grouped panels for format 0
    gemm_pass(P, [&](bf16* buffer) { return Int8Panels{codes, num_pairs(K), buffer}; });
#endif
  });
}

#if defined(PAGODA_VNNI) && defined(__x86_64__)
// `pagoda_gemm_packed_gated` (gemm.h): bf16, int8 (column or group scales) and int4 panels, where
// every pass of `all_passes` would take AMX tiles (the last pass is the smallest), else nothing.
bool gemm_gated(const GemmWeight& w, const bf16* x, int64_t xs, const bf16* bias, bf16* y, int64_t ys, int64_t M,
                int64_t act) {
  if ((act != kSiluGate && act != kGeluTanhGate) || w.n % (2 * kPanel) != 0 || M <= 0) return false;
  const Int8GroupScales groups = int8_scales(w);
  if (groups.kind == kF16GroupsNarrow) return false;  // NOTE: the avx2 build's kind, never on AMX
  const bool int8 = w.kind == kPackedInt8 || groups.kind != kColumnScales;
  const std::atomic<int64_t>* from_rows = nullptr;
  if (w.kind == kPackedBf16) from_rows = &g_amx_rows;
  if (int8) from_rows = &g_amx_int8_rows;
  if (w.kind == kPackedInt4 || w.kind == kPackedInt5 || w.kind == kPackedInt5F32) from_rows = &g_amx_int4_rows;
  const int64_t last = M - (M - 1) / kMaxRowsPerPass * kMaxRowsPerPass;
  if (!from_rows || !takes_amx(Problem{x, xs, nullptr, bias, y, ys, last, w.n, w.k}, *from_rows)) return false;
  const auto* codes = static_cast<const uint8_t*>(w.data);
  const auto* scales = w.kind == kPackedInt8 ? static_cast<const float*>(w.scales) : nullptr;
  all_passes(x, xs, scales, bias, y, ys, M, w.n, w.k, [&](const Problem& pass) {
    Problem P = pass;
    P.gated = act;
    if (int8)
      amx_int8_passes(P, codes, groups);
    else if (w.kind == kPackedInt4 || w.kind == kPackedInt5 || w.kind == kPackedInt5F32)
      amx_passes(P, AmxInt4{codes, w.scales, P.K / 2, w.group_size / 2, int5_high(w), int4_scales(w)});
    else
      amx_passes(P, AmxBf16{static_cast<const bf16*>(w.data), kPanel * 2 * num_pairs(P.K)});
  });
  return true;
}
#endif

void gemm_pack(const bf16* w, int64_t w_stride, bf16* packed, int64_t N, int64_t K) {
  const int64_t pairs = num_pairs(K);
  for (int64_t n = 0; n < N; ++n) {
    bf16* panel = packed + n / kPanel * kPanel * 2 * pairs;
    for (int64_t k = 0; k < K; ++k) panel[(k / 2) * kPanelPair + (n % kPanel) * 2 + (k & 1)] = w[n * w_stride + k];
  }
}

bool bf16_dot_wins(int64_t rows) { return rows < g_fma_rows.load(std::memory_order_relaxed); }

bool amx_dot_wins(int64_t rows) {
#if defined(PAGODA_VNNI) && defined(__x86_64__)
  return rows >= g_amx_rows.load(std::memory_order_relaxed) && amx_usable();
#else
  (void)rows;
  return false;
#endif
}

}  // namespace pagoda

extern "C" int64_t pagoda_gemm_int8_format() { return pagoda::kInt8Format; }

// Whether this build takes int5 panels (kPackedInt5: int4's nibbles and a plane of fifth bits).
extern "C" int64_t pagoda_gemm_int5() { return pagoda::kInt5Panels; }

// Whether the int8 tiles take f16 groups of 32 of narrow codes (+ 32, in [-32, 31]: GGUF's Q5_0;
// the AVX2 build).
extern "C" int64_t pagoda_gemm_int8_narrow() { return pagoda::kInt8ScaleKinds > pagoda::kF16GroupsNarrow; }

// Whether the int8 tiles take fp32 scales by groups of 16 or 32 along K, with offsets or none, of
// narrow codes (GGUF's Q6_K, Q5_K, Q5_1; the AVX2 and VNNI builds).
extern "C" int64_t pagoda_gemm_int8_f32_groups() { return pagoda::kInt8ScaleKinds > pagoda::kF32GroupsOffsets; }

// The bias the fp32-group kinds' stored codes carry: 32 (narrow codes, in [-32, 31]: the AVX2
// build) or 128 (any code: the VNNI build).
extern "C" int64_t pagoda_gemm_int8_f32_bias() { return pagoda::is_narrow(pagoda::kF32Groups) ? 32 : 128; }

// Whether this build has the wide fp32-group kinds apart (kPackedInt8F32GroupsWide, ...Offsets-
// Wide: the AVX2 build, whose plain ones are narrow).
extern "C" int64_t pagoda_gemm_int8_f32_wide() { return pagoda::kInt8ScaleKinds > pagoda::kF32GroupsOffsetsWide; }

// Steps of at least `rows` rows multiply bf16 panels on the FMA tiles (the AVX-512 build) or on
// widened chunks (the AVX2 build; see kAvx2WideRows); returns whether this build has them.
extern "C" int64_t pagoda_gemm_set_fma_rows(int64_t rows) {
#if (defined(PAGODA_AVX512) && defined(__AVX512BF16__)) || defined(PAGODA_AVX2)
  pagoda::g_fma_rows.store(rows, std::memory_order_relaxed);
  return 1;
#else
  (void)rows;
  return 0;
#endif
}

// One tile of at least `rows` rows (a step of few rows) prefetches the weight stream ahead of it.
extern "C" int64_t pagoda_gemm_set_prefetch_rows(int64_t rows) {
  pagoda::g_prefetch_rows.store(rows, std::memory_order_relaxed);
  return 1;
}

// Steps of at least `rows` rows multiply bf16 panels on AMX tiles (where K is a multiple of 32);
// returns whether this CPU and build have them (AMX-BF16, tile data granted by Linux).
extern "C" int64_t pagoda_gemm_set_amx_rows(int64_t rows) {
#if defined(PAGODA_VNNI) && defined(__x86_64__)
  if (!pagoda::amx_usable()) return 0;
  pagoda::g_amx_rows.store(rows, std::memory_order_relaxed);
  return 1;
#else
  (void)rows;
  return 0;
#endif
}

// Steps of at least `rows` rows multiply int8 (bits 8) or int4 (bits 4) panels on AMX tiles
// (widened to bf16, x as it is; K a multiple of 32); returns whether this CPU and build have them.
extern "C" int64_t pagoda_gemm_set_amx_integer_rows(int64_t bits, int64_t rows) {
#if defined(PAGODA_VNNI) && defined(__x86_64__)
  if (!pagoda::amx_usable() || !__builtin_cpu_supports("avx512vbmi")) return 0;  // the widening's vpermb
  if (bits != 8 && bits != 4) return 0;
  (bits == 8 ? pagoda::g_amx_int8_rows : pagoda::g_amx_int4_rows).store(rows, std::memory_order_relaxed);
  return 1;
#else
  (void)bits;
  (void)rows;
  return 0;
#endif
}

namespace pagoda {
namespace {

// Row r of an integer panel weight as w = q * d (+ m) in fp32 (the product rounded, then the
// offset added: packing's dequantize, two roundings, no FMA), each weight rounded once to bf16.
void int8_panel_row(const GemmWeight& w, int64_t r, bf16* out) {
  const int64_t K = w.k, steps = (K + 3) / 4, panel = r / kPanel, c = r % kPanel;
  const uint8_t* codes = static_cast<const uint8_t*>(w.data) + panel * kPanel * 4 * steps + 4 * c;
  const Int8GroupScales groups = int8_scales(w);
  const int bias = is_narrow(groups.kind) ? 32 : 128;
  const int64_t gs = groups.kind == kColumnScales ? K : groups.group, G = K / gs;
  for (int64_t k = 0; k < K; ++k) {
    const float q = static_cast<float>(int(codes[(k / 4) * kPanel * 4 + k % 4]) - bias);
    const int64_t g = k / gs;
    float v;
    if (groups.kind == kColumnScales) {
      v = q * static_cast<const float*>(w.scales)[r];
    } else if (is_f16_groups(groups.kind)) {
      v = q * f16_from_bits(static_cast<const uint16_t*>(w.scales)[(panel * G + g) * kPanel + c]);
    } else {
      const float* d = static_cast<const float*>(w.scales) + (panel * G + g) * group_floats(groups.kind);
      v = q * d[c];
      if (has_offsets(groups.kind)) v = v + d[kPanel + c];
    }
    store_one(v, out + k);
  }
}

// The same for int4 (and int5) panels: nibble of block (c / 16) in byte 4 (c % 16) + 2 e + h of
// each 64-byte step (see the top of this file), int5's fifth bit at that byte's place in its
// block's mask; d, m f16 per panel and group (int5: d alone, m = -16 d).
void int4_panel_row(const GemmWeight& w, int64_t r, bf16* out) {
  const int64_t K = w.k, panel = r / kPanel, c = r % kPanel, block = c / 16, G = K / w.group_size;
  const uint8_t* codes = static_cast<const uint8_t*>(w.data) + panel * kInt4PairBytes * (K / 2);
  const uint8_t* high = int5_high(w);
  const int sc = int4_scales(w);
  const auto* scales = static_cast<const uint8_t*>(w.scales) + panel * G * int4_group_bytes(sc);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t j = k / 4, byte = 4 * (c % 16) + 2 * (k % 2) + (k / 2) % 2;
    int q = (codes[j * 64 + byte] >> (4 * block)) & 15;
    if (high != nullptr)
      q |= ((high[(panel * (K / 4) + j) * kInt5HighBytes + 8 * block + byte / 8] >> (byte % 8)) & 1) << 4;
    const uint8_t* at = scales + (k / w.group_size) * int4_group_bytes(sc);
    const auto* s = reinterpret_cast<const uint16_t*>(at);
    const auto* f = reinterpret_cast<const float*>(at);
    const float d = sc == kF32Dm ? f[c] : f16_from_bits(s[c]);
    const float m = sc == kF16Sym ? -16.f * d : sc == kF32Dm ? f[kPanel + c] : f16_from_bits(s[kPanel + c]);
    const float product = static_cast<float>(q) * d;
    store_one(product + m, out + k);
  }
}

}  // namespace
}  // namespace pagoda

// Rows ids[0, count) of an integer panel weight (`pagoda::GemmWeight`), each weight dequantized
// as packing's torch reference does (w = q * d (+ m) in fp32, rounded once) into bf16 out
// [count, k]: an embedding read from a tied, packed LM head. Returns 1, or 0 having done nothing
// where it does not take the weight (bf16 or records kinds, the portable build's int8 layout),
// or -1 for an id outside [0, n).
extern "C" int64_t pagoda_gemm_rows_bf16(const void* weight, const int64_t* ids, int64_t count, void* out) {
  using namespace pagoda;
  const auto& w = *static_cast<const GemmWeight*>(weight);
  const bool int4 = w.kind == kPackedInt4 || ((w.kind == kPackedInt5 || w.kind == kPackedInt5F32) && kInt5Panels);
  const bool int8 = kInt8Format == 2 && (w.kind == kPackedInt8 || w.kind == kPackedInt8Groups ||
                                         w.kind == kPackedInt8GroupsNarrow || w.kind == kPackedInt8F32Groups ||
                                         w.kind == kPackedInt8F32GroupsOffsets ||
                                         w.kind == kPackedInt8F32GroupsWide || w.kind == kPackedInt8F32GroupsOffsetsWide);
  if (!int4 && !int8) return 0;
  for (int64_t i = 0; i < count; ++i)
    if (ids[i] < 0 || ids[i] >= w.n) return -1;
  auto* rows = static_cast<bf16*>(out);
  parallel_items(count, [&](int64_t i) {
    (int4 ? int4_panel_row : int8_panel_row)(w, ids[i], rows + i * w.k);
  }, count * w.k >= (1 << 16) ? 1 << 30 : 1);
  return 1;
}

extern "C" int64_t pagoda_gemm_packed_size_bf16(int64_t N, int64_t K) { return pagoda::gemm_packed_size(N, K); }

// Writes W[N, K] (row stride w_stride) into `packed` (gemm_packed_size elements, zeroed).
extern "C" void pagoda_gemm_pack_bf16(const void* w, int64_t w_stride, void* packed, int64_t N, int64_t K) {
  pagoda::gemm_pack(static_cast<const pagoda::bf16*>(w), w_stride, static_cast<pagoda::bf16*>(packed), N, K);
}

// bf16: y = x . W^T; int8: the codes (panel layout, zero padded) times one fp32 scale per
// column, or (int8 groups, format 2) one f16 scale per panel, group of 32 along K and column;
// int4: W = q * d + m by groups of gs along K, q as nibbles in the panel layout (64 bytes per
// panel and two k-pairs, see the top of this file), d and m as f16 per panel and group (d for
// its 32 columns, then m), K a multiple of gs, gs a multiple of 16.
extern "C" void pagoda_gemm_packed(const void* weight, const void* x, int64_t x_stride, const void* bias, void* y,
                                   int64_t y_stride, int64_t M) {
  using pagoda::bf16;
  const auto& w = *static_cast<const pagoda::GemmWeight*>(weight);
  const auto* xb = static_cast<const bf16*>(x);
  const auto* b = static_cast<const bf16*>(bias);
  auto* yb = static_cast<bf16*>(y);
  switch (w.kind) {
    case pagoda::kPackedInt8:
    case pagoda::kPackedInt8Groups:
    case pagoda::kPackedInt8GroupsNarrow:
    case pagoda::kPackedInt8F32Groups:
    case pagoda::kPackedInt8F32GroupsOffsets:
    case pagoda::kPackedInt8F32GroupsWide:
    case pagoda::kPackedInt8F32GroupsOffsetsWide: {
      // NOTE: ops.py builds the narrow, fp32-group and wide fp32 kinds only where this build says it has them.
      const auto groups = pagoda::int8_scales(w);
      if (groups.kind >= pagoda::kInt8ScaleKinds || (pagoda::is_f32_groups(groups.kind) && !pagoda_gemm_int8_f32_groups()))
        std::abort();
      const auto* column = w.kind == pagoda::kPackedInt8 ? static_cast<const float*>(w.scales) : nullptr;
      pagoda::qgemm_int8(xb, x_stride, static_cast<const int8_t*>(w.data), column, groups, b, yb, y_stride, M, w.n,
                         w.k);
      break;
    }
    case pagoda::kPackedInt5:
    case pagoda::kPackedInt5F32:
      if (!pagoda::kInt5Panels) std::abort();  // NOTE: ops.py builds them only where pagoda_gemm_int5 says so
      [[fallthrough]];
    case pagoda::kPackedInt4:
      pagoda::qgemm_int4(xb, x_stride, static_cast<const uint8_t*>(w.data), pagoda::int5_high(w), w.scales,
                         pagoda::int4_scales(w), w.group_size, b, yb, y_stride, M, w.n, w.k);
      break;
    case pagoda::kInt8Records:  // qgemv's format 1: [k codes][k / gs fp32 scales] a row
      pagoda_qgemv_bf16(1, x, x_stride, w.data, w.k + 4 * (w.k / w.group_size), w.group_size, bias, y, y_stride, M,
                        w.n, w.k, 1 << 30);
      break;
    case pagoda::kInt8F16Records:  // format 1 with f16 scales: [k codes][k / gs f16 scales] a row
      pagoda_qgemv_bf16(1, x, x_stride, w.data, w.k + 2 * (w.k / w.group_size), w.group_size, bias, y, y_stride, M,
                        w.n, w.k, 1 << 30);
      break;
    case pagoda::kInt4Records:  // format 0: [k / 2 nibble bytes][k / gs f16 d][k / gs f16 m] a row
      pagoda_qgemv_bf16(0, x, x_stride, w.data, w.k / 2 + 4 * (w.k / w.group_size), w.group_size, bias, y, y_stride,
                        M, w.n, w.k, 1 << 30);
      break;
    default:
      pagoda::gemm(xb, x_stride, static_cast<const bf16*>(w.data), b, yb, y_stride, M, w.n, w.k);
  }
}

extern "C" int64_t pagoda_gemm_packed_gated(const void* weight, const void* x, int64_t x_stride, const void* bias,
                                           void* y, int64_t y_stride, int64_t M, int64_t act) {
#if defined(PAGODA_VNNI) && defined(__x86_64__)
  using pagoda::bf16;
  return pagoda::gemm_gated(*static_cast<const pagoda::GemmWeight*>(weight), static_cast<const bf16*>(x), x_stride,
                            static_cast<const bf16*>(bias), static_cast<bf16*>(y), y_stride, M, act);
#else
  (void)weight, (void)x, (void)x_stride, (void)bias, (void)y, (void)y_stride, (void)M, (void)act;
  return 0;
#endif
}
