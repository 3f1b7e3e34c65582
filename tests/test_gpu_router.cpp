// GPU router tests (label gpu): the CUDA backend against the CPU reference
// on random cases (T 0, 1, 7, 4096; E 8, 32, 64, 256, 512, 1000; K 1, 2, 8; every
// option). Expert ids, counts and the non-finite count must match exactly
// (both backends compute the routing scores with the same exact arithmetic);
// probs and dlogits within the float32 tolerance; the losses (sums over T*E
// terms in float32 against a double reference) within kLossTolerance.
// Outputs are poisoned before each run. Also: run-to-run bitwise
// determinism, graph capture + replay with new logits, the bias update.
// Padding mask and seq_aux_loss (random packed sequences with empty ones,
// spanning chunks): seq_tokens_per_expert exact, seq_aux_loss within
// kLossTolerance; an all-zero mask is bitwise no mask; invalid cu_seqlens
// are flagged without faults. Capacity: kept ids and dropped counts exactly
// the CPU's (both policies, ties, bad ids, in place), in a captured graph.
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
    for (int E : {8, 32, 64, 256, 512, 1000}) {
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

// ---- Padding mask and seq_aux_loss -------------------------------------------

struct SeqOuts {
  Outs o;
  Tensor seq_aux, seq_counts, invalid;
  RouterOutputs view() const {
    RouterOutputs v = o.view();
    v.seq_aux_loss = seq_aux;
    v.seq_tokens_per_expert = seq_counts;
    v.invalid_cu_seqlens = invalid;
    return v;
  }
};

SeqOuts make_seq_outs(int64_t T, int64_t S, const RouterConfig& c, Device dev) {
  SeqOuts r{make_outs(T, c, dev), Tensor::empty({1}, DType::kFloat32, dev),
            Tensor::empty({S, c.num_experts}, DType::kInt32, dev),
            Tensor::empty({1}, DType::kInt32, dev)};
  for (Tensor* t : {&r.seq_aux, &r.seq_counts, &r.invalid}) fill_bytes(*t, 0xFF);
  return r;
}

// Random packed sequences over T tokens: lengths 0..max_len (some empty).
Tensor random_cu_seqlens(int64_t T, int max_len, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> cu = {0};
  while (cu.back() < T) {
    const int len = (rng() % 5 == 0) ? 0 : static_cast<int>(rng() % (max_len + 1));
    cu.push_back(static_cast<int32_t>(std::min<int64_t>(T, cu.back() + len)));
  }
  if (cu.size() < 2) cu.push_back(0);      // T = 0: one empty sequence
  if (rng() % 2) cu.push_back(cu.back());  // an empty last sequence
  Tensor t = Tensor::empty({static_cast<int64_t>(cu.size())}, DType::kInt32);
  std::copy(cu.begin(), cu.end(), t.data_ptr<int32_t>());
  return t;
}

Tensor random_pad_mask(int64_t T, double rate, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  Tensor m = Tensor::empty({T}, DType::kUInt8);
  for (int64_t t = 0; t < T; ++t) m.data_ptr<uint8_t>()[t] = uni(rng) < rate ? 1 : 0;
  return m;
}

void expect_same_seq_forward(const SeqOuts& gpu, const SeqOuts& cpu) {
  expect_same_forward(gpu.o, cpu.o);
  EXPECT_EQ(to_vec<int32_t>(gpu.seq_counts), to_vec<int32_t>(cpu.seq_counts));
  EXPECT_TRUE(all_close(gpu.seq_aux.to(Device::cpu()), cpu.seq_aux, kLossTolerance));
  EXPECT_EQ(to_vec<int32_t>(gpu.invalid), std::vector<int32_t>{0});
}

TEST_F(GpuRouter, MaskAndSeqAuxLossMatchCpu) {
  uint32_t seed = 700;
  for (int64_t T : {0, 1, 7, 300, 4096}) {
    for (int E : {8, 64, 256}) {
      for (int K : {1, 2, 8}) {
        if (K > E) continue;
        for (Case cs : cases_for(E, K)) {
          for (int variant = 0; variant < 3; ++variant) {  // mask, seq, both
            const bool masked = variant != 1, seq = variant != 0;
            SCOPED_TRACE(std::string(cs.name) + " T=" + std::to_string(T) +
                         " E=" + std::to_string(E) + " K=" + std::to_string(K) +
                         (masked ? " masked" : "") + (seq ? " seq" : ""));
            RouterConfig c = cs.config;
            c.seq_aux_loss_coeff = seq ? 0.02f : 0.0f;
            Tensor logits = random_logits(T, E, ++seed, T >= 7);
            Tensor bias = Tensor::empty({E}, DType::kFloat32);
            fill_random(bias, ++seed, -0.1f, 0.1f);
            Tensor mask = random_pad_mask(T, 0.15, ++seed);
            Tensor cu = random_cu_seqlens(T, T > 1000 ? 300 : 9, ++seed);
            const int64_t S = seq ? cu.size(0) - 1 : 0;
            Tensor logits_g = logits.to(kGpu), bias_g = bias.to(kGpu), mask_g = mask.to(kGpu),
                   cu_g = cu.to(kGpu);
            TensorView bias_cpu = cs.bias ? TensorView(bias) : TensorView{};
            TensorView bias_gpu = cs.bias ? TensorView(bias_g) : TensorView{};
            RouterTokenInfo info_cpu{masked ? TensorView(mask) : TensorView{},
                                     seq ? TensorView(cu) : TensorView{}};
            RouterTokenInfo info_gpu{masked ? TensorView(mask_g) : TensorView{},
                                     seq ? TensorView(cu_g) : TensorView{}};

            SeqOuts cpu = make_seq_outs(T, S, c, Device::cpu()), gpu = make_seq_outs(T, S, c, kGpu);
            RouterOutputs vc = cpu.view(), vg = gpu.view();
            if (!seq) vc.seq_tokens_per_expert = vg.seq_tokens_per_expert = TensorView{};
            Tensor ws = Tensor::empty({static_cast<int64_t>(router_workspace_bytes(T, c, S))},
                                      DType::kUInt8, kGpu);
            router_forward(logits, c, vc, bias_cpu, {}, nullptr, info_cpu);
            router_forward(logits_g, c, vg, bias_gpu, ws, nullptr, info_gpu);
            MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
            if (seq) {
              expect_same_seq_forward(gpu, cpu);
            } else {
              expect_same_forward(gpu.o, cpu.o);
              EXPECT_EQ(to_vec<float>(gpu.seq_aux), std::vector<float>{0.0f});
            }

            Tensor dprobs = Tensor::empty({T, K}, DType::kFloat32);
            fill_random(dprobs, ++seed);
            Tensor daux = Tensor::empty({1}, DType::kFloat32);
            Tensor dz = Tensor::empty({1}, DType::kFloat32);
            Tensor dseq = Tensor::empty({1}, DType::kFloat32);
            daux.data_ptr<float>()[0] = 0.7f;
            dz.data_ptr<float>()[0] = 1.3f;
            dseq.data_ptr<float>()[0] = 0.9f;
            Tensor dl_cpu = Tensor::empty({T, E}, DType::kFloat32);
            Tensor dl_gpu = Tensor::empty({T, E}, DType::kFloat32, kGpu);
            fill_bytes(dl_gpu, 0xFF);
            router_backward(logits, cpu.o.ids, cpu.o.counts, RouterGrads{dprobs, daux, dz, dseq}, c,
                            dl_cpu, nullptr, info_cpu,
                            seq ? TensorView(cpu.seq_counts) : TensorView{});
            Tensor dprobs_g = dprobs.to(kGpu), daux_g = daux.to(kGpu), dz_g = dz.to(kGpu),
                   dseq_g = dseq.to(kGpu);
            router_backward(logits_g, gpu.o.ids, gpu.o.counts,
                            RouterGrads{dprobs_g, daux_g, dz_g, dseq_g}, c, dl_gpu, nullptr,
                            info_gpu, seq ? TensorView(gpu.seq_counts) : TensorView{});
            MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
            EXPECT_TRUE(all_close(dl_gpu.to(Device::cpu()), dl_cpu, tolerance(DType::kFloat32)));
          }
        }
      }
    }
  }
}

TEST_F(GpuRouter, ZeroMaskIsBitwiseNoMask) {
  const int64_t T = 1000;
  for (const Case& cs : cases_for(64, 8)) {
    SCOPED_TRACE(cs.name);
    const RouterConfig& c = cs.config;
    Tensor logits = random_logits(T, 64, 9, true).to(kGpu);
    Tensor bias = Tensor::zeros({64}, DType::kFloat32, kGpu);
    Tensor mask = Tensor::zeros({T}, DType::kBool, kGpu);
    Tensor dprobs = Tensor::empty({T, 8}, DType::kFloat32);
    fill_random(dprobs, 10);
    Tensor dprobs_g = dprobs.to(kGpu);
    Tensor one = Tensor::empty({1}, DType::kFloat32);
    one.data_ptr<float>()[0] = 1.0f;
    Tensor one_g = one.to(kGpu);
    Tensor ws = workspace_for(T, c);
    Outs a = make_outs(T, c, kGpu), b = make_outs(T, c, kGpu);
    Tensor dla = Tensor::empty({T, 64}, DType::kFloat32, kGpu);
    Tensor dlb = Tensor::empty({T, 64}, DType::kFloat32, kGpu);
    TensorView bv = cs.bias ? TensorView(bias) : TensorView{};
    router_forward(logits, c, a.view(), bv, ws);
    router_backward(logits, a.ids, a.counts, RouterGrads{dprobs_g, one_g, one_g}, c, dla);
    router_forward(logits, c, b.view(), bv, ws, nullptr, RouterTokenInfo{mask, {}});
    router_backward(logits, b.ids, b.counts, RouterGrads{dprobs_g, one_g, one_g}, c, dlb, nullptr,
                    RouterTokenInfo{mask, {}});
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    for (auto [x, y] : {std::pair{&a.ids, &b.ids},
                        {&a.probs, &b.probs},
                        {&a.counts, &b.counts},
                        {&a.aux, &b.aux},
                        {&a.z, &b.z},
                        {&a.nonfinite, &b.nonfinite},
                        {&dla, &dlb}})
      EXPECT_TRUE(bytes_equal(x->to(Device::cpu()), y->to(Device::cpu())));
  }
}

TEST_F(GpuRouter, SeqAuxLossBitwiseDeterministic) {
  const int64_t T = 4096;
  RouterConfig c = cases_for(256, 8)[0].config;
  c.seq_aux_loss_coeff = 0.01f;
  Tensor logits = random_logits(T, 256, 11, false).to(kGpu);
  Tensor cu = random_cu_seqlens(T, 500, 12);
  const int64_t S = cu.size(0) - 1;
  Tensor cu_g = cu.to(kGpu), mask = random_pad_mask(T, 0.1, 13).to(kGpu);
  Tensor dprobs = Tensor::zeros({T, 8}, DType::kFloat32, kGpu);
  Tensor one = Tensor::empty({1}, DType::kFloat32);
  one.data_ptr<float>()[0] = 1.0f;
  Tensor one_g = one.to(kGpu);
  Tensor ws =
      Tensor::empty({static_cast<int64_t>(router_workspace_bytes(T, c, S))}, DType::kUInt8, kGpu);
  SeqOuts a = make_seq_outs(T, S, c, kGpu), b = make_seq_outs(T, S, c, kGpu);
  Tensor dla = Tensor::empty({T, 256}, DType::kFloat32, kGpu);
  Tensor dlb = Tensor::empty({T, 256}, DType::kFloat32, kGpu);
  for (auto [o, dl] : {std::pair{&a, &dla}, std::pair{&b, &dlb}}) {
    router_forward(logits, c, o->view(), {}, ws, nullptr, {mask, cu_g});
    router_backward(logits, o->o.ids, o->o.counts, RouterGrads{dprobs, one_g, one_g, one_g}, c, *dl,
                    nullptr, {mask, cu_g}, o->seq_counts);
  }
  MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(bytes_equal(a.seq_aux.to(Device::cpu()), b.seq_aux.to(Device::cpu())));
  EXPECT_TRUE(bytes_equal(a.seq_counts.to(Device::cpu()), b.seq_counts.to(Device::cpu())));
  EXPECT_TRUE(bytes_equal(dla.to(Device::cpu()), dlb.to(Device::cpu())));
}

TEST_F(GpuRouter, InvalidCuSeqlensFlaggedNotFaulting) {
  const int64_t T = 200;
  RouterConfig c = cases_for(64, 2)[0].config;
  c.seq_aux_loss_coeff = 0.01f;
  Tensor logits = random_logits(T, 64, 14, false).to(kGpu);
  const std::vector<std::vector<int32_t>> bad = {{0, 150, 100, 200},      // decreasing
                                                 {5, 100, 200},           // cu[0] != 0
                                                 {0, 100, 150},           // cu[S] != T
                                                 {0, -50, 1000000, 200},  // out of range
                                                 {0, 2147483647, -2147483647 - 1, 0}};
  for (const auto& v : bad) {
    const int64_t S = static_cast<int64_t>(v.size()) - 1;
    Tensor cu = Tensor::empty({S + 1}, DType::kInt32);
    std::copy(v.begin(), v.end(), cu.data_ptr<int32_t>());
    Tensor cu_g = cu.to(kGpu);
    SeqOuts o = make_seq_outs(T, S, c, kGpu);
    Tensor ws =
        Tensor::empty({static_cast<int64_t>(router_workspace_bytes(T, c, S))}, DType::kUInt8, kGpu);
    router_forward(logits, c, o.view(), {}, ws, nullptr, {{}, cu_g});
    Tensor dl = Tensor::empty({T, 64}, DType::kFloat32, kGpu);
    Tensor zeros = Tensor::zeros({T, 2}, DType::kFloat32, kGpu);
    Tensor one = Tensor::empty({1}, DType::kFloat32);
    one.data_ptr<float>()[0] = 1.0f;
    Tensor one_g = one.to(kGpu);
    router_backward(logits, o.o.ids, o.o.counts, RouterGrads{zeros, {}, {}, one_g}, c, dl, nullptr,
                    {{}, cu_g}, o.seq_counts);
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(to_vec<int32_t>(o.invalid), std::vector<int32_t>{1});
    EXPECT_TRUE(std::isfinite(to_vec<float>(o.seq_aux)[0]));
    int64_t total = 0;
    for (int32_t n : to_vec<int32_t>(o.seq_counts)) total += n;
    EXPECT_EQ(total, T * 2);  // every token in some sequence
    // The CPU backend throws on the same values.
    EXPECT_NE(message_of([&] {
                SeqOuts h = make_seq_outs(T, S, c, Device::cpu());
                router_forward(logits.to(Device::cpu()), c, h.view(), {}, {}, nullptr, {{}, cu});
              }).find("cu_seqlens"),
              std::string::npos);
  }
}

// ---- Capacity ---------------------------------------------------------------

TEST_F(GpuRouter, CapacityMatchesCpu) {
  uint32_t seed = 900;
  for (int64_t T : {1, 7, 333, 4096, 20000}) {
    for (int E : {2, 8, 64, 256}) {
      for (int K : {1, 2, 8}) {
        if (K > E) continue;
        Tensor ids = random_topk(T, K, E, ++seed, 1.0, 0.05);
        if (T > 10) ids.data_ptr<int32_t>()[3] = E + 5;  // bad ids: -1 on the GPU
        Tensor probs = Tensor::empty({T, K}, DType::kFloat32);
        fill_random(probs, ++seed, 0.0f, 1.0f);
        for (int64_t i = 0; i < T * K; ++i)  // ties
          probs.data_ptr<float>()[i] = std::round(probs.data_ptr<float>()[i] * 16.0f) / 16.0f;
        Tensor ids_g = ids.to(kGpu), probs_g = probs.to(kGpu);
        Tensor ids_cpu = ids;
        if (T > 10) {  // the CPU reference throws on bad ids: compare with -1 there
          ids_cpu = Tensor::empty({T, K}, DType::kInt32);
          std::copy(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + T * K,
                    ids_cpu.data_ptr<int32_t>());
          ids_cpu.data_ptr<int32_t>()[3] = -1;
        }
        Tensor ws = Tensor::empty({static_cast<int64_t>(router_capacity_workspace_bytes(T, K, E))},
                                  DType::kUInt8, kGpu);
        for (double f : {0.3, 1.0, 1.25, 1e6}) {
          for (DropPolicy pol : {DropPolicy::kProbs, DropPolicy::kPosition}) {
            SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E) +
                         " K=" + std::to_string(K) + " factor=" + std::to_string(f) +
                         (pol == DropPolicy::kProbs ? " probs" : " position"));
            RouterCapacityConfig c;
            c.num_experts = E;
            c.capacity_factor = f;
            c.drop_policy = pol;
            Tensor kept = Tensor::empty({T, K}, DType::kInt32);
            Tensor dropped = Tensor::empty({1}, DType::kInt32);
            router_apply_capacity(ids_cpu, probs, c, kept, dropped);
            Tensor kept_g = Tensor::empty({T, K}, DType::kInt32, kGpu);
            Tensor dropped_g = Tensor::empty({1}, DType::kInt32, kGpu);
            fill_bytes(kept_g, 0xFF);
            fill_bytes(dropped_g, 0xFF);
            router_apply_capacity(ids_g, probs_g, c, kept_g, dropped_g, ws);
            MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
            EXPECT_EQ(to_vec<int32_t>(kept_g), to_vec<int32_t>(kept));
            EXPECT_EQ(to_vec<int32_t>(dropped_g), to_vec<int32_t>(dropped));
            // In place.
            Tensor inplace = ids_g.to(kGpu);
            router_apply_capacity(inplace, probs_g, c, inplace, {}, ws);
            MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
            EXPECT_EQ(to_vec<int32_t>(inplace), to_vec<int32_t>(kept));
          }
        }
      }
    }
  }
}

TEST_F(GpuRouter, GraphWithMaskSeqAndCapacity) {
  const int64_t T = 777;
  const int E = 64, K = 8;
  RouterConfig c = cases_for(E, K).back().config;  // sigmoid grouped + bias + scaled
  c.seq_aux_loss_coeff = 0.01f;
  RouterCapacityConfig cc;
  cc.num_experts = E;
  cc.capacity_factor = 0.8;
  const int64_t S = 5;
  Tensor bias = Tensor::empty({E}, DType::kFloat32);
  fill_random(bias, 3, -0.1f, 0.1f);
  Tensor bias_g = bias.to(kGpu);
  Tensor logits_g = Tensor::empty({T, E}, DType::kFloat32, kGpu);
  Tensor mask_g = Tensor::empty({T}, DType::kUInt8, kGpu);
  Tensor cu_g = Tensor::empty({S + 1}, DType::kInt32, kGpu);
  Tensor dprobs = Tensor::empty({T, K}, DType::kFloat32);
  fill_random(dprobs, 4);
  Tensor dprobs_g = dprobs.to(kGpu);
  Tensor one = Tensor::empty({1}, DType::kFloat32);
  one.data_ptr<float>()[0] = 1.0f;
  Tensor one_g = one.to(kGpu);
  Tensor ws =
      Tensor::empty({static_cast<int64_t>(router_workspace_bytes(T, c, S))}, DType::kUInt8, kGpu);
  Tensor cws = Tensor::empty({static_cast<int64_t>(router_capacity_workspace_bytes(T, K, E))},
                             DType::kUInt8, kGpu);
  SeqOuts g = make_seq_outs(T, S, c, kGpu);
  Tensor kept_g = Tensor::empty({T, K}, DType::kInt32, kGpu);
  Tensor dropped_g = Tensor::empty({1}, DType::kInt32, kGpu);
  Tensor dl_g = Tensor::empty({T, E}, DType::kFloat32, kGpu);
  const RouterTokenInfo info_g{mask_g, cu_g};

  cudaStream_t stream;
  MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  router_forward(logits_g, c, g.view(), bias_g, ws, stream, info_g);
  router_apply_capacity(g.o.ids, g.o.probs, cc, kept_g, dropped_g, cws, stream);
  router_backward(logits_g, g.o.ids, g.o.counts, RouterGrads{dprobs_g, one_g, one_g, one_g}, c,
                  dl_g, stream, info_g, g.seq_counts);
  MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint32_t round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Tensor logits = random_logits(T, E, 60 + round, true);
    Tensor mask = random_pad_mask(T, 0.1 * round, 70 + round);
    std::vector<int32_t> cuv = {0, 100, 100, static_cast<int32_t>(300 + 100 * round), 700, 777};
    Tensor cu = Tensor::empty({S + 1}, DType::kInt32);
    std::copy(cuv.begin(), cuv.end(), cu.data_ptr<int32_t>());
    copy(logits, logits_g, stream);
    copy(mask, mask_g, stream);
    copy(cu, cu_g, stream);
    for (Tensor* t : {&g.o.ids, &g.o.probs, &g.o.counts, &g.o.aux, &g.o.z, &g.o.nonfinite,
                      &g.seq_aux, &g.seq_counts, &g.invalid, &kept_g, &dropped_g, &dl_g})
      fill_bytes(*t, 0xFF, stream);
    MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
    SeqOuts cpu = make_seq_outs(T, S, c, Device::cpu());
    const RouterTokenInfo info{mask, cu};
    router_forward(logits, c, cpu.view(), bias, {}, nullptr, info);
    expect_same_seq_forward(g, cpu);
    Tensor kept = Tensor::empty({T, K}, DType::kInt32), dropped = Tensor::empty({1}, DType::kInt32);
    router_apply_capacity(cpu.o.ids, cpu.o.probs, cc, kept, dropped);
    EXPECT_EQ(to_vec<int32_t>(kept_g), to_vec<int32_t>(kept));
    EXPECT_EQ(to_vec<int32_t>(dropped_g), to_vec<int32_t>(dropped));
    Tensor dl_cpu = Tensor::empty({T, E}, DType::kFloat32);
    router_backward(logits, cpu.o.ids, cpu.o.counts, RouterGrads{dprobs, one, one, one}, c, dl_cpu,
                    nullptr, info, cpu.seq_counts);
    EXPECT_TRUE(all_close(dl_g.to(Device::cpu()), dl_cpu, tolerance(DType::kFloat32)));
  }
  MOEFLOW_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOEFLOW_CUDA_CHECK(cudaGraphDestroy(graph));
  MOEFLOW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace moeflow::test
