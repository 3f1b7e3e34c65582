// The backend entry points of permute_quantize (moeflow/permute.h). Arguments
// arrive validated: x [T,H] float, y [capacity,H] fp8, y_scales
// [capacity, ceil(H/128)] float32, config 1x128 rowwise, extras without scales.
#pragma once

#include "moeflow/permute.h"

namespace moeflow {

namespace cpu {
void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      const QuantizeConfig& config, const PermuteExtras& extras);
}  // namespace cpu

namespace cuda {
void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      const QuantizeConfig& config, const PermuteExtras& extras,
                      cudaStream_t stream);
}  // namespace cuda

}  // namespace moeflow
