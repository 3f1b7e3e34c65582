// The grouped expert MLP with FP8 GEMMs (docs/fp8.md, "Precision recipes"):
// FC1, FC2 and both input gradients run through grouped_gemm_fp8_forward on
// e4m3 codes. Blockwise recipe (DeepSeek-V3's): activations in 1x128
// blocks, weights in 128x128 blocks, float32 scales promoted every 128 of
// K. Tensorwise recipe: one scale per tensor from its amax (current
// scaling; an activation's over the groups' real rows only), the GEMMs'
// promotion as GroupedMlpConfig::gemm.fp8_promote says. The weight
// gradients: 16-bit GEMMs (grouped_mlp_backward_wgrad on x, a recomputed
// from h, dy and d_h, exactly as in the bf16 MLP), or FP8
// (grouped_mlp_fp8_backward_wgrad below; each expert's rows starting at a
// multiple of 128 blockwise, of 16 tensorwise).
// The same formulas as moeflow/grouped_mlp.h; no biases.
//
// Shapes: x [rows, H], h [rows, N1] (N1 = 2F gated, F plain), y [rows, H];
// bf16 data, H, N1 and F multiples of 128, the weights stacked. x, y, dy
// and dx may have strided rows (y and dx: even row strides); h and d_h are
// contiguous and distinct (FC2's dgrad writes d_h before the activation's
// backward reads h). Each
// expert's rows padded to a multiple of 16 (the plan's align) keep the FP8
// GEMM's tiles whole. Pad rows produce zeros and get no gradient.
// Deterministic; GPU calls (Hopper) enqueue on `stream` only, allocate
// nothing and synchronise with nothing (CUDA-graph safe); the CPU runs the
// references of the same ops.
#pragma once

#include "moeflow/grouped_mlp.h"

namespace moeflow {

enum class Fp8Recipe : uint8_t {
  kBlockwise,   // 1x128 activation blocks, 128x128 weight blocks
  kTensorwise,  // one scale per tensor (every *_scales below is [1])
};

// The weights' e4m3 codes and scales, both orientations (caller-owned;
// grouped_mlp_fp8_weights writes them once per weight update). Scales:
// blockwise as commented, tensorwise [1] float32 each (fc1_t's the same
// value as fc1's).
struct GroupedMlpFp8Weights {
  TensorView fc1, fc1_scales;      // [E, N1, H] e4m3, [E, N1/128, H/128] float32
  TensorView fc2, fc2_scales;      // [E, H, F], [E, H/128, F/128]
  TensorView fc1_t, fc1_t_scales;  // W1^T for FC1's dgrad: [E, H, N1], [E, H/128, N1/128]
  TensorView fc2_t, fc2_t_scales;  // W2^T for FC2's dgrad: [E, F, H], [E, F/128, H/128]
  Fp8Recipe recipe = Fp8Recipe::kBlockwise;
};

// One activation operand's codes at a time (caller-owned scratch): codes
// uint8 or e4m3 of >= rows * max(H, N1) bytes, 16-byte aligned, scales
// float32 of >= rows * max(H, N1) / 128 elements (tensorwise: >= 1), both
// contiguous; required even when rows = 0.
struct GroupedMlpFp8Scratch {
  TensorView codes;
  TensorView scales;
};

// Tensorwise FP8 codes of the rows of a grouped layout (the tensorwise
// recipe's operands): scale[0] from the amax of the groups' real rows only
// (rows r with offsets[e] <= r < offsets[e] + real_rows[e]; the whole
// segments without real_rows; every row of x when groups.offsets is
// undefined) by quantize.h's policy, those rows quantized with it, every
// other row of q written as code 0 (its x is not read). x [rows, K]
// float32/float16/bfloat16, q [rows, K] config.out, both with unit column
// stride (rows may be strided); scale [1] float32. config.scaling must be
// kTensorwise, rowwise. CUDA: four launches (the scale word zeroed, the
// amax, the codes, the scale), no workspace, no sync, graph-safe; bitwise
// the CPU reference.
void quantize_group_rows(TensorView x, const GroupLayout& groups, const QuantizeConfig& config,
                         TensorView q, TensorView scale, cudaStream_t stream = nullptr);
// The same, also writing q_t [K, rows] config.out, contiguous: q transposed
// (q_t[k][r] = q[r][k], what transpose_codes(q, q_t) writes: the tensorwise
// wgrad's K-major operand). CUDA: the codes launch writes both (still four
// launches, no sync, graph-safe).
void quantize_group_rows(TensorView x, const GroupLayout& groups, const QuantizeConfig& config,
                         TensorView q, TensorView scale, TensorView q_t,
                         cudaStream_t stream = nullptr);
// The same with the amax given ([1] float32, e.g. d(h)'s from
// grouped_mlp_activation_backward): scale[0] = the policy's scale of it and
// the codes pass alone; the same bits as quantize_group_rows when amax is
// the amax of x's data rows. q_t optional. CUDA: two launches.
void quantize_group_rows_with_amax(TensorView x, const GroupLayout& groups,
                                   const QuantizeConfig& config, TensorView amax, TensorView q,
                                   TensorView scale, TensorView q_t = {},
                                   cudaStream_t stream = nullptr);

// Quantizes w.fc1 / w.fc2 (stacked bf16 [E, N1, H] / [E, H, F]) into q by
// q.recipe: one read of each weight (tensorwise: two, the amax first), then
// transpose_codes for W^T's codes and scales.
void grouped_mlp_fp8_weights(const GroupedMlpWeights& w, const GroupedMlpFp8Weights& q,
                             cudaStream_t stream = nullptr);

// y = FC2(act(FC1(x)) * p) on FP8 codes; h [rows, N1] bf16 is written (the
// pre-activation backward reads). probs optional [rows] float32. The GEMMs
// take config.gemm's options (fp8_tile, fp8_promote).
void grouped_mlp_fp8_forward(TensorView x, const GroupedMlpFp8Weights& q,
                             const GroupLayout& groups, TensorView probs,
                             const GroupedMlpConfig& config, TensorView y, TensorView h,
                             const GroupedMlpFp8Scratch& scratch, cudaStream_t stream = nullptr);

// The input gradients: d_h [rows, N1] (d(h), kept for the wgrad), dx [rows,
// H] (optional: left undefined, only d_h and dprobs), dprobs optional
// [rows] float32 (with probs). Reads h, dy and the transposed codes.
void grouped_mlp_fp8_backward_dgrad(TensorView dy, const GroupedMlpFp8Weights& q,
                                    const GroupLayout& groups, TensorView probs,
                                    const GroupedMlpConfig& config, TensorView h, TensorView dx,
                                    TensorView d_h, TensorView dprobs,
                                    const GroupedMlpFp8Scratch& scratch,
                                    cudaStream_t stream = nullptr);

// The FP8 weight gradients' scratch (caller-owned): codes uint8 or e4m3 of
// >= rows * (H + N1) bytes, 16-byte aligned; scales float32 of >= (H + N1) *
// ceil(rows / 128) elements; a bf16 of >= rows * F elements (a recomputed
// from h; only with dw2). All contiguous.
struct GroupedMlpFp8WgradScratch {
  TensorView codes;
  TensorView scales;
  TensorView a;
};

// The weight gradients in FP8: dw2[e] (+)= dy_e^T a_e and dw1[e] (+)=
// d_h_e^T x_e through grouped_gemm_fp8_wgrad, the operands quantized along
// the rows (quantize_rowwise_columnwise's columnwise codes: 1x128 blocks of
// 128 rows, scales slice-major), a recomputed from h and probs
// (grouped_mlp_recompute_activation). dw2 [E, H, F] needs dy [rows, H];
// dw1 [E, N1, H] needs x [rows, H] and d_h [rows, N1] (the dgrad's d(h));
// either may be left undefined. dw float32 or bf16, stacked; accumulate as
// in grouped_gemm_fp8_wgrad. rows a multiple of 16; every group with real
// rows must start at a multiple of 128 (a plan with align 128): CUDA sets
// groups.error and leaves that expert's gradient as it was, the CPU throws.
// Pad rows enter the columnwise scales: they should be zero (as permute,
// dispatch and backward_dgrad write them).
void grouped_mlp_fp8_backward_wgrad(TensorView x, TensorView dy, const GroupLayout& groups,
                                    TensorView probs, const GroupedMlpConfig& config, TensorView h,
                                    TensorView d_h, TensorView dw1, TensorView dw2, bool accumulate,
                                    const GroupedMlpFp8WgradScratch& scratch,
                                    cudaStream_t stream = nullptr);
// The same by recipe. kTensorwise: each operand quantized rowwise with one
// scale over the groups' real rows (quantize_group_rows; a straight from h
// by grouped_mlp_activation_quantize, scratch.a unused), its codes
// transposed (the columnwise codes of one scale, from the quantize pass
// itself), then the
// tensorwise grouped_gemm_fp8_wgrad: every group with real rows must start
// at a multiple of 16 rows (the plan's FP8 align; otherwise as above: CUDA
// sets groups.error and leaves that gradient, the CPU throws).
// scratch.codes then needs rows * (H + N1 + max(H, N1)) bytes (the rowwise
// codes staged before their transpose), scratch.scales >= 2 elements.
void grouped_mlp_fp8_backward_wgrad(TensorView x, TensorView dy, const GroupLayout& groups,
                                    TensorView probs, const GroupedMlpConfig& config, TensorView h,
                                    TensorView d_h, TensorView dw1, TensorView dw2, bool accumulate,
                                    const GroupedMlpFp8WgradScratch& scratch, Fp8Recipe recipe,
                                    cudaStream_t stream = nullptr);

}  // namespace moeflow
