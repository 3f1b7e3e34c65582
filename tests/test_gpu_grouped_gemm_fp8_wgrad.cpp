// GPU blockwise FP8 grouped GEMM wgrad (label gpu) against the CPU
// reference: dC and A quantized columnwise by moeflow::quantize (1x128
// blocks along rows); the groups' pad rows and the rows past them hold NaN
// (codes 0x7F), which the op must never read; dW poisoned first. Random
// values within a stated bound, integer values with power-of-two scales
// bitwise (every sum exact in float32); float32 and bf16 dW, accumulate,
// per-expert pointers, slice-major scales, every tile shape; a group that
// does not start on a scale block flagged and left alone; a captured launch
// replayed with new offsets; tensorwise scales on groups starting anywhere.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <tuple>

#include "gpu_util.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);

struct WgradProblem {
  std::vector<int64_t> seg;   // rows of each group (multiples of 128)
  std::vector<int32_t> real;  // real rows of each group
  int64_t n, k;
};

struct WgradInputs {
  int64_t rows = 0;
  Tensor offsets, real;       // CPU, int64 [E+1], int32 [E]
  Tensor dct, dcs, at_, as_;  // CPU: [N, rows] e4m3, [N, nb]; [K, rows] e4m3, [K, nb]
};

// dC [rows, N] and A [rows, K] drawn by draw(which, row, col) on real rows,
// NaN elsewhere (pad rows, 16 rows past the groups), quantized columnwise.
template <typename Draw>
WgradInputs make_inputs(const WgradProblem& p, Draw draw, bool pow2 = false,
                        bool tensorwise = false) {
  WgradInputs d;
  const int64_t E = p.seg.size(), N = p.n, K = p.k;
  d.offsets = make_tensor({E + 1}, DType::kInt64);
  d.real = make_tensor({E}, DType::kInt32);
  std::vector<bool> is_real;
  int64_t o = 0;
  for (int64_t e = 0; e < E; ++e) {
    d.offsets.data_ptr<int64_t>()[e] = o;
    d.real.data_ptr<int32_t>()[e] = p.real[e];
    for (int64_t r = 0; r < p.seg[e]; ++r) is_real.push_back(r < p.real[e]);
    o += p.seg[e];
  }
  d.offsets.data_ptr<int64_t>()[E] = o;
  d.rows = o + 16;
  is_real.resize(d.rows, false);
  auto quantized = [&](int which, int64_t cols, Tensor& q, Tensor& s) {
    Tensor x = make_tensor({d.rows, cols}, DType::kFloat32);
    for (int64_t r = 0; r < d.rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        x.data_ptr<float>()[r * cols + c] = is_real[r] ? draw(which, r, c) : std::nanf("");
    QuantizeConfig cfg;
    cfg.scaling = tensorwise ? QuantScaling::kTensorwise : QuantScaling::kBlock1x128;
    cfg.columnwise = true;
    cfg.pow2_scales = pow2;
    q = make_tensor({cols, d.rows}, DType::kFloat8E4M3);
    s = tensorwise ? make_tensor({1}, DType::kFloat32)
                   : make_tensor({cols, blocks128(d.rows)}, DType::kFloat32);
    quantize(x, cfg, q, s);
  };
  quantized(0, N, d.dct, d.dcs);
  quantized(1, K, d.at_, d.as_);
  return d;
}

GroupLayout layout(const Tensor& offsets, const Tensor& real, TensorView error = {}) {
  GroupLayout g;
  g.offsets = offsets;
  g.real_rows = real;
  g.error = error;
  return g;
}

GemmOptions with_tile(Fp8Tile t) {
  GemmOptions o;
  o.fp8_tile = t;
  return o;
}

const Fp8Tile kTiles[] = {Fp8Tile::kAuto, Fp8Tile::k128x128, Fp8Tile::k128x192, Fp8Tile::k192x128};

const std::vector<WgradProblem> kProblems = {
    {{128}, {128}, 128, 128},                             // one tile, one slice
    {{256, 0, 384, 128}, {200, 0, 257, 0}, 256, 384},     // empty groups, partial slices
    {{1024, 128, 640}, {1024, 1, 600}, 384, 128},         // many slices, a single real row
    {{512, 512, 256, 768}, {512, 500, 256, 700}, 640, 256},  // N past a 192-row tile
};

// |got - want| / |want| over all of dW, as a relative norm.
double rel_norm(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = at(got, i), w = at(want, i);
    if (std::isnan(g)) return INFINITY;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The reference and the GPU op on the same inputs and initial dW (`init`,
// CPU; copied), options `o`; returns {cpu, gpu} dW on the CPU.
std::pair<Tensor, Tensor> run_both(const WgradProblem& p, const WgradInputs& d, const Tensor& init,
                                   bool accumulate, const GemmOptions& o = {},
                                   bool slice_major = false) {
  Tensor want = init.to(Device::cpu());
  grouped_gemm_fp8_wgrad(d.dct, d.dcs, d.at_, d.as_, layout(d.offsets, d.real),
                         GroupedWeights::from_stacked(want), accumulate);
  Tensor dct = d.dct.to(kGpu), at_ = d.at_.to(kGpu);
  Tensor off = d.offsets.to(kGpu), real = d.real.to(kGpu), dw = init.to(kGpu);
  const int64_t nb = blocks128(d.rows);
  // Slice-major scales: [nb, N] contiguous, read through a transposed view.
  auto scales = [&](const Tensor& s, Tensor& keep) -> TensorView {
    if (!slice_major) return keep = s.to(kGpu);
    const int64_t R = s.size(0);
    Tensor t = make_tensor({nb, R}, DType::kFloat32);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t b = 0; b < nb; ++b) t.data_ptr<float>()[b * R + r] = s.data_ptr<float>()[r * nb + b];
    keep = t.to(kGpu);
    return TensorView::strided(keep.data(), DType::kFloat32, kGpu, {R, nb}, {1, R});
  };
  Tensor k1, k2;
  const TensorView dcs = scales(d.dcs, k1), as = scales(d.as_, k2);
  grouped_gemm_fp8_wgrad(dct, dcs, at_, as, layout(off, real), GroupedWeights::from_stacked(dw),
                         accumulate, o);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {want, dw.to(Device::cpu())};
}

std::vector<float> normal_table(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> xs(1 << 16);
  for (float& v : xs) v = nd(rng);
  return xs;
}

TEST(GpuGemmFp8Wgrad, MatchesCpuWithinBound) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  uint32_t seed = 5;
  for (const WgradProblem& p : kProblems) {
    const std::vector<float> xs = normal_table(seed++);
    const WgradInputs d = make_inputs(p, [&](int which, int64_t r, int64_t c) {
      return xs[(r * 131 + c * 7 + which * 31) & 0xFFFF];
    });
    const int64_t E = p.seg.size();
    for (const DType out : {DType::kFloat32, DType::kBFloat16}) {
      for (const Fp8Tile tile : kTiles) {
        SCOPED_TRACE(std::string(dtype_name(out)) + " tile " +
                     std::to_string(static_cast<int>(tile)));
        // Bound: the tensor cores' FP8 block sums (measured 1.2e-4 relative
        // to float64 on these problems: they keep fewer bits than float32)
        // and the float32 promotion; bf16 output adds its rounding (half an
        // ulp, 2e-3 of a value).
        const double bound = out == DType::kFloat32 ? 3e-4 : 3e-3;
        const auto [want, got] =
            run_both(p, d, poisoned({E, p.n, p.k}, out), false, with_tile(tile));
        EXPECT_LT(rel_norm(got, want), bound) << "N=" << p.n << " K=" << p.k;
        // Groups without real rows are zeros.
        for (int64_t e = 0; e < E; ++e)
          if (p.real[e] == 0)
            for (int64_t i = 0; i < p.n * p.k; ++i)
              ASSERT_EQ(at(got, e * p.n * p.k + i), 0.0f) << "group " << e;
      }
      // Accumulate into values already there (the TMA reduce-add in dW's
      // dtype; bf16: the result rounded to bf16 first), every tile.
      Tensor init = make_tensor({E, p.n, p.k}, out);
      fill_random(init, 77);
      for (const Fp8Tile tile : kTiles) {
        SCOPED_TRACE(std::string("accumulate ") + dtype_name(out) + " tile " +
                     std::to_string(static_cast<int>(tile)));
        const auto [want, got] = run_both(p, d, init, true, with_tile(tile));
        EXPECT_LT(rel_norm(got, want), out == DType::kFloat32 ? 3e-4 : 3e-3);
        for (int64_t e = 0; e < E; ++e)  // empty groups keep their values
          if (p.real[e] == 0)
            for (int64_t i = 0; i < p.n * p.k; ++i)
              ASSERT_EQ(at(got, e * p.n * p.k + i), at(init, e * p.n * p.k + i)) << "group " << e;
      }
    }
  }
}

// Tensorwise scales ([1] each): groups may start at any multiple of 16
// rows (48, 464, ...); float32 and bf16 dW, accumulate, every tile, promoted
// every slice, every 4 (the default) and once; a group starting off 16 is
// flagged and left alone.
TEST(GpuGemmFp8Wgrad, TensorwiseMatchesCpuWithinBound) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  const std::vector<WgradProblem> problems = {
      {{48, 0, 400, 16, 272}, {40, 0, 389, 16, 200}, 256, 384},
      {{1040, 16, 656}, {1040, 1, 600}, 384, 128},
  };
  uint32_t seed = 41;
  for (const WgradProblem& p : problems) {
    const std::vector<float> xs = normal_table(seed++);
    const WgradInputs d = make_inputs(
        p,
        [&](int which, int64_t r, int64_t c) {
          return xs[(r * 131 + c * 7 + which * 31) & 0xFFFF];
        },
        false, true);
    const int64_t E = p.seg.size();
    for (const DType out : {DType::kFloat32, DType::kBFloat16})
      for (const bool acc : {false, true})
        for (const Fp8Tile tile : kTiles)
          for (const int promote : {1, -1, 0}) {
            SCOPED_TRACE(std::string(dtype_name(out)) + (acc ? " accumulate" : "") + " tile " +
                         std::to_string(static_cast<int>(tile)) + " promote " +
                         std::to_string(promote));
            GemmOptions o = with_tile(tile);
            o.fp8_promote = promote;
            Tensor init = make_tensor({E, p.n, p.k}, out);
            fill_random(init, 78);
            const auto [want, got] =
                run_both(p, d, acc ? init : poisoned({E, p.n, p.k}, out), acc, o);
            // Bound: the blockwise one (3e-4 float32, 3e-3 bf16) with the tensor
            // cores' sums over up to all of a group's rows inside it: 1e-3 float32.
            const double err = rel_norm(got, want);
            EXPECT_LT(err, out == DType::kFloat32 ? 1e-3 : 3e-3);
            if (tile == Fp8Tile::kAuto && out == DType::kFloat32 && !acc)
              std::printf("tensorwise wgrad rows %lld promote %d: relative error %.2e\n",
                          static_cast<long long>(d.rows), promote, err);
            for (int64_t e = 0; e < E; ++e)
              if (p.real[e] == 0)
                for (int64_t i = 0; i < p.n * p.k; ++i)
                  ASSERT_EQ(at(got, e * p.n * p.k + i), acc ? at(init, e * p.n * p.k + i) : 0.0f)
                      << "group " << e;
          }
  }
  // A group starting at row 40: flagged, its dW left as it was (poison).
  const WgradProblem bad{{40, 216}, {40, 200}, 128, 128};
  const WgradInputs d = make_inputs(
      bad,
      [](int which, int64_t r, int64_t c) { return static_cast<float>((r + c + which) % 7) - 3; },
      false, true);
  Tensor dw = poisoned({2, 128, 128}, DType::kFloat32, kGpu);
  Tensor err = Tensor::zeros({1}, DType::kInt32, kGpu);
  grouped_gemm_fp8_wgrad(d.dct.to(kGpu), d.dcs.to(kGpu), d.at_.to(kGpu), d.as_.to(kGpu),
                         layout(d.offsets.to(kGpu), d.real.to(kGpu), err),
                         GroupedWeights::from_stacked(dw), false);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(err.to(Device::cpu()).data_ptr<int32_t>()[0], 1);
  Tensor got = dw.to(Device::cpu());
  for (int64_t i = 128 * 128; i < 2 * 128 * 128; ++i)
    ASSERT_TRUE(std::isnan(at(got, i))) << "group 1 written";
}

TEST(GpuGemmFp8Wgrad, ExactSumsAreBitwise) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  // Integers in [-8, 8] with power-of-two scales: every code exact, every sum
  // an integer times a power of two below 2^24 ulps: float32 equals float64.
  for (const WgradProblem& p : {kProblems[1], kProblems[3]}) {
    const WgradInputs d = make_inputs(
        p,
        [](int which, int64_t r, int64_t c) {
          return static_cast<float>((r * (which ? 5 : 3) + c * 7 + which) % 17 - 8);
        },
        true);
    const int64_t E = p.seg.size();
    for (const Fp8Tile tile : kTiles)
      for (const bool slice_major : {false, true}) {
        const auto [want, got] = run_both(p, d, poisoned({E, p.n, p.k}, DType::kFloat32), false,
                                          with_tile(tile), slice_major);
        EXPECT_TRUE(bytes_equal(got, want))
            << "tile " << static_cast<int>(tile) << " slice-major " << slice_major;
      }
    // Accumulated into a bf16 dW holding other values: the exact result
    // rounded to bf16, then added and rounded (the TMA reduce-add), bitwise.
    Tensor init = make_tensor({E, p.n, p.k}, DType::kBFloat16);
    fill_random(init, 91);
    for (const Fp8Tile tile : kTiles) {
      const auto [want, got] = run_both(p, d, init, true, with_tile(tile));
      EXPECT_TRUE(bytes_equal(got, want)) << "bf16 accumulate, tile " << static_cast<int>(tile);
    }
  }
}

// dW as E separate tensors (the pointer table: stores straight from the
// accumulators): within the bound of the reference, bf16 and float32,
// written and accumulated; bitwise where every sum is exact (bf16
// accumulate: the result rounded to bf16, then added and rounded).
TEST(GpuGemmFp8Wgrad, PointerWeights) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  const WgradProblem& p = kProblems[1];
  const std::vector<float> xs = normal_table(21);
  const WgradInputs normal = make_inputs(
      p, [&](int which, int64_t r, int64_t c) { return xs[(r * 97 + c * 3 + which) & 0xFFFF]; });
  const WgradInputs exact = make_inputs(
      p,
      [](int which, int64_t r, int64_t c) {
        return static_cast<float>((r * (which ? 5 : 3) + c * 7 + which) % 17 - 8);
      },
      true);
  const int64_t E = p.seg.size(), m = p.n * p.k;
  for (const bool is_exact : {false, true})
    for (const DType out : {DType::kBFloat16, DType::kFloat32})
      for (const bool accumulate : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(out)) + (accumulate ? " accumulate" : "") +
                     (is_exact ? " exact sums" : ""));
        const WgradInputs& d = is_exact ? exact : normal;
        Tensor init = make_tensor({E, p.n, p.k}, out);
        fill_random(init, 5);
        Tensor want = init.to(Device::cpu());
        grouped_gemm_fp8_wgrad(d.dct, d.dcs, d.at_, d.as_, layout(d.offsets, d.real),
                               GroupedWeights::from_stacked(want), accumulate);
        std::vector<Tensor> experts;
        std::vector<TensorView> views;
        for (int64_t e = 0; e < E; ++e) {
          Tensor x = make_tensor({p.n, p.k}, out);
          std::memcpy(x.data(), static_cast<const uint8_t*>(init.data()) + e * x.nbytes(),
                      x.nbytes());
          experts.push_back(x.to(kGpu));
          views.push_back(experts.back());
        }
        const ExpertTable table = make_expert_table(views);
        grouped_gemm_fp8_wgrad(d.dct.to(kGpu), d.dcs.to(kGpu), d.at_.to(kGpu), d.as_.to(kGpu),
                               layout(d.offsets.to(kGpu), d.real.to(kGpu)), table.weights,
                               accumulate);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        Tensor got = make_tensor({E, p.n, p.k}, out);
        for (int64_t e = 0; e < E; ++e) {
          Tensor g = experts[e].to(Device::cpu());
          std::memcpy(static_cast<uint8_t*>(got.data()) + e * g.nbytes(), g.data(), g.nbytes());
        }
        if (is_exact)
          EXPECT_TRUE(bytes_equal(got, want));
        else
          EXPECT_LT(rel_norm(got, want), out == DType::kFloat32 ? 3e-4 : 3e-3);
        for (int64_t i = 0; i < E * m; ++i) ASSERT_FALSE(std::isnan(at(got, i))) << i;
      }
}

// A group with real rows that does not start at a multiple of 128: the error
// flag is set and its dW left as it was; the other groups are right.
TEST(GpuGemmFp8Wgrad, MisalignedGroupIsFlagged) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  const WgradProblem p{{64, 192, 256}, {0, 100, 256}, 128, 128};  // group 1 starts at 64
  const WgradInputs d = make_inputs(p, [](int which, int64_t r, int64_t c) {
    return static_cast<float>((r + c * 3 + which) % 9) - 4.0f;
  });
  // The reference refuses it, naming the group.
  Tensor ref = make_tensor({3, p.n, p.k}, DType::kFloat32);
  EXPECT_NE(message_of([&] {
              grouped_gemm_fp8_wgrad(d.dct, d.dcs, d.at_, d.as_, layout(d.offsets, d.real),
                                     GroupedWeights::from_stacked(ref), false);
            }).find("group 1 starts at row 64"),
            std::string::npos);
  Tensor dw = poisoned({3, p.n, p.k}, DType::kFloat32, kGpu);
  Tensor err = Tensor::zeros({1}, DType::kInt32, kGpu);
  grouped_gemm_fp8_wgrad(d.dct.to(kGpu), d.dcs.to(kGpu), d.at_.to(kGpu), d.as_.to(kGpu),
                         layout(d.offsets.to(kGpu), d.real.to(kGpu), err),
                         GroupedWeights::from_stacked(dw), false);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(err.to(Device::cpu()).data_ptr<int32_t>()[0], 1);
  Tensor got = dw.to(Device::cpu());
  const int64_t m = p.n * p.k;
  for (int64_t i = 0; i < m; ++i) ASSERT_EQ(at(got, i), 0.0f) << "group 0 (no rows)";
  for (int64_t i = 0; i < m; ++i) ASSERT_TRUE(std::isnan(at(got, m + i))) << "group 1 written";
  // Group 2 alone against the reference (group 1's rows made empty there).
  Tensor real = d.real;
  real.data_ptr<int32_t>()[1] = 0;
  grouped_gemm_fp8_wgrad(d.dct, d.dcs, d.at_, d.as_, layout(d.offsets, real),
                         GroupedWeights::from_stacked(ref), false);
  double num = 0, den = 0;
  for (int64_t i = 2 * m; i < 3 * m; ++i) {
    const double g = at(got, i), w = at(ref, i);
    num += (g - w) * (g - w);
    den += w * w;
  }
  EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 3e-4);
}

// One captured launch replayed with new offsets: each replay bitwise equal to
// an eager call on the same layout.
TEST(GpuGemmFp8Wgrad, GraphReplayWithNewOffsets) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  // All rows real in the inputs (no NaN), so that any layout of them reads
  // finite values.
  const WgradProblem base{{512, 256, 0, 768}, {512, 256, 0, 768}, 256, 256};
  const std::vector<float> xs = normal_table(9);
  const WgradInputs d = make_inputs(
      base, [&](int which, int64_t r, int64_t c) { return xs[(r * 5 + c * 17 + which) & 0xFFFF]; });
  const int64_t E = base.seg.size();
  Tensor dct = d.dct.to(kGpu), dcs = d.dcs.to(kGpu), at_ = d.at_.to(kGpu), as = d.as_.to(kGpu);
  Tensor off = d.offsets.to(kGpu), real = d.real.to(kGpu);
  Tensor dw = Tensor::empty({E, base.n, base.k}, DType::kBFloat16, kGpu);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  auto call = [&](const Tensor& o, const Tensor& r, Tensor& out) {
    grouped_gemm_fp8_wgrad(dct, dcs, at_, as, layout(o, r), GroupedWeights::from_stacked(out),
                           false, s);
  };
  call(off, real, dw);  // warm-up
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  call(off, real, dw);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  // Other layouts of the same rows: groups on multiples of 128, partial
  // last slices, empty groups.
  const std::vector<std::vector<int64_t>> segs = {{128, 384, 768, 256}, {1536, 0, 0, 0}};
  const std::vector<std::vector<int32_t>> reals = {{128, 256, 0, 200}, {480, 0, 0, 0}};
  for (size_t replay = 0; replay < segs.size(); ++replay) {
    Tensor o = make_tensor({E + 1}, DType::kInt64), r = make_tensor({E}, DType::kInt32);
    int64_t acc = 0;
    for (int64_t e = 0; e < E; ++e) {
      o.data_ptr<int64_t>()[e] = acc;
      r.data_ptr<int32_t>()[e] = reals[replay][e];
      acc += segs[replay][e];
    }
    o.data_ptr<int64_t>()[E] = acc;
    copy(o, off, s);
    copy(r, real, s);
    fill_bytes(dw, 0xFF, s);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    Tensor eager = poisoned({E, base.n, base.k}, DType::kBFloat16, kGpu);
    Tensor o_g = o.to(kGpu), r_g = r.to(kGpu);
    call(o_g, r_g, eager);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_TRUE(bytes_equal(dw.to(Device::cpu()), eager.to(Device::cpu()))) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace moeflow::test
