// GPU tests (label gpu): the CUDA backend against the CPU reference. Plans
// and index outputs must match exactly; values bitwise where the CPU
// reference uses the same float32 operation order (permute, unpermute, dy),
// within the tolerance table otherwise (dprobs). Outputs are poisoned before
// each run. Also: determinism, graph capture + replay with new routings,
// invalid ids, offsets past 2^31 elements.
#include <cuda_runtime.h>

#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device";
  }
};

Tensor on_gpu(const Tensor& t) { return t.to(kGpu); }

void poison_plan(RoutingPlan& p) {
  for (Tensor* t : {&p.tokens_per_expert, &p.padded_tokens_per_expert, &p.expert_row_offsets,
                    &p.dest_row, &p.row_token, &p.row_k, &p.total_rows, &p.overflow, &p.invalid_ids})
    fill_bytes(*t, 0xFF);
}

Tensor workspace_for(int64_t T, int K, const PlanConfig& cfg) {
  return Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(T, K, cfg))}, DType::kUInt8, kGpu);
}

struct Built {
  RoutingPlan cpu, gpu;
};

// Builds the same routing on both backends (ids: [T,K] ids, or a [T,E] mask).
Built build_both(const Tensor& routing, bool is_mask, const PlanConfig& cfg) {
  const int64_t T = routing.size(0);
  const int K = static_cast<int>(routing.size(1));
  Built b;
  b.cpu = allocate_plan(T, K, cfg, Device::cpu());
  b.gpu = allocate_plan(T, K, cfg, kGpu);
  poison_plan(b.gpu);
  Tensor ws = workspace_for(T, K, cfg);
  Tensor routing_gpu = on_gpu(routing);
  if (is_mask) {
    build_plan_from_mask(routing, b.cpu);
    build_plan_from_mask(routing_gpu, b.gpu, ws);
  } else {
    build_plan(routing, b.cpu);
    build_plan(routing_gpu, b.gpu, ws);
  }
  MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  return b;
}

void expect_same_plan(const RoutingPlan& gpu, const RoutingPlan& cpu) {
  EXPECT_EQ(to_vec<int32_t>(gpu.tokens_per_expert), to_vec<int32_t>(cpu.tokens_per_expert));
  EXPECT_EQ(to_vec<int32_t>(gpu.padded_tokens_per_expert), to_vec<int32_t>(cpu.padded_tokens_per_expert));
  EXPECT_EQ(to_vec<int64_t>(gpu.expert_row_offsets), to_vec<int64_t>(cpu.expert_row_offsets));
  EXPECT_EQ(to_vec<int64_t>(gpu.dest_row), to_vec<int64_t>(cpu.dest_row));
  PlanStatus g = check_plan(gpu), c = plan_status(cpu);
  EXPECT_EQ(g.total_rows, c.total_rows);
  EXPECT_EQ(g.overflow, c.overflow);
  auto gt = to_vec<int32_t>(gpu.row_token), ct = to_vec<int32_t>(cpu.row_token);
  auto gk = to_vec<int32_t>(gpu.row_k), ck = to_vec<int32_t>(cpu.row_k);
  for (int64_t r = 0; r < c.total_rows; ++r) {
    ASSERT_EQ(gt[r], ct[r]) << "row_token of row " << r;
    ASSERT_EQ(gk[r], ck[r]) << "row_k of row " << r;
  }
}

const std::vector<Case> kCases = {
    {0, 2, 4, 64, 16},      {1, 1, 1, 16, 1},        {1, 8, 16, 13, 32},     {3, 2, 8, 8, 256},
    {127, 2, 8, 4096, 16},  {509, 8, 64, 7, 128},    {1000, 4, 7, 200, 64},  {2048, 8, 256, 1024, 16},
    {4099, 2, 8, 520, 32},  {777, 6, 128, 2048, 256}, {300, 40, 64, 64, 16},  {64, 2, 4, 0, 16},
};

TEST_F(Gpu, PlanMatchesCpuExactly) {
  uint32_t seed = 100;
  for (int align : {1, 16, 32, 64, 128, 256}) {
    for (auto [T, K, E] : std::vector<std::tuple<int64_t, int, int>>{
             {0, 4, 8}, {1, 1, 1}, {1, 8, 16}, {31, 2, 8}, {997, 8, 64}, {8192, 8, 256},
             {4096, 6, 160}, {16384, 2, 8}, {3000, 40, 64}}) {
      for (double skew : {0.0, 3.0}) {
        SCOPED_TRACE(::testing::Message() << "T=" << T << " K=" << K << " E=" << E
                                          << " align=" << align << " skew=" << skew);
        Tensor ids = random_topk(T, K, E, seed++, skew, 0.05,
                                 seed % 2 ? DType::kInt32 : DType::kInt64);
        Built b = build_both(ids, false, PlanConfig{E, align, -1});
        expect_same_plan(b.gpu, b.cpu);
      }
    }
  }
}

TEST_F(Gpu, PlanAllTokensOnOneExpertAndEmptyExperts) {
  Tensor ids = Tensor::empty({5000, 2}, DType::kInt32);
  for (int i = 0; i < 10000; ++i) ids.data_ptr<int32_t>()[i] = i % 2 == 0 ? 3 : -1;
  Built b = build_both(ids, false, PlanConfig{16, 128, -1});
  expect_same_plan(b.gpu, b.cpu);
}

TEST_F(Gpu, PlanFromMaskMatchesCpu) {
  for (int align : {1, 16, 256}) {
    Tensor mask = random_mask(3001, 64, 6, 7 + align);
    Built b = build_both(mask, true, PlanConfig{64, align, -1});
    expect_same_plan(b.gpu, b.cpu);
  }
}

TEST_F(Gpu, PlanCapacityOverflowMatchesCpu) {
  Tensor ids = random_topk(4000, 8, 32, 55, 1.5);
  for (int64_t cap : {0, 128, 4096, 20000, 32000}) {
    SCOPED_TRACE(cap);
    Built b = build_both(ids, false, PlanConfig{32, 32, cap});
    expect_same_plan(b.gpu, b.cpu);
    EXPECT_GT(plan_status(b.gpu).overflow, 0);
  }
}

TEST_F(Gpu, PlanInvalidIdsAreFlaggedNotWritten) {
  Tensor ids = random_topk(500, 4, 8, 66);
  ids.data_ptr<int32_t>()[17] = 8;
  ids.data_ptr<int32_t>()[1203] = -7;
  PlanConfig cfg{8, 16, -1};
  RoutingPlan plan = allocate_plan(500, 4, cfg, kGpu);
  Tensor ws = workspace_for(500, 4, cfg);
  build_plan(on_gpu(ids), plan, ws);
  PlanStatus s = plan_status(plan);
  EXPECT_EQ(s.invalid_ids, 2);
  EXPECT_THROW(check_plan(plan), Error);
  // The invalid slots behave as unrouted: same plan as with -1 there.
  ids.data_ptr<int32_t>()[17] = -1;
  ids.data_ptr<int32_t>()[1203] = -1;
  RoutingPlan want = allocate_plan(500, 4, cfg, Device::cpu());
  build_plan(ids, want);
  EXPECT_EQ(to_vec<int64_t>(plan.dest_row), to_vec<int64_t>(want.dest_row));
}

// Runs permute on both backends and compares the whole outputs bytewise
// (untouched rows keep their poison on both sides).
TEST_F(Gpu, PermuteMatchesCpuBitwise) {
  uint32_t seed = 200;
  for (const Case& c : kCases) {
    for (DType dt : {DType::kBFloat16, DType::kFloat32, DType::kFloat16, DType::kFloat8E4M3}) {
      SCOPED_TRACE(name_of(c) + " " + dtype_name(dt));
      Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.05);
      Built b = build_both(ids, false, PlanConfig{c.E, c.align, -1});
      Tensor x = make_tensor({c.T, c.H}, dt);
      fill_random(x, seed++);
      Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
      fill_random(probs, seed++, 0.0f, 1.0f);
      const int64_t S = (c.H + 127) / 128;
      Tensor scales = make_tensor({c.T, S}, DType::kFloat32);
      fill_random(scales, seed++);
      const int64_t cap = b.cpu.capacity_rows;
      Tensor y_c = poisoned({cap, c.H}, dt, Device::cpu()), pp_c = poisoned({cap}, DType::kFloat32, Device::cpu());
      Tensor ys_c = poisoned({cap, S}, DType::kFloat32, Device::cpu());
      permute(x, b.cpu, y_c, PermuteExtras{probs, pp_c, scales, ys_c});
      Tensor y_g = poisoned({cap, c.H}, dt, kGpu), pp_g = poisoned({cap}, DType::kFloat32, kGpu);
      Tensor ys_g = poisoned({cap, S}, DType::kFloat32, kGpu);
      permute(on_gpu(x), b.gpu, y_g, PermuteExtras{on_gpu(probs), pp_g, on_gpu(scales), ys_g});
      EXPECT_TRUE(bytes_equal(y_g.to(Device::cpu()), y_c));
      EXPECT_TRUE(bytes_equal(pp_g.to(Device::cpu()), pp_c));
      EXPECT_TRUE(bytes_equal(ys_g.to(Device::cpu()), ys_c));
    }
  }
}

TEST_F(Gpu, PermuteMxfp8ScalesAndStridedRows) {
  Case c{513, 4, 32, 1000, 32};
  Tensor ids = random_topk(c.T, c.K, c.E, 300);
  Built b = build_both(ids, false, PlanConfig{c.E, c.align, -1});
  const int64_t cap = b.cpu.capacity_rows, stride = 1024;
  Tensor xbuf = make_tensor({c.T, stride}, DType::kFloat8E5M2);
  fill_random(xbuf, 301);
  Tensor scales = make_tensor({c.T, 32}, DType::kUInt8);  // e8m0, 1x32
  fill_random(scales, 302);
  Tensor xbuf_g = on_gpu(xbuf);
  auto x_c = TensorView::strided(xbuf.data(), DType::kFloat8E5M2, Device::cpu(), {c.T, c.H}, {stride, 1});
  auto x_g = TensorView::strided(xbuf_g.data(), DType::kFloat8E5M2, kGpu, {c.T, c.H}, {stride, 1});
  Tensor y_c = poisoned({cap, c.H}, DType::kFloat8E5M2, Device::cpu());
  Tensor ys_c = poisoned({cap, 32}, DType::kUInt8, Device::cpu());
  Tensor y_g = poisoned({cap, c.H}, DType::kFloat8E5M2, kGpu);
  Tensor ys_g = poisoned({cap, 32}, DType::kUInt8, kGpu);
  permute(x_c, b.cpu, y_c, PermuteExtras{{}, {}, scales, ys_c});
  permute(x_g, b.gpu, y_g, PermuteExtras{{}, {}, on_gpu(scales), ys_g});
  EXPECT_TRUE(bytes_equal(y_g.to(Device::cpu()), y_c));
  EXPECT_TRUE(bytes_equal(ys_g.to(Device::cpu()), ys_c));
}

TEST_F(Gpu, UnpermuteMatchesCpu) {
  uint32_t seed = 400;
  for (const Case& c : kCases) {
    for (DType din : {DType::kBFloat16, DType::kFloat32, DType::kFloat16}) {
      for (DType dout : {DType::kFloat32, din}) {
        for (bool weighted : {true, false}) {
          SCOPED_TRACE(name_of(c) + " " + dtype_name(din) + "->" + dtype_name(dout) +
                       (weighted ? " weighted" : ""));
          Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.05);
          Built b = build_both(ids, false, PlanConfig{c.E, c.align, -1});
          const int64_t total = plan_status(b.cpu).total_rows;
          Tensor y = poisoned({b.cpu.capacity_rows, c.H}, din, Device::cpu());
          // Fill only the used rows: rows past total_rows hold NaN poison that must never be read.
          Tensor used = make_tensor({total, c.H}, din);
          fill_random(used, seed++);
          std::memcpy(y.data(), used.data(), used.nbytes());
          Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
          fill_random(probs, seed++, 0.0f, 1.0f);
          TensorView w_c = weighted ? TensorView(probs) : TensorView();
          Tensor probs_g = on_gpu(probs);
          TensorView w_g = weighted ? TensorView(probs_g) : TensorView();
          Tensor out_c = poisoned({c.T, c.H}, dout, Device::cpu());
          unpermute(y, b.cpu, out_c, w_c);
          Tensor out_g = poisoned({c.T, c.H}, dout, kGpu);
          Tensor y_g = on_gpu(y);
          unpermute(y_g, b.gpu, out_g, w_g);
          Tensor got = out_g.to(Device::cpu());
          EXPECT_TRUE(all_close(got, out_c, tolerance(dout)));
          EXPECT_TRUE(bytes_equal(got, out_c));  // same fma order: bitwise
          // Deterministic run to run.
          Tensor again = poisoned({c.T, c.H}, dout, kGpu);
          unpermute(y_g, b.gpu, again, w_g);
          EXPECT_TRUE(bytes_equal(again.to(Device::cpu()), got));
        }
      }
    }
  }
}

TEST_F(Gpu, BackwardOpsMatchCpu) {
  uint32_t seed = 500;
  for (const Case& c : kCases) {
    for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
      SCOPED_TRACE(name_of(c) + " " + dtype_name(dt));
      Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.05);
      Built b = build_both(ids, false, PlanConfig{c.E, c.align, -1});
      const int64_t cap = b.cpu.capacity_rows, total = plan_status(b.cpu).total_rows;
      Tensor y = Tensor::zeros({cap, c.H}, dt);
      Tensor used = make_tensor({total, c.H}, dt);
      fill_random(used, seed++);
      std::memcpy(y.data(), used.data(), used.nbytes());
      Tensor y_g = on_gpu(y);
      Tensor dout = make_tensor({c.T, c.H}, dt);
      fill_random(dout, seed++);
      Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
      fill_random(probs, seed++, 0.0f, 1.0f);
      Tensor dpp = make_tensor({cap}, DType::kFloat32);
      fill_random(dpp, seed++);

      // unpermute_backward with probs and dprobs
      Tensor dy_c = poisoned({cap, c.H}, dt, Device::cpu());
      Tensor dprobs_c = poisoned({c.T, c.K}, DType::kFloat32, Device::cpu());
      unpermute_backward(dout, b.cpu, y, probs, dy_c, dprobs_c);
      Tensor dy_g = poisoned({cap, c.H}, dt, kGpu);
      Tensor dprobs_g = poisoned({c.T, c.K}, DType::kFloat32, kGpu);
      unpermute_backward(on_gpu(dout), b.gpu, y_g, on_gpu(probs), dy_g, dprobs_g);
      EXPECT_TRUE(bytes_equal(dy_g.to(Device::cpu()), dy_c));
      EXPECT_TRUE(all_close(dprobs_g.to(Device::cpu()), dprobs_c, dot_tolerance(c.H)));

      // without probs: dy is dout copied to every row
      Tensor dy2_c = poisoned({cap, c.H}, dt, Device::cpu());
      unpermute_backward(dout, b.cpu, {}, {}, dy2_c, {});
      Tensor dy2_g = poisoned({cap, c.H}, dt, kGpu);
      unpermute_backward(on_gpu(dout), b.gpu, {}, {}, dy2_g, {});
      EXPECT_TRUE(bytes_equal(dy2_g.to(Device::cpu()), dy2_c));

      // permute_backward with the probs gradient gather
      Tensor dx_c = poisoned({c.T, c.H}, dt, Device::cpu());
      Tensor dpr_c = poisoned({c.T, c.K}, DType::kFloat32, Device::cpu());
      permute_backward(y, b.cpu, dx_c, dpp, dpr_c);
      Tensor dx_g = poisoned({c.T, c.H}, dt, kGpu);
      Tensor dpr_g = poisoned({c.T, c.K}, DType::kFloat32, kGpu);
      permute_backward(y_g, b.gpu, dx_g, on_gpu(dpp), dpr_g);
      EXPECT_TRUE(bytes_equal(dx_g.to(Device::cpu()), dx_c));
      EXPECT_TRUE(bytes_equal(dpr_g.to(Device::cpu()), dpr_c));
    }
  }
}

// plan + permute + unpermute captured in one CUDA graph; replays with new
// routings (copied into the captured input buffers) must equal eager runs.
TEST_F(Gpu, GraphCaptureReplayWithNewRoutings) {
  const Case c{3000, 8, 64, 512, 16};
  const PlanConfig cfg{c.E, c.align, -1};
  cudaStream_t stream;
  MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RoutingPlan plan = allocate_plan(c.T, c.K, cfg, kGpu);
  Tensor ws = workspace_for(c.T, c.K, cfg);
  Tensor ids_g = Tensor::empty({c.T, c.K}, DType::kInt32, kGpu);
  Tensor x_g = Tensor::empty({c.T, c.H}, DType::kBFloat16, kGpu);
  Tensor probs_g = Tensor::empty({c.T, c.K}, DType::kFloat32, kGpu);
  Tensor y_g = Tensor::empty({plan.capacity_rows, c.H}, DType::kBFloat16, kGpu);
  Tensor pp_g = Tensor::empty({plan.capacity_rows}, DType::kFloat32, kGpu);
  Tensor out_g = Tensor::empty({c.T, c.H}, DType::kFloat32, kGpu);
  // Warm the kernels up (module load happens outside the capture).
  copy(random_topk(c.T, c.K, c.E, 1), ids_g, stream);
  build_plan(ids_g, plan, ws, stream);
  MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));

  cudaGraph_t graph;
  MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  build_plan(ids_g, plan, ws, stream);
  permute(x_g, plan, y_g, PermuteExtras{probs_g, pp_g, {}, {}}, stream);
  unpermute(y_g, plan, out_g, probs_g, stream);
  MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE(replay);
    Tensor ids = random_topk(c.T, c.K, c.E, 700 + replay, replay * 1.0, 0.05);
    Tensor x = make_tensor({c.T, c.H}, DType::kBFloat16);
    fill_random(x, 800 + replay);
    Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
    fill_random(probs, 900 + replay, 0.0f, 1.0f);
    copy(ids, ids_g, stream);
    copy(x, x_g, stream);
    copy(probs, probs_g, stream);
    fill_bytes(y_g, 0xFF, stream);
    fill_bytes(out_g, 0xFF, stream);
    MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));

    // eager, on separate buffers
    RoutingPlan eager = allocate_plan(c.T, c.K, cfg, kGpu);
    Tensor y_e = poisoned({plan.capacity_rows, c.H}, DType::kBFloat16, kGpu);
    Tensor pp_e = poisoned({plan.capacity_rows}, DType::kFloat32, kGpu);
    Tensor out_e = poisoned({c.T, c.H}, DType::kFloat32, kGpu);
    Tensor ws_e = workspace_for(c.T, c.K, cfg);
    build_plan(on_gpu(ids), eager, ws_e);
    permute(x_g, eager, y_e, PermuteExtras{probs_g, pp_e, {}, {}});
    unpermute(y_e, eager, out_e, probs_g);
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    expect_same_plan(plan, eager);
    const int64_t total = plan_status(eager).total_rows;
    Tensor yg = y_g.to(Device::cpu()), ye = y_e.to(Device::cpu());
    EXPECT_EQ(0, std::memcmp(yg.data(), ye.data(), total * c.H * 2));
    EXPECT_TRUE(bytes_equal(out_g.to(Device::cpu()), out_e.to(Device::cpu())));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Offsets past 2^31 elements: rows * H > 2^31 (about 6 GB of GPU memory).
TEST_F(Gpu, LargeOffsetsPast2To31Elements) {
  const int64_t T = 70000, H = 8192;
  const int K = 4, E = 8;
  const PlanConfig cfg{E, 16, -1};
  Tensor ids = random_topk(T, K, E, 1234);
  RoutingPlan plan = allocate_plan(T, K, cfg, kGpu);
  Tensor ws = workspace_for(T, K, cfg);
  build_plan(on_gpu(ids), plan, ws);
  const int64_t total = check_plan(plan).total_rows;
  ASSERT_GT(total * H, int64_t{1} << 31);
  Tensor x = make_tensor({T, H}, DType::kBFloat16);
  fill_random(x, 1235);
  Tensor x_g = on_gpu(x);
  Tensor y_g = poisoned({plan.capacity_rows, H}, DType::kBFloat16, kGpu);
  permute(x_g, plan, y_g);
  Tensor out_g = poisoned({T, H}, DType::kFloat32, kGpu);
  unpermute(y_g, plan, out_g);
  MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  // The last 2000 used rows (all past 2^31 elements) hold their tokens.
  auto row_token = to_vec<int32_t>(plan.row_token);
  const int64_t first = total - 2000;
  ASSERT_GT(first * H, int64_t{1} << 31);
  std::vector<uint16_t> tail(2000 * H);
  MOEFLOW_CUDA_CHECK(cudaMemcpy(tail.data(), y_g.data_ptr<uint16_t>() + first * H, tail.size() * 2,
                                cudaMemcpyDeviceToHost));
  for (int64_t r = first; r < total; ++r) {
    const uint16_t* got = tail.data() + (r - first) * H;
    if (row_token[r] < 0) {
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(got[h], 0) << "pad row " << r;
    } else {
      ASSERT_EQ(0, std::memcmp(got, x.data_ptr<uint16_t>() + row_token[r] * H, H * 2)) << "row " << r;
    }
  }
  // unpermute without weights: every token routed K times -> K * x exactly.
  Tensor out = out_g.to(Device::cpu());
  for (int64_t t : {int64_t{0}, T / 2, T - 1})
    for (int64_t h = 0; h < H; h += 97)
      ASSERT_EQ(out.data_ptr<float>()[t * H + h], K * at(x, t * H + h));
}

}  // namespace
}  // namespace moeflow::test
