// The grouped expert MLP: FC1 -> activation (GLU or plain) -> FC2 for every
// expert over its rows of a RoutingPlan-shaped layout, forward and backward,
// with the weight gradients separable from the input gradient (delayed wgrad).
//
//   h  = x · W1_e^T + b1_e                       [rows, N1]  (N1 = 2F gated, F plain)
//   a  = act(h) * p                              [rows, F]   (p = router prob of the row, or 1)
//   y  = a · W2_e^T + b2_e                       [rows, H]
//
// FC1 rows of a gated activation are [gate; up] halves (glu_interleave = 0)
// or interleaved blocks of glu_interleave gate rows then as many up rows
// (Megatron's glu_interleave_size). Pad rows produce zeros and get no
// gradient. bf16 or fp16 data, float32 probabilities and bias gradients;
// weight gradients float32 or the weights' dtype.
// Deterministic; GPU calls enqueue on `stream` only, allocate nothing and
// synchronise with nothing (CUDA-graph safe). On Hopper FC1's bias,
// activation and probability run in the GEMM's epilogue.
#pragma once

#include "moeflow/activation.h"
#include "moeflow/grouped_gemm.h"
#include "moeflow/quantize.h"

namespace moeflow {

struct GroupedMlpConfig {
  Activation activation = Activation::kSwiGLU;
  ActivationParams params;
  int glu_interleave = 0;  // gated FC1 row order: 0 = halves, else 8/16/32/64/128
  GemmOptions gemm;        // kernel choice and tuning of the GEMMs (moeflow/tuning.h)
};

// Weights (bf16 or fp16, one dtype): each FC weight either stacked in one
// tensor or as E separate tensors (moeflow/checkpoint.h loads both); give
// exactly one of fc1 / fc1_experts and of fc2 / fc2_experts. Stacked is the
// fast path on Hopper (the TMA kernels and the fused FC1 need it).
struct GroupedMlpWeights {
  TensorView fc1;    // [E, N1, H]
  TensorView fc2;    // [E, H, F]
  TensorView bias1;  // optional [E, N1]
  TensorView bias2;  // optional [E, H]
  // Or GroupedWeights::from_pointers([E] int64 addresses, dtype, N1, H) of E
  // contiguous [N1, H] tensors, and (..., H, F) of E [H, F] tensors.
  GroupedWeights fc1_experts;
  GroupedWeights fc2_experts;
};

// What forward keeps for backward: caller-owned buffers (sizes from shapes).
struct GroupedMlpSaved {
  TensorView h;  // [rows, N1] FC1 output with bias (pre-activation)
  TensorView a;  // [rows, F]  FC2 input: act(h) * p
};

// x [rows, H]; probs optional [rows] float32 (the "weighted" activation, so
// that unpermute need not keep its input); y [rows, H].
void grouped_mlp_forward(TensorView x, const GroupedMlpWeights& w, const GroupLayout& groups,
                         TensorView probs, const GroupedMlpConfig& config, TensorView y,
                         const GroupedMlpSaved& saved, cudaStream_t stream = nullptr);

// FC1 alone (the forward's first half): a [rows, F] = act(x · W1_e^T + b1_e)
// * p, and h [rows, N1] (the pre-activation, bias included) when given.
// Reads w.fc1 / w.fc1_experts and w.bias1 only. On GPUs without the fused
// kernel (or with separate weight tensors) h is required.
void grouped_mlp_fc1_forward(TensorView x, const GroupedMlpWeights& w, const GroupLayout& groups,
                             TensorView probs, const GroupedMlpConfig& config, TensorView a,
                             TensorView h = {}, cudaStream_t stream = nullptr);

// Input gradient now: dx [rows, H], d_h [rows, N1] (the FC1 output gradient,
// kept for backward_wgrad), dprobs optional [rows] float32 (with probs).
// dx may be left undefined: then only d_h (and dprobs) are computed, and
// backward_fc1_dgrad gives dx later.
// Reads saved.h only: saved.a may be left undefined here.
void grouped_mlp_backward_dgrad(TensorView dy, const GroupedMlpWeights& w,
                                const GroupLayout& groups, TensorView probs,
                                const GroupedMlpConfig& config, const GroupedMlpSaved& saved,
                                TensorView dx, TensorView d_h, TensorView dprobs = {},
                                cudaStream_t stream = nullptr);

// Weight gradients, each optional; accumulate: += (Megatron's
// gradient-accumulation fusion), else =. dtypes: dw1 / dw2 float32 or the
// weights' dtype (bf16 / fp16: float32 accumulation rounded once, see
// grouped_gemm_wgrad), dbias1 / dbias2 float32.
struct GroupedMlpGrads {
  TensorView dw1;     // [E, N1, H]
  TensorView dw2;     // [E, H, F]
  TensorView dbias1;  // [E, N1]
  TensorView dbias2;  // [E, H]
  bool accumulate = false;
  // Or E separate tensors per weight gradient (at most one of dw1 /
  // dw1_experts, of dw2 / dw2_experts): GroupedWeights::from_pointers(...,
  // dtype, N1, H) and (..., H, F), dtype as above.
  GroupedWeights dw1_experts;
  GroupedWeights dw2_experts;
};

// Recomputes a = act(h) * p (pad rows: zeros) from the saved pre-activation
// with the forward's arithmetic, so that only saved.h must live from forward
// to backward (give forward a scratch saved.a, run backward_dgrad without it,
// recompute a just before backward_wgrad).
void grouped_mlp_recompute_activation(TensorView h, const GroupLayout& groups, TensorView probs,
                                      const GroupedMlpConfig& config, TensorView a,
                                      cudaStream_t stream = nullptr);

// FC2's input in FP8 (blockwise FP8 training): a = act(h) * p rounded to h's
// dtype, exactly as recompute_activation writes it, then quantized 1x128
// rowwise (moeflow/quantize.h) into a_q [rows, F] (quant.out: e4m3 / e5m2;
// stride(1) == 1) and a_scales [rows, ceil(F/128)] float32, bit for bit the
// composition on the same backend; h is read once. Pad rows: code 0, scale
// 1 (a zero block); rows past the groups are untouched. quant: kBlock1x128,
// rowwise; or kTensorwise (a_scales [1]): one scale from the amax of a over
// the groups' real rows, every other row code 0 (quantize_group_rows of a;
// h read twice: the amax, then the codes). No host sync, no allocation;
// graph-capturable.
void grouped_mlp_activation_quantize(TensorView h, const GroupLayout& groups, TensorView probs,
                                     const GroupedMlpConfig& config, const QuantizeConfig& quant,
                                     TensorView a_q, TensorView a_scales,
                                     cudaStream_t stream = nullptr);
// The same (kTensorwise only) also writing a_q_t [F, rows] quant.out,
// contiguous: a_q transposed (the tensorwise FP8 wgrad's operand), from the
// codes pass (CUDA: still four launches).
void grouped_mlp_activation_quantize(TensorView h, const GroupLayout& groups, TensorView probs,
                                     const GroupedMlpConfig& config, const QuantizeConfig& quant,
                                     TensorView a_q, TensorView a_scales, TensorView a_q_t,
                                     cudaStream_t stream = nullptr);

// The activation's backward alone (backward_dgrad's middle step): d_h
// [rows, N1] holds d(a) in its last F columns (gated) or is d(a) (plain); on
// return d_h = d(h) (pad rows zero) and dprobs[row] = <d(a), act(h)> (optional
// [rows] float32, with probs). h [rows, N1] is the saved pre-activation.
void grouped_mlp_activation_backward(TensorView h, const GroupLayout& groups, TensorView probs,
                                     const GroupedMlpConfig& config, TensorView d_h,
                                     TensorView dprobs = {}, cudaStream_t stream = nullptr);
// The same, also writing d_h_amax [1] float32: the largest |d(h)| over the
// groups' real rows (finite values; 0 when none), what quantize_group_rows
// would take for d(h)'s tensorwise scale (quantize_group_rows_with_amax then
// skips its amax pass). CUDA: one more launch (the word zeroed).
void grouped_mlp_activation_backward(TensorView h, const GroupLayout& groups, TensorView probs,
                                     const GroupedMlpConfig& config, TensorView d_h,
                                     TensorView dprobs, TensorView d_h_amax,
                                     cudaStream_t stream = nullptr);

// dx = d_h · W1_e [rows, H]: FC1's input gradient alone, for a backward_dgrad
// called without dx (so that FC2's weight gradient can run, and dy be freed,
// before dx exists). Same sync and graph behaviour as backward_dgrad.
void grouped_mlp_backward_fc1_dgrad(TensorView d_h, const GroupedMlpWeights& w,
                                    const GroupLayout& groups, const GroupedMlpConfig& config,
                                    TensorView dx, cudaStream_t stream = nullptr);

// Weight gradients later (delayed wgrad). Each gradient reads only its own
// operands: dw2 dy and saved.a, dbias2 dy, dw1 d_h and x, dbias1 d_h; the
// others may be left undefined (e.g. FC2's gradients first, FC1's later).
void grouped_mlp_backward_wgrad(TensorView dy, TensorView x, const GroupLayout& groups,
                                const GroupedMlpSaved& saved, TensorView d_h,
                                const GroupedMlpGrads& grads, cudaStream_t stream = nullptr);
void grouped_mlp_backward_wgrad(TensorView dy, TensorView x, const GroupLayout& groups,
                                const GroupedMlpSaved& saved, TensorView d_h,
                                const GroupedMlpGrads& grads, const GemmOptions& gemm,
                                cudaStream_t stream = nullptr);

}  // namespace moeflow
