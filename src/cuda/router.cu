// CUDA router forward (selection, probabilities, counts, losses) and the
// expert-bias update.
//
// Forward, two kernels (and the sequence stage between them):
//   route: per block of tokens, the per-expert partial counts and aux-loss
//          column sums (warps combined in warp order) and the z-loss and
//          non-finite partials of its tokens ("rows" of the workspace).
//     route_fast_kernel<V> (router_route.cuh): E <= 512, K <= 32,
//          num_groups <= 32: one warp per token, the token's logits, scores
//          and rank keys in registers (lane l owns experts l + 32 j), groups
//          by several lanes per group, top-k by warp arg-max of the lanes'
//          cached best keys (redux.sync), ids and scores kept in lanes.
//     route_kernel (every other shape): one warp per token, scores and
//          routing scores in shared memory (lane l owns experts l, l+32, ...).
//          Groups: one lane per group sums its top (K / group_topk) routing
//          scores; the group_topk best groups are found by repeated warp
//          arg-max. Top-k: K rounds of a warp arg-max over rank keys (score,
//          then lower id), each round taking the best key below the previous
//          one, so nothing is marked or sorted.
//   (seq_aux_loss: the per-sequence stage of router_seq.cu runs here.)
//   finalize_kernel: a grid of 32-expert chunks by splits of 128 rows; each
//          block sums its rows for its experts (warp w: rows w + 32 u, u < 4,
//          as (r0 + r1) + (r2 + r3); then the warps in order) into the
//          split's column sums. The last block to arrive (an integer ticket,
//          zeroed by the route kernel's block 0) adds the splits in order per
//          expert: tokens_per_expert and the aux-loss terms, which it sums,
//          and the z-loss and non-finite rows, by fixed trees (butterflies
//          per warp, then over the warps), and writes aux_loss, z_loss,
//          nonfinite, the sequences' seq_aux_loss (in sequence order) and
//          the cu_seqlens check.
// Padding tokens (padding_mask) get ids -1 and probs 0 and are skipped
// everywhere; with a mask the losses' token count is sum(counts) / K, read on
// the device.
// Backward: router_backward.cu.
// The scores use core/router_math.h, which the CPU reference shares, so both
// backends choose the same experts. No host sync, no allocation, no float
// atomics; sizes come from shapes (graph safe).
#include <algorithm>
#include <cmath>

#include "core/backends.h"
#include "core/router_backend.h"
#include "core/router_math.h"
#include "cuda/common.cuh"
#include "cuda/router_common.cuh"
#include "cuda/router_route.cuh"

namespace moeflow::cuda {
namespace {

namespace rm = router_math;
using router_detail::aux_factor_of;
using router_detail::warp_max;
using router_detail::warp_max_u64;
using router_detail::warp_sum;
using router_detail::z_factor_of;
using router_route::RouteParams;

constexpr int kMaxWarps = 8;
constexpr int kTokensPerWarp = 8;  // tokens a warp handles in route_kernel
constexpr int kFinalWarps = 32;  // finalize_kernel: a lane per expert, the warps over rows
constexpr int kFinalThreads = kFinalWarps * kWarpSize;
constexpr int kFinalRowsPerWarp = 4;
constexpr int kFinalRows = kFinalWarps * kFinalRowsPerWarp;  // rows per finalize block
constexpr int kBiasThreads = 256;
constexpr size_t kSharedBudget = 40 << 10;  // dynamic shared memory of route_kernel
constexpr size_t kAlign = 256;

// Shared memory of route_kernel for `warps` warps.
struct RouteShared {
  int warps, E, G;
  __host__ __device__ size_t per_warp_floats() const { return 3 * size_t(E) + G; }
  __host__ __device__ size_t bytes() const {
    return (per_warp_floats() * warps + E + 2 * warps) * sizeof(float);
  }
};

int route_warps(int E, int G) {
  for (int w = kMaxWarps; w > 1; --w)
    if (RouteShared{w, E, G}.bytes() <= kSharedBudget) return w;
  return 1;
}

// How the route stage runs for T tokens: which kernel, its blocks (rows of
// partials, at least one so that the ticket is always zeroed) and threads.
// A function of the shapes only.
struct RoutePlan {
  int fast_v;  // route_fast_kernel<fast_v>, or 0: route_kernel
  int tokens_per_warp;
  int threads;
  int64_t blocks;
  size_t shared;
};

int fast_v_of(const RouterConfig& c) {
  namespace rr = router_route;
  if (c.topk > rr::kFastMaxK || c.num_groups > rr::kFastMaxGroups) return 0;
  const int slots = static_cast<int>(ceil_div(int64_t{c.num_experts}, int64_t{kWarpSize}));
  for (int v = 1; v <= rr::kFastMaxV; v *= 2)
    if (slots <= v) return v;
  return 0;
}

RoutePlan route_plan(int64_t T, const RouterConfig& c) {
  RoutePlan r{};
  r.fast_v = fast_v_of(c);
  if (r.fast_v > 0) {
    // About one wave of blocks on a 132-SM GPU (blocks per SM by register
    // use: 4 for V <= 4, 2 for V = 8, 1 for V = 16), more tokens per warp on
    // long inputs (their loads overlap the previous token's routing), which
    // also keeps finalize's rows few. A function of the shapes only.
    const int64_t target = r.fast_v <= 4 ? 512 : (r.fast_v == 8 ? 256 : 128);
    r.tokens_per_warp = static_cast<int>(std::clamp<int64_t>(
        ceil_div(T, target * router_route::kFastWarps), 1, 16));
    r.threads = router_route::kFastThreads;
    r.shared = router_route::fast_shared_bytes(
        c.num_experts, c.num_groups > 0 || c.aux_loss_coeff != 0.0f);
  } else {
    const int warps = route_warps(c.num_experts, c.num_groups);
    r.tokens_per_warp = kTokensPerWarp;
    r.threads = warps * kWarpSize;
    r.shared = RouteShared{warps, c.num_experts, c.num_groups}.bytes();
  }
  const int64_t per_block = int64_t{r.threads / kWarpSize} * r.tokens_per_warp;
  r.blocks = std::max<int64_t>(1, ceil_div(T, per_block));
  return r;
}

// finalize_kernel's grid: 32 experts by kFinalRows rows per block.
int64_t final_chunks(int E) {
  return ceil_div(int64_t{E}, int64_t{kWarpSize});
}
int64_t final_splits(int64_t rows) {
  return ceil_div(rows, int64_t{kFinalRows});
}

struct Workspace {
  float* part_colsum;
  int32_t* part_count;
  float* part_z;
  int32_t* part_nonfinite;
  float* split_colsum;   // [splits, E]: finalize's column sums per row split
  int32_t* split_count;  // [splits, E]
  unsigned* ticket;      // finalize's arrival counter
  float* seq_loss;  // [S] (seq_aux_loss only)
  void* seq;        // router_detail::seq_aux_workspace_bytes (seq_aux_loss only)
  size_t bytes;
};

size_t align_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

// rows: blocks of the route stage; S: sequences of the seq_aux_loss stage (0: none).
Workspace carve(void* base, int64_t rows, int E, int64_t T = 0, int64_t S = 0) {
  auto* p = static_cast<uint8_t*>(base);
  Workspace w{};
  size_t off = 0;
  w.part_colsum = reinterpret_cast<float*>(p + off);
  off = align_up(off + sizeof(float) * rows * E);
  w.part_count = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * rows * E);
  w.part_z = reinterpret_cast<float*>(p + off);
  off = align_up(off + sizeof(float) * rows);
  w.part_nonfinite = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * rows);
  w.split_colsum = reinterpret_cast<float*>(p + off);
  off = align_up(off + sizeof(float) * final_splits(rows) * E);
  w.split_count = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * final_splits(rows) * E);
  w.ticket = reinterpret_cast<unsigned*>(p + off);
  off = align_up(off + sizeof(unsigned));
  if (S > 0) {
    w.seq_loss = reinterpret_cast<float*>(p + off);
    off = align_up(off + sizeof(float) * S);
    w.seq = p + off;
    off = align_up(off + router_detail::seq_aux_workspace_bytes(T, E, S));
  }
  w.bytes = off;
  return w;
}

__global__ void route_kernel(RouteParams p) {
  extern __shared__ float smem[];
  const int E = p.num_experts, K = p.topk, G = p.num_groups;
  const int warps = blockDim.x / kWarpSize;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const RouteShared layout{warps, E, G};
  float* val = smem + layout.per_warp_floats() * warp;  // scores
  float* key = val + E;                                 // routing scores
  float* colsum = key + E;                              // aux-loss column sums of this warp
  float* gscore = colsum + E;                           // group scores
  int32_t* count = reinterpret_cast<int32_t*>(smem + layout.per_warp_floats() * warps);
  float* z_warp = reinterpret_cast<float*>(count + E);
  int32_t* bad_warp = reinterpret_cast<int32_t*>(z_warp + warps);

  if (blockIdx.x == 0 && threadIdx.x == 0) *p.ticket = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  for (int e = lane; e < E; e += kWarpSize) colsum[e] = 0.0f;
  __syncthreads();

  const int64_t tokens_per_block = int64_t{warps} * kTokensPerWarp;
  const int64_t t0 = int64_t{blockIdx.x} * tokens_per_block;
  float z_acc = 0.0f;
  int32_t bad_count = 0;
  for (int i = 0; i < kTokensPerWarp; ++i) {
    const int64_t t = t0 + warp + int64_t{i} * warps;
    if (t >= p.num_tokens) break;
    if (p.mask && p.mask[t]) {  // padding: not routed (warp-uniform)
      for (int j = lane; j < K; j += kWarpSize) {
        p.ids[t * K + j] = -1;
        p.probs[t * K + j] = 0.0f;
      }
      continue;
    }
    const float* row = p.logits + t * E;

    // Step 1: sanitized logits, row max, non-finite flag.
    float m = -INFINITY;
    bool bad = false;
    for (int e = lane; e < E; e += kWarpSize) {
      const float x = row[e];
      bad |= !isfinite(x);
      val[e] = rm::sanitize(x);
      m = fmaxf(m, val[e]);
    }
    m = warp_max(m);
    bad_count += __any_sync(0xffffffffu, bad) ? 1 : 0;

    // Step 2: scores, routing scores, the losses' per-token terms.
    // The full softmax only where something reads it.
    const bool need_soft = (p.softmax && (p.pre_softmax || p.aux)) || p.z;
    float part = 0.0f;
    if (need_soft)
      for (int e = lane; e < E; e += kWarpSize) part = part + rm::exp_exact(val[e] - m);
    const float sum_ex = warp_sum(part);
    float sig_part = 0.0f;
    for (int e = lane; e < E; e += kWarpSize) {
      const float x = val[e];
      const float soft = need_soft && p.softmax ? rm::exp_exact(x - m) / sum_ex : 0.0f;
      float v;
      if (p.softmax) {
        v = p.pre_softmax ? soft : x;
        if (p.aux) colsum[e] += soft;
      } else {
        v = rm::sigmoid_exact(x);
        sig_part += v;
      }
      val[e] = v;
      key[e] = p.bias ? v + p.bias[e] : v;
    }
    if (p.aux && !p.softmax) {
      const float d = warp_sum(sig_part) + rm::kRenormEps;
      for (int e = lane; e < E; e += kWarpSize) colsum[e] += val[e] / d;
    }
    if (p.z) {
      const float lse = m + logf(sum_ex);
      z_acc += lse * lse;
    }
    __syncwarp();

    // Step 3: group limits (a group is allowed when its key >= g_threshold).
    uint64_t g_threshold = 0;
    const int per = G > 0 ? E / G : E;
    if (G > 0) {
      const int take = K / p.group_topk;
      for (int g = lane; g < G; g += kWarpSize) {
        uint64_t prev = ~uint64_t{0};
        float s = 0.0f;
        for (int j = 0; j < take; ++j) {
          uint64_t best = 0;
          for (int e = g * per; e < (g + 1) * per; ++e) {
            const uint64_t k = rm::rank_key(key[e], e);
            if (k < prev && k > best) best = k;
          }
          s = s + key[rm::rank_key_id(best)];
          prev = best;
        }
        gscore[g] = s;
      }
      __syncwarp();
      uint64_t prev = ~uint64_t{0};
      for (int j = 0; j < p.group_topk; ++j) {
        uint64_t best = 0;
        for (int g = lane; g < G; g += kWarpSize) {
          const uint64_t k = rm::rank_key(gscore[g], g);
          if (k < prev && k > best) best = k;
        }
        prev = warp_max_u64(best);
      }
      g_threshold = prev;
    }

    // Step 4: top-k, best first; lane 0 writes the ids and counts them.
    uint64_t prev = ~uint64_t{0};
    for (int j = 0; j < K; ++j) {
      uint64_t best = 0;
      for (int e = lane; e < E; e += kWarpSize) {
        if (G > 0 && rm::rank_key(gscore[e / per], e / per) < g_threshold) continue;
        const uint64_t k = rm::rank_key(key[e], e);
        if (k < prev && k > best) best = k;
      }
      prev = warp_max_u64(best);
      if (lane == 0) {
        const int id = rm::rank_key_id(prev);
        p.ids[t * K + j] = id;
        atomicAdd(&count[id], 1);  // integer: order does not matter
      }
    }
    __syncwarp();  // NOTE: orders lane 0's id stores before the reads below

    // Step 5: probabilities of the chosen slots (lane l: slots l, l+32, ...).
    float mk = -INFINITY, s_part = 0.0f;
    for (int j = lane; j < K; j += kWarpSize) mk = fmaxf(mk, val[p.ids[t * K + j]]);
    mk = warp_max(mk);
    for (int j = lane; j < K; j += kWarpSize) {
      const float v = val[p.ids[t * K + j]];
      s_part = s_part + (p.softmax && !p.pre_softmax ? rm::exp_exact(v - mk) : v);
    }
    const float s = warp_sum(s_part);
    for (int j = lane; j < K; j += kWarpSize) {
      const float v = val[p.ids[t * K + j]];
      float prob = v;
      if (p.softmax && !p.pre_softmax)
        prob = rm::exp_exact(v - mk) / s;
      else if (!p.softmax && K > 1)
        prob = v / (s + rm::kRenormEps);
      p.probs[t * K + j] = prob * p.scale;
    }
    __syncwarp();  // the next token overwrites val/key
  }
  if (lane == 0) {
    z_warp[warp] = z_acc;
    bad_warp[warp] = bad_count;
  }
  __syncthreads();

  // Step 6: this block's partials, warps combined in warp order.
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float c = 0.0f;
    for (int w = 0; w < warps; ++w) c = c + smem[layout.per_warp_floats() * w + 2 * E + e];
    p.part_colsum[int64_t{blockIdx.x} * E + e] = c;
    p.part_count[int64_t{blockIdx.x} * E + e] = count[e];
  }
  if (threadIdx.x == 0) {
    float z = 0.0f;
    int32_t b = 0;
    for (int w = 0; w < warps; ++w) {
      z = z + z_warp[w];
      b += bad_warp[w];
    }
    p.part_z[blockIdx.x] = z;
    p.part_nonfinite[blockIdx.x] = b;
  }
}

struct FinalizeParams {
  const float* part_colsum;  // read when aux
  const int32_t* part_count;
  const float* part_z;
  const int32_t* part_nonfinite;
  int64_t rows;  // blocks of the route stage
  int num_experts;
  bool aux;
  float* split_colsum;  // [gridDim.y, E] (workspace)
  int32_t* split_count;
  unsigned* ticket;
  int32_t* tokens_per_expert;
  float* aux_loss;     // or null
  float* z_loss;       // or null
  int32_t* nonfinite;  // or null
  float aux_factor;    // E * coeff / (K * T * T), 0 when not computed
  float z_factor;      // coeff / T, 0 when not computed
  // Padding mask: T = sum(tokens_per_expert) / K on the device, the factors
  // computed here from the coefficients.
  bool masked;
  int topk;
  float aux_coeff, z_coeff;
  // seq_aux_loss: the sequences' loss terms [S] (or null) and the output.
  const float* seq_loss;
  int64_t num_sequences;
  float* seq_aux_loss;  // or null
  // cu_seqlens [S+1] check (or null).
  const int32_t* cu;
  int64_t num_tokens;
  int32_t* invalid_cu;
};

__device__ __forceinline__ float reduce_add(float v) { return warp_sum(v); }
__device__ __forceinline__ long long reduce_add(long long v) {
  return router_detail::warp_sum_ll(v);
}

// v summed over the block (32 warps): each warp's butterfly, then the warps'
// sums by a butterfly; a fixed order. Every thread gets the sum.
template <typename T>
__device__ T block_sum(T v, T* red) {
  static_assert(kFinalWarps == kWarpSize, "one warp sum per lane");
  v = reduce_add(v);
  if (threadIdx.x % kWarpSize == 0) red[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  v = reduce_add(red[threadIdx.x % kWarpSize]);
  __syncthreads();  // red is free again
  return v;
}

// Grid (32-expert chunks, row splits of kFinalRows rows).
__global__ void __launch_bounds__(kFinalThreads) finalize_kernel(FinalizeParams p) {
  __shared__ float col_c[kFinalWarps][kWarpSize + 1];
  __shared__ int32_t col_n[kFinalWarps][kWarpSize + 1];
  __shared__ float red_f[kFinalWarps];
  __shared__ long long red_n[kFinalWarps];
  __shared__ bool is_last;
  const int E = p.num_experts;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t R = p.rows;

  // Step 1: this block's 32 experts over its rows: warp w takes rows
  // w + 32 u (u < 4) of the split, summed as (r0 + r1) + (r2 + r3); then the
  // warps in order.
  {
    const int e = blockIdx.x * kWarpSize + lane;
    const int64_t r0 = int64_t{blockIdx.y} * kFinalRows + warp;
    float c[kFinalRowsPerWarp];
    int32_t n = 0;
#pragma unroll
    for (int u = 0; u < kFinalRowsPerWarp; ++u) {
      const int64_t b = r0 + int64_t{u} * kFinalWarps;
      const bool in = e < E && b < R;
      c[u] = in && p.aux ? p.part_colsum[b * E + e] : 0.0f;
      n += in ? p.part_count[b * E + e] : 0;
    }
    col_c[warp][lane] = (c[0] + c[1]) + (c[2] + c[3]);
    col_n[warp][lane] = n;
    __syncthreads();
    if (warp == 0 && e < E) {
      float cs = 0.0f;
      int32_t ns = 0;
      for (int w = 0; w < kFinalWarps; ++w) {
        cs = cs + col_c[w][lane];
        ns += col_n[w][lane];
      }
      p.split_colsum[int64_t{blockIdx.y} * E + e] = cs;
      p.split_count[int64_t{blockIdx.y} * E + e] = ns;
    }
  }

  // Step 2: the last block to arrive finishes (the ticket is an integer
  // counter; what the last block computes does not depend on who it is).
  const unsigned blocks = gridDim.x * gridDim.y;
  if (blocks > 1) {
    if (warp == 0) __threadfence();  // this block's split sums before its ticket
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(p.ticket, 1u) == blocks - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
  }
  // Per expert: the splits in order; the aux-loss terms and counts by the
  // block's fixed tree.
  const int64_t splits = gridDim.y;
  float aux_part = 0.0f;
  long long total = 0;
  for (int e = threadIdx.x; e < E; e += kFinalThreads) {
    float c = 0.0f;
    int32_t n = 0;
    for (int64_t sp = 0; sp < splits; ++sp) {
      c = c + __ldcg(p.split_colsum + sp * E + e);
      n += __ldcg(p.split_count + sp * E + e);
    }
    p.tokens_per_expert[e] = n;
    aux_part = aux_part + c * static_cast<float>(n);
    total += n;
  }
  float z = 0.0f;
  long long bad = 0;
  for (int64_t b = threadIdx.x; b < R; b += kFinalThreads) {
    z = z + p.part_z[b];
    bad += p.part_nonfinite[b];
  }
  const float aux_sum = block_sum(aux_part, red_f);
  total = block_sum(total, red_n);
  z = block_sum(z, red_f);
  bad = block_sum(bad, red_n);
  if (threadIdx.x == 0) {
    float aux_factor = p.aux_factor, z_factor = p.z_factor;
    if (p.masked) {  // the real tokens
      const int64_t real = total / p.topk;
      aux_factor = p.aux_coeff != 0.0f ? aux_factor_of(E, p.topk, p.aux_coeff, real) : 0.0f;
      z_factor = p.z_coeff != 0.0f ? z_factor_of(p.z_coeff, real) : 0.0f;
    }
    if (p.aux_loss) *p.aux_loss = aux_factor != 0.0f ? aux_sum * aux_factor : 0.0f;
    if (p.z_loss) *p.z_loss = z_factor != 0.0f ? z * z_factor : 0.0f;
    if (p.nonfinite) *p.nonfinite = static_cast<int32_t>(bad);
    if (blocks > 1) *p.ticket = 0;
  }
  // The sequences' loss terms, strided per thread then the tree: fixed order.
  if (p.seq_aux_loss) {
    float s = 0.0f;
    if (p.seq_loss)
      for (int64_t i = threadIdx.x; i < p.num_sequences; i += kFinalThreads) s = s + p.seq_loss[i];
    s = block_sum(s, red_f);
    if (threadIdx.x == 0) *p.seq_aux_loss = s;
  }
  // cu_seqlens: 0 = cu[0] <= cu[1] <= ... <= cu[S] = T.
  if (p.invalid_cu) {
    bool bad_cu = false;
    if (p.cu) {
      for (int64_t i = threadIdx.x; i < p.num_sequences; i += kFinalThreads)
        bad_cu |= p.cu[i] > p.cu[i + 1];
      if (threadIdx.x == 0) bad_cu |= p.cu[0] != 0 || p.cu[p.num_sequences] != p.num_tokens;
    }
    bad_cu = __syncthreads_or(bad_cu);
    if (threadIdx.x == 0) *p.invalid_cu = bad_cu ? 1 : 0;
  }
}

__global__ void update_bias_kernel(const int32_t* counts, float* bias, int E, float rate) {
  __shared__ long long red[kBiasThreads];
  long long s = 0;
  for (int e = threadIdx.x; e < E; e += kBiasThreads) s += counts[e];
  red[threadIdx.x] = s;
  __syncthreads();
  for (int half = kBiasThreads / 2; half >= 1; half /= 2) {
    if (threadIdx.x < half) red[threadIdx.x] += red[threadIdx.x + half];
    __syncthreads();
  }
  const double mean = static_cast<double>(red[0]) / E;
  for (int e = threadIdx.x; e < E; e += kBiasThreads) {
    const double off = mean - counts[e];
    const float sign = off > 0 ? 1.0f : (off < 0 ? -1.0f : 0.0f);
    bias[e] = bias[e] + rate * sign;
  }
}

}  // namespace

size_t router_workspace_bytes(int64_t num_tokens, const RouterConfig& c, int64_t num_sequences) {
  return carve(nullptr, route_plan(num_tokens, c).blocks, c.num_experts, num_tokens,
               num_sequences)
      .bytes;
}

void router_forward(const RouterForwardArgs& a, cudaStream_t stream) {
  const RouterConfig& c = a.config;
  const RouterOutputs& out = a.out;
  const int64_t T = a.logits.shape[0];
  const int E = c.num_experts, K = c.topk;
  const RoutePlan plan = route_plan(T, c);
  // The sequence stage runs when its outputs are wanted (S from cu_seqlens).
  const bool seq = a.num_sequences > 0 && out.seq_tokens_per_expert.defined();
  const int64_t S = seq ? a.num_sequences : 0;
  const Workspace ws = carve(a.workspace.data, plan.blocks, E, T, S);
  MOEFLOW_CHECK(plan.blocks <= 0x7FFFFFFF && final_splits(plan.blocks) <= 65535,
                "router: too many tokens (", T, ")");
  const dim3 final_grid(static_cast<unsigned>(final_chunks(E)),
                        static_cast<unsigned>(final_splits(plan.blocks)));
  const bool softmax = c.score_function == ScoreFunction::kSoftmax;
  const uint8_t* mask =
      a.padding_mask.defined() ? static_cast<const uint8_t*>(a.padding_mask.data) : nullptr;
  {
    RouteParams p{};
    p.logits = T > 0 ? a.logits.data_ptr<float>() : nullptr;
    p.bias = a.expert_bias.defined() ? a.expert_bias.data_ptr<float>() : nullptr;
    p.mask = mask;
    p.ids = T > 0 ? out.topk_ids.data_ptr<int32_t>() : nullptr;
    p.probs = T > 0 ? out.probs.data_ptr<float>() : nullptr;
    p.num_tokens = T;
    p.num_experts = E;
    p.topk = K;
    p.softmax = softmax;
    p.pre_softmax = c.pre_softmax;
    p.num_groups = c.num_groups;
    p.group_topk = c.group_topk;
    p.scale = rm::effective_scale(c.topk_scaling_factor);
    p.aux = c.aux_loss_coeff != 0.0f;
    p.z = c.z_loss_coeff != 0.0f;
    p.tokens_per_warp = plan.tokens_per_warp;
    p.part_colsum = ws.part_colsum;
    p.part_count = ws.part_count;
    p.part_z = ws.part_z;
    p.part_nonfinite = ws.part_nonfinite;
    p.ticket = ws.ticket;
    MOEFLOW_CHECK(plan.shared <= 48 << 10, "router: num_experts=", E,
                  " with num_groups=", c.num_groups, " needs ", plan.shared,
                  " bytes of shared memory; the CUDA router supports up to 49152 "
                  "(about 2400 experts)");
    const auto grid = static_cast<unsigned>(plan.blocks);
    switch (plan.fast_v) {
      case 1: router_route::route_fast_kernel<1><<<grid, plan.threads, plan.shared, stream>>>(p); break;
      case 2: router_route::route_fast_kernel<2><<<grid, plan.threads, plan.shared, stream>>>(p); break;
      case 4: router_route::route_fast_kernel<4><<<grid, plan.threads, plan.shared, stream>>>(p); break;
      case 8: router_route::route_fast_kernel<8><<<grid, plan.threads, plan.shared, stream>>>(p); break;
      case 16: router_route::route_fast_kernel<16><<<grid, plan.threads, plan.shared, stream>>>(p); break;
      default: route_kernel<<<grid, plan.threads, plan.shared, stream>>>(p);
    }
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
  if (seq) {
    router_detail::SeqAuxParams sp{};
    sp.logits = a.logits.data_ptr<float>();
    sp.ids = out.topk_ids.data_ptr<int32_t>();
    sp.mask = mask;
    sp.cu = a.cu_seqlens.data_ptr<int32_t>();
    sp.num_tokens = T;
    sp.num_sequences = S;
    sp.num_experts = E;
    sp.topk = K;
    sp.softmax = softmax;
    sp.coeff = c.seq_aux_loss_coeff;
    sp.seq_counts = out.seq_tokens_per_expert.data_ptr<int32_t>();
    sp.seq_loss = ws.seq_loss;
    sp.workspace = ws.seq;
    router_detail::seq_aux_forward(sp, stream);
  }
  FinalizeParams f{};
  f.part_colsum = ws.part_colsum;
  f.part_count = ws.part_count;
  f.part_z = ws.part_z;
  f.part_nonfinite = ws.part_nonfinite;
  f.rows = plan.blocks;
  f.num_experts = E;
  f.aux = c.aux_loss_coeff != 0.0f;
  f.split_colsum = ws.split_colsum;
  f.split_count = ws.split_count;
  f.ticket = ws.ticket;
  f.tokens_per_expert = out.tokens_per_expert.data_ptr<int32_t>();
  f.aux_loss = out.aux_loss.defined() ? out.aux_loss.data_ptr<float>() : nullptr;
  f.z_loss = out.z_loss.defined() ? out.z_loss.data_ptr<float>() : nullptr;
  f.nonfinite = out.nonfinite.defined() ? out.nonfinite.data_ptr<int32_t>() : nullptr;
  f.aux_factor = aux_factor_of(E, K, c.aux_loss_coeff, T);
  f.z_factor = z_factor_of(c.z_loss_coeff, T);
  f.masked = mask != nullptr;
  f.topk = K;
  f.aux_coeff = c.aux_loss_coeff;
  f.z_coeff = c.z_loss_coeff;
  f.seq_loss = seq ? ws.seq_loss : nullptr;
  f.num_sequences = a.num_sequences;
  f.seq_aux_loss = out.seq_aux_loss.defined() ? out.seq_aux_loss.data_ptr<float>() : nullptr;
  f.cu = a.cu_seqlens.defined() ? a.cu_seqlens.data_ptr<int32_t>() : nullptr;
  f.num_tokens = T;
  f.invalid_cu =
      out.invalid_cu_seqlens.defined() ? out.invalid_cu_seqlens.data_ptr<int32_t>() : nullptr;
  finalize_kernel<<<final_grid, kFinalThreads, 0, stream>>>(f);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void router_update_expert_bias(TensorView tokens_per_expert, TensorView expert_bias, float rate,
                               cudaStream_t stream) {
  const int64_t E = tokens_per_expert.shape[0];
  if (E == 0) return;
  update_bias_kernel<<<1, kBiasThreads, 0, stream>>>(tokens_per_expert.data_ptr<int32_t>(),
                                                     expert_bias.data_ptr<float>(),
                                                     static_cast<int>(E), rate);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda
