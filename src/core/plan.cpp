// Public RoutingPlan entry points: capacity arithmetic, allocation, argument
// checks, and dispatch to the CPU or CUDA backend by the device of the input.
#include <algorithm>

#include "core/backends.h"
#include "core/internal.h"
#include "moeflow/plan.h"

namespace moeflow {

using detail::Expect;

bool is_valid_align(int align) {
  return align == 1 || align == 16 || align == 32 || align == 64 || align == 128 || align == 256;
}

static void check_config(const PlanConfig& config) {
  MOEFLOW_CHECK(config.num_experts > 0, "PlanConfig.num_experts must be > 0, got ",
                config.num_experts);
  MOEFLOW_CHECK(is_valid_align(config.align),
                "PlanConfig.align must be one of 1, 16, 32, 64, 128, 256, got ", config.align);
  MOEFLOW_CHECK(config.capacity_rows == -1 || config.capacity_rows >= 0,
                "PlanConfig.capacity_rows must be -1 (worst case) or >= 0, got ",
                config.capacity_rows);
  MOEFLOW_CHECK(config.capacity_rows <= 0 || config.capacity_rows % config.align == 0,
                "PlanConfig.capacity_rows must be a multiple of align=", config.align, ", got ",
                config.capacity_rows);
}

int64_t plan_capacity_rows(int64_t num_tokens, int topk, const PlanConfig& config) {
  check_config(config);
  MOEFLOW_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
  MOEFLOW_CHECK(topk >= 0, "topk must be >= 0, got ", topk);
  if (config.capacity_rows >= 0) return config.capacity_rows;
  int64_t a = config.align;
  int64_t worst = num_tokens * topk + static_cast<int64_t>(config.num_experts) * (a - 1);
  return (worst + a - 1) / a * a;
}

RoutingPlan allocate_plan(int64_t num_tokens, int topk, const PlanConfig& config, Device device) {
  RoutingPlan p;
  p.capacity_rows = plan_capacity_rows(num_tokens, topk, config);
  p.config = config;
  p.config.capacity_rows = p.capacity_rows;
  p.num_tokens = num_tokens;
  p.topk = topk;
  p.device = device;
  int64_t e = config.num_experts;
  p.tokens_per_expert = Tensor::empty({e}, DType::kInt32, device);
  p.padded_tokens_per_expert = Tensor::empty({e}, DType::kInt32, device);
  p.expert_row_offsets = Tensor::empty({e + 1}, DType::kInt64, device);
  p.dest_row = Tensor::empty({num_tokens, topk}, DType::kInt64, device);
  p.row_token = Tensor::empty({p.capacity_rows}, DType::kInt32, device);
  p.row_k = Tensor::empty({p.capacity_rows}, DType::kInt32, device);
  p.total_rows = Tensor::zeros({1}, DType::kInt64, device);
  p.overflow = Tensor::zeros({1}, DType::kInt32, device);
  p.invalid_ids = Tensor::zeros({1}, DType::kInt32, device);
  return p;
}

size_t plan_workspace_bytes(int64_t num_tokens, int topk, const PlanConfig& config) {
  check_config(config);
#ifdef MOEFLOW_WITH_CUDA
  return cuda::plan_workspace_bytes(num_tokens, topk, config);
#else
  (void)num_tokens;
  (void)topk;
  return 0;
#endif
}

static void check_plan_shape(const RoutingPlan& plan, int64_t num_tokens, int topk,
                             Device device, const char* input_name) {
  MOEFLOW_CHECK(plan.tokens_per_expert.defined(), "plan was not allocated (use allocate_plan)");
  MOEFLOW_CHECK(plan.num_tokens == num_tokens && plan.topk == topk, "plan was allocated for [T,K]=[",
                plan.num_tokens, ",", plan.topk, "] but ", input_name, " is [", num_tokens, ",",
                topk, "]");
  MOEFLOW_CHECK(plan.device == device, "plan is on ", plan.device.str(), " but ", input_name,
                " is on ", device.str());
}

static void run_build(const RoutingInput& in, RoutingPlan& plan, TensorView workspace,
                      cudaStream_t stream) {
  if (plan.device.is_cpu()) {
    cpu::build_plan(in, plan);
    return;
  }
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(plan.device);
  size_t need = cuda::plan_workspace_bytes(in.num_tokens, in.topk, plan.config);
  if (need > 0) {
    detail::expect(workspace, "workspace", Expect{{DType::kUInt8}, {-1}, plan.device});
    MOEFLOW_CHECK(workspace.nbytes() >= need, "workspace must hold >= ", need,
                  " bytes (plan_workspace_bytes), got ", workspace.nbytes());
  }
  cuda::build_plan(in, plan, workspace, stream);
#else
  (void)workspace;
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

void build_plan(TensorView topk_ids, RoutingPlan& plan, TensorView workspace,
                cudaStream_t stream) {
  detail::expect_defined(topk_ids, "topk_ids");
  MOEFLOW_CHECK(topk_ids.ndim == 2, "topk_ids must be int32 or int64 [T,K], got ", topk_ids.str());
  check_plan_shape(plan, topk_ids.shape[0], static_cast<int>(topk_ids.shape[1]), topk_ids.device,
                   "topk_ids");
  detail::expect(topk_ids, "topk_ids",
                 Expect{{DType::kInt32, DType::kInt64}, {plan.num_tokens, plan.topk}, plan.device});
  RoutingInput in;
  in.kind = topk_ids.dtype == DType::kInt32 ? RoutingInput::kIds32 : RoutingInput::kIds64;
  in.data = topk_ids.data;
  in.num_tokens = plan.num_tokens;
  in.topk = plan.topk;
  run_build(in, plan, workspace, stream);
}

void build_plan_from_mask(TensorView routing_mask, RoutingPlan& plan, TensorView workspace,
                          cudaStream_t stream) {
  detail::expect_defined(routing_mask, "routing_mask");
  MOEFLOW_CHECK(routing_mask.ndim == 2, "routing_mask must be bool or uint8 [T,E], got ",
                routing_mask.str());
  MOEFLOW_CHECK(routing_mask.shape[1] == plan.config.num_experts, "routing_mask must be [T,E] with E=",
                plan.config.num_experts, ", got ", routing_mask.str());
  check_plan_shape(plan, routing_mask.shape[0], static_cast<int>(routing_mask.shape[1]),
                   routing_mask.device, "routing_mask");
  detail::expect(routing_mask, "routing_mask",
                 Expect{{DType::kBool, DType::kUInt8}, {plan.num_tokens, plan.topk}, plan.device});
  RoutingInput in;
  in.kind = RoutingInput::kMask;
  in.data = routing_mask.data;
  in.num_tokens = plan.num_tokens;
  in.topk = plan.topk;
  run_build(in, plan, workspace, stream);
}

PlanStatus plan_status(const RoutingPlan& plan, cudaStream_t stream) {
  PlanStatus s;
  Tensor total = Tensor::empty({1}, DType::kInt64);
  Tensor ovf = Tensor::empty({1}, DType::kInt32);
  Tensor inv = Tensor::empty({1}, DType::kInt32);
  copy(plan.total_rows, total, stream);
  copy(plan.overflow, ovf, stream);
  copy(plan.invalid_ids, inv, stream);
  s.total_rows = *total.data_ptr<int64_t>();
  s.overflow = *ovf.data_ptr<int32_t>();
  s.invalid_ids = *inv.data_ptr<int32_t>();
  return s;
}

PlanStatus check_plan(const RoutingPlan& plan, cudaStream_t stream) {
  PlanStatus s = plan_status(plan, stream);
  MOEFLOW_CHECK(s.invalid_ids == 0, "routing had ", s.invalid_ids,
                " expert ids outside [-1, ", plan.config.num_experts,
                ") (treated as unrouted)");
  return s;
}

}  // namespace moeflow
