// CPU reference of the router: the oracle for the CUDA backend.
//
// Forward, per token: sanitize the logits (NaN -> -inf), compute the scores
// (logits, full softmax, or sigmoid), the routing scores (+ expert_bias),
// optionally keep the group_topk best groups, take the top-k by rank_key
// (score descending, id ascending), then the probabilities of the chosen
// slots. The scores and the selection use the shared exact arithmetic of
// core/router_math.h (with the warp's sum order replayed), so the CUDA
// backend chooses bitwise the same experts. The losses are accumulated in
// double. Backward recomputes the forward quantities per token in double and
// applies the chain rule with the choice fixed.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/backends.h"
#include "core/internal.h"
#include "core/router_math.h"

namespace moeflow::cpu {

namespace rm = router_math;

namespace {

// The experts chosen for one token, best first; `key` are the routing scores.
std::vector<int> select_experts(const std::vector<float>& key, const RouterConfig& c) {
  const int E = c.num_experts;
  std::vector<char> allowed(E, 1);
  if (c.num_groups > 0) {
    // Step 1: group scores = sum of the group's top (K / group_topk) routing
    // scores, added best first (as the CUDA kernel does).
    const int per = E / c.num_groups, take = c.topk / c.group_topk;
    std::vector<uint64_t> group_keys(c.num_groups);
    for (int g = 0; g < c.num_groups; ++g) {
      std::vector<uint64_t> ks;
      for (int e = g * per; e < (g + 1) * per; ++e) ks.push_back(rm::rank_key(key[e], e));
      std::sort(ks.rbegin(), ks.rend());
      float s = 0.0f;
      for (int i = 0; i < take; ++i) s = s + key[rm::rank_key_id(ks[i])];
      group_keys[g] = rm::rank_key(s, g);
    }
    // Step 2: keep the group_topk best groups.
    std::vector<uint64_t> sorted = group_keys;
    std::sort(sorted.rbegin(), sorted.rend());
    const uint64_t threshold = sorted[c.group_topk - 1];
    for (int e = 0; e < E; ++e) allowed[e] = group_keys[e / per] >= threshold;
  }
  std::vector<uint64_t> ks;
  for (int e = 0; e < E; ++e)
    if (allowed[e]) ks.push_back(rm::rank_key(key[e], e));
  std::partial_sort(ks.begin(), ks.begin() + c.topk, ks.end(), std::greater<uint64_t>());
  std::vector<int> ids(c.topk);
  for (int k = 0; k < c.topk; ++k) ids[k] = rm::rank_key_id(ks[k]);
  return ids;
}

// logsumexp of a sanitized row, in double.
double logsumexp(const float* x, int E) {
  double m = -INFINITY;
  for (int e = 0; e < E; ++e) m = std::max(m, static_cast<double>(x[e]));
  if (std::isinf(m)) return m;
  double s = 0.0;
  for (int e = 0; e < E; ++e) s += std::exp(x[e] - m);
  return m + std::log(s);
}

bool is_softmax(const RouterConfig& c) {
  return c.score_function == ScoreFunction::kSoftmax;
}

}  // namespace

void router_forward(TensorView logits, const RouterConfig& c, const RouterOutputs& out,
                    TensorView expert_bias) {
  const int64_t T = logits.shape[0];
  const int E = c.num_experts, K = c.topk;
  const float* in = logits.data_ptr<float>();
  const float* bias = expert_bias.defined() ? expert_bias.data_ptr<float>() : nullptr;
  int32_t* ids_out = out.topk_ids.data_ptr<int32_t>();
  float* probs_out = out.probs.data_ptr<float>();
  const float scale = rm::effective_scale(c.topk_scaling_factor);

  std::vector<int64_t> counts(E, 0);
  std::vector<double> colsum(E, 0.0);  // sum over tokens of the aux-loss scores
  double z_sum = 0.0;
  int32_t nonfinite = 0;
  std::vector<float> x(E), ex(E), val(E), key(E);
  for (int64_t t = 0; t < T; ++t) {
    // Step 1: sanitized logits, row max, non-finite count.
    bool bad = false;
    float m = -INFINITY;
    for (int e = 0; e < E; ++e) {
      const float v = in[t * E + e];
      bad |= !std::isfinite(v);
      x[e] = rm::sanitize(v);
      m = std::max(m, x[e]);
    }
    nonfinite += bad;
    // Step 2: scores (val) and routing scores (key).
    for (int e = 0; e < E; ++e) ex[e] = rm::exp_exact(x[e] - m);
    const float sum_ex = rm::lane_order_sum(ex.data(), E);
    for (int e = 0; e < E; ++e) {
      if (is_softmax(c))
        val[e] = c.pre_softmax ? ex[e] / sum_ex : x[e];
      else
        val[e] = rm::sigmoid_exact(x[e]);
      key[e] = bias ? val[e] + bias[e] : val[e];
    }
    // Step 3: the choice and the probabilities of the chosen slots.
    const std::vector<int> ids = select_experts(key, c);
    std::vector<float> v(K);
    for (int k = 0; k < K; ++k) v[k] = val[ids[k]];
    std::vector<float> p(K);
    if (is_softmax(c) && !c.pre_softmax) {
      float mk = -INFINITY;
      for (int k = 0; k < K; ++k) mk = std::max(mk, v[k]);
      std::vector<float> ek(K);
      for (int k = 0; k < K; ++k) ek[k] = rm::exp_exact(v[k] - mk);
      const float s = rm::lane_order_sum(ek.data(), K);
      for (int k = 0; k < K; ++k) p[k] = ek[k] / s;
    } else if (!is_softmax(c) && K > 1) {
      const float s = rm::lane_order_sum(v.data(), K);
      for (int k = 0; k < K; ++k) p[k] = v[k] / (s + rm::kRenormEps);
    } else {
      p = v;
    }
    for (int k = 0; k < K; ++k) {
      ids_out[t * K + k] = ids[k];
      probs_out[t * K + k] = p[k] * scale;
      ++counts[ids[k]];
    }
    // Step 4: the losses' per-token terms.
    if (c.aux_loss_coeff != 0.0f) {
      if (is_softmax(c)) {
        for (int e = 0; e < E; ++e) colsum[e] += static_cast<double>(ex[e]) / sum_ex;
      } else {
        double s = 0.0;
        for (int e = 0; e < E; ++e) s += val[e];
        for (int e = 0; e < E; ++e) colsum[e] += val[e] / (s + 1e-20);
      }
    }
    if (c.z_loss_coeff != 0.0f) {
      const double lse = logsumexp(x.data(), E);
      z_sum += lse * lse;
    }
  }
  double aux = 0.0;
  for (int e = 0; e < E; ++e) {
    out.tokens_per_expert.data_ptr<int32_t>()[e] = static_cast<int32_t>(counts[e]);
    aux += colsum[e] * static_cast<double>(counts[e]);
  }
  const double Td = static_cast<double>(T);
  if (out.aux_loss.defined())
    out.aux_loss.data_ptr<float>()[0] =
        T > 0 ? static_cast<float>(aux * E * c.aux_loss_coeff / (K * Td * Td)) : 0.0f;
  if (out.z_loss.defined())
    out.z_loss.data_ptr<float>()[0] =
        T > 0 ? static_cast<float>(c.z_loss_coeff * z_sum / Td) : 0.0f;
  if (out.nonfinite.defined()) out.nonfinite.data_ptr<int32_t>()[0] = nonfinite;
}

void router_backward(TensorView logits, TensorView topk_ids, TensorView tokens_per_expert,
                     const RouterGrads& grads, const RouterConfig& c, TensorView dlogits) {
  const int64_t T = logits.shape[0];
  const int E = c.num_experts, K = c.topk;
  const float* in = logits.data_ptr<float>();
  const int32_t* ids = topk_ids.data_ptr<int32_t>();
  const float* dprobs = grads.dprobs.data_ptr<float>();
  float* dl_out = dlogits.data_ptr<float>();
  const double scale = rm::effective_scale(c.topk_scaling_factor);
  const double Td = static_cast<double>(T);
  // d(loss)/d(s[t,e]) of the aux loss is w[e] for every t; d(z_loss)/d(lse_t^2) is zc.
  const double g_aux = grads.daux_loss.defined() ? grads.daux_loss.data_ptr<float>()[0] : 0.0;
  const double g_z = grads.dz_loss.defined() ? grads.dz_loss.data_ptr<float>()[0] : 0.0;
  std::vector<double> w(E, 0.0);
  if (c.aux_loss_coeff != 0.0f && T > 0)
    for (int e = 0; e < E; ++e)
      w[e] =
          g_aux * E * c.aux_loss_coeff / (K * Td * Td) * tokens_per_expert.data_ptr<int32_t>()[e];
  const double zc = (c.z_loss_coeff != 0.0f && T > 0) ? g_z * c.z_loss_coeff / Td : 0.0;

  std::vector<double> x(E), soft(E), sig(E), dl(E), dval(E);
  for (int64_t t = 0; t < T; ++t) {
    // Forward quantities of the token, in double.
    double m = -INFINITY;
    for (int e = 0; e < E; ++e) {
      x[e] = rm::sanitize(in[t * E + e]);
      m = std::max(m, x[e]);
    }
    double sum_ex = 0.0, sum_sig = 0.0;
    for (int e = 0; e < E; ++e) sum_ex += std::exp(x[e] - m);
    for (int e = 0; e < E; ++e) {
      soft[e] = std::exp(x[e] - m) / sum_ex;
      sig[e] = 1.0 / (1.0 + std::exp(-x[e]));
      sum_sig += sig[e];
    }
    std::fill(dl.begin(), dl.end(), 0.0);
    std::fill(dval.begin(), dval.end(), 0.0);  // gradient w.r.t. the scores val[e]
    const int32_t* tid = ids + t * K;
    const float* g = dprobs + t * K;
    auto valid = [&](int k) { return tid[k] >= 0 && tid[k] < E; };

    // Slots: through the probabilities of the chosen experts.
    if (is_softmax(c) && !c.pre_softmax) {
      double mk = -INFINITY, s = 0.0, dot = 0.0;
      for (int k = 0; k < K; ++k)
        if (valid(k)) mk = std::max(mk, x[tid[k]]);
      for (int k = 0; k < K; ++k)
        if (valid(k)) s += std::exp(x[tid[k]] - mk);
      for (int k = 0; k < K; ++k)
        if (valid(k)) dot += std::exp(x[tid[k]] - mk) / s * g[k];
      for (int k = 0; k < K; ++k)
        if (valid(k)) dl[tid[k]] += scale * std::exp(x[tid[k]] - mk) / s * (g[k] - dot);
    } else if (is_softmax(c)) {
      for (int k = 0; k < K; ++k)
        if (valid(k)) dval[tid[k]] += scale * g[k];
    } else if (K > 1) {
      double s = 0.0, dot = 0.0;
      for (int k = 0; k < K; ++k)
        if (valid(k)) s += sig[tid[k]];
      s += 1e-20;
      for (int k = 0; k < K; ++k)
        if (valid(k)) dot += sig[tid[k]] / s * g[k];
      for (int k = 0; k < K; ++k)
        if (valid(k)) dval[tid[k]] += scale * (g[k] - dot) / s;
    } else {
      if (valid(0)) dval[tid[0]] += scale * g[0];
    }
    // Aux loss: s = softmax (softmax) or sigmoid / (sum + 1e-20) (sigmoid).
    if (is_softmax(c)) {
      double dot = 0.0;
      for (int e = 0; e < E; ++e) dot += soft[e] * w[e];
      for (int e = 0; e < E; ++e) dl[e] += soft[e] * (w[e] - dot);
    } else {
      const double D = sum_sig + 1e-20;
      double dot = 0.0;
      for (int e = 0; e < E; ++e) dot += sig[e] / D * w[e];
      for (int e = 0; e < E; ++e) dval[e] += (w[e] - dot) / D;
    }
    // Scores -> logits (full softmax or sigmoid).
    if (is_softmax(c)) {
      double dot = 0.0;
      for (int e = 0; e < E; ++e) dot += soft[e] * dval[e];
      for (int e = 0; e < E; ++e) dl[e] += soft[e] * (dval[e] - dot);
    } else {
      for (int e = 0; e < E; ++e) dl[e] += dval[e] * sig[e] * (1.0 - sig[e]);
    }
    // z loss: d/dx (lse^2) = 2 lse softmax.
    if (zc != 0.0) {
      const double lse = std::isinf(m) ? m : m + std::log(sum_ex);
      for (int e = 0; e < E; ++e) dl[e] += zc * 2.0 * lse * soft[e];
    }
    for (int e = 0; e < E; ++e) dl_out[t * E + e] = static_cast<float>(dl[e]);
  }
}

void router_update_expert_bias(TensorView tokens_per_expert, TensorView expert_bias, float rate) {
  const int64_t E = tokens_per_expert.shape[0];
  const int32_t* counts = tokens_per_expert.data_ptr<int32_t>();
  float* bias = expert_bias.data_ptr<float>();
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += counts[e];
  const double mean = E > 0 ? static_cast<double>(total) / E : 0.0;
  for (int64_t e = 0; e < E; ++e) {
    const double off = mean - counts[e];
    const float sign = off > 0 ? 1.0f : (off < 0 ? -1.0f : 0.0f);
    bias[e] = bias[e] + rate * sign;
  }
}

}  // namespace moeflow::cpu
