// Greedy sampling's reduction: each row's argmax, as torch's (the first maximum; a NaN counts as
// the maximum, so the first NaN wins). Two passes over a row: its maximum (returning at the first
// NaN), then the first element equal to it (a row of Gemma 3's 262144 bf16 logits is 512 KB, in
// L2 for the second pass). Rows split over the threads. torch's CPU argmax is not vectorized,
// and widening bf16 logits to fp32 first costs a write and a read of twice their bytes.
#include <algorithm>
#include <limits>

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
