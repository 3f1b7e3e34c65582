// RoutingPlan: where every (token, k) routing slot goes in the expert-major,
// per-expert padded layout that permute, the grouped GEMM and unpermute share.
// Built on the device of the routing input with no host synchronisation;
// every buffer is sized from shapes, so building it is CUDA-graph safe.
#pragma once

#include <cstdint>

#include "moeflow/tensor.h"

namespace moeflow {

// Alignments accepted for PlanConfig::align.
bool is_valid_align(int align);  // 1, 16, 32, 64, 128, 256

struct PlanConfig {
  int num_experts = 0;  // E (the CUDA backend takes E <= 2048)
  // Each expert's segment is padded to a multiple of `align` rows:
  // 16 for FP8, 32 for MXFP8, 128 for NVFP4, 256 for the fused grouped-GEMM path.
  int align = 1;
  // Rows of the permuted buffer. -1: the worst case
  // T*K + E*(align-1), rounded up to align (nothing can ever be dropped).
  // A caller-given capacity must be a multiple of align. When it is too small,
  // experts are laid out in id order and the slots that do not fit are
  // dropped: the tail (highest token ids) of the expert that fits partially
  // and every later expert. Dropped slots get dest_row -1 and are counted in
  // RoutingPlan::overflow.
  int64_t capacity_rows = -1;
};

// Rows of the permuted buffer for this routing shape (host-computable).
int64_t plan_capacity_rows(int64_t num_tokens, int topk, const PlanConfig& config);

// All tensors live on `device` and are allocated once by allocate_plan();
// build_plan() only writes them. "Slot" = (token t, k); slots are ordered
// t-major, and within an expert the rows are in ascending slot order.
struct RoutingPlan {
  PlanConfig config;           // config.capacity_rows resolved (never -1)
  int64_t num_tokens = 0;      // T
  int topk = 0;                // K (for a plan built from a [T,E] mask: K = E)
  int64_t capacity_rows = 0;   // rows of the permuted buffer
  Device device{};

  Tensor tokens_per_expert;         // [E]   int32  rows kept for each expert
  Tensor padded_tokens_per_expert;  // [E]   int32  tokens_per_expert rounded up to align
  Tensor expert_row_offsets;        // [E+1] int64  start of each expert's padded segment;
                                    //              [E] = total_rows
  Tensor dest_row;                  // [T,K] int64  row of slot (t,k); -1 unrouted/dropped
  Tensor row_token;                 // [capacity] int32  source token of each row; -1 pad row
  Tensor row_k;                     // [capacity] int32  source k of each row; -1 pad row
                                    // (row_token/row_k are written for rows < total_rows only)
  Tensor total_rows;                // [1]   int64  rows used (sum of padded counts)
  Tensor overflow;                  // [1]   int32  number of dropped slots (0: none)
  Tensor invalid_ids;               // [1]   int32  routing entries out of range (CUDA
                                    //              backend; treated as unrouted)

  int num_experts() const { return config.num_experts; }
  int align() const { return config.align; }
};

// Allocates the plan's tensors (not on the hot path: do it once and reuse).
RoutingPlan allocate_plan(int64_t num_tokens, int topk, const PlanConfig& config, Device device);

// Scratch bytes build_plan / build_plan_from_mask need (0 on the CPU).
size_t plan_workspace_bytes(int64_t num_tokens, int topk, const PlanConfig& config);

// Builds the plan from top-k expert ids.
//   topk_ids:  [T,K] int32 or int64, contiguous; -1 = no expert for that slot.
//              Ids outside [-1, E) are an error: the CPU backend throws; the
//              CUDA backend (which cannot throw without a host sync) treats them
//              as -1 and counts them in plan.invalid_ids (see check_plan()).
//   plan:      from allocate_plan(T, K, config, device of topk_ids).
//   workspace: uint8 [>= plan_workspace_bytes(T, K, config)] on the same device.
void build_plan(TensorView topk_ids, RoutingPlan& plan, TensorView workspace = {},
                cudaStream_t stream = nullptr);

// Builds the plan from a routing mask (the Megatron form).
//   routing_mask: [T,E] bool or uint8 (nonzero = routed), contiguous.
//   plan:         from allocate_plan(T, E, config, device): slot (t,k) is expert k,
//                 so the [T,E] probs of this form are the plan's [T,K] probs.
void build_plan_from_mask(TensorView routing_mask, RoutingPlan& plan, TensorView workspace = {},
                          cudaStream_t stream = nullptr);

// Host-side summary of a built plan (synchronises: for checks and tests, not
// the hot path).
struct PlanStatus {
  int64_t total_rows = 0;
  int32_t overflow = 0;
  int32_t invalid_ids = 0;
};
PlanStatus plan_status(const RoutingPlan& plan, cudaStream_t stream = nullptr);
// plan_status() and throw moeflow::Error if invalid ids were seen.
PlanStatus check_plan(const RoutingPlan& plan, cudaStream_t stream = nullptr);

}  // namespace moeflow
