// Expert-parallel dispatch / combine on GPUs, nvlink and nccl backends: two
// dispatches in flight (each combine and backward finds its own way back,
// with 1-3 receive regions on nvlink), and dispatch + combine captured in a
// CUDA graph and replayed with new routings (nvlink), bitwise against eager
// runs. Simulated ranks (one GPU, label gpu) and 2+ GPUs (label multigpu).
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "gpu_ep_util.h"
#include "moeflow/ep.h"
#include "moeflow/quantize.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

// Dispatch + combine captured once in a CUDA graph (no host sync on this
// backend) and replayed with new tokens and routings: bitwise the eager results.
// simulated: W ranks on GPU 0 (EpGroup::create_simulated). quantize: the
// bf16 tokens go as e4m3 codes (ep_dispatch_quantize) and the experts' y is
// the received rows dequantized (so the result depends on codes and scales).
void graph_replay(int W, bool simulated, bool quantize = false, int in_dispatch = -1) {
  const int E = 8 * W, K = 4, rounds = 3;
  const int64_t H = 96, T = 160;
  EpOptions opt;
  opt.num_experts = E;
  opt.topk = K;
  opt.hidden = H;
  opt.dtype = quantize ? DType::kFloat8E4M3 : DType::kBFloat16;
  opt.scale_cols = quantize ? 1 : 0;
  opt.max_tokens_per_rank = T;
  opt.backend = EpBackend::kNvlink;
  opt.nvlink_quantize_in_dispatch = in_dispatch;
  const QuantizeConfig qc{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, false};
  std::vector<int> devs;
  for (int r = 0; r < W; ++r) devs.push_back(r);
  auto groups = simulated ? EpGroup::create_simulated(W, 0, opt) : EpGroup::create_local(devs, opt);
  std::vector<cudaStream_t> streams(W);
  for (int r = 0; r < W; ++r) {  // (simulated: the group's own stream)
    MOEFLOW_CUDA_CHECK(cudaSetDevice(groups[r]->device().index));
    if (simulated)
      streams[r] = groups[r]->simulated_stream();
    else
      MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
  }
  HostBarrier ready(W);  // simulated: every launch after all ranks are ready for it
  const int64_t cap = groups[0]->capacity_rows();
  std::vector<std::vector<Tensor>> xs(rounds), ids(rounds), probs(rounds), ys(rounds);
  uint32_t seed = 41;
  for (int i = 0; i < rounds; ++i)
    for (int r = 0; r < W; ++r) {
      xs[i].push_back(make_tensor({T, H}, DType::kBFloat16));
      fill_random(xs[i][r], seed++);
      ids[i].push_back(random_topk(T, K, E, seed++, 0.5, 0.05));
      probs[i].push_back(make_tensor({T, K}, DType::kFloat32));
      fill_random(probs[i][r], seed++, 0.1f, 1.0f);
      ys[i].push_back(make_tensor({cap, H}, DType::kBFloat16));
      fill_random(ys[i][r], seed++);
    }
  std::vector<std::vector<Tensor>> eager(rounds, std::vector<Tensor>(W)),
      replay(rounds, std::vector<Tensor>(W));
  EpGroup::run_local(groups, [&](int r) {
    EpGroup& g = *groups[r];
    const Device dev = g.device();
    cudaStream_t st = streams[r];
    Tensor x = Tensor::empty({T, H}, DType::kBFloat16, dev),
           id = Tensor::empty({T, K}, DType::kInt32, dev),
           pr = Tensor::empty({T, K}, DType::kFloat32, dev),
           y = Tensor::empty({cap, H}, DType::kBFloat16, dev),
           out = Tensor::empty({T, H}, DType::kBFloat16, dev);
    auto load = [&](int i) {
      for (auto [src, dst] :
           {std::pair{&xs[i][r], &x}, {&ids[i][r], &id}, {&probs[i][r], &pr}, {&ys[i][r], &y}})
        MOEFLOW_CUDA_CHECK(
            cudaMemcpyAsync(dst->data(), src->data(), src->nbytes(), cudaMemcpyHostToDevice, st));
      fill_bytes(out, 0xFF, st);
    };
    auto step = [&] {
      if (quantize) {
        const EpDispatchResult res = ep_dispatch_quantize(g, x, id, pr, qc, st);
        dequantize(res.x, res.scales, qc, y, {}, st);
        ep_combine(g, res.handle, y, true, out, st);
        return;
      }
      const EpDispatchResult res = ep_dispatch(g, x, id, pr, st);
      ep_combine(g, res.handle, y, true, out, st);
    };
    for (int i = 0; i < rounds; ++i) {
      load(i);
      if (simulated) ready.arrive_and_wait();
      step();
      MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(st));
      eager[i][r] = out.to(Device::cpu());
    }
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    step();
    MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < rounds; ++i) {
      load(i);
      if (simulated) ready.arrive_and_wait();
      MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, st));
      MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(st));
      replay[i][r] = out.to(Device::cpu());
    }
    if (simulated) ready.arrive_and_wait();  // nothing of any rank runs now
    MOEFLOW_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOEFLOW_CUDA_CHECK(cudaGraphDestroy(graph));
    if (!simulated) MOEFLOW_CUDA_CHECK(cudaStreamDestroy(st));
  });
  for (int i = 0; i < rounds; ++i)
    for (int r = 0; r < W; ++r) {
      SCOPED_TRACE("round " + std::to_string(i) + " rank " + std::to_string(r));
      EXPECT_TRUE(same_bytes(replay[i][r].data(), eager[i][r].data(), replay[i][r].nbytes()));
      if (i > 0)
        EXPECT_FALSE(same_bytes(eager[i][r].data(), eager[i - 1][r].data(), eager[i][r].nbytes()))
            << "new routings must change the result";
    }
}

// Two dispatches in flight (two layers): dispatch A, dispatch B, combine B,
// combine A, then the backward functions in the same reversed order, each
// with its own handle: bitwise the results of A and B run one after the other.
void two_in_flight(int W, EpBackend backend, bool simulated, int regions = 3) {
  SCOPED_TRACE("nvlink_recv_regions " + std::to_string(regions));
  const int E = 8 * W, K = 4;
  const int64_t H = 96, T = 160;
  EpOptions opt;
  opt.nvlink_recv_regions = regions;
  opt.num_experts = E;
  opt.topk = K;
  opt.hidden = H;
  opt.dtype = DType::kBFloat16;
  opt.max_tokens_per_rank = T;
  opt.backend = backend;
  std::vector<int> devs;
  for (int r = 0; r < W; ++r) devs.push_back(r);
  auto groups = simulated ? EpGroup::create_simulated(W, 0, opt) : EpGroup::create_local(devs, opt);
  const int64_t cap = groups[0]->capacity_rows();
  std::vector<std::vector<Tensor>> xs(2), ids(2), probs(2), ys(2), douts(2);
  uint32_t seed = 77;
  for (int i = 0; i < 2; ++i)
    for (int r = 0; r < W; ++r) {
      xs[i].push_back(make_tensor({T - 7 * i * r, H}, DType::kBFloat16));
      fill_random(xs[i][r], seed++);
      ids[i].push_back(random_topk(T - 7 * i * r, K, E, seed++, 0.5, 0.05));
      probs[i].push_back(make_tensor({T - 7 * i * r, K}, DType::kFloat32));
      fill_random(probs[i][r], seed++, 0.1f, 1.0f);
      ys[i].push_back(make_tensor({cap, H}, DType::kBFloat16));
      fill_random(ys[i][r], seed++);
      douts[i].push_back(make_tensor({T - 7 * i * r, H}, DType::kBFloat16));
      fill_random(douts[i][r], seed++);
    }
  // per mode (0: one after the other, 1: in flight), layer, rank: out, grad_y,
  // dprobs, grad_x, the received rows (those the plan uses)
  std::vector<Tensor> got[2][2][5];
  for (auto& m : got)
    for (auto& l : m)
      for (auto& v : l) v.resize(W);
  HostBarrier ready(W);
  EpGroup::run_local(groups, [&](int r) {
    EpGroup& g = *groups[r];
    const Device dev = g.device();
    cudaStream_t st = simulated ? g.simulated_stream() : nullptr;
    Tensor x[2], id[2], pr[2], y[2], dout[2], out[2], gy[2], dp[2], gx[2];
    for (int i = 0; i < 2; ++i) {
      x[i] = xs[i][r].to(dev);
      id[i] = ids[i][r].to(dev);
      pr[i] = probs[i][r].to(dev);
      y[i] = ys[i][r].to(dev);
      dout[i] = douts[i][r].to(dev);
      const int64_t Ti = x[i].sizes()[0];
      out[i] = Tensor::empty({Ti, H}, DType::kBFloat16, dev);
      gx[i] = Tensor::empty({Ti, H}, DType::kBFloat16, dev);
      gy[i] = Tensor::empty({cap, H}, DType::kBFloat16, dev);
      dp[i] = Tensor::empty({Ti, K}, DType::kFloat32, dev);
    }
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    auto op = [&](const std::function<void()>& f) {
      if (simulated) ready.arrive_and_wait();
      f();
    };
    EpDispatchResult res[2];
    auto forward = [&](int i, EpHandle& h) {
      op([&] {
        res[i] = ep_dispatch(g, x[i], id[i], pr[i], st);
        h = res[i].handle;
      });
    };
    auto finish = [&](int mode, int i, const EpHandle& h) {
      // The received rows first: the other dispatch in flight must not have
      // touched them.
      MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(st));
      int64_t used = 0;
      MOEFLOW_CUDA_CHECK(
          cudaMemcpy(&used, res[i].plan->total_rows.data(), sizeof(used), cudaMemcpyDeviceToHost));
      Tensor rows = Tensor::empty({used, H}, DType::kBFloat16, Device::cpu());
      MOEFLOW_CUDA_CHECK(
          cudaMemcpy(rows.data(), res[i].x.data, rows.nbytes(), cudaMemcpyDeviceToHost));
      got[mode][i][4][r] = rows;
      for (Tensor* t : {&out[i], &gx[i], &gy[i], &dp[i]}) fill_bytes(*t, 0xFF, st);
      op([&] { ep_combine(g, h, y[i], true, out[i], st); });
      op([&] { ep_combine_backward(g, h, dout[i], y[i], true, gy[i], dp[i], st); });
      op([&] { ep_dispatch_backward(g, h, y[i], gx[i], st); });
      MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(st));
      got[mode][i][0][r] = out[i].to(Device::cpu());
      got[mode][i][1][r] = gy[i].to(Device::cpu());
      got[mode][i][2][r] = dp[i].to(Device::cpu());
      got[mode][i][3][r] = gx[i].to(Device::cpu());
    };
    EpHandle a, b;
    forward(0, a);
    finish(0, 0, a);
    forward(1, b);
    finish(0, 1, b);
    forward(0, a);
    forward(1, b);
    finish(1, 1, b);
    finish(1, 0, a);
    if (simulated) ready.arrive_and_wait();
  });
  for (int i = 0; i < 2; ++i)
    for (int v = 0; v < 5; ++v)
      for (int r = 0; r < W; ++r) {
        SCOPED_TRACE("layer " + std::to_string(i) + " value " + std::to_string(v) + " rank " +
                     std::to_string(r));
        const Tensor& want = got[0][i][v][r];
        const Tensor& have = got[1][i][v][r];
        ASSERT_EQ(want.nbytes(), have.nbytes());
        EXPECT_TRUE(same_bytes(have.data(), want.data(), want.nbytes()));
      }
}

// nvlink: with 3 receive regions both dispatches keep theirs, with 2 the
// second is copied out of the window, with 1 both are.
TEST(GpuEpNvlinkSimulated, TwoDispatchesInFlight) {
  for (const int regions : {3, 2, 1}) two_in_flight(2, EpBackend::kNvlink, true, regions);
}

TEST(MultiGpuEpNvlink, TwoDispatchesInFlight) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  for (const int regions : {3, 2, 1}) two_in_flight(W, EpBackend::kNvlink, false, regions);
}

TEST(MultiGpuEpNccl, TwoDispatchesInFlight) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  two_in_flight(W, EpBackend::kNccl, false);
}

TEST(MultiGpuEpNvlink, GraphReplayWithNewRouting) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  graph_replay(W, false);
}

TEST(GpuEpNvlinkSimulated, GraphReplayWithNewRouting) {
  graph_replay(2, true);
}

TEST(GpuEpNvlinkSimulated, QuantizedGraphReplayWithNewRouting) {
  graph_replay(2, true, true);
  SCOPED_TRACE("quantized before the dispatch");
  graph_replay(2, true, true, 0);
}

TEST(MultiGpuEpNvlink, QuantizedGraphReplayWithNewRouting) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  graph_replay(W, false, true);
  SCOPED_TRACE("quantized before the dispatch");
  graph_replay(W, false, true, 0);
}

}  // namespace
}  // namespace moeflow::test
