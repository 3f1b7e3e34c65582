// Backend entry of the fused FC1 of the grouped expert MLP (internal): the
// grouped GEMM x · W1_e^T with bias, activation and router-probability scale
// in its epilogue, optionally saving the pre-activation output for backward.
#pragma once

#include "core/activations.h"
#include "core/backends.h"
#include "moeflow/quantize.h"

namespace moeflow {

struct MlpFc1Call {
  TensorView x;   // [rows, H] bf16/fp16
  TensorView w1;  // [E, N1, H] stacked, same dtype; N1 = 2F gated, F plain
  GroupLayout groups;
  TensorView bias1;  // [E, N1] same dtype, or undefined
  TensorView probs;  // [rows] float32, or undefined
  Activation act = Activation::kSwiGLU;
  ActivationParams params;
  int glu_interleave = 0;  // gated: 0 = halves, else the block size (8..128)
  TensorView out;          // [rows, F] same dtype
  TensorView raw;          // [rows, N1] contiguous, or undefined
  int64_t rows = 0, num_groups = 0, hidden = 0, ffn = 0;
  GemmOptions options;
};

// FC2 dgrad with the dGLU fused (CUDA, Hopper): d(a) = dy . W2_e stays on
// chip; d_h = d(h) is written from it and the saved h. With dprobs, each
// row's partial <d(a), act(h)> per 256-column tile goes to part (float32,
// part_ld floats per row, ceil(F / 256) used) and mlp_dprobs_from_partials()
// sums them in order.
struct MlpDgluCall {
  TensorView dy;  // [rows, H]
  TensorView w2;  // [E, H, F] stacked
  GroupLayout groups;
  TensorView h;      // [rows, N1] saved pre-activation
  TensorView d_h;    // [rows, N1] out
  TensorView probs;  // [rows] float32, or undefined
  Activation act = Activation::kSwiGLU;
  ActivationParams params;
  int glu_interleave = 0;
  float* part = nullptr;  // or null (no dprobs)
  int64_t part_ld = 0;
  int64_t rows = 0, num_groups = 0, hidden = 0, ffn = 0;
  GemmOptions options;
};

// The elementwise steps of the grouped MLP around its GEMMs (validated
// arguments; groups as in grouped_gemm.h; pad rows are left zero / get none).
struct MlpRows {
  GroupLayout groups;
  int64_t num_groups = 0, rows = 0;
};
// CPU only (CUDA fuses it into FC1): h += bias1 (when given), a = act(h) * p.
// h [rows, N1], a [rows, F].
// y += bias2 of the row's expert on data rows. y [rows, H], bias [E, H].
// dGLU: d_h holds d(a) in its columns [N1-F, N1) (gated) or is d(a) (plain);
// on return d_h = d(h) (pad rows zero) and dprobs[row] = <d(a), act(h)> (with probs).
// Per-expert column sums of src's data rows: dst [E, C] float32 (+= with accumulate).
namespace cpu {
void mlp_fc1_epilogue(const MlpRows& r, TensorView h, TensorView bias1, TensorView probs,
                      Activation act, const ActivationParams& ap, int interleave, TensorView a);
void mlp_bias_add(const MlpRows& r, TensorView y, TensorView bias);
void mlp_dglu(const MlpRows& r, TensorView h, TensorView d_h, TensorView probs, Activation act,
              const ActivationParams& ap, int interleave, int64_t ffn, TensorView dprobs);
void mlp_segment_colsum(const MlpRows& r, TensorView src, TensorView dst, bool accumulate);
// quantize_group_rows (moeflow/grouped_mlp_fp8.h), arguments validated;
// groups.offsets undefined: every row holds data; q_t optional.
void quantize_group_rows(const GroupLayout& groups, int64_t num_groups, TensorView x,
                         const QuantizeConfig& config, TensorView q, TensorView scale,
                         TensorView q_t);
// The amax quantize_group_rows takes: the largest finite |x| over the data rows.
float group_rows_amax(const GroupLayout& groups, int64_t num_groups, TensorView x);
// quantize_group_rows with that amax given.
void quantize_group_rows_with_amax(const GroupLayout& groups, int64_t num_groups, TensorView x,
                                   const QuantizeConfig& config, float amax, TensorView q,
                                   TensorView scale, TensorView q_t);
}  // namespace cpu

namespace cuda {
// Hopper (sm_90a) only; throws on other GPUs. mlp_fc1_fusable() says whether
// it takes the call (else: grouped GEMM + mlp_fc1_epilogue).
bool mlp_fc1_fusable(const MlpFc1Call& call);
void mlp_fc1_forward(const MlpFc1Call& call, cudaStream_t stream);
void mlp_fc1_epilogue(const MlpRows& r, TensorView h, TensorView bias1, TensorView probs,
                      Activation act, const ActivationParams& ap, int interleave, TensorView a,
                      cudaStream_t stream);
// a = act(h) * p (h's dtype) quantized 1x128 rowwise into a_q / a_scales
// (grouped_mlp_activation_quantize; arguments validated).
void mlp_activation_quantize(const MlpRows& r, TensorView h, TensorView probs, Activation act,
                             const ActivationParams& ap, int interleave, bool e4m3, bool pow2,
                             TensorView a_q, TensorView a_scales, cudaStream_t stream);
// The same with one scale for the groups' data rows (kTensorwise; a_scale
// [1]): the amax of a over them, then the codes; other rows code 0; a_q_t
// (optional) the codes transposed, from the codes pass.
void mlp_activation_quantize_tensorwise(const MlpRows& r, TensorView h, TensorView probs,
                                        Activation act, const ActivationParams& ap, int interleave,
                                        bool e4m3, bool pow2, TensorView a_q, TensorView a_scale,
                                        TensorView a_q_t, cudaStream_t stream);
void quantize_group_rows(const GroupLayout& groups, int64_t num_groups, TensorView x,
                         const QuantizeConfig& config, TensorView q, TensorView scale,
                         TensorView q_t, cudaStream_t stream);
// amax: [1] float32 on the device (read by the kernels, not the host).
void quantize_group_rows_with_amax(const GroupLayout& groups, int64_t num_groups, TensorView x,
                                   const QuantizeConfig& config, TensorView amax, TensorView q,
                                   TensorView scale, TensorView q_t, cudaStream_t stream);
void mlp_bias_add(const MlpRows& r, TensorView y, TensorView bias, cudaStream_t stream);
// d_h_amax (optional [1] float32): zeroed, then d(h)'s amax over the data rows.
void mlp_dglu(const MlpRows& r, TensorView h, TensorView d_h, TensorView probs, Activation act,
              const ActivationParams& ap, int interleave, int64_t ffn, TensorView dprobs,
              cudaStream_t stream, TensorView d_h_amax = {});
bool mlp_dglu_fusable(const MlpDgluCall& call);
void mlp_fc2_dgrad_dglu(const MlpDgluCall& call, cudaStream_t stream);
// dprobs[row] = sum over t < tiles of part[row * part_ld + t] (rows inside the groups).
void mlp_dprobs_from_partials(const MlpRows& r, const float* part, int64_t part_ld, int64_t tiles,
                              TensorView dprobs, cudaStream_t stream);
void mlp_segment_colsum(const MlpRows& r, TensorView src, TensorView dst, bool accumulate,
                        cudaStream_t stream);
}  // namespace cuda

}  // namespace moeflow
