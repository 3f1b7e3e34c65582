// Grouped GEMM with device-side group sizes: one GEMM per expert over the
// rows the layout gives it, in one launch, with no host synchronisation
// (CUDA-graph safe: new offsets on the device need no new capture).
//
//   forward: C_e  = A_e · W_e^T        A [rows,K], W [E,N,K], C [rows,N]
//   dgrad:   dA_e = dC_e · W_e         dC [rows,N], W [E,N,K], dA [rows,K]
//   wgrad:   dW_e (+)= dC_e^T · A_e    dC [rows,N], A [rows,K], dW [E,N,K]
//
// Group e owns rows [offsets[e], offsets[e+1]). With `real_rows`, rows from
// offsets[e] + real_rows[e] to offsets[e+1] are pad rows: forward and dgrad
// write zeros there, wgrad does not read them. Rows at or past offsets[E] are
// never read or written. Inputs bf16 or fp16 (A and W alike), float32
// accumulation, outputs bf16 / fp16 / float32; K and N multiples of 8.
// Deterministic. GPU calls enqueue on `stream` only; CPU calls run the
// reference. NOTE: on Hopper, dgrad with N not a multiple of 64 reads (and
// multiplies by zero) rows of the next expert's weights: they must be finite.
// NOTE: the views below do not own memory; keep their tensors alive.
#pragma once

#include "moeflow/plan.h"
#include "moeflow/tensor.h"
#include "moeflow/tuning.h"

namespace moeflow {

// E experts' weights, each [N,K] row-major (the [out, in] layout of a Linear).
struct GroupedWeights {
  TensorView stacked;              // [E,N,K] contiguous, or
  TensorView pointers;             // [E] int64: device addresses of E contiguous [N,K] tensors
  DType dtype = DType::kBFloat16;  // with pointers: dtype and shape of each
  int64_t n = 0;
  int64_t k = 0;

  static GroupedWeights from_stacked(TensorView w);
  static GroupedWeights from_pointers(TensorView pointers, DType dtype, int64_t n, int64_t k);
  int64_t num_groups() const;
  Device device() const;
};

// The pointer table of E separate expert tensors (each [N,K] contiguous, one
// dtype, one device): `table` holds their addresses ([E] int64, on their
// device) and `weights` reads through it. Allocates the table: call it at
// setup, not on the hot path, and keep the result (and the tensors) alive
// while `weights` is used.
struct ExpertTable {
  Tensor table;
  GroupedWeights weights;
};
ExpertTable make_expert_table(const std::vector<TensorView>& experts);

struct GroupLayout {
  TensorView offsets;    // [E+1] int64, on the device of the data (monotone, offsets[0] >= 0)
  TensorView real_rows;  // optional [E] int32: real rows of each group (the rest are pad rows)
  // Optional [1] int32 out: set to 1 when the offsets are bad (not monotone,
  // or past the rows of the matrices); the CUDA kernels then clamp them and
  // never read or write out of bounds. The CPU backend throws instead.
  TensorView error;

  // offsets = plan.expert_row_offsets, real_rows = plan.tokens_per_expert.
  static GroupLayout from_plan(const RoutingPlan& plan);
};

void grouped_gemm_forward(TensorView a, const GroupedWeights& w, const GroupLayout& groups,
                          TensorView c, cudaStream_t stream = nullptr);
void grouped_gemm_forward(TensorView a, const GroupedWeights& w, const GroupLayout& groups,
                          TensorView c, const GemmOptions& options, cudaStream_t stream = nullptr);

// The forward over gathered A rows: row m of the product reads row
// a_rows[m] of `a` (int32 [rows] on the device; -1 or >= a's rows: a zero
// row), so rows received once can feed every expert they go to without a
// copy per expert. a [source rows, K]; c [rows, N] of a's dtype. CUDA:
// Hopper with stacked weights only (else throws); CPU: the reference.
void grouped_gemm_forward_gathered(TensorView a, TensorView a_rows, const GroupedWeights& w,
                                   const GroupLayout& groups, TensorView c,
                                   const GemmOptions& options = {}, cudaStream_t stream = nullptr);

void grouped_gemm_dgrad(TensorView dc, const GroupedWeights& w, const GroupLayout& groups,
                        TensorView da, cudaStream_t stream = nullptr);
void grouped_gemm_dgrad(TensorView dc, const GroupedWeights& w, const GroupLayout& groups,
                        TensorView da, const GemmOptions& options, cudaStream_t stream = nullptr);

// dw: weights layout ([E,N,K] stacked or E pointers to [N,K]); float32 or
// the dtype of dc and a (written from the float32 accumulators, no float32
// buffer: bitwise the float32 dW rounded once). accumulate: dW += result
// (Megatron's gradient-accumulation fusion, by a TMA reduce-add: dW is not
// read by the SMs; bf16 / fp16: float(dW) + the result rounded to dW's
// dtype, rounded again, as autograd's grad += g); otherwise dW = result
// (experts with no rows get zeros).
void grouped_gemm_wgrad(TensorView dc, TensorView a, const GroupLayout& groups,
                        const GroupedWeights& dw, bool accumulate, cudaStream_t stream = nullptr);
void grouped_gemm_wgrad(TensorView dc, TensorView a, const GroupLayout& groups,
                        const GroupedWeights& dw, bool accumulate, const GemmOptions& options,
                        cudaStream_t stream = nullptr);

// Blockwise FP8 forward (DeepSeek-V3's recipe): C_e = dequant(A_e) ·
// dequant(W_e)^T with the products summed in float32 and scaled every 128 of
// K. a [rows, K] float8_e4m3 with a_scales [rows, K/128] float32 (quantize's
// kBlock1x128 rowwise layout); w [E, N, K] float8_e4m3 with w_scales
// [E, N/128, K/128] float32 (kBlock128x128 of w as [E*N, K]); c [rows, N]
// bf16, rows may be strided (stride(1) == 1, stride(0) even: e.g. columns
// of a wider buffer). K and N positive multiples of 128; a and w 16-byte
// aligned. Pad rows
// and rows past offsets[E] as in grouped_gemm_forward. Tensorwise: a_scales
// and w_scales [1] (one scale per operand), the tensor cores' sums promoted
// every GemmOptions::fp8_promote slices of 128, the scales' product applied
// once. CUDA: Hopper only,
// one launch, graph-safe; CPU: the reference (dequantized products summed in
// float64, rounded to float32, then to bf16).
void grouped_gemm_fp8_forward(TensorView a, TensorView a_scales, TensorView w, TensorView w_scales,
                              const GroupLayout& groups, TensorView c,
                              cudaStream_t stream = nullptr);
// The same with tuning options (raster, fp8_tile; moeflow/tuning.h).
void grouped_gemm_fp8_forward(TensorView a, TensorView a_scales, TensorView w, TensorView w_scales,
                              const GroupLayout& groups, TensorView c, const GemmOptions& options,
                              cudaStream_t stream = nullptr);

// Blockwise FP8 wgrad (variable K): dW_e (+)= dequant(dC_e)^T ·
// dequant(A_e), group e's rows [offsets[e], offsets[e] + real_rows[e]) being
// the reduction: each 128 rows' products summed by the tensor cores (FP8
// accumulation: fewer bits than float32), scaled per element by the two
// operands' block scales and added in float32. The operands come transposed, as quantize
// writes them with columnwise = true and kBlock1x128: dc_t [N, rows] e4m3
// with dc_t_scales [N, ceil(rows/128)] float32, a_t [K, rows] e4m3 with
// a_t_scales [K, ceil(rows/128)] float32 (any strides: a transposed view of
// a [rows/128, N] slice-major layout is read fastest). dw as in
// grouped_gemm_wgrad (float32 or bf16, stacked dW 16-byte aligned;
// accumulate into bf16: dW + the result rounded to bf16, rounded again, as
// autograd's grad += g; experts with no real rows get
// zeros, or stay as they are with accumulate). N and K positive multiples of
// 128; dc_t and a_t 16-byte aligned with row strides a multiple of 16. Every group with real rows
// must start at a multiple of 128 (a plan with align 128): the CUDA kernel
// sets groups.error and writes nothing of a group that does not (the CPU
// backend throws). Tensorwise: dc_t_scales and a_t_scales [1] (the rowwise
// codes of one scale, transposed), slices chained as in the forward, and
// groups starting at any multiple of 16 rows (the same flag otherwise). Pad rows are never read.
// CUDA: Hopper only, one launch, graph-safe; CPU: the reference (dequantized products summed in
// float64, then rounded to float32 and to dW's dtype).
void grouped_gemm_fp8_wgrad(TensorView dc_t, TensorView dc_t_scales, TensorView a_t,
                            TensorView a_t_scales, const GroupLayout& groups,
                            const GroupedWeights& dw, bool accumulate,
                            cudaStream_t stream = nullptr);
// The same with tuning options (raster, fp8_tile).
void grouped_gemm_fp8_wgrad(TensorView dc_t, TensorView dc_t_scales, TensorView a_t,
                            TensorView a_t_scales, const GroupLayout& groups,
                            const GroupedWeights& dw, bool accumulate, const GemmOptions& options,
                            cudaStream_t stream = nullptr);

}  // namespace moeflow
