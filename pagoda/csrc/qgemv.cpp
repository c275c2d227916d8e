// Weight-only quantized products for small M, and dequantization for large M.
// NOTE: on the avx512bf16 build, int8 (per channel) and int4 layers with bf16 activations are
// repacked at load for the GEMM's quantized variants (gemm.cpp), which run every step size; these
// records serve the rest: group-wise int8 (GGUF Q8_0), fp32/f16 activations, the portable build.
//
// Two packed row formats, one record per output row so that a thread reads one sequential
// stream (the bf16 GEMV's lesson, gemv.cpp):
// - int4: [K/2 bytes of nibbles][G x f16 scale d][G x f16 offset m], w = q * d + m, q in
//   [0, 15], groups of `gs` (32, 64 or 128) along K; K is a multiple of 64.
// - int8: [K x int8][G x f32 scale d], w = q * d (G = 1: one scale per output channel; GGUF's
//   records: groups of 32, or 16 for Q6_K), or [K x int8][G x f16 scale d] (a row of K + 2G
//   bytes: group scales that f16 holds exactly, GGUF's Q8_0 and Q5_0; 1/9 fewer bytes a weight).
// y[M, N] = x[M, K] W^T (+ bias). x, bias and y share one dtype T (f32, bf16, f16).
//
// int4 products run on vdpbf16ps: each nibble q becomes the exact bf16 of 128 + q (0x4300 | q),
// activations are bf16 (x rounded to bf16 when T is not), sums fp32. The nibbles are stored in
// "stream order" (`StreamOrder`) so that no scale is applied per 32 products: K is cut into
// 32-element blocks, the blocks into superblocks of S = 16, 8, 4 or 2 blocks, and inside a
// superblock every one of vdpbf16ps's 16 lanes accumulates only elements of one block (16 / S
// lanes a block). A superblock is read as S / 2 steps of 32 bytes: byte p of a step holds two
// elements (low and high nibble) of the block of lane p / 2. After a superblock, one multiply by
// the lanes' block scales adds it to the row's sum; the offsets come in once per row through
// the group sums of x (y = sum_g d_g sum_k q_k x_k + sum_g m_g sum_k x_k). x is permuted into
// the same stream order once per call. int8 products widen q and x to fp32 (exact products,
// fp32 sums). The AVX2 build (no bf16 dot products) multiplies integers instead, as llama.cpp's
// Q4_0/Q8_0 dot products do: x rounded to int8 codes by blocks of 32 (`quantize_x_groups`),
// vpmaddubsw/vpmaddwd sums, exact, then fp32; y is W times the rounded x. Without AVX2 or
// AVX512_BF16 the bf16/fp32 arithmetic runs in plain loops.
#include <mutex>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace pagoda {
namespace {

constexpr int kMaxRows = 8;        // input rows per pass over the weights
constexpr int64_t kRowGrain = 16;  // output rows per thread range, a multiple of this

struct QArgs {
  const uint8_t* w;
  int64_t row_bytes, N, K, G, gs;
};

// Activations as the kernels read them: int4 takes bf16 rows in stream order, int8 fp32
// rows; both K long.
struct StreamOrder;

struct Acts {
  const bf16* xb;   // [M, K] bf16, stream order (int4)
  const float* xf;  // [M, K] fp32 (int8)
  const float* sx;  // [M, G] group sums of the bf16 rows (int4)
  const int8_t* xq = nullptr;  // [M, K] int8 codes by groups of kXGroup (AVX2; int4: stream order), or null
  const float* dx = nullptr;   // [M, K / kXGroup] their steps (int8); int4: [M, 16 a superblock],
                               // the step of each word_block entry's block
  int64_t dx_stride = 0;       // floats of `dx` a row
  const StreamOrder* order = nullptr;  // int4: K's stream order, looked up once per call
};

constexpr int64_t kXGroup = 32;  // k's per int8 code group of x (the AVX-512 GEMM's too)

// The most f16 group scales an int8 record may have (the kernels widen a row's to fp32 on the
// stack; packing.py packs f16 scales only up to this many).
constexpr int64_t kMaxF16Scales = 4096;

// An int8 record's group scales (after its K codes) as fp32: the record's own where they are
// fp32, else widened from f16 into `buf` (kMaxF16Scales floats), 16 at a time.
inline const float* int8_scales(const QArgs& a, const int8_t* q, float* buf) {
  const auto* s = reinterpret_cast<const uint8_t*>(q) + a.K;
  if (a.row_bytes != a.K + 2 * a.G) return reinterpret_cast<const float*>(s);
  const auto* h = reinterpret_cast<const f16*>(s);
  for (int64_t g = 0; g < a.G; g += kLanes) {
    const Mask m = tail_mask(static_cast<int>(std::min<int64_t>(a.G - g, kLanes)));
    store(buf + g, load(h + g, m), m);
  }
  return buf;
}

// A record's group scales read in order, `per` steps of the caller's (16 or 32 k's) a group:
// the scale of each next step, without dividing k by the group size.
class GroupScales {
 public:
  GroupScales(const float* d, int64_t per) : d_(d), per_(std::max<int64_t>(per, 1)), left_(per_) {}
  float next() {
    const float s = *d_;
    if (--left_ == 0) {
      ++d_;
      left_ = per_;
    }
    return s;
  }

 private:
  const float* d_;
  int64_t per_, left_;
};

struct Superblock {
  int blocks;     // S: 32-element blocks in it
  int64_t block0;  // its first block
};

// The int4 layout of a row of K: its superblocks, and `element[i]`, the element of K whose
// nibble sits at stream position i (step c's low nibbles are positions 64c + p, its high
// nibbles 64c + 32 + p, for byte p). Python's packing.stream_order is the same function.
struct StreamOrder {
  std::vector<Superblock> superblocks;
  std::vector<int32_t> element;
  // per superblock, the block of each 32-bit lane j's even 16-bit word (bytes 4j, 4j + 1), then of
  // its odd word (bytes 4j + 2, 4j + 3): 16 a superblock (the AVX2 integer int4 path)
  std::vector<int32_t> word_block;

  explicit StreamOrder(int64_t K) {
    int64_t left = K / 32, b0 = 0;  // even: K is a multiple of 64
    for (int s : {16, 8, 4, 2})
      for (; left >= s; left -= s, b0 += s) superblocks.push_back({s, b0});
    for (const Superblock& sb : superblocks) {
      const int lanes = 16 / sb.blocks;
      for (int odd = 0; odd < 2; ++odd)
        for (int j = 0; j < 8; ++j) word_block.push_back(static_cast<int32_t>(sb.block0 + (4 * j + 2 * odd) / 2 / lanes));
      for (int t = 0; t < sb.blocks / 2; ++t)
        for (int half = 0; half < 2; ++half)
          for (int p = 0; p < 32; ++p) {
            const int lane = p / 2, j = lane / lanes, u = lane % lanes;
            element.push_back(static_cast<int32_t>(32 * (sb.block0 + j) + (t * lanes + u) * 4 + 2 * half + (p & 1)));
          }
    }
  }
};

// The order of a K, built once per K (a handful of distinct K per model).
const StreamOrder& stream_order(int64_t K) {
  static std::mutex mutex;
  static std::vector<std::pair<int64_t, StreamOrder*>> orders;
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& [k, order] : orders)
    if (k == K) return *order;
  orders.emplace_back(K, new StreamOrder(K));
  return *orders.back().second;
}

// sum_g m_g * sx_g with m in f16.
inline float offset_term(const uint16_t* m, const float* sx, int64_t G) {
  float s = 0.f;
  for (int64_t g = 0; g < G; ++g) s += f16_from_bits(m[g]) * sx[g];
  return s;
}

#if defined(PAGODA_AVX512) && defined(__AVX512BF16__)

// sum_g (m_g - 128 d_g) * sx_g with m in f16 and d in fp32, 16 groups at a time: the offsets,
// less the 128 that each code carried into the products.
inline float offset_term_avx(const uint16_t* m, const float* d, const float* sx, int64_t G) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 k = tail_mask(static_cast<int>(std::min<int64_t>(G - g, 16)));
    const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), _mm512_maskz_loadu_ps(k, d + g),
                                        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, m + g)));
    acc = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(k, sx + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

inline void f16_row_to_float(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(static_cast<int>(std::min<int64_t>(n - i, 16)));
    _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + i)));
  }
}

// One superblock of S blocks for M input rows: acc[m] += the lanes' sums (lane l: block l / (16 / S)).
// NOTE: four accumulators for one row, two for two, one a row from four rows on: enough
// independent vdpbf16ps chains to hide their latency, few enough registers not to spill
// (measured: 2 a row at 8 rows cost 2x through spills).
template <int M, int S>
inline void int4_superblock(const uint8_t* q, const bf16* x, int64_t x_stride, __m512 acc[M]) {
  constexpr int kAcc = M == 1 ? 4 : (M == 2 ? 2 : 1);
  __m512 part[M][kAcc];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < kAcc; ++i) part[m][i] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int t = 0; t < S / 2; ++t) {
    const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * t)));
    // bf16 0x4300 | q is exactly 128 + q (the offset term takes the 128 back out)
    const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(raw, _mm512_set1_epi16(0x000F), _mm512_set1_epi16(0x4300), 0xEA);
    const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi16(0x4300));
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const bf16* xm = x + m * x_stride + 64 * t;
      __m512& a = part[m][(2 * t) % kAcc];
      a = _mm512_dpbf16_ps(a, lo, (__m512bh)_mm512_loadu_si512(xm));
      __m512& b = part[m][(2 * t + 1) % kAcc];
      b = _mm512_dpbf16_ps(b, hi, (__m512bh)_mm512_loadu_si512(xm + 32));
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 sum = part[m][0];
    for (int i = 1; i < kAcc; ++i) sum = _mm512_add_ps(sum, part[m][i]);
    acc[m] = sum;
  }
}

// Output rows [n0, n1) of int4 for M input rows; out[m * N + n] gets the fp32 sum.
template <int M>
void int4_rows(const QArgs& a, const Acts& x, int64_t n0, int64_t n1, float* out) {
  const StreamOrder& order = *x.order;
  thread_local std::vector<float> dq;
  dq.resize(a.G + 16);
  const int shift = __builtin_ctzll(static_cast<uint64_t>(a.gs / 32));
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = a.w + n * a.row_bytes;
    const auto* d = reinterpret_cast<const uint16_t*>(q + a.K / 2);
    f16_row_to_float(d, dq.data(), a.G);
    __m512 y[M];
    for (int m = 0; m < M; ++m) y[m] = _mm512_setzero_ps();
    const uint8_t* qs = q;
    int64_t pos = 0;  // stream position of the superblock
    for (const Superblock& sb : order.superblocks) {
      __m512 acc[M];
      const bf16* xs = x.xb + pos;
      switch (sb.blocks) {
        case 16: int4_superblock<M, 16>(qs, xs, a.K, acc); break;
        case 8: int4_superblock<M, 8>(qs, xs, a.K, acc); break;
        case 4: int4_superblock<M, 4>(qs, xs, a.K, acc); break;
        default: int4_superblock<M, 2>(qs, xs, a.K, acc); break;
      }
      // Lane l's scale: its block's group, d[(block0 + l / (16 / S)) >> shift].
      const int lane_shift = __builtin_ctz(16 / sb.blocks);
      const int64_t g0 = sb.block0 >> shift;
      const __m512i idx = _mm512_sub_epi32(
          _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(sb.block0)), _mm512_srli_epi32(iota, lane_shift)), shift),
          _mm512_set1_epi32(static_cast<int>(g0)));
      const __m512 scale = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(dq.data() + g0));
      for (int m = 0; m < M; ++m) y[m] = _mm512_fmadd_ps(scale, acc[m], y[m]);
      qs += 16 * sb.blocks;
      pos += 32 * sb.blocks;
    }
    const uint16_t* mins = d + a.G;
    for (int m = 0; m < M; ++m)
      out[m * a.N + n] = _mm512_reduce_add_ps(y[m]) + offset_term_avx(mins, dq.data(), x.sx + m * a.G, a.G);
  }
}

// One input row over records with groups of 32 (GGUF Q8_0, the Q5 kinds as int8): a group's 32
// products summed as one vector t (a multiply and an FMA), then acc += t * d_g, alternating two
// accumulators so that no FMA waits on the previous group's: three vector operations a group
// where scaling each half first (below) takes four. Gemma 3 270M Q4_K_M at one row, Intel AMX
// CPU (docs/benchmarks/kernels/gemma_step_split.py): its tied 262144 x 640 Q8_0 LM head 18.7 ->
// 12.9 ms, a decode step 36 -> 27 ms. Only for one row: from two rows on the loop below scales
// each weight once for every row and does less work (c=16 read slower with this loop, Zen 4).
// NOTE: two named accumulators and a scale pointer stepped along (`GroupScales`): indexing
// acc[g & 1] kept both on the stack (a store and a reload around every FMA) and d[k / gs] cost
// an integer division a group. And a prefetch kRecordPrefetch bytes ahead every 64 codes: on
// the Intel AMX CPU the hardware prefetcher alone left the same head at 7.0-7.6 GB/s (two
// threads) against 10.6-11.7 with it (a flat read: 15 GB/s); docs/benchmarks/kernels/qgemv_row.py.
constexpr int64_t kRecordPrefetch = 2048;  // bytes ahead of the codes a one-row pass reads

inline __m512 sum32(const int8_t* q, const float* x) {
  const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  return _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(x)));
}

void int8_row_g32(const QArgs& a, const Acts& x, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const auto* q = reinterpret_cast<const int8_t*>(a.w + n * a.row_bytes);
    alignas(64) float dbuf[kMaxF16Scales];  // NOTE: used by f16 scales only
    GroupScales d(int8_scales(a, q, dbuf), a.gs / 32);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= a.K; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(q + k + kRecordPrefetch), _MM_HINT_T0);
      acc0 = _mm512_fmadd_ps(sum32(q + k, x.xf + k), _mm512_set1_ps(d.next()), acc0);
      acc1 = _mm512_fmadd_ps(sum32(q + k + 32, x.xf + k + 32), _mm512_set1_ps(d.next()), acc1);
    }
    if (k < a.K) acc0 = _mm512_fmadd_ps(sum32(q + k, x.xf + k), _mm512_set1_ps(d.next()), acc0);
    out[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
}

// NOTE: the weights are widened to fp32 16 at a time; with one scale a row they are scaled
// once at the end, with group scales (GGUF Q8_0) each widened vector is multiplied by its
// group's scale before the FMA, so no group keeps a dependency chain of its own (a per-group
// sum then a multiply-add, with one accumulator, ran 1.6x slower on the 49152 x 576 LM head).
// Two accumulators a row.
template <int M>
void int8_rows(const QArgs& a, const Acts& x, int64_t n0, int64_t n1, float* out) {
  const bool grouped = a.G > 1;
  if constexpr (M == 1) {
    if (grouped && a.gs % 32 == 0) return int8_row_g32(a, x, n0, n1, out);
  }
  for (int64_t n = n0; n < n1; ++n) {
    const auto* q = reinterpret_cast<const int8_t*>(a.w + n * a.row_bytes);
    alignas(64) float dbuf[kMaxF16Scales];  // NOTE: used by f16 scales only
    const float* d = int8_scales(a, q, dbuf);
    GroupScales d16(d, a.gs / 16);
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < a.K; k += 32) {
      __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
      __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16))));
      if (grouped) {
        w0 = _mm512_mul_ps(w0, _mm512_set1_ps(d16.next()));
        w1 = _mm512_mul_ps(w1, _mm512_set1_ps(d16.next()));
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x.xf + m * a.K + k), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.xf + m * a.K + k + 16), acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
      out[m * a.N + n] = grouped ? sum : sum * d[0];
    }
  }
}

#else  // portable: the same sums in plain loops

// The nibble at stream position i (step i / 64; low nibbles first within a step).
inline int nibble(const uint8_t* q, int64_t i) {
  const uint8_t b = q[32 * (i / 64) + (i % 32)];
  return (i % 64) < 32 ? (b & 15) : (b >> 4);
}

#if defined(PAGODA_AVX2)
// The scales of the record after the one at `q` (from `offset` to its end): a row reads its
// scales, past its codes, before the codes, so the next row's are fetched while this one runs
// (its codes follow this row's in the stream the hardware prefetcher already runs).
// NOTE: int8 records only: on Zen 3 (qgemv_ab.py, one row, seven paired runs) per-channel int8
// read 1.00-1.18x faster with it, int4 records (360 bytes a row at K = 576) 0.95x.
inline void prefetch_next_scales(const uint8_t* q, int64_t row_bytes, int64_t offset) {
  for (int64_t b = offset; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(q + row_bytes + b), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(q + 2 * row_bytes - 1), _MM_HINT_T0);  // the last line
}

// n f16 values as fp32, 8 at a time with F16C.
inline void f16_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(load128(src + i)));
  for (; i < n; ++i) dst[i] = f16_from_bits(src[i]);
}

// int4 records times x as int8 codes by blocks of 32 (`Acts::xq` in stream order): per step,
// vpmaddubsw multiplies the nibbles (u8) by x's codes (s8) in adjacent pairs, which share a
// block (at most 2 * 15 * 127 a word, 4 steps at most 30,480: int16 sums, exact); every 4 steps
// vpmaddwd by (1, 0) and (0, 1) moves the even and the odd words into int32 lanes, which keeps
// the two blocks of a lane apart where a superblock has one block a byte pair. At the end of a
// superblock each lane, in fp32, times d * dx of its block joins the row's sums; the offsets
// come in through the rounded x's group sums, so y is W times the rounded x.
template <int M>
void int4_rows_int(const QArgs& a, const Acts& x, int64_t n0, int64_t n1, float* out) {
  const StreamOrder& order = *x.order;
  const int64_t dx_stride = 16 * static_cast<int64_t>(order.superblocks.size());
  thread_local std::vector<float> dq, mq;
  dq.resize(a.G + 16);  // NOTE: 16 past the last group: the block scales load 16 from any group
  mq.resize(a.G);
  const int group_shift = __builtin_ctzll(static_cast<uint64_t>(a.gs / 32));
  const __m128i shift = _mm_cvtsi32_si128(group_shift);
  const __m256i seven = _mm256_set1_epi32(7);
  const __m256i low = _mm256_set1_epi8(15), even = _mm256_set1_epi32(1), odd = _mm256_set1_epi32(1 << 16);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = a.w + n * a.row_bytes;
    const auto* d = reinterpret_cast<const uint16_t*>(q + a.K / 2);
    f16_to_float(d, dq.data(), a.G);
    f16_to_float(d + a.G, mq.data(), a.G);
    __m256 y[M];
    for (int m = 0; m < M; ++m) y[m] = _mm256_setzero_ps();
    const uint8_t* qs = q;
    int64_t pos = 0;
    for (size_t s = 0; s < order.superblocks.size(); ++s) {
      const int steps = order.superblocks[s].blocks / 2;
      __m256i ae[M], ao[M];
      for (int m = 0; m < M; ++m) ae[m] = ao[m] = _mm256_setzero_si256();
      for (int t0 = 0; t0 < steps; t0 += 4) {
        __m256i words[M];
        for (int m = 0; m < M; ++m) words[m] = _mm256_setzero_si256();
        for (int t = t0; t < std::min(steps, t0 + 4); ++t) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * t));
          const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            const int8_t* xm = x.xq + m * a.K + pos + 64 * t;
            const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm));
            const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + 32));
            words[m] = _mm256_add_epi16(words[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                                                   _mm256_maddubs_epi16(hi, xh)));
          }
        }
        for (int m = 0; m < M; ++m) {
          ae[m] = _mm256_add_epi32(ae[m], _mm256_madd_epi16(words[m], even));
          ao[m] = _mm256_add_epi32(ao[m], _mm256_madd_epi16(words[m], odd));
        }
      }
      // NOTE: a superblock's lanes take at most 16 consecutive groups from g0: two loads and
      // two in-register permutes a half, not a gather (gathers were ~15% of the kernel).
      const int32_t g0 = static_cast<int32_t>(order.superblocks[s].block0 >> group_shift);
      const __m256 d_lo = _mm256_loadu_ps(dq.data() + g0), d_hi = _mm256_loadu_ps(dq.data() + g0 + 8);
      const auto block_scales = [&](int half) {
        const __m256i block = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order.word_block.data() + 16 * s + 8 * half));
        const __m256i rel = _mm256_sub_epi32(_mm256_srl_epi32(block, shift), _mm256_set1_epi32(g0));
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(d_lo, rel), _mm256_permutevar8x32_ps(d_hi, rel),
                                _mm256_castsi256_ps(_mm256_cmpgt_epi32(rel, seven)));
      };
      const __m256 de = block_scales(0), dodd = block_scales(1);
      for (int m = 0; m < M; ++m) {
        const float* dx = x.dx + m * dx_stride + 16 * s;
        y[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ae[m]), _mm256_mul_ps(de, _mm256_loadu_ps(dx)), y[m]);
        y[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ao[m]), _mm256_mul_ps(dodd, _mm256_loadu_ps(dx + 8)), y[m]);
      }
      qs += 16 * order.superblocks[s].blocks;
      pos += 32 * order.superblocks[s].blocks;
    }
    // NOTE: the offsets 8 groups a vector into the row's sums: a scalar loop was one dependent
    // chain of G adds a row, longer than the row's products at K = 576.
    for (int m = 0; m < M; ++m) {
      const float* sx = x.sx + m * a.G;
      __m256 sums = y[m];
      int64_t g = 0;
      for (; g + 8 <= a.G; g += 8) sums = _mm256_fmadd_ps(_mm256_loadu_ps(mq.data() + g), _mm256_loadu_ps(sx + g), sums);
      float tail = 0.f;
      for (; g < a.G; ++g) tail += mq[g] * sx[g];
      out[m * a.N + n] = reduce_add(Vf{sums, _mm256_setzero_ps()}) + tail;
    }
  }
}
#endif

template <int M>
void int4_rows(const QArgs& a, const Acts& x, int64_t n0, int64_t n1, float* out) {
#if defined(PAGODA_AVX2)
  return int4_rows_int<M>(a, x, n0, n1, out);
#endif
  const StreamOrder& order = *x.order;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = a.w + n * a.row_bytes;
    const auto* d = reinterpret_cast<const uint16_t*>(q + a.K / 2);
    for (int m = 0; m < M; ++m) {
      const bf16* xm = x.xb + m * a.K;
      float y = 0.f;
      for (int64_t i = 0; i < a.K; ++i)
        y += f16_from_bits(d[order.element[i] / a.gs]) * (static_cast<float>(nibble(q, i)) * to_float(xm[i]));
      out[m * a.N + n] = y + offset_term(d + a.G, x.sx + m * a.G, a.G);
    }
  }
}

#if defined(PAGODA_AVX2)
// 16 int8 codes as fp32 (exact).
inline Vf load_codes(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}

// int8_rows on 16-lane vectors (groups a multiple of 16 long): each 16 codes serve all M rows.
template <int M>
void int8_rows_avx2(const QArgs& a, const Acts& x, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const auto* q = reinterpret_cast<const int8_t*>(a.w + n * a.row_bytes);
    alignas(64) float dbuf[kMaxF16Scales];  // NOTE: used by f16 scales only
    const float* d = int8_scales(a, q, dbuf);
    float y[M] = {};
    for (int64_t g = 0; g < a.G; ++g) {
      Vf t[M];
      for (int m = 0; m < M; ++m) t[m] = vzero();
      for (int64_t k = g * a.gs; k < (g + 1) * a.gs; k += kLanes) {
        const Vf w = load_codes(q + k);
        for (int m = 0; m < M; ++m) t[m] = vfma(w, load(x.xf + m * a.K + k), t[m]);
      }
      for (int m = 0; m < M; ++m) y[m] += d[g] * reduce_add(t[m]);
    }
    for (int m = 0; m < M; ++m) out[m * a.N + n] = y[m];
  }
}

// int8 records times x as int8 codes by groups of 32 (`Acts::xq`, `Acts::dx`), as llama.cpp's
// AVX2 Q8_0 dot products but with the weight's sign moved onto x (as the GEMM's AVX2 tiles): per
// 32 k's, vpmaddubsw multiplies |q| (u8, once for all rows; 128 for a code of -128, which
// GGUF's Q8_0 allows and whose negation vpsignb could not hold) by x's codes with q's sign
// (pairs at most 2 * 128 * 127, no saturation), vpmaddwd
// sums the pairs into 8 int32 lanes, exact; then the lanes, in fp32, times dx * d add to the
// row's sums. Three times fewer instructions a weight than widening both to fp32. Weight groups
// of 16 (GGUF's Q6_K) take two scales a block: lanes 0-3 hold k's 0-15, lanes 4-7 k's 16-31.
template <int M>
void int8_rows_int(const QArgs& a, const Acts& x, int64_t n0, int64_t n1, float* out) {
  const int64_t blocks = a.K / kXGroup, per_group = std::max<int64_t>(a.gs / kXGroup, 1);
  const bool halves = a.gs < kXGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const auto* q = reinterpret_cast<const int8_t*>(a.w + n * a.row_bytes);
    prefetch_next_scales(a.w + n * a.row_bytes, a.row_bytes, a.K);
    alignas(64) float dbuf[kMaxF16Scales];  // NOTE: used by f16 scales only
    const float* d = int8_scales(a, q, dbuf);
    GroupScales dg(d, per_group);
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < blocks; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kXGroup * j));
      const __m256i magnitude = _mm256_abs_epi8(w);
      const __m256 dj = halves ? _mm256_setr_m128(_mm_set1_ps(d[2 * j]), _mm_set1_ps(d[2 * j + 1]))
                               : _mm256_set1_ps(dg.next());
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.xq + m * a.K + kXGroup * j));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, w));
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc[m] = _mm256_fmadd_ps(sums, _mm256_mul_ps(_mm256_set1_ps(x.dx[m * blocks + j]), dj), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) out[m * a.N + n] = reduce_add(Vf{acc[m], _mm256_setzero_ps()});
  }
}

// Row m of x as int8 codes by groups of 32 along K, round half to even of x * 127 / max |x|
// (packing.round_to_int8_groups), and each group's step max |x| / 127.
template <typename T>
void quantize_x_groups(const T* x, int64_t x_stride, int64_t M, int64_t K, int8_t* xq, float* dx) {
  const int64_t blocks = K / kXGroup;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < blocks; ++j) {
      const T* xj = x + m * x_stride + kXGroup * j;
      Vf amax = vzero();
      for (int i = 0; i < kXGroup; i += kLanes) {
        const Vf v = load_full(xj + i);
        amax = vmax(amax, vmax(v, vzero() - v));
      }
      const float top = reduce_max(amax);
      const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
      __m256i codes[4];
      for (int i = 0; i < 2; ++i) {
        const Vf v = load_full(xj + kLanes * i);
        codes[2 * i] = _mm256_cvtps_epi32(_mm256_mul_ps(v.lo, inv));
        codes[2 * i + 1] = _mm256_cvtps_epi32(_mm256_mul_ps(v.hi, inv));
      }
      // packs interleave 128-bit lanes: the permute puts the 32 codes back in k order
      const __m256i words = _mm256_packs_epi32(codes[0], codes[1]), words2 = _mm256_packs_epi32(codes[2], codes[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + kXGroup * j), bytes);
      dx[m * blocks + j] = top / 127.f;
    }
}
#endif

template <int M>
void int8_rows(const QArgs& a, const Acts& x, int64_t n0, int64_t n1, float* out) {
#if defined(PAGODA_AVX2)
  if (x.xq) return int8_rows_int<M>(a, x, n0, n1, out);
  if (a.gs % kLanes == 0) return int8_rows_avx2<M>(a, x, n0, n1, out);
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const auto* q = reinterpret_cast<const int8_t*>(a.w + n * a.row_bytes);
    alignas(64) float dbuf[kMaxF16Scales];  // NOTE: used by f16 scales only
    const float* d = int8_scales(a, q, dbuf);
    for (int m = 0; m < M; ++m) {
      float y = 0.f;
      for (int64_t g = 0; g < a.G; ++g) {
        float t = 0.f;
        for (int64_t k = g * a.gs; k < (g + 1) * a.gs; ++k) t += static_cast<float>(q[k]) * x.xf[m * a.K + k];
        y += d[g] * t;
      }
      out[m * a.N + n] = y;
    }
  }
}

#endif

enum class Format { kInt4, kInt8 };

template <Format F, int M>
void rows_block(const QArgs& a, const Acts& x, int64_t n0, int64_t n1, float* out) {
  if constexpr (F == Format::kInt4) {
    int4_rows<M>(a, x, n0, n1, out);
  } else {
    int8_rows<M>(a, x, n0, n1, out);
  }
}

// Each thread takes ranges of output rows and runs every input row against each 16 of them,
// kMaxRows at a time, so that the weights come from DRAM once and from L1 for the other
// passes; then it stores y = out (+ bias), rounded once to T. `out` is [kMaxRows][N] scratch.
template <Format F, typename T>
void all_rows(const QArgs& a, const Acts& x, int64_t M, float* out, const T* bias, T* y, int64_t y_stride,
              int max_threads) {
  parallel_ranges(a.N, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t n0 = r0, n1 = std::min(r1, r0 + kRowGrain); n0 < r1; n0 = n1, n1 = std::min(r1, n1 + kRowGrain))
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      Acts xm = x;
      xm.xb = x.xb ? x.xb + m0 * a.K : nullptr;
      xm.xf = x.xf ? x.xf + m0 * a.K : nullptr;
      xm.sx = x.sx ? x.sx + m0 * a.G : nullptr;
      xm.xq = x.xq ? x.xq + m0 * a.K : nullptr;
      xm.dx = x.dx ? x.dx + m0 * x.dx_stride : nullptr;
      const int rows = static_cast<int>(std::min<int64_t>(M - m0, kMaxRows));
      switch (rows) {
        case 1: rows_block<F, 1>(a, xm, n0, n1, out); break;
        case 2: rows_block<F, 2>(a, xm, n0, n1, out); break;
        case 3: rows_block<F, 3>(a, xm, n0, n1, out); break;
        case 4: rows_block<F, 4>(a, xm, n0, n1, out); break;
        case 5: rows_block<F, 5>(a, xm, n0, n1, out); break;
        case 6: rows_block<F, 6>(a, xm, n0, n1, out); break;
        case 7: rows_block<F, 7>(a, xm, n0, n1, out); break;
        default: rows_block<F, 8>(a, xm, n0, n1, out); break;
      }
      for (int m = 0; m < rows; ++m)
        for (int64_t n = n0; n < n1; ++n)
          store_one(out[m * a.N + n] + (bias ? to_float(bias[n]) : 0.f), y + (m0 + m) * y_stride + n);
    }
  }, max_threads);
}

template <typename T>
void qgemv(Format format, const T* x, int64_t x_stride, const QArgs& a, const T* bias, T* y, int64_t y_stride,
           int64_t M, int max_threads) {
  thread_local std::vector<bf16> xb;
  thread_local std::vector<float> xf, sx, out;
  out.resize(std::min<int64_t>(M, kMaxRows) * a.N);
  Acts acts{nullptr, nullptr, nullptr};
  if (format == Format::kInt4) {
    const StreamOrder& order = stream_order(a.K);
    acts.order = &order;
#if defined(PAGODA_AVX2)
    // x as int8 codes by blocks of 32 in stream order, each word_block entry's step, and the
    // group sums of the rounded x (int4_rows_int).
    thread_local std::vector<int8_t> xq, codes;
    thread_local std::vector<float> block_dx;
    const int64_t blocks = a.K / kXGroup, dx_stride = static_cast<int64_t>(order.word_block.size());
    xq.resize(M * a.K);
    codes.resize(a.K);
    block_dx.resize(blocks);
    xf.resize(M * dx_stride);
    sx.assign(M * a.G, 0.f);
    for (int64_t m = 0; m < M; ++m) {
      quantize_x_groups(x + m * x_stride, x_stride, 1, a.K, codes.data(), block_dx.data());
      for (int64_t i = 0; i < a.K; ++i) xq[m * a.K + i] = codes[order.element[i]];
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t sum = 0;
        for (int64_t k = 0; k < kXGroup; ++k) sum += codes[kXGroup * b + k];
        sx[m * a.G + kXGroup * b / a.gs] += block_dx[b] * static_cast<float>(sum);
      }
      for (int64_t e = 0; e < dx_stride; ++e) xf[m * dx_stride + e] = block_dx[order.word_block[e]];
    }
    acts.xq = xq.data();
    acts.dx = xf.data();
    acts.dx_stride = dx_stride;
    acts.sx = sx.data();
    all_rows<Format::kInt4>(a, acts, M, out.data(), bias, y, y_stride, max_threads);
    return;
#endif
    // x in stream order, rounded to bf16; the group sums from the same rounded values.
    xb.resize(M * a.K);
    sx.assign(M * a.G, 0.f);
    for (int64_t m = 0; m < M; ++m) {
      const T* xm = x + m * x_stride;
      bf16* dst = &xb[m * a.K];
      for (int64_t i = 0; i < a.K; ++i) store_one(to_float(xm[order.element[i]]), dst + i);
      for (int64_t i = 0; i < a.K; ++i) sx[m * a.G + order.element[i] / a.gs] += to_float(dst[i]);
    }
    acts.xb = xb.data();
    acts.sx = sx.data();
    all_rows<Format::kInt4>(a, acts, M, out.data(), bias, y, y_stride, max_threads);
  } else {
#if defined(PAGODA_AVX2)
    if (a.K % kXGroup == 0 && (a.gs % kXGroup == 0 || a.gs == kXGroup / 2)) {
      thread_local std::vector<int8_t> xq;
      xq.resize(M * a.K);
      xf.resize(M * a.K / kXGroup);
      quantize_x_groups(x, x_stride, M, a.K, xq.data(), xf.data());
      acts.xq = xq.data();
      acts.dx = xf.data();
      acts.dx_stride = a.K / kXGroup;
      all_rows<Format::kInt8>(a, acts, M, out.data(), bias, y, y_stride, max_threads);
      return;
    }
#endif
    xf.resize(M * a.K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < a.K; ++k) xf[m * a.K + k] = to_float(x[m * x_stride + k]);
    acts.xf = xf.data();
    all_rows<Format::kInt8>(a, acts, M, out.data(), bias, y, y_stride, max_threads);
  }
}

// One row of W as T, each value q * d (+ m) in fp32 (the multiply and the add rounded
// apart, as torch computes them), then rounded once to T.
template <typename T>
void dequantize_row(Format format, const QArgs& a, const uint8_t* q, T* dst) {
  if (format == Format::kInt4) {
    const auto* d = reinterpret_cast<const uint16_t*>(q + a.K / 2);
    const StreamOrder& order = stream_order(a.K);
#ifdef PAGODA_AVX512
    // Per superblock: the values in stream order (16 at a time, each position's scale and
    // offset those of its lane's block), then moved to their elements two at a time (stream
    // positions 2i and 2i + 1 always hold elements k and k + 1).
    alignas(64) T tmp[512];
    alignas(64) float scale[32], offset[32];
    int64_t pos = 0;
    for (const Superblock& sb : order.superblocks) {
      const int lanes = 16 / sb.blocks;
      for (int p = 0; p < 32; ++p) {
        const int64_t g = (32 * (sb.block0 + p / 2 / lanes)) / a.gs;
        scale[p] = f16_from_bits(d[g]);
        offset[p] = f16_from_bits(d[a.G + g]);
      }
      const uint8_t* qs = q + pos / 2;
      for (int i = 0; i < 32 * sb.blocks; i += 16) {
        const int step = i / 64, within = i % 64, half = within / 32, p0 = within % 32;
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * step + p0)));
        const __m512i v = half == 0 ? _mm512_and_si512(b, _mm512_set1_epi32(15)) : _mm512_srli_epi32(b, 4);
        const Vf w{_mm512_cvtepi32_ps(v)};
        store(tmp + i, w * load(scale + p0) + load(offset + p0));
      }
      for (int i = 0; i < 32 * sb.blocks; i += 2) std::memcpy(dst + order.element[pos + i], tmp + i, 2 * sizeof(T));
      pos += 32 * sb.blocks;
    }
#else
    for (int64_t i = 0; i < a.K; ++i) {
      const uint8_t b = q[32 * (i / 64) + (i % 32)];
      const float v = static_cast<float>((i % 64) < 32 ? (b & 15) : (b >> 4));
      const int64_t k = order.element[i], g = k / a.gs;
      store_one(v * f16_from_bits(d[g]) + f16_from_bits(d[a.G + g]), dst + k);
    }
#endif
  } else {
    const auto* s = reinterpret_cast<const int8_t*>(q);
    alignas(64) float dbuf[kMaxF16Scales];
    const float* d = int8_scales(a, reinterpret_cast<const int8_t*>(q), dbuf);
#ifdef PAGODA_AVX512
    for (int64_t k = 0; k < a.K; k += 16) {
      const Vf w{_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k))))};
      store(dst + k, w * vset1(d[k / a.gs]));
    }
#else
    for (int64_t k = 0; k < a.K; ++k) store_one(static_cast<float>(s[k]) * d[k / a.gs], dst + k);
#endif
  }
}

// W as T [N, K], for large M where a dense matrix product wins.
template <typename T>
void dequantize(Format format, const QArgs& a, T* out) {
  parallel_ranges(a.N, kRowGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) dequantize_row(format, a, a.w + n * a.row_bytes, out + n * a.K);
  });
}

}  // namespace
}  // namespace pagoda

// The groups along K by which qgemv rounds x to int8 codes for int8 records of K and `gs` (0:
// it multiplies x as it is).
extern "C" int64_t pagoda_qgemv_x_group(int64_t K, int64_t gs) {  // int4 records: K, gs multiples of 32 always
#if defined(PAGODA_AVX2)
  const bool groups_fit = gs % pagoda::kXGroup == 0 || gs == pagoda::kXGroup / 2;
  return K % pagoda::kXGroup == 0 && groups_fit ? pagoda::kXGroup : 0;
#else
  (void)K;
  (void)gs;
  return 0;
#endif
}

#define PAGODA_QGEMV(SUFFIX, T)                                                                        \
  extern "C" void pagoda_qgemv_##SUFFIX(int format, const void* x, int64_t x_stride, const void* w,      \
                                        int64_t row_bytes, int64_t gs, const void* bias, void* y,      \
                                        int64_t y_stride, int64_t M, int64_t N, int64_t K,             \
                                        int max_threads) {                                             \
    const pagoda::QArgs a{static_cast<const uint8_t*>(w), row_bytes, N, K, K / gs, gs};               \
    pagoda::qgemv(static_cast<pagoda::Format>(format), static_cast<const T*>(x), x_stride, a,          \
                  static_cast<const T*>(bias), static_cast<T*>(y), y_stride, M, max_threads);          \
  }                                                                                                    \
  extern "C" void pagoda_dequantize_##SUFFIX(int format, const void* w, int64_t row_bytes, int64_t gs, \
                                             void* out, int64_t N, int64_t K) {                        \
    const pagoda::QArgs a{static_cast<const uint8_t*>(w), row_bytes, N, K, K / gs, gs};               \
    pagoda::dequantize(static_cast<pagoda::Format>(format), a, static_cast<T*>(out));                  \
  }

PAGODA_QGEMV(f32, float)
PAGODA_QGEMV(bf16, pagoda::bf16)
PAGODA_QGEMV(f16, pagoda::f16)
