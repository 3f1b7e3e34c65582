// `moeflow run`: one MoE token-path step on a preset, checked as it goes.
// Route (random router scores, softmax top-k) -> plan -> permute+pad ->
// identity experts -> unpermute with probs merged (must equal x * sum_k
// probs), the backward ops (same identity); then linear experts (grouped GEMM
// FC1 [E,F,H] and FC2 [E,H,F], no activation yet: the fused GLU comes with
// the grouped MLP) checked against a naive float64 computation per token.
#include <chrono>
#include <cmath>

#include <fmt/format.h>

#include "bench/bench.h"
#include "bench/presets.h"
#include "core/internal.h"

namespace moeflow::bench {

namespace {

// FC1 -> FC2 through the grouped GEMM on the plan's padded layout, then
// unpermute; checked against out[t] = sum_k p_k W2_e bf16(W1_e x_t) in float64.
bool run_linear_experts(const Preset& p, const RunOptions& opt, const Routing& routing,
                        const Tensor& x, const Tensor& x_host, const RoutingPlan& plan) {
  const Device dev = opt.device;
  const int64_t T = p.num_tokens, H = p.hidden, F = p.ffn;
  const int K = p.topk, E = p.num_experts;
  Tensor w1h = Tensor::empty({E, F, H}, DType::kBFloat16), w2h = Tensor::empty({E, H, F}, DType::kBFloat16);
  for (int64_t i = 0; i < w1h.numel(); ++i)
    detail::store_float(w1h.data(), DType::kBFloat16, i, std::cos(0.37f * static_cast<float>(i % 9973)) / std::sqrt(float(H)));
  for (int64_t i = 0; i < w2h.numel(); ++i)
    detail::store_float(w2h.data(), DType::kBFloat16, i, std::sin(0.53f * static_cast<float>(i % 7919)) / std::sqrt(float(F)));
  Tensor w1 = dev.is_cpu() ? w1h : w1h.to(dev), w2 = dev.is_cpu() ? w2h : w2h.to(dev);
  Tensor y = Tensor::empty({plan.capacity_rows, H}, DType::kBFloat16, dev);
  Tensor h = Tensor::empty({plan.capacity_rows, F}, DType::kBFloat16, dev);
  Tensor y2 = Tensor::empty({plan.capacity_rows, H}, DType::kBFloat16, dev);
  Tensor out = Tensor::empty({T, H}, DType::kFloat32, dev);
  const GroupLayout groups = GroupLayout::from_plan(plan);
  auto t0 = std::chrono::steady_clock::now();
  permute(x, plan, y);
  grouped_gemm_forward(y, GroupedWeights::from_stacked(w1), groups, h);
  grouped_gemm_forward(h, GroupedWeights::from_stacked(w2), groups, y2);
  unpermute(y2, plan, out, routing.probs);
  if (dev.is_cuda()) detail::cuda_stream_sync(nullptr);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("  {:<34} {:>9.1f} us\n", "linear experts (permute, FC1, FC2, unpermute)", us);

  Tensor o = out.to(Device::cpu()), ids = routing.ids.to(Device::cpu()), pr = routing.probs.to(Device::cpu());
  double num = 0, den = 0;
  std::vector<float> xt(H), hid(F);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < H; ++j) xt[j] = detail::load_float(x_host.data(), DType::kBFloat16, t * H + j);
    std::vector<double> want(H, 0.0);
    for (int k = 0; k < K; ++k) {
      const int e = ids.data_ptr<int32_t>()[t * K + k];
      if (e < 0) continue;
      const double w = pr.data_ptr<float>()[t * K + k];
      for (int64_t f = 0; f < F; ++f) {
        double s = 0;
        for (int64_t j = 0; j < H; ++j) s += double(xt[j]) * detail::load_float(w1h.data(), DType::kBFloat16, (e * F + f) * H + j);
        hid[f] = detail::bf16_to_float(detail::float_to_bf16(static_cast<float>(s)));
      }
      for (int64_t j = 0; j < H; ++j) {
        double s = 0;
        for (int64_t f = 0; f < F; ++f) s += double(hid[f]) * detail::load_float(w2h.data(), DType::kBFloat16, (e * H + j) * F + f);
        want[j] += w * detail::bf16_to_float(detail::float_to_bf16(static_cast<float>(s)));
      }
    }
    for (int64_t j = 0; j < H; ++j) {
      const double d = o.data_ptr<float>()[t * H + j] - want[j];
      num += d * d;
      den += want[j] * want[j];
    }
  }
  const double rel = std::sqrt(num / (den > 0 ? den : 1.0));
  const bool ok = rel < 1e-2;
  fmt::print("  check: linear experts vs float64: relative norm error {:.2e} {}\n", rel, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace

int run_layer(const RunOptions& opt) {
  const Preset& p = find_preset(opt.preset);
  const Device dev = opt.device;
  const int64_t T = p.num_tokens, H = p.hidden;
  const int K = p.topk, E = p.num_experts;
  fmt::print("moeflow run: preset {} (T={} H={} E={} K={}), align {}, on {}\n", p.name, T, H, E, K,
             opt.align, device_name(dev));
  const PlanConfig cfg{E, opt.align, -1};
  auto t0 = std::chrono::steady_clock::now();
  auto lap = [&](const char* what) {
    if (dev.is_cuda()) detail::cuda_stream_sync(nullptr);
    auto t1 = std::chrono::steady_clock::now();
    fmt::print("  {:<34} {:>9.1f} us\n", what, std::chrono::duration<double, std::micro>(t1 - t0).count());
    t0 = t1;
  };

  Routing routing = random_routing(T, E, K, 7, dev);
  Tensor x_host = Tensor::empty({T, H}, DType::kBFloat16);
  for (int64_t i = 0; i < T * H; ++i)
    detail::store_float(x_host.data(), DType::kBFloat16, i, std::sin(0.001f * static_cast<float>(i)));
  Tensor x = dev.is_cpu() ? x_host : x_host.to(dev);
  RoutingPlan plan = allocate_plan(T, K, cfg, dev);
  Tensor ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(T, K, cfg))}, DType::kUInt8, dev);
  Tensor y = Tensor::empty({plan.capacity_rows, H}, DType::kBFloat16, dev);
  Tensor pp = Tensor::empty({plan.capacity_rows}, DType::kFloat32, dev);
  Tensor out = Tensor::empty({T, H}, DType::kFloat32, dev);
  Tensor dy = Tensor::empty({plan.capacity_rows, H}, DType::kBFloat16, dev);
  Tensor dprobs = Tensor::empty({T, K}, DType::kFloat32, dev);
  Tensor dx = Tensor::empty({T, H}, DType::kFloat32, dev);
  lap("setup (allocation, routing)");

  build_plan(routing.ids, plan, ws);
  lap("plan");
  permute(x, plan, y, PermuteExtras{routing.probs, pp, {}, {}});
  lap("permute+pad");
  // experts: identity (the grouped expert MLP comes with the grouped GEMM)
  unpermute(y, plan, out, routing.probs);
  lap("unpermute (probs merged)");
  if (opt.backward) {
    // dout = 1: dy[row] = prob * 1, dprobs = <1, y_row> = sum_h x[t,h]
    Tensor ones = Tensor::empty({T, H}, DType::kFloat32);
    for (int64_t i = 0; i < T * H; ++i) ones.data_ptr<float>()[i] = 1.0f;
    Tensor dout = dev.is_cpu() ? ones : ones.to(dev);
    t0 = std::chrono::steady_clock::now();
    Tensor dy32 = Tensor::empty({plan.capacity_rows, H}, DType::kBFloat16, dev);
    unpermute_backward(dout, plan, y, routing.probs, dy32, dprobs);
    lap("unpermute_backward (+dprobs)");
    permute_backward(dy32, plan, dx);
    lap("permute_backward");
  }

  // Checks.
  const PlanStatus s = check_plan(plan);
  Tensor tpe = plan.tokens_per_expert.to(Device::cpu());
  int32_t mn = INT32_MAX, mx = 0;
  for (int e = 0; e < E; ++e) {
    mn = std::min(mn, tpe.data_ptr<int32_t>()[e]);
    mx = std::max(mx, tpe.data_ptr<int32_t>()[e]);
  }
  fmt::print("  plan: {} rows used of {} (capacity), tokens per expert {}..{}, {} dropped\n",
             s.total_rows, plan.capacity_rows, mn, mx, s.overflow);
  Tensor o = out.to(Device::cpu());
  Tensor pr = routing.probs.to(Device::cpu());
  Tensor g = dx.to(Device::cpu());
  Tensor dp = dprobs.to(Device::cpu());
  double max_err = 0, max_err_bwd = 0, max_err_dp = 0;
  for (int64_t t = 0; t < T; ++t) {
    double psum = 0, xsum = 0;
    for (int k = 0; k < K; ++k) psum += pr.data_ptr<float>()[t * K + k];
    for (int64_t h = 0; h < H; ++h) {
      const double xv = detail::load_float(x_host.data(), DType::kBFloat16, t * H + h);
      xsum += xv;
      max_err = std::max(max_err, std::fabs(o.data_ptr<float>()[t * H + h] - psum * xv));
      if (opt.backward)  // dx = sum_k bf16(prob_k)
        max_err_bwd = std::max(max_err_bwd, std::fabs(g.data_ptr<float>()[t * H + h] - psum));
    }
    if (opt.backward)
      for (int k = 0; k < K; ++k)
        max_err_dp = std::max(max_err_dp, std::fabs(dp.data_ptr<float>()[t * K + k] - xsum) /
                                              (1.0 + std::fabs(xsum)));
  }
  bool ok = max_err < 1e-5 && s.overflow == 0;
  fmt::print("  check: out = x * sum(probs): max abs error {:.2e} {}\n", max_err, max_err < 1e-5 ? "ok" : "FAILED");
  if (opt.backward) {
    ok = ok && max_err_bwd < 1e-2 && max_err_dp < 1e-4;
    fmt::print("  check: dx = sum(probs) (bf16 dy): max abs error {:.2e} {}\n", max_err_bwd,
               max_err_bwd < 1e-2 ? "ok" : "FAILED");
    fmt::print("  check: dprobs = sum_h x: max rel error {:.2e} {}\n", max_err_dp,
               max_err_dp < 1e-4 ? "ok" : "FAILED");
  }
  ok = run_linear_experts(p, opt, routing, x, x_host, plan) && ok;
  fmt::print("{}\n", ok ? "moeflow run: OK" : "moeflow run: FAILED");
  return ok ? 0 : 1;
}

}  // namespace moeflow::bench
