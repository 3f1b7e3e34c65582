// CUDA router backward: one warp per token recomputes the token's forward
// quantities (row max, softmax denominator, sigmoid sum, the chosen slots'
// normalisation) and writes its dlogits row (no shared state between tokens).
//   backward_fast_kernel (E <= 512, K <= 32), templated on the score
//     function and V in {1,2,4,8,16} (the least with 32 V >= E): the row is
//     read once into registers (lane l owns experts l + 32 j, coalesced),
//     only the functions the score function needs are computed (sigmoid:
//     one expf per element; softmax: exp(x - m) kept per element; exp(x - m)
//     for sigmoid only with the z loss), and the warp's sums are reduced
//     together. Slot k sits in lane k
//     (id, dprob, its logit/score fetched from the owner lane by shuffle);
//     each chosen expert's slot term is written by the first slot choosing
//     it into the warp's shared row (zero elsewhere), which the owner adds
//     while writing its elements (one coalesced store each).
//   backward_kernel (any E, K): the same quantities, the row read from
//     global memory in several passes.
// Repeated ids in a row act as separate slots (the CPU reference's sums).
// The aux losses' weights w[e] = d(loss)/d(s[t,e]): the aux loss's
// g * factor * tokens_per_expert[e], plus the sequence aux loss's
// g * E * coeff / (K * S * L^2) * seq_tokens_per_expert[seq(t), e].
// Padding rows are written as 0. Each row is summed in a fixed order by one
// warp: bitwise deterministic. No host sync; graph safe.
#include <cmath>

#include "core/backends.h"
#include "core/router_backend.h"
#include "core/router_math.h"
#include "cuda/common.cuh"
#include "cuda/router_common.cuh"

namespace moeflow::cuda {
namespace {

namespace rm = router_math;
using router_detail::aux_factor_of;
using router_detail::warp_max;
using router_detail::warp_sum;
using router_detail::warp_sum_ll;
using router_detail::z_factor_of;

constexpr int kWarps = 8;  // tokens per block
constexpr unsigned kAll = 0xffffffffu;
constexpr int kMaxFastV = 16;  // the fast kernel's largest E: 16 * 32

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
  // Padding mask: padding rows get dlogits 0; the factors come from the
  // device count T = sum(counts) / K and the coefficients.
  const uint8_t* mask;  // or null
  float aux_coeff, z_coeff;
  // seq_aux_loss (seq_counts null when off).
  const int32_t* cu;          // [S+1]
  const int32_t* seq_counts;  // [S,E]
  const float* dseq;          // or null
  int64_t num_sequences;
  float seq_coeff;
};

// The token's loss gradients: g_aux * counts[e] + g_seq * seq_row[e] = w[e]
// (the aux losses), g_z (the z loss).
struct LossGrads {
  float g_aux = 0.0f, g_z = 0.0f, g_seq = 0.0f;
  const int32_t* seq_row = nullptr;  // [E] or null
  __device__ bool any_w() const { return g_aux != 0.0f || g_seq != 0.0f; }
  __device__ float w(const BackwardParams& p, int e) const {
    float v = g_aux != 0.0f ? g_aux * static_cast<float>(p.counts[e]) : 0.0f;
    if (g_seq != 0.0f) v += g_seq * static_cast<float>(seq_row[e]);
    return v;
  }
};

// Whether the kernels need tokens_per_expert: the aux loss's weights or the
// padding mask's token count.
__device__ __forceinline__ bool uses_counts(const BackwardParams& p) {
  return p.counts && (p.mask || p.aux_factor != 0.0f);
}

// g_aux and g_z of a (non-padding) token; count_part: this lane's part of
// sum(counts) (read only with a padding mask). Warp-collective.
__device__ __forceinline__ void loss_factors(const BackwardParams& p, long long count_part,
                                             LossGrads& lg) {
  const int E = p.num_experts, K = p.topk;
  float aux_factor = p.aux_factor, z_factor = p.z_factor;
  if (p.mask) {  // the real tokens: sum(counts) / K
    const int64_t real = warp_sum_ll(count_part) / K;
    aux_factor = p.aux_coeff != 0.0f && p.counts ? aux_factor_of(E, K, p.aux_coeff, real) : 0.0f;
    z_factor = p.z_coeff != 0.0f ? z_factor_of(p.z_coeff, real) : 0.0f;
  }
  lg.g_aux = p.daux && aux_factor != 0.0f ? *p.daux * aux_factor : 0.0f;
  lg.g_z = p.dz && z_factor != 0.0f ? *p.dz * z_factor : 0.0f;
}

// The sequence counts row of token t, or null when seq_aux_loss is off.
__device__ __forceinline__ const int32_t* seq_row_of(const BackwardParams& p, int64_t t) {
  if (!p.seq_counts || !p.dseq) return nullptr;
  return p.seq_counts +
         router_detail::sequence_of(p.cu, p.num_sequences, p.num_tokens, t) * p.num_experts;
}

// seq_aux_loss: d/d(s[t,e]) = g * E * coeff / (K * S * L^2) * c[seq(t), e],
// L = sum_e c / K; seq_part: this lane's part of the row sum. Warp-collective.
__device__ __forceinline__ float seq_grad(const BackwardParams& p, long long seq_part) {
  const int E = p.num_experts, K = p.topk;
  const int64_t L = warp_sum_ll(seq_part) / K;
  if (L <= 0 || p.seq_coeff == 0.0f) return 0.0f;
  const double Ld = static_cast<double>(L);
  return *p.dseq * static_cast<float>(static_cast<double>(E) * p.seq_coeff /
                                      (K * static_cast<double>(p.num_sequences) * Ld * Ld));
}

// ---------------------------------------------------------------------------
// Fast path: the row in registers.

enum class Score { kSoftmax, kPreSoftmax, kSigmoid };

// N sums / maxima reduced together (the butterfly of warp_sum / warp_max).
template <int N>
__device__ __forceinline__ void warp_sum_n(float (&v)[N]) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m /= 2)
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = v[i] + __shfl_xor_sync(kAll, v[i], m);
}
template <int N>
__device__ __forceinline__ void warp_max_n(float (&v)[N]) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m /= 2)
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = fmaxf(v[i], __shfl_xor_sync(kAll, v[i], m));
}

// a[] of the lane owning expert id (id >> 5 in lane id & 31); 0 where
// !valid. Warp-collective.
template <int V>
__device__ __forceinline__ float fetch_owned(const float (&a)[V], int id, bool valid) {
  const int src = valid ? id % kWarpSize : 0, r = valid ? id / kWarpSize : -1;
  float out = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float v = __shfl_sync(kAll, a[j], src);
    if (j == r) out = v;
  }
  return out;
}

template <int V, Score S>
__global__ void __launch_bounds__(kWarps* kWarpSize, V >= 16 ? 2 : 4)
    backward_fast_kernel(BackwardParams p) {
  // Per warp: each chosen expert's slot term (0 for the others).
  __shared__ float slot_terms[kWarps][V * kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t t = int64_t{blockIdx.x} * kWarps + warp;
  if (t >= p.num_tokens) return;  // the whole warp
  const int E = p.num_experts, K = p.topk;
  float* out = p.dlogits + t * E;
  if (p.mask && p.mask[t]) {  // padding
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (lane + j * kWarpSize < E) out[lane + j * kWarpSize] = 0.0f;
    return;
  }
  // The row (lane owns e = lane + 32 j; -inf beyond E), the slots (lane k:
  // slot k), the counts.
  const float* row = p.logits + t * E;
  float x[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = lane + j * kWarpSize;
    x[j] = e < E ? rm::sanitize(row[e]) : -INFINITY;
  }
  int id = -1;
  float g = 0.0f;
  if (lane < K) {
    id = p.ids[t * K + lane];
    g = p.dprobs[t * K + lane];
  }
  const bool valid = lane < K && id >= 0 && id < E;
  int cnt[V];
  long long count_part = 0;
  const bool counts = uses_counts(p);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = lane + j * kWarpSize;
    cnt[j] = counts && e < E ? p.counts[e] : 0;
    count_part += cnt[j];
  }
  float* terms = slot_terms[warp];
#pragma unroll
  for (int j = 0; j < V; ++j) terms[lane + j * kWarpSize] = 0.0f;

  LossGrads lg;
  loss_factors(p, count_part, lg);
  lg.seq_row = seq_row_of(p, t);
  int seq_cnt[V];
  long long seq_part = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = lane + j * kWarpSize;
    seq_cnt[j] = lg.seq_row && e < E ? lg.seq_row[e] : 0;
    seq_part += seq_cnt[j];
  }
  if (lg.seq_row) lg.g_seq = seq_grad(p, seq_part);
  const bool any_w = lg.any_w();
  float w[V];  // the aux losses' weights (LossGrads::w)
#pragma unroll
  for (int j = 0; j < V; ++j) {
    w[j] = lg.g_aux != 0.0f ? lg.g_aux * static_cast<float>(cnt[j]) : 0.0f;
    if (lg.g_seq != 0.0f) w[j] += lg.g_seq * static_cast<float>(seq_cnt[j]);
  }
  const bool z = lg.g_z != 0.0f;

  // Per element: q = exp(x - m) (softmax) or sigmoid(x) (sigmoid); ez = exp(x - m)
  // for the z loss of sigmoid.
  float q[V], ez[V];
  float m = -INFINITY;
  float slot_num = 0.0f;  // the slot's numerator in its normalisation
  // sums[]: 0 the row's denominator, 1 <q, w>, 2 the slots' denominator,
  // 3 the slots' <q, g>, 4 (sigmoid) sum exp(x - m).
  float sums[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if constexpr (S == Score::kSigmoid) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      q[j] = lane + j * kWarpSize < E ? __frcp_rn(1.0f + expf(-x[j])) : 0.0f;
      sums[0] += q[j];
      sums[1] += q[j] * w[j];
    }
    slot_num = fetch_owned<V>(q, id, valid);
    if (z) {
#pragma unroll
      for (int j = 0; j < V; ++j) m = fmaxf(m, x[j]);
      m = warp_max(m);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        ez[j] = lane + j * kWarpSize < E ? expf(x[j] - m) : 0.0f;
        sums[4] += ez[j];
      }
    }
  } else {
    // Softmax over the chosen needs their max mk; pre_softmax reads exp(x - m).
    const float xk = S == Score::kSoftmax ? fetch_owned<V>(x, id, valid) : 0.0f;
    float mx[2] = {-INFINITY, valid ? xk : -INFINITY};
#pragma unroll
    for (int j = 0; j < V; ++j) mx[0] = fmaxf(mx[0], x[j]);
    warp_max_n(mx);
    m = mx[0];
    const bool soft = S == Score::kPreSoftmax || any_w || z;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      q[j] = soft && lane + j * kWarpSize < E ? expf(x[j] - m) : 0.0f;
      sums[0] += q[j];
      sums[1] += q[j] * w[j];
    }
    if constexpr (S == Score::kSoftmax)
      slot_num = valid ? expf(xk - mx[1]) : 0.0f;
    else
      slot_num = fetch_owned<V>(q, id, valid);
  }
  sums[2] = slot_num;
  sums[3] = slot_num * g;
  warp_sum_n(sums);

  // The slot terms d(loss)/d(score of the slot's expert), through the
  // chosen probabilities: contrib per slot, summed over the slots of an id.
  float contrib = g, dot = 0.0f, sk = sums[2];
  if constexpr (S == Score::kSigmoid) sk += rm::kRenormEps;
  if constexpr (S == Score::kPreSoftmax) {
    dot = p.scale * (sums[3] / sums[0]);  // <soft, dS>
  } else if (S == Score::kSoftmax || K > 1) {
    dot = sums[3] / sk;  // <p~, g>
    contrib = g - dot;
  }
  const int key = valid ? id : -1 - lane;
  const unsigned same = __match_any_sync(kAll, key);
  float acc = contrib;
  if (__any_sync(kAll, valid && __popc(same) > 1)) {  // repeated ids: sum in slot order
    acc = 0.0f;
    for (int k = 0; k < K; ++k) {
      const int idk = __shfl_sync(kAll, id, k);
      const float ck = __shfl_sync(kAll, contrib, k);
      if (valid && idk == id) acc += ck;
    }
  }
  __syncwarp();  // the zeros before the terms
  if (valid && (same & lanemask_lt()) == 0) {
    float term;
    if constexpr (S == Score::kSoftmax)
      term = p.scale * (slot_num / sk) * acc;
    else if constexpr (S == Score::kPreSoftmax)
      term = p.scale * acc;
    else
      term = K > 1 ? p.scale * acc / sk : p.scale * acc;
    terms[id] = term;
  }
  __syncwarp();

  // Each lane's experts.
  float zc = 0.0f;  // 2 g_z lse: the z loss's factor of softmax(x)
  if (z) {
    const float sum_ex = S == Score::kSigmoid ? sums[4] : sums[0];
    const float lse = isinf(m) ? m : m + logf(sum_ex);
    zc = lg.g_z * 2.0f * lse;
  }
  if constexpr (S == Score::kSigmoid) {
    const float sig_d = sums[0] + rm::kRenormEps;
    const float inv_d = __frcp_rn(sig_d);
    const float adot = sums[1] / sig_d;  // <s, w>
    const float inv_ex = z ? __frcp_rn(sums[4]) : 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = lane + j * kWarpSize;
      if (e >= E) continue;
      float dsig = terms[e];
      if (any_w) dsig += (w[j] - adot) * inv_d;
      float dl = dsig * q[j] * (1.0f - q[j]);
      if (z) dl += zc * (ez[j] * inv_ex);
      out[e] = dl;
    }
  } else {
    const float inv = __frcp_rn(sums[0]);
    const float adot = sums[1] * inv;  // <soft, w>
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = lane + j * kWarpSize;
      if (e >= E) continue;
      const float soft = q[j] * inv;
      float dl = terms[e];
      if constexpr (S == Score::kPreSoftmax) {
        dl = soft * ((dl - dot) + (w[j] - adot) + zc);
      } else if (any_w || z) {
        dl += soft * ((w[j] - adot) + zc);
      }
      out[e] = dl;
    }
  }
}

// ---------------------------------------------------------------------------
// Generic path: any E and K.

__global__ void __launch_bounds__(kWarps* kWarpSize) backward_kernel(BackwardParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarpSize;
  if (t >= p.num_tokens) return;
  const int E = p.num_experts, K = p.topk;
  const float* row = p.logits + t * E;
  const int32_t* ids = p.ids + t * K;
  const float* g = p.dprobs + t * K;
  if (p.mask && p.mask[t]) {  // padding
    for (int e = lane; e < E; e += kWarpSize) p.dlogits[t * E + e] = 0.0f;
    return;
  }
  long long count_part = 0;
  if (p.mask && p.counts)
    for (int e = lane; e < E; e += kWarpSize) count_part += p.counts[e];
  LossGrads lg;
  loss_factors(p, count_part, lg);
  lg.seq_row = seq_row_of(p, t);
  if (lg.seq_row) {
    long long n = 0;
    for (int e = lane; e < E; e += kWarpSize) n += lg.seq_row[e];
    lg.g_seq = seq_grad(p, n);
  }
  const float g_z = lg.g_z;
  const bool any_w = lg.any_w();
  auto valid = [&](int j) { return ids[j] >= 0 && ids[j] < E; };

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
  if (any_w)
    for (int e = lane; e < E; e += kWarpSize) {
      const float x = rm::sanitize(row[e]);
      const float s = p.softmax ? expf(x - m) / sum_ex : (1.0f / (1.0f + expf(-x))) / sig_d;
      adot_part += s * lg.w(p, e);
    }
  const float adot = warp_sum(adot_part);
  const float lse = isinf(m) ? m : m + logf(sum_ex);

  // Step 4: each lane's experts.
  for (int e = lane; e < E; e += kWarpSize) {
    const float x = rm::sanitize(row[e]);
    const float soft = expf(x - m) / sum_ex;
    const float sig = 1.0f / (1.0f + expf(-x));
    float d_slot = 0.0f;  // sum of g_j over the slots that chose e
    int hits = 0;         // and their number
    for (int j = 0; j < K; ++j) {
      if (ids[j] != e) continue;
      d_slot += g[j];
      ++hits;
    }
    const float d_hits = d_slot - static_cast<float>(hits) * dot;
    float dl = 0.0f;
    if (p.softmax) {
      if (p.pre_softmax)
        dl += soft * (p.scale * d_slot - dot);
      else if (hits)
        dl += p.scale * (expf(x - mk) / sk) * d_hits;
      if (any_w) dl += soft * (lg.w(p, e) - adot);
    } else {
      float dsig = 0.0f;
      if (hits) dsig = K > 1 ? p.scale * d_hits / sk : p.scale * d_slot;
      if (any_w) dsig += (lg.w(p, e) - adot) / sig_d;
      dl += dsig * sig * (1.0f - sig);
    }
    if (g_z != 0.0f) dl += g_z * 2.0f * lse * soft;
    p.dlogits[t * E + e] = dl;
  }
}

template <int V>
void launch_fast(const BackwardParams& p, unsigned blocks, cudaStream_t stream) {
  constexpr int kThreads = kWarps * kWarpSize;
  if (p.softmax && p.pre_softmax)
    backward_fast_kernel<V, Score::kPreSoftmax><<<blocks, kThreads, 0, stream>>>(p);
  else if (p.softmax)
    backward_fast_kernel<V, Score::kSoftmax><<<blocks, kThreads, 0, stream>>>(p);
  else
    backward_fast_kernel<V, Score::kSigmoid><<<blocks, kThreads, 0, stream>>>(p);
}

}  // namespace

void router_backward(const RouterBackwardArgs& a, cudaStream_t stream) {
  const RouterConfig& c = a.config;
  const int64_t T = a.logits.shape[0];
  if (T == 0) return;
  BackwardParams p{};
  p.logits = a.logits.data_ptr<float>();
  p.ids = a.topk_ids.data_ptr<int32_t>();
  p.counts = a.tokens_per_expert.defined() ? a.tokens_per_expert.data_ptr<int32_t>() : nullptr;
  p.dprobs = a.grads.dprobs.data_ptr<float>();
  p.daux = a.grads.daux_loss.defined() ? a.grads.daux_loss.data_ptr<float>() : nullptr;
  p.dz = a.grads.dz_loss.defined() ? a.grads.dz_loss.data_ptr<float>() : nullptr;
  p.dlogits = a.dlogits.data_ptr<float>();
  p.num_tokens = T;
  p.num_experts = c.num_experts;
  p.topk = c.topk;
  p.softmax = c.score_function == ScoreFunction::kSoftmax;
  p.pre_softmax = c.pre_softmax;
  p.scale = rm::effective_scale(c.topk_scaling_factor);
  p.aux_factor = p.counts ? aux_factor_of(c.num_experts, c.topk, c.aux_loss_coeff, T) : 0.0f;
  p.z_factor = z_factor_of(c.z_loss_coeff, T);
  p.mask = a.padding_mask.defined() ? static_cast<const uint8_t*>(a.padding_mask.data) : nullptr;
  p.aux_coeff = c.aux_loss_coeff;
  p.z_coeff = c.z_loss_coeff;
  const bool seq = a.num_sequences > 0 && c.seq_aux_loss_coeff != 0.0f;
  p.cu = seq ? a.cu_seqlens.data_ptr<int32_t>() : nullptr;
  p.seq_counts = seq ? a.seq_tokens_per_expert.data_ptr<int32_t>() : nullptr;
  p.dseq = a.grads.dseq_aux_loss.defined() ? a.grads.dseq_aux_loss.data_ptr<float>() : nullptr;
  p.num_sequences = a.num_sequences;
  p.seq_coeff = c.seq_aux_loss_coeff;
  const int64_t blocks = ceil_div(T, kWarps);
  MOEFLOW_CHECK(blocks <= 0x7FFFFFFF, "router: too many tokens (", T, ")");
  const unsigned nb = static_cast<unsigned>(blocks);
  const int E = c.num_experts;
  if (c.topk > kWarpSize || E > kMaxFastV * kWarpSize)
    backward_kernel<<<nb, kWarps * kWarpSize, 0, stream>>>(p);
  else if (E <= kWarpSize)
    launch_fast<1>(p, nb, stream);
  else if (E <= 2 * kWarpSize)
    launch_fast<2>(p, nb, stream);
  else if (E <= 4 * kWarpSize)
    launch_fast<4>(p, nb, stream);
  else if (E <= 8 * kWarpSize)
    launch_fast<8>(p, nb, stream);
  else
    launch_fast<kMaxFastV>(p, nb, stream);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda
