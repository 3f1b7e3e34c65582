// grouped_mlp_fp8_fc1_forward on the GPU (label gpu): FC1 with a's 1x128
// quantization in the FP8 GEMM's epilogue, bit for bit the GPU's own
// composition (grouped_gemm_fp8_forward, then grouped_mlp_activation_quantize
// of its h): h, a's codes and scales, every row (pad rows, rows past the
// groups left as poisoned). Every activation, every GLU interleave the fused
// kernel takes and one it does not (the composition then), both tiles
// (128 x 128, 192 x 128), probs or none, power-of-two scales, and rows whose
// a overflows to inf or holds NaN (the policy's slow path). A captured launch
// replayed with new offsets and tokens.
#include <cuda_runtime.h>

#include <random>
#include <string>

#include "gpu_util.h"
#include "moeflow/grouped_mlp_fp8.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);
constexpr int64_t kE = 3, kH = 256;

bool is_gated(Activation a) {
  return a == Activation::kSwiGLU || a == Activation::kGeGLU || a == Activation::kClampedQuickGeGLU;
}

struct Fc1Problem {
  int64_t f = 256;
  Activation act = Activation::kSwiGLU;
  int il = 0;
  bool probs = true, pow2 = false, special = false;
  Fp8Tile tile = Fp8Tile::kAuto;
};

struct Fc1Out {
  Tensor h, a_q, a_s;  // CPU copies
};

// The groups: 144 rows (130 real), an empty one, 256 (250 real); 48 rows
// past them.
constexpr int64_t kRows = 448;
const std::vector<int64_t> kOffsets = {0, 144, 144, 400};
const std::vector<int32_t> kReal = {130, 0, 250};

struct Fc1Inputs {
  Tensor xq, xs, wq, ws, probs, offsets, real;  // on the GPU
};

Tensor host_layout_offsets(const std::vector<int64_t>& o) {
  Tensor t = make_tensor({static_cast<int64_t>(o.size())}, DType::kInt64);
  for (size_t i = 0; i < o.size(); ++i) t.data_ptr<int64_t>()[i] = o[i];
  return t;
}
Tensor host_real(const std::vector<int32_t>& r) {
  Tensor t = make_tensor({static_cast<int64_t>(r.size())}, DType::kInt32);
  for (size_t i = 0; i < r.size(); ++i) t.data_ptr<int32_t>()[i] = r[i];
  return t;
}

// x [rows, H] and W1 [E, N1, H] random bf16, quantized on the GPU (1x128,
// 128x128). special: row 3's x holds a NaN (its h and a are NaN), row 5's
// is scaled by 1e20 (its a overflows float32 to inf).
Fc1Inputs fc1_inputs(const Fc1Problem& p, uint32_t seed) {
  const int64_t n1 = is_gated(p.act) ? 2 * p.f : p.f;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Tensor x = make_tensor({kRows, kH}, DType::kBFloat16),
         w = make_tensor({kE * n1, kH}, DType::kBFloat16);
  for (int64_t i = 0; i < x.numel(); ++i) detail::store_float(x.data(), x.dtype(), i, nd(rng));
  for (int64_t i = 0; i < w.numel(); ++i)
    detail::store_float(w.data(), w.dtype(), i, nd(rng) / 16.0f);
  if (p.special) {
    detail::store_float(x.data(), x.dtype(), 3 * kH + 7, NAN);
    for (int64_t k = 0; k < kH; ++k)
      detail::store_float(x.data(), x.dtype(), 5 * kH + k, at(x, 5 * kH + k) * 1e20f);
  }
  Fc1Inputs in;
  const QuantizeConfig rows{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, false};
  const QuantizeConfig blocks{DType::kFloat8E4M3, QuantScaling::kBlock128x128, false, false};
  Tensor xd = x.to(kGpu), wd = w.to(kGpu);
  in.xq = Tensor::empty({kRows, kH}, DType::kFloat8E4M3, kGpu);
  in.xs = Tensor::empty({kRows, kH / 128}, DType::kFloat32, kGpu);
  in.wq = Tensor::empty({kE, n1, kH}, DType::kFloat8E4M3, kGpu);
  in.ws = Tensor::empty({kE, n1 / 128, kH / 128}, DType::kFloat32, kGpu);
  quantize(xd, rows, in.xq, in.xs);
  quantize(TensorView(wd.data(), DType::kBFloat16, kGpu, {kE * n1, kH}), blocks,
           TensorView(in.wq.data(), DType::kFloat8E4M3, kGpu, {kE * n1, kH}),
           TensorView(in.ws.data(), DType::kFloat32, kGpu, {kE * n1 / 128, kH / 128}));
  Tensor pr = make_tensor({kRows}, DType::kFloat32);
  for (int64_t i = 0; i < kRows; ++i) pr.data_ptr<float>()[i] = 0.25f + 0.5f * (i % 7) / 7.0f;
  in.probs = pr.to(kGpu);
  in.offsets = host_layout_offsets(kOffsets).to(kGpu);
  in.real = host_real(kReal).to(kGpu);
  return in;
}

GroupedMlpConfig config_of(const Fc1Problem& p) {
  GroupedMlpConfig c;
  c.activation = p.act;
  c.glu_interleave = p.il;
  c.gemm.fp8_tile = p.tile;
  return c;
}

struct Outs {
  Tensor h, a_q, a_s;
};
Outs poisoned_outs(const Fc1Problem& p) {
  const int64_t n1 = is_gated(p.act) ? 2 * p.f : p.f;
  return {poisoned({kRows, n1}, DType::kBFloat16, kGpu),
          poisoned({kRows, p.f}, DType::kFloat8E4M3, kGpu),
          poisoned({kRows, p.f / 128}, DType::kFloat32, kGpu)};
}
Fc1Out to_cpu(const Outs& o) {
  return {o.h.to(Device::cpu()), o.a_q.to(Device::cpu()), o.a_s.to(Device::cpu())};
}

GroupLayout layout_of(const Fc1Inputs& in) {
  GroupLayout g;
  g.offsets = in.offsets;
  g.real_rows = in.real;
  return g;
}

Fc1Out fused(const Fc1Problem& p, const Fc1Inputs& in) {
  Outs o = poisoned_outs(p);
  grouped_mlp_fp8_fc1_forward(in.xq, in.xs, in.wq, in.ws, layout_of(in),
                              p.probs ? TensorView(in.probs) : TensorView{}, config_of(p), o.h,
                              o.a_q, o.a_s, p.pow2);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return to_cpu(o);
}

Fc1Out composed(const Fc1Problem& p, const Fc1Inputs& in) {
  Outs o = poisoned_outs(p);
  const GroupedMlpConfig c = config_of(p);
  grouped_gemm_fp8_forward(in.xq, in.xs, in.wq, in.ws, layout_of(in), o.h, c.gemm);
  QuantizeConfig q{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, false};
  q.pow2_scales = p.pow2;
  grouped_mlp_activation_quantize(o.h, layout_of(in), p.probs ? TensorView(in.probs) : TensorView{},
                                  c, q, o.a_q, o.a_s);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return to_cpu(o);
}

void expect_equal(const Fc1Out& got, const Fc1Out& want) {
  EXPECT_TRUE(bytes_equal(got.h, want.h)) << "h";
  EXPECT_TRUE(bytes_equal(got.a_q, want.a_q)) << "a_q";
  EXPECT_TRUE(bytes_equal(got.a_s, want.a_s)) << "a_scales";
}

std::string name_of(const Fc1Problem& p) {
  return "act " + std::to_string(static_cast<int>(p.act)) + " il " + std::to_string(p.il) + " F " +
         std::to_string(p.f) + " tile " + std::to_string(static_cast<int>(p.tile)) +
         (p.probs ? " probs" : "") + (p.pow2 ? " pow2" : "") + (p.special ? " special" : "");
}

TEST(GpuMlpFp8Fc1, FusedIsGemmThenActivationQuantize) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  std::vector<Fc1Problem> cases;
  for (const Fp8Tile tile : {Fp8Tile::k128x128, Fp8Tile::k192x128})
    for (const int il : {0, 8, 16, 32, 64, 128, 256}) {
      Fc1Problem p;
      p.tile = tile;
      p.il = il;
      p.probs = il % 16 == 0;
      p.pow2 = il == 32;
      cases.push_back(p);
    }
  for (const Activation a : {Activation::kGeGLU, Activation::kClampedQuickGeGLU, Activation::kGelu,
                             Activation::kRelu, Activation::kSquaredRelu}) {
    Fc1Problem p;
    p.act = a;
    p.il = is_gated(a) ? 64 : 0;
    cases.push_back(p);
  }
  Fc1Problem one_block;  // F = 128: one tile of a per row block
  one_block.f = 128;
  cases.push_back(one_block);
  for (const Activation a : {Activation::kSwiGLU, Activation::kGelu}) {
    Fc1Problem p;
    p.act = a;
    p.special = true;
    cases.push_back(p);
  }
  uint32_t seed = 1;
  for (const Fc1Problem& p : cases) {
    SCOPED_TRACE(name_of(p));
    const Fc1Inputs in = fc1_inputs(p, seed++);
    const Fc1Out got = fused(p, in), want = composed(p, in);
    expect_equal(got, want);
    // the values are there: pad rows code 0, data rows not all 0
    const auto* q = static_cast<const uint8_t*>(got.a_q.data());
    EXPECT_EQ(q[140 * p.f], 0) << "a pad row";
    int nonzero = 0;
    for (int64_t i = 0; i < p.f; ++i) nonzero += q[10 * p.f + i] != 0;
    EXPECT_GT(nonzero, p.f / 4) << "a data row";
    if (p.special) EXPECT_EQ(q[3 * p.f], 0x7F) << "NaN row";
  }
}

TEST(GpuMlpFp8Fc1, GraphReplayWithNewOffsets) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  Fc1Problem p;
  p.il = 32;
  Fc1Inputs in = fc1_inputs(p, 11);
  Outs o = poisoned_outs(p);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  const auto call = [&] {
    grouped_mlp_fp8_fc1_forward(in.xq, in.xs, in.wq, in.ws, layout_of(in), in.probs, config_of(p),
                                o.h, o.a_q, o.a_s, false, s);
  };
  call();  // warm-up
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  call();
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const std::vector<std::vector<int64_t>> offs = {{0, 0, 256, 384}, {0, 400, 400, 400}};
  const std::vector<std::vector<int32_t>> reals = {{0, 250, 100}, {384, 0, 0}};
  for (size_t r = 0; r < offs.size(); ++r) {
    const Fc1Inputs next = fc1_inputs(p, static_cast<uint32_t>(20 + r));
    const auto copy = [&](const Tensor& src, const Tensor& dst) {
      ASSERT_EQ(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault, s),
                cudaSuccess);
    };
    copy(next.xq, in.xq);
    copy(next.xs, in.xs);
    copy(host_layout_offsets(offs[r]), in.offsets);
    copy(host_real(reals[r]), in.real);
    ASSERT_EQ(cudaMemsetAsync(o.a_q.data(), 0xFF, o.a_q.nbytes(), s), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(o.a_s.data(), 0xFF, o.a_s.nbytes(), s), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(o.h.data(), 0xFF, o.h.nbytes(), s), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    SCOPED_TRACE("replay " + std::to_string(r));
    expect_equal(to_cpu(o), composed(p, in));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace moeflow::test
