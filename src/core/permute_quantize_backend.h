// The backend entry points of permute_quantize and unpermute_backward_quantize
// (moeflow/permute.h). Arguments arrive validated: x / dout [T,H] float, y / dy
// [capacity,H] fp8, scales [capacity, ceil(H/128)] float32, config 1x128
// rowwise, extras without scales, probs [T,K] float32 or empty (the
// tensorwise form: scale [1], y_t [H, capacity] or empty; the columnwise
// form: y [H, capacity], scales [H, ceil(capacity/128)] any strides, no
// extras).
#pragma once

#include "moeflow/permute.h"

namespace moeflow {

namespace cpu {
void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      const QuantizeConfig& config, const PermuteExtras& extras);
void unpermute_backward_quantize(TensorView dout, const RoutingPlan& plan, TensorView probs,
                                 TensorView dy, TensorView dy_scales,
                                 const QuantizeConfig& config);
void permute_quantize_tensorwise(TensorView x, const RoutingPlan& plan, TensorView weights,
                                 TensorView y, TensorView scale, TensorView y_t,
                                 const QuantizeConfig& config, TensorView probs,
                                 TensorView permuted_probs);
// The columnwise form: y [H, capacity], y_scales [H, ceil(capacity/128)]
// (any strides), config 1x128 columnwise.
void permute_quantize_columnwise(TensorView x, const RoutingPlan& plan, TensorView y,
                                 TensorView y_scales, const QuantizeConfig& config);
}  // namespace cpu

namespace cuda {
void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      const QuantizeConfig& config, const PermuteExtras& extras,
                      cudaStream_t stream);
void unpermute_backward_quantize(TensorView dout, const RoutingPlan& plan, TensorView probs,
                                 TensorView dy, TensorView dy_scales,
                                 const QuantizeConfig& config, cudaStream_t stream);
// Both ops' kTensorwise form: rows gathered from x by the plan (weights
// empty: permute's rows, with probs / permuted_probs as PermuteExtras; [T,K]
// weights: unpermute_backward's w * dout rows), then quantize_group_rows over
// the plan's groups into y, scale [1] and y_t (optional).
void permute_quantize_tensorwise(TensorView x, const RoutingPlan& plan, TensorView weights,
                                 TensorView y, TensorView scale, TensorView y_t,
                                 const QuantizeConfig& config, TensorView probs,
                                 TensorView permuted_probs, cudaStream_t stream);
// The columnwise form (defined in quantize.cu: its 1x128 tile kernel with
// the rows gathered through plan.row_token).
void permute_quantize_columnwise(TensorView x, const RoutingPlan& plan, TensorView y,
                                 TensorView y_scales, const QuantizeConfig& config,
                                 cudaStream_t stream);
}  // namespace cuda

}  // namespace moeflow
