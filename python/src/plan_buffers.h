// The RoutingPlan over moeflow.Plan's two flat buffers, shared by the
// extensions (moeflow._C and the torch autograd nodes of moeflow._autograd).
// Plain C++: no binding library.
//
//   buffer64 int64 [E+1 + T*K + 1]      expert_row_offsets, dest_row, total_rows
//   buffer32 int32 [2E + 2*capacity + 2] tokens_per_expert, padded_tokens_per_expert,
//                                        row_token, row_k, overflow, invalid_ids
//
// The plan's tensors view the buffers without owning them: the caller keeps
// the buffers alive as long as the plan.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moeflow/error.h"
#include "moeflow/plan.h"
#include "moeflow/tensor.h"

namespace moeflow::python {

inline PlanConfig plan_config(int E, int align, int64_t capacity) {
  PlanConfig c;
  c.num_experts = E;
  c.align = align;
  c.capacity_rows = capacity;
  return c;
}

// The parts of the two buffers, in the order above, for a plan of these
// sizes (capacity resolved): the one statement of the layout (moeflow.Plan
// reads it through moeflow._C.plan_buffer_layout).
inline std::vector<int64_t> plan_buffer64_parts(int64_t T, int K, int E) {
  return {E + 1, T * K, 1};  // expert_row_offsets, dest_row, total_rows
}
inline std::vector<int64_t> plan_buffer32_parts(int E, int64_t capacity_rows) {
  // tokens_per_expert, padded_tokens_per_expert, row_token, row_k, overflow, invalid_ids
  return {E, E, capacity_rows, capacity_rows, 1, 1};
}
inline int64_t sum_of(const std::vector<int64_t>& parts) {
  int64_t n = 0;
  for (int64_t p : parts) n += p;
  return n;
}
inline int64_t plan_buffer64_size(int64_t T, int K, int E) {
  return sum_of(plan_buffer64_parts(T, K, E));
}
inline int64_t plan_buffer32_size(int E, int64_t capacity_rows) {
  return sum_of(plan_buffer32_parts(E, capacity_rows));
}

// A Tensor over v that frees nothing (`owner` holds no memory), checked
// against the shape and dtype the plan needs.
inline Tensor adopt_plan_view(const TensorView& v, const std::vector<int64_t>& shape, DType dtype,
                              const char* name, const std::shared_ptr<void>& owner) {
  MOEFLOW_CHECK(v.dtype == dtype, "plan.", name, ": expected dtype ", dtype_name(dtype), ", got ",
                dtype_name(v.dtype));
  MOEFLOW_CHECK(v.sizes() == shape, "plan.", name, ": expected shape ",
                TensorView(nullptr, dtype, v.device, shape).shape_str(), ", got ", v.shape_str());
  return Tensor::adopt(v, owner);
}

// The plan of T tokens, top-k K, E experts over the two buffers (checked:
// dtypes, lengths, one device). capacity_rows: the library's
// plan_capacity_rows, or the same taken from moeflow._C (api_table.h).
inline RoutingPlan plan_over_buffers(
    int64_t T, int K, int E, int align, int64_t capacity, const TensorView& b64,
    const TensorView& b32,
    int64_t (*capacity_rows)(int64_t, int, const PlanConfig&) = &plan_capacity_rows) {
  const PlanConfig c = plan_config(E, align, capacity);
  const int64_t cap = capacity_rows(T, K, c);
  const int64_t n64 = plan_buffer64_size(T, K, E), n32 = plan_buffer32_size(E, cap);
  MOEFLOW_CHECK(b64.dtype == DType::kInt64 && b64.ndim == 1 && b64.shape[0] == n64,
                "buffer64 must be int64 [", n64, "], got ", b64.str());
  MOEFLOW_CHECK(b32.dtype == DType::kInt32 && b32.ndim == 1 && b32.shape[0] == n32,
                "buffer32 must be int32 [", n32, "] on ", b64.device.str(), ", got ", b32.str());
  MOEFLOW_CHECK(b32.device == b64.device, "buffer32 must be on ", b64.device.str(), ", got ",
                b32.str());
  RoutingPlan r;
  r.capacity_rows = cap;
  r.config = c;
  r.config.capacity_rows = cap;
  r.num_tokens = T;
  r.topk = K;
  r.device = b64.device;
  // One owner for the nine views: it holds nothing (the buffers' owner does).
  const std::shared_ptr<void> owner(b64.data, [](void*) {});
  // Part i of a buffer starts after parts 0..i-1 (plan_buffer*_parts).
  const std::vector<int64_t> p64 = plan_buffer64_parts(T, K, E), p32 = plan_buffer32_parts(E, cap);
  size_t i64 = 0, i32 = 0;
  int64_t o64 = 0, o32 = 0;
  auto part = [&](const TensorView& b, const std::vector<int64_t>& parts, size_t& i, int64_t& off,
                  std::vector<int64_t> shape, DType dt, const char* name) {
    const TensorView v(static_cast<char*>(b.data) + off * static_cast<int64_t>(dtype_size(dt)), dt,
                       b.device, shape);
    off += parts[i++];
    return adopt_plan_view(v, shape, dt, name, owner);
  };
  auto part64 = [&](std::vector<int64_t> shape, const char* name) {
    return part(b64, p64, i64, o64, std::move(shape), DType::kInt64, name);
  };
  auto part32 = [&](std::vector<int64_t> shape, const char* name) {
    return part(b32, p32, i32, o32, std::move(shape), DType::kInt32, name);
  };
  r.expert_row_offsets = part64({E + 1}, "expert_row_offsets");
  r.dest_row = part64({T, K}, "dest_row");
  r.total_rows = part64({1}, "total_rows");
  r.tokens_per_expert = part32({E}, "tokens_per_expert");
  r.padded_tokens_per_expert = part32({E}, "padded_tokens_per_expert");
  r.row_token = part32({cap}, "row_token");
  r.row_k = part32({cap}, "row_k");
  r.overflow = part32({1}, "overflow");
  r.invalid_ids = part32({1}, "invalid_ids");
  return r;
}

}  // namespace moeflow::python
