// `moeflow bench quantize`: the FP8 quantization passes of an MLP step, per
// case of `bench mlp` (E experts, R rows, H, F), e4m3, bf16 inputs, against
// the device copy bandwidth measured in the same run. Ops: the activations'
// 1x128 codes (x rowwise, columnwise, both ways), and per weight W1 / W2 its
// 128x128 codes ("codes"), W^T's straight from W ("^T codes"), both from one
// read ("both ways"), and W's codes then transpose_codes ("codes,
// transposed", what the dgrad's codes cost before). Bytes counted by hand
// (n elements, s scales):
//   activations x [R, H], 1x128 blocks, s = R * ceil(H/128):
//     rowwise / columnwise: 2n read + n + 4s written; both ways: 2n + 2 (n + 4s)
//   weights W1 [E, 2F, H] and W2 [E, H, F], 128x128 blocks:
//     W's codes, W^T's codes:          2n + n + 4s
//     both from one read:              2n + 2 (n + 4s)
//     W's codes, then transpose_codes: (2n + n + 4s) + 2n (the codes read and written again)
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <utility>

#include "bench/bench.h"
#include "moeflow/quantize.h"

namespace moeflow::bench {

namespace {

struct QuantCase {
  std::string name;
  int64_t experts, rows, hidden, ffn;
};

int64_t nb(int64_t n) {
  return (n + 127) / 128;
}

}  // namespace

void run_quantize_bench(const QuantizeBenchOptions& opt) {
  const Device dev = opt.device;
  MOEFLOW_CHECK(dev.is_cuda(), "bench quantize needs a CUDA device");
  const std::vector<QuantCase> all = {{"dsv3", 32, 65536, 7168, 2048},
                                      {"mixtral", 8, 32768, 4096, 14336},
                                      {"qwen3-30b", 128, 131072, 2048, 768}};
  for (const auto& name : opt.cases)
    MOEFLOW_CHECK(
        std::any_of(all.begin(), all.end(), [&](const QuantCase& c) { return c.name == name; }),
        "--case must be dsv3, mixtral or qwen3-30b, got '", name, "'");
  std::vector<QuantCase> cases;
  for (const auto& c : all)
    if (opt.cases.empty() ||
        std::find(opt.cases.begin(), opt.cases.end(), c.name) != opt.cases.end())
      cases.push_back(c);
  cudaStream_t stream = nullptr;
  const double copy_gbps = copy_bandwidth_gbps(dev, stream, opt.timing);
  std::vector<Row> rows;
  const QuantizeConfig act{};  // e4m3, 1x128
  QuantizeConfig act_col = act;
  act_col.columnwise = true;
  const QuantizeConfig blocks{DType::kFloat8E4M3, QuantScaling::kBlock128x128, false, false};
  constexpr size_t kOps = 11;
  for (const QuantCase& c : cases) {
    size_t timed = 0;
    auto add = [&](const std::string& op, const std::string& shape, double bytes,
                   const std::function<void()>& fn) {
      print_progress(c.name, timed++, kOps);
      const double us = time_us(dev, stream, fn, opt.timing);
      Row r{c.name, op, us, bytes, bytes / us / 1e3, copy_gbps};
      r.extra = {{"shape", shape}};
      rows.push_back(r);
    };
    {  // the activations: x [R, H] (the MLP's input rows)
      const int64_t R = c.rows, H = c.hidden;
      Tensor x = Tensor::empty({R, H}, DType::kBFloat16, dev);
      fill_uniform(x, 1, -1.0f, 1.0f, stream);
      Tensor q = Tensor::empty({R, H}, DType::kFloat8E4M3, dev);
      Tensor s = Tensor::empty({R, nb(H)}, DType::kFloat32, dev);
      Tensor qt = Tensor::empty({H, R}, DType::kFloat8E4M3, dev);
      Tensor st_buf = Tensor::empty({nb(R), H}, DType::kFloat32, dev);
      const TensorView st = TensorView::strided(st_buf.data(), DType::kFloat32, dev, {H, nb(R)},
                                                {1, H});  // the wgrad's layout
      Tensor st_c = Tensor::empty({H, nb(R)}, DType::kFloat32, dev);
      const double n = static_cast<double>(R) * H, sc = 4.0 * R * nb(H);
      const std::string shape = fmt::format("[{}, {}]", R, H);
      add("x rowwise", shape, 3 * n + sc, [&] { quantize(x, act, q, s, {}, {}, stream); });
      add("x columnwise", shape, 3 * n + sc,
          [&] { quantize(x, act_col, qt, st_c, {}, {}, stream); });
      add("x both ways", shape, 4 * n + 2 * sc,
          [&] { quantize_rowwise_columnwise(x, act, q, s, qt, st, stream); });
    }
    // the weights: W1 [E, 2F, H] (FC1, gated) and W2 [E, H, F]
    const int64_t E = c.experts;
    const std::pair<const char*, std::array<int64_t, 2>> weights[] = {{"W1", {2 * c.ffn, c.hidden}},
                                                                      {"W2", {c.hidden, c.ffn}}};
    for (const auto& [name, nk] : weights) {
      const int64_t N = nk[0], K = nk[1];
      Tensor w = Tensor::empty({E, N, K}, DType::kBFloat16, dev);
      fill_uniform(w, 2, -0.05f, 0.05f, stream);
      Tensor q = Tensor::empty({E, N, K}, DType::kFloat8E4M3, dev);
      Tensor s = Tensor::empty({E, nb(N), nb(K)}, DType::kFloat32, dev);
      Tensor qt = Tensor::empty({E, K, N}, DType::kFloat8E4M3, dev);
      Tensor st = Tensor::empty({E, nb(K), nb(N)}, DType::kFloat32, dev);
      const TensorView w2(w.data(), DType::kBFloat16, dev, {E * N, K});
      const TensorView q2(q.data(), DType::kFloat8E4M3, dev, {E * N, K});
      const TensorView s2(s.data(), DType::kFloat32, dev, {E * nb(N), nb(K)});
      const double n = static_cast<double>(E) * N * K, sc = 4.0 * E * nb(N) * nb(K);
      const std::string shape = fmt::format("[{}, {}, {}]", E, N, K);
      const std::string op(name);
      add(op + " codes", shape, 3 * n + sc, [&] { quantize(w2, blocks, q2, s2, {}, {}, stream); });
      add(op + "^T codes", shape, 3 * n + sc,
          [&] { quantize_rowwise_columnwise(w, blocks, {}, {}, qt, st, stream); });
      add(op + " both ways", shape, 4 * n + 2 * sc,
          [&] { quantize_rowwise_columnwise(w, blocks, q, s, qt, st, stream); });
      add(op + " codes, transposed", shape, 5 * n + sc, [&] {
        quantize(w2, blocks, q2, s2, {}, {}, stream);
        transpose_codes(q, qt, stream);
      });
    }
    print_progress(c.name, kOps, kOps);
  }
  print_table(fmt::format("FP8 quantization on {} (e4m3, bf16 in; GB/s = counted bytes / median "
                          "time; 'of copy' = fraction of the measured device copy bandwidth)",
                          device_name(dev)),
              rows);
  if (!opt.json_path.empty()) {
    nlohmann::json j = {
        {"device", device_name(dev)}, {"copy_GBps", copy_gbps}, {"rows", rows_to_json(rows)}};
    std::ofstream f(opt.json_path);
    MOEFLOW_CHECK(f.good(), "--json: cannot write '", opt.json_path, "'");
    f << j.dump(1) << "\n";
    fmt::print("wrote {}\n", opt.json_path);
  }
}

}  // namespace moeflow::bench
