// The route kernels' parameters and the fast route kernel of the CUDA router
// forward (router.cu includes this file; nothing else does).
//
// route_fast_kernel<V>: E <= 32 V experts (V = 1, 2, 4, 8, 16), K <= 32,
// num_groups <= 32. One warp per token, kFastWarps warps per block, each warp
// routing tokens_per_warp tokens one after another (warp w: tokens w,
// w + kFastWarps, ... of the block), the next token's logits loaded while the
// current one is routed. Lane l owns experts l + 32 j (j < V) and keeps their
// logits, scores and rank keys in registers; its sums run in j order and the
// warp combines them by the xor butterfly, as the CPU reference replays. The
// exp and the sigmoid's reciprocal are branch-free forms of the same
// operations (exp_exact_flat, rcp_fast; the rare inputs outside rcp_fast's
// range take the division itself), so the V slots interleave.
//   Groups (the score of a group: its top K / group_topk routing scores
//   added best first from 0, as key_score of the winning keys):
//   - power-of-two sizes <= 32: group g of slot j is (l + 32 j) >> log2(per),
//     an aligned lane segment of one slot; `take` rounds of "best key below
//     the previous one" per slot, by a butterfly over the segment (redux.sync
//     for whole slots), all slots at once;
//   - other sizes: the keys' score words go to the warp's shared row (at
//     e + group * L: no bank conflicts when per % 32 == 0); L = 2^floor(
//     log2(32 / G)) lanes per group (lane l: group l / L, every L-th expert
//     of it) scan it in `take` rounds, then a butterfly over the L lanes.
//   Then group_topk rounds of a warp arg-max over the group keys (one group
//   per lane) give the threshold, a ballot the allowed groups, and keys of
//   experts outside them become 0 (never chosen: every real key is > 0).
//   Top-k: each lane caches its best two keys; a round is a warp arg-max of
//   the lanes' best (two redux.sync: score word, then lowest id), after which
//   the winning lane moves its second key up, rescanning its V keys only when
//   it wins twice since its last scan. Lane j keeps slot j's id; the slots'
//   scores come by shuffle from the owning lanes, so the probabilities need
//   no global re-read.
// Per block: counts by shared-memory integer atomics; the aux-loss column
// sums accumulate in registers per lane over the warp's tokens, then the warps
// are combined in warp order; z and non-finite partials likewise.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/router_math.h"
#include "cuda/common.cuh"
#include "cuda/router_common.cuh"

namespace moeflow::cuda::router_route {

namespace rm = router_math;
using router_detail::warp_max;
using router_detail::warp_sum;

constexpr int kFastWarps = 8;
constexpr int kFastThreads = kFastWarps * kWarpSize;
constexpr int kFastMaxV = 16;    // experts <= 32 * kFastMaxV
constexpr int kFastMaxK = 32;    // one slot per lane
constexpr int kFastMaxGroups = 32;

struct RouteParams {
  const float* logits;
  const float* bias;    // [E] or null
  const uint8_t* mask;  // [T] or null: nonzero = padding token
  int32_t* ids;
  float* probs;
  int64_t num_tokens;
  int num_experts, topk;
  bool softmax, pre_softmax;
  int num_groups, group_topk;
  float scale;
  bool aux, z;
  int tokens_per_warp;  // route_fast_kernel
  // Per-block partials (workspace).
  float* part_colsum;       // [blocks, E] (written when aux)
  int32_t* part_count;      // [blocks, E]
  float* part_z;            // [blocks]
  int32_t* part_nonfinite;  // [blocks]
  unsigned* ticket;         // finalize's arrival counter, zeroed by block 0
};

// Dynamic shared memory of route_fast_kernel: counts [E], z and non-finite
// per warp, and (groups or aux) one row of E + 32 words per warp.
__host__ __device__ inline size_t fast_shared_bytes(int E, bool rows) {
  return (static_cast<size_t>(E) + 2 * kFastWarps +
          (rows ? static_cast<size_t>(kFastWarps) * (E + kWarpSize) : 0)) *
         sizeof(uint32_t);
}

// The warp's largest 64-bit key (warp_max_u64's result): the largest score
// word, then the largest low word (lowest id) among the lanes holding it.
__device__ __forceinline__ uint64_t warp_best(uint64_t v) {
#if __CUDA_ARCH__ >= 800
  const unsigned hi = static_cast<unsigned>(v >> 32);
  const unsigned mh = __reduce_max_sync(0xffffffffu, hi);
  const unsigned ml = __reduce_max_sync(0xffffffffu, hi == mh ? static_cast<unsigned>(v) : 0u);
  return (static_cast<uint64_t>(mh) << 32) | ml;
#else
  return router_detail::warp_max_u64(v);
#endif
}

// The score of a rank key (rank_key's inverse on the score word): exact,
// except that a NaN score comes back as -inf. The group scores add these
// instead of the routing scores themselves; only sanitize(sum) is ranked, and
// it is the same: where the CPU adds a NaN its sum stays NaN, and here the
// -inf makes the sum -inf or NaN, which later terms keep -inf or NaN; both
// rank as -inf.
__device__ __forceinline__ float key_score(uint64_t key) {
  const uint32_t hi = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((hi & 0x80000000u) ? (hi & 0x7FFFFFFFu) : ~hi);
}

// (h1, h2) = the best two of the keys seen so far (0 = none).
__device__ __forceinline__ void top2_insert(uint64_t& h1, uint64_t& h2, uint64_t k) {
  if (k > h1) {
    h2 = h1;
    h1 = k;
  } else if (k > h2) {
    h2 = k;
  }
}

// The warp's largest float (no NaN): one redux.sync on an order-preserving
// integer image. Equal to warp_max except that of -0 and +0 it returns +0,
// which no output can tell apart (the max is only subtracted from values or
// added to a log of a number >= 1).
__device__ __forceinline__ float warp_max_flat(float v) {
#if __CUDA_ARCH__ >= 800
  const uint32_t b = __float_as_uint(v);
  const uint32_t k = b ^ ((b & 0x80000000u) ? 0xFFFFFFFFu : 0x80000000u);
  const uint32_t m = __reduce_max_sync(0xffffffffu, k);
  return __uint_as_float(m ^ ((m & 0x80000000u) ? 0x80000000u : 0xFFFFFFFFu));
#else
  return warp_max(v);
#endif
}

// rm::exp_exact without branches: the same operations on (-104, 88.72], and
// selects for the other inputs, so that the V slots of a lane interleave.
__device__ __forceinline__ float exp_exact_flat(float x) {
  const float xc = fminf(fmaxf(x, -104.0f), 88.72f);  // = x where the operations apply
  const float n = rintf(rm::mul_rn(xc, 1.44269504f));
  float r = fmaf(n, -0.693145751953125f, xc);
  r = fmaf(n, -1.42860682e-6f, r);
  float p = 1.98412698e-4f;
  p = fmaf(p, r, 1.38888889e-3f);
  p = fmaf(p, r, 8.33333333e-3f);
  p = fmaf(p, r, 4.16666667e-2f);
  p = fmaf(p, r, 1.66666667e-1f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const int ni = static_cast<int>(n);
  const int n1 = ni / 2, n2 = ni - n1;
  const float y = rm::mul_rn(rm::mul_rn(p, __uint_as_float(static_cast<uint32_t>(n1 + 127) << 23)),
                             __uint_as_float(static_cast<uint32_t>(n2 + 127) << 23));
  if (x > 88.72f) return __uint_as_float(0x7F800000u);
  return x > -104.0f ? y : (x != x ? x : 0.0f);
}

// 1 / d rounded to nearest where nvcc's division takes its fast path
// (rcp_fast_ok: exponent field not in {0, 253, 254, 255}; every d in
// [1, 2^126)): the same approximation and refinement, without the branch to
// the slow path, which the caller takes for the other d.
__device__ __forceinline__ bool rcp_fast_ok(float d) {
  return ((__float_as_uint(d) + 0x01800000u) & 0x7F800000u) > 0x01FFFFFFu;
}
__device__ __forceinline__ float rcp_fast(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float e = fmaf(d, r, -1.0f);
  return fmaf(r, -e, r);
}

// The score word of rank_key (rank_key(s, id) >> 32).
__device__ __forceinline__ uint32_t score_word(float s) {
  return static_cast<uint32_t>(rm::rank_key(s, 0) >> 32);
}

// Blocks per SM the register budget aims at (V <= 4: four; larger V keep
// their slots in registers rather than spill).
template <int V>
constexpr int fast_min_blocks() {
  return V <= 4 ? 4 : (V <= 8 ? 2 : 1);
}

template <int V>
__global__ void __launch_bounds__(kFastThreads, fast_min_blocks<V>())
    route_fast_kernel(RouteParams p) {
  extern __shared__ uint32_t fsm[];
  const int E = p.num_experts, K = p.topk, G = p.num_groups;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int stride = E + kWarpSize;  // words per warp row (a swizzle's room)
  int32_t* count = reinterpret_cast<int32_t*>(fsm);
  float* z_warp = reinterpret_cast<float*>(fsm + E);
  int32_t* bad_warp = reinterpret_cast<int32_t*>(fsm + E + kFastWarps);
  uint32_t* rows = fsm + E + 2 * kFastWarps;  // [kFastWarps][stride]
  uint32_t* key_row = rows + warp * stride;   // this warp's key words (groups)
  constexpr unsigned kAll = 0xffffffffu;

  if (blockIdx.x == 0 && threadIdx.x == 0) *p.ticket = 0;
  for (int e = threadIdx.x; e < E; e += kFastThreads) count[e] = 0;
  __syncthreads();

  uint32_t active = 0;  // bit j: this lane's slot j is an expert
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (lane + kWarpSize * j < E) active |= 1u << j;
  auto is_active = [&](int j) { return ((active >> j) & 1u) != 0; };

  // Groups of a power-of-two size <= 32 ("lane groups"): group g of slot j
  // is (lane + 32 j) >> log2(per), the lanes of a group one aligned segment
  // of a slot. Other sizes ("row groups"): L lanes per group (lane: group
  // lane / L, part lane % L) scan the group's keys in the warp's shared row,
  // stored at e + group * L (no bank conflicts when per % 32 == 0).
  int per = 1, shift = 0, take = 0, L = 1, my_group = 0, my_part = 0;
  bool lane_groups = false;
  uint32_t gbit[(V + 3) / 4] = {};  // row groups: ballot bit (group * L) of each slot
  if (G > 0) {
    per = E / G;
    take = K / p.group_topk;
    lane_groups = per <= kWarpSize && (per & (per - 1)) == 0;
    shift = 31 - __clz(per);
    if (!lane_groups) {
      L = 1 << (31 - __clz(kWarpSize / G));
      my_group = lane / L;
      my_part = lane % L;
      const float inv_per = 1.0f / static_cast<float>(per);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        // floor(e / per), exact for e < 2^10 (a quotient's distance to an
        // integer is >= 0.5 / per).
        const int e = lane + kWarpSize * j;
        const uint32_t g = static_cast<uint32_t>((static_cast<float>(e) + 0.5f) * inv_per);
        gbit[j / 4] |= (is_active(j) ? g * L : 0u) << (8 * (j % 4));
      }
    }
  }

  float colsum[V], bias[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    colsum[j] = 0.0f;
    bias[j] = p.bias && is_active(j) ? p.bias[lane + kWarpSize * j] : 0.0f;
  }
  float z_acc = 0.0f;
  int32_t bad_count = 0;
  const bool need_soft = (p.softmax && (p.pre_softmax || p.aux)) || p.z;
  const bool soft_k = p.softmax && !p.pre_softmax;  // probs: softmax over the K slots
  const int64_t T = p.num_tokens;

  // The next token's logits and padding flag are loaded while the current
  // one is routed.
  float next[V];
  bool next_pad = false;
  int64_t t = int64_t{blockIdx.x} * kFastWarps * p.tokens_per_warp + warp;
  if (t < T) {
#pragma unroll
    for (int j = 0; j < V; ++j)
      next[j] = is_active(j) ? p.logits[t * E + lane + kWarpSize * j] : -INFINITY;
    next_pad = p.mask && p.mask[t];
  }
  for (int i = 0; i < p.tokens_per_warp && t < T; ++i, t += kFastWarps) {
    float x[V];
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = next[j];
    const bool pad = next_pad;
    const int64_t tn = t + kFastWarps;
    if (i + 1 < p.tokens_per_warp && tn < T) {
#pragma unroll
      for (int j = 0; j < V; ++j)
        next[j] = is_active(j) ? p.logits[tn * E + lane + kWarpSize * j] : -INFINITY;
      next_pad = p.mask && p.mask[tn];
    }
    if (pad) {  // padding: not routed (warp-uniform)
      if (lane < K) {
        p.ids[t * K + lane] = -1;
        p.probs[t * K + lane] = 0.0f;
      }
      continue;
    }

    // Step 1: sanitized logits (inactive slots: -inf), row max, non-finite flag.
    float m = -INFINITY;
    bool bad = false;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      bad |= is_active(j) && !isfinite(x[j]);
      x[j] = rm::sanitize(x[j]);
      m = fmaxf(m, x[j]);
    }
    m = warp_max_flat(m);
    bad_count += __any_sync(kAll, bad) ? 1 : 0;

    // Step 2: scores (val), rank keys of the routing scores (inactive: 0),
    // the losses' per-token terms. The full softmax only where read.
    float ex[V];
    float part = 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      ex[j] = 0.0f;
      if (need_soft && is_active(j)) {
        ex[j] = exp_exact_flat(x[j] - m);
        part = part + ex[j];
      }
    }
    const float sum_ex = need_soft ? warp_sum(part) : 0.0f;
    float val[V];
    float sig_part = 0.0f;
    if (p.softmax) {
#pragma unroll
      for (int j = 0; j < V; ++j) val[j] = p.pre_softmax ? ex[j] / sum_ex : x[j];
    } else {
      bool slow = false;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = 1.0f + exp_exact_flat(-x[j]);
        slow |= is_active(j) && !rcp_fast_ok(d);
        val[j] = rcp_fast(d);
      }
      if (slow) {  // rare (logits below about -87.3): the division itself
#pragma unroll
        for (int j = 0; j < V; ++j) val[j] = rm::sigmoid_exact(x[j]);
      }
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (is_active(j)) sig_part = sig_part + val[j];
    }
    uint64_t key[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = lane + kWarpSize * j;
      float k = val[j];
      if (p.bias) k = k + bias[j];
      key[j] = is_active(j) ? rm::rank_key(k, e) : 0;
    }
    if (p.aux) {
      // The aux-loss scores: the full softmax, or the sigmoid scores over
      // their sum (+ eps).
      const float inv = 1.0f / (p.softmax ? sum_ex : warp_sum(sig_part) + rm::kRenormEps);
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (is_active(j))
          colsum[j] += p.softmax ? (p.pre_softmax ? val[j] : ex[j] * inv) : val[j] * inv;
    }
    if (p.z) {
      const float lse = m + logf(sum_ex);
      z_acc += lse * lse;
    }

    // Step 3: group limits. A group's score: its top `take` routing scores
    // added best first from 0 (key_score of the winners); then group_topk
    // rounds of a warp arg-max over the groups' keys give the threshold, a
    // ballot the allowed groups, and the others' keys become 0.
    if (G > 0) {
      uint32_t allowed;
      if (lane_groups) {
        float gs[V];
        uint64_t gprev[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          gs[j] = 0.0f;
          gprev[j] = ~uint64_t{0};
        }
        for (int r = 0; r < take; ++r) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            uint64_t c = key[j] < gprev[j] ? key[j] : 0;
            if (per == kWarpSize) {
              c = warp_best(c);
            } else {
              for (int o = per / 2; o > 0; o /= 2) {
                const uint64_t other = __shfl_xor_sync(kAll, c, o);
                c = other > c ? other : c;
              }
            }
            gs[j] = gs[j] + key_score(c);
            gprev[j] = c;
          }
        }
        // Lane g < G fetches group g's score word from its first lane.
        const int first = lane << shift;  // group `lane`'s first expert
        uint32_t word = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const uint32_t w = __shfl_sync(kAll, score_word(gs[j]), first & (kWarpSize - 1));
          if (j == first / kWarpSize) word = w;
        }
        const uint64_t gkey =
            lane < G ? (static_cast<uint64_t>(word) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(lane))
                     : 0;
        uint64_t threshold = ~uint64_t{0};
        for (int r = 0; r < p.group_topk; ++r) threshold = warp_best(gkey < threshold ? gkey : 0);
        allowed = __ballot_sync(kAll, lane < G && gkey >= threshold);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const uint32_t g = static_cast<uint32_t>(lane + kWarpSize * j) >> shift;
          if (is_active(j) && !((allowed >> (g & 31u)) & 1u)) key[j] = 0;
        }
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const uint32_t b = (gbit[j / 4] >> (8 * (j % 4))) & 0xFFu;
          if (is_active(j)) key_row[lane + kWarpSize * j + b] = static_cast<uint32_t>(key[j] >> 32);
        }
        __syncwarp();
        const bool in_group = my_group < G;
        uint64_t prev = ~uint64_t{0};
        float s = 0.0f;
        for (int r = 0; r < take; ++r) {
          uint64_t best = 0;
          if (in_group)
            for (int e = my_group * per + my_part; e < (my_group + 1) * per; e += L) {
              const uint64_t k = (static_cast<uint64_t>(key_row[e + my_group * L]) << 32) |
                                 (0xFFFFFFFFu - static_cast<uint32_t>(e));
              if (k < prev && k > best) best = k;
            }
          for (int o = L / 2; o > 0; o /= 2) {
            const uint64_t other = __shfl_xor_sync(kAll, best, o);
            best = other > best ? other : best;
          }
          s = s + key_score(best);  // best first, as the CPU adds them
          prev = best;
        }
        __syncwarp();  // the key row is read before the next token writes it
        const uint64_t gkey = in_group ? rm::rank_key(s, my_group) : 0;
        uint64_t threshold = ~uint64_t{0};
        for (int r = 0; r < p.group_topk; ++r) threshold = warp_best(gkey < threshold ? gkey : 0);
        allowed = __ballot_sync(kAll, in_group && my_part == 0 && gkey >= threshold);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const uint32_t b = (gbit[j / 4] >> (8 * (j % 4))) & 0xFFu;
          if (!((allowed >> b) & 1u)) key[j] = 0;
        }
      }
    }

    // Step 4: top-k, best first; lane j keeps slot j's id.
    uint64_t h1 = 0, h2 = 0;
#pragma unroll
    for (int j = 0; j < V; ++j) top2_insert(h1, h2, key[j]);
    bool h2_known = true;
    int my_id = 0;
    for (int r = 0; r < K; ++r) {
      const uint64_t w = warp_best(h1);
      const int id = rm::rank_key_id(w);
      if (lane == r) my_id = id;
      if (lane == (id & (kWarpSize - 1))) {
        if (h2_known) {
          h1 = h2;
          h2_known = false;
        } else {  // this lane's next two below w
          h1 = 0;
          h2 = 0;
#pragma unroll
          for (int j = 0; j < V; ++j)
            if (key[j] < w) top2_insert(h1, h2, key[j]);
          h2_known = true;
        }
      }
    }
    const int64_t slot = t * K + lane;
    if (lane < K) {
      p.ids[slot] = my_id;
      atomicAdd(&count[my_id], 1);  // integer: order does not matter
    }

    // Step 5: probabilities of the chosen slots (lane j: slot j).
    float v = 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float o = __shfl_sync(kAll, val[j], my_id & (kWarpSize - 1));
      if (j == my_id / kWarpSize) v = o;
    }
    float mk = -INFINITY;
    if (soft_k) mk = warp_max_flat(lane < K ? fmaxf(-INFINITY, v) : -INFINITY);
    const float term = soft_k ? rm::exp_exact(v - mk) : v;
    float s = 0.0f;
    if (soft_k || (!p.softmax && K > 1)) {
      float s_part = 0.0f;
      if (lane < K) s_part = s_part + term;
      s = warp_sum(s_part);
    }
    if (lane < K) {
      float prob = v;
      if (soft_k)
        prob = term / s;
      else if (!p.softmax && K > 1)
        prob = v / (s + rm::kRenormEps);
      p.probs[slot] = prob * p.scale;
    }
  }

  // Step 6: this block's partials, warps combined in warp order.
  __syncthreads();  // the key rows are free
  float* colsum_rows = reinterpret_cast<float*>(rows);
  if (p.aux) {
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (is_active(j)) colsum_rows[warp * stride + lane + kWarpSize * j] = colsum[j];
  }
  if (lane == 0) {
    z_warp[warp] = z_acc;
    bad_warp[warp] = bad_count;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kFastThreads) {
    if (p.aux) {
      float c = 0.0f;
      for (int w = 0; w < kFastWarps; ++w) c = c + colsum_rows[w * stride + e];
      p.part_colsum[int64_t{blockIdx.x} * E + e] = c;
    }
    p.part_count[int64_t{blockIdx.x} * E + e] = count[e];
  }
  if (threadIdx.x == 0) {
    float z = 0.0f;
    int32_t b = 0;
    for (int w = 0; w < kFastWarps; ++w) {
      z = z + z_warp[w];
      b += bad_warp[w];
    }
    p.part_z[blockIdx.x] = z;
    p.part_nonfinite[blockIdx.x] = b;
  }
}

}  // namespace moeflow::cuda::router_route
