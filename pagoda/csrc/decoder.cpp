// A step's whole stack of decoder layers in one call (bf16 activations), Llama family (Qwen3's
// per-head q/k RMSNorm too) or Gemma 3: decodes and prefill chunks alike, whatever the
// paged-attention kernel takes.
//
// The Python path calls ~10 kernels a layer through ctypes and nn.Module (~60 us a layer,
// ~2 ms a step for 30 layers: as much as the attention at one stream). This runs the same
// kernels, in the same order, on the same buffers, from C++: per layer
//   (layer 0) residual = h, h = rms_norm(h); (others) residual += h, h = rms_norm(residual)
//   qkv = h . Wqkv^T; (Qwen3) q, k = q_norm(q), k_norm(k) per head, the layer norms' kernel;
//   rotate q and k in place (rotary, then over an fp8 pool the Hadamard
//   rotation of PagedAttention); write k, v to their slots; attn = paged
//   attention; h = attn . Wo^T; residual += h, h = rms_norm(residual); gate_up = h . Wgu^T;
//   act = silu(gate) * up (on AMX tiles, in that product's epilogue); h = act . Wdown^T
// Gemma 3 (kGemma3; pagoda/models/gemma3.py) differs per layer: its norms are Gemma's (fp32
// scales 1 + w), q and k heads are normalized before the rotary (each layer with its own table
// and window, local or global), attention and MLP outputs are normalized before the residual
// add, and the MLP is GeGLU (tanh GELU):
//   h = norm(residual) as above; qkv = h . Wqkv^T; q, k = q_norm(q), k_norm(k) per head;
//   rotary, cache, attention; h = post_attention_norm(attn . Wo^T); residual += h,
//   h = pre_ff_norm(residual); act = gelu(gate) * up; h = post_ff_norm(act . Wdown^T)
// so its results are bit for bit those of the Python path. The caller applies the final norm.
// Each linear is a packed weight of the small-M GEMM (bf16, int8 or int4 panels: gemm.h).
// A mixture-of-experts layer (Mixtral, Qwen3-MoE's sparse layers) runs its feed-forward block
// as the layer path does, through moe.cpp's one call (router, experts, weighted sum).
// Rows that run with a LoRA adapter (pagoda/lora.py) add its low-rank update to each adapted
// projection's output right after the product, as the Python path's hooks do: the same
// roundings (the update rounded to bf16, then added in fp32 and rounded), its products in fp32.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "moe.h"
#include "parallel.h"
#include "vec.h"

extern "C" {
void pagoda_rms_norm_bf16(const void* x, const void* weight, void* out, int64_t rows, int n, int64_t x_stride,
                          int64_t out_stride, float eps);
void pagoda_fused_add_rms_norm_bf16(void* x, void* residual, const void* weight, int64_t rows, int n, float eps);
void pagoda_gemma_rms_norm_bf16(const void* x, const void* scale, void* out, int64_t rows, int n, int64_t x_stride,
                                int64_t out_stride, float eps);
void pagoda_fused_add_gemma_rms_norm_bf16(void* x, void* residual, const void* scale, int64_t rows, int n, float eps);
void pagoda_silu_and_mul_bf16(const void* x, void* out, int64_t rows, int n);
void pagoda_gelu_tanh_and_mul_bf16(const void* x, void* out, int64_t rows, int n);
void pagoda_rotary_bf16(void* x, const int64_t* positions, const float* cos, const float* sin, int64_t num_tokens,
                        int num_heads, int head_dim, int64_t token_stride, int64_t head_stride);
void pagoda_hadamard_bf16(void* x, int64_t num_tokens, int num_heads, int head_dim, int64_t token_stride,
                          int64_t head_stride);
#define PAGODA_DECLARE_CACHE(SUFFIX)                                                                         \
  void pagoda_reshape_and_cache_##SUFFIX(const void* k, const void* v, void* k_cache, void* v_cache,         \
                                         const int64_t* slots, int64_t num_tokens, int64_t row_len,          \
                                         int64_t k_stride, int64_t v_stride, float k_scale, float v_scale);  \
  void pagoda_paged_attention_##SUFFIX(const void* q, const void* k_cache, const void* v_cache, void* out,    \
                                       const int64_t* block_tables, const int64_t* seq_lens,                  \
                                       const int64_t* query_start_loc, int num_seqs, int num_heads,           \
                                       int num_kv_heads, int head_dim, int block_size, int max_blocks,        \
                                       int64_t q_stride, int64_t out_stride, float scale, int64_t window,     \
                                       float k_scale, float v_scale);
PAGODA_DECLARE_CACHE(bf16)
PAGODA_DECLARE_CACHE(bf16_e4m3)
PAGODA_DECLARE_CACHE(bf16_e5m2)
#undef PAGODA_DECLARE_CACHE
}

namespace pagoda {
namespace {

// Mirrored by ctypes Structures in pagoda/models/native_decoder.py: keep the field order.
enum CacheKind : int64_t { kCacheBf16 = 0, kCacheE4m3 = 1, kCacheE5m2 = 2 };
enum Arch : int64_t { kLlama = 0, kGemma3 = 1 };

struct LinearWeight {
  GemmWeight weight;
  const void* bias;      // bf16 [n] or null
  const int64_t* perm;   // [k]: the input columns the weight's columns read (GPTQ act order), or null
};

struct DecoderLayer {
  const void* input_norm;
  const void* post_norm;  // Llama: before the MLP; Gemma 3: after attention (Gemma's: fp32 1 + w)
  LinearWeight qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
  float k_scale, v_scale;
  const float* cos;  // this layer's rotary table, fp32 [max_positions, head_dim]
  const float* sin;
  int64_t window;  // sliding window in tokens, 0 for none
  int64_t group;   // the KV cache group whose slots and block tables it reads (DecodeStep::groups)
  // Gemma 3 only (null otherwise): fp32 scales 1 + w
  const void* q_norm;
  const void* k_norm;
  const void* pre_ff_norm;
  const void* post_ff_norm;
  const MoeLayer* moe;  // a sparse feed-forward block in place of gate_up and down (Llama family), or null
};

struct DecoderStack {
  const DecoderLayer* layers;
  int64_t num_layers;
  int64_t hidden, intermediate;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  int64_t cache_kind;
  int64_t rotate_qk;  // 1: q and k rotated by the Hadamard matrix after rotary (an fp8 pool)
  int64_t arch;       // Arch
  float eps, scale;
};

// One KV cache group's view of the step (a hybrid cache gives sliding-window layers their own).
struct StepGroup {
  const int64_t* slots;
  const int64_t* block_tables;  // [num_seqs, max_blocks]
  int64_t max_blocks;
};

// One adapter's update of one projection (pagoda/lora.py's LoRAUpdate): y[:, start:start + width]
// += bf16((x . a^T) . b_t), a [r, k] fp32 (scaled: LoRAUpdate's a_t transposed), b_t [r, width]
// fp32; r = 0: not adapted.
struct LoraUpdate {
  const float* a;
  const float* b_t;
  const int64_t* cols;  // [r, 2]: each row of b_t's nonzero columns [begin, end)
  int64_t r, start, width;
};

// The rows of a step that run with one adapter (indices, ascending) and its updates, four a
// layer (qkv, o, gate_up, down) for every layer.
struct LoraRun {
  const int64_t* rows;
  int64_t count;
  const LoraUpdate* updates;
};
enum Projection : int { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

struct DecodeStep {
  int64_t num_tokens, num_seqs;
  const StepGroup* groups;
  const int64_t* positions;
  const int64_t* seq_lens;
  const int64_t* query_start_loc;
  void* h;         // [T, hidden]: in, the embedded tokens; out, the last layer's MLP output
  void* residual;  // [T, hidden]: out, the residual stream before that output is added
  void* qkv;       // scratch [T, q + 2 kv]
  void* attn;      // scratch [T, q]
  void* gate_up;   // scratch [T, 2 intermediate]
  void* act;       // scratch [T, intermediate]
  const LoraRun* lora_runs;  // the adapted rows (null: none)
  int64_t num_lora_runs;
};

// y[M, n] (row stride n) = x[M, k] . W^T (+ bias); with `perm`, x's columns gathered first.
void project(const LinearWeight& l, const void* x, void* y, int64_t M) {
  const int64_t k = l.weight.k;
  if (l.perm) {
    thread_local std::vector<bf16> gathered;
    gathered.resize(size_t(M * k));
    const auto* xs = static_cast<const bf16*>(x);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < k; ++c) gathered[m * k + c] = xs[m * k + l.perm[c]];
    x = gathered.data();
  }
  pagoda_gemm_packed(&l.weight, x, k, l.bias, y, l.weight.n, M);
}

// fp32 dot product of x and a (n long) in 32 running sums (four vectors' worth, so that it
// vectorizes and the adds do not wait on each other), then added.
inline float dot(const float* x, const float* a, int64_t n) {
  constexpr int kParts = 32;
  float part[kParts] = {};
  int64_t c = 0;
  for (; c + kParts <= n; c += kParts)
    for (int l = 0; l < kParts; ++l) part[l] += x[c + l] * a[c + l];
  float sum = 0.f;
  for (int l = 0; l < kParts; ++l) sum += part[l];
  for (; c < n; ++c) sum += x[c] * a[c];
  return sum;
}

// Columns a block of the update's second product: its sums stay in registers over b's rows.
constexpr int64_t kLoraCols = 64;

// The adapted rows' updates of projection `which` of layer `layer` (x [T, k] its input, y [T, n]
// its output): per adapter, mid = x . a^T for each of its rows, then for each block of columns
// every row's delta = mid . b_t, skipping rows of b_t that are zero over the block (a fused
// projection's b_t is block-diagonal), rounded to bf16 and added.
void adapt(const DecodeStep& t, int64_t layer, int which, const void* x, int64_t k, void* y, int64_t n) {
  for (int64_t i = 0; i < t.num_lora_runs; ++i) {
    const LoraRun& run = t.lora_runs[i];
    const LoraUpdate& u = run.updates[layer * 4 + which];
    if (u.r == 0) continue;
    const int64_t rows = run.count, r = u.r;
    std::vector<float> mid(size_t(rows * r));
    parallel_items(rows, [&](int64_t m) {
      thread_local std::vector<float> wide;
      wide.resize(size_t(k));
      const bf16* xr = static_cast<const bf16*>(x) + run.rows[m] * k;
      for (int64_t c = 0; c < k; ++c) wide[c] = to_float(xr[c]);
      for (int64_t j = 0; j < r; ++j) mid[m * r + j] = dot(wide.data(), u.a + j * k, k);
    });
    parallel_items((u.width + kLoraCols - 1) / kLoraCols, [&](int64_t block) {
      const int64_t c0 = block * kLoraCols, c1 = std::min(u.width, c0 + kLoraCols);
      for (int64_t m = 0; m < rows; ++m) {
        float delta[kLoraCols] = {};
        const float* acc = mid.data() + m * r;
        for (int64_t j = 0; j < r; ++j) {
          if (u.cols[2 * j] >= c1 || u.cols[2 * j + 1] <= c0) continue;
          const float* b = u.b_t + j * u.width + c0;
          const float w = acc[j];
          if (c1 - c0 == kLoraCols) {
            for (int64_t l = 0; l < kLoraCols; ++l) delta[l] += w * b[l];
          } else {
            for (int64_t l = 0; l < c1 - c0; ++l) delta[l] += w * b[l];
          }
        }
        bf16* out = static_cast<bf16*>(y) + run.rows[m] * n + u.start + c0;
        for (int64_t l = 0; l < c1 - c0; ++l) add_rounded(delta[l], out + l);
      }
    });
  }
}

// A projection and the adapted rows' updates of it.
void project(const LinearWeight& l, const DecodeStep& t, int64_t layer, int which, const void* x, void* y) {
  project(l, x, y, t.num_tokens);
  if (t.num_lora_runs) adapt(t, layer, which, x, l.weight.k, y, l.weight.n);
}

// Whether any row of the step adapts projection `which` of layer `layer`.
bool adapted(const DecodeStep& t, int64_t layer, int which) {
  for (int64_t i = 0; i < t.num_lora_runs; ++i)
    if (t.lora_runs[i].updates[layer * 4 + which].r) return true;
  return false;
}

// act = act(gate) * up of layer `layer`: in the gate/up product's epilogue where the GEMM can
// (gemm.h; the same bits), else the product into gate_up and then the elementwise kernel.
void gated(const DecoderStack& s, const DecoderLayer& l, const DecodeStep& t, int64_t layer, GatedAct act) {
  const int64_t T = t.num_tokens;
  if (!l.gate_up.perm && l.gate_up.weight.n == 2 * s.intermediate && !adapted(t, layer, kGateUp) &&
      pagoda_gemm_packed_gated(&l.gate_up.weight, t.h, l.gate_up.weight.k, l.gate_up.bias, t.act, s.intermediate,
                               T, act))
    return;
  project(l.gate_up, t, layer, kGateUp, t.h, t.gate_up);
  const auto elementwise = act == kSiluGate ? pagoda_silu_and_mul_bf16 : pagoda_gelu_tanh_and_mul_bf16;
  elementwise(t.gate_up, t.act, T, static_cast<int>(s.intermediate));
}

void attend(const DecoderStack& s, const DecoderLayer& l, const DecodeStep& t, char* qkv, int64_t row) {
  const int64_t T = t.num_tokens, q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  char* q = qkv;  // bf16 rows of `row` elements: q, then k, then v
  char* k = qkv + q_size * 2;
  char* v = k + kv_size * 2;
  const int H = static_cast<int>(s.num_heads), KV = static_cast<int>(s.num_kv_heads);
  const int D = static_cast<int>(s.head_dim), B = static_cast<int>(s.block_size);
  if (l.q_norm) {  // Gemma 3 and Qwen3: each head normalized in place, token by token
    const auto norm = s.arch == kGemma3 ? pagoda_gemma_rms_norm_bf16 : pagoda_rms_norm_bf16;
    for (int64_t i = 0; i < T; ++i) {
      norm(q + i * row * 2, l.q_norm, q + i * row * 2, H, D, D, D, s.eps);
      norm(k + i * row * 2, l.k_norm, k + i * row * 2, KV, D, D, D, s.eps);
    }
  }
  pagoda_rotary_bf16(q, t.positions, l.cos, l.sin, T, H, D, row, D);
  pagoda_rotary_bf16(k, t.positions, l.cos, l.sin, T, KV, D, row, D);
  if (s.rotate_qk) {
    pagoda_hadamard_bf16(q, T, H, D, row, D);
    pagoda_hadamard_bf16(k, T, KV, D, row, D);
  }
  const StepGroup& g = t.groups[l.group];
  auto run = [&](auto write, auto attention) {
    write(k, v, l.k_cache, l.v_cache, g.slots, T, kv_size, row, row, l.k_scale, l.v_scale);
    attention(q, l.k_cache, l.v_cache, t.attn, g.block_tables, t.seq_lens, t.query_start_loc,
              static_cast<int>(t.num_seqs), H, KV, D, B, static_cast<int>(g.max_blocks), row, q_size, s.scale,
              l.window, l.k_scale, l.v_scale);
  };
  switch (s.cache_kind) {
    case kCacheE4m3: run(pagoda_reshape_and_cache_bf16_e4m3, pagoda_paged_attention_bf16_e4m3); break;
    case kCacheE5m2: run(pagoda_reshape_and_cache_bf16_e5m2, pagoda_paged_attention_bf16_e5m2); break;
    default: run(pagoda_reshape_and_cache_bf16, pagoda_paged_attention_bf16);
  }
}

void decode_layer(const DecoderStack& s, const DecoderLayer& l, const DecodeStep& t, int64_t i, bool first) {
  const int64_t T = t.num_tokens;
  const int n = static_cast<int>(s.hidden);
  if (first) {
    std::memcpy(t.residual, t.h, size_t(T * s.hidden) * 2);
    pagoda_rms_norm_bf16(t.residual, l.input_norm, t.h, T, n, s.hidden, s.hidden, s.eps);
  } else {
    pagoda_fused_add_rms_norm_bf16(t.h, t.residual, l.input_norm, T, n, s.eps);
  }
  project(l.qkv, t, i, kQkv, t.h, t.qkv);
  attend(s, l, t, static_cast<char*>(t.qkv), l.qkv.weight.n);
  project(l.o, t, i, kO, t.attn, t.h);
  pagoda_fused_add_rms_norm_bf16(t.h, t.residual, l.post_norm, T, n, s.eps);
  if (l.moe) {
    pagoda_fused_moe_bf16(l.moe, t.h, t.h, T);
    return;
  }
  gated(s, l, t, i, kSiluGate);
  project(l.down, t, i, kDown, t.act, t.h);
}

// Gemma 3's layer (see the top of this file); its norms' weights are fp32 scales 1 + w.
void gemma3_layer(const DecoderStack& s, const DecoderLayer& l, const DecodeStep& t, int64_t i, bool first) {
  const int64_t T = t.num_tokens;
  const int n = static_cast<int>(s.hidden);
  auto norm_in_place = [&](const void* scale) {
    pagoda_gemma_rms_norm_bf16(t.h, scale, t.h, T, n, s.hidden, s.hidden, s.eps);
  };
  if (first) {
    std::memcpy(t.residual, t.h, size_t(T * s.hidden) * 2);
    norm_in_place(l.input_norm);
  } else {
    pagoda_fused_add_gemma_rms_norm_bf16(t.h, t.residual, l.input_norm, T, n, s.eps);
  }
  project(l.qkv, t, i, kQkv, t.h, t.qkv);
  attend(s, l, t, static_cast<char*>(t.qkv), l.qkv.weight.n);
  project(l.o, t, i, kO, t.attn, t.h);
  norm_in_place(l.post_norm);
  pagoda_fused_add_gemma_rms_norm_bf16(t.h, t.residual, l.pre_ff_norm, T, n, s.eps);
  gated(s, l, t, i, kGeluTanhGate);
  project(l.down, t, i, kDown, t.act, t.h);
  norm_in_place(l.post_ff_norm);
}

}  // namespace
}  // namespace pagoda

// Runs every layer of `stack` over one decode step. has_residual = 0: step->h holds the
// embedded tokens (layer 0 starts the residual stream); 1: step->residual already holds it.
extern "C" void pagoda_decoder_stack_bf16(const void* stack, const void* step, int64_t has_residual) {
  const auto& s = *static_cast<const pagoda::DecoderStack*>(stack);
  const auto& t = *static_cast<const pagoda::DecodeStep*>(step);
  const auto layer = s.arch == pagoda::kGemma3 ? pagoda::gemma3_layer : pagoda::decode_layer;
  for (int64_t i = 0; i < s.num_layers; ++i) layer(s, s.layers[i], t, i, i == 0 && !has_residual);
}

// The sizes of the structs Python mirrors with ctypes (pagoda/layers/cpu_kernels/ops.py,
// pagoda/models/native_decoder.py), in this order; checked when the library loads.
extern "C" void pagoda_abi_sizes(int64_t* out) {
  out[0] = sizeof(pagoda::GemmWeight);
  out[1] = sizeof(pagoda::LinearWeight);
  out[2] = sizeof(pagoda::DecoderLayer);
  out[3] = sizeof(pagoda::DecoderStack);
  out[4] = sizeof(pagoda::DecodeStep);
  out[5] = sizeof(pagoda::StepGroup);
  out[6] = sizeof(pagoda::LoraUpdate);
  out[7] = sizeof(pagoda::LoraRun);
  out[8] = sizeof(pagoda::MoeLayer);
}
