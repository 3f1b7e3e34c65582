// GPU router tests (label gpu): the CUDA backend against the CPU reference
// on random cases (T 0, 1, 7, 4096; E 8, 64, 256, 512; K 1, 2, 8; every
// option). Expert ids, counts and the non-finite count must match exactly
// (both backends compute the routing scores with the same exact arithmetic);
// probs and dlogits within the float32 tolerance; the losses (sums over T*E
// terms in float32 against a double reference) within kLossTolerance.
// Outputs are poisoned before each run. Also: run-to-run bitwise
// determinism, graph capture + replay with new logits, the bias update.
#include <cuda_runtime.h>

#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);
const Tolerance kLossTolerance{1e-6, 1e-4};

class GpuRouter : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device"; }
};

struct Outs {
  Tensor ids, probs, counts, aux, z, nonfinite;
  RouterOutputs view() const { return RouterOutputs{ids, probs, counts, aux, z, nonfinite}; }
};

Outs make_outs(int64_t T, const RouterConfig& c, Device dev) {
  Outs o;
  o.ids = Tensor::empty({T, c.topk}, DType::kInt32, dev);
  o.probs = Tensor::empty({T, c.topk}, DType::kFloat32, dev);
  o.counts = Tensor::empty({c.num_experts}, DType::kInt32, dev);
  o.aux = Tensor::empty({1}, DType::kFloat32, dev);
  o.z = Tensor::empty({1}, DType::kFloat32, dev);
  o.nonfinite = Tensor::empty({1}, DType::kInt32, dev);
  for (Tensor* t : {&o.ids, &o.probs, &o.counts, &o.aux, &o.z, &o.nonfinite}) fill_bytes(*t, 0xFF);
  return o;
}

Tensor workspace_for(int64_t T, const RouterConfig& c) {
  return Tensor::empty({static_cast<int64_t>(router_workspace_bytes(T, c))}, DType::kUInt8, kGpu);
}

struct Case {
  const char* name;
  RouterConfig config;
  bool bias;
};

// Every option on (E, K): softmax, pre_softmax, sigmoid (with and without
// bias), grouped (softmax and sigmoid + bias); scaling and both losses.
std::vector<Case> cases_for(int E, int K) {
  std::vector<Case> cs;
  RouterConfig base;
  base.num_experts = E;
  base.topk = K;
  base.aux_loss_coeff = 0.01f;
  base.z_loss_coeff = 0.001f;
  RouterConfig c = base;
  cs.push_back({"softmax", c, false});
  c.pre_softmax = true;
  c.topk_scaling_factor = 2.5f;
  cs.push_back({"pre_softmax scaled", c, false});
  c = base;
  c.score_function = ScoreFunction::kSigmoid;
  cs.push_back({"sigmoid", c, false});
  cs.push_back({"sigmoid bias", c, true});
  const int G = E >= 64 ? 8 : 4;
  const int gt = K == 1 ? 1 : (K == 2 ? 2 : 4);
  if (E % G == 0 && gt <= G && K % gt == 0 && K <= gt * (E / G)) {
    RouterConfig g = base;
    g.num_groups = G;
    g.group_topk = gt;
    cs.push_back({"softmax grouped", g, false});
    g.score_function = ScoreFunction::kSigmoid;
    g.topk_scaling_factor = 2.5f;
    cs.push_back({"sigmoid grouped bias scaled", g, true});
  }
  return cs;
}

// Random logits in [-4, 4) with repeated values (ties) and, with `nan`, a
// few NaN logits.
Tensor random_logits(int64_t T, int E, uint32_t seed, bool nan) {
  Tensor x = Tensor::empty({T, E}, DType::kFloat32);
  fill_random(x, seed, -4.0f, 4.0f);
  float* p = x.data_ptr<float>();
  for (int64_t t = 0; t < T; t += 5) p[t * E + E - 1] = p[t * E];
  if (nan)
    for (int64_t t = 1; t < T; t += 97) p[t * E + (t % E)] = NAN;
  return x;
}

void expect_same_forward(const Outs& gpu, const Outs& cpu) {
  EXPECT_EQ(to_vec<int32_t>(gpu.ids), to_vec<int32_t>(cpu.ids));
  EXPECT_EQ(to_vec<int32_t>(gpu.counts), to_vec<int32_t>(cpu.counts));
  EXPECT_EQ(to_vec<int32_t>(gpu.nonfinite), to_vec<int32_t>(cpu.nonfinite));
  EXPECT_TRUE(all_close(gpu.probs.to(Device::cpu()), cpu.probs, tolerance(DType::kFloat32)));
  EXPECT_TRUE(all_close(gpu.aux.to(Device::cpu()), cpu.aux, kLossTolerance));
  EXPECT_TRUE(all_close(gpu.z.to(Device::cpu()), cpu.z, kLossTolerance));
}

TEST_F(GpuRouter, ForwardAndBackwardMatchCpu) {
  uint32_t seed = 100;
  for (int64_t T : {0, 1, 7, 4096}) {
    for (int E : {8, 64, 256, 512}) {
      for (int K : {1, 2, 8}) {
        if (K > E) continue;
        for (const Case& cs : cases_for(E, K)) {
          SCOPED_TRACE(std::string(cs.name) + " T=" + std::to_string(T) +
                       " E=" + std::to_string(E) + " K=" + std::to_string(K));
          const RouterConfig& c = cs.config;
          Tensor logits = random_logits(T, E, ++seed, T >= 7);
          Tensor bias = Tensor::empty({E}, DType::kFloat32);
          fill_random(bias, ++seed, -0.1f, 0.1f);
          Tensor logits_g = logits.to(kGpu), bias_g = bias.to(kGpu);
          TensorView bias_cpu = cs.bias ? TensorView(bias) : TensorView{};
          TensorView bias_gpu = cs.bias ? TensorView(bias_g) : TensorView{};

          Outs cpu = make_outs(T, c, Device::cpu()), gpu = make_outs(T, c, kGpu);
          Tensor ws = workspace_for(T, c);
          router_forward(logits, c, cpu.view(), bias_cpu);
          router_forward(logits_g, c, gpu.view(), bias_gpu, ws);
          MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
          expect_same_forward(gpu, cpu);

          Tensor dprobs = Tensor::empty({T, K}, DType::kFloat32);
          fill_random(dprobs, ++seed);
          Tensor daux = Tensor::empty({1}, DType::kFloat32),
                 dz = Tensor::empty({1}, DType::kFloat32);
          daux.data_ptr<float>()[0] = 0.7f;
          dz.data_ptr<float>()[0] = 1.3f;
          Tensor dl_cpu = Tensor::empty({T, E}, DType::kFloat32);
          Tensor dl_gpu = Tensor::empty({T, E}, DType::kFloat32, kGpu);
          fill_bytes(dl_gpu, 0xFF);
          router_backward(logits, cpu.ids, cpu.counts, RouterGrads{dprobs, daux, dz}, c, dl_cpu);
          Tensor dprobs_g = dprobs.to(kGpu), daux_g = daux.to(kGpu), dz_g = dz.to(kGpu);
          router_backward(logits_g, gpu.ids, gpu.counts, RouterGrads{dprobs_g, daux_g, dz_g}, c,
                          dl_gpu);
          MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
          EXPECT_TRUE(all_close(dl_gpu.to(Device::cpu()), dl_cpu, tolerance(DType::kFloat32)));
        }
      }
    }
  }
}

TEST_F(GpuRouter, BitwiseDeterministic) {
  const int64_t T = 4096;
  for (const Case& cs : cases_for(256, 8)) {
    SCOPED_TRACE(cs.name);
    const RouterConfig& c = cs.config;
    Tensor logits = random_logits(T, 256, 7, false).to(kGpu);
    Tensor bias = Tensor::empty({256}, DType::kFloat32);
    fill_random(bias, 8, -0.1f, 0.1f);
    Tensor bias_g = bias.to(kGpu);
    Tensor dprobs = Tensor::empty({T, 8}, DType::kFloat32);
    fill_random(dprobs, 9);
    Tensor dprobs_g = dprobs.to(kGpu);
    Tensor one = Tensor::empty({1}, DType::kFloat32);
    one.data_ptr<float>()[0] = 1.0f;
    Tensor one_g = one.to(kGpu);
    Tensor ws = workspace_for(T, c);
    Outs a = make_outs(T, c, kGpu), b = make_outs(T, c, kGpu);
    Tensor dla = Tensor::empty({T, 256}, DType::kFloat32, kGpu);
    Tensor dlb = Tensor::empty({T, 256}, DType::kFloat32, kGpu);
    TensorView bv = cs.bias ? TensorView(bias_g) : TensorView{};
    for (auto [o, dl] : {std::pair{&a, &dla}, std::pair{&b, &dlb}}) {
      router_forward(logits, c, o->view(), bv, ws);
      router_backward(logits, o->ids, o->counts, RouterGrads{dprobs_g, one_g, one_g}, c, *dl);
    }
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(bytes_equal(a.ids.to(Device::cpu()), b.ids.to(Device::cpu())));
    EXPECT_TRUE(bytes_equal(a.probs.to(Device::cpu()), b.probs.to(Device::cpu())));
    EXPECT_TRUE(bytes_equal(a.aux.to(Device::cpu()), b.aux.to(Device::cpu())));
    EXPECT_TRUE(bytes_equal(a.z.to(Device::cpu()), b.z.to(Device::cpu())));
    EXPECT_TRUE(bytes_equal(dla.to(Device::cpu()), dlb.to(Device::cpu())));
  }
}

TEST_F(GpuRouter, GraphCaptureReplayWithNewLogits) {
  const int64_t T = 777;
  RouterConfig c = cases_for(64, 8).back().config;  // sigmoid grouped + bias + scaled
  const int E = c.num_experts, K = c.topk;
  Tensor bias = Tensor::empty({E}, DType::kFloat32);
  fill_random(bias, 3, -0.1f, 0.1f);
  Tensor bias_g = bias.to(kGpu);
  Tensor logits_g = Tensor::empty({T, E}, DType::kFloat32, kGpu);
  Tensor dprobs = Tensor::empty({T, K}, DType::kFloat32);
  fill_random(dprobs, 4);
  Tensor dprobs_g = dprobs.to(kGpu);
  Tensor one = Tensor::empty({1}, DType::kFloat32);
  one.data_ptr<float>()[0] = 1.0f;
  Tensor one_g = one.to(kGpu);
  Tensor ws = workspace_for(T, c);
  Outs g = make_outs(T, c, kGpu);
  Tensor dl_g = Tensor::empty({T, E}, DType::kFloat32, kGpu);

  cudaStream_t stream;
  MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  router_forward(logits_g, c, g.view(), bias_g, ws, stream);
  router_backward(logits_g, g.ids, g.counts, RouterGrads{dprobs_g, one_g, one_g}, c, dl_g, stream);
  MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint32_t round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Tensor logits = random_logits(T, E, 50 + round, true);
    copy(logits, logits_g, stream);
    for (Tensor* t : {&g.ids, &g.probs, &g.counts, &g.aux, &g.z, &g.nonfinite, &dl_g})
      fill_bytes(*t, 0xFF, stream);
    MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
    Outs cpu = make_outs(T, c, Device::cpu());
    router_forward(logits, c, cpu.view(), bias);
    expect_same_forward(g, cpu);
    Tensor dl_cpu = Tensor::empty({T, E}, DType::kFloat32);
    router_backward(logits, cpu.ids, cpu.counts, RouterGrads{dprobs, one, one}, c, dl_cpu);
    EXPECT_TRUE(all_close(dl_g.to(Device::cpu()), dl_cpu, tolerance(DType::kFloat32)));
  }
  MOEFLOW_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOEFLOW_CUDA_CHECK(cudaGraphDestroy(graph));
  MOEFLOW_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_F(GpuRouter, UpdateExpertBiasMatchesCpu) {
  for (int E : {1, 8, 256, 1000}) {
    SCOPED_TRACE("E=" + std::to_string(E));
    Tensor counts = Tensor::empty({E}, DType::kInt32);
    for (int e = 0; e < E; ++e) counts.data_ptr<int32_t>()[e] = (e * 37) % 11;
    Tensor bias = Tensor::empty({E}, DType::kFloat32);
    fill_random(bias, E);
    Tensor counts_g = counts.to(kGpu), bias_g = bias.to(kGpu);
    router_update_expert_bias(counts, bias, 1e-3f);
    router_update_expert_bias(counts_g, bias_g, 1e-3f);
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(bytes_equal(bias_g.to(Device::cpu()), bias));
  }
}

TEST_F(GpuRouter, WorkspaceTooSmallIsReported) {
  RouterConfig c;
  c.num_experts = 64;
  c.topk = 2;
  const int64_t T = 100;
  Outs o = make_outs(T, c, kGpu);
  Tensor logits = Tensor::zeros({T, 64}, DType::kFloat32, kGpu);
  Tensor small = Tensor::empty({8}, DType::kUInt8, kGpu);
  EXPECT_NE(message_of([&] {
              router_forward(logits, c, o.view(), {}, small);
            }).find("workspace must hold >= "),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
