// CUDA router backward: one warp per token recomputes the token's forward
// quantities (row max, softmax denominator, sigmoid sum, the chosen slots'
// normalisation) and writes its dlogits row (no shared state between tokens).
// The aux losses' weights w[e] = d(loss)/d(s[t,e]): the aux loss's
// g * factor * tokens_per_expert[e], plus the sequence aux loss's
// g * E * coeff / (K * S * L^2) * seq_tokens_per_expert[seq(t), e].
// Padding rows are written as 0. No host sync; graph safe.
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
  float aux_factor = p.aux_factor, z_factor = p.z_factor;
  if (p.mask) {  // the real tokens: sum(counts) / K
    long long n = 0;
    if (p.counts)
      for (int e = lane; e < E; e += kWarpSize) n += p.counts[e];
    const int64_t real = warp_sum_ll(n) / K;
    aux_factor = p.aux_coeff != 0.0f && p.counts ? aux_factor_of(E, K, p.aux_coeff, real) : 0.0f;
    z_factor = p.z_coeff != 0.0f ? z_factor_of(p.z_coeff, real) : 0.0f;
  }
  const float g_aux = p.daux && aux_factor != 0.0f ? *p.daux * aux_factor : 0.0f;
  const float g_z = p.dz && z_factor != 0.0f ? *p.dz * z_factor : 0.0f;
  // seq_aux_loss: d/d(s[t,e]) = g * E * coeff / (K * S * L^2) * c[seq(t), e], L = sum_e c / K.
  float g_seq = 0.0f;
  const int32_t* seq_row = nullptr;
  if (p.seq_counts && p.dseq) {
    seq_row = p.seq_counts + router_detail::sequence_of(p.cu, p.num_sequences, p.num_tokens, t) * E;
    long long n = 0;
    for (int e = lane; e < E; e += kWarpSize) n += seq_row[e];
    const int64_t L = warp_sum_ll(n) / K;
    if (L > 0 && p.seq_coeff != 0.0f) {
      const double Ld = static_cast<double>(L);
      g_seq = *p.dseq * static_cast<float>(static_cast<double>(E) * p.seq_coeff /
                                           (K * static_cast<double>(p.num_sequences) * Ld * Ld));
    }
  }
  const bool any_w = g_aux != 0.0f || g_seq != 0.0f;
  auto valid = [&](int j) { return ids[j] >= 0 && ids[j] < E; };
  auto w_of = [&](int e) {
    float w = g_aux != 0.0f ? g_aux * static_cast<float>(p.counts[e]) : 0.0f;
    if (g_seq != 0.0f) w += g_seq * static_cast<float>(seq_row[e]);
    return w;
  };

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
      if (any_w) dl += soft * (w_of(e) - adot);
    } else {
      float dsig = 0.0f;
      if (chosen) dsig = K > 1 ? p.scale * (d_slot - dot) / sk : p.scale * d_slot;
      if (any_w) dsig += (w_of(e) - adot) / sig_d;
      dl += dsig * sig * (1.0f - sig);
    }
    if (g_z != 0.0f) dl += g_z * 2.0f * lse * soft;
    p.dlogits[t * E + e] = dl;
  }
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
  backward_kernel<<<static_cast<unsigned>(blocks), kWarps * kWarpSize, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda
