// CUDA build_plan: two kernels, no host synchronisation.
//
// The T*K routing slots (t-major) are cut into at most kMaxChunks chunks of
// `chunk_slots` (a multiple of kBatch).
//   1. plan_count_kernel:  one block per chunk counts the slots of each expert
//      (shared-memory atomics: counts do not depend on order) and the invalid
//      ids, and writes counts[chunk][0..E] (column E: invalid ids).
//   2. plan_assign_kernel: one block per chunk again.
//      a. From all chunks' counts (a few KB, read from L2 by every block) it
//         derives the experts' totals and the rank base of its own chunk, and
//         lays the padded segments out with a block scan (layout_expert,
//         shared with the CPU reference: same drop order). Block 0 writes the
//         plan-wide results (counts, offsets, total rows, overflow, invalid).
//      b. It walks its chunk in batches of kBatch slots staged in shared
//         memory: each warp counts its 128 slots per expert, a prefix across
//         the warps gives each warp its first rank, and __match_any_sync hands
//         out ranks in slot order within each 32-slot step. Rank -> row, or -1
//         past the expert's kept count (dropped).
//      c. Pad rows of the experts it owns get row_token = row_k = -1.
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
constexpr int kItems = 4;                         // slots per thread per batch
constexpr int kBatch = kPlanThreads * kItems;     // 1024 slots
constexpr int kWarpBatch = kWarpSize * kItems;    // 128 slots per warp per batch
constexpr int kExpertItems = 8;                   // experts per thread in the layout scan
constexpr int kMaxExperts = kPlanThreads * kExpertItems;  // 2048
constexpr int64_t kMaxChunks = 256;

struct Chunking {
  int64_t chunk_slots = kBatch;
  int64_t num_chunks = 0;
};

Chunking plan_chunking(int64_t num_slots) {
  Chunking c;
  c.chunk_slots = ceil_div(ceil_div(num_slots, kMaxChunks), kBatch) * kBatch;
  if (c.chunk_slots < kBatch) c.chunk_slots = kBatch;
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
                      int64_t chunk_slots, int32_t* counts) {
  extern __shared__ int32_t cnt[];  // [E]
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const int64_t begin = blockIdx.x * chunk_slots;
  const int64_t end = min(begin + chunk_slots, num_slots);
  bool bad = false;
  for (int64_t b = begin; b < end; b += kBatch) {
    int e[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {  // all loads first, then the atomics
      const int64_t i = b + j * kPlanThreads + threadIdx.x;
      e[j] = i < end ? read_slot<KIND>(ids, i, topk, num_experts, &bad) : -1;
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j)
      if (e[j] >= 0) atomicAdd(&cnt[e[j]], 1);
  }
  const int num_bad = __syncthreads_count(bad);
  int32_t* row = counts + blockIdx.x * (num_experts + 1);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) row[e] = cnt[e];
  if (threadIdx.x == 0) row[num_experts] = num_bad;
}

struct AssignArgs {
  const void* ids;
  int64_t num_slots;
  int topk;
  int num_experts;
  int align;
  int64_t capacity;
  int64_t chunk_slots;
  int64_t num_chunks;
  const int32_t* counts;  // [chunks][E+1]
  int32_t* kept_out;
  int32_t* padded_out;
  int64_t* offsets_out;
  int64_t* total_rows;
  int32_t* overflow;
  int32_t* invalid_ids;
  int64_t* dest_row;
  int32_t* row_token;
  int32_t* row_k;
};

size_t assign_smem_bytes(int num_experts) {
  return static_cast<size_t>(num_experts) * (sizeof(int64_t) + 2 * sizeof(int32_t)) +
         static_cast<size_t>(kPlanWarps) * num_experts * sizeof(int32_t) + kBatch * sizeof(int16_t);
}

template <RoutingInput::Kind KIND>
__global__ void __launch_bounds__(kPlanThreads) plan_assign_kernel(AssignArgs a) {
  const int E = a.num_experts;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  extern __shared__ int64_t smem64[];
  int64_t* offset_s = smem64;                                          // [E]
  int32_t* kept_s = reinterpret_cast<int32_t*>(offset_s + E);          // [E]
  int32_t* next_s = kept_s + E;                                        // [E] next rank
  int32_t* warp_cnt = next_s + E;                                      // [warps][E]
  int16_t* batch_ids = reinterpret_cast<int16_t*>(warp_cnt + kPlanWarps * E);  // [kBatch]

  // Step a: totals and this chunk's rank base per expert (totals parked in warp_cnt).
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t total = 0, base = 0;
#pragma unroll 8
    for (int64_t c = 0; c < a.num_chunks; ++c) {
      const int32_t v = a.counts[c * (E + 1) + e];
      total += v;
      base += c < blockIdx.x ? v : 0;
    }
    warp_cnt[e] = total;
    next_s[e] = base;
  }
  __syncthreads();
  using Scan = cub::BlockScan<int64_t, kPlanThreads>;
  using Reduce = cub::BlockReduce<int64_t, kPlanThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  int64_t routed[kExpertItems], prefix[kExpertItems];
#pragma unroll
  for (int j = 0; j < kExpertItems; ++j) {
    const int e = threadIdx.x * kExpertItems + j;
    routed[j] = e < E ? warp_cnt[e] : 0;
    prefix[j] = (routed[j] + a.align - 1) / a.align * a.align;
  }
  int64_t sum_padded = 0;
  Scan(tmp.scan).ExclusiveSum(prefix, prefix, sum_padded);
  int64_t dropped = 0;
#pragma unroll
  for (int j = 0; j < kExpertItems; ++j) {
    const int e = threadIdx.x * kExpertItems + j;
    if (e < E) {
      const ExpertLayout l = layout_expert(routed[j], prefix[j], a.capacity, a.align);
      kept_s[e] = l.kept;
      offset_s[e] = l.offset;
      dropped += routed[j] - l.kept;
      if (blockIdx.x == 0) {
        a.kept_out[e] = l.kept;
        a.padded_out[e] = l.padded;
        a.offsets_out[e] = l.offset;
      }
    }
  }
  __syncthreads();  // tmp reuse; warp_cnt free again
  if (blockIdx.x == 0) {
    const int64_t total_dropped = Reduce(tmp.reduce).Sum(dropped);
    if (threadIdx.x == 0) {
      int64_t bad = 0;
      for (int64_t c = 0; c < a.num_chunks; ++c) bad += a.counts[c * (E + 1) + E];
      const int64_t total = sum_padded < a.capacity ? sum_padded : a.capacity;
      a.offsets_out[E] = total;
      *a.total_rows = total;
      *a.overflow = static_cast<int32_t>(total_dropped);
      *a.invalid_ids = static_cast<int32_t>(bad);
    }
  }

  // Step b: ranks in slot order, a batch of kBatch slots at a time.
  const int64_t chunk_begin = blockIdx.x * a.chunk_slots;
  const int64_t chunk_end = min(chunk_begin + a.chunk_slots, a.num_slots);
  int32_t* my_cnt = warp_cnt + warp * E;
  for (int64_t b = chunk_begin; b < chunk_end; b += kBatch) {
    bool bad = false;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = b + j * kPlanThreads + threadIdx.x;
      batch_ids[j * kPlanThreads + threadIdx.x] =
          static_cast<int16_t>(i < chunk_end ? read_slot<KIND>(a.ids, i, a.topk, E, &bad) : -1);
    }
    for (int i = threadIdx.x; i < kPlanWarps * E; i += blockDim.x) warp_cnt[i] = 0;
    __syncthreads();
    // NOTE: warp w owns slots [w*128, (w+1)*128) of the batch, in order.
    const int16_t* mine = batch_ids + warp * kWarpBatch;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int e = mine[j * kWarpSize + lane];
      if (e >= 0) atomicAdd(&my_cnt[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      int32_t running = next_s[e];
      for (int w = 0; w < kPlanWarps; ++w) {
        const int32_t c = warp_cnt[w * E + e];
        warp_cnt[w * E + e] = running;
        running += c;
      }
      next_s[e] = running;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int e = mine[j * kWarpSize + lane];
      const int64_t i = b + warp * kWarpBatch + j * kWarpSize + lane;
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int32_t first = e >= 0 ? my_cnt[e] : 0;
      __syncwarp();
      if (e >= 0 && lane == __ffs(peers) - 1) my_cnt[e] = first + __popc(peers);
      __syncwarp();
      if (i < chunk_end) {
        int64_t row = -1;
        if (e >= 0) {
          const int32_t rank = first + __popc(peers & lanemask_lt());
          if (rank < kept_s[e]) row = offset_s[e] + rank;
        }
        a.dest_row[i] = row;
        if (row >= 0) {
          a.row_token[row] = static_cast<int32_t>(i / a.topk);
          a.row_k[row] = static_cast<int32_t>(i % a.topk);
        }
      }
    }
    __syncthreads();  // batch_ids and warp_cnt are rewritten next batch
  }

  // Step c: pad rows of the experts this block owns.
  for (int e = blockIdx.x; e < E; e += gridDim.x) {
    const int64_t start = offset_s[e] + kept_s[e];
    const int64_t end = offset_s[e] + (kept_s[e] + a.align - 1) / a.align * a.align;
    for (int64_t row = start + threadIdx.x; row < end; row += blockDim.x) {
      a.row_token[row] = -1;
      a.row_k[row] = -1;
    }
  }
}

template <RoutingInput::Kind KIND>
void launch_plan(const RoutingInput& in, RoutingPlan& plan, int32_t* counts, const Chunking& ch,
                 cudaStream_t stream) {
  const int E = plan.config.num_experts;
  AssignArgs a{};
  a.ids = in.data;
  a.num_slots = in.num_tokens * in.topk;
  a.topk = in.topk;
  a.num_experts = E;
  a.align = plan.config.align;
  a.capacity = plan.capacity_rows;
  a.chunk_slots = ch.chunk_slots;
  a.num_chunks = ch.num_chunks;
  a.counts = counts;
  a.kept_out = plan.tokens_per_expert.data_ptr<int32_t>();
  a.padded_out = plan.padded_tokens_per_expert.data_ptr<int32_t>();
  a.offsets_out = plan.expert_row_offsets.data_ptr<int64_t>();
  a.total_rows = plan.total_rows.data_ptr<int64_t>();
  a.overflow = plan.overflow.data_ptr<int32_t>();
  a.invalid_ids = plan.invalid_ids.data_ptr<int32_t>();
  a.dest_row = plan.dest_row.data_ptr<int64_t>();
  a.row_token = plan.row_token.data_ptr<int32_t>();
  a.row_k = plan.row_k.data_ptr<int32_t>();
  // With no slots, one block still writes the plan-wide results.
  const int64_t blocks = ch.num_chunks > 0 ? ch.num_chunks : 1;
  if (ch.num_chunks > 0) {
    plan_count_kernel<KIND><<<ch.num_chunks, kPlanThreads, E * sizeof(int32_t), stream>>>(
        in.data, a.num_slots, in.topk, E, ch.chunk_slots, counts);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
  const size_t smem = assign_smem_bytes(E);
  if (smem > 48 * 1024)
    MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(plan_assign_kernel<KIND>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
  plan_assign_kernel<KIND><<<blocks, kPlanThreads, smem, stream>>>(a);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace

size_t plan_workspace_bytes(int64_t num_tokens, int topk, const PlanConfig& config) {
  const Chunking ch = plan_chunking(num_tokens * topk);
  // counts[chunks][E+1] int32, rounded to 256 bytes.
  const size_t bytes = static_cast<size_t>(config.num_experts + 1) * ch.num_chunks * sizeof(int32_t);
  return (bytes + 255) / 256 * 256;
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
