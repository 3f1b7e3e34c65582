// GPU router tests (label gpu) for the kernel paths the random cases of
// test_gpu_router.cpp do not reach: the generic kernels (more than 512
// experts, or top-k above 32) and group sizes that are not a power of two,
// against the CPU reference, and the backward
// given hand-made ids (out-of-range ids and repeated ids in real rows,
// which top-k never produces) on both the fast and the generic path.
#include <cuda_runtime.h>

#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);
const Tolerance kLossTolerance{1e-6, 1e-4};

class GpuRouterPaths : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device"; }
};

std::vector<RouterConfig> configs(int E, int K) {
  std::vector<RouterConfig> cs;
  RouterConfig c;
  c.num_experts = E;
  c.topk = K;
  c.aux_loss_coeff = 0.01f;
  c.z_loss_coeff = 0.001f;
  cs.push_back(c);
  c.pre_softmax = true;
  c.topk_scaling_factor = 2.5f;
  cs.push_back(c);
  c.pre_softmax = false;
  c.score_function = ScoreFunction::kSigmoid;
  cs.push_back(c);
  return cs;
}

Tensor logits_for(int64_t T, int E, uint32_t seed) {
  Tensor x = Tensor::empty({T, E}, DType::kFloat32);
  fill_random(x, seed, -4.0f, 4.0f);
  return x;
}

TEST_F(GpuRouterPaths, GenericForwardAndBackwardMatchCpu) {
  uint32_t seed = 700;
  const int64_t T = 300;
  for (auto [E, K] : {std::pair{1024, 8}, std::pair{64, 40}, std::pair{600, 33}}) {
    for (const RouterConfig& c : configs(E, K)) {
      SCOPED_TRACE("E=" + std::to_string(E) + " K=" + std::to_string(K) +
                   " score=" + std::to_string(static_cast<int>(c.score_function)) +
                   (c.pre_softmax ? " pre_softmax" : ""));
      Tensor logits = logits_for(T, E, ++seed), logits_g = logits.to(kGpu);
      Tensor ids = Tensor::empty({T, K}, DType::kInt32), probs = Tensor::empty({T, K}, DType::kFloat32),
             counts = Tensor::empty({E}, DType::kInt32), aux = Tensor::empty({1}, DType::kFloat32),
             z = Tensor::empty({1}, DType::kFloat32), bad = Tensor::empty({1}, DType::kInt32);
      Tensor ids_g = Tensor::empty({T, K}, DType::kInt32, kGpu),
             probs_g = Tensor::empty({T, K}, DType::kFloat32, kGpu),
             counts_g = Tensor::empty({E}, DType::kInt32, kGpu),
             aux_g = Tensor::empty({1}, DType::kFloat32, kGpu),
             z_g = Tensor::empty({1}, DType::kFloat32, kGpu),
             bad_g = Tensor::empty({1}, DType::kInt32, kGpu);
      for (Tensor* t : {&ids_g, &probs_g, &counts_g, &aux_g, &z_g, &bad_g}) fill_bytes(*t, 0xFF);
      Tensor ws = Tensor::empty({static_cast<int64_t>(router_workspace_bytes(T, c))},
                                DType::kUInt8, kGpu);
      router_forward(logits, c, RouterOutputs{ids, probs, counts, aux, z, bad});
      router_forward(logits_g, c, RouterOutputs{ids_g, probs_g, counts_g, aux_g, z_g, bad_g}, {},
                     ws);
      MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(to_vec<int32_t>(ids_g), to_vec<int32_t>(ids));
      EXPECT_EQ(to_vec<int32_t>(counts_g), to_vec<int32_t>(counts));
      EXPECT_TRUE(all_close(probs_g.to(Device::cpu()), probs, tolerance(DType::kFloat32)));
      EXPECT_TRUE(all_close(aux_g.to(Device::cpu()), aux, kLossTolerance));
      EXPECT_TRUE(all_close(z_g.to(Device::cpu()), z, kLossTolerance));

      Tensor dprobs = Tensor::empty({T, K}, DType::kFloat32);
      fill_random(dprobs, ++seed);
      Tensor daux = Tensor::empty({1}, DType::kFloat32), dz = Tensor::empty({1}, DType::kFloat32);
      daux.data_ptr<float>()[0] = 0.7f;
      dz.data_ptr<float>()[0] = 1.3f;
      Tensor dl = Tensor::empty({T, E}, DType::kFloat32);
      Tensor dl_g = Tensor::empty({T, E}, DType::kFloat32, kGpu);
      fill_bytes(dl_g, 0xFF);
      router_backward(logits, ids, counts, RouterGrads{dprobs, daux, dz}, c, dl);
      Tensor dprobs_g = dprobs.to(kGpu), daux_g = daux.to(kGpu), dz_g = dz.to(kGpu);
      router_backward(logits_g, ids_g, counts_g, RouterGrads{dprobs_g, daux_g, dz_g}, c, dl_g);
      MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(all_close(dl_g.to(Device::cpu()), dl, tolerance(DType::kFloat32)));
    }
  }
}

// Group sizes that are not a power of two (the group step's row scan):
// DeepSeek-V2's 160 experts in 8 groups (top-3 groups, K 6), 96 in 4, 48 in 3.
TEST_F(GpuRouterPaths, UnevenGroupSizesMatchCpu) {
  uint32_t seed = 800;
  const int64_t T = 513;
  for (auto [E, G, gt, K] : {std::tuple{160, 8, 3, 6}, std::tuple{96, 4, 2, 8},
                             std::tuple{48, 3, 2, 4}}) {
    for (bool sigmoid : {false, true}) {
      SCOPED_TRACE("E=" + std::to_string(E) + " G=" + std::to_string(G) +
                   (sigmoid ? " sigmoid" : " softmax"));
      RouterConfig c;
      c.num_experts = E;
      c.topk = K;
      c.num_groups = G;
      c.group_topk = gt;
      c.aux_loss_coeff = 0.01f;
      if (sigmoid) {
        c.score_function = ScoreFunction::kSigmoid;
        c.topk_scaling_factor = 2.5f;
      }
      Tensor logits = logits_for(T, E, ++seed), logits_g = logits.to(kGpu);
      Tensor bias = Tensor::empty({E}, DType::kFloat32);
      fill_random(bias, ++seed, -0.1f, 0.1f);
      Tensor bias_g = bias.to(kGpu);
      Tensor ids = Tensor::empty({T, K}, DType::kInt32), probs = Tensor::empty({T, K}, DType::kFloat32),
             counts = Tensor::empty({E}, DType::kInt32), aux = Tensor::empty({1}, DType::kFloat32),
             bad = Tensor::empty({1}, DType::kInt32);
      Tensor ids_g = Tensor::empty({T, K}, DType::kInt32, kGpu),
             probs_g = Tensor::empty({T, K}, DType::kFloat32, kGpu),
             counts_g = Tensor::empty({E}, DType::kInt32, kGpu),
             aux_g = Tensor::empty({1}, DType::kFloat32, kGpu),
             bad_g = Tensor::empty({1}, DType::kInt32, kGpu);
      for (Tensor* t : {&ids_g, &probs_g, &counts_g, &aux_g, &bad_g}) fill_bytes(*t, 0xFF);
      Tensor ws = Tensor::empty({static_cast<int64_t>(router_workspace_bytes(T, c))},
                                DType::kUInt8, kGpu);
      router_forward(logits, c, RouterOutputs{ids, probs, counts, aux, {}, bad},
                     sigmoid ? TensorView(bias) : TensorView{});
      router_forward(logits_g, c, RouterOutputs{ids_g, probs_g, counts_g, aux_g, {}, bad_g},
                     sigmoid ? TensorView(bias_g) : TensorView{}, ws);
      MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(to_vec<int32_t>(ids_g), to_vec<int32_t>(ids));
      EXPECT_EQ(to_vec<int32_t>(counts_g), to_vec<int32_t>(counts));
      EXPECT_TRUE(all_close(probs_g.to(Device::cpu()), probs, tolerance(DType::kFloat32)));
      EXPECT_TRUE(all_close(aux_g.to(Device::cpu()), aux, kLossTolerance));
    }
  }
}

// Ids that top-k never writes: -1 and E + 3 in real rows (ignored), and an
// expert chosen twice in a row (two slots); counts given by hand.
TEST_F(GpuRouterPaths, BackwardOfHandMadeIdsMatchesCpu) {
  uint32_t seed = 900;
  const int64_t T = 97;
  for (auto [E, K] : {std::pair{64, 8}, std::pair{256, 8}, std::pair{1024, 8}, std::pair{64, 40}}) {
    for (const RouterConfig& c : configs(E, K)) {
      SCOPED_TRACE("E=" + std::to_string(E) + " K=" + std::to_string(K) +
                   " score=" + std::to_string(static_cast<int>(c.score_function)) +
                   (c.pre_softmax ? " pre_softmax" : ""));
      Tensor logits = logits_for(T, E, ++seed);
      Tensor ids = Tensor::empty({T, K}, DType::kInt32);
      int32_t* id = ids.data_ptr<int32_t>();
      for (int64_t t = 0; t < T; ++t)
        for (int k = 0; k < K; ++k) id[t * K + k] = static_cast<int32_t>((t * 7 + k * 13) % E);
      for (int64_t t = 0; t < T; t += 3) id[t * K + (t % K)] = -1;
      for (int64_t t = 1; t < T; t += 4) id[t * K + ((t + 1) % K)] = E + 3;
      for (int64_t t = 2; t < T; t += 5) id[t * K + K - 1] = id[t * K];  // a repeat
      Tensor counts = Tensor::empty({E}, DType::kInt32);
      for (int e = 0; e < E; ++e) counts.data_ptr<int32_t>()[e] = (e * 5) % 17;
      Tensor dprobs = Tensor::empty({T, K}, DType::kFloat32);
      fill_random(dprobs, ++seed);
      Tensor daux = Tensor::empty({1}, DType::kFloat32), dz = Tensor::empty({1}, DType::kFloat32);
      daux.data_ptr<float>()[0] = 0.7f;
      dz.data_ptr<float>()[0] = 1.3f;
      Tensor dl = Tensor::empty({T, E}, DType::kFloat32);
      Tensor dl_g = Tensor::empty({T, E}, DType::kFloat32, kGpu);
      fill_bytes(dl_g, 0xFF);
      router_backward(logits, ids, counts, RouterGrads{dprobs, daux, dz}, c, dl);
      Tensor logits_g = logits.to(kGpu), ids_g = ids.to(kGpu), counts_g = counts.to(kGpu),
             dprobs_g = dprobs.to(kGpu), daux_g = daux.to(kGpu), dz_g = dz.to(kGpu);
      router_backward(logits_g, ids_g, counts_g, RouterGrads{dprobs_g, daux_g, dz_g}, c, dl_g);
      MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(all_close(dl_g.to(Device::cpu()), dl, tolerance(DType::kFloat32)));
    }
  }
}

// router_split_bf16: CUDA against the CPU reference, bit for bit (a NaN
// equal to any NaN: payloads differ), on wide-exponent values with inf,
// NaN, subnormals and the largest float, for every layout the router GEMM
// uses and odd shapes; the output poisoned first.
TEST_F(GpuRouterPaths, SplitBf16MatchesCpu) {
  uint32_t seed = 1234;
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> expo(-140, 120);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  const float specials[] = {
      std::numeric_limits<float>::infinity(),  -std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::quiet_NaN(), 1e-45f,
      std::numeric_limits<float>::max(),       -0.0f};
  struct L {
    const char* parts;
    bool cols;
  };
  for (auto [R, C] : {std::pair<int64_t, int64_t>{5, 7}, {256, 7168}, {8192, 32}, {0, 8}}) {
    Tensor src = Tensor::empty({R, C}, DType::kFloat32);
    float* x = src.data_ptr<float>();
    for (int64_t i = 0; i < R * C; ++i)
      x[i] = (gen() & 1 ? -1.0f : 1.0f) * std::ldexp(mant(gen), expo(gen));
    for (int64_t i = 0; i < std::min<int64_t>(R * C, 6); ++i) x[i] = specials[i];
    Tensor src_g = src.to(kGpu);
    for (L l : {L{"0120", false}, L{"012", false}, L{"0001", true}, L{"012", true}, L{"2", true}}) {
      SCOPED_TRACE(std::string(l.parts) + (l.cols ? " along columns" : " along rows") +
                   " R=" + std::to_string(R) + " C=" + std::to_string(C));
      Bf16SplitLayout layout;
      layout.count = static_cast<int>(std::strlen(l.parts));
      for (int i = 0; i < layout.count; ++i) layout.parts[i] = l.parts[i] - '0';
      layout.along_columns = l.cols;
      const int64_t n = layout.count;
      const std::vector<int64_t> shape =
          l.cols ? std::vector<int64_t>{R, n * C} : std::vector<int64_t>{n * R, C};
      Tensor want = poisoned(shape, DType::kBFloat16);
      router_split_bf16(src, layout, want);
      Tensor got_g = poisoned(shape, DType::kBFloat16, kGpu);
      router_split_bf16(src_g, layout, got_g);
      MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
      Tensor got = got_g.to(Device::cpu());
      const uint16_t* a = got.data_ptr<uint16_t>();
      const uint16_t* b = want.data_ptr<uint16_t>();
      int64_t bad = 0, first = -1;
      for (int64_t i = 0; i < got.numel(); ++i) {
        const bool na = std::isnan(detail::bf16_to_float(a[i]));
        const bool nb = std::isnan(detail::bf16_to_float(b[i]));
        if (na != nb || (!na && a[i] != b[i])) {
          if (first < 0) first = i;
          ++bad;
        }
      }
      EXPECT_EQ(bad, 0) << "first at " << first << ": " << a[first < 0 ? 0 : first] << " vs "
                        << b[first < 0 ? 0 : first];
    }
  }
}

}  // namespace
}  // namespace moeflow::test
