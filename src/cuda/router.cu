// CUDA router: forward (selection, probabilities, counts, losses) and
// backward, and the expert-bias update.
//
// Forward, two kernels:
//   route_kernel:    one warp per token; the token's scores and routing
//                    scores sit in shared memory (lane l owns experts
//                    l, l+32, ...). Groups: one lane per group sums its top
//                    (K / group_topk) routing scores; the group_topk best
//                    groups are found by K-free repeated warp arg-max. Top-k:
//                    K rounds of a warp arg-max over rank keys (score, then
//                    lower id), each round taking the best key below the
//                    previous one, so nothing is marked or sorted. Each block
//                    owns a fixed range of tokens and writes its per-expert
//                    partial counts and aux-loss column sums (warps combined in
//                    warp order) and its z-loss and non-finite partials.
//   finalize_kernel: one block sums the block partials in block order:
//                    tokens_per_expert, aux_loss, z_loss, nonfinite.
// Backward: one warp per token recomputes the token's forward quantities and
// writes its dlogits row (no shared state between tokens).
// The scores use core/router_math.h, which the CPU reference shares, so both
// backends choose the same experts. No host sync, no allocation, no float
// atomics; sizes come from shapes (graph safe).
#include <cmath>

#include "core/backends.h"
#include "core/router_math.h"
#include "cuda/common.cuh"

namespace moeflow::cuda {
namespace {

namespace rm = router_math;

constexpr int kMaxWarps = 8;
constexpr int kTokensPerWarp = 8;  // tokens a warp handles in route_kernel
constexpr int kFinalThreads = 256;
constexpr size_t kSharedBudget = 40 << 10;  // dynamic shared memory of route_kernel
constexpr size_t kAlign = 256;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m /= 2) v = v + __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m /= 2) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o > v ? o : v;
  }
  return v;
}

struct RouteParams {
  const float* logits;
  const float* bias;  // [E] or null
  int32_t* ids;
  float* probs;
  int64_t num_tokens;
  int num_experts, topk;
  bool softmax, pre_softmax;
  int num_groups, group_topk;
  float scale;
  bool aux, z;
  // Per-block partials (workspace).
  float* part_colsum;       // [blocks, E]
  int32_t* part_count;      // [blocks, E]
  float* part_z;            // [blocks]
  int32_t* part_nonfinite;  // [blocks]
};

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

struct Workspace {
  float* part_colsum;
  int32_t* part_count;
  float* part_z;
  int32_t* part_nonfinite;
  size_t bytes;
};

size_t align_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

Workspace carve(void* base, int64_t blocks, int E) {
  auto* p = static_cast<uint8_t*>(base);
  Workspace w{};
  size_t off = 0;
  w.part_colsum = reinterpret_cast<float*>(p + off);
  off = align_up(off + sizeof(float) * blocks * E);
  w.part_count = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * blocks * E);
  w.part_z = reinterpret_cast<float*>(p + off);
  off = align_up(off + sizeof(float) * blocks);
  w.part_nonfinite = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * blocks);
  w.bytes = off;
  return w;
}

int64_t route_blocks(int64_t T, int warps) {
  return ceil_div(T, int64_t{warps} * kTokensPerWarp);
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
  const float* part_colsum;
  const int32_t* part_count;
  const float* part_z;
  const int32_t* part_nonfinite;
  int64_t blocks;
  int num_experts;
  int32_t* tokens_per_expert;
  float* aux_loss;     // or null
  float* z_loss;       // or null
  int32_t* nonfinite;  // or null
  float aux_factor;    // E * coeff / (K * T * T), 0 when not computed
  float z_factor;      // coeff / T, 0 when not computed
};

__global__ void __launch_bounds__(kFinalThreads) finalize_kernel(FinalizeParams p) {
  __shared__ float red[kFinalThreads];
  const int E = p.num_experts;
  float acc = 0.0f;
  for (int e = threadIdx.x; e < E; e += kFinalThreads) {
    float c = 0.0f;
    int32_t n = 0;
    for (int64_t b = 0; b < p.blocks; ++b) {
      c = c + p.part_colsum[b * E + e];
      n += p.part_count[b * E + e];
    }
    p.tokens_per_expert[e] = n;
    acc = acc + c * static_cast<float>(n);
  }
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kFinalThreads / 2; half >= 1; half /= 2) {
    if (threadIdx.x < half) red[threadIdx.x] = red[threadIdx.x] + red[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float z = 0.0f;
    int32_t bad = 0;
    for (int64_t b = 0; b < p.blocks; ++b) {
      z = z + p.part_z[b];
      bad += p.part_nonfinite[b];
    }
    if (p.aux_loss) *p.aux_loss = p.aux_factor != 0.0f ? red[0] * p.aux_factor : 0.0f;
    if (p.z_loss) *p.z_loss = p.z_factor != 0.0f ? z * p.z_factor : 0.0f;
    if (p.nonfinite) *p.nonfinite = bad;
  }
}

struct BackwardParams {
  const float* logits;
  const int32_t* ids;
  const int32_t* counts;  // or null
  const float* dprobs;
  const float* daux;  // or null
  const float* dz;    // or null
  float* dlogits;
  int64_t num_tokens;
  int num_experts, topk;
  bool softmax, pre_softmax;
  float scale;
  float aux_factor;  // E * coeff / (K * T * T), 0 when off
  float z_factor;    // coeff / T, 0 when off
};

__global__ void __launch_bounds__(kMaxWarps* kWarpSize) backward_kernel(BackwardParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = int64_t{blockIdx.x} * kMaxWarps + threadIdx.x / kWarpSize;
  if (t >= p.num_tokens) return;
  const int E = p.num_experts, K = p.topk;
  const float* row = p.logits + t * E;
  const int32_t* ids = p.ids + t * K;
  const float* g = p.dprobs + t * K;
  const float g_aux = p.daux && p.aux_factor != 0.0f ? *p.daux * p.aux_factor : 0.0f;
  const float g_z = p.dz && p.z_factor != 0.0f ? *p.dz * p.z_factor : 0.0f;
  auto valid = [&](int j) { return ids[j] >= 0 && ids[j] < E; };
  auto w_of = [&](int e) { return g_aux != 0.0f ? g_aux * static_cast<float>(p.counts[e]) : 0.0f; };

  // Step 1: row max, softmax denominator, sigmoid sum.
  float m = -INFINITY;
  for (int e = lane; e < E; e += kWarpSize) m = fmaxf(m, rm::sanitize(row[e]));
  m = warp_max(m);
  float ex_part = 0.0f, sig_part = 0.0f;
  for (int e = lane; e < E; e += kWarpSize) {
    const float x = rm::sanitize(row[e]);
    ex_part += expf(x - m);
    sig_part += 1.0f / (1.0f + expf(-x));
  }
  const float sum_ex = warp_sum(ex_part);
  const float sig_d = warp_sum(sig_part) + rm::kRenormEps;

  // Step 2: the slot terms' dot products.
  //   softmax:     mk, sk: softmax over the chosen logits; dot = sum p~ g
  //   pre_softmax: dot = sum_j soft[id_j] * scale * g_j   (= <soft, dS>)
  //   sigmoid:     sk = sum of chosen sigmoids + eps; dot = sum p~ g
  float mk = -INFINITY;
  for (int j = lane; j < K; j += kWarpSize)
    if (valid(j)) mk = fmaxf(mk, rm::sanitize(row[ids[j]]));
  mk = warp_max(mk);
  float sk_part = 0.0f;
  for (int j = lane; j < K; j += kWarpSize) {
    if (!valid(j)) continue;
    const float x = rm::sanitize(row[ids[j]]);
    sk_part += p.softmax ? expf(x - mk) : 1.0f / (1.0f + expf(-x));
  }
  const float sk = warp_sum(sk_part) + (p.softmax ? 0.0f : rm::kRenormEps);
  float dot_part = 0.0f;
  for (int j = lane; j < K; j += kWarpSize) {
    if (!valid(j)) continue;
    const float x = rm::sanitize(row[ids[j]]);
    float q;
    if (p.softmax)
      q = p.pre_softmax ? expf(x - m) / sum_ex * p.scale : expf(x - mk) / sk;
    else
      q = (1.0f / (1.0f + expf(-x))) / sk;
    dot_part += q * g[j];
  }
  const float dot = warp_sum(dot_part);

  // Step 3: the aux loss's dot product <s, w>.
  float adot_part = 0.0f;
  if (g_aux != 0.0f)
    for (int e = lane; e < E; e += kWarpSize) {
      const float x = rm::sanitize(row[e]);
      const float s = p.softmax ? expf(x - m) / sum_ex : (1.0f / (1.0f + expf(-x))) / sig_d;
      adot_part += s * w_of(e);
    }
  const float adot = warp_sum(adot_part);
  const float lse = isinf(m) ? m : m + logf(sum_ex);

  // Step 4: each lane's experts.
  for (int e = lane; e < E; e += kWarpSize) {
    const float x = rm::sanitize(row[e]);
    const float soft = expf(x - m) / sum_ex;
    const float sig = 1.0f / (1.0f + expf(-x));
    float d_slot = 0.0f;  // sum of g_j over the slots that chose e
    bool chosen = false;
    for (int j = 0; j < K; ++j) {
      if (ids[j] != e) continue;
      d_slot += g[j];
      chosen = true;
    }
    float dl = 0.0f;
    if (p.softmax) {
      if (p.pre_softmax)
        dl += soft * (p.scale * d_slot - dot);
      else if (chosen)
        dl += p.scale * (expf(x - mk) / sk) * (d_slot - dot);
      if (g_aux != 0.0f) dl += soft * (w_of(e) - adot);
    } else {
      float dsig = 0.0f;
      if (chosen) dsig = K > 1 ? p.scale * (d_slot - dot) / sk : p.scale * d_slot;
      if (g_aux != 0.0f) dsig += (w_of(e) - adot) / sig_d;
      dl += dsig * sig * (1.0f - sig);
    }
    if (g_z != 0.0f) dl += g_z * 2.0f * lse * soft;
    p.dlogits[t * E + e] = dl;
  }
}

__global__ void update_bias_kernel(const int32_t* counts, float* bias, int E, float rate) {
  __shared__ long long red[kFinalThreads];
  long long s = 0;
  for (int e = threadIdx.x; e < E; e += kFinalThreads) s += counts[e];
  red[threadIdx.x] = s;
  __syncthreads();
  for (int half = kFinalThreads / 2; half >= 1; half /= 2) {
    if (threadIdx.x < half) red[threadIdx.x] += red[threadIdx.x + half];
    __syncthreads();
  }
  const double mean = static_cast<double>(red[0]) / E;
  for (int e = threadIdx.x; e < E; e += kFinalThreads) {
    const double off = mean - counts[e];
    const float sign = off > 0 ? 1.0f : (off < 0 ? -1.0f : 0.0f);
    bias[e] = bias[e] + rate * sign;
  }
}

// d(aux_loss) / d(sum_t s[t,e] * count[e]) and d(z_loss) / d(lse_t^2); 0 when off.
float aux_factor(const RouterConfig& c, int64_t T) {
  const double Td = static_cast<double>(T);
  return T > 0 ? static_cast<float>(static_cast<double>(c.num_experts) * c.aux_loss_coeff /
                                    (c.topk * Td * Td))
               : 0.0f;
}
float z_factor(const RouterConfig& c, int64_t T) {
  return T > 0 ? static_cast<float>(c.z_loss_coeff / static_cast<double>(T)) : 0.0f;
}

}  // namespace

size_t router_workspace_bytes(int64_t num_tokens, const RouterConfig& c) {
  const int warps = route_warps(c.num_experts, c.num_groups);
  return carve(nullptr, route_blocks(num_tokens, warps), c.num_experts).bytes;
}

void router_forward(TensorView logits, const RouterConfig& c, const RouterOutputs& out,
                    TensorView expert_bias, TensorView workspace, cudaStream_t stream) {
  const int64_t T = logits.shape[0];
  const int E = c.num_experts, K = c.topk;
  const int warps = route_warps(E, c.num_groups);
  const int64_t blocks = route_blocks(T, warps);
  const Workspace ws = carve(workspace.data, blocks, E);
  const bool softmax = c.score_function == ScoreFunction::kSoftmax;
  if (blocks > 0) {
    RouteParams p{};
    p.logits = logits.data_ptr<float>();
    p.bias = expert_bias.defined() ? expert_bias.data_ptr<float>() : nullptr;
    p.ids = out.topk_ids.data_ptr<int32_t>();
    p.probs = out.probs.data_ptr<float>();
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
    p.part_colsum = ws.part_colsum;
    p.part_count = ws.part_count;
    p.part_z = ws.part_z;
    p.part_nonfinite = ws.part_nonfinite;
    const size_t shared = RouteShared{warps, E, c.num_groups}.bytes();
    MOEFLOW_CHECK(shared <= 48 << 10, "router: num_experts=", E, " with num_groups=", c.num_groups,
                  " needs ", shared,
                  " bytes of shared memory; the CUDA router supports up to 49152 "
                  "(about 2400 experts)");
    MOEFLOW_CHECK(blocks <= 0x7FFFFFFF, "router: too many tokens (", T, ")");
    route_kernel<<<static_cast<unsigned>(blocks), warps * kWarpSize, shared, stream>>>(p);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
  FinalizeParams f{};
  f.part_colsum = ws.part_colsum;
  f.part_count = ws.part_count;
  f.part_z = ws.part_z;
  f.part_nonfinite = ws.part_nonfinite;
  f.blocks = blocks;
  f.num_experts = E;
  f.tokens_per_expert = out.tokens_per_expert.data_ptr<int32_t>();
  f.aux_loss = out.aux_loss.defined() ? out.aux_loss.data_ptr<float>() : nullptr;
  f.z_loss = out.z_loss.defined() ? out.z_loss.data_ptr<float>() : nullptr;
  f.nonfinite = out.nonfinite.defined() ? out.nonfinite.data_ptr<int32_t>() : nullptr;
  f.aux_factor = aux_factor(c, T);
  f.z_factor = z_factor(c, T);
  finalize_kernel<<<1, kFinalThreads, 0, stream>>>(f);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void router_backward(TensorView logits, TensorView topk_ids, TensorView tokens_per_expert,
                     const RouterGrads& grads, const RouterConfig& c, TensorView dlogits,
                     cudaStream_t stream) {
  const int64_t T = logits.shape[0];
  if (T == 0) return;
  BackwardParams p{};
  p.logits = logits.data_ptr<float>();
  p.ids = topk_ids.data_ptr<int32_t>();
  p.counts = tokens_per_expert.defined() ? tokens_per_expert.data_ptr<int32_t>() : nullptr;
  p.dprobs = grads.dprobs.data_ptr<float>();
  p.daux = grads.daux_loss.defined() ? grads.daux_loss.data_ptr<float>() : nullptr;
  p.dz = grads.dz_loss.defined() ? grads.dz_loss.data_ptr<float>() : nullptr;
  p.dlogits = dlogits.data_ptr<float>();
  p.num_tokens = T;
  p.num_experts = c.num_experts;
  p.topk = c.topk;
  p.softmax = c.score_function == ScoreFunction::kSoftmax;
  p.pre_softmax = c.pre_softmax;
  p.scale = rm::effective_scale(c.topk_scaling_factor);
  p.aux_factor = p.counts ? aux_factor(c, T) : 0.0f;
  p.z_factor = z_factor(c, T);
  const int64_t blocks = ceil_div(T, kMaxWarps);
  MOEFLOW_CHECK(blocks <= 0x7FFFFFFF, "router: too many tokens (", T, ")");
  backward_kernel<<<static_cast<unsigned>(blocks), kMaxWarps * kWarpSize, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void router_update_expert_bias(TensorView tokens_per_expert, TensorView expert_bias, float rate,
                               cudaStream_t stream) {
  const int64_t E = tokens_per_expert.shape[0];
  if (E == 0) return;
  update_bias_kernel<<<1, kFinalThreads, 0, stream>>>(tokens_per_expert.data_ptr<int32_t>(),
                                                      expert_bias.data_ptr<float>(),
                                                      static_cast<int>(E), rate);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda
