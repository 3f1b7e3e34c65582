// Ops on the tensors of a GPU that is not the current one (label multigpu,
// 2+ GPUs): each public op runs on its arguments' device, here on a stream of
// GPU 1 (a kernel launched on another device into it fails), and leaves the
// caller's current device (GPU 0, which has a context) as it was. Results
// against the float64 / CPU reference, or bitwise against the same ops on
// GPU 0.
#include <cuda_runtime.h>

#include "moeflow/ep.h"
#include "test_grouped_mlp_fp8.h"
#include "test_mlp_api.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu0 = Device::cuda(0), kGpu1 = Device::cuda(1);

int current_device() {
  int d = -1;
  EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
  return d;
}

class MultiGpuDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GE(cuda_device_count(), 2) << "these tests need 2 GPUs";
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);  // ordered with GPU 1's default stream
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // GPU 0 in use: its context exists
  }
  void TearDown() override {
    EXPECT_EQ(current_device(), 0) << "an op left another device current";
    cudaSetDevice(1);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    cudaStreamDestroy(stream_);
    cudaSetDevice(0);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
  cudaStream_t stream_ = nullptr;
};

// The grouped MLP's composites (FC1 fused or not, bias-add, dGLU, recompute,
// wgrad and the bias gradients' column sums) on GPU 1.
TEST_F(MultiGpuDevice, GroupedMlpRunsOnItsTensorsDevice) {
  const std::vector<MlpApiCase> all = mlp_api_cases();
  uint32_t seed = 900;
  for (const MlpApiCase& cs : {all[3], all.back(), all[all.size() - 3]}) {
    run_mlp_api_case(cs, kGpu1, seed++, {}, stream_);
    ASSERT_EQ(current_device(), 0);
  }
}

// The FP8 MLP (the weights' codes, 1x128 quantization, FP8 GEMMs) and the
// bf16 one beside it: the same bits on GPU 1 as on GPU 0.
TEST_F(MultiGpuDevice, Fp8MlpOnGpu1MatchesGpu0) {
  for (Fp8Recipe recipe : {Fp8Recipe::kBlockwise, Fp8Recipe::kTensorwise}) {
    SCOPED_TRACE(recipe == Fp8Recipe::kBlockwise ? "blockwise" : "tensorwise");
    const Fp8MlpResult one = run_fp8_mlp(kGpu1, 17, recipe, stream_);
    ASSERT_EQ(current_device(), 0);
    const Fp8MlpResult zero = run_fp8_mlp(kGpu0, 17, recipe);
    EXPECT_TRUE(bytes_equal(one.y, zero.y)) << "y";
    EXPECT_TRUE(bytes_equal(one.h, zero.h)) << "h";
    EXPECT_TRUE(bytes_equal(one.d_h, zero.d_h)) << "d_h";
    EXPECT_TRUE(bytes_equal(one.dx, zero.dx)) << "dx";
    EXPECT_TRUE(bytes_equal(one.dprobs, zero.dprobs)) << "dprobs";
    EXPECT_TRUE(bytes_equal(one.y16, zero.y16)) << "y16";
    EXPECT_TRUE(bytes_equal(one.dx16, zero.dx16)) << "dx16";
  }
}

// Plan, permute with probs, unpermute, the plan's status, 1x128 quantize and
// the tensor helpers on GPU 1 against the CPU.
TEST_F(MultiGpuDevice, PlanPermuteQuantizeRunOnTheirTensorsDevice) {
  const int64_t T = 300, H = 256;
  const int K = 4, E = 16;
  const PlanConfig cfg{E, 16, -1};
  Tensor ids = random_topk(T, K, E, 41);
  Tensor x = make_tensor({T, H}, DType::kBFloat16), probs = make_tensor({T, K}, DType::kFloat32);
  fill_random(x, 42);
  fill_random(probs, 43, 0.1f, 1.0f);

  RoutingPlan pc = allocate_plan(T, K, cfg, Device::cpu());
  build_plan(ids, pc);
  const int64_t cap = pc.capacity_rows;
  Tensor yc = poisoned({cap, H}, DType::kBFloat16), ppc = poisoned({cap}, DType::kFloat32);
  permute(x, pc, yc, PermuteExtras{probs, ppc});
  Tensor outc = poisoned({T, H}, DType::kFloat32);
  unpermute(yc, pc, outc, probs);
  const QuantizeConfig q1x128{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, false};
  Tensor qc = poisoned({T, H}, DType::kFloat8E4M3), sc = poisoned({T, H / 128}, DType::kFloat32);
  quantize(x, q1x128, qc, sc);

  RoutingPlan pg = allocate_plan(T, K, cfg, kGpu1);
  ASSERT_EQ(current_device(), 0);
  Tensor ws = Tensor::zeros({static_cast<int64_t>(plan_workspace_bytes(T, K, cfg)) + 1},
                            DType::kUInt8, kGpu1);
  Tensor ids_g = ids.to(kGpu1), x_g = x.to(kGpu1), probs_g = probs.to(kGpu1);
  build_plan(ids_g, pg, ws, stream_);
  Tensor yg = poisoned({cap, H}, DType::kBFloat16, kGpu1);
  Tensor ppg = poisoned({cap}, DType::kFloat32, kGpu1);
  permute(x_g, pg, yg, PermuteExtras{probs_g, ppg}, stream_);
  Tensor outg = poisoned({T, H}, DType::kFloat32, kGpu1);
  unpermute(yg, pg, outg, probs_g, stream_);
  Tensor qg = poisoned({T, H}, DType::kFloat8E4M3, kGpu1);
  Tensor sg = poisoned({T, H / 128}, DType::kFloat32, kGpu1);
  quantize(x_g, q1x128, qg, sg, {}, {}, stream_);
  const PlanStatus st = plan_status(pg, stream_);
  ASSERT_EQ(current_device(), 0);
  EXPECT_EQ(st.total_rows, plan_status(pc).total_rows);
  EXPECT_TRUE(bytes_equal(pg.dest_row.to(Device::cpu()), pc.dest_row));
  EXPECT_TRUE(bytes_equal(yg.to(Device::cpu()), yc));
  EXPECT_TRUE(bytes_equal(ppg.to(Device::cpu()), ppc));
  EXPECT_TRUE(bytes_equal(outg.to(Device::cpu()), outc));
  EXPECT_TRUE(bytes_equal(qg.to(Device::cpu()), qc));
  EXPECT_TRUE(bytes_equal(sg.to(Device::cpu()), sc));

  // Tensor helpers: fills and copies on GPU 1, the same bits as on GPU 0.
  Tensor u1 = Tensor::empty({1000}, DType::kBFloat16, kGpu1);
  Tensor u0 = Tensor::empty({1000}, DType::kBFloat16, kGpu0);
  fill_uniform(u1, 7, -1.0f, 1.0f, stream_);
  fill_uniform(u0, 7, -1.0f, 1.0f);
  Tensor z1 = Tensor::zeros({1000}, DType::kFloat32, kGpu1);
  EXPECT_TRUE(bytes_equal(u1.to(Device::cpu()), u0.to(Device::cpu())));
  EXPECT_TRUE(bytes_equal(z1.to(Device::cpu()), Tensor::zeros({1000}, DType::kFloat32)));
  ASSERT_EQ(current_device(), 0);
}

// EP groups made and destroyed with GPU 0 current: create_local over GPUs 1
// and 0, and from the communicator of a GPU-1 group (the new group lives on
// the communicator's GPU).
TEST_F(MultiGpuDevice, EpGroupsLiveOnTheirGpuAndLeaveTheCallersDevice) {
  EpOptions opt;
  opt.num_experts = 4;
  opt.topk = 2;
  opt.hidden = 64;
  opt.max_tokens_per_rank = 16;
  {
    auto pair = EpGroup::create_local({1, 0}, opt);
    EXPECT_EQ(pair[0]->device(), kGpu1);
    EXPECT_EQ(pair[1]->device(), kGpu0);
    EXPECT_EQ(current_device(), 0);
  }
  EXPECT_EQ(current_device(), 0);
  auto owner = EpGroup::create_local({1}, opt);
  ASSERT_EQ(current_device(), 0);
  {
    auto g = EpGroup::from_comm(owner[0]->nccl_comm(), opt);
    EXPECT_EQ(g->device(), kGpu1);
    EXPECT_EQ(current_device(), 0);
    // a dispatch and combine on it, from GPU 0 (one rank: every slot stays)
    Tensor x = Tensor::zeros({16, 64}, DType::kBFloat16, kGpu1);
    Tensor ids = random_topk(16, 2, 4, 3).to(kGpu1);
    Tensor probs = Tensor::zeros({16, 2}, DType::kFloat32, kGpu1);
    EpDispatchResult d = ep_dispatch(*g, x, ids, probs, stream_);
    Tensor out = poisoned({16, 64}, DType::kBFloat16, kGpu1);
    ep_combine(*g, d.handle, d.x, false, out, stream_);
    EXPECT_EQ(current_device(), 0);
    EXPECT_TRUE(bytes_equal(out.to(Device::cpu()), Tensor::zeros({16, 64}, DType::kBFloat16)));
  }
  EXPECT_EQ(current_device(), 0);
}

}  // namespace
}  // namespace moeflow::test
