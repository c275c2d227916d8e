// A mixture-of-experts feed-forward block in one call (bf16 activations): pagoda/layers/
// fused_moe.py's `FusedMoE` with its router, for the layer path and the native decoder stack
// alike (decoder.cpp), so both compute the same bits.
//
//   logits = x . Wrouter^T (bf16, as the model's dtype rounds them)
//   p = softmax(logits) in fp32; the top k of p (the lower expert id first among equals),
//   renormalized to sum to one where asked (Mixtral; Qwen3-MoE with norm_topk_prob)
//   each expert, over its tokens in order: y = silu(rows . W1^T) * (rows . W3^T) . W2^T
//   out[t] = sum over t's experts in ascending id of bf16(y . w): w in fp32 (Mixtral) or rounded
//   to bf16 first (Qwen3-MoE), each add rounded to bf16, as transformers' loop adds them.
//
// The experts' products are the small-M GEMM's (bf16, int8 or int4 panels, or records: gemm.h),
// one product per projection over all of an expert's rows of the step.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "moe.h"
#include "parallel.h"
#include "vec.h"

extern "C" void pagoda_silu_and_mul_bf16(const void* x, void* out, int64_t rows, int n);

namespace pagoda {
namespace {

// Each token's top-k experts and their weights (fp32 [T, k], ids [T, k]) from the router's
// bf16 logits [T, E].
void route(const MoeLayer& m, const bf16* logits, int64_t T, float* weights, int64_t* ids) {
  const int64_t E = m.num_experts, K = m.top_k;
  parallel_items(T, [&](int64_t t) {
    thread_local std::vector<float> p;
    p.resize(size_t(E));
    const bf16* l = logits + t * E;
    float top = -INFINITY;
    for (int64_t e = 0; e < E; ++e) top = std::max(top, p[e] = to_float(l[e]));
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - top);
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    float* w = weights + t * K;
    int64_t* id = ids + t * K;
    float chosen = 0.f;
    for (int64_t j = 0; j < K; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (std::find(id, id + j, e) != id + j) continue;
        if (best < 0 || p[e] > p[best]) best = e;  // NOTE: among equals the lower id stays
      }
      id[j] = best;
      chosen += w[j] = p[best];
    }
    if (m.renormalize)
      for (int64_t j = 0; j < K; ++j) w[j] /= chosen;
  }, /*max_threads=*/T >= 64 ? 1 << 30 : 1);
}

// The scratch of one call (the calling thread's: calls do not overlap on a thread).
struct Scratch {
  std::vector<bf16> logits, rows, gate_up, act, y;
  std::vector<float> weights;
  std::vector<int64_t> ids, order, starts;
};

}  // namespace
}  // namespace pagoda

// out[T, hidden] = the block's output for x[T, hidden] (contiguous; out may be x).
extern "C" void pagoda_fused_moe_bf16(const void* layer, const void* x, void* out, int64_t T) {
  using namespace pagoda;
  const auto& m = *static_cast<const MoeLayer*>(layer);
  const int64_t E = m.num_experts, K = m.top_k, H = m.hidden, I = m.intermediate, P = T * K;
  // NOTE: a reference, so that the workers' lambdas below read the caller's scratch (a
  // thread_local named there would be each worker's own, empty one).
  static thread_local Scratch caller_scratch;
  Scratch& s = caller_scratch;
  s.logits.resize(size_t(T * E));
  s.weights.resize(size_t(P));
  s.ids.resize(size_t(P));
  pagoda_gemm_packed(&m.router, x, H, nullptr, s.logits.data(), E, T);
  route(m, s.logits.data(), T, s.weights.data(), s.ids.data());
  // The pairs (t, j) grouped by expert, tokens in order within one (a counting sort).
  s.starts.assign(size_t(E + 1), 0);
  for (int64_t p = 0; p < P; ++p) ++s.starts[s.ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) s.starts[e + 1] += s.starts[e];
  s.order.resize(size_t(P));
  {
    std::vector<int64_t> next(s.starts.begin(), s.starts.end() - 1);
    for (int64_t p = 0; p < P; ++p) s.order[next[s.ids[p]]++] = p;
  }
  s.rows.resize(size_t(P * H));
  const auto* xs = static_cast<const bf16*>(x);
  for (int64_t i = 0; i < P; ++i) std::memcpy(&s.rows[i * H], xs + s.order[i] / K * H, size_t(H) * 2);
  auto* o = static_cast<bf16*>(out);
  std::memset(o, 0, size_t(T * H) * 2);  // NOTE: x is read (gathered) by now: out may be x
  s.gate_up.resize(size_t(P * 2 * I));
  s.act.resize(size_t(P * I));
  s.y.resize(size_t(P * H));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = s.starts[e], count = s.starts[e + 1] - first;
    if (!count) continue;
    bf16* gu = &s.gate_up[first * 2 * I];
    bf16* act = &s.act[first * I];
    bf16* y = &s.y[first * H];
    // NOTE: the SiLU in the gate/up product's epilogue where the GEMM takes it (AMX rows), the same bits
    if (!pagoda_gemm_packed_gated(&m.w13[e], &s.rows[first * H], H, nullptr, act, I, count, kSiluGate)) {
      pagoda_gemm_packed(&m.w13[e], &s.rows[first * H], H, nullptr, gu, 2 * I, count);
      pagoda_silu_and_mul_bf16(gu, act, count, static_cast<int>(I));
    }
    pagoda_gemm_packed(&m.w2[e], act, I, nullptr, y, H, count);
    // NOTE: an expert's tokens are distinct, so its rows add in parallel; experts in id order.
    parallel_items(count, [&](int64_t i) {
      const int64_t pair = s.order[first + i];
      float w = s.weights[pair];
      if (m.weights_in_model_dtype) w = round_as<bf16>(w);
      bf16* dst = o + pair / K * H;
      const bf16* src = y + i * H;
      for (int64_t c = 0; c < H; ++c) add_rounded(to_float(src[c]) * w, dst + c);
    });
  }
}
