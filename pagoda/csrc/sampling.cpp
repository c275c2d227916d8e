// Greedy sampling's reduction (and, at the end, the watermark's pseudorandom function): each row's argmax, as torch's (the first maximum; a NaN counts as
// the maximum, so the first NaN wins). Two passes over a row: its maximum (returning at the first
// NaN), then the first element equal to it (a row of Gemma 3's 262144 bf16 logits is 512 KB, in
// L2 for the second pass). Rows split over the threads. torch's CPU argmax is not vectorized,
// and widening bf16 logits to fp32 first costs a write and a read of twice their bytes.
#include <algorithm>
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
