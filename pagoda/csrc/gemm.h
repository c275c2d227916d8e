// The small-M GEMM's one entry point (gemm.cpp), shared by ctypes (pagoda/layers/cpu_kernels/
// ops.py) and the native decoder stack (decoder.cpp).
#pragma once

#include <cstdint>

namespace pagoda {

// Panels (this GEMM's layout) or records (qgemv.cpp's rows: int8 with fp32 or f16 group scales,
// or int4, `scales` unused; the decoder stack takes them for steps of up to 16 rows).
enum PackedKind : int64_t {
  kPackedBf16 = 0, kPackedInt8 = 1, kPackedInt4 = 2, kInt8Records = 3, kInt4Records = 4, kInt8F16Records = 5,
  kPackedInt8Groups = 6, kPackedInt8F32Groups = 7, kPackedInt8F32GroupsOffsets = 8, kPackedInt8GroupsNarrow = 9,
  kPackedInt5 = 10, kPackedInt5F32 = 11, kPackedInt8F32GroupsWide = 12, kPackedInt8F32GroupsOffsetsWide = 13
};

// A weight [n, k] packed once at load; mirrored by ops.py's `GemmWeight` field for field.
struct GemmWeight {
  int64_t kind;        // PackedKind
  const void* data;    // bf16 values, int8 codes or int4 nibbles in the panel layout
  const void* scales;  // int8: fp32 per column; int8 groups (narrow too): f16 per panel, group and column;
                       // int8 fp32 groups: fp32 d (then m, with offsets) per panel and group;
                       // int4 (int5 too: `data` its nibbles, then its fifth bits): f16 d, m per panel
                       // and group (int5: d alone, m = -16 d; int5 f32: fp32 d, m); bf16: null
  int64_t group_size;  // int4 and int8 groups (32; int8 fp32 groups 16 or 32)
  int64_t n, k;
};

// A gated MLP's activation, which `pagoda_gemm_packed_gated` applies in the product's epilogue.
enum GatedAct : int64_t { kSiluGate = 1, kGeluTanhGate = 2 };

// Whether vdpbf16ps tiles beat fp32 FMAs on this CPU for a product of `rows` rows: the GEMM's
// measured choice (`pagoda_gemm_set_fma_rows`), which prefill attention follows too.
bool bf16_dot_wins(int64_t rows);

// Whether AMX tiles run the GEMM at `rows` rows (the measured choice, `pagoda_gemm_set_amx_rows`,
// on a CPU with AMX-BF16): prefill attention follows it too.
bool amx_dot_wins(int64_t rows);

}  // namespace pagoda

// qgemv.cpp's product over row records (format 0 int4, 1 int8), which the records kinds call.
extern "C" void pagoda_qgemv_bf16(int format, const void* x, int64_t x_stride, const void* w, int64_t row_bytes,
                                  int64_t gs, const void* bias, void* y, int64_t y_stride, int64_t M, int64_t N,
                                  int64_t K, int max_threads);

// y[M, n] (row stride y_stride) = x[M, k] (row stride x_stride) . W^T (+ bias[n]), W a
// `pagoda::GemmWeight`.
extern "C" void pagoda_gemm_packed(const void* weight, const void* x, int64_t x_stride, const void* bias, void* y,
                                   int64_t y_stride, int64_t M);

// A gated MLP's input in one product: y[M, n / 2] (row stride y_stride) = act(x . Wg^T + bg) *
// (x . Wu^T + bu), W = [Wg; Wu] a `pagoda::GemmWeight` [n, k] (bias likewise [n] or null), each
// factor rounded to bf16 first as `pagoda_gemm_packed` and then the elementwise kernels would
// round them: the same bits without the [M, n] intermediate. Returns 0, having done nothing,
// where it cannot (not on AMX tiles at these rows, n / 2 not a multiple of 32, records): the
// caller then takes the product and the elementwise kernel.
extern "C" int64_t pagoda_gemm_packed_gated(const void* weight, const void* x, int64_t x_stride, const void* bias,
                                           void* y, int64_t y_stride, int64_t M, int64_t act);
