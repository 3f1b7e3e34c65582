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

// The config both ops take: fp8 out, rowwise, 1x128 blocks or one scale
// (kTensorwise, the only form with a transposed output: with_t).
void check_rowwise_fp8(const QuantizeConfig& config, const char* op, bool with_t) {
  MOEFLOW_CHECK(config.out == DType::kFloat8E4M3 || config.out == DType::kFloat8E5M2, op,
                ": QuantizeConfig.out must be float8_e4m3 or float8_e5m2, got ",
                dtype_name(config.out));
  const bool tensor = config.scaling == QuantScaling::kTensorwise;
  MOEFLOW_CHECK(tensor || (!with_t && config.scaling == QuantScaling::kBlock1x128), op,
                ": QuantizeConfig.scaling must be ",
                with_t ? "kTensorwise (with the transposed output)"
                       : "kBlock1x128 (1x128 rowwise) or kTensorwise",
                ", got ",
                config.scaling == QuantScaling::kBlock128x128 ? "kBlock128x128"
                : config.scaling == QuantScaling::kBlock1x128 ? "kBlock1x128"
                                                              : "an unknown value");
  MOEFLOW_CHECK(!config.columnwise, op,
                ": QuantizeConfig.columnwise must be false (rows are permuted)");
}

// The rows' scales: [capacity, ceil(H/128)] (1x128) or [1] (tensorwise); the
// transposed codes (tensorwise only): [H, capacity] contiguous or undefined.
void check_scales(const RoutingPlan& plan, const QuantizeConfig& config, TensorView scales,
                  const char* scales_name, TensorView y, TensorView t, const char* t_name,
                  int64_t hidden) {
  const Device dev = plan.device;
  if (config.scaling == QuantScaling::kTensorwise) {
    detail::expect(scales, scales_name, Expect{{DType::kFloat32}, {1}, dev});
    if (t.defined()) {
      const int64_t rows = plan.capacity_rows;
      detail::expect(t, t_name, Expect{{config.out}, {hidden, rows}, dev});
      // (the codes' last row may be strided: their span is rows * stride)
      const auto* yb = static_cast<const uint8_t*>(y.data);
      const auto* tb = static_cast<const uint8_t*>(t.data);
      const int64_t y_span = rows > 0 ? (rows - 1) * y.strides[0] + hidden : 0;
      MOEFLOW_CHECK(tb + rows * hidden <= yb || yb + y_span <= tb, t_name,
                    " must not overlap the codes");
    }
    return;
  }
  const int64_t nb = (hidden + quant::kBlock - 1) / quant::kBlock;
  detail::expect(scales, scales_name, Expect{{DType::kFloat32}, {plan.capacity_rows, nb}, dev});
}

// permute_quantize's columnwise form: y [H, capacity] (the rows' codes
// transposed), y_scales [H, ceil(capacity/128)] with any strides.
void permute_quantize_columnwise(TensorView x, const RoutingPlan& plan, TensorView y,
                                 TensorView y_scales, TensorView y_t, const QuantizeConfig& config,
                                 const PermuteExtras& extras, cudaStream_t stream) {
  const char* op = "permute_quantize";
  MOEFLOW_CHECK(config.out == DType::kFloat8E4M3 || config.out == DType::kFloat8E5M2, op,
                ": QuantizeConfig.out must be float8_e4m3 or float8_e5m2, got ",
                dtype_name(config.out));
  MOEFLOW_CHECK(config.scaling == QuantScaling::kBlock1x128, op,
                ": QuantizeConfig.columnwise needs scaling kBlock1x128");
  MOEFLOW_CHECK(!y_t.defined(), op,
                ": y_t must be empty with QuantizeConfig.columnwise (y is the transposed codes)");
  MOEFLOW_CHECK(!extras.probs.defined() && !extras.permuted_probs.defined() &&
                    !extras.scales.defined() && !extras.permuted_scales.defined(),
                op, ": PermuteExtras must be empty with QuantizeConfig.columnwise");
  const Device dev = plan.device;
  detail::expect_defined(x, "x");
  MOEFLOW_CHECK(x.ndim == 2, "x must be [T,H], got ", x.str());
  const int64_t hidden = x.shape[1], rows = plan.capacity_rows;
  detail::expect(
      x, "x",
      rows_of({DType::kFloat32, DType::kBFloat16, DType::kFloat16}, plan.num_tokens, hidden, dev));
  detail::expect(y, "y", rows_of({config.out}, hidden, rows, dev));
  const int64_t nb = (rows + quant::kBlock - 1) / quant::kBlock;
  Expect se{{DType::kFloat32}, {hidden, nb}, dev};
  se.contiguous = false;
  detail::expect(y_scales, "y_scales", se);
  // any strides, as long as no two scales share an address (one dimension
  // steps over the whole other one)
  const int64_t s0 = y_scales.strides[0], s1 = y_scales.strides[1];
  MOEFLOW_CHECK(hidden * nb <= 1 || (s0 > 0 && s1 > 0 && (s0 >= nb * s1 || s1 >= hidden * s0)),
                "y_scales: strides [", s0, ",", s1, "] make scales of [", hidden, ",", nb,
                "] overlap");
  if (hidden * rows > 0 && hidden * nb > 0) {
    const auto* yb = static_cast<const uint8_t*>(y.data);
    const auto* sb = static_cast<const uint8_t*>(y_scales.data);
    const int64_t y_span = (hidden - 1) * y.strides[0] + rows;
    const int64_t s_span = ((hidden - 1) * s0 + (nb - 1) * s1 + 1) * 4;
    MOEFLOW_CHECK(sb + s_span <= yb || yb + y_span <= sb, "y_scales must not overlap y");
  }
  if (dev.is_cpu()) return cpu::permute_quantize_columnwise(x, plan, y, y_scales, config);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::permute_quantize_columnwise(x, plan, y, y_scales, config, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

}  // namespace

void unpermute_backward_quantize(TensorView dout, const RoutingPlan& plan, TensorView probs,
                                 TensorView dy, TensorView dy_scales,
                                 const QuantizeConfig& config, cudaStream_t stream) {
  unpermute_backward_quantize(dout, plan, probs, dy, dy_scales, TensorView{}, config, stream);
}

void unpermute_backward_quantize(TensorView dout, const RoutingPlan& plan, TensorView probs,
                                 TensorView dy, TensorView dy_scales, TensorView dy_t,
                                 const QuantizeConfig& config, cudaStream_t stream) {
  MOEFLOW_CHECK(plan.tokens_per_expert.defined(), "plan was not allocated (use allocate_plan)");
  check_rowwise_fp8(config, "unpermute_backward_quantize", dy_t.defined());
  const Device dev = plan.device;
  detail::expect_defined(dout, "dout");
  MOEFLOW_CHECK(dout.ndim == 2, "dout must be [T,H], got ", dout.str());
  const int64_t hidden = dout.shape[1];
  detail::expect(dout, "dout",
                 rows_of({DType::kFloat32, DType::kBFloat16, DType::kFloat16}, plan.num_tokens,
                         hidden, dev));
  detail::expect(dy, "dy", rows_of({config.out}, plan.capacity_rows, hidden, dev));
  check_scales(plan, config, dy_scales, "dy_scales", dy, dy_t, "dy_t", hidden);
  if (probs.defined())
    detail::expect(probs, "probs", Expect{{DType::kFloat32}, {plan.num_tokens, plan.topk}, dev});
  const bool tensor = config.scaling == QuantScaling::kTensorwise;
  if (dev.is_cpu()) {
    if (tensor)
      return cpu::permute_quantize_tensorwise(dout, plan, probs, dy, dy_scales, dy_t, config, {},
                                              {});
    return cpu::unpermute_backward_quantize(dout, plan, probs, dy, dy_scales, config);
  }
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  if (tensor)
    return cuda::permute_quantize_tensorwise(dout, plan, probs, dy, dy_scales, dy_t, config, {}, {},
                                             stream);
  cuda::unpermute_backward_quantize(dout, plan, probs, dy, dy_scales, config, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      const QuantizeConfig& config, const PermuteExtras& extras,
                      cudaStream_t stream) {
  permute_quantize(x, plan, y, y_scales, TensorView{}, config, extras, stream);
}

void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      TensorView y_t, const QuantizeConfig& config, const PermuteExtras& extras,
                      cudaStream_t stream) {
  MOEFLOW_CHECK(plan.tokens_per_expert.defined(), "plan was not allocated (use allocate_plan)");
  if (config.columnwise)
    return permute_quantize_columnwise(x, plan, y, y_scales, y_t, config, extras, stream);
  check_rowwise_fp8(config, "permute_quantize", y_t.defined());
  const Device dev = plan.device;
  detail::expect_defined(x, "x");
  MOEFLOW_CHECK(x.ndim == 2, "x must be [T,H], got ", x.str());
  const int64_t hidden = x.shape[1];
  detail::expect(x, "x",
                 rows_of({DType::kFloat32, DType::kBFloat16, DType::kFloat16}, plan.num_tokens,
                         hidden, dev));
  detail::expect(y, "y", rows_of({config.out}, plan.capacity_rows, hidden, dev));
  check_scales(plan, config, y_scales, "y_scales", y, y_t, "y_t", hidden);
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
  const bool tensor = config.scaling == QuantScaling::kTensorwise;
  if (dev.is_cpu()) {
    if (tensor)
      return cpu::permute_quantize_tensorwise(x, plan, {}, y, y_scales, y_t, config, extras.probs,
                                              extras.permuted_probs);
    return cpu::permute_quantize(x, plan, y, y_scales, config, extras);
  }
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  if (tensor)
    return cuda::permute_quantize_tensorwise(x, plan, {}, y, y_scales, y_t, config, extras.probs,
                                             extras.permuted_probs, stream);
  cuda::permute_quantize(x, plan, y, y_scales, config, extras, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

}  // namespace moeflow
