// Public permute_quantize and unpermute_backward_quantize entry points:
// argument checks against the plan and the quantization config, then dispatch
// to the CPU or CUDA backend by the device of the plan.
#include "core/internal.h"
#include "core/permute_quantize_backend.h"
#include "core/quantize_backend.h"

namespace moeflow {

using detail::Expect;

namespace {

// A row-major [rows, cols] view: last dim unit stride, rows may be strided.
Expect rows_of(const std::vector<DType>& dtypes, int64_t rows, int64_t cols, Device device) {
  Expect e{dtypes, {rows, cols}, device};
  e.contiguous = false;
  e.inner_unit = true;
  return e;
}

// The config both ops take: fp8 out, 1x128 rowwise.
void check_rowwise_fp8(const QuantizeConfig& config, const char* op) {
  MOEFLOW_CHECK(config.out == DType::kFloat8E4M3 || config.out == DType::kFloat8E5M2, op,
                ": QuantizeConfig.out must be float8_e4m3 or float8_e5m2, got ",
                dtype_name(config.out));
  MOEFLOW_CHECK(config.scaling == QuantScaling::kBlock1x128, op,
                ": QuantizeConfig.scaling must be kBlock1x128 (1x128 rowwise), got ",
                config.scaling == QuantScaling::kTensorwise     ? "kTensorwise"
                : config.scaling == QuantScaling::kBlock128x128 ? "kBlock128x128"
                                                                : "an unknown value");
  MOEFLOW_CHECK(!config.columnwise, op,
                ": QuantizeConfig.columnwise must be false (rows are permuted)");
}

}  // namespace

void unpermute_backward_quantize(TensorView dout, const RoutingPlan& plan, TensorView probs,
                                 TensorView dy, TensorView dy_scales,
                                 const QuantizeConfig& config, cudaStream_t stream) {
  MOEFLOW_CHECK(plan.tokens_per_expert.defined(), "plan was not allocated (use allocate_plan)");
  check_rowwise_fp8(config, "unpermute_backward_quantize");
  const Device dev = plan.device;
  detail::expect_defined(dout, "dout");
  MOEFLOW_CHECK(dout.ndim == 2, "dout must be [T,H], got ", dout.str());
  const int64_t hidden = dout.shape[1];
  const int64_t nb = (hidden + quant::kBlock - 1) / quant::kBlock;
  detail::expect(dout, "dout",
                 rows_of({DType::kFloat32, DType::kBFloat16, DType::kFloat16}, plan.num_tokens,
                         hidden, dev));
  detail::expect(dy, "dy", rows_of({config.out}, plan.capacity_rows, hidden, dev));
  detail::expect(dy_scales, "dy_scales", Expect{{DType::kFloat32}, {plan.capacity_rows, nb}, dev});
  if (probs.defined())
    detail::expect(probs, "probs", Expect{{DType::kFloat32}, {plan.num_tokens, plan.topk}, dev});
  if (dev.is_cpu()) return cpu::unpermute_backward_quantize(dout, plan, probs, dy, dy_scales, config);
#ifdef MOEFLOW_WITH_CUDA
  detail::cuda_set_device(dev.index);
  cuda::unpermute_backward_quantize(dout, plan, probs, dy, dy_scales, config, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      const QuantizeConfig& config, const PermuteExtras& extras,
                      cudaStream_t stream) {
  MOEFLOW_CHECK(plan.tokens_per_expert.defined(), "plan was not allocated (use allocate_plan)");
  check_rowwise_fp8(config, "permute_quantize");
  const Device dev = plan.device;
  detail::expect_defined(x, "x");
  MOEFLOW_CHECK(x.ndim == 2, "x must be [T,H], got ", x.str());
  const int64_t hidden = x.shape[1];
  const int64_t nb = (hidden + quant::kBlock - 1) / quant::kBlock;
  detail::expect(x, "x",
                 rows_of({DType::kFloat32, DType::kBFloat16, DType::kFloat16}, plan.num_tokens,
                         hidden, dev));
  detail::expect(y, "y", rows_of({config.out}, plan.capacity_rows, hidden, dev));
  detail::expect(y_scales, "y_scales", Expect{{DType::kFloat32}, {plan.capacity_rows, nb}, dev});
  MOEFLOW_CHECK(!extras.scales.defined() && !extras.permuted_scales.defined(),
                "permute_quantize: PermuteExtras.scales and permuted_scales must be empty "
                "(the scales of y are written to y_scales)");
  MOEFLOW_CHECK(extras.probs.defined() == extras.permuted_probs.defined(),
                "PermuteExtras.probs and permuted_probs must be given together");
  if (extras.probs.defined()) {
    detail::expect(extras.probs, "probs",
                   Expect{{DType::kFloat32}, {plan.num_tokens, plan.topk}, dev});
    detail::expect(extras.permuted_probs, "permuted_probs",
                   Expect{{DType::kFloat32}, {plan.capacity_rows}, dev});
  }
  if (dev.is_cpu()) return cpu::permute_quantize(x, plan, y, y_scales, config, extras);
#ifdef MOEFLOW_WITH_CUDA
  detail::cuda_set_device(dev.index);
  cuda::permute_quantize(x, plan, y, y_scales, config, extras, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

}  // namespace moeflow
