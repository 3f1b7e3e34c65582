// `moeflow run`: one MoE token-path step on a preset, checked as it goes.
// Route (random router scores, softmax top-k) -> plan -> permute+pad ->
// experts (identity for now: the grouped expert MLP is not built yet) ->
// unpermute with probs merged; then the backward ops. The result must equal
// x * sum_k probs[t,k]; the backward ops are checked against the same identity.
#include <chrono>
#include <cmath>

#include <fmt/format.h>

#include "bench/bench.h"
#include "bench/presets.h"
#include "core/internal.h"

namespace moeflow::bench {

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
  fmt::print("{}\n", ok ? "moeflow run: OK" : "moeflow run: FAILED");
  return ok ? 0 : 1;
}

}  // namespace moeflow::bench
