// ep_dispatch_quantize: 16-bit tokens quantized 1x128 on their way, FP8 codes
// and float32 scales on the wire, against quantize() on the CPU followed by
// the W-rank CPU reference of the FP8 dispatch (moeflow/ep_reference.h),
// bitwise: received rows, scales, probs, per-expert counts and offsets, drop
// counts. Special values (zeros, NaN, -inf, large and tiny magnitudes), a
// partial last block, bfloat16 and float16 tokens, e4m3 and e5m2, powers of
// two; a second round over poisoned outputs. Label gpu: both backends with
// one rank; the nvlink backend with 2 and 4 ranks simulated on one GPU
// (GpuEpNvlinkSimulated, a process of its own). Label multigpu: both
// backends on every GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_ep_util.h"
#include "moeflow/ep.h"
#include "moeflow/ep_reference.h"
#include "moeflow/quantize.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

using ep_reference::EpConfig;
using ep_reference::RankInput;

Tensor host_copy(TensorView v) {
  Tensor t = Tensor::empty(v.sizes(), v.dtype, Device::cpu());
  copy(v, t);
  return t;
}

struct QuantCase {
  int64_t hidden;
  DType in, out;
  bool pow2;
};

// W ranks (simulated: on GPU 0) of `backend`; two rounds of tokens per case.
// in_dispatch: EpOptions::nvlink_quantize_in_dispatch.
void quantized_dispatch_matches(int W, EpBackend backend, bool simulated, int in_dispatch = -1) {
  ASSERT_GE(cuda_device_count(), simulated ? 1 : W);
  const int E = 8 * W, K = 4;
  const int64_t tmax = 200;
  const std::vector<std::vector<int64_t>> rounds = {{150, 0, 97, 64, 5, 130, 1, 77},
                                                    {37, 120, 0, 200, 64, 3, 99, 12}};
  for (const QuantCase& c : {QuantCase{1040, DType::kBFloat16, DType::kFloat8E4M3, false},
                             QuantCase{320, DType::kFloat16, DType::kFloat8E5M2, true},
                             QuantCase{512, DType::kBFloat16, DType::kFloat8E4M3, true}}) {
    SCOPED_TRACE("W=" + std::to_string(W) + " H=" + std::to_string(c.hidden) + " " +
                 dtype_name(c.in) + " -> " + dtype_name(c.out) + (c.pow2 ? " pow2" : ""));
    const int64_t H = c.hidden, nb = blocks128(H);
    EpOptions opt;
    opt.backend = backend;
    opt.num_experts = E;
    opt.topk = K;
    opt.hidden = H;
    opt.dtype = c.out;
    opt.align = 16;
    opt.max_tokens_per_rank = tmax;
    opt.scale_cols = nb;
    opt.scale_dtype = DType::kFloat32;
    opt.nvlink_quantize_in_dispatch = in_dispatch;
    std::vector<int> devs;
    for (int r = 0; r < W; ++r) devs.push_back(r);
    if (simulated) {  // every rank's kernels resident at once
      int sms = 0;
      MOEFLOW_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      opt.nvlink_blocks = std::min(opt.nvlink_blocks, sms / W);
    }
    auto groups =
        simulated ? EpGroup::create_simulated(W, 0, opt) : EpGroup::create_local(devs, opt);
    const QuantizeConfig qc{c.out, QuantScaling::kBlock1x128, c.pow2, false};
    uint32_t seed = 31;
    for (const auto& tokens : rounds) {
      std::vector<RankInput> want_in(W);
      std::vector<Tensor> x16(W);
      for (int r = 0; r < W; ++r) {
        const int64_t T = tokens[r];
        x16[r] = make_tensor({T, H}, c.in);
        fill_random(x16[r], seed++, -3.0f, 3.0f);
        for (int64_t t = 4; t < T; t += 9)  // rows of other magnitudes
          for (int64_t h = 0; h < H; ++h)
            detail::store_float(x16[r].data(), c.in, t * H + h,
                                at(x16[r], t * H + h) * (t % 2 ? 100.0f : 1.0e-3f));
        add_special_rows(x16[r]);
        want_in[r].x = Tensor::empty({T, H}, c.out, Device::cpu());
        want_in[r].scales = Tensor::empty({T, nb}, DType::kFloat32, Device::cpu());
        quantize(x16[r], qc, want_in[r].x, want_in[r].scales);
        want_in[r].ids = random_topk(T, K, E, seed++, 0.5, 0.05);
        want_in[r].probs = make_tensor({T, K}, DType::kFloat32);
        fill_random(want_in[r].probs, seed++, 0.1f, 1.0f);
      }
      EpConfig cfg{W, E, opt.align, tmax, -1};
      ep_reference::Handle handle;
      const std::vector<ep_reference::RankReceive> want =
          ep_reference::dispatch(want_in, cfg, handle);
      std::vector<Tensor> got_x(W), got_scales(W), got_probs(W), got_tpe(W), got_off(W);
      std::vector<int64_t> got_overflow(W);
      HostBarrier ready(W);
      EpGroup::run_local(groups, [&](int r) {
        const Device dev = groups[r]->device();
        cudaStream_t st = simulated ? groups[r]->simulated_stream() : nullptr;
        Tensor x = x16[r].to(dev), ids = want_in[r].ids.to(dev), probs = want_in[r].probs.to(dev);
        if (simulated) ready.arrive_and_wait();  // every rank launches together
        EpDispatchResult res = ep_dispatch_quantize(*groups[r], x, ids, probs, qc, st);
        MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(st));
        ASSERT_TRUE(res.scales.defined());
        got_x[r] = host_copy(res.x);
        got_scales[r] = host_copy(res.scales);
        got_probs[r] = host_copy(res.probs);
        got_tpe[r] = res.plan->tokens_per_expert.to(Device::cpu());
        got_off[r] = res.plan->expert_row_offsets.to(Device::cpu());
        got_overflow[r] = plan_status(*res.plan, st).overflow;
        // poisoned for the next round: its dispatch must write every row it reports
        fill_bytes(res.x, 0xFF, st);
        fill_bytes(res.scales, 0xFF, st);
        fill_bytes(res.probs, 0xFF, st);
        MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(st));
        if (simulated) ready.arrive_and_wait();  // nothing runs on the GPU now
      });
      for (int r = 0; r < W; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r) + " T=" + std::to_string(tokens[r]));
        const ep_reference::RankReceive& w = want[r];
        const int64_t used = w.total_rows;
        EXPECT_EQ(to_vec<int32_t>(got_tpe[r]), to_vec<int32_t>(w.tokens_per_expert));
        EXPECT_EQ(to_vec<int64_t>(got_off[r]), to_vec<int64_t>(w.expert_row_offsets));
        EXPECT_EQ(got_overflow[r], w.dropped);
        EXPECT_TRUE(same_bytes(got_x[r].data(), w.x.data(), used * H)) << "received codes differ";
        EXPECT_TRUE(same_bytes(got_scales[r].data(), w.scales.data(), used * nb * 4))
            << "received scales differ";
        EXPECT_TRUE(same_bytes(got_probs[r].data(), w.probs.data(), used * 4))
            << "received probs differ";
      }
    }
  }
}

TEST(GpuEp, QuantizedTokensMatchReference) {
  for (const EpBackend b : {EpBackend::kNccl, EpBackend::kNvlink}) {
    SCOPED_TRACE(b == EpBackend::kNccl ? "nccl" : "nvlink");
    quantized_dispatch_matches(1, b, false);
  }
  SCOPED_TRACE("nvlink, quantized before the dispatch");
  quantized_dispatch_matches(1, EpBackend::kNvlink, false, 0);
}

TEST(MultiGpuEp, QuantizedTokensMatchReference) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  for (const EpBackend b : {EpBackend::kNccl, EpBackend::kNvlink}) {
    SCOPED_TRACE(b == EpBackend::kNccl ? "nccl" : "nvlink");
    quantized_dispatch_matches(std::min(W, 8), b, false);
  }
  SCOPED_TRACE("nvlink, quantized before the dispatch");
  quantized_dispatch_matches(std::min(W, 8), EpBackend::kNvlink, false, 0);
}

TEST(GpuEpNvlinkSimulated, QuantizedTokensMatchReference) {
  for (const int in_dispatch : {1, 0}) {  // in the dispatch kernel, or quantized first
    SCOPED_TRACE("nvlink_quantize_in_dispatch " + std::to_string(in_dispatch));
    quantized_dispatch_matches(2, EpBackend::kNvlink, true, in_dispatch);
    quantized_dispatch_matches(4, EpBackend::kNvlink, true, in_dispatch);
  }
}

// The group and the quantization must agree; x must be 16-bit.
TEST(GpuEp, QuantizeArgumentErrors) {
  for (const EpBackend b : {EpBackend::kNccl, EpBackend::kNvlink}) {
    EpOptions opt;
    opt.backend = b;
    opt.num_experts = 8;
    opt.topk = 2;
    opt.hidden = 256;
    opt.dtype = DType::kFloat8E4M3;
    opt.max_tokens_per_rank = 16;
    opt.scale_cols = 2;
    auto groups = EpGroup::create_local({0}, opt);
    EpGroup& g = *groups[0];
    const Device dev = g.device();
    Tensor x = Tensor::zeros({16, 256}, DType::kBFloat16, dev);
    Tensor ids = random_topk(16, 2, 8, 5).to(dev);
    Tensor probs = Tensor::zeros({16, 2}, DType::kFloat32, dev);
    const QuantizeConfig qc{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, false};
    auto message_of = [&](auto&& f) -> std::string {
      try {
        f();
      } catch (const Error& e) {
        return e.what();
      }
      return "";
    };
    QuantizeConfig e5 = qc, tw = qc, cw = qc;
    e5.out = DType::kFloat8E5M2;
    tw.scaling = QuantScaling::kTensorwise;
    cw.columnwise = true;
    EXPECT_NE(message_of([&] { ep_dispatch_quantize(g, x, ids, probs, e5); }).find("quantize.out"),
              std::string::npos);
    EXPECT_NE(message_of([&] { ep_dispatch_quantize(g, x, ids, probs, tw); }).find("1x128"),
              std::string::npos);
    EXPECT_NE(message_of([&] { ep_dispatch_quantize(g, x, ids, probs, cw); }).find("1x128"),
              std::string::npos);
    Tensor x32 = Tensor::zeros({16, 256}, DType::kFloat32, dev);
    EXPECT_NE(message_of([&] { ep_dispatch_quantize(g, x32, ids, probs, qc); }).find("x"),
              std::string::npos);
    Tensor x8 = Tensor::zeros({16, 256}, DType::kFloat8E4M3, dev);
    EXPECT_THROW(ep_dispatch_quantize(g, x8, ids, probs, qc), Error);
    // a group of 16-bit tokens, or with other scales, does not quantize
    EpOptions plain = opt;
    plain.dtype = DType::kBFloat16;
    auto pg = EpGroup::create_local({0}, plain);
    EXPECT_NE(message_of([&] { ep_dispatch_quantize(*pg[0], x, ids, probs, qc); }).find("FP8"),
              std::string::npos);
    EpOptions bytes = opt;
    bytes.scale_cols = 3;
    auto bg = EpGroup::create_local({0}, bytes);
    EXPECT_NE(
        message_of([&] { ep_dispatch_quantize(*bg[0], x, ids, probs, qc); }).find("scale_cols"),
        std::string::npos);
    // and the caller's scales are not taken: a good call works
    EpDispatchResult r = ep_dispatch_quantize(g, x, ids, probs, qc);
    EXPECT_EQ(r.scales.sizes(), std::vector<int64_t>({g.capacity_rows(), 2}));
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

}  // namespace
}  // namespace moeflow::test
