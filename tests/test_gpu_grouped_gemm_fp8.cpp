// GPU blockwise FP8 grouped GEMM forward (label gpu) against the CPU
// reference: inputs quantized by moeflow::quantize (1x128 activations,
// 128x128 weights); random values within a stated relative-norm bound, and
// values whose every sum is exact in float32 bitwise; output poisoned first;
// pad rows zero; rows past the groups untouched; a captured launch replayed
// with new offsets. Every tile shape (GemmOptions::fp8_tile) runs the value
// checks, with blockwise and with tensorwise scales; the 192-wide tile's two weight-scale blocks
// (split at its column 128 or 64) and its columns past N are covered by N = 128, 256, 384, 1024.
#include <cuda_runtime.h>

#include <cstdio>
#include <tuple>

#include "gpu_util.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);

struct Fp8Problem {
  std::vector<int64_t> seg;   // rows of each group's segment
  std::vector<int32_t> real;  // real rows of each group
  int64_t k, n;
  int64_t tail = 7;  // rows past offsets[E]
};

struct Fp8Inputs {
  int64_t rows = 0;
  Tensor offsets, real, qa, sa, qw, sw;  // CPU
};

// The CPU layout of segment sizes and real rows: offsets int64 [E+1], real
// int32 [E].
std::pair<Tensor, Tensor> layout_of(const std::vector<int64_t>& seg,
                                    const std::vector<int32_t>& real) {
  const int64_t E = seg.size();
  Tensor offsets = make_tensor({E + 1}, DType::kInt64), r = make_tensor({E}, DType::kInt32);
  int64_t o = 0;
  for (int64_t e = 0; e < E; ++e) {
    offsets.data_ptr<int64_t>()[e] = o;
    r.data_ptr<int32_t>()[e] = real[e];
    o += seg[e];
  }
  offsets.data_ptr<int64_t>()[E] = o;
  return {offsets, r};
}

// Quantized inputs: x and w drawn by `draw` (element index -> float), then
// quantized with moeflow's CPU quantize.
template <typename Draw>
Fp8Inputs make_inputs(const Fp8Problem& p, Draw draw, bool pow2_scales = false,
                      bool tensorwise = false) {
  Fp8Inputs d;
  const int64_t E = p.seg.size(), K = p.k, N = p.n;
  std::tie(d.offsets, d.real) = layout_of(p.seg, p.real);
  d.rows = d.offsets.data_ptr<int64_t>()[E] + p.tail;
  Tensor x = make_tensor({d.rows, K}, DType::kFloat32),
         w = make_tensor({E * N, K}, DType::kFloat32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data_ptr<float>()[i] = draw(0, i);
  for (int64_t i = 0; i < w.numel(); ++i) w.data_ptr<float>()[i] = draw(1, i);
  QuantizeConfig ca, cw;
  ca.scaling = tensorwise ? QuantScaling::kTensorwise : QuantScaling::kBlock1x128;
  cw.scaling = tensorwise ? QuantScaling::kTensorwise : QuantScaling::kBlock128x128;
  ca.pow2_scales = cw.pow2_scales = pow2_scales;
  d.qa = make_tensor({d.rows, K}, DType::kFloat8E4M3);
  d.sa = tensorwise ? make_tensor({1}, DType::kFloat32)
                    : make_tensor({d.rows, K / 128}, DType::kFloat32);
  d.qw = make_tensor({E, N, K}, DType::kFloat8E4M3);
  d.sw = tensorwise ? make_tensor({1}, DType::kFloat32)
                    : make_tensor({E, N / 128, K / 128}, DType::kFloat32);
  quantize(x, ca, d.qa, d.sa);
  // w as [E*N, K]: its 128 x 128 blocks never straddle two experts (N % 128 == 0)
  quantize(w, cw, TensorView(d.qw.data(), DType::kFloat8E4M3, Device::cpu(), {E * N, K}),
           tensorwise
               ? TensorView(d.sw)
               : TensorView(d.sw.data(), DType::kFloat32, Device::cpu(), {E * N / 128, K / 128}));
  return d;
}

GroupLayout layout(const Tensor& offsets, const Tensor& real) {
  GroupLayout g;
  g.offsets = offsets;
  g.real_rows = real;
  return g;
}

// Runs the CPU reference and the GPU op; returns {cpu, gpu} outputs (CPU
// tensors) and checks the rows the op must not touch.
std::pair<Tensor, Tensor> run_both(const Fp8Problem& p, const Fp8Inputs& d,
                                   const GemmOptions& o = {}) {
  const int64_t N = p.n;
  Tensor want = make_tensor({d.rows, N}, DType::kBFloat16);
  std::memset(want.data(), 0, want.nbytes());
  grouped_gemm_fp8_forward(d.qa, d.sa, d.qw, d.sw, layout(d.offsets, d.real), want);
  Tensor qa = d.qa.to(kGpu), sa = d.sa.to(kGpu), qw = d.qw.to(kGpu), sw = d.sw.to(kGpu);
  Tensor off = d.offsets.to(kGpu), real = d.real.to(kGpu);
  Tensor c = poisoned({d.rows, N}, DType::kBFloat16, kGpu);
  grouped_gemm_fp8_forward(qa, sa, qw, sw, layout(off, real), c, o);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Tensor got = c.to(Device::cpu());
  // Rows past offsets[E] keep the poison.
  const int64_t end = d.offsets.data_ptr<int64_t>()[p.seg.size()];
  for (int64_t r = end; r < d.rows; ++r) EXPECT_TRUE(row_is(got, r, 0xFF)) << "row " << r;
  return {want, got};
}

const std::vector<Fp8Problem> kFp8Problems = {
    {{128}, {128}, 128, 128},                       // one tile
    {{16, 0, 144, 32}, {1, 0, 130, 32}, 256, 128},  // empty group, pad rows, a tile's edge
    {{256, 16, 400}, {200, 16, 389}, 384, 256},
    {{64, 512, 128, 48, 32}, {64, 500, 0, 40, 17}, 1024, 384},  // a pad-only group
    // more tiles than twice the SMs: blocks walk several tiles and groups
    // (the pipeline's phases and the group search carried across tiles)
    {{1024, 640, 0, 1536, 896, 16, 256}, {1000, 640, 0, 1500, 3, 16, 200}, 256, 1024},
};

const Fp8Tile kTiles[] = {Fp8Tile::kAuto, Fp8Tile::k128x128, Fp8Tile::k128x192, Fp8Tile::k192x128};

GemmOptions with_tile(Fp8Tile t) {
  GemmOptions o;
  o.fp8_tile = t;
  return o;
}

TEST(GpuGemmFp8, ForwardMatchesCpuWithinBound) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  uint32_t seed = 3;
  for (const Fp8Problem& p : kFp8Problems) {
    std::mt19937 rng(seed++);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> xs(1 << 16);
    for (float& v : xs) v = nd(rng);
    const Fp8Inputs d =
        make_inputs(p, [&](int which, int64_t i) { return xs[(i * 7 + which * 31) & 0xFFFF]; });
    for (const Fp8Tile tile : kTiles) {
      SCOPED_TRACE("tile " + std::to_string(static_cast<int>(tile)));
      const auto [want, got] = run_both(p, d, with_tile(tile));
      // Bound: the reference sums exact products in float64 and rounds once to
      // bf16; the GPU sums each 128-wide K block in float32 (tensor cores) and
      // scales it, then rounds to bf16: relative norm error < 3e-3 (bf16's
      // half ulp is 2^-9 = 2e-3 of a value; float32 sums add ~1e-6).
      double num = 0, den = 0;
      const int64_t end = d.offsets.data_ptr<int64_t>()[p.seg.size()];
      for (int64_t i = 0; i < end * p.n; ++i) {
        const double g = at(got, i), w = at(want, i);
        ASSERT_FALSE(std::isnan(g)) << "element " << i;
        num += (g - w) * (g - w);
        den += w * w;
      }
      EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 3e-3) << "K=" << p.k << " N=" << p.n;
      // Pad rows are zeros.
      for (size_t e = 0; e < p.seg.size(); ++e)
        for (int64_t r = p.real[e]; r < p.seg[e]; ++r)
          for (int64_t j = 0; j < p.n; ++j)
            ASSERT_EQ(at(got, (d.offsets.data_ptr<int64_t>()[e] + r) * p.n + j), 0.0f)
                << "group " << e << " pad row " << r;
    }
  }
}

TEST(GpuGemmFp8, ExactSumsAreBitwise) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  // Integers in [-8, 8], every 128-block holding 8: power-of-two scales
  // (2^-5) make every code exact (32 v), every partial sum an integer below
  // 2^24, so float32 and float64 agree and both round the same value.
  for (const Fp8Problem& p : {kFp8Problems[1], kFp8Problems[3]}) {
    const Fp8Inputs d = make_inputs(
        p,
        [](int which, int64_t i) {
          if (i % 128 == 5) return 8.0f;
          return static_cast<float>((i * (which ? 5 : 3) + which) % 17 - 8);
        },
        true);
    for (const Fp8Tile tile : kTiles) {
      const auto [want, got] = run_both(p, d, with_tile(tile));
      const int64_t end = d.offsets.data_ptr<int64_t>()[p.seg.size()];
      const auto* g = static_cast<const uint16_t*>(got.data());
      const auto* w = static_cast<const uint16_t*>(want.data());
      int64_t bad = 0, first = -1;
      for (int64_t i = 0; i < end * p.n; ++i)
        if (g[i] != w[i] && bad++ == 0) first = i;
      EXPECT_EQ(bad, 0) << "tile " << static_cast<int>(tile) << ": first difference at element "
                        << first << ": " << at(got, first) << " vs " << at(want, first);
    }
  }
}

// Tensorwise scales (a_scales and w_scales [1]): every tile, promoted every
// slice, every 4 (the default) and once (fast accumulation), within a
// relative-norm bound of the reference; pad rows zero.
TEST(GpuGemmFp8, TensorwiseMatchesCpuWithinBound) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  uint32_t seed = 21;
  for (const Fp8Problem& p : kFp8Problems) {
    std::mt19937 rng(seed++);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> xs(1 << 16);
    for (float& v : xs) v = nd(rng);
    const Fp8Inputs d = make_inputs(
        p, [&](int which, int64_t i) { return xs[(i * 7 + which * 31) & 0xFFFF]; }, false, true);
    for (const Fp8Tile tile : kTiles)
      for (const int promote : {1, -1, 0}) {
        SCOPED_TRACE("tile " + std::to_string(static_cast<int>(tile)) + " promote " +
                     std::to_string(promote));
        GemmOptions o = with_tile(tile);
        o.fp8_promote = promote;
        const auto [want, got] = run_both(p, d, o);
        // Bound: as the blockwise test (3e-3), with the tensor cores' own
        // accumulation over 4 slices (512 of K) or all of K (fast
        // accumulation: fewer bits than float32) inside it: 1e-2.
        double num = 0, den = 0;
        const int64_t end = d.offsets.data_ptr<int64_t>()[p.seg.size()];
        for (int64_t i = 0; i < end * p.n; ++i) {
          const double g = at(got, i), w = at(want, i);
          ASSERT_FALSE(std::isnan(g)) << "element " << i;
          num += (g - w) * (g - w);
          den += w * w;
        }
        const double err = std::sqrt(num / std::max(den, 1e-30));
        EXPECT_LT(err, promote == 1 ? 3e-3 : 1e-2) << "K=" << p.k << " N=" << p.n;
        if (tile == Fp8Tile::kAuto)
          std::printf("tensorwise K=%lld N=%lld promote %d: relative error %.2e\n",
                      static_cast<long long>(p.k), static_cast<long long>(p.n), promote, err);
        for (size_t e = 0; e < p.seg.size(); ++e)
          for (int64_t r = p.real[e]; r < p.seg[e]; ++r)
            for (int64_t j = 0; j < p.n; ++j)
              ASSERT_EQ(at(got, (d.offsets.data_ptr<int64_t>()[e] + r) * p.n + j), 0.0f)
                  << "group " << e << " pad row " << r;
      }
  }
}

// Tensorwise, promoted every slice, on values whose slice sums are exact in
// float32 (as ExactSumsAreBitwise): bitwise the reference on every tile.
TEST(GpuGemmFp8, TensorwiseExactSumsAreBitwise) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  for (const Fp8Problem& p : {kFp8Problems[1], kFp8Problems[3]}) {
    const Fp8Inputs d = make_inputs(
        p,
        [](int which, int64_t i) {
          if (i % 128 == 5) return 8.0f;
          return static_cast<float>((i * (which ? 5 : 3) + which) % 17 - 8);
        },
        true, true);
    for (const Fp8Tile tile : kTiles) {
      GemmOptions o = with_tile(tile);
      o.fp8_promote = 1;
      const auto [want, got] = run_both(p, d, o);
      const int64_t end = d.offsets.data_ptr<int64_t>()[p.seg.size()];
      const auto* g = static_cast<const uint16_t*>(got.data());
      const auto* w = static_cast<const uint16_t*>(want.data());
      int64_t bad = 0, first = -1;
      for (int64_t i = 0; i < end * p.n; ++i)
        if (g[i] != w[i] && bad++ == 0) first = i;
      EXPECT_EQ(bad, 0) << "tile " << static_cast<int>(tile) << ": first difference at element "
                        << first << ": " << at(got, first) << " vs " << at(want, first);
    }
  }
}

// c as columns of a wider buffer (rows strided, as the MLP's dgrad writes
// d(a) into d_h): the same bytes as a contiguous c, both on the GPU and in
// the reference, and the other columns untouched.
TEST(GpuGemmFp8, StridedOutputRows) {
  const Fp8Problem& p = kFp8Problems[2];
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> xs(1 << 12);
  for (float& v : xs) v = nd(rng);
  const Fp8Inputs d =
      make_inputs(p, [&](int which, int64_t i) { return xs[(i * 5 + which * 17) & 0xFFF]; });
  const int64_t N = p.n, ld = N + 48, col = 16;
  for (Device dev : {Device::cpu(), kGpu}) {
    if (dev.is_cuda() && !is_hopper()) continue;
    SCOPED_TRACE(dev.is_cpu() ? "cpu" : "cuda");
    Tensor qa = d.qa.to(dev), sa = d.sa.to(dev), qw = d.qw.to(dev), sw = d.sw.to(dev);
    Tensor off = d.offsets.to(dev), real = d.real.to(dev);
    Tensor c = poisoned({d.rows, N}, DType::kBFloat16, dev);
    Tensor wide = poisoned({d.rows, ld}, DType::kBFloat16, dev);
    grouped_gemm_fp8_forward(qa, sa, qw, sw, layout(off, real), c);
    grouped_gemm_fp8_forward(qa, sa, qw, sw, layout(off, real),
                             TensorView::strided(static_cast<uint16_t*>(wide.data()) + col,
                                                 DType::kBFloat16, dev, {d.rows, N}, {ld, 1}));
    if (dev.is_cuda()) MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    Tensor cc = c.to(Device::cpu()), wc = wide.to(Device::cpu());
    const auto* a = static_cast<const uint16_t*>(cc.data());
    const auto* b = static_cast<const uint16_t*>(wc.data());
    for (int64_t r = 0; r < d.rows; ++r)
      for (int64_t j = 0; j < ld; ++j) {
        const uint16_t want = j >= col && j < col + N ? a[r * N + j - col] : 0xFFFF;
        ASSERT_EQ(b[r * ld + j], want) << "row " << r << " column " << j;
      }
  }
}

// One captured launch replayed with new offsets on the device: each replay
// bitwise equal to an eager call on the same layout.
TEST(GpuGemmFp8, GraphReplayWithNewOffsets) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  const Fp8Problem base{{512, 256, 0, 768}, {500, 256, 0, 700}, 256, 256};
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> xs(1 << 16);
  for (float& v : xs) v = nd(rng);
  const Fp8Inputs d =
      make_inputs(base, [&](int which, int64_t i) { return xs[(i * 5 + which * 17) & 0xFFFF]; });
  const int64_t E = base.seg.size(), N = base.n;
  Tensor qa = d.qa.to(kGpu), sa = d.sa.to(kGpu), qw = d.qw.to(kGpu), sw = d.sw.to(kGpu);
  Tensor off = d.offsets.to(kGpu), real = d.real.to(kGpu);
  Tensor c = Tensor::empty({d.rows, N}, DType::kBFloat16, kGpu);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  grouped_gemm_fp8_forward(qa, sa, qw, sw, layout(off, real), c, s);  // warm-up
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  grouped_gemm_fp8_forward(qa, sa, qw, sw, layout(off, real), c, s);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  // New layouts over the same rows: other segment sizes, real rows and an
  // empty last group.
  const std::vector<std::vector<int64_t>> segs = {
      {256, 512, 768, 0}, {1536, 0, 0, 0}, {0, 128, 1024, 384}};
  for (size_t replay = 0; replay < segs.size(); ++replay) {
    std::vector<int32_t> real_rows(E);
    for (int64_t e = 0; e < E; ++e)  // odd groups end in 16 pad rows
      real_rows[e] =
          static_cast<int32_t>(segs[replay][e] - (e % 2 && segs[replay][e] > 0 ? 16 : 0));
    const auto [offsets, reals] = layout_of(segs[replay], real_rows);
    ASSERT_LE(offsets.data_ptr<int64_t>()[E], d.rows);
    copy(offsets, off, s);
    copy(reals, real, s);
    fill_bytes(c, 0xFF, s);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    Tensor eager = poisoned({d.rows, N}, DType::kBFloat16, kGpu);
    grouped_gemm_fp8_forward(qa, sa, qw, sw, layout(offsets.to(kGpu), reals.to(kGpu)), eager);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(bytes_equal(c.to(Device::cpu()), eager.to(Device::cpu()))) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace moeflow::test
