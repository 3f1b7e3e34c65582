// `moeflow run`: one MoE token-path step on a preset, checked as it goes.
// Route (random router scores, softmax top-k) -> plan -> permute+pad ->
// identity experts -> unpermute with probs merged (must equal x * sum_k
// probs), the backward ops (same identity); then the grouped expert MLP
// (FC1 [E,2F,H] -> probs-weighted SwiGLU -> FC2 [E,H,F]) forward and backward,
// checked against float64 per token and, on a GPU, against the CPU reference.
#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>

#include "bench/bench.h"
#include "bench/presets.h"
#include "core/internal.h"

namespace moeflow::bench {

// The grouped expert MLP on the plan's padded layout: permute (probs along)
// -> FC1 + weighted SwiGLU (the rows' probs) -> FC2 -> unpermute, then the
// backward of all of it with dout given: unpermute_backward -> MLP input
// gradient (+ dprobs of the rows) -> permute_backward, and the weight
// gradients (delayed wgrad). Runs on the device of `x`.
MlpStep mlp_step(const Preset& p, const RoutingPlan& plan, const Tensor& x, const Tensor& probs,
                 const Tensor& w1, const Tensor& w2, const Tensor& dout, bool backward,
                 double* us, cudaStream_t stream) {
  const Device dev = x.device();
  const int64_t T = p.num_tokens, H = p.hidden, F = p.ffn, rows = plan.capacity_rows;
  const int E = p.num_experts;
  Tensor xr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
  Tensor pr = Tensor::empty({rows}, DType::kFloat32, dev);
  Tensor h = Tensor::empty({rows, 2 * F}, DType::kBFloat16, dev);
  Tensor a = Tensor::empty({rows, F}, DType::kBFloat16, dev);
  Tensor yr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
  Tensor out = Tensor::empty({T, H}, DType::kFloat32, dev);
  Tensor dyr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
  Tensor dxr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
  Tensor dh = Tensor::empty({rows, 2 * F}, DType::kBFloat16, dev);
  Tensor dpr = Tensor::empty({rows}, DType::kFloat32, dev);
  Tensor dx = Tensor::empty({T, H}, DType::kFloat32, dev);
  Tensor dw1 = Tensor::empty({E, 2 * F, H}, DType::kFloat32, dev);
  Tensor dw2 = Tensor::empty({E, H, F}, DType::kFloat32, dev);
  const GroupLayout groups = GroupLayout::from_plan(plan);
  const GroupedMlpWeights w{w1, w2, {}, {}};
  const GroupedMlpConfig cfg{};  // SwiGLU, [gate; up] halves
  const GroupedMlpSaved saved{h, a};
  if (dev.is_cuda()) detail::cuda_stream_sync(stream);
  const auto t0 = std::chrono::steady_clock::now();
  permute(x, plan, xr, PermuteExtras{probs, pr, {}, {}}, stream);
  grouped_mlp_forward(xr, w, groups, pr, cfg, yr, saved, stream);
  unpermute(yr, plan, out, {}, stream);
  if (backward) {
    unpermute_backward(dout, plan, {}, {}, dyr, {}, stream);
    grouped_mlp_backward_dgrad(dyr, w, groups, pr, cfg, saved, dxr, dh, dpr, stream);
    permute_backward(dxr, plan, dx, {}, {}, stream);
    grouped_mlp_backward_wgrad(dyr, xr, groups, saved, dh, GroupedMlpGrads{dw1, dw2, {}, {}, false},
                               stream);
  }
  if (dev.is_cuda()) detail::cuda_stream_sync(stream);
  *us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  const Device cpu = Device::cpu();
  if (!backward) return {out.to(cpu), {}, {}, {}, {}};
  return {out.to(cpu), dx.to(cpu), dpr.to(cpu), dw1.to(cpu), dw2.to(cpu)};
}

namespace {

// Relative norm error of got against want (same shape, float32 or bf16).
double rel_err(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = detail::load_float(got.data(), got.dtype(), i),
                 w = detail::load_float(want.data(), want.dtype(), i);
    num += (g - w) * (g - w);
    den += w * w;
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

// The expert MLP step on opt.device, checked: the forward output of up to 64
// tokens spread over T against float64, and on a GPU (small presets) the
// whole step (out, dx, dW1, dW2, dprobs) against the CPU reference backend on
// the same inputs.
bool run_expert_mlp(const Preset& p, const RunOptions& opt, const Routing& routing,
                    const Tensor& x_host, const RoutingPlan& plan) {
  const Device dev = opt.device;
  const int64_t T = p.num_tokens, H = p.hidden, F = p.ffn;
  const int K = p.topk, E = p.num_experts;
  Tensor w1h = Tensor::empty({E, 2 * F, H}, DType::kBFloat16), w2h = Tensor::empty({E, H, F}, DType::kBFloat16);
  for (int64_t i = 0; i < w1h.numel(); ++i)
    detail::store_float(w1h.data(), DType::kBFloat16, i, 2.0f * std::cos(0.37f * static_cast<float>(i % 9973)) / std::sqrt(float(H)));
  for (int64_t i = 0; i < w2h.numel(); ++i)
    detail::store_float(w2h.data(), DType::kBFloat16, i, std::sin(0.53f * static_cast<float>(i % 7919)) / std::sqrt(float(F)));
  // The CPU reference costs about 18 x rows x H x F multiply-adds (fwd+bwd).
  const bool small = 18.0 * double(plan.capacity_rows) * double(H) * double(F) < 3e10;
  if (dev.is_cpu() && !small) {
    fmt::print("  expert MLP skipped: preset {} is too large for the CPU reference backend (use a "
               "GPU, or --preset tiny)\n", p.name);
    return true;
  }
  Tensor douth = Tensor::empty({T, H}, DType::kFloat32);
  for (int64_t i = 0; i < douth.numel(); ++i) douth.data_ptr<float>()[i] = std::cos(0.011f * static_cast<float>(i % 10007));
  const Tensor ids = routing.ids.to(Device::cpu()), pr = routing.probs.to(Device::cpu());
  double us = 0;
  const MlpStep got = mlp_step(p, plan, x_host.to(dev), routing.probs, w1h.to(dev), w2h.to(dev), douth.to(dev), opt.backward, &us);
  fmt::print("  {:<34} {:>9.1f} us\n",
             opt.backward ? "expert MLP fwd+bwd (SwiGLU)" : "expert MLP forward (SwiGLU)", us);

  // Forward, float64 per token with the kernels' bf16 roundings (h, a, y).
  // tokens checked: up to 64, fewer on large presets (about 2e9 multiply-adds)
  const int64_t n_check = std::clamp<int64_t>(2'000'000'000 / (int64_t{K} * 3 * F * H), 1, 64);
  const int64_t step = std::max<int64_t>(1, T / n_check);
  double num = 0, den = 0;
  std::vector<double> xt(H), hid(2 * F), act(F);
  auto w1 = [&](int64_t i) { return detail::load_float(w1h.data(), DType::kBFloat16, i); };
  auto w2 = [&](int64_t i) { return detail::load_float(w2h.data(), DType::kBFloat16, i); };
  auto bf = [](double v) { return double(detail::bf16_to_float(detail::float_to_bf16(static_cast<float>(v)))); };
  for (int64_t t = 0; t < T; t += step) {
    for (int64_t j = 0; j < H; ++j) xt[j] = detail::load_float(x_host.data(), DType::kBFloat16, t * H + j);
    std::vector<double> want(H, 0.0);
    for (int k = 0; k < K; ++k) {
      const int e = ids.data_ptr<int32_t>()[t * K + k];
      if (e < 0) continue;
      const double pk = pr.data_ptr<float>()[t * K + k];
      for (int64_t f = 0; f < 2 * F; ++f) {
        double s = 0;
        for (int64_t j = 0; j < H; ++j) s += xt[j] * w1((e * 2 * F + f) * H + j);
        hid[f] = bf(s);
      }
      for (int64_t f = 0; f < F; ++f) {
        const double g = hid[f], u = hid[F + f];
        act[f] = bf(pk * g / (1.0 + std::exp(-g)) * u);
      }
      for (int64_t j = 0; j < H; ++j) {
        double s = 0;
        for (int64_t f = 0; f < F; ++f) s += act[f] * w2((e * H + j) * F + f);
        want[j] += bf(s);
      }
    }
    for (int64_t j = 0; j < H; ++j) {
      const double d = got.out.data_ptr<float>()[t * H + j] - want[j];
      num += d * d;
      den += want[j] * want[j];
    }
  }
  const double fwd = std::sqrt(num / (den > 0 ? den : 1.0));
  bool ok = fwd < 1e-2;
  fmt::print("  check: expert MLP out vs float64 ({} tokens): relative norm error {:.2e} {}\n",
             (T + step - 1) / step, fwd, fwd < 1e-2 ? "ok" : "FAILED");
  // The same step on the CPU reference backend (small presets).
  if (dev.is_cuda() && !small)
    fmt::print("  check: expert MLP fwd+bwd vs CPU reference skipped (preset too large for the "
               "CPU; the tests cover it)\n");
  if (dev.is_cuda() && small) {
    const PlanConfig pc{E, opt.align, -1};
    RoutingPlan cplan = allocate_plan(T, K, pc, Device::cpu());
    Tensor ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(T, K, pc))}, DType::kUInt8);
    build_plan(ids, cplan, ws);
    double cus = 0;
    const MlpStep want = mlp_step(p, cplan, x_host, pr, w1h, w2h, douth, opt.backward, &cus);
    const struct { const char* what; const Tensor& g; const Tensor& w; } cmp[] = {
        {"out", got.out, want.out}, {"dx", got.dx, want.dx}, {"dprobs", got.dprobs, want.dprobs},
        {"dW1", got.dw1, want.dw1}, {"dW2", got.dw2, want.dw2}};
    std::string line;
    bool all = true;
    for (const auto& c : cmp) {
      if (!c.w.defined()) continue;  // --no-backward
      const double e = rel_err(c.g, c.w);
      all = all && e < 2e-2;
      line += fmt::format(" {} {:.1e}", c.what, e);
    }
    ok = ok && all;
    fmt::print("  check: expert MLP fwd+bwd vs CPU reference, relative norm errors:{} {}\n", line,
               all ? "ok" : "FAILED");
  }
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
  ok = run_expert_mlp(p, opt, routing, x_host, plan) && ok;
  fmt::print("{}\n", ok ? "moeflow run: OK" : "moeflow run: FAILED");
  return ok ? 0 : 1;
}

}  // namespace moeflow::bench
