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
// Without AVX512_BF16 the same loops widen to fp32 (plain code, slow: layers route around it).
// Each output is the fp32 sum (+ bias) rounded once to bf16.
//
// int8 variant (pagoda_qgemm_int8, quantized weights with one scale per output column): the same
// panels with one int8 code an element (64 bytes per k-pair), the same tiles and threads. Every
// int8 is exactly a bf16, so the products stay exact: one tile (up to kTileRows rows) converts
// the codes in registers as it streams them; more rows decode each chunk once into an L1 bf16
// buffer that all the tiles then read. With AVX512_VBMI (the avx512vbmi build) a k-pair's 64
// codes are sign-magnitude bytes, the two blocks interleaved 8 bytes at a time in each 16-byte
// lane, so that one load, two byte-table lookups (vpermi2b: a magnitude's bf16 low and high
// byte), an or of the sign and two byte unpacks give both weight vectors (5 vector ops for 64
// codes); without it they are two's complement in the bf16 layout, converted int8 -> int32 ->
// fp32 -> bf16 (14 ops). Codes are in [-127, 127] (what per-channel quantization gives). The scale multiplies each
// column's fp32 sum once, before the bias and the one rounding.
//
// int4 variant (pagoda_qgemm_int4, w = q * d + m with q in [0, 15] and f16 d, m per group of gs
// along K): a panel's two k-pairs p, p + 1 (p even) are 64 bytes, 16-bit lane 2c + e holding, from
// its low nibble up, the codes of column c at p, column 16 + c at p, column c at p + 1, column
// 16 + c at p + 1 (k-pair element e), so that a shift and a mask per vector turn one load into
// four weight vectors of bf16 0x4300 | q, exactly 128 + q. A tile (up to kInt4TileRows
// rows) sums each group's products in registers, then adds d * sum + (m - 128 d) * sx per column
// to its fp32 sums in L1 (sx: the row's sum of x over the group, computed once per call). More
// rows than one tile take K in chunks that stay in L1 while every tile converts them again.
#include <array>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "gemm.h"
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

// How int8 panels hold their codes (see the top of this file): 1, sign-magnitude and interleaved
// for the VBMI table lookups; 0, two's complement in the bf16 layout.
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
constexpr int kInt8Format = 1;
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
};

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)

// A weight vector: 16 columns at a k-pair, 32 bf16 values at `src`.
inline __m512bh weight_vector(const bf16* src) { return (__m512bh)_mm512_loadu_si512(src); }

#if defined(__AVX512VBMI__)

// bf16 of v in [0, 127], split in bytes: the tables vpermi2b looks the magnitudes up in.
struct Bf16Bytes {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  constexpr Bf16Bytes() : lo(), hi() {
    for (int v = 1; v < 128; ++v) {
      int e = 0;
      while ((v >> (e + 1)) != 0) ++e;
      const int bits = (127 + e) << 7 | ((v << (7 - e)) & 0x7F);
      lo[v] = static_cast<uint8_t>(bits & 0xFF);
      hi[v] = static_cast<uint8_t>(bits >> 8);
    }
  }
};
constexpr Bf16Bytes kBf16Bytes;

// A k-pair's two weight vectors from its 64 codes (sign-magnitude, the two blocks interleaved
// by 8 bytes a 16-byte lane): each magnitude's bf16 bytes by two table lookups, the sign
// or-ed into the high byte, the bytes paired by two unpacks.
inline void int8_vectors(const int8_t* src, __m512bh out[2]) {
  const __m512i raw = _mm512_loadu_si512(src);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(kBf16Bytes.lo), raw, _mm512_load_si512(kBf16Bytes.lo + 64));
  const __m512i hi = _mm512_ternarylogic_epi32(
      _mm512_permutex2var_epi8(_mm512_load_si512(kBf16Bytes.hi), raw, _mm512_load_si512(kBf16Bytes.hi + 64)), raw,
      _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // a | (b & c)
  out[0] = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
  out[1] = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}
#else

// A k-pair's two weight vectors from its 64 codes (two's complement, block by block): int8 ->
// int32 -> fp32 -> bf16, exact.
inline void int8_vectors(const int8_t* src, __m512bh out[2]) {
  for (int b = 0; b < 2; ++b) {
    const int8_t* s = src + b * 2 * kBlock;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + kBlock))));
    out[b] = _mm512_cvtne2ps_pbh(hi, lo);
  }
}
#endif

// Rows [0, MR) of `rows` x NP panels (`w`, then `panel_stride` elements on) over k-pairs
// [p0, p1); adds into `sums` (from zero when `first`); with PF, prefetches kPrefetchPairs ahead.
// W: bf16 panels, or int8 ones converted to bf16 as they are loaded.
template <int MR, bool PF, int NP = 1, class W = bf16>
void tile(const Rows& rows, const W* w, int64_t p0, int64_t p1, bool first, Sums sums, int64_t panel_stride = 0) {
  constexpr int NB = 2 * NP;
  __m512 acc[MR][NB];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) acc[m][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + m * kSumsRow + b * kBlock);
  auto step = [&](int64_t p, auto pair_of) {
    const W* wp = w + p * kPanelPair;
    __m512bh wv[NB];
    if constexpr (std::is_same_v<W, int8_t>) {
      static_assert(NB == 2, "int8 tiles take one panel");
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
      int8_vectors(wp, wv);
    } else {
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        const W* src = wp + (b / 2) * panel_stride + (b % 2) * 2 * kBlock;
        if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
        wv[b] = weight_vector(src);
      }
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

inline float weight_value(bf16 v) { return to_float(v); }
inline float weight_value(int8_t v) { return static_cast<float>(v); }

template <int MR, bool PF, int NP = 1, class W = bf16>
void tile(const Rows& rows, const W* w, int64_t p0, int64_t p1, bool first, Sums sums, int64_t panel_stride = 0) {
  for (int m = 0; first && m < MR; ++m) std::fill(sums + m * kSumsRow, sums + m * kSumsRow + NP * kPanel, 0.f);
  for (int64_t p = p0; p < p1; ++p) {
    for (int m = 0; m < MR; ++m) {
      const bf16* xp = rows.x + m * rows.stride + 2 * p;
      const float x0 = to_float(xp[0]), x1 = 2 * p + 1 < rows.K ? to_float(xp[1]) : 0.f;
      for (int c = 0; c < NP * kPanel; ++c) {
        const W* wc = w + (c / kPanel) * panel_stride + p * kPanelPair + (c % kPanel) * 2;
        sums[m * kSumsRow + c] += weight_value(wc[0]) * x0 + weight_value(wc[1]) * x1;
      }
    }
  }
}

#endif

template <class W = bf16>
using TileFn = void (*)(const Rows&, const W*, int64_t, int64_t, bool, Sums, int64_t);

template <bool PF, int NP, class W = bf16, int... I>
constexpr std::array<TileFn<W>, kTileRows> make_tiles(std::integer_sequence<int, I...>) {
  return {tile<I + 1, PF, NP, W>...};
}
constexpr std::array<std::array<TileFn<>, kTileRows>, 2> kTiles{
    make_tiles<false, 1>(std::make_integer_sequence<int, kTileRows>()),
    make_tiles<true, 1>(std::make_integer_sequence<int, kTileRows>())};
constexpr std::array<std::array<TileFn<>, kTileRows>, 2> kWideTiles{
    make_tiles<false, 2>(std::make_integer_sequence<int, kWideRows>()),
    make_tiles<true, 2>(std::make_integer_sequence<int, kWideRows>())};
constexpr std::array<std::array<TileFn<int8_t>, kTileRows>, 2> kInt8Tiles{
    make_tiles<false, 1, int8_t>(std::make_integer_sequence<int, kTileRows>()),
    make_tiles<true, 1, int8_t>(std::make_integer_sequence<int, kTileRows>())};
TileFn<> tile_fn(int rows, bool prefetch) { return kTiles[prefetch][rows - 1]; }
TileFn<> wide_tile_fn(int rows, bool prefetch) { return kWideTiles[prefetch][rows - 1]; }
TileFn<int8_t> int8_tile_fn(int rows, bool prefetch) { return kInt8Tiles[prefetch][rows - 1]; }

struct Problem {
  const bf16* x;
  int64_t xs;
  const float* scales;  // per output column (quantized weights), or null
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

// k-pairs [p0, p1) of an int8 panel (same layout, one byte an element) as bf16 at `out`: exact,
// every int8 is a bf16. With `prefetch`, the codes kPrefetchPairs ahead are fetched into L2.
void decode_int8(const int8_t* panel, int64_t p0, int64_t p1, bf16* out, bool prefetch) {
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* s = panel + p * kPanelPair;
    bf16* d = out + (p - p0) * kPanelPair;
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
    __m512bh v[2];
    int8_vectors(s, v);
    _mm512_storeu_si512(d, (__m512i)v[0]);
    _mm512_storeu_si512(d + 2 * kBlock, (__m512i)v[1]);
#else
    (void)prefetch;
    for (int i = 0; i < kPanelPair; ++i) store_one(static_cast<float>(s[i]), d + i);
#endif
  }
}

// int8 panels, decoded a chunk at a time into a bf16 buffer in L1 that every tile then reads.
struct Int8Panels {
  static constexpr bool kInPlace = false;
  const int8_t* codes;
  int64_t pairs;
  bf16* buffer;  // 2 * kChunkPairs * kPanelPair elements
  View chunk(int64_t index, int np, int64_t p0, int64_t p1, bool prefetch) const {
    for (int j = 0; j < np; ++j)
      decode_int8(codes + (index + j) * kPanel * 2 * pairs, p0, p1, buffer + j * kChunkPairs * kPanelPair, prefetch);
    // NOTE: offset back by p0 so that the tiles index the chunk by its absolute k-pairs.
    return {buffer - p0 * kPanelPair, kChunkPairs * kPanelPair};
  }
};

// All M rows over panel `index`: one tile straight through K, or every tile over each chunk.
template <class Source>
void panel(const Problem& P, const Source& src, const Tiling& tiling, int64_t index, float* sums) {
  const int64_t pairs = num_pairs(P.K), c0 = index * kPanel;
  const bool single = tiling.count == 1;
  if constexpr (std::is_same_v<Source, Int8Panels>) {
    if (single) {  // the codes converted in registers as the one tile streams them
      int8_tile_fn(tiling.rows(0), tiling.rows(0) >= kPrefetchRows)(Rows{P.x, P.xs, P.K}, src.codes + c0 * 2 * pairs,
                                                                     0, pairs, true, sums, 0);
      emit(P, sums, 0, tiling.rows(0), c0, kPanel);
      return;
    }
  }
  const int64_t chunk = single && Source::kInPlace ? pairs : kChunkPairs;
  for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
    const int64_t p1 = std::min(pairs, p0 + chunk);
    const View v = src.chunk(index, 1, p0, p1, !single || tiling.rows(0) >= kPrefetchRows);
    for (int t = 0; t < tiling.count; ++t) {
      const bool prefetch = Source::kInPlace && (single ? tiling.rows(0) >= kPrefetchRows : t == 0);
      tile_fn(tiling.rows(t), prefetch)(Rows{P.x + tiling.start[t] * P.xs, P.xs, P.K}, v.w, p0, p1, p0 == 0,
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
      wide_tile_fn(tiling.rows(t), Source::kInPlace && t == 0)(Rows{P.x + tiling.start[t] * P.xs, P.xs, P.K}, v.w, p0,
                                                               p1, p0 == 0, sums + tiling.start[t] * kSumsRow,
                                                               v.panel_stride);
  }
  for (int t = 0; t < tiling.count; ++t)
    emit(P, sums + tiling.start[t] * kSumsRow, tiling.start[t], tiling.rows(t), c0, 2 * kPanel);
}

// `make_source(buffer)` gives each thread its Source (`buffer`: that thread's decode buffer).
template <class MakeSource>
void gemm_pass(const Problem& P, MakeSource make_source) {
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
constexpr int kInt4TileRows = 12;       // 12 x 2 group sums + 2 weight vectors + 2 constants

struct Int4Problem {
  const uint8_t* codes;
  const uint16_t* scales;  // per panel and group: d[32] then m[32], f16
  const float* sx;         // [M, G]: each row's sum of x over each group
  int64_t G, group_pairs;
};

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)

// Rows [0, MR) x one int4 panel over k-pairs [p0, p1) (whole groups); adds into `sums` (from zero
// when `first`). Each group: sums of x * (128 + q) in registers, then sums += d * that + (m - 128 d)
// * sx, per column. Two k-pairs a step: one 64-byte load holds their four weight vectors.
// NOTE: one or two rows keep separate sums for the two k-pairs, so that four chains of
// vdpbf16ps hide its latency.
template <int MR, bool PF>
void int4_tile(const Rows& rows, const Int4Problem& Q, const uint8_t* w, const uint16_t* dm, const float* sx,
               int64_t p0, int64_t p1, bool first, Sums sums) {
  constexpr int kSplit = MR <= 2 ? 2 : 1;
  if (first)
    for (int m = 0; m < MR; ++m) std::fill(sums + m * kSumsRow, sums + m * kSumsRow + kPanel, 0.f);
  const __m512i low = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
  int64_t g = p0 / Q.group_pairs;
  for (int64_t g0 = p0; g0 < p1; g0 += Q.group_pairs, ++g) {
    __m512 part[MR][2 * kSplit];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
      for (int i = 0; i < 2 * kSplit; ++i) part[m][i] = _mm512_setzero_ps();
    for (int64_t p = g0; p < g0 + Q.group_pairs; p += 2) {
      const uint8_t* src = w + p * kInt4PairBytes;
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * kInt4PairBytes), _MM_HINT_T1);
      const __m512i raw = _mm512_loadu_si512(src);
      // bf16 0x4300 | q is exactly 128 + q (the offset term takes the 128 back out)
      __m512bh v[4];
      v[0] = (__m512bh)_mm512_ternarylogic_epi32(raw, low, exponent, 0xEA);
      v[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), low, exponent, 0xEA);
      v[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 8), low, exponent, 0xEA);
      v[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(raw, 12), exponent);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          uint32_t pair;
          std::memcpy(&pair, rows.x + m * rows.stride + 2 * (p + h), sizeof(pair));
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          __m512* acc = part[m] + (kSplit == 2 ? 2 * h : 0);
          acc[0] = _mm512_dpbf16_ps(acc[0], v[2 * h], xv);
          acc[1] = _mm512_dpbf16_ps(acc[1], v[2 * h + 1], xv);
        }
      }
    }
    const uint16_t* s = dm + g * 2 * kPanel;
    __m512 d[2], off[2];
    for (int b = 0; b < 2; ++b) {
      d[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b * kBlock)));
      off[b] = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d[b],
                                _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kPanel + b * kBlock))));
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512 xs = _mm512_set1_ps(sx[m * Q.G + g]);
      for (int b = 0; b < 2; ++b) {
        __m512 sum = part[m][b];
        if constexpr (kSplit == 2) sum = _mm512_add_ps(sum, part[m][2 + b]);
        float* out = sums + m * kSumsRow + b * kBlock;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(off[b], xs, _mm512_fmadd_ps(d[b], sum, _mm512_loadu_ps(out))));
      }
    }
  }
}

#else

template <int MR, bool PF>
void int4_tile(const Rows& rows, const Int4Problem& Q, const uint8_t* w, const uint16_t* dm, const float* sx,
               int64_t p0, int64_t p1, bool first, Sums sums) {
  if (first)
    for (int m = 0; m < MR; ++m) std::fill(sums + m * kSumsRow, sums + m * kSumsRow + kPanel, 0.f);
  for (int64_t g0 = p0; g0 < p1; g0 += Q.group_pairs) {
    const int64_t g = g0 / Q.group_pairs;
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < kPanel; ++c) {
        float part = 0.f;
        for (int64_t p = g0; p < g0 + Q.group_pairs; ++p) {
          for (int e = 0; e < 2; ++e) {
            const uint8_t b8 = w[(p & ~int64_t{1}) * kInt4PairBytes + ((c % kBlock) * 2 + e) * 2 + (p & 1)];
            const int q = c < kBlock ? (b8 & 15) : (b8 >> 4);
            part += static_cast<float>(128 + q) * to_float(rows.x[m * rows.stride + 2 * p + e]);
          }
        }
        const float d = f16_from_bits(dm[g * 2 * kPanel + c]), mm = f16_from_bits(dm[g * 2 * kPanel + kPanel + c]);
        sums[m * kSumsRow + c] += d * part + (mm - 128.f * d) * sx[m * Q.G + g];
      }
  }
}

#endif

using Int4TileFn = void (*)(const Rows&, const Int4Problem&, const uint8_t*, const uint16_t*, const float*, int64_t,
                            int64_t, bool, Sums);

template <bool PF, int... I>
constexpr std::array<Int4TileFn, kInt4TileRows> make_int4_tiles(std::integer_sequence<int, I...>) {
  return {int4_tile<I + 1, PF>...};
}
constexpr std::array<std::array<Int4TileFn, kInt4TileRows>, 2> kInt4Tiles{
    make_int4_tiles<false>(std::make_integer_sequence<int, kInt4TileRows>()),
    make_int4_tiles<true>(std::make_integer_sequence<int, kInt4TileRows>())};

// All M rows over int4 panel `index`: each chunk of K (whole groups) by every tile in turn, the
// chunk's codes L1-resident after the first.
void int4_panel(const Problem& P, const Int4Problem& Q, const Tiling& tiling, int64_t index, float* sums) {
  const int64_t pairs = P.K / 2, c0 = index * kPanel;
  const uint8_t* w = Q.codes + index * kInt4PairBytes * pairs;
  const uint16_t* dm = Q.scales + index * Q.G * 2 * kPanel;
  const bool single = tiling.count == 1;
  const int64_t chunk = single ? pairs : std::max<int64_t>(kChunkPairs, Q.group_pairs);
  for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
    const int64_t p1 = std::min(pairs, p0 + chunk);
    for (int t = 0; t < tiling.count; ++t) {
      const bool prefetch = single ? tiling.rows(0) >= kPrefetchRows : t == 0;
      kInt4Tiles[prefetch][tiling.rows(t) - 1](Rows{P.x + tiling.start[t] * P.xs, P.xs, P.K}, Q, w, dm,
                                               Q.sx + tiling.start[t] * Q.G, p0, p1, p0 == 0,
                                               sums + tiling.start[t] * kSumsRow);
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

void gemm(const bf16* x, int64_t xs, const bf16* packed, const bf16* bias, bf16* y, int64_t ys, int64_t M, int64_t N,
          int64_t K) {
  all_passes(x, xs, nullptr, bias, y, ys, M, N, K, [&](const Problem& P) {
    gemm_pass(P, [&](bf16*) { return Bf16Panels{packed, num_pairs(K)}; });
  });
}

// K a multiple of gs, gs a multiple of 16; x's group sums from the bf16 values themselves.
void qgemm_int4(const bf16* x, int64_t xs, const uint8_t* codes, const uint16_t* scales, int64_t gs, const bf16* bias,
                bf16* y, int64_t ys, int64_t M, int64_t N, int64_t K) {
  const int64_t G = K / gs;
  thread_local std::vector<float> sx;
  all_passes(x, xs, nullptr, bias, y, ys, M, N, K, [&](const Problem& P) {
    sx.resize(P.M * G);
    for (int64_t m = 0; m < P.M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const bf16* xg = P.x + m * P.xs + g * gs;
        Vf acc = load(xg);
        for (int64_t i = kBlock; i < gs; i += kBlock) acc = acc + load(xg + i);
        sx[m * G + g] = reduce_add(acc);
      }
    int4_pass(P, Int4Problem{codes, scales, sx.data(), G, gs / 2});
  });
}

void qgemm_int8(const bf16* x, int64_t xs, const int8_t* codes, const float* scales, const bf16* bias, bf16* y,
                int64_t ys, int64_t M, int64_t N, int64_t K) {
  all_passes(x, xs, scales, bias, y, ys, M, N, K, [&](const Problem& P) {
    gemm_pass(P, [&](bf16* buffer) { return Int8Panels{codes, num_pairs(K), buffer}; });
  });
}

void gemm_pack(const bf16* w, int64_t w_stride, bf16* packed, int64_t N, int64_t K) {
  const int64_t pairs = num_pairs(K);
  for (int64_t n = 0; n < N; ++n) {
    bf16* panel = packed + n / kPanel * kPanel * 2 * pairs;
    for (int64_t k = 0; k < K; ++k) panel[(k / 2) * kPanelPair + (n % kPanel) * 2 + (k & 1)] = w[n * w_stride + k];
  }
}

}  // namespace pagoda

extern "C" int64_t pagoda_gemm_int8_format() { return pagoda::kInt8Format; }

extern "C" int64_t pagoda_gemm_packed_size_bf16(int64_t N, int64_t K) { return pagoda::gemm_packed_size(N, K); }

// Writes W[N, K] (row stride w_stride) into `packed` (gemm_packed_size elements, zeroed).
extern "C" void pagoda_gemm_pack_bf16(const void* w, int64_t w_stride, void* packed, int64_t N, int64_t K) {
  pagoda::gemm_pack(static_cast<const pagoda::bf16*>(w), w_stride, static_cast<pagoda::bf16*>(packed), N, K);
}

// bf16: y = x . W^T; int8: the codes (panel layout, zero padded) times one fp32 scale per
// column; int4: W = q * d + m by groups of gs along K, q as nibbles in the panel layout (64 bytes
// per panel and two k-pairs, see the top of this file), d and m as f16 per panel and group (d for
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
      pagoda::qgemm_int8(xb, x_stride, static_cast<const int8_t*>(w.data), static_cast<const float*>(w.scales), b, yb,
                         y_stride, M, w.n, w.k);
      break;
    case pagoda::kPackedInt4:
      pagoda::qgemm_int4(xb, x_stride, static_cast<const uint8_t*>(w.data), static_cast<const uint16_t*>(w.scales),
                         w.group_size, b, yb, y_stride, M, w.n, w.k);
      break;
    default:
      pagoda::gemm(xb, x_stride, static_cast<const bf16*>(w.data), b, yb, y_stride, M, w.n, w.k);
  }
}
