// CPU reference for permute_quantize: literally the composition it is defined
// as, quantize(x, 1x128 rowwise) into a temporary [T,H] fp8 buffer and its
// [T, ceil(H/128)] scales, then permute of those rows with the scales as
// PermuteExtras.scales. The oracle of the fused CUDA kernel.
#include "core/backends.h"
#include "core/permute_quantize_backend.h"
#include "core/quantize_backend.h"

namespace moeflow::cpu {

void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      const QuantizeConfig& config, const PermuteExtras& extras) {
  const int64_t T = x.shape[0], H = x.shape[1];
  Tensor q = Tensor::empty({T, H}, config.out, Device::cpu());
  Tensor scales = Tensor::empty({T, y_scales.shape[1]}, DType::kFloat32, Device::cpu());
  cpu::quantize(x, config, q, scales);
  cpu::permute(q, plan, y, PermuteExtras{extras.probs, extras.permuted_probs, scales, y_scales});
}

}  // namespace moeflow::cpu
