// `moeflow run --ep`: one expert-parallel MoE layer forward on every visible
// GPU (one rank each, one thread per rank): dispatch (the nccl or nvlink
// backend) -> the rank's experts' grouped MLP (probs-weighted SwiGLU) ->
// combine. Checked per rank against the same layer without expert
// parallelism on that GPU (plan over all experts -> permute -> grouped MLP
// with all experts' weights -> unpermute): the MLP rows are the same
// computations, only the order of the final float32 sums differs.
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
  std::vector<double> err(W, 0.0), dispatch_us(W), mlp_us(W), combine_us(W);
  std::vector<int64_t> received(W, 0);
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
    cudaEvent_t ev[4];
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
      received[r] = d.received_tokens;
    }
    MOEFLOW_CUDA_CHECK(cudaEventSynchronize(ev[3]));
    float ms[3];
    for (int i = 0; i < 3; ++i) MOEFLOW_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
    dispatch_us[r] = ms[0] * 1e3;
    mlp_us[r] = ms[1] * 1e3;
    combine_us[r] = ms[2] * 1e3;
    // The same layer without expert parallelism, on this GPU, all experts.
    {
      Tensor w1a = expert_weights(0, E, 2 * F, H, s1, 0.37f, dev);
      Tensor w2a = expert_weights(0, E, H, F, s2, 0.53f, dev);
      const PlanConfig pc{E, opt.align, -1};
      RoutingPlan plan = allocate_plan(T, K, pc, dev);
      Tensor ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(T, K, pc))}, DType::kUInt8, dev);
      build_plan(routing.ids, plan, ws, stream);
      const int64_t rows = plan.capacity_rows;
      Tensor xr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
      Tensor pr = Tensor::empty({rows}, DType::kFloat32, dev);
      Tensor hr = Tensor::empty({rows, 2 * F}, DType::kBFloat16, dev);
      Tensor ar = Tensor::empty({rows, F}, DType::kBFloat16, dev);
      Tensor yr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
      Tensor ref = Tensor::empty({T, H}, DType::kFloat32, dev);
      permute(x, plan, xr, PermuteExtras{routing.probs, pr, {}, {}}, stream);
      grouped_mlp_forward(xr, GroupedMlpWeights{w1a, w2a, {}, {}}, GroupLayout::from_plan(plan), pr,
                          cfg, yr, GroupedMlpSaved{hr, ar}, stream);
      unpermute(yr, plan, ref, {}, stream);
      MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
      Tensor o = out.to(Device::cpu()), rf = ref.to(Device::cpu());
      double num = 0, den = 0;
      for (int64_t i = 0; i < o.numel(); ++i) {
        const double d = double(o.data_ptr<float>()[i]) - rf.data_ptr<float>()[i];
        num += d * d;
        den += double(rf.data_ptr<float>()[i]) * rf.data_ptr<float>()[i];
      }
      err[r] = std::sqrt(num / (den > 0 ? den : 1.0));
    }
    for (auto& e : ev) MOEFLOW_CUDA_CHECK(cudaEventDestroy(e));
    MOEFLOW_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  bool ok = true;
  for (int r = 0; r < W; ++r) {
    const bool good = err[r] < 1e-3;
    ok = ok && good;
    fmt::print("  rank {}: dispatch {:8.1f} us | expert MLP {:8.1f} us | combine {:8.1f} us{}\n", r,
               dispatch_us[r], mlp_us[r], combine_us[r],
               received[r] >= 0 ? fmt::format(" | {} tokens received", received[r]) : "");
    fmt::print("  check rank {}: out vs the layer without expert parallelism: relative norm "
               "error {:.2e} {}\n",
               r, err[r], good ? "ok" : "FAILED");
  }
  fmt::print("{}\n", ok ? "moeflow run --ep: OK" : "moeflow run --ep: FAILED");
  return ok ? 0 : 1;
}

}  // namespace moeflow::bench
