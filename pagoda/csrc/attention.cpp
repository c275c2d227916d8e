// Paged attention for CPUs: any number of new query rows per sequence, K/V read in place.
//
// Sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]) of `q`; they are the
// last rows of its context of seq_lens[s] tokens, whose K/V (the new rows' included) are
// already in the pool. Row i of n sits at position seq_lens[s] - n + i and attends causally
// to positions [p - window + 1, p] (window > 0) or [0, p]. One pass, online softmax, fp32
// accumulation whatever the storage dtype. The pool may hold K/V in another dtype than q and
// the output (fp8: one byte, with per-tensor scales `k_scale`/`v_scale` folded into the
// query scale and the output).
// Work items are (sequence, tile of up to 16 query rows, KV heads): every query head of a GQA
// group, and every row of the tile, is scored against one read of each K/V row. A small batch
// takes one KV head per item, so two cores share even a single sequence; a large batch takes
// all KV heads per item, so that each item reads whole pool blocks.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm.h"
#include "parallel.h"
#include "vec.h"

namespace pagoda {
namespace {

// The largest head_dim the accumulators hold (kMaxHeadDim / kLanes vectors a row); Python
// keeps larger heads on the torch path (PagedAttention.supports_native, MAX_NATIVE_HEAD_DIM).
constexpr int kMaxHeadDim = 256;
constexpr int kQueryTile = 16;
constexpr int kAmxQueryTile = 32;  // query rows of a prefill item on AMX (amx_query_tile)
constexpr int kKeyTile = 16;
constexpr int kSpanKeys = 128;  // keys a step of the AMX prefill path (several key tiles)
constexpr int kPrefetchTiles = 4;
// Keys a decode item scores before their softmax and P.V (a chunk of whole key tiles): the max,
// sums and rescaling run once a chunk, not once a 16-key tile (fewer horizontal reductions; no
// faster warm on the AMX Xeon of docs/performance.md, where decode attention waits on memory).
// A row's scores sit kScoreStride apart (a tile's 16 lanes stored past the chunk's last key
// stay inside the row).
constexpr int kChunkKeys = 256;
constexpr int kScoreStride = kChunkKeys + 16;
constexpr int kItemsPerThread = 8;
constexpr int64_t kMinParallelKeyRows = 4096;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct AttnArgs {
  const int64_t* block_tables;
  const int64_t* seq_lens;
  const int64_t* query_start_loc;
  int num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_stride, out_stride;
  float scale;  // softmax scale times k_scale
  float v_scale;
  int64_t window;
};

// Per-item scratch: query rows, accumulators, running max/sum, one tile of K/V and scores.
struct KeyTile {
  int64_t key0;
  int n;
  int64_t offset;
};

struct Scratch {
  std::vector<float> qf, acc, m, l, kf, vf, s;
  void resize(int rows, int d) {
    qf.resize(size_t(rows) * d);
    acc.assign(size_t(rows) * d, 0.f);
    m.assign(rows, kNegInf);
    l.assign(rows, 0.f);
    kf.resize(size_t(kKeyTile) * d);
    vf.resize(size_t(kKeyTile) * d);
    s.resize(size_t(rows) * kScoreStride);
  }
};

// Loads one byte of every cache line of `rows` rows of `bytes` bytes, `stride` elements apart.
// NOTE: plain loads, not prefetch instructions: on this machine (Zen 4 under KVM) prefetcht0
// ahead of the tile changed nothing, while touching the lines cut cold decode attention by
// ~25% (docs/performance.md, Kernels).
template <typename T>
inline void touch_rows(const T* p, int rows, int64_t stride, int bytes) {
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < bytes; b += 64) (void)*(reinterpret_cast<const volatile char*>(p + r * stride) + b);
}

// Prefetches every cache line of those rows into L2 (prefetcht1): no load waits on them.
template <typename T>
inline void prefetch_rows(const T* p, int rows, int64_t stride, int bytes) {
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p + r * stride) + b, 0, 2);
}

template <typename T>
inline void widen_row(const T* src, float* dst, int d) {
  for (int i = 0; i < d; i += kLanes) store(dst + i, load(src + i, tail_mask(d - i)), tail_mask(d - i));
}

inline float dot(const float* a, const float* b, int d) {
  Vf acc = vzero();
  for (int i = 0; i < d; i += kLanes) {
    const Mask m = tail_mask(d - i);
    acc = vfma(load(a + i, m), load(b + i, m), acc);
  }
  return reduce_add(acc);
}

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
constexpr bool kNativeBf16Dot = true;

// Lane j of the result = the sum of v[j]'s 16 lanes: four levels of shuffles and adds (45
// instructions for 16 sums, against ~8 for each sum reduced alone).
inline __m512 sum_each16(__m512 v[16]) {
  __m512 t[8], u[4], x[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}

// scale * (q . k[j]) for the n (<= 16) keys k[j] (row stride k_stride) into s[0..16): 16 bf16
// dot products reduced together; lanes past n repeat key n - 1 (the caller masks them).
// NOTE: always 16 keys, so that the sums stay in registers (a run-time count kept them on
// the stack).
inline void score_keys_bf16_row(const bf16* q, const bf16* k, int64_t k_stride, int n, int d, float scale,
                                float* s) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int i = 0; i < d; i += 32) {
    const __mmask32 m = tail_mask32(d - i);
    const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + i);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const bf16* kj = k + std::min(j, n - 1) * k_stride + i;
      acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, kj));
    }
  }
  _mm512_storeu_ps(s, _mm512_mul_ps(sum_each16(acc), _mm512_set1_ps(scale)));
}
#else
inline void score_keys_bf16_row(const bf16*, const bf16*, int64_t, int, int, float, float*) { std::abort(); }
constexpr bool kNativeBf16Dot = false;
#endif

template <typename T, typename C>
struct Tile {
  const T* q;        // first query row of the tile, head kvh * group
  const C* k;        // first key of the key tile (row stride kv_stride)
  const C* v;
  int64_t kv_stride;
  int rows, group, n;  // query rows x heads in the group; keys in the tile
};

// Scores of every (row, key) of the tile into s[row * kScoreStride + j0 + j] (j0: the tile's
// first key in its chunk; the bf16 path writes 16 lanes, the next tile's keys overwriting those
// past this tile's).
template <typename T, typename C>
void score_tile(const Tile<T, C>& t, const AttnArgs& a, Scratch& w, int j0) {
  const int d = a.head_dim;
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16> && kNativeBf16Dot) {
    static_assert(kKeyTile == 16);
    for (int r = 0; r < t.rows * t.group; ++r) {
      const bf16* qr = t.q + (r / t.group) * a.q_stride + (r % t.group) * d;
      score_keys_bf16_row(qr, t.k, t.kv_stride, t.n, d, a.scale, &w.s[r * kScoreStride + j0]);
    }
  } else {
    for (int j = 0; j < t.n; ++j) widen_row(t.k + j * t.kv_stride, &w.kf[j * d], d);
    for (int r = 0; r < t.rows * t.group; ++r)
      for (int j = 0; j < t.n; ++j) w.s[r * kScoreStride + j0 + j] = dot(&w.qf[r * d], &w.kf[j * d], d);
  }
}

// Lanes i of a 16-key vector starting at key j with lo <= j + i < hi.
inline Mask key_range_mask(int j, int lo, int hi) {
  return Mask(tail_mask(std::clamp(hi - j, 0, kLanes)) & ~tail_mask(std::clamp(lo - j, 0, kLanes)));
}

// Row r's share of a chunk of n keys: running max and sum updated, the accumulator rescaled,
// and the chunk's probabilities left in s[r * kScoreStride + j] (0 where the row may not look:
// outside keys [lo, hi)).
inline void softmax_chunk(Scratch& w, int r, int d, int n, int lo, int hi) {
  float* srow = &w.s[r * kScoreStride];
  if (lo >= hi) {
    for (int j = 0; j < n; j += kLanes) store(srow + j, vzero());
    return;
  }
  Vf top = vset1(kNegInf);
  for (int j = lo / kLanes * kLanes; j < hi; j += kLanes) top = vmax(top, select(key_range_mask(j, lo, hi), load(srow + j), kNegInf));
  const float m_new = std::max(w.m[r], reduce_max(top));
  const Vf m = vset1(m_new);
  Vf sum = vzero();
  for (int j = 0; j < n; j += kLanes) {
    const Vf p = select(key_range_mask(j, lo, hi), vexp(load(srow + j) - m), 0.f);
    store(srow + j, p);
    sum = sum + p;
  }
  // NOTE: the max seldom moves after the first chunk; exp(0) skipped (a libm call a row).
  const float corr = m_new == w.m[r] ? 1.f : std::exp(w.m[r] - m_new);
  w.l[r] = w.l[r] * corr + reduce_add(sum);
  w.m[r] = m_new;
  if (corr != 1.f) {
    float* acc = &w.acc[r * d];
    for (int i = 0; i < d; i += kLanes) store(acc + i, load(acc + i, tail_mask(d - i)) * vset1(corr), tail_mask(d - i));
  }
}

// acc[r] += sum_j p[r][j] * v[j] for RB rows at once, DC 16-lane chunks of head_dim held in
// registers (DC = 0: head_dim known only at run time). V rows come from `v` (row stride
// v_stride): the tile widened to fp32 (w.vf), or, when one pass covers every row, the pool
// itself, widened in registers as it is read.
// NOTE: ROWS (<= RB) is a template argument: with a run-time row count the compiler kept x
// on the stack, a store and a reload around every FMA (1.6x a warm decode call on Zen 4).
template <int DC, int ROWS, typename V>
void accumulate_exact_rows(Scratch& w, const V* v, int64_t v_stride, int r0, int n, int d, int j0) {
  constexpr int kMax = DC > 0 ? DC : kMaxHeadDim / kLanes;
  const int dc = DC > 0 ? DC : (d + kLanes - 1) / kLanes;
  Vf x[ROWS][kMax];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < dc; ++c) x[r][c] = load(&w.acc[(r0 + r) * d + c * kLanes], tail_mask(d - c * kLanes));
  for (int j = 0; j < n; ++j) {
    const V* vj = v + j * v_stride;
    for (int c = 0; c < dc; ++c) {
      const Vf vv = load(vj + c * kLanes, tail_mask(d - c * kLanes));
      for (int r = 0; r < ROWS; ++r) x[r][c] = vfma(vset1(w.s[(r0 + r) * kScoreStride + j0 + j]), vv, x[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < dc; ++c) store(&w.acc[(r0 + r) * d + c * kLanes], x[r][c], tail_mask(d - c * kLanes));
}

template <int DC, int RB, typename V>
void accumulate_rows(Scratch& w, const V* v, int64_t v_stride, int r0, int rows, int n, int d, int j0) {
  static_assert(RB >= 1 && RB <= 4);
  switch (rows) {
    case 1: accumulate_exact_rows<DC, 1>(w, v, v_stride, r0, n, d, j0); break;
    case 2: if constexpr (RB >= 2) accumulate_exact_rows<DC, 2>(w, v, v_stride, r0, n, d, j0); break;
    case 3: if constexpr (RB >= 3) accumulate_exact_rows<DC, 3>(w, v, v_stride, r0, n, d, j0); break;
    case 4: if constexpr (RB >= 4) accumulate_exact_rows<DC, 4>(w, v, v_stride, r0, n, d, j0); break;
    default: std::abort();
  }
}

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
// 32 dims of two keys' values, a and b, as bf16 key pairs (a[i], b[i]): dims 0-15 into lo, 16-31
// into hi (what vdpbf16ps takes against a probability pair).
inline void interleave_pairs(__m512i a, __m512i b, __m512i& lo, __m512i& hi) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i order = _mm512_load_si512(kLo);
  lo = _mm512_permutex2var_epi16(a, order, b);
  hi = _mm512_permutex2var_epi16(a, _mm512_add_epi16(order, _mm512_set1_epi16(16)), b);
}

// As accumulate_exact_rows on bf16 pairs, for a decode tile (ROWS <= 4 query vectors, n <= 16
// keys, DC even): each key pair's values interleaved in registers (two vpermt2w a 32-dim chunk)
// and P rounded to bf16, as the prefill's pairs path rounds it (softmax_pairs; the sums l keep the
// fp32 probabilities): one vdpbf16ps a row per 16 dims and two keys, where the FMAs took a
// widened value and an FMA per key.
template <int DC, int ROWS>
void accumulate_pairs_rows(Scratch& w, const bf16* v, int64_t v_stride, int n, int d, int j0) {
  static_assert(DC > 0 && DC % 2 == 0);
  alignas(32) uint16_t pb[ROWS][kKeyTile];  // each row's probabilities in bf16, zero past n
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  __m512 x[ROWS][DC];
  for (int r = 0; r < ROWS; ++r) {
    const __m256bh p = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, &w.s[r * kScoreStride + j0]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r]), (__m256i)p);
    for (int c = 0; c < DC; ++c) x[r][c] = _mm512_loadu_ps(&w.acc[r * d + c * kLanes]);
  }
  for (int j = 0; j < n; j += 2) {
    const bf16* a = v + j * v_stride;
    __m512bh vv[DC];
#pragma GCC unroll 4
    for (int c = 0; c < DC / 2; ++c) {
      __m512i lo, hi;
      interleave_pairs(_mm512_loadu_si512(a + 32 * c),
                       j + 1 < n ? _mm512_loadu_si512(a + v_stride + 32 * c) : _mm512_setzero_si512(), lo, hi);
      vv[2 * c] = (__m512bh)lo;
      vv[2 * c + 1] = (__m512bh)hi;
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, &pb[r][j], sizeof pair);
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int c = 0; c < DC; ++c) x[r][c] = _mm512_dpbf16_ps(x[r][c], vv[c], pv);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(&w.acc[r * d + c * kLanes], x[r][c]);
}

template <int DC>
void accumulate_pairs(Scratch& w, const bf16* v, int64_t v_stride, int rows, int n, int d, int j0) {
  switch (rows) {
    case 1: accumulate_pairs_rows<DC, 1>(w, v, v_stride, n, d, j0); break;
    case 2: accumulate_pairs_rows<DC, 2>(w, v, v_stride, n, d, j0); break;
    case 3: accumulate_pairs_rows<DC, 3>(w, v, v_stride, n, d, j0); break;
    case 4: accumulate_pairs_rows<DC, 4>(w, v, v_stride, n, d, j0); break;
    default: std::abort();
  }
}
#endif

template <int DC>
constexpr int kRowBlock = DC > 0 && DC <= 4 ? 4 : (DC > 0 && DC <= 8 ? 2 : 1);

// NOTE: a decode tile (a GQA group of up to kRowBlock query heads, one row) reads V straight
// from the pool: widening it into w.vf first cost a store and a reload per value, ~20% of a
// warm decode call.
template <int DC, typename T, typename C>
void accumulate(const Tile<T, C>& t, Scratch& w, int rows, int d, int j0, bool pairs) {
  constexpr int RB = kRowBlock<DC>;
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, bf16> && DC > 0 && DC % 2 == 0) {
    if (pairs && rows <= 4) {
      accumulate_pairs<DC>(w, t.v, t.kv_stride, rows, t.n, d, j0);
      return;
    }
  }
#endif
  (void)pairs;
  if (rows <= RB) {
    accumulate_rows<DC, RB>(w, t.v, t.kv_stride, 0, rows, t.n, d, j0);
    return;
  }
  for (int j = 0; j < t.n; ++j) widen_row(t.v + j * t.kv_stride, &w.vf[j * d], d);
  for (int r0 = 0; r0 < rows; r0 += RB)
    accumulate_rows<DC, RB>(w, w.vf.data(), int64_t(d), r0, std::min(RB, rows - r0), t.n, d, j0);
}

// One head's query rows over the key tiles [t0, t1) (a chunk of n keys from key0): every tile
// scored, one softmax step a row, then P.V tile by tile (`touch` called with each tile index
// scored, to read ahead).
template <int DC, typename T, typename C, typename Touch>
void attend_chunk(const Tile<T, C>& head, const std::vector<KeyTile>& tiles, int t0, int t1, const AttnArgs& a,
                  Scratch& w, int64_t pos0, bool pairs, Touch&& touch) {
  const int d = a.head_dim, vectors = head.rows * head.group;
  const int64_t key0 = tiles[t0].key0;
  int n = 0;
  for (int i = t0; i < t1; n += tiles[i].n, ++i) {
    touch(i);
    Tile<T, C> t = head;
    t.k += tiles[i].offset, t.n = tiles[i].n;
    score_tile(t, a, w, n);
  }
  for (int r = 0; r < vectors; ++r) {
    const int64_t pos = pos0 + r / head.group;
    const int64_t first = a.window > 0 ? pos - a.window + 1 : 0;
    const int lo = static_cast<int>(std::clamp<int64_t>(first - key0, 0, n));
    const int hi = static_cast<int>(std::clamp<int64_t>(pos + 1 - key0, 0, n));
    softmax_chunk(w, r, d, n, lo, hi);
  }
  for (int i = t0, j0 = 0; i < t1; j0 += tiles[i].n, ++i) {
    Tile<T, C> t = head;
    t.v += tiles[i].offset, t.n = tiles[i].n;
    accumulate<DC>(t, w, vectors, d, j0, pairs);
  }
}

// Loads query rows of head `kvh` (scaled, fp32) into w.qf and clears its running state.
template <typename T>
void start_head(const T* q, const AttnArgs& a, Scratch& w, int rows, int group) {
  const int d = a.head_dim;
  w.resize(rows * group, d);
  for (int r = 0; r < rows * group; ++r) {
    const T* src = q + (r / group) * a.q_stride + (r % group) * d;
    for (int i = 0; i < d; ++i) w.qf[r * d + i] = to_float(src[i]) * a.scale;
  }
}

template <typename T>
void finish_head(T* out, const AttnArgs& a, const Scratch& w, int rows, int group) {
  const int d = a.head_dim;
  for (int r = 0; r < rows * group; ++r) {
    T* dst = out + (r / group) * a.out_stride + (r % group) * d;
    const float inv = w.l[r] > 0.f ? a.v_scale / w.l[r] : 0.f;
    for (int i = 0; i < d; i += kLanes) {
      const Mask m = tail_mask(d - i);
      store(dst + i, load(&w.acc[r * d + i], m) * vset1(inv), m);
    }
  }
}

// Key tiles [lo, hi) of a sequence: start, length, element offset of KV head 0's first row.
void list_tiles(const AttnArgs& a, int64_t seq, int64_t lo, int64_t hi, std::vector<KeyTile>& tiles) {
  const int64_t* table = a.block_tables + seq * a.max_blocks;
  const int bs = a.block_size;
  tiles.clear();
  for (int64_t key0 = lo; key0 < hi;) {
    const int64_t blk = key0 / bs, in_blk = key0 % bs;
    const int n = static_cast<int>(std::min<int64_t>({kKeyTile, bs - in_blk, hi - key0}));
    tiles.push_back({key0, n, (table[blk] * bs + in_blk) * a.num_kv_heads * a.head_dim});
    key0 += n;
  }
}

// One work item: query rows [row0, row0 + 16) of `seq` for KV heads [h0, h0 + nh), every
// head's rows scored and accumulated tile by tile over the key tiles read once.
// NOTE: blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at every
// block edge; the tile kPrefetchTiles ahead is touched while this one is computed.
template <int DC, typename T, typename C>
void attend_item(const T* q, const C* k_cache, const C* v_cache, T* out, const AttnArgs& a,
                 int64_t seq, int h0, int nh, int64_t row0, int rows) {
  const int d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t q_begin = a.query_start_loc[seq], qlen = a.query_start_loc[seq + 1] - q_begin;
  const int64_t pos0 = a.seq_lens[seq] - qlen + row0;
  const int64_t kv_stride = int64_t(a.num_kv_heads) * d;
  thread_local std::vector<Scratch> heads;
  thread_local std::vector<KeyTile> tiles;
  if (static_cast<int>(heads.size()) < nh) heads.resize(nh);
  const T* q_rows = q + (q_begin + row0) * a.q_stride;
  for (int h = 0; h < nh; ++h) start_head(q_rows + int64_t(h0 + h) * group * d, a, heads[h], rows, group);
  list_tiles(a, seq, a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0, pos0 + rows, tiles);
  const int num_tiles = static_cast<int>(tiles.size());
  const int row_bytes = nh * d * static_cast<int>(sizeof(C));
  auto touch = [&](int i) {
    if (i >= num_tiles) return;
    const int64_t offset = tiles[i].offset + int64_t(h0) * d;
    touch_rows(k_cache + offset, tiles[i].n, kv_stride, row_bytes);
    touch_rows(v_cache + offset, tiles[i].n, kv_stride, row_bytes);
    if (i + kPrefetchTiles < num_tiles) {  // and the tile after that into L2 (prefetcht1)
      const int64_t ahead = tiles[i + kPrefetchTiles].offset + int64_t(h0) * d;
      prefetch_rows(k_cache + ahead, tiles[i + kPrefetchTiles].n, kv_stride, row_bytes);
      prefetch_rows(v_cache + ahead, tiles[i + kPrefetchTiles].n, kv_stride, row_bytes);
    }
  };
  for (int i = 0; i < kPrefetchTiles; ++i) touch(i);
  // NOTE: P.V on bf16 pairs where vdpbf16ps wins this CPU's GEMM at this many rows (the measured
  // choice the prefill tiles follow too); Q.K is on bf16 pairs wherever the build has them.
  const bool pairs = kNativeBf16Dot && std::is_same_v<C, bf16> && bf16_dot_wins(rows * group);
  for (int t0 = 0; t0 < num_tiles;) {
    int t1 = t0, n = 0;
    for (; t1 < num_tiles && n + tiles[t1].n <= kChunkKeys; ++t1) n += tiles[t1].n;
    for (int h = 0; h < nh; ++h) {
      const int64_t offset = int64_t(h0 + h) * d;
      const Tile<T, C> head{q_rows + int64_t(h0 + h) * group * d, k_cache + offset, v_cache + offset,
                            kv_stride, rows, group, 0};
      // NOTE: the first head's scores read ahead for every head (the rows hold all nh heads)
      attend_chunk<DC>(head, tiles, t0, t1, a, heads[h], pos0, pairs, [&](int i) {
        if (h == 0) touch(i + kPrefetchTiles);
      });
    }
    t0 = t1;
  }
  T* out_rows = out + (q_begin + row0) * a.out_stride;
  for (int h = 0; h < nh; ++h) finish_head(out_rows + int64_t(h0 + h) * group * d, a, heads[h], rows, group);
}

// ---- Prefill tiles: many query vectors a tile, scored as one small GEMM per key tile.
//
// A tile of rows x group query vectors (R of them, rounded up to whole vectors in R16) keeps
// them transposed, qt[i][r], so that scores, max, sum and rescaling all run down the vector
// lanes, one lane a query vector: a key tile's scores are st[j][r] = sum_i k[j][i] * qt[i][r]
// (kKeyBlock keys x one 16-vector chunk in registers), with no horizontal reduction anywhere.
// The running max starts finite (kFloor), so a row whose keys are all masked so far gets
// exp(-inf - kFloor) = 0, never NaN. A decode tile (few vectors) keeps attend_item.
// bf16 (q and pool) on the avx512bf16 build, where vdpbf16ps wins the GEMM's measured tile
// choice: Q.K on bf16 pairs read from the pool (exact products), P rounded to bf16 as torch's
// CPU flash attention does and P.V on key pairs; twice the products an instruction
// (1.2-1.3x on a 2,000-token prompt's attention on Zen 4, docs/performance.md).
constexpr int kBlockMinVectors = 16;
constexpr int kKeyBlock = 4;
constexpr int kAccRows = 4;
constexpr float kFloor = -1e30f;

struct BlockScratch {
  std::vector<float> qt, kf, vf, st, m, l, acc, top;  // top: a span's raw score maxima (AMX spans)
  // bf16 pairs for vdpbf16ps: query vectors qp[(i / 2) * 2 r16 + 2 r + i % 2]; a tile's values
  // vp[(j / 2) * 2 d + 2 i + j % 2] and probabilities pp[(j / 2) * 2 r16 + 2 r + j % 2].
  std::vector<bf16> qp, vp, pp, kspan;  // kspan: a span's keys copied into whole tiles (AMX)
  int r16 = 0;
  void reset(int vectors, int d, bool pairs) {
    r16 = (vectors + kLanes - 1) / kLanes * kLanes;
    if (pairs) {
      qp.resize(size_t(d) * r16);  // NOTE: filled whole by load_queries, padding vectors included
      vp.resize(size_t(kSpanKeys) * d);  // NOTE: sized for AMX's spans, the pairs path uses a tile's
      pp.resize(size_t(kSpanKeys) * r16);
      kspan.resize(size_t(kSpanKeys + kKeyTile) * d);
    } else {
      qt.assign(size_t(d) * r16, 0.f);
      kf.resize(size_t(kKeyTile) * d);  // the key tile widened to fp32 (the FMA path only)
      vf.resize(size_t(kKeyTile) * d);
    }
    st.resize(size_t(kSpanKeys + kKeyTile) * r16);  // a span's scores and a tile's stored past it
    m.assign(r16, kFloor);
    l.assign(r16, 0.f);
    top.resize(r16);
    acc.assign(size_t(r16) * d, 0.f);  // r16 rows: the AMX tiles take 16 at a time
  }
};

// score.template operator()<KB>(j0, c) over every query chunk c of the tile and its n keys in
// blocks of kKeyBlock, then one by one.
template <class Score>
inline void for_key_blocks(int r16, int n, Score score) {
  for (int c = 0; c < r16; c += kLanes) {
    int j = 0;
    for (; j + kKeyBlock <= n; j += kKeyBlock) score.template operator()<kKeyBlock>(j, c);
    for (; j < n; ++j) score.template operator()<1>(j, c);
  }
}

// st[j][c..c+16) for keys [j0, j0 + KB) of the tile against query chunk c.
template <int KB>
inline void score_keys(BlockScratch& w, int d, int j0, int c) {
  Vf s[KB];
  for (int jj = 0; jj < KB; ++jj) s[jj] = vzero();
  const float* k = &w.kf[size_t(j0) * d];
  for (int i = 0; i < d; ++i) {
    const Vf qv = load(&w.qt[size_t(i) * w.r16 + c]);
    for (int jj = 0; jj < KB; ++jj) s[jj] = vfma(vset1(k[jj * d + i]), qv, s[jj]);
  }
  for (int jj = 0; jj < KB; ++jj) store(&w.st[size_t(j0 + jj) * w.r16 + c], s[jj]);
}

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
// As score_keys, on bf16 pairs: query chunk c (qp) against keys [j0, j0 + KB) read from the
// pool, products exact and sums in fp32 (twice the FMAs' products an instruction where
// vdpbf16ps issues as fast as an FMA: Zen 4; not on the Intel of docs/performance.md).
template <int KB>
inline void score_keys_bf16(BlockScratch& w, const bf16* k, int64_t kv_stride, int d, int j0, int c, float scale) {
  __m512 s[KB];
  for (int jj = 0; jj < KB; ++jj) s[jj] = _mm512_setzero_ps();
  const bf16* q = &w.qp[size_t(c) * 2];
  for (int i = 0; i < d; i += 2) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + size_t(i) * w.r16);
    for (int jj = 0; jj < KB; ++jj) {
      int32_t pair;
      std::memcpy(&pair, k + (j0 + jj) * kv_stride + i, sizeof pair);
      s[jj] = _mm512_dpbf16_ps(s[jj], qv, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  for (int jj = 0; jj < KB; ++jj)
    _mm512_storeu_ps(&w.st[size_t(j0 + jj) * w.r16 + c], _mm512_mul_ps(s[jj], _mm512_set1_ps(scale)));
}

void score_tile_bf16(BlockScratch& w, const bf16* k, int64_t kv_stride, int d, int n, float scale) {
  for_key_blocks(w.r16, n, [&]<int KB>(int j, int c) { score_keys_bf16<KB>(w, k, kv_stride, d, j, c, scale); });
}

// The values of keys a and b (b null past the last key: zeros) interleaved into pairs at dst (2d).
void pair_rows(const bf16* a, const bf16* b, bf16* dst, int d) {
  for (int i = 0; i < d; i += 32) {
    const __mmask32 m = tail_mask32(d - i);
    __m512i lo, hi;
    interleave_pairs(_mm512_maskz_loadu_epi16(m, a + i),
                     b != nullptr ? _mm512_maskz_loadu_epi16(m, b + i) : _mm512_setzero_si512(), lo, hi);
    _mm512_storeu_si512(dst + 2 * i, lo);
    if (d - i > 16) _mm512_storeu_si512(dst + 2 * i + 32, hi);
  }
}

// The tile's values as key pairs (vp), a zero row after an odd last key.
void pair_values(BlockScratch& w, const bf16* v, int64_t kv_stride, int d, int n) {
  for (int j = 0; j < n; j += 2)
    pair_rows(v + j * kv_stride, j + 1 < n ? v + (j + 1) * kv_stride : nullptr, &w.vp[size_t(j) * d], d);
}

// 2^t for t <= 0 (-inf included): 2^floor(t) times a degree-4 polynomial in t - floor(t), in
// [0, 1) (coefficients fitted for least relative error, at most 2.7e-6 in fp32: far below the
// bf16 rounding the probabilities get next). vreduceps takes the remainder in one instruction
// and vscalefps floors t itself; -inf gives a remainder of 0 and 2^-inf = 0, so no clamp.
inline __m512 exp2_for_pairs(__m512 t) {
  const __m512 r = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.353379339e-2f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.201172084e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.414429784e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.930036544e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.000002623f));
  return _mm512_scalef_ps(p, t);
}

// Online softmax over n scores down the lanes, as softmax_block (times `scale`; corr, l and m
// alike), its probabilities written as they are made straight into bf16 key pairs (pp), the
// layout the pair products read (rounded as torch's CPU flash attention rounds P for its bf16
// product with V); st is only read. The sums take the fp32 probabilities.
void softmax_pairs(BlockScratch& w, int n, float scale, float* corr, const float* known_top) {
  alignas(64) static constexpr uint16_t kPairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512i order = _mm512_load_si512(kPairs);
  const float* st = w.st.data();  // NOTE: w is thread_local: its fields read once, not per store
  bf16* pp = w.pp.data();
  float *m = w.m.data(), *l = w.l.data();
  const int64_t r16 = w.r16;
  const __m512 f = _mm512_set1_ps(scale), f2 = _mm512_set1_ps(scale * kLog2e);
  for (int c = 0; c < r16; c += kLanes) {
    const __m512 m_old = _mm512_loadu_ps(&m[c]);
    int j = 0;
    __m512 top;
    if (known_top != nullptr) {
      top = _mm512_loadu_ps(&known_top[c]);
    } else {
      __m512 raw[4];  // NOTE: four running maxima, so that the loads do not wait on one chain
      for (auto& x : raw) x = _mm512_set1_ps(kNegInf);
      for (; j + 4 <= n; j += 4)
        for (int u = 0; u < 4; ++u) raw[u] = _mm512_max_ps(raw[u], _mm512_loadu_ps(&st[(j + u) * r16 + c]));
      for (; j < n; ++j) raw[0] = _mm512_max_ps(raw[0], _mm512_loadu_ps(&st[j * r16 + c]));
      top = _mm512_max_ps(_mm512_max_ps(raw[0], raw[1]), _mm512_max_ps(raw[2], raw[3]));
    }
    const __m512 mx = _mm512_max_ps(m_old, _mm512_mul_ps(top, f));
    const __m512 off = _mm512_mul_ps(mx, _mm512_set1_ps(-kLog2e));
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    const auto pair = [&](int j, __m512 a, __m512 b) {
      sum0 = _mm512_add_ps(sum0, a);
      sum1 = _mm512_add_ps(sum1, b);
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in the low half
      _mm512_storeu_si512(&pp[j * r16 + 2 * c], _mm512_permutexvar_epi16(order, both));
    };
    const auto p = [&](int j) { return exp2_for_pairs(_mm512_fmadd_ps(_mm512_loadu_ps(&st[j * r16 + c]), f2, off)); };
    for (j = 0; j + 4 <= n; j += 4) {  // NOTE: four exponentials in flight
      const __m512 a = p(j), b = p(j + 1), a2 = p(j + 2), b2 = p(j + 3);
      pair(j, a, b);
      pair(j + 2, a2, b2);
    }
    for (; j < n; j += 2) pair(j, p(j), j + 1 < n ? p(j + 1) : _mm512_setzero_ps());
    const __m512 g = vexp(Vf{_mm512_sub_ps(m_old, mx)}).v;
    _mm512_storeu_ps(&corr[c], g);
    _mm512_storeu_ps(&l[c], _mm512_fmadd_ps(_mm512_loadu_ps(&l[c]), g, _mm512_add_ps(sum0, sum1)));
    _mm512_storeu_ps(&m[c], mx);
  }
}

// acc[r][c0..c0 + 16 DC) = acc * corr[r] + sum over key pairs of p . v, RB rows from r0.
template <int DC, int RB>
void accumulate_rows_bf16(BlockScratch& w, const float* corr, int r0, int n, int d, int c0) {
  __m512 x[RB][DC];
  for (int r = 0; r < RB; ++r) {
    const __m512 f = _mm512_set1_ps(corr[r0 + r]);
    for (int c = 0; c < DC; ++c) x[r][c] = _mm512_mul_ps(_mm512_loadu_ps(&w.acc[size_t(r0 + r) * d + c0 + c * kLanes]), f);
  }
  for (int j = 0; j < n; j += 2) {
    __m512bh vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(&w.vp[size_t(j) * d + 2 * (c0 + c * kLanes)]);
    const bf16* p = &w.pp[size_t(j) * w.r16 + 2 * r0];
    for (int r = 0; r < RB; ++r) {
      int32_t pair;
      std::memcpy(&pair, p + 2 * r, sizeof pair);
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < DC; ++c) x[r][c] = _mm512_dpbf16_ps(x[r][c], vv[c], pb);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(&w.acc[size_t(r0 + r) * d + c0 + c * kLanes], x[r][c]);
}

template <int DC>
void accumulate_chunks_bf16(BlockScratch& w, const float* corr, int vectors, int n, int d, int c0) {
  int r0 = 0;
  for (; r0 + 4 <= vectors; r0 += 4) accumulate_rows_bf16<DC, 4>(w, corr, r0, n, d, c0);
  for (; r0 < vectors; ++r0) accumulate_rows_bf16<DC, 1>(w, corr, r0, n, d, c0);
}

// head_dim a whole number of 16-lane chunks, four a pass.
void accumulate_block_bf16(BlockScratch& w, const float* corr, int vectors, int n, int d) {
  int c = 0;
  for (; c + 4 * kLanes <= d; c += 4 * kLanes) accumulate_chunks_bf16<4>(w, corr, vectors, n, d, c);
  for (; c < d; c += kLanes) accumulate_chunks_bf16<1>(w, corr, vectors, n, d, c);
}

// ---- Spans on AMX (CPUs with AMX-BF16, where the GEMM's measured choice takes it): up to
// kSpanKeys keys (consecutive key tiles) at a time, for query tiles of kAmxQueryTile rows.
// Scores as S^T = K Q^T, so that they land in st[j][r] for the softmax down the lanes: the A
// tiles the key rows read in place from the pool (a span with a tile of fewer than 16 keys
// copied into zeroed rows first), 32 head dims each; the B tiles the query pairs qp; two key
// tiles by two query chunks a block. One softmax over the span (the scale applied there) that
// writes the probabilities as bf16 pairs (pp). P.V as O = P V with the span's probabilities as
// A tiles: pp's key pairs transposed 16 x 16 into rows (pa), the value pairs vp as B tiles, and
// two query chunks' outputs, 32 head dims at a time, kept in four sums tiles through the span's
// 32-key steps, loaded from and stored back to acc once. Every tile is 16 rows of 64 bytes (one
// configuration an item): 0-1 keys or probabilities, 1-2 values, 2-3 queries or probabilities,
// 4-7 sums. On the Sapphire Rapids of docs/performance.md a tile load costs about what a
// product does, so a block that loads each operand tile once for two products is what counts.
constexpr int kSpanPairs = kSpanKeys / 2;
constexpr int kPairStep = 16;  // key pairs a tile step

struct AmxTiles {
  bool configured = false;
  void configure();
  ~AmxTiles();
};

void AmxTiles::configure() {
  if (configured) return;
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.set(t, kLanes, 64);
  load_tile_config(c);
  configured = true;
}

AmxTiles::~AmxTiles() {
  if (configured) release_tiles();
}

// Raw scores of key tiles k0 and k1 (16 keys each, row strides s0 and s1 elements) against the
// query chunk at q (16 vectors of pairs, r16 apart) and, when TWO, the next chunk too, into st
// at dst (the first tile's first row, the chunk's column; the second tile's rows follow): a
// 2 x 2 block, keys in tiles 0-1, queries in 2-3, sums in 4-7.
template <bool TWO>
__attribute__((target("amx-tile,amx-bf16"))) void score_block_amx(const bf16* k0, int64_t s0, const bf16* k1,
                                                                 int64_t s1, const bf16* q, int64_t r16, int d,
                                                                 float* dst) {
  _tile_zero(4);
  _tile_zero(6);
  if constexpr (TWO) {
    _tile_zero(5);
    _tile_zero(7);
  }
  for (int i = 0; i < d; i += 32) {
    const bf16* qi = q + (i / 2) * 2 * r16;
    _tile_loadd(0, k0 + i, s0 * 2);
    _tile_loadd(2, qi, 4 * r16);
    _tile_loadd(1, k1 + i, s1 * 2);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(6, 1, 2);
    if constexpr (TWO) {
      _tile_loadd(3, qi + 32, 4 * r16);
      _tile_dpbf16ps(5, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  float* second = dst + kKeyTile * r16;
  _tile_stored(4, dst, 4 * r16);
  _tile_stored(6, second, 4 * r16);
  if constexpr (TWO) {
    _tile_stored(5, dst + 16, 4 * r16);
    _tile_stored(7, second + 16, 4 * r16);
  }
}

// The same for head_dim 64, a pair of key tiles against every query chunk: both tiles' two
// 32-dim halves stay loaded (tiles 0-3) while each chunk's query halves (4-5) multiply them into
// two sums (6-7), so that a product loads two thirds of a tile where the 2 x 2 block loads one.
// `track(c)` reads chunk c's maxima back after its sums are stored.
template <class Track>
__attribute__((target("amx-tile,amx-bf16"))) void score_pair_d64_amx(const bf16* k0, int64_t s0, const bf16* k1,
                                                                    int64_t s1, const bf16* q, int64_t r16,
                                                                    float* dst, const Track& track) {
  _tile_loadd(0, k0, s0 * 2);
  _tile_loadd(1, k0 + 32, s0 * 2);
  _tile_loadd(2, k1, s1 * 2);
  _tile_loadd(3, k1 + 32, s1 * 2);
  const bf16* q_hi = q + 32 * r16;  // query pairs of dims 32-63
  float* second = dst + kKeyTile * r16;
  for (int64_t c = 0; c < r16; c += kLanes) {
    _tile_loadd(4, q + 2 * c, 4 * r16);
    _tile_loadd(5, q_hi + 2 * c, 4 * r16);
    _tile_zero(6);
    _tile_zero(7);
    _tile_dpbf16ps(6, 0, 4);
    _tile_dpbf16ps(7, 2, 4);
    _tile_dpbf16ps(6, 1, 5);
    _tile_dpbf16ps(7, 3, 5);
    _tile_stored(6, dst + c, 4 * r16);
    _tile_stored(7, second + c, 4 * r16);
    track(c);
  }
}

// Raw scores of a span's key tiles (kt[t]: 16 rows `stride` elements apart) into st, two key
// tiles by two query chunks at a time (an odd last tile paired with `zeros`, whose scores land
// past the span's).
void score_span_amx(BlockScratch& w, const bf16* const* kt, int tiles, int64_t stride, const bf16* zeros, int d,
                    int n) {
  tile_sources_written();  // qp, the copied keys
  const int64_t r16 = w.r16;
  const bf16* qp = w.qp.data();
  float* st = w.st.data();  // NOTE: w is thread_local: its fields read once, not per store
  float* top = w.top.data();
  for (int c = 0; c < r16; c += kLanes) _mm512_storeu_ps(&top[c], _mm512_set1_ps(kNegInf));
  for (int t = 0; t < tiles; t += 2) {
    const bf16* k1 = t + 1 < tiles ? kt[t + 1] : zeros;
    const int64_t s1 = t + 1 < tiles ? stride : d;
    float* d0 = st + int64_t(t) * kKeyTile * r16;
    const int keys = std::min(2 * kKeyTile, n - t * kKeyTile);  // the block's rows that are keys
    // NOTE: each block's maxima read back while its rows are in L1 (the softmax's own pass read
    // the whole span's scores back from L2)
    auto track = [&](int c, int chunks) {
      tile_sources_written();  // NOTE: a barrier: the block's tile stores before these loads
      for (int h = 0; h < chunks; ++h) {
        __m512 mx = _mm512_loadu_ps(&top[c + h * kLanes]);
        for (int j = 0; j < keys; ++j) mx = _mm512_max_ps(mx, _mm512_loadu_ps(&d0[int64_t(j) * r16 + c + h * kLanes]));
        _mm512_storeu_ps(&top[c + h * kLanes], mx);
      }
    };
    if (d == 64) {
      score_pair_d64_amx(kt[t], stride, k1, s1, qp, r16, d0, [&](int64_t c) { track(int(c), 1); });
      continue;
    }
    int c = 0;
    for (; c + 2 * kLanes <= r16; c += 2 * kLanes) {
      score_block_amx<true>(kt[t], stride, k1, s1, qp + 2 * c, r16, d, d0 + c);
      track(c, 2);
    }
    if (c < r16) {
      score_block_amx<false>(kt[t], stride, k1, s1, qp + 2 * c, r16, d, d0 + c);
      track(c, 1);
    }
  }
}

// dst row e (stride ds int32) = lane e of the 16 rows r (r is overwritten).
inline void transpose16_rows(__m512i* r, int32_t* dst, int64_t ds) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4k + m]: lane L holds element 4L + m of rows 4k..4k+3
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    const __m512i a = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88), b = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88), e = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xDD);
    _mm512_storeu_si512(dst + m * ds, _mm512_shuffle_i32x4(a, c, 0x88));
    _mm512_storeu_si512(dst + (4 + m) * ds, _mm512_shuffle_i32x4(b, e, 0x88));
    _mm512_storeu_si512(dst + (8 + m) * ds, _mm512_shuffle_i32x4(a, c, 0xDD));
    _mm512_storeu_si512(dst + (12 + m) * ds, _mm512_shuffle_i32x4(b, e, 0xDD));
  }
}

// dst row e (stride ds int32) = column e of the 16 x 16 int32 block at src (stride ss).
inline void transpose16(const int32_t* src, int64_t ss, int32_t* dst, int64_t ds) {
  __m512i r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ss);
  transpose16_rows(r, dst, ds);
}

// The query vectors as bf16 pairs (qp, see BlockScratch), d a multiple of 32: vector r is
// q_rows' row r / group, head r % group; 16 vectors at a time, each row's pairs (int32)
// transposed into qp's columns; vectors past the last stay zero.
void query_pairs(BlockScratch& w, const bf16* q_rows, int64_t q_stride, int group, int vectors, int d) {
  auto* qp = reinterpret_cast<int32_t*>(w.qp.data());
  for (int r0 = 0; r0 < vectors; r0 += kLanes)
    for (int p0 = 0; p0 < d / 2; p0 += kLanes) {
      __m512i r[kLanes];
      for (int k = 0; k < kLanes; ++k) {
        const int v = r0 + k;
        r[k] = v < vectors ? _mm512_loadu_si512(q_rows + (v / group) * q_stride + (v % group) * d + 2 * p0)
                           : _mm512_setzero_si512();
      }
      transpose16_rows(r, qp + int64_t(p0) * w.r16 + r0, w.r16);
    }
}

// Output dims [i, i + 32) of the query chunk at o (acc rows, d apart) += P (pa0: steps x 16 key
// pairs a row) . V (vp at dim i), and when TWO of the next chunk (o1, pa1) too: a 2 x 2 block of
// products over the span's steps, sums in tiles 4-7, probabilities in 0 and 3, values in 1-2.
template <bool TWO>
__attribute__((target("amx-tile,amx-bf16"))) void values_block_amx(float* o0, float* o1, const int32_t* pa0,
                                                                  const int32_t* pa1, const bf16* vp, int d,
                                                                  int steps) {
  const int64_t ob = 4 * int64_t(d), vb = 4 * int64_t(d), pb = kSpanPairs * 4;
  _tile_loadd(4, o0, ob);
  _tile_loadd(5, o0 + 16, ob);
  if constexpr (TWO) {
    _tile_loadd(6, o1, ob);
    _tile_loadd(7, o1 + 16, ob);
  }
  for (int s = 0; s < steps; ++s) {
    const bf16* v = vp + size_t(kPairStep * s) * 2 * d;
    _tile_loadd(0, pa0 + kPairStep * s, pb);
    _tile_loadd(1, v, vb);
    _tile_loadd(2, v + 32, vb);
    _tile_dpbf16ps(4, 0, 1);
    _tile_dpbf16ps(5, 0, 2);
    if constexpr (TWO) {
      _tile_loadd(3, pa1 + kPairStep * s, pb);
      _tile_dpbf16ps(6, 3, 1);
      _tile_dpbf16ps(7, 3, 2);
    }
  }
  _tile_stored(4, o0, ob);
  _tile_stored(5, o0 + 16, ob);
  if constexpr (TWO) {
    _tile_stored(6, o1, ob);
    _tile_stored(7, o1 + 16, ob);
  }
}

// acc = acc * corr + P V over the span's n keys (vp: their value pairs; pp zero past n up to
// whole steps, so that the finite values there add nothing), two query chunks at a time.
void accumulate_span_amx(BlockScratch& w, const float* corr, const bf16* vp, int n, int d) {
  const int steps = (n + 2 * kPairStep - 1) / (2 * kPairStep);
  alignas(64) int32_t pa[2][kLanes * kSpanPairs];  // two query chunks' probabilities, a row each
  const auto* pp = reinterpret_cast<const int32_t*>(w.pp.data());
  float* acc = w.acc.data();  // NOTE: w is thread_local: its fields read once, not per store
  const int64_t r16 = w.r16;
  for (int c = 0; c < r16; c += 2 * kLanes) {
    const bool two = c + kLanes < r16;
    for (int h = 0; h < (two ? 2 : 1); ++h) {
      const int c0 = c + h * kLanes;
      bool moved = false;  // NOTE: once the running max settles, corr is 1 and the rescale is skipped
      for (int r = c0; r < c0 + kLanes; ++r) moved |= corr[r] != 1.f;
      if (moved)
        for (int64_t r = c0; r < c0 + kLanes; ++r) {
          const __m512 f = _mm512_set1_ps(corr[r]);
          for (int i = 0; i < d; i += kLanes)
            _mm512_storeu_ps(&acc[r * d + i], _mm512_mul_ps(_mm512_loadu_ps(&acc[r * d + i]), f));
        }
      for (int s = 0; s < steps; ++s)
        transpose16(pp + kPairStep * s * r16 + c0, r16, pa[h] + kPairStep * s, kSpanPairs);
    }
    tile_sources_written();  // pa, the rescaled acc, vp
    float *o0 = acc + c * int64_t(d), *o1 = two ? o0 + kLanes * int64_t(d) : o0;
    for (int i = 0; i < d; i += 32) {
      if (two)
        values_block_amx<true>(o0 + i, o1 + i, pa[0], pa[1], vp + 2 * i, d, steps);
      else
        values_block_amx<false>(o0 + i, o1 + i, pa[0], pa[1], vp + 2 * i, d, steps);
    }
  }
}

bool mask_block(BlockScratch& w, int rows, int group, int n, int64_t key0, int64_t pos0, int64_t window);
void softmax_block(BlockScratch& w, int n, float scale, float* corr);

// Prefetches the K rows of head h of the span that starts at tiles[t0], and its values (the
// paired ones when given, else the V rows), while this one is computed: the tile loads read 16
// rows far apart, which the hardware's prefetchers do not follow.
void prefetch_span(const bf16* k_cache, const bf16* v_cache, const bf16* paired, int64_t kv_stride,
                   const std::vector<KeyTile>& tiles, size_t t0, int h, int d) {
  int n = 0;
  for (size_t t = t0; t < tiles.size() && n + tiles[t].n <= kSpanKeys; n += tiles[t].n, ++t) {
    const auto* k = reinterpret_cast<const char*>(k_cache + tiles[t].offset + int64_t(h) * d);
    const auto* v = reinterpret_cast<const char*>(v_cache + tiles[t].offset + int64_t(h) * d);
    for (int64_t j = 0; j < tiles[t].n * kv_stride * 2; j += kv_stride * 2)
      for (int b = 0; b < d * 2; b += 64) {
        _mm_prefetch(k + j + b, _MM_HINT_T0);
        if (paired == nullptr) _mm_prefetch(v + j + b, _MM_HINT_T0);
      }
  }
  if (paired == nullptr || t0 >= tiles.size()) return;
  const auto* v = reinterpret_cast<const char*>(paired + tiles[t0].key0 * d);
  for (int64_t b = 0; b < int64_t(n) * d * 2; b += 64) _mm_prefetch(v + b, _MM_HINT_T0);
}

// The key tiles [t0, t1) of a span (k: the head's first row) as whole 16-row tiles into kt: read
// in place from the pool, or, when one of them is short, all copied into zeroed rows (w.kspan).
// Returns their row stride.
int64_t span_key_tiles(BlockScratch& w, const bf16* k, int64_t kv_stride, const std::vector<KeyTile>& tiles,
                       size_t t0, size_t t1, int d, const bf16** kt) {
  bool whole = true;
  for (size_t t = t0; t < t1; ++t) whole &= tiles[t].n == kKeyTile;
  if (whole) {
    for (size_t t = t0; t < t1; ++t) kt[t - t0] = k + tiles[t].offset;
    return kv_stride;
  }
  bf16* ks = w.kspan.data();
  int j = 0;
  for (size_t t = t0; t < t1; ++t)
    for (int r = 0; r < tiles[t].n; ++r, ++j)
      std::memcpy(ks + size_t(j) * d, k + tiles[t].offset + r * kv_stride, sizeof(bf16) * d);
  const int key_tiles = (j + kKeyTile - 1) / kKeyTile;
  std::memset(ks + size_t(j) * d, 0, sizeof(bf16) * d * (key_tiles * kKeyTile - j));
  for (int t = 0; t < key_tiles; ++t) kt[t] = ks + size_t(t) * kKeyTile * d;
  return d;
}

// A head's key tiles in spans on AMX (see above). A span with a tile of fewer than 16 keys has
// its keys copied into zeroed rows first (w.kspan), so that no tile reads past its block. Its
// values from `paired` (this head's, pair_sequence_values) where given and the span starts on
// an even key, else paired here.
void attend_spans_amx(BlockScratch& w, const bf16* k_cache, const bf16* v_cache, const bf16* paired,
                      int64_t kv_stride, const AttnArgs& a, int rows, int group, const std::vector<KeyTile>& tiles,
                      int h, int64_t pos0, float* corr, AmxTiles& amx) {
  const int d = a.head_dim;
  amx.configure();
  alignas(64) static const bf16 zeros[kKeyTile * kMaxHeadDim] = {};
  const bf16* vrow[kSpanKeys];
  const bf16* kt[kSpanKeys / kKeyTile];
  for (size_t t0 = 0; t0 < tiles.size();) {
    int n = 0;
    size_t t1 = t0;
    for (; t1 < tiles.size() && n + tiles[t1].n <= kSpanKeys; ++t1) {
      const KeyTile& t = tiles[t1];
      const bf16* v = v_cache + t.offset + int64_t(h) * d;
      for (int j = 0; j < t.n; ++j) vrow[n + j] = v + j * kv_stride;
      n += t.n;
    }
    prefetch_span(k_cache, v_cache, paired, kv_stride, tiles, t1, h, d);
    const int64_t stride = span_key_tiles(w, k_cache + int64_t(h) * d, kv_stride, tiles, t0, t1, d, kt);
    score_span_amx(w, kt, (n + kKeyTile - 1) / kKeyTile, stride, zeros, d, n);
    const bool masked = mask_block(w, rows, group, n, tiles[t0].key0, pos0, a.window);
    softmax_pairs(w, n, a.scale, corr, masked ? nullptr : w.top.data());
    const int pairs = (n + 1) / 2, padded = (pairs + kPairStep - 1) / kPairStep * kPairStep;
    const bf16* vp = w.vp.data();
    if (paired != nullptr && tiles[t0].key0 % 2 == 0) {
      vp = paired + tiles[t0].key0 * d;  // pair key0 / 2: rows of 2d
    } else {
      for (int j = 0; j < n; j += 2) pair_rows(vrow[j], j + 1 < n ? vrow[j + 1] : nullptr, &w.vp[size_t(j) * d], d);
      std::memset(&w.vp[size_t(pairs) * 2 * d], 0, sizeof(bf16) * 2 * d * (padded - pairs));
    }
    std::memset(&w.pp[size_t(pairs) * 2 * w.r16], 0, sizeof(bf16) * 2 * w.r16 * (padded - pairs));
    accumulate_span_amx(w, corr, vp, n, d);
    t0 = t1;
  }
}
#else
void score_tile_bf16(BlockScratch&, const bf16*, int64_t, int, int, float) { std::abort(); }
void pair_values(BlockScratch&, const bf16*, int64_t, int, int) { std::abort(); }
void softmax_pairs(BlockScratch&, int, float, float*, const float*) { std::abort(); }
void query_pairs(BlockScratch&, const bf16*, int64_t, int, int, int) { std::abort(); }
void accumulate_block_bf16(BlockScratch&, const float*, int, int, int) { std::abort(); }
struct AmxTiles {
  void configure() { std::abort(); }
};
void attend_spans_amx(BlockScratch&, const bf16*, const bf16*, const bf16*, int64_t, const AttnArgs&, int, int,
                      const std::vector<KeyTile>&, int, int64_t, float*, AmxTiles&) {
  std::abort();
}
#endif

// A sequence's values already in key pairs (pair_rows' layout, pair p at 2 p d), every KV head
// `head_stride` elements apart, zero rows past its keys; data null: each span pairs its own.
struct PairedValues {
  const bf16* data = nullptr;
  int64_t head_stride = 0;
  const bf16* head(int h) const { return data == nullptr ? nullptr : data + h * head_stride; }
};

// Pairs, once a call, the values of every sequence that at least two AMX query tiles of this
// call read (without a window), into buf (paired[s]; the others' entries left as they are, null):
// each tile paired the spans it read again.
// NOTE: P.V reads whole steps of 32 keys past a span's last key, where P is zero: those rows hold
// the sequence's next keys (finite) or the zeros after its last.
#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)
void pair_sequence_values(const bf16* v_cache, const AttnArgs& a, int num_seqs, std::vector<bf16>& buf,
                          std::vector<PairedValues>& paired) {
  const int d = a.head_dim, kv = a.num_kv_heads;
  // keys a head's pairs hold: whole spans, and one span of zeros after the last key
  auto padded = [&](int64_t s) { return (a.seq_lens[s] + 2 * kSpanKeys - 1) / kSpanKeys * kSpanKeys; };
  std::vector<int64_t> offset(num_seqs, -1);
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = a.query_start_loc[s + 1] - a.query_start_loc[s];
    if (a.window > 0 || qlen <= kAmxQueryTile) continue;
    offset[s] = total;
    total += kv * padded(s) * d;
  }
  if (total == 0) return;
  buf.resize(total);
  struct Range {
    int64_t seq;
    int h;
    int64_t k0;
  };
  std::vector<Range> ranges;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (offset[s] < 0) continue;
    paired[s] = {buf.data() + offset[s], padded(s) * d};
    for (int h = 0; h < kv; ++h)
      for (int64_t k0 = 0; k0 < padded(s); k0 += kSpanKeys) ranges.push_back({s, h, k0});
  }
  bf16* out = buf.data();
  parallel_items(int64_t(ranges.size()), [&](int64_t i) {
    const auto [s, h, k0] = ranges[i];
    const int64_t len = a.seq_lens[s];
    const int64_t* table = a.block_tables + s * a.max_blocks;
    const int bs = a.block_size;
    auto row = [&](int64_t key) { return v_cache + ((table[key / bs] * bs + key % bs) * kv + h) * d; };
    bf16* dst = out + offset[s] + h * paired[s].head_stride;
    for (int64_t j = k0; j < k0 + kSpanKeys; j += 2) {
      if (j < len)
        pair_rows(row(j), j + 1 < len ? row(j + 1) : nullptr, dst + j * d, d);
      else
        std::memset(dst + j * d, 0, sizeof(bf16) * 2 * d);
    }
  });
}
#else
void pair_sequence_values(const bf16*, const AttnArgs&, int, std::vector<bf16>&, std::vector<PairedValues>&) {}
#endif

// Masks (to -inf) the scores a row may not see: only tiles on the causal diagonal or the
// window's edge have any. Whether it masked anything.
bool mask_block(BlockScratch& w, int rows, int group, int n, int64_t key0, int64_t pos0, int64_t window) {
  const int64_t last = pos0 + rows - 1;
  const bool all_seen = key0 + n - 1 <= pos0 && (window <= 0 || key0 >= last - window + 1);
  if (all_seen) return false;
  float* st = w.st.data();  // NOTE: w is thread_local: its fields read once, not per store
  const int64_t r16 = w.r16;
  auto hide = [&](int64_t j, int q) {
    for (int g = 0; g < group; ++g) st[j * r16 + q * group + g] = kNegInf;
  };
  for (int q = 0; q < rows; ++q) {
    const int64_t pos = pos0 + q;
    const int64_t after = std::clamp<int64_t>(pos - key0 + 1, 0, n);  // keys [after, n) come after pos
    const int64_t left = window > 0 ? std::clamp<int64_t>(pos - window - key0 + 1, 0, n) : 0;  // [0, left) left the window
    for (int64_t j = 0; j < left; ++j) hide(j, q);
    for (int64_t j = after; j < n; ++j) hide(j, q);
  }
  return true;
}

// Online softmax down the lanes over n scores, times `scale` (1 where the scores are scaled
// already): each row's new max, its probabilities left in st, its sum, and in corr the factor
// its accumulator is rescaled by (1 where the max did not move).
void softmax_block(BlockScratch& w, int n, float scale, float* corr) {
  float* st = w.st.data();  // NOTE: w is thread_local: its fields read once, not per store
  float *m = w.m.data(), *l = w.l.data();
  const int64_t r16 = w.r16;
  const Vf f = vset1(scale);
  for (int c = 0; c < r16; c += kLanes) {
    const Vf m_old = load(&m[c]);
    Vf raw = vset1(kNegInf);
    for (int j = 0; j < n; ++j) raw = vmax(raw, load(&st[j * r16 + c]));
    const Vf mx = vmax(m_old, raw * f), neg = vzero() - mx;
    Vf sum = vzero();
    for (int j = 0; j < n; ++j) {
      const Vf p = vexp(vfma(load(&st[j * r16 + c]), f, neg));
      store(&st[j * r16 + c], p);
      sum = sum + p;
    }
    const Vf g = vexp(m_old - mx);
    store(&corr[c], g);
    store(&l[c], vfma(load(&l[c]), g, sum));
    store(&m[c], mx);
  }
}

// acc[r] = acc[r] * corr[r] + sum_j p[j][r] * v[j] for RB rows from r0, one 16-lane chunk of
// head_dim at a time (AVX2's 16 registers hold 4 rows x 2 halves). FULL: d is whole chunks.
template <int RB, bool FULL>
void accumulate_rows_block(BlockScratch& w, const float* corr, int r0, int n, int d) {
  for (int c = 0; c < d; c += kLanes) {
    const Mask mask = FULL ? Mask(0xFFFF) : tail_mask(d - c);
    Vf x[RB];
    for (int r = 0; r < RB; ++r) x[r] = load(&w.acc[size_t(r0 + r) * d + c], mask) * vset1(corr[r0 + r]);
    for (int j = 0; j < n; ++j) {
      const Vf vv = FULL ? load(&w.vf[size_t(j) * d + c]) : load(&w.vf[size_t(j) * d + c], mask);
      const float* p = &w.st[size_t(j) * w.r16 + r0];
      for (int r = 0; r < RB; ++r) x[r] = vfma(vset1(p[r]), vv, x[r]);
    }
    for (int r = 0; r < RB; ++r) store(&w.acc[size_t(r0 + r) * d + c], x[r], mask);
  }
}

template <bool FULL>
void accumulate_block(BlockScratch& w, const float* corr, int vectors, int n, int d) {
  int r0 = 0;
  for (; r0 + kAccRows <= vectors; r0 += kAccRows) accumulate_rows_block<kAccRows, FULL>(w, corr, r0, n, d);
  for (; r0 < vectors; ++r0) accumulate_rows_block<1, FULL>(w, corr, r0, n, d);
}

// How a prefill tile multiplies: fp32 FMAs, bf16 pairs on vdpbf16ps, or AMX tiles.
enum class Products { kFma, kPairs, kAmx };

template <typename C>
void attend_block_tile(BlockScratch& w, const C* k, const C* v, int64_t kv_stride, const AttnArgs& a, int rows,
                       int group, int n, int64_t key0, int64_t pos0, float* corr, Products products) {
  const int d = a.head_dim;
  if constexpr (std::is_same_v<C, bf16>) {
    if (products == Products::kPairs) {
      score_tile_bf16(w, k, kv_stride, d, n, a.scale);
      mask_block(w, rows, group, n, key0, pos0, a.window);
      softmax_pairs(w, n, 1.f, corr, nullptr);
      pair_values(w, v, kv_stride, d, n);
      accumulate_block_bf16(w, corr, rows * group, n, d);
      return;
    }
  }
  for (int j = 0; j < n; ++j) {
    widen_row(k + j * kv_stride, &w.kf[size_t(j) * d], d);
    widen_row(v + j * kv_stride, &w.vf[size_t(j) * d], d);
  }
  for_key_blocks(w.r16, n, [&]<int KB>(int j, int c) { score_keys<KB>(w, d, j, c); });
  mask_block(w, rows, group, n, key0, pos0, a.window);
  softmax_block(w, n, 1.f, corr);
  if (d % kLanes == 0) {
    accumulate_block<true>(w, corr, rows * group, n, d);
  } else {
    accumulate_block<false>(w, corr, rows * group, n, d);
  }
}

// An item's query vectors (vector r: q_rows' row r / group, head r % group) into the scratch: as
// bf16 pairs (qp) for the pair and AMX products, else in fp32 times `scale` (qt).
template <typename T>
void load_queries(BlockScratch& w, const T* q_rows, int64_t q_stride, int group, int vectors, int d, bool pairs,
                  float scale) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (pairs && d % 32 == 0) return query_pairs(w, q_rows, q_stride, group, vectors, d);
  }
  if (pairs) std::fill(w.qp.begin(), w.qp.end(), bf16{0});  // the vectors past the last stay zero
  for (int r = 0; r < vectors; ++r) {
    const T* src = q_rows + (r / group) * q_stride + (r % group) * d;
    if constexpr (std::is_same_v<T, bf16>) {
      if (pairs) {
        for (int i = 0; i < d; ++i) w.qp[size_t(i / 2) * 2 * w.r16 + 2 * r + (i & 1)] = src[i];
        continue;
      }
    }
    for (int i = 0; i < d; ++i) w.qt[size_t(i) * w.r16 + r] = to_float(src[i]) * scale;
  }
}

// One prefill work item (see attend_item), head by head.
template <typename T, typename C>
void attend_block_item(const T* q, const C* k_cache, const C* v_cache, T* out, const AttnArgs& a,
                       int64_t seq, int h0, int nh, int64_t row0, int rows, const PairedValues& paired) {
  const int d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t q_begin = a.query_start_loc[seq], qlen = a.query_start_loc[seq + 1] - q_begin;
  const int vectors = rows * group;
  const int64_t pos0 = a.seq_lens[seq] - qlen + row0;
  const int64_t kv_stride = int64_t(a.num_kv_heads) * d;
  thread_local BlockScratch w;
  thread_local std::vector<KeyTile> tiles;
  thread_local std::vector<float> corr;
  list_tiles(a, seq, a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0, pos0 + rows, tiles);
  // NOTE: on bf16 pairs where vdpbf16ps wins this CPU's GEMM at this many rows (the measured
  // choice of gemm_tiles.py): Q.K exact either way; P.V then takes P rounded to bf16.
  // AMX where the GEMM takes it at this many rows (d a multiple of 32).
  const bool bf16_pool = kNativeBf16Dot && std::is_same_v<T, bf16> && std::is_same_v<C, bf16> && d % kLanes == 0;
  const Products products = !bf16_pool                          ? Products::kFma
                            : d % 32 == 0 && amx_dot_wins(vectors) ? Products::kAmx
                            : bf16_dot_wins(vectors)               ? Products::kPairs
                                                                   : Products::kFma;
  const bool pairs = products != Products::kFma;
  AmxTiles amx;  // configured at its first tile, released at the end of the item
  for (int h = h0; h < h0 + nh; ++h) {
    w.reset(vectors, d, pairs);
    corr.resize(w.r16);
    const T* q_rows = q + (q_begin + row0) * a.q_stride + int64_t(h) * group * d;
    load_queries(w, q_rows, a.q_stride, group, vectors, d, pairs, a.scale);
    if (products == Products::kAmx) {  // a bf16 pool (bf16_pool above)
      if constexpr (std::is_same_v<C, bf16>)
        attend_spans_amx(w, k_cache, v_cache, paired.head(h), kv_stride, a, rows, group, tiles, h, pos0,
                         corr.data(), amx);
    } else {
      for (const KeyTile& t : tiles) {
        const int64_t offset = t.offset + int64_t(h) * d;
        attend_block_tile(w, k_cache + offset, v_cache + offset, kv_stride, a, rows, group, t.n, t.key0, pos0,
                          corr.data(), products);
      }
    }
    T* out_rows = out + (q_begin + row0) * a.out_stride + int64_t(h) * group * d;
    for (int r = 0; r < vectors; ++r) {
      T* dst = out_rows + (r / group) * a.out_stride + (r % group) * d;
      const float inv = w.l[r] > 0.f ? a.v_scale / w.l[r] : 0.f;
      for (int i = 0; i < d; i += kLanes) {
        const Mask mk = tail_mask(d - i);
        store(dst + i, load(&w.acc[size_t(r) * d + i], mk) * vset1(inv), mk);
      }
    }
  }
}

// Whether a prefill tile of kAmxQueryTile rows of this call multiplies on AMX (as
// attend_block_item decides): those items take twice the rows, so that each span's keys and
// paired values serve twice the query vectors.
template <typename T, typename C>
bool amx_query_tile(const AttnArgs& a) {
  const int group = a.num_heads / a.num_kv_heads;
  return kNativeBf16Dot && std::is_same_v<T, bf16> && std::is_same_v<C, bf16> && a.head_dim % 32 == 0 &&
         amx_dot_wins(int64_t(kAmxQueryTile) * group);
}

template <typename T, typename C>
void paged_attention(const void* q, const void* k_cache, const void* v_cache, void* out, int num_seqs,
                     const AttnArgs& a) {
  if (a.head_dim > kMaxHeadDim) std::abort();  // NOTE: refused in Python first; never overrun
  const int query_tile = amx_query_tile<T, C>(a) ? kAmxQueryTile : kQueryTile;
  // NOTE: items are (sequence, query tile) x KV head, listed once per call so that a long
  // prefill's tiles spread over threads like separate sequences, the most work first: a causal
  // prefill's last tiles read the most keys, and taken last they left one thread working alone.
  struct QueryTile {
    int64_t seq, row0, work;
  };
  std::vector<QueryTile> tiles;
  int64_t key_rows = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = a.query_start_loc[s + 1] - a.query_start_loc[s];
    for (int64_t r = 0; r < qlen; r += query_tile) {
      // NOTE: a tile's work is its query rows times the keys they read (a decode: one row).
      const int64_t keys = a.seq_lens[s] - qlen + r + 1;
      const int64_t seen = a.window > 0 ? std::min<int64_t>(keys, a.window + query_tile) : keys;
      const int64_t work = std::min<int64_t>(query_tile, qlen - r) * seen;
      tiles.push_back({s, r, work});
      key_rows += work;
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const QueryTile& x, const QueryTile& y) { return x.work > y.work; });
  // NOTE: the caller's buffers, reached from the workers through these locals (a thread_local
  // named inside the lambda would be each worker's own)
  thread_local std::vector<bf16> paired_buf;
  thread_local std::vector<PairedValues> paired_seqs;
  paired_seqs.assign(num_seqs, {});
  if constexpr (std::is_same_v<C, bf16>)
    if (query_tile == kAmxQueryTile)
      pair_sequence_values(static_cast<const bf16*>(v_cache), a, num_seqs, paired_buf, paired_seqs);
  const PairedValues* paired = paired_seqs.data();
  // NOTE: a call with less work than this (K/V rows read, times the query rows reading them)
  // runs on the calling thread: waking a worker cost more than it saved for one short
  // sequence, and lost badly on a busy machine.
  const int max_threads = key_rows * a.num_kv_heads < kMinParallelKeyRows ? 1 : num_threads();
  // NOTE: a small batch splits over KV heads too, so that two cores share one sequence; a
  // large one keeps each token's K/V row (all heads, contiguous) in one item, which reads the
  // pool as whole blocks.
  const int kv = a.num_kv_heads;
  const int nh = int64_t(tiles.size()) * kv >= kItemsPerThread * max_threads ? kv : 1;
  const int groups = kv / nh;
  parallel_items(int64_t(tiles.size()) * groups, [&](int64_t i) {
    const auto [seq, row0, work] = tiles[i / groups];
    const auto* qt = static_cast<const T*>(q);
    const auto* kt = static_cast<const C*>(k_cache);
    const auto* vt = static_cast<const C*>(v_cache);
    auto* ot = static_cast<T*>(out);
    const int h0 = static_cast<int>(i % groups) * nh;
    const int64_t qlen = a.query_start_loc[seq + 1] - a.query_start_loc[seq];
    const int rows = static_cast<int>(std::min<int64_t>(query_tile, qlen - row0));
    if (rows * (a.num_heads / kv) >= kBlockMinVectors) {
      attend_block_item(qt, kt, vt, ot, a, seq, h0, nh, row0, rows, paired[seq]);
      return;
    }
    switch (a.head_dim) {
      case 64: attend_item<4>(qt, kt, vt, ot, a, seq, h0, nh, row0, rows); break;
      case 128: attend_item<8>(qt, kt, vt, ot, a, seq, h0, nh, row0, rows); break;
      default: attend_item<0>(qt, kt, vt, ot, a, seq, h0, nh, row0, rows); break;
    }
  }, max_threads);
}

}  // namespace
}  // namespace pagoda

#define PAGODA_ATTENTION(NAME, T, C)                                                                 \
  extern "C" void NAME(const void* q, const void* k_cache, const void* v_cache, void* out,          \
                       const int64_t* block_tables, const int64_t* seq_lens,                        \
                       const int64_t* query_start_loc, int num_seqs, int num_heads, int num_kv_heads, \
                       int head_dim, int block_size, int max_blocks, int64_t q_stride,               \
                       int64_t out_stride, float scale, int64_t window, float k_scale, float v_scale) { \
    const pagoda::AttnArgs a{block_tables, seq_lens,  query_start_loc, num_heads,     num_kv_heads, \
                             head_dim,     block_size, max_blocks,      q_stride,      out_stride,   \
                             scale * k_scale, v_scale, window};                                      \
    pagoda::paged_attention<T, C>(q, k_cache, v_cache, out, num_seqs, a);                           \
  }

PAGODA_ATTENTION(pagoda_paged_attention_f32, float, float)
PAGODA_ATTENTION(pagoda_paged_attention_bf16, pagoda::bf16, pagoda::bf16)
PAGODA_ATTENTION(pagoda_paged_attention_f16, pagoda::f16, pagoda::f16)
PAGODA_ATTENTION(pagoda_paged_attention_f32_e4m3, float, pagoda::fp8_e4m3)
PAGODA_ATTENTION(pagoda_paged_attention_bf16_e4m3, pagoda::bf16, pagoda::fp8_e4m3)
PAGODA_ATTENTION(pagoda_paged_attention_f16_e4m3, pagoda::f16, pagoda::fp8_e4m3)
PAGODA_ATTENTION(pagoda_paged_attention_f32_e5m2, float, pagoda::fp8_e5m2)
PAGODA_ATTENTION(pagoda_paged_attention_bf16_e5m2, pagoda::bf16, pagoda::fp8_e5m2)
PAGODA_ATTENTION(pagoda_paged_attention_f16_e5m2, pagoda::f16, pagoda::fp8_e5m2)
