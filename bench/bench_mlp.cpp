// `moeflow bench mlp`: the grouped expert MLP (SwiGLU, router-probability
// weighting), forward + backward (dgrad now, wgrad into float32 main
// gradients with accumulation), on the dsv3 / mixtral / qwen3-30b shapes of
// bench/presets.cpp, next to bench/peers_mlp.py (the PyTorch composite,
// run in the same device command). Reports the step time, TFLOP/s and the
// bytes of the buffers a step needs beyond its inputs, weights and gradients.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "bench/bench.h"
#include "moeflow/grouped_mlp.h"

namespace moeflow::bench {

namespace {

struct MlpCase {
  const char* name;
  int experts;
  int64_t rows, hidden, ffn;
};

}  // namespace

void run_mlp_bench(const MlpBenchOptions& opt) {
  const Device dev = opt.device;
  MOEFLOW_CHECK(dev.is_cuda(), "bench mlp needs a CUDA device");
  const std::vector<MlpCase> all = {{"dsv3", 32, 65536, 7168, 2048},
                                    {"mixtral", 8, 32768, 4096, 14336},
                                    {"qwen3-30b", 128, 131072, 2048, 768}};
  cudaStream_t stream = nullptr;
  nlohmann::json rows = nlohmann::json::array();
  fmt::print(
      "moeflow bench mlp on {}: SwiGLU, bf16, probs-weighted, fp32 main grads (accumulate)\n",
      device_name(dev));
  for (const MlpCase& c : all) {
    if (!opt.cases.empty() &&
        std::find(opt.cases.begin(), opt.cases.end(), c.name) == opt.cases.end())
      continue;
    const int64_t E = c.experts, M = c.rows, H = c.hidden, F = c.ffn;
    fmt::print("[{}] E={} rows={} H={} F={} ...\n", c.name, E, M, H, F);
    std::fflush(stdout);
    const std::vector<int64_t> sizes = uneven_split(c.experts, M, 0);
    Tensor offs = Tensor::empty({E + 1}, DType::kInt64);
    offs.data_ptr<int64_t>()[0] = 0;
    for (int64_t e = 0; e < E; ++e)
      offs.data_ptr<int64_t>()[e + 1] = offs.data_ptr<int64_t>()[e] + sizes[e];
    Tensor offs_g = offs.to(dev);
    GroupLayout layout;
    layout.offsets = offs_g;
    const DType bf = DType::kBFloat16;
    Tensor x = Tensor::empty({M, H}, bf, dev), dy = Tensor::empty({M, H}, bf, dev);
    Tensor w1 = Tensor::empty({E, 2 * F, H}, bf, dev), w2 = Tensor::empty({E, H, F}, bf, dev);
    Tensor probs = Tensor::empty({M}, DType::kFloat32, dev);
    // Random operands, as the peer's randn (a constant draws less power and
    // runs at a higher clock); weights scaled by 1/sqrt(fan-in).
    const float s1 = std::sqrt(3.0f / static_cast<float>(H)),
                s2 = std::sqrt(3.0f / static_cast<float>(F));
    fill_uniform(x, 1, -1.0f, 1.0f, stream);
    fill_uniform(dy, 2, -1.0f, 1.0f, stream);
    fill_uniform(w1, 3, -s1, s1, stream);
    fill_uniform(w2, 4, -s2, s2, stream);
    fill_uniform(probs, 5, 0.0f, 1.0f, stream);
    Tensor dw1 = Tensor::zeros({E, 2 * F, H}, DType::kFloat32, dev),
           dw2 = Tensor::zeros({E, H, F}, DType::kFloat32, dev);
    // The step's device memory beyond inputs, weights and their gradients, measured: free memory
    // before its buffers are allocated minus free memory after forward+backward ran (the library
    // allocates nothing itself; this would show it if it did).
    size_t free_before = 0, free_after = 0, total = 0;
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    MOEFLOW_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
    Tensor y = Tensor::empty({M, H}, bf, dev), h = Tensor::empty({M, 2 * F}, bf, dev),
           a = Tensor::empty({M, F}, bf, dev);
    Tensor dx = Tensor::empty({M, H}, bf, dev), d_h = Tensor::empty({M, 2 * F}, bf, dev);
    Tensor dprobs = Tensor::empty({M}, DType::kFloat32, dev);
    GroupedMlpWeights w{w1, w2, {}, {}};
    GroupedMlpConfig cfg;
    const GroupedMlpSaved saved{h, a};
    GroupedMlpGrads grads{dw1, dw2, {}, {}, true};
    auto fwd = [&] { grouped_mlp_forward(x, w, layout, probs, cfg, y, saved, stream); };
    auto bwd_with = [&](const GroupedMlpConfig& c) {
      grouped_mlp_backward_dgrad(dy, w, layout, probs, c, saved, dx, d_h, dprobs, stream);
      grouped_mlp_backward_wgrad(dy, x, layout, saved, d_h, grads, c.gemm, stream);
    };
    auto bwd = [&] { bwd_with(cfg); };
    TimingOptions t = opt.timing;
    t.flush_l2 = false;
    const double fwd_us = time_us(dev, stream, fwd, t);
    const double step_us = time_us(
        dev, stream,
        [&] {
          fwd();
          bwd();
        },
        t);
    // The dGLU step alone (a separate kernel between FC2 dgrad and FC1 dgrad):
    // the most that fusing it into the FC2 dgrad epilogue could save.
    const double dglu_us = time_us(
        dev, stream,
        [&] { grouped_mlp_activation_backward(h, layout, probs, cfg, d_h, dprobs, stream); }, t);
    // The step with the dGLU fused into the FC2 dgrad epilogue instead.
    GroupedMlpConfig cfg_fused = cfg;
    cfg_fused.gemm.fused_dglu = true;
    const double step_fused_us = time_us(
        dev, stream,
        [&] {
          fwd();
          bwd_with(cfg_fused);
        },
        t);
    // Keeping only h from forward to backward: dgrad without saved.a, then a
    // recomputed from h just before wgrad (a's buffer is free in between).
    const double recompute_us = time_us(
        dev, stream, [&] { grouped_mlp_recompute_activation(h, layout, probs, cfg, a, stream); },
        t);
    const double step_recompute_us = time_us(
        dev, stream,
        [&] {
          fwd();
          grouped_mlp_backward_dgrad(dy, w, layout, probs, cfg, GroupedMlpSaved{h, {}}, dx, d_h,
                                     dprobs, stream);
          grouped_mlp_recompute_activation(h, layout, probs, cfg, a, stream);
          grouped_mlp_backward_wgrad(dy, x, layout, saved, d_h, grads, stream);
        },
        t);
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    MOEFLOW_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
    const double held = static_cast<double>(free_before) - static_cast<double>(free_after);
    const double flops = 3.0 * 2.0 * M * H * 3.0 * F;
    const double extra = static_cast<double>(y.nbytes() + h.nbytes() + a.nbytes() + d_h.nbytes() +
                                             dx.nbytes() + dprobs.nbytes());
    fmt::print(
        "    forward {:>9} | forward+backward {:>9} ({:6.1f} TFLOP/s) | step buffers "
        "{:8.0f} MiB (y, h, a, d_h, dx, dprobs; device memory the step held, measured: {:.0f} "
        "MiB)\n      dGLU kernel {:>9} ({:.1f}% of the step); forward+backward with the dGLU "
        "fused into FC2 dgrad {:>9}\n",
        format_time(fwd_us), format_time(step_us), flops / step_us / 1e6, extra / (1 << 20),
        held / (1 << 20), format_time(dglu_us), 100.0 * dglu_us / step_us,
        format_time(step_fused_us));
    fmt::print(
        "      keeping only h (a recomputed before wgrad, {:.0f} MiB less held from forward to "
        "backward): forward+backward {:>9}, the recompute {:>9}\n",
        static_cast<double>(a.nbytes()) / (1 << 20), format_time(step_recompute_us),
        format_time(recompute_us));
    std::fflush(stdout);
    rows.push_back({{"case", c.name},
                    {"forward_us", fwd_us},
                    {"fwd_bwd_us", step_us},
                    {"TFLOPs", flops / step_us / 1e6},
                    {"step_buffers_MiB", extra / (1 << 20)},
                    {"step_device_memory_MiB", held / (1 << 20)},
                    {"dglu_us", dglu_us},
                    {"fwd_bwd_fused_dglu_us", step_fused_us},
                    {"fwd_bwd_keep_h_only_us", step_recompute_us},
                    {"recompute_activation_us", recompute_us},
                    {"a_MiB", static_cast<double>(a.nbytes()) / (1 << 20)}});
  }
  if (!opt.json_path.empty()) {
    std::ofstream f(opt.json_path);
    MOEFLOW_CHECK(f.good(), "--json: cannot write '", opt.json_path, "'");
    f << nlohmann::json{{"device", device_name(dev)}, {"rows", rows}}.dump(1) << "\n";
    fmt::print("wrote {}\n", opt.json_path);
  }
}

}  // namespace moeflow::bench
