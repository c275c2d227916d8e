// The mixture-of-experts block's one entry point (moe.cpp), shared by ctypes (pagoda/layers/
// fused_moe.py) and the native decoder stack (decoder.cpp).
#pragma once

#include <cstdint>

#include "gemm.h"

namespace pagoda {

// One sparse layer's router and experts; mirrored by fused_moe.py's `MoeLayerStruct` field for field.
struct MoeLayer {
  GemmWeight router;      // [num_experts, hidden]
  const GemmWeight* w13;  // num_experts of [2 intermediate, hidden]: gate rows, then up rows
  const GemmWeight* w2;   // num_experts of [hidden, intermediate]
  int64_t num_experts, top_k;
  int64_t renormalize;             // the top k's weights scaled to sum to one
  int64_t weights_in_model_dtype;  // an expert's weight rounded to bf16 before it scales its output
  int64_t hidden, intermediate;
};

}  // namespace pagoda

// out[T, hidden] = the block's output for x[T, hidden] (contiguous rows; out may be x).
extern "C" void pagoda_fused_moe_bf16(const void* layer, const void* x, void* out, int64_t T);
