// CPU references for permute_quantize and unpermute_backward_quantize:
// literally the compositions they are defined as. permute_quantize:
// quantize(x, 1x128 rowwise) into a temporary [T,H] fp8 buffer and its
// [T, ceil(H/128)] scales, then permute of those rows with the scales as
// PermuteExtras.scales. unpermute_backward_quantize: unpermute_backward into
// a temporary [capacity,H] of dout's dtype, then quantize of its rows below
// total_rows. Their kTensorwise form: the rows (permute, or
// unpermute_backward with the weights) into a temporary [capacity,H] of the
// input's dtype, then quantize_group_rows over the plan's groups; its
// columnwise form: permute into a zeroed temporary, then the columnwise half
// of quantize_rowwise_columnwise over the blocks below total_rows. The
// oracles of the fused CUDA kernels.
#include <algorithm>

#include "core/backends.h"
#include "core/mlp_call.h"
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

void unpermute_backward_quantize(TensorView dout, const RoutingPlan& plan, TensorView probs,
                                 TensorView dy, TensorView dy_scales,
                                 const QuantizeConfig& config) {
  const int64_t H = dout.shape[1];
  const int64_t total = plan.total_rows.data_ptr<int64_t>()[0];
  if (total <= 0) return;
  Tensor tmp = Tensor::empty({plan.capacity_rows, H}, dout.dtype, Device::cpu());
  cpu::unpermute_backward(dout, plan, {}, probs, tmp, {});
  const TensorView rows = TensorView::strided(tmp.data(), dout.dtype, Device::cpu(), {total, H},
                                              {H, 1});
  const TensorView q = TensorView::strided(dy.data, dy.dtype, Device::cpu(), {total, H},
                                           {dy.strides[0], 1});
  const TensorView s = TensorView::strided(dy_scales.data, DType::kFloat32, Device::cpu(),
                                           {total, dy_scales.shape[1]}, {dy_scales.shape[1], 1});
  cpu::quantize(rows, config, q, s);
}

void permute_quantize_tensorwise(TensorView x, const RoutingPlan& plan, TensorView weights,
                                 TensorView y, TensorView scale, TensorView y_t,
                                 const QuantizeConfig& config, TensorView probs,
                                 TensorView permuted_probs) {
  // (rows >= total_rows of tmp stay unwritten: they hold no data, so
  // quantize_group_rows never reads them)
  Tensor tmp = Tensor::empty({plan.capacity_rows, x.shape[1]}, x.dtype, Device::cpu());
  if (weights.defined())
    cpu::unpermute_backward(x, plan, {}, weights, tmp, {});
  else
    cpu::permute(x, plan, tmp, PermuteExtras{probs, permuted_probs, {}, {}});
  cpu::quantize_group_rows(GroupLayout::from_plan(plan), plan.num_experts(), tmp, config, y, scale,
                           y_t);
}

void permute_quantize_columnwise(TensorView x, const RoutingPlan& plan, TensorView y,
                                 TensorView y_scales, const QuantizeConfig& config) {
  // The rows, those holding no slot zero, quantized columnwise over the
  // 128-row blocks that start below total_rows (the later ones untouched).
  const int64_t H = x.shape[1], cap = plan.capacity_rows;
  const int64_t total = plan.total_rows.data_ptr<int64_t>()[0];
  const int64_t rows = std::min(cap, (total + quant::kBlock - 1) / quant::kBlock * quant::kBlock);
  if (rows <= 0 || H == 0) return;
  Tensor tmp = Tensor::zeros({cap, H}, x.dtype, Device::cpu());
  cpu::permute(x, plan, tmp, {});
  const TensorView src = TensorView::strided(tmp.data(), x.dtype, Device::cpu(), {rows, H}, {H, 1});
  const TensorView q =
      TensorView::strided(y.data, y.dtype, Device::cpu(), {H, rows}, {y.strides[0], 1});
  const TensorView s = TensorView::strided(y_scales.data, DType::kFloat32, Device::cpu(),
                                           {H, (rows + quant::kBlock - 1) / quant::kBlock},
                                           {y_scales.strides[0], y_scales.strides[1]});
  QuantizeConfig rowwise = config;
  rowwise.columnwise = false;
  cpu::quantize_rowwise_columnwise(src, rowwise, {}, {}, q, s);
}

}  // namespace moeflow::cpu
