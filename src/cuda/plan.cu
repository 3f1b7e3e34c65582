// CUDA build_plan: three small kernels, no host synchronisation.
//
// The T*K routing slots (t-major) are cut into chunks of `chunk_slots`.
//   1. plan_count_kernel:  one block per chunk counts the slots of each expert
//      (shared-memory atomics; counts do not depend on order) and writes
//      counts[e][chunk] to the workspace.
//   2. plan_layout_kernel: one block. A warp per expert turns counts[e][*]
//      into exclusive prefixes (the rank of the chunk's first slot within the
//      expert); then a block scan over experts lays the padded segments out
//      (layout_expert, shared with the CPU reference: same drop order).
//   3. plan_assign_kernel: one block per chunk again. Each warp owns a
//      contiguous run of the chunk's slots; a first pass counts its slots per
//      expert, a prefix across the warps gives each warp its starting rank,
//      and a second pass hands out ranks in slot order with __match_any_sync
//      (peers with the same expert in one 32-slot step). Rank -> row, or -1
//      when past the expert's kept count (dropped). Pad rows get -1 maps.
// Ranks follow slot order exactly, so the plan equals the CPU reference bit
// for bit and does not depend on scheduling.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "core/backends.h"
#include "cuda/common.cuh"

namespace moeflow::cuda {
namespace {

constexpr int kPlanWarps = 8;
constexpr int kPlanThreads = kPlanWarps * kWarpSize;
constexpr int kLayoutThreads = 1024;
constexpr int kLayoutItems = 4;  // experts per thread in the layout scan
constexpr int kMaxExperts = kLayoutThreads * kLayoutItems;
constexpr int64_t kTargetChunks = 256;
constexpr int64_t kMinChunkSlots = 1024;

struct Chunking {
  int64_t chunk_slots = kMinChunkSlots;
  int64_t num_chunks = 0;
};

Chunking plan_chunking(int64_t num_slots) {
  Chunking c;
  int64_t per = ceil_div(num_slots, kTargetChunks);
  per = ceil_div(per, kPlanThreads) * kPlanThreads;
  c.chunk_slots = per > kMinChunkSlots ? per : kMinChunkSlots;
  c.num_chunks = ceil_div(num_slots, c.chunk_slots);
  return c;
}

// Expert of slot i, or -1 (unrouted); ids outside [-1, E) set *bad and read as -1.
template <RoutingInput::Kind KIND>
__device__ __forceinline__ int read_slot(const void* data, int64_t i, int topk, int num_experts,
                                         bool* bad) {
  int64_t e;
  if constexpr (KIND == RoutingInput::kIds32) {
    e = static_cast<const int32_t*>(data)[i];
  } else if constexpr (KIND == RoutingInput::kIds64) {
    e = static_cast<const int64_t*>(data)[i];
  } else {
    e = static_cast<const uint8_t*>(data)[i] ? i % topk : -1;
  }
  if (e < -1 || e >= num_experts) {
    *bad = true;
    return -1;
  }
  return static_cast<int>(e);
}

template <RoutingInput::Kind KIND>
__global__ void __launch_bounds__(kPlanThreads)
    plan_count_kernel(const void* ids, int64_t num_slots, int topk, int num_experts,
                      int64_t chunk_slots, int64_t num_chunks, int32_t* counts) {
  extern __shared__ int32_t cnt[];  // [E]
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const int64_t begin = blockIdx.x * chunk_slots;
  const int64_t end = min(begin + chunk_slots, num_slots);
  bool bad = false;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    int e = read_slot<KIND>(ids, i, topk, num_experts, &bad);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    counts[e * num_chunks + blockIdx.x] = cnt[e];
}

__global__ void __launch_bounds__(kLayoutThreads)
    plan_layout_kernel(int32_t* counts, int64_t num_chunks, int num_experts, int align,
                       int64_t capacity, int32_t* kept_out, int32_t* padded_out,
                       int64_t* offsets_out, int64_t* total_rows, int32_t* overflow,
                       int32_t* invalid_ids) {
  __shared__ int64_t routed[kMaxExperts];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;

  // Step 1: per expert, exclusive prefix of the chunk counts (in place).
  for (int e = warp; e < num_experts; e += num_warps) {
    int32_t* row = counts + e * num_chunks;
    int64_t running = 0;
    for (int64_t c0 = 0; c0 < num_chunks; c0 += kWarpSize) {
      const int64_t c = c0 + lane;
      const int32_t v = c < num_chunks ? row[c] : 0;
      int32_t incl = v;
#pragma unroll
      for (int d = 1; d < kWarpSize; d *= 2) {
        int32_t n = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += n;
      }
      if (c < num_chunks) row[c] = static_cast<int32_t>(running + incl - v);
      running += __shfl_sync(0xffffffffu, incl, kWarpSize - 1);
    }
    if (lane == 0) routed[e] = running;
  }
  __syncthreads();

  // Step 2: segments in expert order (exclusive scan of padded routed counts).
  using Scan = cub::BlockScan<int64_t, kLayoutThreads>;
  using Reduce = cub::BlockReduce<int64_t, kLayoutThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  int64_t padded_routed[kLayoutItems];
#pragma unroll
  for (int j = 0; j < kLayoutItems; ++j) {
    const int e = threadIdx.x * kLayoutItems + j;
    padded_routed[j] = e < num_experts ? (routed[e] + align - 1) / align * align : 0;
  }
  int64_t prefix[kLayoutItems];
  int64_t sum_padded = 0;
  Scan(tmp.scan).ExclusiveSum(padded_routed, prefix, sum_padded);
  int64_t dropped = 0;
#pragma unroll
  for (int j = 0; j < kLayoutItems; ++j) {
    const int e = threadIdx.x * kLayoutItems + j;
    if (e < num_experts) {
      ExpertLayout l = layout_expert(routed[e], prefix[j], capacity, align);
      kept_out[e] = l.kept;
      padded_out[e] = l.padded;
      offsets_out[e] = l.offset;
      dropped += routed[e] - l.kept;
    }
  }
  __syncthreads();
  const int64_t total_dropped = Reduce(tmp.reduce).Sum(dropped);
  if (threadIdx.x == 0) {
    const int64_t total = sum_padded < capacity ? sum_padded : capacity;
    offsets_out[num_experts] = total;
    *total_rows = total;
    *overflow = static_cast<int32_t>(total_dropped);
    *invalid_ids = 0;
  }
}

template <RoutingInput::Kind KIND>
__global__ void __launch_bounds__(kPlanThreads)
    plan_assign_kernel(const void* ids, int64_t num_slots, int topk, int num_experts,
                       int64_t chunk_slots, int64_t num_chunks, const int32_t* chunk_base,
                       const int32_t* kept, const int32_t* padded, const int64_t* offsets,
                       int64_t* dest_row, int32_t* row_token, int32_t* row_k,
                       int32_t* invalid_ids) {
  extern __shared__ int32_t warp_rank[];  // [kPlanWarps][E]
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  int32_t* my_rank = warp_rank + warp * num_experts;
  for (int i = threadIdx.x; i < kPlanWarps * num_experts; i += blockDim.x) warp_rank[i] = 0;
  __syncthreads();

  const int64_t warp_span = chunk_slots / kPlanWarps;  // a multiple of 32
  const int64_t begin = blockIdx.x * chunk_slots + warp * warp_span;
  const int64_t end = min(begin + warp_span, num_slots);
  bool bad = false;

  // Step 1: this warp's slots per expert.
  for (int64_t i = begin + lane; i < end; i += kWarpSize) {
    int e = read_slot<KIND>(ids, i, topk, num_experts, &bad);
    if (e >= 0) atomicAdd(&my_rank[e], 1);
  }
  __syncthreads();

  // Step 2: starting rank of each warp = chunk base + counts of earlier warps.
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t running = chunk_base[e * num_chunks + blockIdx.x];
    for (int w = 0; w < kPlanWarps; ++w) {
      const int32_t c = warp_rank[w * num_experts + e];
      warp_rank[w * num_experts + e] = running;
      running += c;
    }
  }
  __syncthreads();

  // Step 3: ranks in slot order; rank -> row (or -1 when dropped).
  for (int64_t base = begin; base < end; base += kWarpSize) {
    const int64_t i = base + lane;
    const int e = i < end ? read_slot<KIND>(ids, i, topk, num_experts, &bad) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int32_t first = e >= 0 ? my_rank[e] : 0;
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) my_rank[e] = first + __popc(peers);
    __syncwarp();
    if (i < end) {
      int64_t row = -1;
      if (e >= 0) {
        const int32_t rank = first + __popc(peers & lanemask_lt());
        if (rank < kept[e]) row = offsets[e] + rank;
      }
      dest_row[i] = row;
      if (row >= 0) {
        row_token[row] = static_cast<int32_t>(i / topk);
        row_k[row] = static_cast<int32_t>(i % topk);
      }
    }
  }

  // Pad rows of the experts this block owns.
  for (int e = blockIdx.x; e < num_experts; e += gridDim.x) {
    for (int64_t row = offsets[e] + kept[e] + threadIdx.x; row < offsets[e] + padded[e];
         row += blockDim.x) {
      row_token[row] = -1;
      row_k[row] = -1;
    }
  }
  const int num_bad = __syncthreads_count(bad);
  if (threadIdx.x == 0 && num_bad > 0) atomicAdd(invalid_ids, num_bad);
}

template <RoutingInput::Kind KIND>
void launch_plan(const RoutingInput& in, RoutingPlan& plan, int32_t* counts, const Chunking& ch,
                 cudaStream_t stream) {
  const int num_experts = plan.config.num_experts;
  const int64_t num_slots = in.num_tokens * in.topk;
  if (ch.num_chunks > 0) {
    plan_count_kernel<KIND><<<ch.num_chunks, kPlanThreads, num_experts * sizeof(int32_t), stream>>>(
        in.data, num_slots, in.topk, num_experts, ch.chunk_slots, ch.num_chunks, counts);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
  plan_layout_kernel<<<1, kLayoutThreads, 0, stream>>>(
      counts, ch.num_chunks, num_experts, plan.config.align, plan.capacity_rows,
      plan.tokens_per_expert.data_ptr<int32_t>(), plan.padded_tokens_per_expert.data_ptr<int32_t>(),
      plan.expert_row_offsets.data_ptr<int64_t>(), plan.total_rows.data_ptr<int64_t>(),
      plan.overflow.data_ptr<int32_t>(), plan.invalid_ids.data_ptr<int32_t>());
  MOEFLOW_CUDA_LAUNCH_CHECK();
  if (ch.num_chunks > 0) {
    const size_t smem = static_cast<size_t>(kPlanWarps) * num_experts * sizeof(int32_t);
    if (smem > 48 * 1024)
      MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(plan_assign_kernel<KIND>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
    plan_assign_kernel<KIND><<<ch.num_chunks, kPlanThreads, smem, stream>>>(
        in.data, num_slots, in.topk, num_experts, ch.chunk_slots, ch.num_chunks, counts,
        plan.tokens_per_expert.data_ptr<int32_t>(),
        plan.padded_tokens_per_expert.data_ptr<int32_t>(),
        plan.expert_row_offsets.data_ptr<int64_t>(), plan.dest_row.data_ptr<int64_t>(),
        plan.row_token.data_ptr<int32_t>(), plan.row_k.data_ptr<int32_t>(),
        plan.invalid_ids.data_ptr<int32_t>());
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace

size_t plan_workspace_bytes(int64_t num_tokens, int topk, const PlanConfig& config) {
  const Chunking ch = plan_chunking(num_tokens * topk);
  // counts[E][chunks] int32, rounded to 256 bytes; at least one word.
  size_t bytes = static_cast<size_t>(config.num_experts) * ch.num_chunks * sizeof(int32_t);
  return (bytes + 255) / 256 * 256 + 256;
}

void build_plan(const RoutingInput& in, RoutingPlan& plan, TensorView workspace,
                cudaStream_t stream) {
  const int num_experts = plan.config.num_experts;
  MOEFLOW_CHECK(num_experts <= kMaxExperts, "num_experts must be <= ", kMaxExperts,
                " on the CUDA backend, got ", num_experts);
  MOEFLOW_CHECK(in.num_tokens * in.topk < (int64_t{1} << 31), "T*K must be < 2^31, got ",
                in.num_tokens * in.topk);
  const Chunking ch = plan_chunking(in.num_tokens * in.topk);
  auto* counts = static_cast<int32_t*>(workspace.data);
  switch (in.kind) {
    case RoutingInput::kIds32: launch_plan<RoutingInput::kIds32>(in, plan, counts, ch, stream); break;
    case RoutingInput::kIds64: launch_plan<RoutingInput::kIds64>(in, plan, counts, ch, stream); break;
    case RoutingInput::kMask: launch_plan<RoutingInput::kMask>(in, plan, counts, ch, stream); break;
  }
}

}  // namespace moeflow::cuda
