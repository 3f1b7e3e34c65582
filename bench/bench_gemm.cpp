// `moeflow bench gemm`: grouped GEMM forward, dgrad and wgrad on the
// grouped-GEMM cases listed below (local experts after expert parallelism)
// and a rows-per-expert sweep, next to dense cuBLAS of the same FLOPs
// measured in the same run. FLOPs = 2 * rows * K * N.
#include <cublas_v2.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <random>
#include <tuple>

#include "bench/bench.h"
#include "moeflow/grouped_mlp.h"
#include "moeflow/quantize.h"
#include "moeflow/tuning.h"

namespace moeflow::bench {

namespace {

#define CUBLAS_CHECK(x)                                                                \
  do {                                                                                 \
    cublasStatus_t st_ = (x);                                                          \
    MOEFLOW_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "cuBLAS error ", int(st_), " in " #x); \
  } while (0)

struct GemmCase {
  std::string name;
  int experts;
  int64_t rows, k, n;
  std::vector<int64_t> sizes;  // rows per expert
};

// Mildly uneven split (as the PyTorch peer script): weights U(0.5, 1.5), rows
// rounded down to 16, the remainder on the last expert.

}  // namespace

// Sweep splits, shared with bench/peers_gemm_sweep.py: uniform (R rows each) or
// skewed (rows ~ 1/(e+1), rounded to 16, same total E*R).
std::vector<int64_t> sweep_split(int E, int64_t R, bool skewed) {
  std::vector<int64_t> s(E, R);
  if (!skewed) return s;
  double z = 0;
  for (int e = 0; e < E; ++e) z += 1.0 / (e + 1);
  int64_t used = 0;
  for (int e = 0; e < E; ++e) used += (s[e] = static_cast<int64_t>(E * R / (e + 1) / z / 16) * 16);
  s[0] += E * R - used;
  return s;
}

// Mildly uneven rows per expert, multiples of 16 (as the PyTorch peer script).
std::vector<int64_t> uneven_split(int E, int64_t rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  std::vector<double> w(E);
  double sum = 0;
  for (double& x : w) sum += (x = u(rng));
  std::vector<int64_t> s(E);
  int64_t used = 0;
  for (int e = 0; e < E; ++e) used += (s[e] = static_cast<int64_t>(w[e] / sum * rows / 16) * 16);
  s[E - 1] += rows - used;
  return s;
}

void run_gemm_bench(const GemmBenchOptions& opt) {
  const Device dev = opt.device;
  MOEFLOW_CHECK(dev.is_cuda(), "bench gemm needs a CUDA device");
  cudaStream_t stream = nullptr;
  cublasHandle_t handle;
  CUBLAS_CHECK(cublasCreate(&handle));
  std::vector<GemmCase> cases;
  if (!opt.sweep) {
    const std::vector<GemmCase> all = {{"dsv3-fc1", 32, 65536, 7168, 4096, {}},
                                       {"dsv3-fc2", 32, 65536, 2048, 7168, {}},
                                       {"mixtral-fc1", 8, 32768, 4096, 28672, {}},
                                       {"qwen3-fc1", 128, 131072, 2048, 1536, {}},
                                       {"qwen3-fc2", 128, 131072, 768, 2048, {}}};
    for (const auto& c : all)
      if (opt.cases.empty() ||
          std::find(opt.cases.begin(), opt.cases.end(), c.name) != opt.cases.end())
        cases.push_back(c);
    for (auto& c : cases) c.sizes = uneven_split(c.experts, c.rows, 0);
  } else {
    std::vector<int64_t> rows_per_expert = opt.sweep_rows;
    if (rows_per_expert.empty()) rows_per_expert = {64, 128, 256, 512, 1024, 2048, 4096};
    for (bool skewed : {false, true})
      for (int64_t R : rows_per_expert) {
        GemmCase c{fmt::format("{}-{}", skewed ? "skew" : "unif", R),
                   opt.sweep_experts,
                   opt.sweep_experts * R,
                   opt.sweep_k,
                   opt.sweep_n,
                   sweep_split(opt.sweep_experts, R, skewed)};
        cases.push_back(c);
      }
  }
  fmt::print("moeflow bench gemm on {}, bf16 in, fp32 accumulation\n", device_name(dev));
  int cc_major = 0;  // the FP8 forward runs on Hopper (sm_90) only
  MOEFLOW_CUDA_CHECK(
      cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, dev.index));
  const bool hopper = cc_major == 9;
  if (!hopper)
    fmt::print("  (forward_fp8 rows not run: the FP8 grouped GEMM needs a Hopper GPU)\n");
  std::vector<Row> rows_out;
  int index = 0;
  for (const GemmCase& c : cases) {
    fmt::print("[{}/{}] {}: E={} rows={} K={} N={} ...\n", ++index, cases.size(), c.name, c.experts,
               c.rows, c.k, c.n);
    std::fflush(stdout);
    const int64_t E = c.experts, M = c.rows, K = c.k, N = c.n;
    Tensor offs = Tensor::empty({E + 1}, DType::kInt64);
    offs.data_ptr<int64_t>()[0] = 0;
    for (int64_t e = 0; e < E; ++e)
      offs.data_ptr<int64_t>()[e + 1] = offs.data_ptr<int64_t>()[e] + c.sizes[e];
    GroupLayout layout;
    Tensor offs_g = offs.to(dev);
    layout.offsets = offs_g;
    Tensor a = Tensor::empty({M, K}, DType::kBFloat16, dev),
           w = Tensor::empty({E, N, K}, DType::kBFloat16, dev);
    Tensor out = Tensor::empty({M, N}, DType::kBFloat16, dev),
           dc = Tensor::empty({M, N}, DType::kBFloat16, dev);
    Tensor da = Tensor::empty({M, K}, DType::kBFloat16, dev),
           dw = Tensor::empty({E, N, K}, DType::kFloat32, dev),
           dw_bf16 = Tensor::empty({E, N, K}, DType::kBFloat16, dev);
    // Random operands, as the peers' randn (a constant draws less power and
    // runs at a higher clock); weights scaled by 1/sqrt(K).
    const float ws = std::sqrt(3.0f / static_cast<float>(K));
    fill_uniform(a, 1, -1.0f, 1.0f, stream);
    fill_uniform(w, 2, -ws, ws, stream);
    fill_uniform(dc, 3, -1.0f, 1.0f, stream);
    fill_bytes(dw, 0, stream);
    const double flops = 2.0 * M * K * N;
    const float one = 1.0f, zero = 0.0f;
    TimingOptions t = opt.timing;
    t.flush_l2 = false;  // compute-bound; the operands exceed L2 anyway
    auto tflops = [&](const std::function<void()>& fn) {
      return flops / time_us(dev, stream, fn, t) / 1e6;
    };
    // Ours and dense cuBLAS timed in alternation (5 rounds, median of each), so
    // that clock drift over the run moves both alike.
    auto paired = [&](const std::function<void()>& ours, const std::function<void()>& dense) {
      std::vector<double> a, b;
      for (int r = 0; r < 5; ++r) {
        a.push_back(tflops(ours));
        b.push_back(tflops(dense));
      }
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      return std::pair{a[2], b[2]};
    };
    auto add = [&](const std::string& op, double ours, double dense) {
      Row r{c.name, op, flops / ours / 1e6, 0, 0, 0};
      r.extra = {{"TFLOPs", ours},
                 {"dense_TFLOPs", dense},
                 {"ratio_to_dense", ours / dense},
                 {"experts", E},
                 {"rows", M},
                 {"K", K},
                 {"N", N}};
      rows_out.push_back(r);
      fmt::print("    {:<7} {:7.1f} TFLOP/s   dense cuBLAS {:7.1f}   ratio {:.2f}\n", op, ours,
                 dense, ours / dense);
      std::fflush(stdout);
    };
    // The forward (and wgrad) with kernel k instead of the default.
    auto with_kernel = [](GemmKernel k) {
      GemmOptions o;
      o.kernel = k;
      return o;
    };
    auto forward_with = [&](const GemmOptions& o) {
      return tflops([&] {
        grouped_gemm_forward(a, GroupedWeights::from_stacked(w), layout, out, o, stream);
      });
    };
    const double fwd_portable = forward_with(with_kernel(GemmKernel::kPortable));
    const double fwd_narrow = forward_with(with_kernel(GemmKernel::kSm90Narrow));
    const double fwd_cpasync = forward_with(with_kernel(GemmKernel::kSm90CpAsync));
    const GemmOptions direct = with_kernel(GemmKernel::kTmaDirectStore);
    const double fwd_direct = forward_with(direct);
    const double wg_direct = tflops([&] {
      grouped_gemm_wgrad(dc, a, layout, GroupedWeights::from_stacked(dw), true, direct, stream);
    });
    fmt::print(
        "    forward variants: portable mma.sync {:7.1f}, cp.async+wgmma 128x256 {:7.1f}, "
        "128x128 (2 blocks/SM) {:7.1f}, TMA kernel with masked-store epilogue {:7.1f} TFLOP/s "
        "(wgrad {:7.1f})\n",
        fwd_portable, fwd_cpasync, fwd_narrow, fwd_direct, wg_direct);
    const auto [fwd, fwd_dense] = paired(
        [&] { grouped_gemm_forward(a, GroupedWeights::from_stacked(w), layout, out, stream); },
        [&] {
          CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w.data(),
                                    CUDA_R_16BF, K, a.data(), CUDA_R_16BF, K, &zero, out.data(),
                                    CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        });
    add("forward", fwd, fwd_dense);
    if (hopper && K % 128 == 0 && N % 128 == 0 && !opt.sweep) {
      // Blockwise FP8 (1x128 activations, 128x128 weights, e4m3) against the
      // bf16 forward, in alternation.
      QuantizeConfig qa_cfg, qw_cfg;
      qw_cfg.scaling = QuantScaling::kBlock128x128;
      Tensor qa = Tensor::empty({M, K}, DType::kFloat8E4M3, dev),
             sa = Tensor::empty({M, K / 128}, DType::kFloat32, dev),
             qw = Tensor::empty({E, N, K}, DType::kFloat8E4M3, dev),
             sw = Tensor::empty({E, N / 128, K / 128}, DType::kFloat32, dev);
      Tensor ws_a = Tensor::empty(
          {static_cast<int64_t>(std::max<size_t>(1, quantize_workspace_bytes(M, K, qa_cfg)))},
          DType::kUInt8, dev);
      Tensor ws_w = Tensor::empty(
          {static_cast<int64_t>(std::max<size_t>(1, quantize_workspace_bytes(E * N, K, qw_cfg)))},
          DType::kUInt8, dev);
      quantize(a, qa_cfg, qa, sa, ws_a, {}, stream);
      quantize(TensorView(w.data(), DType::kBFloat16, dev, {E * N, K}), qw_cfg,
               TensorView(qw.data(), DType::kFloat8E4M3, dev, {E * N, K}),
               TensorView(sw.data(), DType::kFloat32, dev, {E * N / 128, K / 128}), ws_w, {},
               stream);
      const auto [f8, bf] = paired(
          [&] { grouped_gemm_fp8_forward(qa, sa, qw, sw, layout, out, stream); },
          [&] { grouped_gemm_forward(a, GroupedWeights::from_stacked(w), layout, out, stream); });
      Row r{c.name, "forward_fp8", flops / f8 / 1e6, 0, 0, 0};
      r.extra = {{"TFLOPs", f8}, {"bf16_forward_TFLOPs", bf}, {"ratio_to_bf16", f8 / bf}};
      rows_out.push_back(r);
      fmt::print("    forward fp8 (blockwise) {:7.1f} TFLOP/s, bf16 forward {:7.1f}: {:.2f}x\n", f8,
                 bf, f8 / bf);
      {
        // Tensorwise FP8 (one scale per operand), promoted every 4 slices
        // (the default) and once (fast accumulation), each against the
        // blockwise forward in alternation.
        QuantizeConfig tw_cfg;
        tw_cfg.scaling = QuantScaling::kTensorwise;
        Tensor ta = Tensor::empty({M, K}, DType::kFloat8E4M3, dev),
               tsa = Tensor::empty({1}, DType::kFloat32, dev),
               tw = Tensor::empty({E, N, K}, DType::kFloat8E4M3, dev),
               tsw = Tensor::empty({1}, DType::kFloat32, dev);
        const size_t ws_bytes = std::max(quantize_workspace_bytes(M, K, tw_cfg),
                                         quantize_workspace_bytes(E * N, K, tw_cfg));
        Tensor ws = Tensor::empty({static_cast<int64_t>(std::max<size_t>(1, ws_bytes))},
                                  DType::kUInt8, dev);
        quantize(a, tw_cfg, ta, tsa, ws, {}, stream);
        quantize(TensorView(w.data(), DType::kBFloat16, dev, {E * N, K}), tw_cfg,
                 TensorView(tw.data(), DType::kFloat8E4M3, dev, {E * N, K}), tsw, ws, {}, stream);
        for (const int promote : {4, 0}) {
          GemmOptions o;
          o.fp8_promote = promote;
          const auto [ft, fb] =
              paired([&] { grouped_gemm_fp8_forward(ta, tsa, tw, tsw, layout, out, o, stream); },
                     [&] { grouped_gemm_fp8_forward(qa, sa, qw, sw, layout, out, stream); });
          const std::string op =
              promote ? "forward_fp8_tensorwise" : "forward_fp8_tensorwise_fast_accum";
          Row rt{c.name, op, flops / ft / 1e6, 0, 0, 0};
          rt.extra = {{"TFLOPs", ft},
                      {"blockwise_TFLOPs", fb},
                      {"ratio_to_blockwise", ft / fb},
                      {"ratio_to_bf16", ft / bf},
                      {"promote_slices", promote}};
          rows_out.push_back(rt);
          fmt::print(
              "    forward fp8 (tensorwise, promoted {}) {:7.1f} TFLOP/s, blockwise {:7.1f}: "
              "{:.2f}x ({:.2f}x bf16)\n",
              promote ? "every 4 slices" : "once", ft, fb, ft / fb, ft / bf);
        }
      }
      // The FP8 wgrad: each expert's rows padded to 128 (a plan with align
      // 128; the pad rows are not read), dC and A quantized columnwise, against
      // the bf16 wgrad on the unpadded rows, both into a bf16 dW and both
      // accumulating into a float32 dW; FLOPs of the real rows.
      {
        Tensor offs_p = Tensor::empty({E + 1}, DType::kInt64),
               real_p = Tensor::empty({E}, DType::kInt32);
        int64_t mp = 0;
        for (int64_t e = 0; e < E; ++e) {
          offs_p.data_ptr<int64_t>()[e] = mp;
          real_p.data_ptr<int32_t>()[e] = static_cast<int32_t>(c.sizes[e]);
          mp += (c.sizes[e] + 127) / 128 * 128;
        }
        offs_p.data_ptr<int64_t>()[E] = mp;
        const int64_t nb = mp / 128;
        Tensor offs_pg = offs_p.to(dev), real_pg = real_p.to(dev);
        GroupLayout lp;
        lp.offsets = offs_pg;
        lp.real_rows = real_pg;
        QuantizeConfig col_cfg;
        col_cfg.columnwise = true;
        Tensor dct = Tensor::empty({N, mp}, DType::kFloat8E4M3, dev),
               dcs = Tensor::empty({N, nb}, DType::kFloat32, dev),
               at = Tensor::empty({K, mp}, DType::kFloat8E4M3, dev),
               as = Tensor::empty({K, nb}, DType::kFloat32, dev);
        {
          Tensor dcp = Tensor::empty({mp, N}, DType::kBFloat16, dev),
                 ap = Tensor::empty({mp, K}, DType::kBFloat16, dev);
          fill_uniform(dcp, 5, -1.0f, 1.0f, stream);
          fill_uniform(ap, 6, -1.0f, 1.0f, stream);
          quantize(dcp, col_cfg, dct, dcs, {}, {}, stream);
          quantize(ap, col_cfg, at, as, {}, {}, stream);
          MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
        }
        // Slice-major scales ([nb, N] read through a transposed view).
        Tensor dcs_t = Tensor::empty({nb, N}, DType::kFloat32, dev),
               as_t = Tensor::empty({nb, K}, DType::kFloat32, dev);
        transpose_codes(dcs, dcs_t, stream);
        transpose_codes(as, as_t, stream);
        const TensorView dcs_v = TensorView::strided(dcs_t.data(), DType::kFloat32, dev, {N, nb},
                                                     {1, N}),
                         as_v = TensorView::strided(as_t.data(), DType::kFloat32, dev, {K, nb},
                                                    {1, K});
        auto fp8_wgrad = [&](bool slice_major, bool f32, const GemmOptions& o) {
          grouped_gemm_fp8_wgrad(dct, slice_major ? dcs_v : TensorView(dcs), at,
                                 slice_major ? as_v : TensorView(as), lp,
                                 GroupedWeights::from_stacked(f32 ? dw : dw_bf16), f32, o, stream);
        };
        auto bf16_wgrad = [&](bool f32) {
          grouped_gemm_wgrad(dc, a, layout, GroupedWeights::from_stacked(f32 ? dw : dw_bf16), f32,
                             stream);
        };
        for (const bool f32 : {false, true}) {
          const auto [w8, wb] = paired([&] { fp8_wgrad(true, f32, {}); }, [&] { bf16_wgrad(f32); });
          const auto [w8r, w8s] = paired([&] { fp8_wgrad(false, f32, {}); },
                                         [&] { fp8_wgrad(true, f32, {}); });
          const std::string op = f32 ? "wgrad_fp8_accumulate_f32" : "wgrad_fp8";
          Row r{c.name, op, flops / w8 / 1e6, 0, 0, 0};
          r.extra = {{"TFLOPs", w8},
                     {"bf16_wgrad_TFLOPs", wb},
                     {"ratio_to_bf16", w8 / wb},
                     {"row_major_scales_TFLOPs", w8r},
                     {"padded_rows", mp}};
          rows_out.push_back(r);
          fmt::print(
              "    wgrad fp8 ({} dW) {:7.1f} TFLOP/s, bf16 wgrad {:7.1f}: {:.2f}x "
              "(scales as quantize writes them: {:7.1f} vs slice-major {:7.1f})\n",
              f32 ? "float32 accumulated" : "bf16", w8, wb, w8 / wb, w8r, w8s);
          {
            // Tensorwise: the transposed operands with one scale each, on the
            // unpadded rows (no 128-row blocks to respect), against the bf16
            // wgrad on the same rows.
            QuantizeConfig tcol;
            tcol.scaling = QuantScaling::kTensorwise;
            tcol.columnwise = true;
            Tensor tdc = Tensor::empty({N, M}, DType::kFloat8E4M3, dev),
                   ta = Tensor::empty({K, M}, DType::kFloat8E4M3, dev),
                   tdcs = Tensor::empty({1}, DType::kFloat32, dev),
                   tas = Tensor::empty({1}, DType::kFloat32, dev);
            const size_t wsb = std::max(quantize_workspace_bytes(M, N, tcol),
                                        quantize_workspace_bytes(M, K, tcol));
            Tensor ws =
                Tensor::empty({static_cast<int64_t>(std::max<size_t>(1, wsb))}, DType::kUInt8, dev);
            quantize(dc, tcol, tdc, tdcs, ws, {}, stream);
            quantize(a, tcol, ta, tas, ws, {}, stream);
            const auto [tw8, twb] = paired(
                [&] {
                  grouped_gemm_fp8_wgrad(tdc, tdcs, ta, tas, layout,
                                         GroupedWeights::from_stacked(f32 ? dw : dw_bf16), f32,
                                         stream);
                },
                [&] { bf16_wgrad(f32); });
            Row rt{c.name, op + "_tensorwise", flops / tw8 / 1e6, 0, 0, 0};
            rt.extra = {{"TFLOPs", tw8}, {"bf16_wgrad_TFLOPs", twb}, {"ratio_to_bf16", tw8 / twb}};
            rows_out.push_back(rt);
            fmt::print(
                "    wgrad fp8 tensorwise ({} dW) {:7.1f} TFLOP/s, bf16 wgrad {:7.1f}: {:.2f}x\n",
                f32 ? "float32 accumulated" : "bf16", tw8, twb, tw8 / twb);
          }
          if (opt.fp8_tiles)
            for (const auto& [tile, name] : {std::pair{Fp8Tile::k128x128, "128x128"},
                                             std::pair{Fp8Tile::k128x192, "128x192"}}) {
              GemmOptions o;
              o.fp8_tile = tile;
              const auto [ft, fd] = paired([&] { fp8_wgrad(true, f32, o); },
                                           [&] { fp8_wgrad(true, f32, {}); });
              fmt::print("      tile {}: {:7.1f} TFLOP/s, default {:7.1f}: {:.3f}x\n", name, ft,
                         fd, ft / fd);
            }
        }
      }
      if (opt.fp8_tiles) {
        const std::pair<Fp8Tile, const char*> tiles[] = {{Fp8Tile::k128x128, "128x128"},
                                                         {Fp8Tile::k128x192, "128x192"},
                                                         {Fp8Tile::k192x128, "192x128"}};
        for (const auto& [tile, name] : tiles) {
          GemmOptions o;
          o.fp8_tile = tile;
          const auto [ft, fd] =
              paired([&] { grouped_gemm_fp8_forward(qa, sa, qw, sw, layout, out, o, stream); },
                     [&] { grouped_gemm_fp8_forward(qa, sa, qw, sw, layout, out, stream); });
          Row rt{c.name, std::string("forward_fp8_") + name, flops / ft / 1e6, 0, 0, 0};
          rt.extra = {{"TFLOPs", ft}, {"default_TFLOPs", fd}, {"ratio_to_default", ft / fd}};
          rows_out.push_back(rt);
          fmt::print("      tile {}: {:7.1f} TFLOP/s, default {:7.1f}: {:.3f}x\n", name, ft, fd,
                     ft / fd);
        }
      }
    }
    if (c.name.size() > 4 && c.name.substr(c.name.size() - 4) == "-fc1" && K % 8 == 0) {
      // Gathered A rows (what a token-major dispatch would feed FC1): every
      // row of the product reads a row of a source with M/4 rows through a
      // random row map, against the contiguous forward, in alternation.
      const int64_t src_rows = std::max<int64_t>(1, M / 4);
      Tensor src = Tensor::empty({src_rows, K}, DType::kBFloat16, dev);
      fill_uniform(src, 4, -1.0f, 1.0f, stream);
      Tensor map_h = Tensor::empty({M}, DType::kInt32);
      std::mt19937 rng(7);
      for (int64_t r = 0; r < M; ++r)
        map_h.data_ptr<int32_t>()[r] =
            std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(src_rows) - 1)(rng);
      Tensor map = map_h.to(dev);
      // What a token-major receive buffer gives: within each expert's rows the
      // source rows ascend (tokens in order), so sort each group's slice.
      Tensor map_sorted_h = map_h.to(Device::cpu());
      for (int64_t e = 0; e < E; ++e) {
        int32_t* m = map_sorted_h.data_ptr<int32_t>();
        std::sort(m + offs.data_ptr<int64_t>()[e], m + offs.data_ptr<int64_t>()[e + 1]);
      }
      Tensor map_sorted = map_sorted_h.to(dev);
      // Random map, then the same map sorted within each expert's rows (what a
      // token-major receive buffer gives: tokens in order).
      for (const bool sorted : {false, true}) {
        const TensorView a_rows = sorted ? map_sorted : map;
        const auto [gat, contig] = paired(
            [&] {
              grouped_gemm_forward_gathered(src, a_rows, GroupedWeights::from_stacked(w), layout,
                                            out, {}, stream);
            },
            [&] { grouped_gemm_forward(a, GroupedWeights::from_stacked(w), layout, out, stream); });
        fmt::print(
            "    forward with gathered A rows ({} row map into M/4 source rows) {:7.1f} TFLOP/s, "
            "contiguous {:7.1f}: gathered costs {:.3f}x\n",
            sorted ? "sorted-per-expert" : "random", gat, contig, contig / gat);
        Row r{c.name,
              sorted ? "forward_gathered_rows_sorted" : "forward_gathered_rows",
              flops / gat / 1e6,
              0,
              0,
              0};
        r.extra = {{"TFLOPs", gat}, {"contiguous_TFLOPs", contig}, {"time_ratio", contig / gat}};
        rows_out.push_back(r);
      }
    }
    // One call of the fused FC1 (grouped_mlp_fc1_forward): the views it reads
    // and writes, and its configuration (SwiGLU, tuning).
    struct Fc1Call {
      GroupedMlpWeights w;
      TensorView probs, act, raw;
      GroupedMlpConfig cfg;
    };
    auto fc1 = [&](const Fc1Call& f) {
      grouped_mlp_fc1_forward(a, f.w, layout, f.probs, f.cfg, f.act, f.raw, stream);
    };
    std::optional<Fc1Call> fused_call;  // views of act, bias, probs
    Tensor act, bias, probs;
    if (c.name.size() > 4 && c.name.substr(c.name.size() - 4) == "-fc1" && N % 128 == 0) {
      // FC1 with bias + SwiGLU + probability scale fused, saving the pre-activation
      // output (as training does), timed in alternation with the plain FC1.
      act = Tensor::empty({M, N / 2}, DType::kBFloat16, dev);
      bias = Tensor::empty({E, N}, DType::kBFloat16, dev);
      probs = Tensor::empty({M}, DType::kFloat32, dev);
      fill_bytes(bias, 0x3C, stream);
      fill_bytes(probs, 0x3C, stream);
      Fc1Call call;
      call.w.fc1 = w;
      call.w.bias1 = bias;
      call.probs = probs;
      call.act = act;
      call.raw = out;
      bool ok = true;
      try {
        fc1(call);
      } catch (const Error& e) {
        fmt::print("    fused FC1 skipped: {}\n", e.what());
        ok = false;
      }
      if (ok) {
        fused_call = call;
        // A fused FC1 call timed in alternation with FC1 alone: printed and
        // kept as the JSON row `op`.
        auto vs_alone = [&](const Fc1Call& v, const char* what, const char* op) {
          const auto [fu, plain] = paired([&] { fc1(v); },
                                          [&] {
                                            grouped_gemm_forward(a, GroupedWeights::from_stacked(w),
                                                                 layout, out, stream);
                                          });
          fmt::print("    {} {:7.1f} TFLOP/s, FC1 alone {:7.1f}: fused costs {:.3f}x FC1 alone\n",
                     what, fu, plain, plain / fu);
          std::fflush(stdout);
          Row r{c.name, op, flops / fu / 1e6, 0, 0, 0};
          r.extra = {{"TFLOPs", fu}, {"fc1_alone_TFLOPs", plain}, {"time_ratio", plain / fu}};
          rows_out.push_back(r);
          return fu;
        };
        const double fused = vs_alone(
            call, "fc1 + bias + SwiGLU + probs fused (pre-activation saved)", "fc1_swiglu_fused");
        // Where the fused epilogue's time goes: the same call with parts left out.
        auto variant = [&](bool with_raw, bool with_bias, bool with_probs) {
          Fc1Call v = call;
          if (!with_raw) v.raw = TensorView();
          if (!with_bias) v.w.bias1 = TensorView();
          if (!with_probs) v.probs = TensorView();
          return v;
        };
        auto part = [&](bool with_raw, bool with_bias, bool with_probs) {
          const Fc1Call v = variant(with_raw, with_bias, with_probs);
          return tflops([&] { fc1(v); });
        };
        // The configuration of the models these cases come from (DeepSeek-V3,
        // Mixtral, Qwen3 experts have no bias; the router probabilities are
        // applied at the combine): SwiGLU fused and the pre-activation saved
        // for the backward, against FC1 alone, in alternation. Nothing the
        // forward needs is left out, and FC1 alone has no bias either.
        vs_alone(variant(true, false, false),
                 "fc1 + SwiGLU fused, pre-activation saved, no bias, no probs (the models' "
                 "configuration)",
                 "fc1_swiglu_fused_model");
        const double act_only = part(false, false, false), act_raw = part(true, false, false),
                     act_raw_bias = part(true, true, false);
        // Both outputs copied out by the helper warps' 16-byte stores instead
        // of TMA stores (the TMA then only loads operands), paired with FC1
        // alone (TMA stores).
        Fc1Call call_direct = call;
        call_direct.cfg.gemm = direct;
        const auto [fused_direct, plain_direct] = paired(
            [&] { fc1(call_direct); },
            [&] { grouped_gemm_forward(a, GroupedWeights::from_stacked(w), layout, out, stream); });
        fmt::print(
            "    fused with masked-store outputs {:7.1f} TFLOP/s, FC1 alone {:7.1f}: {:.3f}x\n",
            fused_direct, plain_direct, plain_direct / fused_direct);
        fmt::print(
            "    fused parts: SwiGLU only {:7.1f}, + pre-activation saved {:7.1f}, + bias {:7.1f}, "
            "+ probs (all) {:7.1f} TFLOP/s\n",
            act_only, act_raw, act_raw_bias, fused);
      }
    }
    // The fused FC1 with tuning t, timed in alternation with FC1 alone at its defaults.
    // The fused FC1 with options t.
    auto fused_with = [&](const GemmOptions& t) {
      Fc1Call v = *fused_call;
      v.cfg.gemm = t;
      return v;
    };
    auto fused_vs_alone = [&](const GemmOptions& t) {
      const Fc1Call v = fused_with(t);
      return paired(
          [&] { fc1(v); },
          [&] { grouped_gemm_forward(a, GroupedWeights::from_stacked(w), layout, out, stream); });
    };
    // One setting of the fused FC1 (knob = value), paired with FC1 alone:
    // printed and kept as a JSON row "tune_<knob>".
    auto tune_fused = [&](const char* knob, int value, const GemmOptions& t) {
      const auto [fu, plain] = fused_vs_alone(t);
      fmt::print("    tune fused fc1 {}={:4d}: {:7.1f} TFLOP/s, FC1 alone {:7.1f}: {:.3f}x\n", knob,
                 value, fu, plain, plain / fu);
      std::fflush(stdout);
      Row r{c.name, std::string("tune_") + knob, flops / fu / 1e6, 0, 0, 0};
      r.extra = {{knob, value},
                 {"fused_fc1_TFLOPs", fu},
                 {"fc1_alone_TFLOPs", plain},
                 {"time_ratio", plain / fu}};
      rows_out.push_back(r);
    };
    // The fused FC1's held-stage window, each value paired with FC1 alone.
    if (fused_call)
      for (const int hold : opt.tune_hold) {
        GemmOptions t;
        t.hold = hold;
        tune_fused("hold", hold, t);
      }
    if (opt.tune) {  // TMA kernel: pipeline stages x staging buffers x raster x stagger
      for (const auto [st, nb, rb, sg, ds] : {std::tuple{4, 2, 8, 1, 0},
                                              {3, 2, 8, 1, 0},
                                              {3, 4, 8, 1, 0},
                                              {3, 5, 8, 2, 0},
                                              {4, 2, 8, 0, 0},
                                              {4, 2, 8, 2, 0},
                                              {4, 2, 8, 3, 0},
                                              {4, 3, 8, 3, 0},
                                              {4, 4, 8, 2, 0},
                                              {4, 2, 8, 1, 2},
                                              {4, 2, 2, 1, 0},
                                              {4, 2, 4, 1, 0},
                                              {4, 2, 16, 1, 0},
                                              {4, 2, 32, 1, 0}}) {
        GemmOptions t;
        t.stages = st;
        t.bufs = nb;
        t.raster = rb;
        t.stagger = sg;
        t.desync = ds;
        const double f = forward_with(t);
        const double d = tflops([&] {
          grouped_gemm_dgrad(dc, GroupedWeights::from_stacked(w), layout, da, t, stream);
        });
        const double g = tflops([&] {
          grouped_gemm_wgrad(dc, a, layout, GroupedWeights::from_stacked(dw), true, t, stream);
        });
        const double gb = tflops([&] {
          grouped_gemm_wgrad(dc, a, layout, GroupedWeights::from_stacked(dw_bf16), false, t,
                             stream);
        });
        double fu = 0.0;
        if (fused_call) {
          const Fc1Call v = fused_with(t);
          fu = tflops([&] { fc1(v); });
        }
        fmt::print(
            "    tune stages={} bufs={} raster={} stagger={} desync={}: forward {:7.1f} dgrad "
            "{:7.1f} wgrad {:7.1f} wgrad bf16 {:7.1f} fused fc1 {:7.1f} TFLOP/s\n",
            st, nb, rb, sg, ds, f, d, g, gb, fu);
        std::fflush(stdout);
      }
      // The fused FC1's held-stage window (helper mode): K slices the ring
      // skips the stage the helpers hold after a tile.
      if (fused_call)
        for (const int st : {4, 3})
          for (const int hold : {0, 8, 16, 24, 32, 40, 48, 64, 1000}) {
            GemmOptions t;
            t.stages = st;
            t.hold = hold;
            const Fc1Call v = fused_with(t);
            fmt::print("    tune fused fc1 stages={} hold={}: {:7.1f} TFLOP/s\n", st, hold,
                       tflops([&] { fc1(v); }));
            std::fflush(stdout);
          }
      // Consumer warpgroup 1's lag (K slices) in the fused FC1, each timed
      // in alternation with FC1 alone at its default.
      if (fused_call)
        for (const int sg : {0, 1, 2, 3}) {
          GemmOptions t;
          t.stagger = sg;
          tune_fused("stagger", sg, t);
        }
    }
    const auto [dg, dg_dense] = paired(
        [&] { grouped_gemm_dgrad(dc, GroupedWeights::from_stacked(w), layout, da, stream); },
        [&] {
          CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, K, M, N, &one, w.data(),
                                    CUDA_R_16BF, K, dc.data(), CUDA_R_16BF, N, &zero, da.data(),
                                    CUDA_R_16BF, K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        });
    add("dgrad", dg, dg_dense);
    const auto [wg, wg_dense] = paired(
        [&] { grouped_gemm_wgrad(dc, a, layout, GroupedWeights::from_stacked(dw), true, stream); },
        [&] {
          CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, K, N, M, &one, a.data(),
                                    CUDA_R_16BF, K, dc.data(), CUDA_R_16BF, N, &one, dw.data(),
                                    CUDA_R_32F, K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        });
    add("wgrad", wg, wg_dense);
    // The layer's wgrad: a bf16 dW written from the accumulators (no float32
    // buffer, nothing accumulated), against dense cuBLAS writing one bf16 dW.
    const auto [wb, wb_dense] = paired(
        [&] {
          grouped_gemm_wgrad(dc, a, layout, GroupedWeights::from_stacked(dw_bf16), false, stream);
        },
        [&] {
          CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, K, N, M, &one, a.data(),
                                    CUDA_R_16BF, K, dc.data(), CUDA_R_16BF, N, &zero,
                                    dw_bf16.data(), CUDA_R_16BF, K, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
        });
    add("wgrad_bf16", wb, wb_dense);
  }
  cublasDestroy(handle);
  if (!opt.json_path.empty()) {
    nlohmann::json j = {{"device", device_name(dev)}, {"rows", rows_to_json(rows_out)}};
    std::ofstream f(opt.json_path);
    MOEFLOW_CHECK(f.good(), "--json: cannot write '", opt.json_path, "'");
    f << j.dump(1) << "\n";
    fmt::print("wrote {}\n", opt.json_path);
  }
}

}  // namespace moeflow::bench
