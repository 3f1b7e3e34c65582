// Permute (token order -> expert-major padded rows) and unpermute (back, with
// the copies of each token summed in float32), forward and backward, driven by
// a RoutingPlan. No host synchronisation; outputs are caller-allocated.
//
// Row ranges: rows < plan.total_rows hold data or pad rows (pad rows are
// written as zeros, only those); rows >= total_rows are never read or written.
#pragma once

#include "moeflow/plan.h"
#include "moeflow/quantize.h"
#include "moeflow/tensor.h"

namespace moeflow {

// Optional per-slot and per-row side data that travels with the tokens.
struct PermuteExtras {
  // probs:           [T,K] float32 (routing probability of each slot), contiguous.
  // permuted_probs:  [capacity] float32 out: probs of each row, 0 on pad rows.
  TensorView probs;
  TensorView permuted_probs;
  // scales:          [T,S] any dtype (e.g. float32 1x128 blockwise scales, uint8
  //                  e8m0 MXFP8 1x32 scales), contiguous.
  // permuted_scales: [capacity,S] same dtype out: scales of each row, 0 on pad rows.
  TensorView scales;
  TensorView permuted_scales;
};

// y[dest_row[t,k]] = x[t] for every kept slot; pad rows of y are zeroed.
//   x: [T,H] float32/float16/bfloat16/float8 (bytes moved as they are);
//      rows may be strided (stride(1) must be 1).
//   y: [capacity,H] same dtype; stride(1) must be 1.
void permute(TensorView x, const RoutingPlan& plan, TensorView y, const PermuteExtras& extras = {},
             cudaStream_t stream = nullptr);

// Permute with FP8 quantization fused in (the FC1 input of blockwise FP8
// training): exactly quantize(x, 1x128 rowwise) followed by permute of the
// fp8 rows with their scales, bit for bit on both backends; x is read once.
//   x:        [T,H] float32/float16/bfloat16; rows may be strided (stride(1) == 1).
//   y:        [capacity,H] config.out (fp8); stride(1) == 1. Pad rows: code 0.
//   y_scales: [capacity, ceil(H/128)] float32, contiguous: the scales of each
//             row (the same for the K copies of a token). Pad rows: 0 (as
//             permute writes permuted_scales on pad rows).
//   config:   scaling must be kBlock1x128; out e4m3/e5m2; pow2_scales honoured.
//   extras:   probs / permuted_probs as in permute; scales / permuted_scales
//             must be empty (y_scales takes their place).
// Dropped / unrouted slots write nothing; rows >= total_rows are untouched.
// CUDA: one kernel, no host sync, no allocation; graph-capturable.
//
// config.columnwise (the blockwise FP8 wgrad's operand): y and y_scales are
// the rows' transposed codes instead, exactly quantize(rows, config) with
// columnwise set, where rows = permute(x) [capacity,H] with every row that
// holds no slot zero (pad rows, rows >= total_rows): 1x128 blocks along the
// rows, each scale shared by 128 consecutive rows of one column.
//   y:        [H, capacity] config.out; stride(1) == 1.
//   y_scales: [H, ceil(capacity/128)] float32, any strides (the transpose of
//             a contiguous [ceil(capacity/128), H] is what
//             grouped_gemm_fp8_wgrad reads fastest).
//   extras:   must be empty (the rowwise call writes permuted_probs).
// The 128-row blocks starting at or past total_rows are left untouched.
// CUDA: one kernel (x 16-bit, H % 8 == 0, x / y rows 16-byte aligned: x read
// once per kept slot through a 128 x 128 tile; otherwise a per-element
// path), no host sync, no allocation; graph-capturable.
void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      const QuantizeConfig& config, const PermuteExtras& extras = {},
                      cudaStream_t stream = nullptr);
// The tensorwise recipe (config.scaling kTensorwise, the fp8-tensorwise FC1
// input): exactly permute(x, plan, tmp, extras) into a tmp [capacity,H] of
// x's dtype, then quantize_group_rows(tmp, GroupLayout::from_plan(plan),
// config, y, y_scales[, y_t]), bit for bit on both backends: one scale, from
// the amax of the kept slots' tokens; every row holding no slot (pad rows,
// rows >= total_rows) written as code 0.
//   y_scales: [1] float32.
//   y_t:      optional [H, capacity] config.out, contiguous: y transposed (the
//             tensorwise FP8 wgrad's operand), from the same pass.
// CUDA: the amax over the tokens (each read once), then the codes of the
// rows (each token read once per kept slot) and the scale; no host sync, no
// allocation; graph-capturable.
void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      TensorView y_t, const QuantizeConfig& config,
                      const PermuteExtras& extras = {}, cudaStream_t stream = nullptr);

// out[t] = sum over k of w[t,k] * y[dest_row[t,k]], accumulated in float32 in
// ascending k order (bitwise deterministic); dropped/unrouted slots add nothing.
//   y:           [capacity,H] float32/float16/bfloat16.
//   out:         [T,H] float32/float16/bfloat16.
//   merge_probs: optional [T,K] float32 weights w (omitted: w = 1).
void unpermute(TensorView y, const RoutingPlan& plan, TensorView out, TensorView merge_probs = {},
               cudaStream_t stream = nullptr);

// Gradient of permute: dx[t] = sum over k of dy[dest_row[t,k]] (float32 accumulation,
// ascending k), and, when given, dprobs[t,k] = dpermuted_probs[dest_row[t,k]] (0 if none).
//   dy: [capacity,H]; dx: [T,H] (float32/float16/bfloat16)
//   dpermuted_probs: optional [capacity] float32; dprobs: [T,K] float32 (with it).
void permute_backward(TensorView dy, const RoutingPlan& plan, TensorView dx,
                      TensorView dpermuted_probs = {}, TensorView dprobs = {},
                      cudaStream_t stream = nullptr);

// Gradient of unpermute with merge_probs:
//   dy[dest_row[t,k]] = w[t,k] * dout[t]   (w = 1 when probs is omitted; pad rows zeroed)
//   dprobs[t,k]       = <dout[t], y_fwd[dest_row[t,k]]>  (float32; 0 for dropped slots)
//   dout:   [T,H] float32/float16/bfloat16
//   y_fwd:  [capacity,H] the forward input of unpermute (needed for dprobs)
//   probs:  optional [T,K] float32 (the forward merge_probs)
//   dy:     [capacity,H] out, dtype of y_fwd (or any float dtype without y_fwd)
//   dprobs: optional [T,K] float32 out (needs y_fwd)
void unpermute_backward(TensorView dout, const RoutingPlan& plan, TensorView y_fwd,
                        TensorView probs, TensorView dy, TensorView dprobs = {},
                        cudaStream_t stream = nullptr);

// The gradient of unpermute with FP8 quantization fused in (the FC2 dgrad
// input of blockwise FP8 training): exactly unpermute_backward(dout, plan,
// {}, probs, tmp) into a tmp of dout's dtype, then quantize (1x128 rowwise)
// of tmp's rows < total_rows into dy and dy_scales, bit for bit on both
// backends; dout is read once.
//   dout:      [T,H] float32/float16/bfloat16; rows may be strided (stride(1) == 1).
//   probs:     optional [T,K] float32 (the forward's merge_probs): slot (t,k)'s
//              row quantizes w[t,k] * dout[t] rounded to dout's dtype (its own
//              scales); without probs the K rows of a token are the same.
//   dy:        [capacity,H] config.out (fp8); stride(1) == 1. Pad rows: code 0.
//   dy_scales: [capacity, ceil(H/128)] float32, contiguous. Pad rows: the
//              scale quantize gives a zero block (1).
//   config:    as permute_quantize (kBlock1x128, rowwise, e4m3/e5m2, pow2_scales).
// The probs' gradient reads the forward rows: unpermute_backward computes it.
// Dropped / unrouted slots write nothing; rows >= total_rows are untouched.
// CUDA: one kernel, no host sync, no allocation; graph-capturable.
void unpermute_backward_quantize(TensorView dout, const RoutingPlan& plan, TensorView probs,
                                 TensorView dy, TensorView dy_scales,
                                 const QuantizeConfig& config, cudaStream_t stream = nullptr);
// The tensorwise recipe (config.scaling kTensorwise, the fp8-tensorwise FC2
// dgrad input): exactly unpermute_backward(dout, plan, {}, probs, tmp) into a
// tmp [capacity,H] of dout's dtype, then quantize_group_rows(tmp,
// GroupLayout::from_plan(plan), config, dy, dy_scales[, dy_t]), bit for bit
// on both backends (one scale from the amax of the kept slots' w * dout;
// every row holding no slot, rows >= total_rows included, code 0).
//   dy_scales: [1] float32.
//   dy_t:      optional [H, capacity] config.out, contiguous: dy transposed.
// CUDA: as permute_quantize's tensorwise form.
void unpermute_backward_quantize(TensorView dout, const RoutingPlan& plan, TensorView probs,
                                 TensorView dy, TensorView dy_scales, TensorView dy_t,
                                 const QuantizeConfig& config, cudaStream_t stream = nullptr);

}  // namespace moeflow
