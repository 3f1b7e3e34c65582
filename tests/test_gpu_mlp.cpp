// GPU tests of the fused FC1 of the grouped expert MLP (label gpu): the TMA
// grouped GEMM with bias + activation + router-probability scale in its
// epilogue, against the float64 CPU reference (cpu/grouped_mlp.h), for every
// activation, [gate; up] halves and interleaved GLU rows, bias and probs on
// and off, experts with 0 and 1 rows, pad rows, rows past the groups. Both the
// activation output and the saved pre-activation output are checked (relative
// norm error under the bf16/fp16 GEMM bound); outputs are poisoned first; pad
// rows must be exactly zero and the tail untouched. Also the delayed wgrad
// into bf16 / fp16 weight gradients (bitwise the float32 ones rounded), and
// the activation quantized to FP8 (bitwise the GPU's own composition).
#include <cuda_runtime.h>

#include <random>

#include "core/activations.h"
#include "core/backends.h"
#include "core/mlp_call.h"
#include "cpu/grouped_mlp.h"
#include "gpu_util.h"
#include "moeflow/grouped_mlp.h"
#include "test_grouped_mlp_fp8.h"
#include "test_mlp_api.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);

struct Case {
  Activation act;
  int interleave;  // 0: halves
  bool bias, probs;
  int64_t h, f;
  DType dtype;
  bool save_raw = true;  // store the pre-activation output too (training)
};

std::string describe(const Case& c) {
  static const char* names[] = {"swiglu", "geglu", "clamped-qgeglu", "gelu", "relu", "sq-relu"};
  return std::string(names[static_cast<int>(c.act)]) + " il=" + std::to_string(c.interleave) +
         (c.bias ? " bias" : "") + (c.probs ? " probs" : "") + " H=" + std::to_string(c.h) +
         " F=" + std::to_string(c.f) + " " + dtype_name(c.dtype) + (c.save_raw ? "" : " no-raw");
}

void run_case(const Case& cs, uint32_t seed, const GemmOptions& opts = {}) {
  SCOPED_TRACE(describe(cs));
  std::mt19937 rng(seed);
  // groups: 7 experts, rows in [0, 300] (some 0 and 1), padded to 16 (one to 272
  // rows more); 5 rows past the groups
  const int E = 7;
  std::vector<int64_t> offsets{0}, real;
  for (int e = 0; e < E; ++e) {
    int r = std::uniform_int_distribution<int>(0, 300)(rng);
    if (e == 1) r = 0;
    if (e == 4) r = 1;
    real.push_back(r);
    // expert 5 padded far past its rows: 128-row tiles of pad rows only
    offsets.push_back(offsets.back() + (r + 15) / 16 * 16 + (e == 5 ? 272 : 0));
  }
  const int64_t used = offsets.back(), rows = used + 5, H = cs.h, F = cs.f;
  cpu::mlp::Shape shape{E, H, F};
  cpu::mlp::Config cfg;
  cfg.act = cs.act;
  cfg.glu_interleave = cs.interleave;
  cfg.bias1 = cs.bias;
  cfg.weighted = cs.probs;
  const int64_t N1 = cpu::mlp::fc1_rows(shape, cfg);

  Tensor x = make_tensor({rows, H}, cs.dtype), w1 = make_tensor({E, N1, H}, cs.dtype);
  Tensor b1 = make_tensor({E, N1}, cs.dtype), probs = make_tensor({rows}, DType::kFloat32);
  fill_random(x, seed + 1);
  fill_random(w1, seed + 2, -0.15f, 0.15f);
  fill_random(b1, seed + 3);
  fill_random(probs, seed + 4, 0.1f, 1.0f);

  // float64 reference on the same (rounded) inputs
  cpu::mlp::Groups g;
  g.offsets = offsets;
  g.real = real;
  cpu::mlp::Params prm;
  prm.w1 = doubles_of(w1);
  prm.b1 = doubles_of(b1);
  prm.w2.assign(size_t(E) * H * F, 0.0);
  prm.b2.assign(size_t(E) * H, 0.0);
  std::vector<double> xd = doubles_of(x), pd = doubles_of(probs), y;
  xd.resize(size_t(used) * H);
  pd.resize(used);
  cpu::mlp::Saved saved;
  cpu::mlp::forward(shape, cfg, g, prm, xd, pd, y, saved);

  Tensor offs = make_tensor({E + 1}, DType::kInt64), realt = make_tensor({E}, DType::kInt32);
  for (int e = 0; e <= E; ++e) offs.data_ptr<int64_t>()[e] = offsets[e];
  for (int e = 0; e < E; ++e) realt.data_ptr<int32_t>()[e] = static_cast<int32_t>(real[e]);
  Tensor offs_g = offs.to(kGpu), real_g = realt.to(kGpu);
  Tensor x_g = x.to(kGpu), w1_g = w1.to(kGpu), b1_g = b1.to(kGpu), probs_g = probs.to(kGpu);
  Tensor out_g = Tensor::empty({rows, F}, cs.dtype, kGpu),
         raw_g = Tensor::empty({rows, N1}, cs.dtype, kGpu);
  fill_bytes(out_g, 0xFF);
  fill_bytes(raw_g, 0xFF);

  MlpFc1Call call;
  call.x = x_g;
  call.w1 = w1_g;
  call.groups.offsets = offs_g;
  call.groups.real_rows = real_g;
  if (cs.bias) call.bias1 = b1_g;
  if (cs.probs) call.probs = probs_g;
  call.act = cs.act;
  call.params = cfg.params;
  call.glu_interleave = cs.interleave;
  call.out = out_g;
  if (cs.save_raw) call.raw = raw_g;
  call.rows = rows;
  call.num_groups = E;
  call.hidden = H;
  call.ffn = F;
  call.options = opts;
  cuda::mlp_fc1_forward(call, nullptr);
  MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());

  Tensor out = out_g.to(Device::cpu()), raw = raw_g.to(Device::cpu());
  std::vector<double> out_d = doubles_of(out), raw_d = doubles_of(raw), want_out(size_t(used) * F);
  for (int64_t r = 0; r < used; ++r)
    for (int64_t j = 0; j < F; ++j)
      want_out[r * F + j] = saved.a[r * F + j] * (cs.probs ? pd[r] : 1.0);
  std::vector<double> got_out(out_d.begin(), out_d.begin() + used * F);
  std::vector<double> got_raw(raw_d.begin(), raw_d.begin() + used * N1);
  EXPECT_LE(rel_norm_error(got_out, want_out), gemm_tolerance(cs.dtype));
  if (cs.save_raw) EXPECT_LE(rel_norm_error(got_raw, saved.h), gemm_tolerance(cs.dtype));
  // pad rows exactly zero; the rows past the groups keep their poison
  for (int e = 0; e < E; ++e)
    for (int64_t r = offsets[e] + real[e]; r < offsets[e + 1]; ++r) {
      for (int64_t j = 0; j < F; ++j) ASSERT_EQ(out_d[r * F + j], 0.0) << "pad row " << r;
      for (int64_t j = 0; j < N1 && cs.save_raw; ++j)
        ASSERT_EQ(raw_d[r * N1 + j], 0.0) << "pad row " << r;
    }
  const auto* ob = static_cast<const uint8_t*>(out.data());
  for (int64_t i = used * F * dtype_size(cs.dtype); i < int64_t(out.nbytes()); ++i)
    ASSERT_EQ(ob[i], 0xFF) << "tail of out written";
  const auto* rb = static_cast<const uint8_t*>(raw.data());
  for (int64_t i = cs.save_raw ? used * N1 * dtype_size(cs.dtype) : 0; i < int64_t(raw.nbytes());
       ++i)
    ASSERT_EQ(rb[i], 0xFF) << "raw written where it must not be";
}

TEST(GpuMlp, FusedFc1MatchesCpuReference) {
  ASSERT_GT(cuda_device_count(), 0);
  if (!is_hopper()) GTEST_SKIP() << "the fused FC1 runs on Hopper only";
  uint32_t seed = 100;
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kClampedQuickGeGLU})
    for (int il : {0, 32, 128})
      for (bool bias : {false, true})
        for (bool probs : {false, true})
          run_case(
              {act, il, bias, probs, 200, il == 0 ? 192 : (il == 32 ? 160 : 256), DType::kBFloat16},
              seed++);
  for (Activation act : {Activation::kGelu, Activation::kRelu, Activation::kSquaredRelu})
    for (bool bias : {false, true})
      run_case({act, 0, bias, true, 136, 200, DType::kBFloat16}, seed++);
  run_case({Activation::kSwiGLU, 0, true, true, 264, 320, DType::kFloat16}, seed++);
  run_case({Activation::kSwiGLU, 16, true, false, 64, 96, DType::kFloat16}, seed++);
  // consumer warpgroups staggered by 1 and 3 K slices (hidden 200: 4 slices)
  for (int stagger : {1, 3}) {
    GemmOptions t;
    t.stagger = stagger;
    run_case({Activation::kSwiGLU, 0, true, true, 200, 192, DType::kBFloat16}, seed++, t);
    run_case({Activation::kClampedQuickGeGLU, 32, true, false, 200, 160, DType::kBFloat16}, seed++,
             t);
  }
  // The ring's window skipping the stage the helpers hold (StageRing): none,
  // one slice, most of a tile (the default's kind: it ends inside the next
  // tile), longer than any tile; two and three stages (hidden 520: 9 slices)
  for (const auto& [st, hold] : {std::pair{4, 0}, {4, 1}, {4, 6}, {4, 1000}, {2, 3}, {3, 1000}}) {
    GemmOptions t;
    t.stages = st;
    t.hold = hold;
    run_case({Activation::kSwiGLU, 0, true, true, 520, 192, DType::kBFloat16}, seed++, t);
    run_case({Activation::kGeGLU, 0, false, true, 200, 320, DType::kBFloat16}, seed++, t);
  }
  // Without the pre-activation output (inference), and with every chunk
  // leaving through masked 16-byte stores instead of the TMA.
  for (Activation act : {Activation::kSwiGLU, Activation::kRelu})
    for (int il : {0, 32}) {
      Case c{act, is_gated(act) ? il : 0, true, true, 200, 192, DType::kBFloat16};
      c.save_raw = false;
      run_case(c, seed++);
    }
  GemmOptions direct;
  direct.kernel = GemmKernel::kTmaDirectStore;
  run_case({Activation::kSwiGLU, 0, true, true, 200, 192, DType::kBFloat16}, seed++, direct);
  run_case({Activation::kGelu, 0, true, true, 136, 200, DType::kBFloat16}, seed++, direct);
  run_case({Activation::kGeGLU, 32, false, true, 200, 160, DType::kBFloat16}, seed++, direct);
}

// The whole MLP (forward, dgrad, delayed wgrad) on the GPU against float64.
TEST(GpuMlp, ApiMatchesReference) {
  ASSERT_GT(cuda_device_count(), 0);
  uint32_t seed = 500;
  if (is_hopper()) {  // FC1 fused into the TMA GEMM; the dGLU separate, then fused
    for (const MlpApiCase& c : mlp_api_cases()) run_mlp_api_case(c, kGpu, seed++);
    uint32_t wide = 900;
    for (const MlpApiCase& c : mlp_api_wide_cases()) run_mlp_api_case(c, kGpu, wide++);
    GemmOptions fused;
    fused.fused_dglu = true;
    {
      SCOPED_TRACE("dGLU fused into FC2 dgrad");
      uint32_t s = 500;  // the same inputs as the unfused run
      for (const MlpApiCase& c : mlp_api_cases()) run_mlp_api_case(c, kGpu, s++, fused);
      s = 900;
      for (const MlpApiCase& c : mlp_api_wide_cases()) run_mlp_api_case(c, kGpu, s++, fused);
    }
  }
  // the unfused path (other GPUs): portable GEMMs + the activation kernel
  GemmOptions portable;
  portable.kernel = GemmKernel::kPortable;
  for (const MlpApiCase& c : mlp_api_cases()) run_mlp_api_case(c, kGpu, seed++, portable);
}

// backward_wgrad with bf16 / fp16 dw1 / dw2 (stacked dw1, dw2 as E separate
// tensors) equals, bitwise, the same kernels' float32 gradients rounded once:
// poisoned outputs (beta = 0), and beta = 1 (the start values + those
// rounded gradients, rounded: autograd's grad += g); an
// empty expert, pad rows holding garbage, rows past the groups, F and H not
// multiples of the tile; every GEMM path.
TEST(GpuMlp, WgradHalfPrecisionGradsAreFloat32Rounded) {
  ASSERT_GT(cuda_device_count(), 0);
  const int64_t E = 5, rows = 700, H = 200, F = 136, N1 = 2 * F;
  const std::vector<int64_t> o = {0, 160, 160, 420, 432, 690};
  const std::vector<int32_t> rr = {150, 0, 259, 1, 200};
  Tensor offs = make_tensor({E + 1}, DType::kInt64), real = make_tensor({E}, DType::kInt32);
  std::copy(o.begin(), o.end(), offs.data_ptr<int64_t>());
  std::copy(rr.begin(), rr.end(), real.data_ptr<int32_t>());
  Tensor offs_g = offs.to(kGpu), real_g = real.to(kGpu);
  GroupLayout layout;
  layout.offsets = offs_g;
  layout.real_rows = real_g;
  std::vector<GemmOptions> paths(3);
  paths[1].kernel = GemmKernel::kTmaDirectStore;
  paths[2].kernel = GemmKernel::kPortable;
  uint32_t seed = 800;
  for (const GemmOptions& gemm : paths)
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " kernel " +
                   std::to_string(static_cast<int>(gemm.kernel)));
      Tensor x = make_tensor({rows, H}, dt), dy = make_tensor({rows, H}, dt),
             a = make_tensor({rows, F}, dt), h = make_tensor({rows, N1}, dt),
             d_h = make_tensor({rows, N1}, dt);
      for (Tensor* t : {&x, &dy, &a, &h, &d_h}) fill_random(*t, seed++);
      Tensor xg = x.to(kGpu), dyg = dy.to(kGpu), ag = a.to(kGpu), hg = h.to(kGpu),
             d_hg = d_h.to(kGpu);
      auto rounded = [&](const Tensor& f32) {
        Tensor r = make_tensor(f32.sizes(), dt);
        for (int64_t i = 0; i < f32.numel(); ++i)
          detail::store_float(r.data(), dt, i, f32.data_ptr<float>()[i]);
        return r;
      };
      // dw2 as E separate device tensors
      std::vector<Tensor> parts;
      Tensor ptrs = make_tensor({E}, DType::kInt64);
      for (int64_t e = 0; e < E; ++e) {
        parts.push_back(Tensor::empty({H, F}, dt, kGpu));
        ptrs.data_ptr<int64_t>()[e] = reinterpret_cast<int64_t>(parts.back().data());
      }
      Tensor ptrs_g = ptrs.to(kGpu);
      const size_t part_bytes = parts[0].nbytes();
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
        Tensor dw1_32 = Tensor::empty({E, N1, H}, DType::kFloat32, kGpu),
               dw2_32 = Tensor::empty({E, H, F}, DType::kFloat32, kGpu),
               dw1_h = Tensor::empty({E, N1, H}, dt, kGpu);
        Tensor init1 = make_tensor({E, N1, H}, dt), init2 = make_tensor({E, H, F}, dt);
        for (Tensor* t : {&dw1_32, &dw2_32, &dw1_h}) fill_bytes(*t, 0xFF);
        if (accumulate) {  // the 16-bit gradients start at these values
          fill_random(init1, seed++);
          fill_random(init2, seed++);
          copy(init1, dw1_h);
        } else {
          fill_bytes(init2, 0xFF);
        }
        for (int64_t e = 0; e < E; ++e)
          MOEFLOW_CUDA_CHECK(cudaMemcpy(parts[e].data(),
                                        static_cast<const uint8_t*>(init2.data()) + e * part_bytes,
                                        part_bytes, cudaMemcpyHostToDevice));
        // The float32 gradients, fresh.
        grouped_mlp_backward_wgrad(dyg, xg, layout, {hg, ag}, d_hg,
                                   GroupedMlpGrads{dw1_32, dw2_32, {}, {}, false}, gemm);
        GroupedMlpGrads gh{dw1_h, {}, {}, {}, accumulate};
        gh.dw2_experts = GroupedWeights::from_pointers(ptrs_g, dt, H, F);
        grouped_mlp_backward_wgrad(dyg, xg, layout, {hg, ag}, d_hg, gh, gemm);
        MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
        const Tensor w1_32 = dw1_32.to(Device::cpu()), w2_32 = dw2_32.to(Device::cpu());
        for (const Tensor* t : {&w1_32, &w2_32})
          for (int64_t i = 0; i < t->numel(); ++i)
            ASSERT_FALSE(std::isnan(t->data_ptr<float>()[i])) << "float32 element " << i;
        const auto want = [&](const Tensor& fresh, const Tensor& init) {
          return wgrad_16bit(fresh, dt, accumulate ? &init : nullptr);
        };
        EXPECT_TRUE(bytes_equal(dw1_h.to(Device::cpu()), want(w1_32, init1))) << "dw1";
        Tensor w2_h = make_tensor({E, H, F}, dt);
        for (int64_t e = 0; e < E; ++e)
          MOEFLOW_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(w2_h.data()) + e * part_bytes,
                                        parts[e].data(), part_bytes, cudaMemcpyDeviceToHost));
        EXPECT_TRUE(bytes_equal(w2_h, want(w2_32, init2))) << "dw2 (separate tensors)";
      }
    }
}

// A forward + backward step captured once in a CUDA graph, replayed with new
// routings (offsets and real rows rewritten in place): every replay equals an
// eager run of the same routing bitwise.
TEST(GpuMlp, GraphReplayWithNewRouting) {
  ASSERT_GT(cuda_device_count(), 0);
  const int E = 4;
  const int64_t rows = 96, H = 64, F = 64;
  const DType dt = DType::kBFloat16;
  Tensor x = make_tensor({rows, H}, dt), w1 = make_tensor({E, 2 * F, H}, dt),
         w2 = make_tensor({E, H, F}, dt);
  Tensor dy = make_tensor({rows, H}, dt), probs = make_tensor({rows}, DType::kFloat32);
  fill_random(x, 1);
  fill_random(w1, 2, -0.2f, 0.2f);
  fill_random(w2, 3, -0.2f, 0.2f);
  fill_random(dy, 4);
  fill_random(probs, 5, 0.1f, 1.0f);
  Tensor xg = x.to(kGpu), w1g = w1.to(kGpu), w2g = w2.to(kGpu), dyg = dy.to(kGpu),
         pg = probs.to(kGpu);
  Tensor offs = Tensor::empty({E + 1}, DType::kInt64, kGpu),
         real = Tensor::empty({E}, DType::kInt32, kGpu);
  GroupLayout layout;
  layout.offsets = offs;
  layout.real_rows = real;
  GroupedMlpWeights w{w1g, w2g, {}, {}};
  GroupedMlpConfig cfg;
  Tensor y = Tensor::empty({rows, H}, dt, kGpu), h = Tensor::empty({rows, 2 * F}, dt, kGpu);
  Tensor a = Tensor::empty({rows, F}, dt, kGpu), dx = Tensor::empty({rows, H}, dt, kGpu);
  Tensor d_h = Tensor::empty({rows, 2 * F}, dt, kGpu),
         dp = Tensor::empty({rows}, DType::kFloat32, kGpu);
  Tensor dw1 = Tensor::empty({E, 2 * F, H}, DType::kFloat32, kGpu),
         dw2 = Tensor::empty({E, H, F}, DType::kFloat32, kGpu);
  cudaStream_t stream;
  MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto step = [&] {
    grouped_mlp_forward(xg, w, layout, pg, cfg, y, {h, a}, stream);
    grouped_mlp_backward_dgrad(dyg, w, layout, pg, cfg, {h, a}, dx, d_h, dp, stream);
    grouped_mlp_backward_wgrad(dyg, xg, layout, {h, a}, d_h,
                               GroupedMlpGrads{dw1, dw2, {}, {}, false}, stream);
  };
  auto set_routing = [&](const std::vector<int64_t>& o, const std::vector<int32_t>& r) {
    MOEFLOW_CUDA_CHECK(
        cudaMemcpyAsync(offs.data(), o.data(), o.size() * 8, cudaMemcpyHostToDevice, stream));
    MOEFLOW_CUDA_CHECK(
        cudaMemcpyAsync(real.data(), r.data(), r.size() * 4, cudaMemcpyHostToDevice, stream));
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
  };
  auto results = [&] {
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
    return std::vector<Tensor>{y.to(Device::cpu()), dx.to(Device::cpu()), dp.to(Device::cpu()),
                               dw1.to(Device::cpu()), dw2.to(Device::cpu())};
  };
  set_routing({0, 32, 48, 48, 96}, {30, 16, 0, 41});
  step();  // warm-up (kernel attributes, tensor maps) before the capture
  cudaGraph_t graph;
  MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  step();
  MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const std::vector<std::vector<int64_t>> offsets = {
      {0, 16, 64, 80, 96}, {0, 0, 0, 96, 96}, {0, 32, 48, 48, 96}};
  const std::vector<std::vector<int32_t>> reals = {{16, 47, 9, 16}, {0, 0, 95, 0}, {30, 16, 0, 41}};
  for (size_t i = 0; i < offsets.size(); ++i) {
    SCOPED_TRACE("routing " + std::to_string(i));
    set_routing(offsets[i], reals[i]);
    step();
    const std::vector<Tensor> eager = results();
    for (Tensor* t : {&y, &dx, &dp, &dw1, &dw2}) fill_bytes(*t, 0xFF, stream);
    MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    const std::vector<Tensor> replay = results();
    for (size_t k = 0; k < eager.size(); ++k)
      EXPECT_TRUE(bytes_equal(replay[k], eager[k])) << "output " << k;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(GpuMlp, FusedFc1RejectsBadLayouts) {
  ASSERT_GT(cuda_device_count(), 0);
  if (!is_hopper()) GTEST_SKIP() << "the fused FC1 runs on Hopper only";
  MlpFc1Call call;
  call.act = Activation::kSwiGLU;
  call.ffn = 96;  // halves need F % 64 == 0
  EXPECT_NE(message_of([&] { cuda::mlp_fc1_forward(call, nullptr); }).find("F % 64 == 0"),
            std::string::npos);
  call.glu_interleave = 24;
  EXPECT_NE(message_of([&] { cuda::mlp_fc1_forward(call, nullptr); }).find("glu_interleave"),
            std::string::npos);
}

// The activation quantized for an FP8 FC2 on the GPU: the GPU's own
// composition (recompute_activation then quantize), bit for bit.
TEST(GpuMlp, ActivationQuantizeIsRecomputeThenQuantize) {
  ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device";
  expect_activation_quantize_is_composition(kGpu);
}

// d(h)'s amax from the dGLU kernels (both), and the codes from it.
TEST(GpuMlp, ActivationBackwardAmax) {
  ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device";
  expect_activation_backward_amax(kGpu);
}

// The FP8 recipes (moeflow/grouped_mlp_fp8.h; blockwise, tensorwise) on the
// GPU against the same recipe on the CPU: the GEMMs sum 128-wide blocks in float32 (the CPU
// in float64; tensorwise: the tensor cores' own sums over 4 blocks), so h,
// and through it a's codes, may differ by a rounding: relative Frobenius
// error < 2e-2 for every output (tensorwise 3e-2: one scale per tensor
// leaves its small rows fewer bits, so a rounding of h flips more codes;
// 0.021 measured on an H200); and the GPU recipe
// against the GPU's bf16 MLP within the FP8 bound (< 0.1, calc_diff < 5e-3).
TEST(GpuMlp, Fp8RecipeMatchesCpu) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  for (const Fp8Recipe recipe : {Fp8Recipe::kBlockwise, Fp8Recipe::kTensorwise}) {
    SCOPED_TRACE(recipe == Fp8Recipe::kBlockwise ? "blockwise" : "tensorwise");
    const Fp8MlpResult c = run_fp8_mlp(Device::cpu(), 5, recipe), g = run_fp8_mlp(kGpu, 5, recipe);
    const int64_t H = 256, N1 = 256, used = c.used;
    for (auto [name, got, want, n] :
         {std::tuple{"y", &g.y, &c.y, used * H}, std::tuple{"h", &g.h, &c.h, used * N1},
          std::tuple{"d_h", &g.d_h, &c.d_h, used * N1}, std::tuple{"dx", &g.dx, &c.dx, used * H},
          std::tuple{"dprobs", &g.dprobs, &c.dprobs, used}})
      EXPECT_LT(fp8_errors(*got, *want, n).first, recipe == Fp8Recipe::kTensorwise ? 3e-2 : 2e-2)
          << name;
    for (auto [name, got, want, n] :
         {std::tuple{"y", &g.y, &g.y16, used * H}, std::tuple{"dx", &g.dx, &g.dx16, used * H}}) {
      const auto [rel, cd] = fp8_errors(*got, *want, n);
      EXPECT_LT(rel, 0.1) << name;
      EXPECT_LT(cd, 5e-3) << name;
      RecordProperty(std::string(name) + "_rel", std::to_string(rel));
    }
    const auto* yb = static_cast<const uint16_t*>(g.y.data());
    for (int64_t i = used * H; i < g.y.numel(); ++i) ASSERT_EQ(yb[i], 0xFFFF) << "past the groups";
  }
}

// The FP8 weight gradients (grouped_mlp_fp8_backward_wgrad, both recipes;
// tensorwise on groups starting off the 128-row blocks) on the GPU:
// near the CPU's (both FP8) and within the FP8 bound of the GPU's 16-bit
// wgrad on the same h, a and d_h; bf16 and accumulated float32 dW.
TEST(GpuMlp, Fp8WgradMatchesCpu) {
  if (!is_hopper()) GTEST_SKIP() << "the FP8 grouped GEMM runs on Hopper only";
  for (const Fp8Recipe recipe : {Fp8Recipe::kBlockwise, Fp8Recipe::kTensorwise})
    for (auto [dwt, acc] : {std::pair{DType::kBFloat16, false}, std::pair{DType::kFloat32, true}}) {
      SCOPED_TRACE(std::string(dtype_name(dwt)) + (acc ? " accumulate " : " ") +
                   (recipe == Fp8Recipe::kBlockwise ? "blockwise" : "tensorwise"));
      const Fp8WgradResult c = run_fp8_wgrad(Device::cpu(), 6, dwt, acc, recipe);
      const Fp8WgradResult g = run_fp8_wgrad(kGpu, 6, dwt, acc, recipe);
      for (auto [name, got, cpu, bf16] : {std::tuple{"dw1", &g.dw1, &c.dw1, &g.dw1_16},
                                          std::tuple{"dw2", &g.dw2, &c.dw2, &g.dw2_16}}) {
        EXPECT_LT(fp8_errors(*got, *cpu, got->numel()).first,
                  recipe == Fp8Recipe::kTensorwise ? 3e-2 : 2e-2)
            << name;
        const auto [rel, cd] = fp8_errors(*got, *bf16, got->numel());
        EXPECT_LT(rel, 0.1) << name;
        EXPECT_LT(cd, 5e-3) << name;
      }
    }
}

}  // namespace
}  // namespace moeflow::test
