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
//
// Float64 logits (CPU only, for gradient checks) run the same code on double:
// libm exp, double sums in the same order, selection by (score, id) at full
// precision; the float32 path is untouched by the templating.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "core/backends.h"
#include "core/internal.h"
#include "core/router_backend.h"
#include "core/router_math.h"

namespace moeflow::cpu {

namespace rm = router_math;

namespace {

// The scalar arithmetic per logits dtype (F: float or double).
template <typename F>
struct Arith;

// float: the exact float32 arithmetic shared with the CUDA backend.
template <>
struct Arith<float> {
  using Key = uint64_t;  // rank_key: larger = ranked first
  static float exp(float x) { return rm::exp_exact(x); }
  static float sigmoid(float x) { return rm::sigmoid_exact(x); }
  static float sanitize(float x) { return rm::sanitize(x); }
  static Key key(float score, int id) { return rm::rank_key(score, id); }
  static int key_id(Key k) { return rm::rank_key_id(k); }
  // A monotone image of the score alone (NaN as -inf).
  static uint64_t order(float score) { return rm::rank_key(score, 0) >> 32; }
  static constexpr float kEps = rm::kRenormEps;
};

// double: libm, and the ordering of rank_key widened to 64-bit scores.
template <>
struct Arith<double> {
  using Key = std::pair<uint64_t, uint32_t>;  // (score order, ~id): larger = ranked first
  static double exp(double x) { return std::exp(x); }
  static double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
  static double sanitize(double x) { return x != x ? -static_cast<double>(INFINITY) : x; }
  static uint64_t order(double score) {
    uint64_t u;
    const double v = sanitize(score);
    std::memcpy(&u, &v, sizeof u);
    return (u >> 63) ? ~u : (u | (uint64_t{1} << 63));
  }
  static Key key(double score, int id) {
    return {order(score), 0xFFFFFFFFu - static_cast<uint32_t>(id)};
  }
  static int key_id(const Key& k) { return static_cast<int>(0xFFFFFFFFu - k.second); }
  static constexpr double kEps = 1e-20;
};

// The experts chosen for one token, best first; `key` are the routing scores.
template <typename F>
std::vector<int> select_experts(const std::vector<F>& key, const RouterConfig& c) {
  using A = Arith<F>;
  using Key = typename A::Key;
  const int E = c.num_experts;
  std::vector<char> allowed(E, 1);
  if (c.num_groups > 0) {
    // Step 1: group scores = sum of the group's top (K / group_topk) routing
    // scores, added best first (as the CUDA kernel does).
    const int per = E / c.num_groups, take = c.topk / c.group_topk;
    std::vector<Key> group_keys(c.num_groups);
    for (int g = 0; g < c.num_groups; ++g) {
      std::vector<Key> ks;
      for (int e = g * per; e < (g + 1) * per; ++e) ks.push_back(A::key(key[e], e));
      std::sort(ks.rbegin(), ks.rend());
      F s = F(0);
      for (int i = 0; i < take; ++i) s = s + key[A::key_id(ks[i])];
      group_keys[g] = A::key(s, g);
    }
    // Step 2: keep the group_topk best groups.
    std::vector<Key> sorted = group_keys;
    std::sort(sorted.rbegin(), sorted.rend());
    const Key threshold = sorted[c.group_topk - 1];
    for (int e = 0; e < E; ++e) allowed[e] = group_keys[e / per] >= threshold;
  }
  std::vector<Key> ks;
  for (int e = 0; e < E; ++e)
    if (allowed[e]) ks.push_back(A::key(key[e], e));
  std::partial_sort(ks.begin(), ks.begin() + c.topk, ks.end(), std::greater<Key>());
  std::vector<int> ids(c.topk);
  for (int k = 0; k < c.topk; ++k) ids[k] = A::key_id(ks[k]);
  return ids;
}

// logsumexp of a sanitized row, in double.
template <typename F>
double logsumexp(const F* x, int E) {
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

bool is_pad(const TensorView& mask, int64_t t) {
  return mask.defined() && static_cast<const uint8_t*>(mask.data)[t] != 0;
}

// cu_seqlens [S+1] (validated: 0 = cu[0] <= ... <= cu[S] = T) as int64.
std::vector<int64_t> read_cu_seqlens(const TensorView& cu, int64_t S, int64_t T) {
  const int32_t* v = static_cast<const int32_t*>(cu.data);
  std::vector<int64_t> out(v, v + S + 1);
  MOEFLOW_CHECK(out[0] == 0, "cu_seqlens[0] must be 0, got ", out[0]);
  MOEFLOW_CHECK(out[S] == T, "cu_seqlens[S=", S, "] must be T=", T, ", got ", out[S]);
  for (int64_t s = 0; s < S; ++s)
    MOEFLOW_CHECK(out[s] <= out[s + 1], "cu_seqlens must be non-decreasing, got cu_seqlens[", s,
                  "]=", out[s], " > cu_seqlens[", s + 1, "]=", out[s + 1]);
  return out;
}

// The sequence of each token (cu validated).
std::vector<int64_t> sequence_of_tokens(const std::vector<int64_t>& cu, int64_t T) {
  std::vector<int64_t> seq(T);
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) seq[t] = static_cast<int64_t>(s);
  return seq;
}

template <typename F>
void forward_impl(const RouterForwardArgs& a) {
  using A = Arith<F>;
  const TensorView logits = a.logits;
  const RouterConfig& c = a.config;
  const RouterOutputs& out = a.out;
  const int64_t T = logits.shape[0];
  const int E = c.num_experts, K = c.topk;
  const F* in = logits.data_ptr<F>();
  const F* bias = a.expert_bias.defined() ? a.expert_bias.data_ptr<F>() : nullptr;
  int32_t* ids_out = out.topk_ids.data_ptr<int32_t>();
  F* probs_out = out.probs.data_ptr<F>();
  const F scale = static_cast<F>(rm::effective_scale(c.topk_scaling_factor));
  // Sequences: read (and checked) when an output needs them.
  const int64_t S = a.num_sequences;
  const bool seq = S > 0 && (c.seq_aux_loss_coeff != 0.0f || out.seq_tokens_per_expert.defined());
  std::vector<int64_t> seq_of;
  if (S > 0) seq_of = sequence_of_tokens(read_cu_seqlens(a.cu_seqlens, S, T), T);
  const bool aux_scores = c.aux_loss_coeff != 0.0f || seq;

  std::vector<int64_t> counts(E, 0);
  std::vector<double> colsum(E, 0.0);  // sum over tokens of the aux-loss scores
  std::vector<int64_t> seq_counts(seq ? S * E : 0, 0), seq_len(seq ? S : 0, 0);
  std::vector<double> seq_colsum(seq ? S * E : 0, 0.0);
  double z_sum = 0.0;
  int32_t nonfinite = 0;
  int64_t real = 0;  // tokens not masked as padding
  std::vector<F> x(E), ex(E), val(E), key(E);
  std::vector<double> score(E);  // the aux-loss scores of the token
  for (int64_t t = 0; t < T; ++t) {
    if (is_pad(a.padding_mask, t)) {
      for (int k = 0; k < K; ++k) {
        ids_out[t * K + k] = -1;
        probs_out[t * K + k] = F(0);
      }
      continue;
    }
    ++real;
    // Step 1: sanitized logits, row max, non-finite count.
    bool bad = false;
    F m = -INFINITY;
    for (int e = 0; e < E; ++e) {
      const F v = in[t * E + e];
      bad |= !std::isfinite(v);
      x[e] = A::sanitize(v);
      m = std::max(m, x[e]);
    }
    nonfinite += bad;
    // Step 2: scores (val) and routing scores (key).
    for (int e = 0; e < E; ++e) ex[e] = A::exp(x[e] - m);
    const F sum_ex = rm::lane_order_sum(ex.data(), E);
    for (int e = 0; e < E; ++e) {
      if (is_softmax(c))
        val[e] = c.pre_softmax ? ex[e] / sum_ex : x[e];
      else
        val[e] = A::sigmoid(x[e]);
      key[e] = bias ? val[e] + bias[e] : val[e];
    }
    // Step 3: the choice and the probabilities of the chosen slots.
    const std::vector<int> ids = select_experts(key, c);
    std::vector<F> v(K);
    for (int k = 0; k < K; ++k) v[k] = val[ids[k]];
    std::vector<F> p(K);
    if (is_softmax(c) && !c.pre_softmax) {
      F mk = -INFINITY;
      for (int k = 0; k < K; ++k) mk = std::max(mk, v[k]);
      std::vector<F> ek(K);
      for (int k = 0; k < K; ++k) ek[k] = A::exp(v[k] - mk);
      const F s = rm::lane_order_sum(ek.data(), K);
      for (int k = 0; k < K; ++k) p[k] = ek[k] / s;
    } else if (!is_softmax(c) && K > 1) {
      const F s = rm::lane_order_sum(v.data(), K);
      for (int k = 0; k < K; ++k) p[k] = v[k] / (s + A::kEps);
    } else {
      p = v;
    }
    for (int k = 0; k < K; ++k) {
      ids_out[t * K + k] = ids[k];
      probs_out[t * K + k] = p[k] * scale;
      ++counts[ids[k]];
    }
    // Step 4: the losses' per-token terms.
    if (aux_scores) {
      if (is_softmax(c)) {
        for (int e = 0; e < E; ++e) score[e] = static_cast<double>(ex[e]) / sum_ex;
      } else {
        double s = 0.0;
        for (int e = 0; e < E; ++e) s += val[e];
        for (int e = 0; e < E; ++e) score[e] = val[e] / (s + 1e-20);
      }
      if (c.aux_loss_coeff != 0.0f)
        for (int e = 0; e < E; ++e) colsum[e] += score[e];
      if (seq) {
        const int64_t sq = seq_of[t];
        ++seq_len[sq];
        for (int e = 0; e < E; ++e) seq_colsum[sq * E + e] += score[e];
        for (int k = 0; k < K; ++k) ++seq_counts[sq * E + ids[k]];
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
  // T of the losses: the real tokens (= T without a padding mask).
  const double Td = static_cast<double>(real);
  if (out.aux_loss.defined())
    out.aux_loss.data_ptr<F>()[0] =
        real > 0 ? static_cast<F>(aux * E * c.aux_loss_coeff / (K * Td * Td)) : F(0);
  if (out.z_loss.defined())
    out.z_loss.data_ptr<F>()[0] = real > 0 ? static_cast<F>(c.z_loss_coeff * z_sum / Td) : F(0);
  if (out.nonfinite.defined()) out.nonfinite.data_ptr<int32_t>()[0] = nonfinite;
  double seq_aux = 0.0;
  if (seq) {
    for (int64_t sq = 0; sq < S; ++sq) {
      double dot = 0.0;
      for (int e = 0; e < E; ++e) {
        out.seq_tokens_per_expert.data_ptr<int32_t>()[sq * E + e] =
            static_cast<int32_t>(seq_counts[sq * E + e]);
        dot += seq_colsum[sq * E + e] * static_cast<double>(seq_counts[sq * E + e]);
      }
      const double L = static_cast<double>(seq_len[sq]);
      if (seq_len[sq] > 0) seq_aux += dot * E * c.seq_aux_loss_coeff / (K * L * L);
    }
    seq_aux /= static_cast<double>(S);
  }
  if (out.seq_aux_loss.defined()) out.seq_aux_loss.data_ptr<F>()[0] = static_cast<F>(seq_aux);
  if (out.invalid_cu_seqlens.defined()) out.invalid_cu_seqlens.data_ptr<int32_t>()[0] = 0;
}

template <typename F>
void backward_impl(const RouterBackwardArgs& a) {
  using A = Arith<F>;
  const RouterConfig& c = a.config;
  const RouterGrads& grads = a.grads;
  const TensorView logits = a.logits;
  const int64_t T = logits.shape[0];
  const int E = c.num_experts, K = c.topk;
  const F* in = logits.data_ptr<F>();
  const int32_t* ids = a.topk_ids.data_ptr<int32_t>();
  const F* dprobs = grads.dprobs.data_ptr<F>();
  F* dl_out = a.dlogits.data_ptr<F>();
  const double scale = rm::effective_scale(c.topk_scaling_factor);
  // T of the losses: with a padding mask, the real tokens = sum(tokens_per_expert) / K.
  int64_t real = T;
  if (a.padding_mask.defined()) {
    real = 0;
    if (a.tokens_per_expert.defined()) {
      for (int e = 0; e < E; ++e) real += a.tokens_per_expert.data_ptr<int32_t>()[e];
      real /= K;
    }
  }
  const double Td = static_cast<double>(real);
  // d(loss)/d(s[t,e]) of the aux loss is w[e] for every t; d(z_loss)/d(lse_t^2) is zc.
  const double g_aux = grads.daux_loss.defined() ? grads.daux_loss.data_ptr<F>()[0] : 0.0;
  const double g_z = grads.dz_loss.defined() ? grads.dz_loss.data_ptr<F>()[0] : 0.0;
  std::vector<double> w(E, 0.0);
  if (c.aux_loss_coeff != 0.0f && real > 0)
    for (int e = 0; e < E; ++e)
      w[e] =
          g_aux * E * c.aux_loss_coeff / (K * Td * Td) * a.tokens_per_expert.data_ptr<int32_t>()[e];
  const double zc = (c.z_loss_coeff != 0.0f && real > 0) ? g_z * c.z_loss_coeff / Td : 0.0;
  // Sequence aux loss: d/d(s[t,e]) = ws[seq(t), e] = g * E * coeff / (K * S * L_s^2) * c[s,e],
  // L_s = sum_e c[s,e] / K.
  const int64_t S = a.num_sequences;
  const bool seq = S > 0 && c.seq_aux_loss_coeff != 0.0f;
  std::vector<int64_t> seq_of;
  std::vector<double> ws;
  if (seq) {
    seq_of = sequence_of_tokens(read_cu_seqlens(a.cu_seqlens, S, T), T);
    const double g_seq = grads.dseq_aux_loss.defined() ? grads.dseq_aux_loss.data_ptr<F>()[0] : 0.0;
    const int32_t* sc = a.seq_tokens_per_expert.data_ptr<int32_t>();
    ws.assign(S * E, 0.0);
    for (int64_t sq = 0; sq < S; ++sq) {
      int64_t n = 0;
      for (int e = 0; e < E; ++e) n += sc[sq * E + e];
      const double L = static_cast<double>(n / K);
      if (n / K == 0) continue;
      for (int e = 0; e < E; ++e)
        ws[sq * E + e] = g_seq * E * c.seq_aux_loss_coeff / (K * L * L) / static_cast<double>(S) *
                         sc[sq * E + e];
    }
  }

  std::vector<double> x(E), soft(E), sig(E), dl(E), dval(E), wt(E);
  for (int64_t t = 0; t < T; ++t) {
    if (is_pad(a.padding_mask, t)) {
      for (int e = 0; e < E; ++e) dl_out[t * E + e] = F(0);
      continue;
    }
    // The loss weights of the token's scores: aux (+ its sequence's).
    const std::vector<double>* wp = &w;
    if (seq) {
      for (int e = 0; e < E; ++e) wt[e] = w[e] + ws[seq_of[t] * E + e];
      wp = &wt;
    }
    const std::vector<double>& wv = *wp;
    // Forward quantities of the token, in double.
    double m = -INFINITY;
    for (int e = 0; e < E; ++e) {
      x[e] = A::sanitize(in[t * E + e]);
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
    const F* g = dprobs + t * K;
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
    // Aux losses: s = softmax (softmax) or sigmoid / (sum + 1e-20) (sigmoid).
    if (is_softmax(c)) {
      double dot = 0.0;
      for (int e = 0; e < E; ++e) dot += soft[e] * wv[e];
      for (int e = 0; e < E; ++e) dl[e] += soft[e] * (wv[e] - dot);
    } else {
      const double D = sum_sig + 1e-20;
      double dot = 0.0;
      for (int e = 0; e < E; ++e) dot += sig[e] / D * wv[e];
      for (int e = 0; e < E; ++e) dval[e] += (wv[e] - dot) / D;
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
    for (int e = 0; e < E; ++e) dl_out[t * E + e] = static_cast<F>(dl[e]);
  }
}

}  // namespace

void router_forward(const RouterForwardArgs& a) {
  if (a.logits.dtype == DType::kFloat64) return forward_impl<double>(a);
  forward_impl<float>(a);
}

void router_backward(const RouterBackwardArgs& a) {
  if (a.logits.dtype == DType::kFloat64) return backward_impl<double>(a);
  backward_impl<float>(a);
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

void router_split_bf16(TensorView src, const Bf16SplitLayout& layout, TensorView dst) {
  const int64_t R = src.shape[0], C = src.shape[1];
  const float* x = src.data_ptr<float>();
  uint16_t* out = static_cast<uint16_t*>(dst.data);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      uint16_t p[3];
      float rest = x[r * C + c];
      for (int k = 0; k < 3; ++k) {
        p[k] = detail::float_to_bf16(rest);
        rest = rest - detail::bf16_to_float(p[k]);
      }
      for (int i = 0; i < layout.count; ++i) {
        const int64_t at =
            layout.along_columns ? r * (layout.count * C) + i * C + c : (i * R + r) * C + c;
        out[at] = p[layout.parts[i]];
      }
    }
  }
}

// Each expert's valid slots in the policy's order (kProbs: prob descending by
// rank order, equal bits by slot index; kPosition: slot index), the first
// `capacity` kept.
void router_apply_capacity(const RouterCapacityArgs& a) {
  const int64_t T = a.topk_ids.shape[0], K = a.topk_ids.shape[1];
  const int E = a.config.num_experts;
  const int32_t* ids = a.topk_ids.data_ptr<int32_t>();
  std::vector<int32_t> kept(ids, ids + T * K);  // topk_ids may alias kept_ids
  for (int64_t i = 0; i < T * K; ++i)
    MOEFLOW_CHECK(kept[i] >= -1 && kept[i] < E, "topk_ids must be in [-1, num_experts=", E,
                  "), got ", kept[i], " at slot ", i);
  int64_t dropped = 0;
  if (a.capacity < T) {
    // The rank order of each slot's prob (kProbs; float32 or float64 probs).
    std::vector<uint64_t> order(a.probs.defined() ? T * K : 0);
    for (size_t i = 0; i < order.size(); ++i)
      order[i] = a.probs.dtype == DType::kFloat64
                     ? Arith<double>::order(a.probs.data_ptr<double>()[i])
                     : Arith<float>::order(a.probs.data_ptr<float>()[i]);
    std::vector<std::vector<int64_t>> slots(E);
    for (int64_t i = 0; i < T * K; ++i)
      if (kept[i] >= 0) slots[kept[i]].push_back(i);
    for (int e = 0; e < E; ++e) {
      std::vector<int64_t>& v = slots[e];
      if (static_cast<int64_t>(v.size()) <= a.capacity) continue;
      if (a.config.drop_policy == DropPolicy::kProbs)
        std::stable_sort(v.begin(), v.end(),
                         [&](int64_t x, int64_t y) { return order[x] > order[y]; });
      for (size_t j = static_cast<size_t>(a.capacity); j < v.size(); ++j) {
        kept[v[j]] = -1;
        ++dropped;
      }
    }
  }
  std::copy(kept.begin(), kept.end(), a.kept_ids.data_ptr<int32_t>());
  if (a.dropped.defined()) a.dropped.data_ptr<int32_t>()[0] = static_cast<int32_t>(dropped);
}

}  // namespace moeflow::cpu
