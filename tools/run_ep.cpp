// `moeflow run --ep`: one expert-parallel MoE layer step on every visible
// GPU (one rank each, one thread per rank): dispatch (the nccl or nvlink
// backend) -> the rank's experts' grouped MLP (probs-weighted SwiGLU) ->
// combine, then (unless --no-backward) combine_backward -> the MLP's input
// and weight gradients -> dispatch_backward. Checked per rank against the
// same layer without expert parallelism on that GPU (plan over all experts
// -> permute -> grouped MLP with all experts' weights -> unpermute, and
// their backward): the MLP rows are the same computations, only the order of
// the final float32 sums differs. out and dx are compared whole; dW on a
// sample (the first rows of dW1's two halves and of dW2 of each rank's
// first and last expert), against the sum over ranks of the reference's.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "bench/bench.h"
#include "bench/presets.h"
#include "moeflow/ep.h"
#include "tools/run_common.h"

namespace moeflow::bench {

namespace {

constexpr double kTolerance = 1e-3;
constexpr int64_t kSampleRows = 8;  // rows of each dW block compared per sampled expert

// Contiguous float32 elements [offset, offset + n) of t, on the host.
std::vector<double> fetch_f64(const Tensor& t, int64_t offset, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  copy(TensorView(t.data_ptr<float>() + offset, DType::kFloat32, t.device(), {n}),
       TensorView(v.data(), DType::kFloat32, Device::cpu(), {n}));
  return std::vector<double>(v.begin(), v.end());
}

// Relative norm error of two float32 tensors on one device, read in chunks.
double rel_error(const Tensor& got, const Tensor& want) {
  const int64_t n = want.numel(), chunk = int64_t{1} << 22;
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t m = std::min(chunk, n - i);
    const std::vector<double> g = fetch_f64(got, i, m), w = fetch_f64(want, i, m);
    for (int64_t j = 0; j < m; ++j) {
      num += (g[j] - w[j]) * (g[j] - w[j]);
      den += w[j] * w[j];
    }
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

// The sampled rows of expert `local` of a [*, 2F, H] dW1 and [*, H, F] dW2:
// dW1 rows [0, R) and [F, F + R), dW2 rows [0, R), concatenated.
std::vector<double> grad_sample(const Tensor& dw1, const Tensor& dw2, int64_t local, int64_t H,
                                int64_t F) {
  const int64_t R = std::min(kSampleRows, std::min(F, H));
  std::vector<double> v = fetch_f64(dw1, local * 2 * F * H, R * H);
  const std::vector<double> up = fetch_f64(dw1, (local * 2 * F + F) * H, R * H);
  const std::vector<double> w2 = fetch_f64(dw2, local * H * F, R * F);
  v.insert(v.end(), up.begin(), up.end());
  v.insert(v.end(), w2.begin(), w2.end());
  return v;
}

}  // namespace

int run_ep_layer(const RunOptions& opt) {
  const Preset& p = find_preset(opt.preset);
  const int W = cuda_device_count();
  MOEFLOW_CHECK(W >= 2,
                "run --ep needs at least 2 GPUs (expert parallelism splits the experts "
                "over the GPUs of this host); found ",
                W,
                ". Without --ep, `moeflow run` checks "
                "the layer on one GPU.");
  MOEFLOW_CHECK(p.num_experts % W == 0, "run --ep: preset ", p.name, " has ", p.num_experts,
                " experts, which do not split over ", W, " GPUs");
  const int64_t T = p.num_tokens, H = p.hidden, F = p.ffn;
  const int K = p.topk, E = p.num_experts, L = E / W;
  const bool nvlink = opt.ep_backend == "nvlink";
  fmt::print(
      "moeflow run --ep: preset {} (T={} per GPU, H={}, F={}, E={}, K={}), {} GPUs, "
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
  std::vector<std::unique_ptr<EpGroup>> groups;
  timed_step(Device::cpu(), "expert-parallel groups",
             [&] { groups = EpGroup::create_local(devs, eo); });
  const WeightPattern w1p = WeightPattern::fc1(H, std::max(H, F));
  const WeightPattern w2p = WeightPattern::fc2(F, std::max(H, F));
  // the sampled experts: each rank's first and last
  std::vector<int64_t> sampled;
  for (int q = 0; q < W; ++q) {
    sampled.push_back(int64_t{q} * L);
    if (L > 1) sampled.push_back(int64_t{q} * L + L - 1);
  }
  struct RankResult {
    double dispatch_us = 0, mlp_us = 0, combine_us = 0, bwd_us = 0;
    int64_t received = 0;
    double err_out = 0, err_dx = 0;
    std::vector<std::vector<double>> ep_dw;   // this rank's sampled experts
    std::vector<std::vector<double>> ref_dw;  // every sampled expert, this rank's tokens
  };
  std::vector<RankResult> res(W);
  timed_step(
      Device::cpu(),
      opt.backward ? "layer step fwd+bwd on every GPU, and the reference"
                   : "layer step forward on every GPU, and the reference",
      [&] {
        EpGroup::run_local(groups, [&](int r) {
          EpGroup& g = *groups[r];
          RankResult& rr = res[r];
          const Device dev = g.device();
          cudaStream_t stream;
          MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
          Routing routing = random_routing(T, E, K, 500 + r, dev);
          Tensor x = make_tokens(T, H, int64_t{r} * 7919).to(dev);
          Tensor dout = make_output_grad(T, H, int64_t{r} * 104729, DType::kBFloat16).to(dev);
          // EP: this rank's experts [r*L, (r+1)*L)
          Tensor w1 = w1p.make(int64_t{r} * L, L, 2 * F, H, dev);
          Tensor w2 = w2p.make(int64_t{r} * L, L, H, F, dev);
          const int64_t cap = g.capacity_rows();
          Tensor h = Tensor::empty({cap, 2 * F}, DType::kBFloat16, dev);
          Tensor a = Tensor::empty({cap, F}, DType::kBFloat16, dev);
          Tensor y = Tensor::empty({cap, H}, DType::kBFloat16, dev);
          Tensor out = Tensor::empty({T, H}, DType::kFloat32, dev);
          const GroupedMlpConfig cfg{};
          GroupedMlpWeights w;
          w.fc1 = w1;
          w.fc2 = w2;
          const GroupedMlpSaved saved{h, a};
          Tensor gy, dxr, dh, dpr, dx, dw1, dw2;
          if (opt.backward) {
            gy = Tensor::empty({cap, H}, DType::kBFloat16, dev);
            dxr = Tensor::empty({cap, H}, DType::kBFloat16, dev);
            dh = Tensor::empty({cap, 2 * F}, DType::kBFloat16, dev);
            dpr = Tensor::empty({cap}, DType::kFloat32, dev);
            dx = Tensor::empty({T, H}, DType::kFloat32, dev);
            dw1 = Tensor::empty({L, 2 * F, H}, DType::kFloat32, dev);
            dw2 = Tensor::empty({L, H, F}, DType::kFloat32, dev);
          }
          GroupedMlpGrads grads;  // dW1, dW2 = (accumulate off)
          grads.dw1 = dw1;
          grads.dw2 = dw2;
          cudaEvent_t ev[5];
          for (auto& e : ev) MOEFLOW_CUDA_CHECK(cudaEventCreate(&e));
          for (int it = 0; it < 2; ++it) {  // the second pass is timed
            MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[0], stream));
            EpDispatchResult d = ep_dispatch(g, x, routing.ids, routing.probs, stream);
            const GroupLayout gl = GroupLayout::from_plan(*d.plan);
            MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[1], stream));
            grouped_mlp_forward(d.x, w, gl, d.probs, cfg, y, saved, stream);
            MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[2], stream));
            ep_combine(g, d.handle, y, false, out, stream);  // the probs were applied in the MLP
            MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[3], stream));
            if (opt.backward) {
              ep_combine_backward(g, d.handle, dout, y, false, gy, {}, stream);
              grouped_mlp_backward_dgrad(gy, w, gl, d.probs, cfg, saved, dxr, dh, dpr, stream);
              ep_dispatch_backward(g, d.handle, dxr, dx, stream);
              grouped_mlp_backward_wgrad(gy, d.x, gl, saved, dh, grads, stream);
            }
            MOEFLOW_CUDA_CHECK(cudaEventRecord(ev[4], stream));
            rr.received = d.received_tokens;
          }
          MOEFLOW_CUDA_CHECK(cudaEventSynchronize(ev[4]));
          float ms[4];
          for (int i = 0; i < 4; ++i)
            MOEFLOW_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
          rr.dispatch_us = ms[0] * 1e3;
          rr.mlp_us = ms[1] * 1e3;
          rr.combine_us = ms[2] * 1e3;
          rr.bwd_us = ms[3] * 1e3;
          for (auto& e : ev) MOEFLOW_CUDA_CHECK(cudaEventDestroy(e));
          if (opt.backward)
            for (int64_t l : {int64_t{0}, int64_t{L - 1}}) {
              if (l == L - 1 && L == 1) break;
              rr.ep_dw.push_back(grad_sample(dw1, dw2, l, H, F));
            }
          w1 = w2 = dw1 = dw2 = Tensor();  // room for the reference's weights
          // The same layer without expert parallelism, on this GPU, all experts.
          const PlanConfig pc{E, opt.align, -1};
          RoutingPlan plan = allocate_plan(T, K, pc, dev);
          Tensor ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(T, K, pc))},
                                    DType::kUInt8, dev);
          build_plan(routing.ids, plan, ws, stream);
          const MlpInputs in{x, routing.probs, w1p.make(0, E, 2 * F, H, dev),
                             w2p.make(0, E, H, F, dev), dout};
          double ref_us = 0;
          const MlpOutputs ref = mlp_step(plan, in, opt.backward, &ref_us, stream);
          rr.err_out = rel_error(out, ref.out);
          if (opt.backward) {
            rr.err_dx = rel_error(dx, ref.dx);
            for (int64_t e : sampled) rr.ref_dw.push_back(grad_sample(ref.dw1, ref.dw2, e, H, F));
          }
          MOEFLOW_CUDA_CHECK(cudaStreamDestroy(stream));
        });
      });
  CheckReport report("moeflow run --ep");
  const int per_rank = L > 1 ? 2 : 1;
  for (int r = 0; r < W; ++r) {
    const RankResult& rr = res[r];
    fmt::print("  rank {}: dispatch {} | expert MLP {} | combine {}{}{}\n", r,
               format_time(rr.dispatch_us), format_time(rr.mlp_us), format_time(rr.combine_us),
               opt.backward ? fmt::format(" | backward {}", format_time(rr.bwd_us)) : "",
               rr.received >= 0 ? fmt::format(" | {} tokens received", rr.received) : "");
  }
  for (int r = 0; r < W; ++r) {
    const RankResult& rr = res[r];
    // dW of rank r's sampled experts: the sum over ranks of the reference's
    double err_dw = 0;
    if (opt.backward) {
      double num = 0, den = 0;
      for (int i = 0; i < per_rank; ++i) {
        const std::vector<double>& got = rr.ep_dw[i];
        for (size_t j = 0; j < got.size(); ++j) {
          double want = 0;
          for (int q = 0; q < W; ++q) want += res[q].ref_dw[r * per_rank + i][j];
          num += (got[j] - want) * (got[j] - want);
          den += want * want;
        }
      }
      err_dw = std::sqrt(num / (den > 0 ? den : 1.0));
    }
    const bool ok = rr.err_out < kTolerance && rr.err_dx < kTolerance && err_dw < kTolerance;
    report.check(
        ok, fmt::format("rank {} vs the layer without expert parallelism: relative norm errors "
                        "out {}{}{} (tol {:.0e})",
                        r, fmt::format("{:.1e}", rr.err_out),
                        opt.backward ? fmt::format(", dx {:.1e}", rr.err_dx) : "",
                        opt.backward
                            ? fmt::format(", dW1/dW2 {:.1e} (experts {}{}: first {} rows "
                                          "of dW1's halves and of dW2)",
                                          err_dw, int64_t{r} * L,
                                          L > 1 ? fmt::format(", {}", int64_t{r} * L + L - 1) : "",
                                          kSampleRows)
                            : "",
                        kTolerance));
  }
  if (!opt.backward) report.skip("backward (dx, dW) on every rank", "--no-backward");
  return report.finish();
}

}  // namespace moeflow::bench
