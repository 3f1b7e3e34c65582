// CPU reference for build_plan: the oracle for the CUDA backend.
//
// Algorithm (plain and sequential):
//   1. count the slots routed to each expert (ids checked here);
//   2. lay the experts out in id order, each segment padded to `align`,
//      clipped by the capacity (layout_expert, shared with CUDA);
//   3. walk the slots in (t,k) order again and hand each the next row of its
//      expert; slots past the kept count are dropped (dest_row -1);
//   4. mark the pad rows of every segment (row_token = row_k = -1).
#include <vector>

#include "core/backends.h"
#include "core/internal.h"

namespace moeflow::cpu {

// Expert of slot i (-1: unrouted); `checked` reports ids outside [-1, E).
static int slot_expert(const RoutingInput& in, int64_t i, int num_experts) {
  int64_t e = -1;
  switch (in.kind) {
    case RoutingInput::kIds32: e = static_cast<const int32_t*>(in.data)[i]; break;
    case RoutingInput::kIds64: e = static_cast<const int64_t*>(in.data)[i]; break;
    case RoutingInput::kMask:
      e = static_cast<const uint8_t*>(in.data)[i] ? i % in.topk : -1;
      break;
  }
  MOEFLOW_CHECK(e >= -1 && e < num_experts, "topk_ids[", i / in.topk, ",", i % in.topk, "] = ",
                e, " is outside [-1, ", num_experts, ") (E=", num_experts, ")");
  return static_cast<int>(e);
}

void build_plan(const RoutingInput& in, RoutingPlan& plan) {
  const int num_experts = plan.config.num_experts;
  const int align = plan.config.align;
  const int64_t num_slots = in.num_tokens * in.topk;

  // Step 1: routed slots per expert.
  std::vector<int64_t> routed(num_experts, 0);
  for (int64_t i = 0; i < num_slots; ++i) {
    int e = slot_expert(in, i, num_experts);
    if (e >= 0) ++routed[e];
  }

  // Step 2: segments in expert order.
  auto* kept = plan.tokens_per_expert.data_ptr<int32_t>();
  auto* padded = plan.padded_tokens_per_expert.data_ptr<int32_t>();
  auto* offsets = plan.expert_row_offsets.data_ptr<int64_t>();
  int64_t routed_prefix = 0, dropped = 0;
  for (int e = 0; e < num_experts; ++e) {
    ExpertLayout l = layout_expert(routed[e], routed_prefix, plan.capacity_rows, align);
    kept[e] = l.kept;
    padded[e] = l.padded;
    offsets[e] = l.offset;
    dropped += routed[e] - l.kept;
    routed_prefix += (routed[e] + align - 1) / align * align;
  }
  offsets[num_experts] = num_experts > 0 ? offsets[num_experts - 1] + padded[num_experts - 1] : 0;

  // Step 3: rows in slot order within each expert.
  auto* dest = plan.dest_row.data_ptr<int64_t>();
  auto* row_token = plan.row_token.data_ptr<int32_t>();
  auto* row_k = plan.row_k.data_ptr<int32_t>();
  std::vector<int64_t> next(num_experts, 0);
  for (int64_t i = 0; i < num_slots; ++i) {
    int e = slot_expert(in, i, num_experts);
    dest[i] = -1;
    if (e < 0) continue;
    int64_t rank = next[e]++;
    if (rank >= kept[e]) continue;  // dropped: over capacity
    int64_t row = offsets[e] + rank;
    dest[i] = row;
    row_token[row] = static_cast<int32_t>(i / in.topk);
    row_k[row] = static_cast<int32_t>(i % in.topk);
  }

  // Step 4: pad rows.
  for (int e = 0; e < num_experts; ++e) {
    for (int64_t row = offsets[e] + kept[e]; row < offsets[e] + padded[e]; ++row) {
      row_token[row] = -1;
      row_k[row] = -1;
    }
  }
  *plan.total_rows.data_ptr<int64_t>() = offsets[num_experts];
  *plan.overflow.data_ptr<int32_t>() = static_cast<int32_t>(dropped);
  *plan.invalid_ids.data_ptr<int32_t>() = 0;
}

}  // namespace moeflow::cpu
