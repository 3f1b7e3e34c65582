// `moeflow bench permute`: plan build, permute (+pad), plan+permute end to
// end, unpermute with probs merged, and the two backward ops, per preset.
// Bytes are counted by hand as in docs/performance.md:
//   permute / unpermute / permute_backward: (T + T*K) * H * bytes(dtype)
//   unpermute_backward (dy + dprobs):       (T + 2*T*K) * H * bytes(dtype)
//   permute+quantize (fp8):                 T*H*bytes(dtype) + T*K*(H + 4*ceil(H/128))
//   unpermute_backward+quantize (fp8):      the same (dout read once, codes + scales written)
//   permute+quantize both ways (fp8):       T*H*bytes(dtype) + 2*T*K*(H + 4*ceil(H/128)) (the
//                                           rowwise and the columnwise codes with their scales;
//                                           the same count for the two-step path it replaces)
// (pad-row zeros are not counted: they are work we must do but not data).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>

#include "bench/bench.h"
#include "bench/presets.h"
#include "moeflow/quantize.h"

namespace moeflow::bench {

Device parse_device(const std::string& s) {
  if (s == "auto") return cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu();
  if (s == "cpu") return Device::cpu();
  if (s == "cuda" || s.rfind("cuda:", 0) == 0) {
    const std::string digits = s == "cuda" ? "0" : s.substr(5);
    MOEFLOW_CHECK(!digits.empty() && digits.size() < 6 &&
                      digits.find_first_not_of("0123456789") == std::string::npos,
                  "--device must be auto, cpu, cuda or cuda:N; got '", s, "'");
    const int index = std::stoi(digits), n = cuda_device_count();
#ifdef MOEFLOW_WITH_CUDA
    MOEFLOW_CHECK(n > 0, "--device ", s, ": no CUDA GPU is visible; use --device cpu");
#else
    MOEFLOW_CHECK(n > 0, "--device ", s, ": this moeflow was built without CUDA; use --device cpu");
#endif
    MOEFLOW_CHECK(index < n, "--device ", s, ": this machine has ", n,
                  " CUDA GPU(s), cuda:0..cuda:", n - 1);
    return Device::cuda(index);
  }
  MOEFLOW_CHECK(false, "--device must be auto, cpu, cuda or cuda:N; got '", s, "'");
}

DType parse_float_dtype(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::kBFloat16;
  if (s == "fp16" || s == "float16") return DType::kFloat16;
  if (s == "fp32" || s == "float32") return DType::kFloat32;
  MOEFLOW_CHECK(false, "--dtype must be bf16, fp16 or fp32; got '", s, "'");
}

Routing random_routing(int64_t T, int E, int K, uint32_t seed, Device device) {
  MOEFLOW_CHECK(K <= E, "top-k (", K, ") must be <= the number of experts (", E, ")");
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Tensor ids = Tensor::empty({T, K}, DType::kInt32);
  Tensor probs = Tensor::empty({T, K}, DType::kFloat32);
  std::vector<float> score(E);
  std::vector<int> order(E);
  for (int64_t t = 0; t < T; ++t) {
    float mx = -1e30f;
    for (int e = 0; e < E; ++e) mx = std::max(mx, score[e] = normal(rng));
    double z = 0;
    for (int e = 0; e < E; ++e) z += std::exp(score[e] - mx);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int a, int b) { return score[a] > score[b]; });
    for (int k = 0; k < K; ++k) {
      ids.data_ptr<int32_t>()[t * K + k] = order[k];
      probs.data_ptr<float>()[t * K + k] = static_cast<float>(std::exp(score[order[k]] - mx) / z);
    }
  }
  if (device.is_cpu()) return {ids, probs};
  return {ids.to(device), probs.to(device)};
}

void run_permute_bench(const PermuteBenchOptions& opt) {
  const Device dev = opt.device;
  cudaStream_t stream = nullptr;
  const size_t esize = dtype_size(opt.dtype);
  std::vector<Row> rows;
  fmt::print("moeflow bench permute on {}, {}, align {}\n", device_name(dev), dtype_name(opt.dtype),
             opt.align);
  std::fflush(stdout);
  const double copy_gbps = copy_bandwidth_gbps(dev, stream, opt.timing);
  const double write_gbps = write_bandwidth_gbps(dev, stream, opt.timing);
  rows.push_back(Row{"-", "device copy (ceiling)", 0, 0, copy_gbps, copy_gbps});
  rows.push_back(Row{"-", "device write (memset)", 0, 0, write_gbps, copy_gbps});

  int index = 0;
  for (const std::string& name : opt.presets) {
    const Preset& p = find_preset(name);
    fmt::print("[{}/{}] {}: T={} H={} E={} K={} ...\n", ++index, opt.presets.size(), p.name,
               p.num_tokens, p.hidden, p.num_experts, p.topk);
    std::fflush(stdout);
    const int64_t T = p.num_tokens, H = p.hidden;
    const int K = p.topk, E = p.num_experts;
    const PlanConfig cfg{E, opt.align, -1};
    Routing routing = random_routing(T, E, K, 1234 + index, dev);
    RoutingPlan plan = allocate_plan(T, K, cfg, dev);
    Tensor ws =
        Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(T, K, cfg))}, DType::kUInt8, dev);
    Tensor x = Tensor::empty({T, H}, opt.dtype, dev);
    fill_bytes(x, 0x3C, stream);  // finite non-zero values in every float dtype
    Tensor y = Tensor::empty({plan.capacity_rows, H}, opt.dtype, dev);
    Tensor pp = Tensor::empty({plan.capacity_rows}, DType::kFloat32, dev);
    Tensor out = Tensor::empty({T, H}, opt.dtype, dev);
    Tensor dy = Tensor::empty({plan.capacity_rows, H}, opt.dtype, dev);
    Tensor dprobs = Tensor::empty({T, K}, DType::kFloat32, dev);
    const PermuteExtras extras{routing.probs, pp, {}, {}};
    build_plan(routing.ids, plan, ws, stream);
    permute(x, plan, y, extras, stream);

    const double moved = static_cast<double>(T + T * K) * H * esize;
    const double moved_bwd = static_cast<double>(T + 2 * T * K) * H * esize;
    // The fused FP8 ops (e4m3, 1x128 scales): the tokens read once, codes and
    // scales written per slot.
    const int64_t nb = (H + 127) / 128;
    const double moved_fp8 = static_cast<double>(T) * H * esize + static_cast<double>(T * K) * (H + 4 * nb);
    Tensor q = Tensor::empty({plan.capacity_rows, H}, DType::kFloat8E4M3, dev);
    Tensor qs = Tensor::empty({plan.capacity_rows, nb}, DType::kFloat32, dev);
    // The blockwise FP8 wgrad's operand: the rows' columnwise codes [H, capacity]
    // and scales (the transpose of a contiguous [nb(capacity), H]).
    const int64_t nbr = (plan.capacity_rows + 127) / 128;
    Tensor qt = Tensor::empty({H, plan.capacity_rows}, DType::kFloat8E4M3, dev);
    Tensor qts = Tensor::empty({nbr, H}, DType::kFloat32, dev);
    const TensorView qts_t =
        TensorView::strided(qts.data(), DType::kFloat32, dev, {H, nbr}, {1, H});
    const double moved_fp8_both =
        static_cast<double>(T) * H * esize + 2.0 * static_cast<double>(T * K) * (H + 4 * nb);
    const bool fp8 = dev.is_cuda() && opt.dtype != DType::kFloat32;
    constexpr size_t kOps = 10;
    size_t timed = 0;
    auto add = [&](const std::string& op, double bytes, const std::function<void()>& fn) {
      print_progress(p.name, timed++, kOps);
      const double us = time_us(dev, stream, fn, opt.timing);
      Row r{p.name, op, us, bytes, bytes > 0 ? bytes / us / 1e3 : 0.0, copy_gbps};
      r.extra = {{"T", T},
                 {"H", H},
                 {"E", E},
                 {"K", K},
                 {"align", opt.align},
                 {"dtype", dtype_name(opt.dtype)}};
      rows.push_back(r);
    };
    add("plan build", 0, [&] { build_plan(routing.ids, plan, ws, stream); });
    add("permute+pad", moved, [&] { permute(x, plan, y, extras, stream); });
    add("plan+permute+pad", moved, [&] {
      build_plan(routing.ids, plan, ws, stream);
      permute(x, plan, y, extras, stream);
    });
    add("unpermute (probs merged)", moved, [&] { unpermute(y, plan, out, routing.probs, stream); });
    add("permute_backward", moved, [&] { permute_backward(y, plan, out, {}, {}, stream); });
    add("unpermute_backward+dprobs", moved_bwd,
        [&] { unpermute_backward(out, plan, y, routing.probs, dy, dprobs, stream); });
    if (fp8) {
      const PermuteExtras probs_only{routing.probs, pp, {}, {}};
      add("permute+quantize (fp8)", moved_fp8,
          [&] { permute_quantize(x, plan, q, qs, QuantizeConfig{}, probs_only, stream); });
      add("unpermute_backward+quantize (fp8)", moved_fp8, [&] {
        unpermute_backward_quantize(out, plan, routing.probs, q, qs, QuantizeConfig{}, stream);
      });
      QuantizeConfig colwise{};
      colwise.columnwise = true;
      add("permute+quantize both ways (fp8)", moved_fp8_both, [&] {
        permute_quantize(x, plan, q, qs, QuantizeConfig{}, probs_only, stream);
        permute_quantize(x, plan, qt, qts_t, colwise, {}, stream);
      });
      add("permute, then quantize both ways (fp8)", moved_fp8_both, [&] {
        permute(x, plan, y, extras, stream);
        quantize_rowwise_columnwise(y, QuantizeConfig{}, q, qs, qt, qts_t, stream);
      });
    }
    print_progress(p.name, kOps, kOps);
    const PlanStatus s = check_plan(plan, stream);
    rows.back().extra["total_rows"] = s.total_rows;
  }
  print_table(fmt::format("permute on {} (GB/s = counted bytes / median time; 'of copy' = "
                          "fraction of the measured device copy bandwidth)",
                          device_name(dev)),
              rows);
  if (!opt.json_path.empty()) {
    nlohmann::json j = {{"device", device_name(dev)}, {"dtype", dtype_name(opt.dtype)},
                        {"align", opt.align},         {"copy_GBps", copy_gbps},
                        {"write_GBps", write_gbps},   {"rows", rows_to_json(rows)}};
    std::ofstream f(opt.json_path);
    MOEFLOW_CHECK(f.good(), "--json: cannot write '", opt.json_path, "'");
    f << j.dump(1) << "\n";
    fmt::print("wrote {}\n", opt.json_path);
  }
}

}  // namespace moeflow::bench
