// y[M, N] = x[M, K] . W[N, K]^T (+ bias) for small M over a packed weight: bf16 in and out,
// fp32 accumulation, the weight read from memory once per call for all M rows.
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
// Without AVX512_BF16 the same loops widen to fp32 (plain code, slow: layers route around it).
// Each output is the fp32 sum (+ bias) rounded once to bf16.
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace pagoda {
namespace {

constexpr int kBlock = 16;              // output columns per vector
constexpr int kPanel = 2 * kBlock;      // output columns per panel
constexpr int kPanelPair = 2 * kPanel;  // elements of a panel per k-pair (128 bytes)
constexpr int kTileRows = 12;           // 12 x 2 accumulators + 2 weight vectors of 32 registers
constexpr int kWideRows = 6;            // wide tiles: 6 x 4 accumulators over 2 panels
constexpr int64_t kWideFrom = 96;       // rows from which wide tiles are used
constexpr int kPrefetchRows = 6;        // one tile of fewer rows is bound by memory alone
constexpr int64_t kChunkPairs = 64;     // 8 KB of a panel
constexpr int64_t kMaxRowsPerPass = 768;  // rows sharing one pass over the weight

// NOTE: one chunk ahead, so that the first tile over a chunk fetches the next. Measured on the
// 30 layers' distinct weights, one thread (docs/performance.md, Small-M GEMM): a prefetch
// into L2 made one tile of 6-12 rows 10-20% faster, and of 1-5 rows slower (the hardware
// prefetcher alone keeps a plain stream at full speed; the prefetches only cost issue slots).
constexpr int64_t kPrefetchPairs = kChunkPairs;

int64_t padded_cols(int64_t N) { return (N + kPanel - 1) / kPanel * kPanel; }
int64_t num_pairs(int64_t K) { return (K + 1) / 2; }

// A tile's running sums: row m, column c of its (up to two) panels at sums[m * kSumsRow + c].
using Sums = float*;
constexpr int kSumsRow = 2 * kPanel;

struct Rows {
  const bf16* x;  // the tile's first row
  int64_t stride;
  int64_t K;
};

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)

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
      wv[b] = (__m512bh)_mm512_loadu_si512(src);
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
TileFn tile_fn(int rows, bool prefetch) { return kTiles[prefetch][rows - 1]; }
TileFn wide_tile_fn(int rows, bool prefetch) { return kWideTiles[prefetch][rows - 1]; }

struct Problem {
  const bf16* x;
  int64_t xs;
  const bf16* packed;
  const bf16* bias;
  bf16* y;
  int64_t ys, M, N, K;
};

// The rows cut into near-equal tiles of at most kTileRows; tile t is rows [start[t], start[t + 1]).
struct Tiling {
  int count;
  std::array<int64_t, kMaxRowsPerPass / kWideRows + 1> start;

  Tiling(int64_t M, int max_rows) : count(static_cast<int>((M + max_rows - 1) / max_rows)) {
    for (int t = 0; t <= count; ++t) start[t] = M * t / count;
  }
  int rows(int t) const { return static_cast<int>(start[t + 1] - start[t]); }
};

// Rows [m0, m0 + rows) of the panel at column c0: the sums plus bias, rounded to bf16; columns
// past N dropped.
void emit(const Problem& P, const float* sums, int64_t m0, int rows, int64_t c0, int64_t cols) {
  for (int m = 0; m < rows; ++m) {
    bf16* out = P.y + (m0 + m) * P.ys;
    for (int64_t c = c0; c < std::min(c0 + cols, P.N); c += kBlock) {
      const Mask mask = tail_mask(static_cast<int>(std::min<int64_t>(P.N - c, kBlock)));
      Vf v = load(sums + m * kSumsRow + (c - c0));
      if (P.bias) v = v + load(P.bias + c, mask);
      store(out + c, v, mask);
    }
  }
}

// All M rows over panel `index`: one tile straight through K, or every tile over each chunk.
void panel(const Problem& P, const Tiling& tiling, int64_t index, float* sums) {
  const int64_t pairs = num_pairs(P.K), c0 = index * kPanel;
  const bf16* w = P.packed + c0 * 2 * pairs;
  const int64_t chunk = tiling.count == 1 ? pairs : kChunkPairs;
  for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
    const int64_t p1 = std::min(pairs, p0 + chunk);
    for (int t = 0; t < tiling.count; ++t) {
      const bool prefetch = tiling.count == 1 ? tiling.rows(0) >= kPrefetchRows : t == 0;
      tile_fn(tiling.rows(t), prefetch)(Rows{P.x + tiling.start[t] * P.xs, P.xs, P.K}, w, p0, p1, p0 == 0,
                                        sums + tiling.start[t] * kSumsRow, 0);
    }
  }
  for (int t = 0; t < tiling.count; ++t)
    emit(P, sums + tiling.start[t] * kSumsRow, tiling.start[t], tiling.rows(t), c0, kPanel);
}

// Panels 2 * index and 2 * index + 1 in wide tiles, over each chunk.
void panel_pair(const Problem& P, const Tiling& tiling, int64_t index, float* sums) {
  const int64_t pairs = num_pairs(P.K), c0 = index * 2 * kPanel;
  const bf16* w = P.packed + c0 * 2 * pairs;
  for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
    const int64_t p1 = std::min(pairs, p0 + kChunkPairs);
    for (int t = 0; t < tiling.count; ++t)
      wide_tile_fn(tiling.rows(t), t == 0)(Rows{P.x + tiling.start[t] * P.xs, P.xs, P.K}, w, p0, p1, p0 == 0,
                                           sums + tiling.start[t] * kSumsRow, kPanel * 2 * pairs);
  }
  for (int t = 0; t < tiling.count; ++t)
    emit(P, sums + tiling.start[t] * kSumsRow, tiling.start[t], tiling.rows(t), c0, 2 * kPanel);
}

void gemm_pass(const Problem& P) {
  const int64_t panels = padded_cols(P.N) / kPanel;
  const bool wide = P.M >= kWideFrom;
  const Tiling tiling(P.M, wide ? kWideRows : kTileRows);
  const int64_t items = wide ? (panels + 1) / 2 : panels;
  parallel_ranges(items, 1, [&](int64_t i0, int64_t i1) {
    static thread_local std::vector<float> sums;
    sums.resize(P.M * kSumsRow);
    for (int64_t i = i0; i < i1; ++i) {
      if (!wide)
        panel(P, tiling, i, sums.data());
      else if (2 * i + 1 < panels)
        panel_pair(P, tiling, i, sums.data());
      else
        panel(P, Tiling(P.M, kTileRows), 2 * i, sums.data());
    }
  });
}

}  // namespace

// Elements of the packed weight for an N x K matrix (zero-initialize it before packing).
int64_t gemm_packed_size(int64_t N, int64_t K) { return padded_cols(N) * 2 * num_pairs(K); }

void gemm(const bf16* x, int64_t xs, const bf16* packed, const bf16* bias, bf16* y, int64_t ys, int64_t M, int64_t N,
          int64_t K) {
  if (N <= 0) return;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsPerPass)
    gemm_pass(Problem{x + m0 * xs, xs, packed, bias, y + m0 * ys, ys, std::min(kMaxRowsPerPass, M - m0), N, K});
}

void gemm_pack(const bf16* w, int64_t w_stride, bf16* packed, int64_t N, int64_t K) {
  const int64_t pairs = num_pairs(K);
  for (int64_t n = 0; n < N; ++n) {
    bf16* panel = packed + n / kPanel * kPanel * 2 * pairs;
    for (int64_t k = 0; k < K; ++k) panel[(k / 2) * kPanelPair + (n % kPanel) * 2 + (k & 1)] = w[n * w_stride + k];
  }
}

}  // namespace pagoda

extern "C" int64_t pagoda_gemm_packed_size_bf16(int64_t N, int64_t K) { return pagoda::gemm_packed_size(N, K); }

// Writes W[N, K] (row stride w_stride) into `packed` (gemm_packed_size elements, zeroed).
extern "C" void pagoda_gemm_pack_bf16(const void* w, int64_t w_stride, void* packed, int64_t N, int64_t K) {
  pagoda::gemm_pack(static_cast<const pagoda::bf16*>(w), w_stride, static_cast<pagoda::bf16*>(packed), N, K);
}

// y[M, N] (row stride y_stride) = x[M, K] (row stride x_stride) . W^T (+ bias[N]).
extern "C" void pagoda_gemm_bf16(const void* x, int64_t x_stride, const void* packed, const void* bias, void* y,
                                 int64_t y_stride, int64_t M, int64_t N, int64_t K) {
  pagoda::gemm(static_cast<const pagoda::bf16*>(x), x_stride, static_cast<const pagoda::bf16*>(packed),
               static_cast<const pagoda::bf16*>(bias), static_cast<pagoda::bf16*>(y), y_stride, M, N, K);
}
