// `moeflow run --ep`: one expert-parallel MoE layer step on every visible
// GPU (one rank each, one thread per rank): dispatch (the nccl or nvlink
// backend) -> the rank's experts' grouped MLP (probs-weighted SwiGLU) ->
// combine, then (unless --no-backward) combine_backward -> the MLP's input
// and weight gradients -> dispatch_backward. Checked per rank against the
// same layer without expert parallelism on that GPU (plan over all experts
// -> permute -> grouped MLP with all experts' weights -> unpermute, and
// their backward): the MLP rows are the same computations, only the order of
// the final float32 sums differs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include "bench/bench.h"
#include "bench/presets.h"
#include "core/internal.h"
#include "moeflow/ep.h"

namespace moeflow::bench {

namespace {

// Deterministic expert weights rows [first, first + n) of FC1 [E, 2F, H] and
// FC2 [E, H, F] (global expert e's rows do not depend on the slice).
Tensor expert_weights(int64_t first, int64_t n, int64_t rows, int64_t cols, float scale,
                      float freq, Device dev) {
  Tensor h = Tensor::empty({n, rows, cols}, DType::kBFloat16);
  const int64_t per = rows * cols;
  for (int64_t i = 0; i < h.numel(); ++i) {
    const int64_t g = first * per + i;
    detail::store_float(h.data(), DType::kBFloat16, i,
                        scale * std::cos(freq * static_cast<float>(g % 9973)));
  }
  return h.to(dev);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int run_ep_layer(const RunOptions& opt) {
  const Preset& p = find_preset(opt.preset);
  const int W = cuda_device_count();
  MOEFLOW_CHECK(W >= 1, "run --ep needs CUDA GPUs; found none");
  MOEFLOW_CHECK(p.num_experts % W == 0, "preset ", p.name, ": ", p.num_experts,
                " experts do not split over ", W, " GPUs");
  const int64_t T = p.num_tokens, H = p.hidden, F = p.ffn;
  const int K = p.topk, E = p.num_experts, L = E / W;
  const bool nvlink = opt.ep_backend == "nvlink";
  fmt::print("moeflow run --ep: preset {} (T={} per GPU, H={}, F={}, E={}, K={}), {} GPU(s), "
             "backend {}, align {}\n",
             p.name, T, H, F, E, K, W, opt.ep_backend, opt.align);
  EpOptions eo;
  eo.backend = nvlink ? EpBackend::kNvlink : EpBackend::kNccl;
  eo.num_experts = E;
  eo.topk = K;
  eo.hidden = H;
  eo.align = opt.align;
  eo.max_tokens_per_rank = T;
  std::vector<int> devs;
  for (int r = 0; r < W; ++r) devs.push_back(r);
  auto t0 = std::chrono::steady_clock::now();
  auto groups = EpGroup::create_local(devs, eo);
  fmt::print("  groups made ({:.1f} s)\n", seconds_since(t0));
  std::vector<double> err(W, 0.0), err_dx(W, 0.0), err_dw(W, 0.0), dispatch_us(W), mlp_us(W),
      combine_us(W), bwd_us(W, 0.0);
  std::vector<int64_t> received(W, 0);
  // dW: rank r's experts get the tokens of every rank, so the reference is the
  // sum over ranks of each rank's all-expert gradients (compared on the host
  // when that fits in a few GB)
  const double dw_bytes = 2.0 * W * double(E) * 3 * F * H * 4;
  const bool check_dw = opt.backward && dw_bytes < 16e9;
  std::vector<Tensor> ep_dw1(W), ep_dw2(W), ref_dw1(W), ref_dw2(W);
  std::mutex print_mu;
  EpGroup::run_local(groups, [&](int r) {
    EpGroup& g = *groups[r];
    const Device dev = g.device();
    cudaStream_t stream;
    MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Routing routing = random_routing(T, E, K, 500 + r, dev);
    Tensor xh = Tensor::empty({T, H}, DType::kBFloat16);
    for (int64_t i = 0; i < xh.numel(); ++i)
      detail::store_float(xh.data(), DType::kBFloat16, i, std::sin(0.001f * static_cast<float>(i + r * 7919)));
    Tensor x = xh.to(dev);
    const float s1 = 2.0f / std::sqrt(float(H)), s2 = 1.0f / std::sqrt(float(F));
    // EP: this rank's experts [r*L, (r+1)*L)
    Tensor w1 = expert_weights(int64_t{r} * L, L, 2 * F, H, s1, 0.37f, dev);
    Tensor w2 = expert_weights(int64_t{r} * L, L, H, F, s2, 0.53f, dev);
    const int64_t cap = g.capacity_rows();
    Tensor h = Tensor::empty({cap, 2 * F}, DType::kBFloat16, dev);
    Tensor a = Tensor::empty({cap, F}, DType::kBFloat16, dev);
    Tensor y = Tensor::empty({cap, H}, DType::kBFloat16, dev);
    Tensor out = Tensor::empty({T, H}, DType::kFloat32, dev);
    const GroupedMlpConfig cfg{};
    Tensor douth = Tensor::empty({T, H}, DType::kBFloat16);
    for (int64_t i = 0; i < douth.numel(); ++i)
      detail::store_float(douth.data(), DType::kBFloat16, i, std::cos(0.011f * static_cast<float>((i + r * 104729) % 10007)));
    Tensor dout = douth.to(dev);
    Tensor gy = Tensor::empty({cap, H}, DType::kBFloat16, dev);
    Tensor dxr = Tensor::empty({cap, H}, DType::kBFloat16, dev);
    Tensor dh = Tensor::empty({cap, 2 * F}, DType::kBFloat16, dev);
    Tensor dpr = Tensor::empty({cap}, DType::kFloat32, dev);
    Tensor dx = Tensor::empty({T, H}, DType::kFloat32, dev);
    Tensor dw1 = Tensor::empty({L, 2 * F, H}, DType::kFloat32, dev);
    Tensor dw2 = Tensor::empty({L, H, F}, DType::kFloat32, dev);
    cudaEvent_t ev[5];
    for (auto& e : ev) MOEFLOW_CUDA_CHECK(cudaEventCreate(&e));
    for (int it = 0; it < 2; ++it) {  // the second pass is timed
      MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[0], stream));
      EpDispatchResult d = ep_dispatch(g, x, routing.ids, routing.probs, stream);
      MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[1], stream));
      grouped_mlp_forward(d.x, GroupedMlpWeights{w1, w2, {}, {}}, GroupLayout::from_plan(*d.plan),
                          d.probs, cfg, y, GroupedMlpSaved{h, a}, stream);
      MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[2], stream));
      ep_combine(g, y, false, out, stream);  // the probs were applied in the MLP
      MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[3], stream));
      if (opt.backward) {
        const GroupLayout gl = GroupLayout::from_plan(*d.plan);
        ep_combine_backward(g, dout, y, false, gy, {}, stream);
        grouped_mlp_backward_dgrad(gy, GroupedMlpWeights{w1, w2, {}, {}}, gl, d.probs, cfg,
                                   GroupedMlpSaved{h, a}, dxr, dh, dpr, stream);
        ep_dispatch_backward(g, dxr, dx, stream);
        grouped_mlp_backward_wgrad(gy, d.x, gl, GroupedMlpSaved{h, a}, dh,
                                   GroupedMlpGrads{dw1, dw2, {}, {}, false}, stream);
      }
      MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[4], stream));
      received[r] = d.received_tokens;
    }
    MOEFLOW_CUDA_CHECK(cudaEventSynchronize(ev[4]));
    float ms[4];
    for (int i = 0; i < 4; ++i) MOEFLOW_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
    dispatch_us[r] = ms[0] * 1e3;
    mlp_us[r] = ms[1] * 1e3;
    combine_us[r] = ms[2] * 1e3;
    bwd_us[r] = ms[3] * 1e3;
    // The same layer without expert parallelism, on this GPU, all experts.
    {
      Tensor w1a = expert_weights(0, E, 2 * F, H, s1, 0.37f, dev);
      Tensor w2a = expert_weights(0, E, H, F, s2, 0.53f, dev);
      const PlanConfig pc{E, opt.align, -1};
      RoutingPlan plan = allocate_plan(T, K, pc, dev);
      Tensor ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(T, K, pc))}, DType::kUInt8, dev);
      build_plan(routing.ids, plan, ws, stream);
      double ref_us = 0;
      const MlpStep ref = mlp_step(p, plan, x, routing.probs, w1a, w2a, dout, opt.backward,
                                   &ref_us, stream);
      auto rel = [](const Tensor& got, const Tensor& want) {
        Tensor g = got.to(Device::cpu());
        double num = 0, den = 0;
        for (int64_t i = 0; i < g.numel(); ++i) {
          const double gv = g.data_ptr<float>()[i], wv = want.data_ptr<float>()[i];
          num += (gv - wv) * (gv - wv);
          den += wv * wv;
        }
        return std::sqrt(num / (den > 0 ? den : 1.0));
      };
      err[r] = rel(out, ref.out);
      if (opt.backward) err_dx[r] = rel(dx, ref.dx);
      if (check_dw) {
        ep_dw1[r] = dw1.to(Device::cpu());
        ep_dw2[r] = dw2.to(Device::cpu());
        ref_dw1[r] = ref.dw1;
        ref_dw2[r] = ref.dw2;
      }
    }
    for (auto& e : ev) MOEFLOW_CUDA_CHECK(cudaEventDestroy(e));
    MOEFLOW_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  if (check_dw)
    for (int r = 0; r < W; ++r) {  // rank r's experts: rows [r*L, (r+1)*L) of the sums
      auto rel_sum = [&](const Tensor& got, const std::vector<Tensor>& refs) {
        const int64_t n = got.numel(), off = int64_t{r} * n;
        double num = 0, den = 0;
        for (int64_t i = 0; i < n; ++i) {
          double w = 0;
          for (int q = 0; q < W; ++q) w += refs[q].data_ptr<float>()[off + i];
          const double d = got.data_ptr<float>()[i] - w;
          num += d * d;
          den += w * w;
        }
        return std::sqrt(num / (den > 0 ? den : 1.0));
      };
      err_dw[r] = std::max(rel_sum(ep_dw1[r], ref_dw1), rel_sum(ep_dw2[r], ref_dw2));
    }
  else if (opt.backward)
    fmt::print("  (dW not compared: the all-expert gradients of {} ranks would take {:.0f} GB)\n",
               W, dw_bytes / 1e9);
  bool ok = true;
  for (int r = 0; r < W; ++r) {
    const bool good = err[r] < 1e-3 && err_dx[r] < 1e-3 && err_dw[r] < 1e-3;
    ok = ok && good;
    fmt::print("  rank {}: dispatch {:8.1f} us | expert MLP {:8.1f} us | combine {:8.1f} us{}{}\n", r,
               dispatch_us[r], mlp_us[r], combine_us[r],
               opt.backward ? fmt::format(" | backward {:8.1f} us", bwd_us[r]) : "",
               received[r] >= 0 ? fmt::format(" | {} tokens received", received[r]) : "");
    fmt::print("  check rank {}: vs the layer without expert parallelism, relative norm errors: "
               "out {:.1e}{}{} {}\n",
               r, err[r],
               opt.backward ? fmt::format(", dx {:.1e}", err_dx[r]) : "",
               check_dw ? fmt::format(", dW1/dW2 {:.1e}", err_dw[r]) : "",
               good ? "ok" : "FAILED");
  }
  fmt::print("{}\n", ok ? "moeflow run --ep: OK" : "moeflow run --ep: FAILED");
  return ok ? 0 : 1;
}

}  // namespace moeflow::bench
