// Public permute/unpermute entry points: argument checks against the plan,
// then dispatch to the CPU or CUDA backend by the device of the plan.
#include "core/backends.h"
#include "core/internal.h"
#include "moeflow/permute.h"

namespace moeflow {

using detail::Expect;

static const std::vector<DType> kArithFloats = {DType::kFloat32, DType::kBFloat16,
                                                DType::kFloat16};
static const std::vector<DType> kMovable = {DType::kFloat32,    DType::kBFloat16,
                                            DType::kFloat16,    DType::kFloat8E4M3,
                                            DType::kFloat8E5M2};

static void check_built(const RoutingPlan& plan) {
  MOEFLOW_CHECK(plan.tokens_per_expert.defined(), "plan was not allocated (use allocate_plan)");
}

// A row-major [rows, H] activation: last dim unit stride, rows may be strided.
static Expect rows_of(const std::vector<DType>& dtypes, int64_t rows, int64_t hidden,
                      Device device) {
  Expect e{dtypes, {rows, hidden}, device};
  e.contiguous = false;
  e.inner_unit = true;
  return e;
}

void permute(TensorView x, const RoutingPlan& plan, TensorView y, const PermuteExtras& extras,
             cudaStream_t stream) {
  check_built(plan);
  const Device dev = plan.device;
  detail::expect_defined(x, "x");
  MOEFLOW_CHECK(x.ndim == 2, "x must be [T,H], got ", x.str());
  const int64_t hidden = x.shape[1];
  detail::expect(x, "x", rows_of(kMovable, plan.num_tokens, hidden, dev));
  detail::expect(y, "y", rows_of({x.dtype}, plan.capacity_rows, hidden, dev));
  MOEFLOW_CHECK(extras.probs.defined() == extras.permuted_probs.defined(),
                "PermuteExtras.probs and permuted_probs must be given together");
  if (extras.probs.defined()) {
    detail::expect(extras.probs, "probs", Expect{{DType::kFloat32}, {plan.num_tokens, plan.topk}, dev});
    detail::expect(extras.permuted_probs, "permuted_probs",
                   Expect{{DType::kFloat32}, {plan.capacity_rows}, dev});
  }
  MOEFLOW_CHECK(extras.scales.defined() == extras.permuted_scales.defined(),
                "PermuteExtras.scales and permuted_scales must be given together");
  if (extras.scales.defined()) {
    MOEFLOW_CHECK(extras.scales.ndim == 2, "scales must be [T,S], got ", extras.scales.str());
    detail::expect(extras.scales, "scales", Expect{{}, {plan.num_tokens, -1}, dev});
    detail::expect(extras.permuted_scales, "permuted_scales",
                   Expect{{extras.scales.dtype}, {plan.capacity_rows, extras.scales.shape[1]}, dev});
  }
  if (dev.is_cpu()) return cpu::permute(x, plan, y, extras);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(plan.device);
  cuda::permute(x, plan, y, extras, stream);
#else
  (void)stream;
#endif
}

// Shared by unpermute and permute_backward (same gather-and-sum).
static void run_unpermute(TensorView y, const RoutingPlan& plan, TensorView out,
                          TensorView weights, TensorView row_vals, TensorView slot_vals,
                          const char* y_name, const char* out_name, const char* w_name,
                          cudaStream_t stream) {
  check_built(plan);
  const Device dev = plan.device;
  detail::expect_defined(y, y_name);
  MOEFLOW_CHECK(y.ndim == 2, y_name, " must be [capacity,H], got ", y.str());
  const int64_t hidden = y.shape[1];
  detail::expect(y, y_name, rows_of(kArithFloats, plan.capacity_rows, hidden, dev));
  detail::expect(out, out_name, rows_of(kArithFloats, plan.num_tokens, hidden, dev));
  if (weights.defined())
    detail::expect(weights, w_name, Expect{{DType::kFloat32}, {plan.num_tokens, plan.topk}, dev});
  if (row_vals.defined()) {
    detail::expect(row_vals, "dpermuted_probs", Expect{{DType::kFloat32}, {plan.capacity_rows}, dev});
    detail::expect(slot_vals, "dprobs", Expect{{DType::kFloat32}, {plan.num_tokens, plan.topk}, dev});
  } else {
    MOEFLOW_CHECK(!slot_vals.defined(), "dprobs needs dpermuted_probs");
  }
  if (dev.is_cpu()) return cpu::unpermute(y, plan, out, weights, row_vals, slot_vals);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(plan.device);
  cuda::unpermute(y, plan, out, weights, row_vals, slot_vals, stream);
#else
  (void)stream;
#endif
}

void unpermute(TensorView y, const RoutingPlan& plan, TensorView out, TensorView merge_probs,
               cudaStream_t stream) {
  run_unpermute(y, plan, out, merge_probs, {}, {}, "y", "out", "merge_probs", stream);
}

void permute_backward(TensorView dy, const RoutingPlan& plan, TensorView dx,
                      TensorView dpermuted_probs, TensorView dprobs, cudaStream_t stream) {
  MOEFLOW_CHECK(dpermuted_probs.defined() == dprobs.defined(),
                "dpermuted_probs and dprobs must be given together");
  run_unpermute(dy, plan, dx, {}, dpermuted_probs, dprobs, "dy", "dx", "", stream);
}

void unpermute_backward(TensorView dout, const RoutingPlan& plan, TensorView y_fwd,
                        TensorView probs, TensorView dy, TensorView dprobs, cudaStream_t stream) {
  check_built(plan);
  const Device dev = plan.device;
  detail::expect_defined(dout, "dout");
  MOEFLOW_CHECK(dout.ndim == 2, "dout must be [T,H], got ", dout.str());
  const int64_t hidden = dout.shape[1];
  detail::expect(dout, "dout", rows_of(kArithFloats, plan.num_tokens, hidden, dev));
  if (y_fwd.defined()) {
    detail::expect(y_fwd, "y_fwd", rows_of(kArithFloats, plan.capacity_rows, hidden, dev));
    detail::expect(dy, "dy", rows_of({y_fwd.dtype}, plan.capacity_rows, hidden, dev));
  } else {
    detail::expect(dy, "dy", rows_of(kArithFloats, plan.capacity_rows, hidden, dev));
  }
  if (probs.defined())
    detail::expect(probs, "probs", Expect{{DType::kFloat32}, {plan.num_tokens, plan.topk}, dev});
  if (dprobs.defined()) {
    MOEFLOW_CHECK(y_fwd.defined(), "dprobs needs y_fwd (the forward input of unpermute)");
    detail::expect(dprobs, "dprobs", Expect{{DType::kFloat32}, {plan.num_tokens, plan.topk}, dev});
  }
  if (dev.is_cpu()) return cpu::unpermute_backward(dout, plan, y_fwd, probs, dy, dprobs);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(plan.device);
  cuda::unpermute_backward(dout, plan, y_fwd, probs, dy, dprobs, stream);
#else
  (void)stream;
#endif
}

}  // namespace moeflow
