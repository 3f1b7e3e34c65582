// `moeflow run`'s router step: the preset's router (Megatron-Core's options:
// DeepSeek-V3's group-limited sigmoid with expert bias for dsv3, softmax
// top-k otherwise) on deterministic logits, forward (+ the aux and z losses)
// and backward, checked: every row's experts distinct and in range, the
// counts those of the ids, the probabilities summing to the scaling factor,
// and on a GPU the CUDA kernels against the CPU reference backend (the same
// experts bitwise, values within float32 rounding). Its ids and probs feed
// the token path that follows.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "moeflow/router.h"
#include "tools/run_common.h"

namespace moeflow::bench {

namespace {

RouterConfig preset_router(const std::string& preset, int E, int K) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = K;
  c.aux_loss_coeff = 1e-2f;
  c.z_loss_coeff = 1e-3f;
  if (preset == "dsv3" && E % 8 == 0 && K % 4 == 0) {  // DeepSeek-V3
    c.score_function = ScoreFunction::kSigmoid;
    c.num_groups = 8;
    c.group_topk = 4;
    c.topk_scaling_factor = 2.5f;
  }
  return c;
}

std::string router_str(const RouterConfig& c) {
  if (c.score_function == ScoreFunction::kSoftmax) return "softmax top-k";
  return fmt::format("sigmoid + expert bias, {} groups / top-{}, scaling {}", c.num_groups,
                     c.group_topk, c.topk_scaling_factor);
}

struct RouterRun {
  Tensor ids, probs, counts, aux, z, dlogits;
};

// Forward (+ backward with dprobs) of `c` on host logits, on `dev`; results
// on the host.
RouterRun run_router_on(const Tensor& logits, const Tensor& bias, const Tensor& dprobs,
                        const RouterConfig& c, Device dev, bool backward, bool timed) {
  const int64_t T = logits.size(0);
  const auto on = [&](const Tensor& t) { return dev.is_cpu() || !t.defined() ? t : t.to(dev); };
  Tensor l = on(logits), b = on(bias);
  RouterRun r;
  Tensor ids = Tensor::empty({T, c.topk}, DType::kInt32, dev);
  Tensor probs = Tensor::empty({T, c.topk}, DType::kFloat32, dev);
  Tensor counts = Tensor::empty({c.num_experts}, DType::kInt32, dev);
  Tensor aux = Tensor::empty({1}, DType::kFloat32, dev);
  Tensor z = Tensor::empty({1}, DType::kFloat32, dev);
  Tensor ws = Tensor::empty(
      {std::max<int64_t>(1, static_cast<int64_t>(dev.is_cpu() ? 0 : router_workspace_bytes(T, c)))},
      DType::kUInt8, dev);
  Tensor dl;
  const auto fwd = [&] {
    router_forward(l, c, RouterOutputs{ids, probs, counts, aux, z, {}}, b, ws);
  };
  if (timed)
    timed_step(dev, "router forward (+ aux, z losses)", fwd);
  else
    fwd();
  if (backward) {
    dl = Tensor::empty({T, c.num_experts}, DType::kFloat32, dev);
    Tensor one_host = Tensor::empty({1}, DType::kFloat32);
    one_host.data_ptr<float>()[0] = 1.0f;
    Tensor dp = on(dprobs), one = on(one_host);
    const auto bwd = [&] { router_backward(l, ids, counts, RouterGrads{dp, one, one}, c, dl); };
    if (timed)
      timed_step(dev, "router backward", bwd);
    else
      bwd();
  }
  sync_device(dev);
  const auto host = [](const Tensor& t) { return t.defined() ? t.to(Device::cpu()) : t; };
  return RouterRun{host(ids), host(probs), host(counts), host(aux), host(z), host(dl)};
}

}  // namespace

Routing run_router_step(const std::string& preset, int64_t T, int E, int K, Device dev,
                        bool backward, CheckReport& report) {
  const RouterConfig c = preset_router(preset, E, K);
  fmt::print("router ({}, T={} E={} K={}){}:\n", router_str(c), T, E, K,
             dev.is_cpu() ? " on the CPU backend" : "");
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Tensor logits = Tensor::empty({T, E}, DType::kFloat32);
  for (int64_t i = 0; i < T * E; ++i) logits.data_ptr<float>()[i] = normal(rng);
  Tensor bias;
  if (c.score_function == ScoreFunction::kSigmoid) {
    bias = Tensor::empty({E}, DType::kFloat32);
    for (int e = 0; e < E; ++e) bias.data_ptr<float>()[e] = 0.01f * normal(rng);
  }
  Tensor dprobs = Tensor::empty({T, K}, DType::kFloat32);
  for (int64_t i = 0; i < T * K; ++i) dprobs.data_ptr<float>()[i] = normal(rng);

  const RouterRun r = run_router_on(logits, bias, dprobs, c, dev, backward, true);

  // The ids, the counts and the probabilities' sums.
  const int32_t* ids = r.ids.data_ptr<int32_t>();
  const float* probs = r.probs.data_ptr<float>();
  std::vector<int64_t> count(static_cast<size_t>(E), 0);
  int64_t bad_rows = 0;
  double sum_err = 0;
  const double want_sum = c.topk_scaling_factor > 0 ? c.topk_scaling_factor : 1.0;
  for (int64_t t = 0; t < T; ++t) {
    bool ok = true;
    double s = 0;
    for (int k = 0; k < K; ++k) {
      const int32_t e = ids[t * K + k];
      ok = ok && e >= 0 && e < E;
      for (int j = 0; j < k; ++j) ok = ok && ids[t * K + j] != e;
      if (e >= 0 && e < E) ++count[static_cast<size_t>(e)];
      s += probs[t * K + k];
    }
    bad_rows += !ok;
    sum_err = std::max(sum_err, std::fabs(s - want_sum));
  }
  bool counts_ok = true;
  for (int e = 0; e < E; ++e) counts_ok = counts_ok && r.counts.data_ptr<int32_t>()[e] == count[e];
  report.check(bad_rows == 0 && counts_ok,
               fmt::format("router: {} tokens routed to {} distinct experts each, counts equal "
                           "the ids' ({} bad rows)",
                           T, K, bad_rows));
  report.check(sum_err < 1e-5, fmt::format("router: each token's probs sum to {}: max abs error "
                                           "{:.1e} (tol 1e-05)",
                                           want_sum, sum_err));

  if (dev.is_cuda()) {  // the CUDA kernels against the CPU reference, whole step
    const RouterRun ref = run_router_on(logits, bias, dprobs, c, Device::cpu(), backward, false);
    const bool same_ids =
        std::equal(ids, ids + T * K, ref.ids.data_ptr<int32_t>()) &&
        std::equal(r.counts.data_ptr<int32_t>(), r.counts.data_ptr<int32_t>() + E,
                   ref.counts.data_ptr<int32_t>());
    double perr = 0;
    for (int64_t i = 0; i < T * K; ++i)
      perr = std::max(perr, double(std::fabs(probs[i] - ref.probs.data_ptr<float>()[i])));
    const auto rel = [](const Tensor& a, const Tensor& b) {
      const double x = a.data_ptr<float>()[0], y = b.data_ptr<float>()[0];
      return std::fabs(x - y) / std::max(1e-30, std::fabs(y));
    };
    const double lerr = std::max(rel(r.aux, ref.aux), rel(r.z, ref.z));
    report.check(same_ids && perr < 1e-6 && lerr < 1e-5,
                 fmt::format("router: CUDA vs the CPU reference: {} experts and counts, probs max "
                             "abs error {:.1e} (tol 1e-06), losses rel error {:.1e} (tol 1e-05)",
                             same_ids ? "the same" : "DIFFERENT", perr, lerr));
    if (backward) {
      std::vector<double> want(static_cast<size_t>(T * E));
      for (int64_t i = 0; i < T * E; ++i) want[i] = ref.dlogits.data_ptr<float>()[i];
      const double gerr = rel_norm_error(r.dlogits.data_ptr<float>(), want.data(), T * E);
      report.check(gerr < 1e-5, fmt::format("router backward: CUDA vs the CPU reference: "
                                            "relative error {:.1e} (tol 1e-05)",
                                            gerr));
    } else {
      report.skip("router backward: CUDA vs the CPU reference", "--no-backward");
    }
  }
  Routing out;
  out.ids = dev.is_cpu() ? r.ids : r.ids.to(dev);
  out.probs = dev.is_cpu() ? r.probs : r.probs.to(dev);
  return out;
}

}  // namespace moeflow::bench
