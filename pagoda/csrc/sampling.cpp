// Greedy sampling's reduction (and, at the end, the watermark's pseudorandom function): each row's argmax, as torch's (the first maximum; a NaN counts as
// the maximum, so the first NaN wins). Two passes over a row: its maximum (returning at the first
// NaN), then the first element equal to it (a row of Gemma 3's 262144 bf16 logits is 512 KB, in
// L2 for the second pass). Rows split over the threads. torch's CPU argmax is not vectorized,
// and widening bf16 logits to fp32 first costs a write and a read of twice their bytes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace pagoda {
namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  Vf top = vset1(kLowest);
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(static_cast<int>(std::min<int64_t>(n - i, kLanes)));
    const Vf v = select(m, load(x + i, m), kLowest);
    if (const Mask nan = is_nan(v) & m) return i + __builtin_ctz(nan);
    top = vmax(top, v);
  }
  const Vf best = vset1(reduce_max(top));
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(static_cast<int>(std::min<int64_t>(n - i, kLanes)));
    if (const Mask hit = equal(load(x + i, m), best) & m) return i + __builtin_ctz(hit);
  }
  return 0;  // NOTE: not reached (the maximum is one of the row's values)
}

}  // namespace
}  // namespace pagoda

// out[r] = argmax of row r (n elements; rows `stride` elements apart).
#define PAGODA_SAMPLING(SUFFIX, T)                                                                   \
  extern "C" void pagoda_argmax_rows_##SUFFIX(const void* x, int64_t* out, int64_t rows, int64_t n,   \
                                              int64_t stride) {                                      \
    pagoda::parallel_ranges(rows, 1, [&](int64_t r0, int64_t r1) {                                   \
      for (int64_t r = r0; r < r1; ++r) out[r] = pagoda::argmax_row(static_cast<const T*>(x) + r * stride, n); \
    }, rows > 1 ? 1 << 30 : 1);                                                                      \
  }

PAGODA_SAMPLING(f32, float)
PAGODA_SAMPLING(bf16, pagoda::bf16)
PAGODA_SAMPLING(f16, pagoda::f16)

// ---- The watermark's pseudorandom function (pagoda/watermark.py): Philox4x32-10 (Salmon et
// al., SC'11) keyed by a 64-bit key, as vLLM's PhiloxPRF. Each row's context (its last `width`
// generated tokens, -1 before the answer's start) is absorbed four tokens a call into a 4-word
// state; then counter g (with the state and the key) gives the words of tokens 4g .. 4g + 3, each
// turned into a uniform in (0, 1) from its top 24 bits. Plain loops over the counters, which the
// compiler vectorizes (vpmuludq for the 32 x 32 -> 64-bit products).
namespace pagoda {
namespace {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
constexpr uint32_t kContextDomain = 0x574D4358u, kTokenDomain = 0x574D544Bu;

struct Words {
  uint32_t w[4];
};

inline Words philox(Words c, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kM0) * c.w[0], p1 = uint64_t(kM1) * c.w[2];
    c = Words{{uint32_t(p1 >> 32) ^ c.w[1] ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ c.w[3] ^ k1, uint32_t(p0)}};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

Words context_state(uint64_t key, const int64_t* context, int64_t width) {
  Words s{{kContextDomain, uint32_t(width), 0, 0}};
  for (int64_t offset = 0; offset < width; offset += 4) {
    Words c;
    for (int i = 0; i < 4; ++i) {
      const uint32_t token = offset + i < width ? uint32_t(context[offset + i]) : 0xFFFFFFFFu - uint32_t(i);
      c.w[i] = s.w[i] ^ token;
    }
    s = philox(c, uint32_t(key) ^ uint32_t(offset), uint32_t(key >> 32));
  }
  return s;
}

inline float to_uniform(uint32_t word) { return float((double(word >> 8) + 1.0) / 16777217.0); }

void uniforms_row(uint64_t key, const Words& s, int64_t g0, int64_t g1, int64_t vocab, float* out) {
  const uint32_t k0 = uint32_t(key) ^ s.w[3], k1 = uint32_t(key >> 32) ^ kTokenDomain;
  for (int64_t g = g0; g < g1; ++g) {
    const Words w = philox(Words{{uint32_t(g), s.w[0], s.w[1], s.w[2]}}, k0, k1);
    if (4 * g + 4 <= vocab) {
      for (int i = 0; i < 4; ++i) out[4 * g + i] = to_uniform(w.w[i]);
    } else {
      for (int i = 0; 4 * g + i < vocab; ++i) out[4 * g + i] = to_uniform(w.w[i]);
    }
  }
}

}  // namespace
}  // namespace pagoda

// out[r][t] = the uniform of token t (t < vocab) after row r's context (contexts: rows x width
// int64); rows `vocab` floats apart. Counters split over the threads.
extern "C" void pagoda_philox_uniform(uint64_t key, const int64_t* contexts, int64_t rows, int64_t width,
                                      int64_t vocab, float* out) {
  const int64_t groups = (vocab + 3) / 4;
  std::vector<pagoda::Words> states(rows);
  for (int64_t r = 0; r < rows; ++r) states[r] = pagoda::context_state(key, contexts + r * width, width);
  pagoda::parallel_ranges(rows * groups, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t r = i0 / groups; r * groups < i1; ++r) {
      const int64_t g0 = std::max(i0 - r * groups, int64_t(0)), g1 = std::min(i1 - r * groups, groups);
      pagoda::uniforms_row(key, states[r], g0, g1, vocab, out + r * vocab);
    }
  });
}

// ---- Top-k / top-p / min-p's candidates (pagoda/sampler.py): each row's `width` largest values
// of x / t (t the row's temperature; IEEE division, torch's bits), in descending order (ties: the
// lower index first) with their indices, and the log of the sum of exp over the whole row (the
// softmax's normalizer), without sorting the row: one pass for the maximum, one for the sum and
// the candidates, which keeps a buffer of those above a threshold and, when it holds 2 x width,
// keeps its top `width` (nth_element) and raises the threshold to the least kept. A row of
// SmolLM2's 49,152 logits: ~1,400 entries, three compactions; a row in ascending order, the worst
// case, compacts every `width` entries (still O(n width) at most). Fewer finite values than
// `width`: the first -inf positions fill the rest (all of them, and lse -inf, where none is
// finite). A row holding a NaN gets lse NaN and no candidates: it is left to the caller. Rows split over the threads.
namespace pagoda {
namespace {

struct Candidate {
  float value;
  int64_t index;
};

// NOTE: a function object, not a function pointer, so that nth_element and sort inline it
// (passed as a pointer it took half of a row's time)
constexpr auto ranks_before = [](const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
};

void keep_top(std::vector<Candidate>& buf, size_t width) {
  if (buf.size() <= width) return;
  std::nth_element(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(width) - 1, buf.end(), ranks_before);
  buf.resize(width);
}

float row_max(const float* x, int64_t n, bool& nan) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  Vf top = vset1(kLowest);
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(static_cast<int>(std::min<int64_t>(n - i, kLanes)));
    const Vf v = select(m, load(x + i, m), kLowest);
    if (is_nan(v) & m) {
      nan = true;
      return 0.0f;
    }
    top = vmax(top, v);
  }
  return reduce_max(top);
}

// NOTE: the row is ranked and summed as it is, and only the kept values divided: dividing by a
// positive t is monotone under IEEE rounding, so the order (and the maximum) is x / t's.
float top_row(const float* x, int64_t n, float temp, int64_t width, float* values, int64_t* index) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  bool nan = false;
  const float top = row_max(x, n, nan);
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  if (top == kLowest) {
    for (int64_t c = 0; c < width; ++c) values[c] = kLowest, index[c] = c;
    return kLowest;
  }
  const size_t keep = static_cast<size_t>(width);
  std::vector<Candidate> buf;
  buf.reserve(2 * keep + kLanes);
  float threshold = kLowest;
  const Vf inv = vset1(1.0f / temp), shift = vset1(top / temp);
  Vf sum = vzero();
  alignas(64) float lane[kLanes];
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(static_cast<int>(std::min<int64_t>(n - i, kLanes)));
    const Vf v = select(m, load(x + i, m), kLowest);
    sum = sum + vexp(vfma(v, inv, vzero() - shift));
    Mask hit = greater(v, vset1(threshold)) & m;
    if (!hit) continue;
    store(lane, v);
    for (; hit; hit &= hit - 1) {
      const int j = __builtin_ctz(hit);
      buf.push_back({lane[j], i + j});
    }
    if (buf.size() >= 2 * keep) {
      keep_top(buf, keep);
      threshold = buf[keep - 1].value;  // NOTE: nth_element leaves none kept below it
    }
  }
  keep_top(buf, keep);
  std::sort(buf.begin(), buf.end(), ranks_before);
  for (int64_t i = 0; i < n && buf.size() < keep; ++i) {
    if (x[i] == kLowest) buf.push_back({kLowest, i});
  }
  for (size_t c = 0; c < keep; ++c) {
    values[c] = c < buf.size() ? buf[c].value / temp : kLowest;
    index[c] = c < buf.size() ? buf[c].index : 0;
  }
  return top / temp + std::log(reduce_add(sum));
}

}  // namespace
}  // namespace pagoda

// Row r (n fp32 values; rows `stride` apart) divided by temps[r]: its `width` largest values
// (width <= n) into values[r * width ...], their indices into index[...], descending; lse[r] the
// log-sum-exp of the whole divided row (NaN, and no candidates, where the row holds a NaN; -inf
// where nothing is finite).
extern "C" void pagoda_top_candidates(const float* x, int64_t rows, int64_t n, int64_t stride, const float* temps,
                                      int64_t width, float* values, int64_t* index, float* lse) {
  pagoda::parallel_items(rows, [&](int64_t r) {
    lse[r] = pagoda::top_row(x + r * stride, n, temps[r], width, values + r * width, index + r * width);
  });
}

// ---- A row's draw by the inverse of its distribution (pagoda/sampler.py's `inverse_cdf`), for
// rows sampled at a temperature alone: p_i = exp((x_i - max) / t), unnormalized; the running sum
// in two levels, fp32 sums of blocks of kDrawBlock tokens kept in float64, then the float64 sums
// inside the one block that u x total falls in; the token whose interval holds it (a token of
// probability 0 adds nothing to the running sum, so none is ever picked; where rounding puts the
// target at or past the end, the last token of nonzero mass). Three passes over the row (its
// maximum, the block sums, one block again) against torch's division, softmax, block sums and
// gathers. A row holding a NaN, or no finite value: its argmax (torch's, a NaN counting as the
// maximum), as the sampler's whole-row path does.
namespace pagoda {
namespace {

constexpr int64_t kDrawBlock = 1024;

double block_mass(const float* x, int64_t n, Vf inv, Vf shift) {
  Vf sum = vzero();
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(static_cast<int>(std::min<int64_t>(n - i, kLanes)));
    const Vf v = select(m, load(x + i, m), -std::numeric_limits<float>::infinity());
    sum = sum + vexp(vfma(v, inv, vzero() - shift));
  }
  return reduce_add(sum);
}

int64_t draw_row(const float* x, int64_t n, float temp, double u, std::vector<double>& ends) {
  bool nan = false;
  const float top = row_max(x, n, nan);
  if (nan || top == -std::numeric_limits<float>::infinity()) return argmax_row(x, n);
  const float inv_t = 1.0f / temp, shift_t = top * inv_t;
  const Vf inv = vset1(inv_t), shift = vset1(shift_t);
  const int64_t blocks = (n + kDrawBlock - 1) / kDrawBlock;
  ends.assign(static_cast<size_t>(blocks), 0.0);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += block_mass(x + b * kDrawBlock, std::min(kDrawBlock, n - b * kDrawBlock), inv, shift);
    ends[static_cast<size_t>(b)] = total;
  }
  const double target = u * total;
  int64_t b = -1, last = 0;
  for (int64_t k = 0; k < blocks && b < 0; ++k) {
    const double before = k ? ends[static_cast<size_t>(k) - 1] : 0.0;
    if (ends[static_cast<size_t>(k)] > before) last = k;
    if (ends[static_cast<size_t>(k)] > target) b = k;
  }
  if (b < 0) b = last;  // NOTE: u x total rounded up to the total: the last block of nonzero mass
  const double start = b ? ends[static_cast<size_t>(b) - 1] : 0.0;
  const int64_t lo = b * kDrawBlock, hi = std::min(n, lo + kDrawBlock);
  alignas(64) float lane[kLanes];
  double running = 0.0;
  int64_t chosen = -1;
  for (int64_t i = lo; i < hi; i += kLanes) {
    const int count = static_cast<int>(std::min<int64_t>(hi - i, kLanes));
    const Vf v = select(tail_mask(count), load(x + i, tail_mask(count)), -std::numeric_limits<float>::infinity());
    store(lane, vexp(vfma(v, inv, vzero() - shift)));
    for (int j = 0; j < count; ++j) {
      // NOTE: probability 0 (fp32, as the block sums; a masked token's -inf whatever exp gives): never drawn
      if (!(lane[j] > 0.0f) || x[i + j] == -std::numeric_limits<float>::infinity()) continue;
      running += lane[j];
      chosen = i + j;
      if (start + running > target) return chosen;
    }
  }
  return chosen >= 0 ? chosen : argmax_row(x, n);
}

}  // namespace
}  // namespace pagoda

// out[r] = row r's token (n fp32 logits; rows `stride` apart) drawn at temperature temps[r] by
// uniforms[r] in [0, 1) (float64). Rows split over the threads.
extern "C" void pagoda_draw_rows(const float* x, int64_t rows, int64_t n, int64_t stride, const float* temps,
                                 const double* uniforms, int64_t* out) {
  pagoda::parallel_items(rows, [&](int64_t r) {
    std::vector<double> ends;
    out[r] = pagoda::draw_row(x + r * stride, n, temps[r], uniforms[r], ends);
  });
}
