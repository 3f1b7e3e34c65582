// Expert-parallel dispatch / combine on GPUs (backends nccl and nvlink) against the
// W-rank CPU reference (moeflow/ep_reference.h), bitwise: received rows (tokens,
// probs), per-expert counts and offsets, drop counts, combined outputs
// (weighted and not), dispatch backward, combine backward (grad_y bitwise,
// dprobs within the dot-product tolerance), determinism over repeated runs.
// Label gpu: one rank on one GPU. Label multigpu: all visible GPUs (2+), with
// uneven tokens per rank (0 and primes), all tokens to one rank's experts, and
// a capacity overflow; tokens carry their source rank and index. The nvlink
// backend also: a rank that starts late and every token crossing. Two
// dispatches in flight and CUDA-graph replays: test_gpu_ep_inflight.cpp.
#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "gpu_ep_util.h"
#include "moeflow/ep.h"
#include "moeflow/ep_reference.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

// The simulated ranks (EpGroup::create_simulated) need every kernel loaded
// when CUDA starts and a hardware queue per stream, set before any test runs.
[[maybe_unused]] const bool kSimulationEnv = [] {
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  return true;
}();

using ep_reference::EpConfig;
using ep_reference::RankInput;

struct Round {
  std::vector<int64_t> tokens;  // T per rank
  bool one_rank = false;        // every slot to the experts of rank W-1
  bool tag_tokens = false;      // float32 x with x[t][0] = rank, x[t][1] = t
  int chunks = 4;               // pipeline pieces per peer (EpOptions::pipeline_chunks)
  int blocks = 0;               // EpOptions::overlap_blocks
  bool slow_rank0 = false;      // rank 0 starts its dispatch 50 ms after the others
  bool ids64 = false;           // the routing ids passed as int64
  DType wire = DType::kFloat32;  // EpOptions::combine_wire_dtype
};

// The same ids as int64 (host).
Tensor widen_ids(const Tensor& ids) {
  Tensor w = Tensor::empty(ids.sizes(), DType::kInt64, Device::cpu());
  for (int64_t i = 0; i < ids.numel(); ++i) w.data_ptr<int64_t>()[i] = ids.data_ptr<int32_t>()[i];
  return w;
}

Tensor to_host(TensorView v) {
  Tensor t = Tensor::empty(v.sizes(), v.dtype, Device::cpu());
  copy(v, t);
  return t;
}

// EpOptions::eager_share of the groups run_rounds makes (nccl backend).
double g_eager_share = EpOptions{}.eager_share;

// simulated: W ranks of the nvlink backend on GPU 0 (EpGroup::create_simulated).
void run_rounds(int W, const std::vector<Round>& rounds, int64_t capacity_rows = -1,
                EpBackend backend = EpBackend::kNccl, bool bulk_copies = false,
                bool register_buffers = true, int64_t H = 96,
                const std::vector<DType>& dtypes = {DType::kBFloat16, DType::kFloat32},
                bool simulated = false) {
  ASSERT_GE(cuda_device_count(), simulated ? 1 : W);
  const int E = 8 * W, K = 4;
  const int64_t tmax = 300;
  for (DType dt : dtypes) {
    // FP8 tokens (random bytes) go out; expert outputs and gradients are bf16
    const DType ydt = dtype_is_arith_float(dt) ? dt : DType::kBFloat16;
    EpOptions opt;
    opt.num_experts = E;
    opt.topk = K;
    opt.hidden = H;
    opt.dtype = dt;
    opt.align = 16;
    opt.max_tokens_per_rank = tmax;
    opt.capacity_rows = capacity_rows;
    opt.backend = backend;
    opt.nvlink_bulk_copies = bulk_copies;
    opt.nccl_register_buffers = register_buffers;
    opt.eager_share = g_eager_share;
    // scales travel with the rows: 3 float32 (4-byte words) with bf16 and
    // e4m3 tokens, 5 bytes with e5m2 tokens, none with float32 tokens
    const bool with_scales = dt != DType::kFloat32;
    opt.scale_cols = !with_scales ? 0 : dt == DType::kFloat8E5M2 ? 5 : 3;
    opt.scale_dtype = dt == DType::kFloat8E5M2 ? DType::kUInt8 : DType::kFloat32;
    std::vector<int> devs;
    for (int r = 0; r < W; ++r) devs.push_back(r);
    if (simulated) {  // every rank's kernels resident at once
      int sms = 0;
      MOEFLOW_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      opt.nvlink_blocks = std::min(opt.nvlink_blocks, sms / W);
      if (const char* v = std::getenv("MOEFLOW_TEST_SIM_BLOCKS")) opt.nvlink_blocks = std::atoi(v);
    }
    auto groups = simulated ? EpGroup::create_simulated(W, 0, opt) : EpGroup::create_local(devs, opt);
    // simulated: each rank runs on its group's stream (a hardware queue each)
    std::vector<cudaStream_t> streams(W, nullptr);
    if (simulated)
      for (int r = 0; r < W; ++r) streams[r] = groups[r]->simulated_stream();
    for (auto& g : groups) {  // the SM budget of the nvlink kernels: [2, SMs], any backend
      if (backend == EpBackend::kNccl && W > 1) {  // MOEFLOW_EP_REGISTER overrides the option
        const char* env = std::getenv("MOEFLOW_EP_REGISTER");
        EXPECT_EQ(g->nccl_buffers_registered(), env ? std::atoi(env) != 0 : register_buffers);
      }
      EXPECT_ANY_THROW(g->set_combine_wire_dtype(DType::kFloat16));
      EXPECT_ANY_THROW(g->set_nvlink_blocks(1));
      EXPECT_ANY_THROW(g->set_nvlink_blocks(100000));
      g->set_nvlink_blocks(opt.nvlink_blocks);
    }
    uint32_t seed = 7;
    for (const Round& rd : rounds) {
      if (rd.tag_tokens && dt != DType::kFloat32) continue;
      SCOPED_TRACE("W=" + std::to_string(W) + " " + dtype_name(dt) +
                   " T0=" + std::to_string(rd.tokens[0]) + (rd.one_rank ? " one-rank" : "") +
                   " pieces=" + std::to_string(rd.chunks) + " blocks=" + std::to_string(rd.blocks) +
                   (with_scales ? " scales" : "") +
                   (rd.wire == DType::kBFloat16 ? " bf16-wire" : ""));
      for (auto& g : groups) {
        g->set_pipeline_chunks(rd.chunks);
        g->set_overlap_blocks(rd.blocks);
        g->set_combine_wire_dtype(rd.wire);
      }
      std::vector<RankInput> in(W);
      for (int r = 0; r < W; ++r) {
        const int64_t T = rd.tokens[r];
        in[r].ids = random_topk(T, K, rd.one_rank ? 8 : E, seed++, 0.5, 0.05);
        if (rd.one_rank)
          for (int64_t i = 0; i < T * K; ++i)
            if (in[r].ids.data_ptr<int32_t>()[i] >= 0)
              in[r].ids.data_ptr<int32_t>()[i] += 8 * (W - 1);
        in[r].x = make_tensor({T, H}, dt);
        fill_random(in[r].x, seed++);
        if (rd.tag_tokens)
          for (int64_t t = 0; t < T; ++t) {
            in[r].x.data_ptr<float>()[t * H] = static_cast<float>(r);
            in[r].x.data_ptr<float>()[t * H + 1] = static_cast<float>(t);
          }
        in[r].probs = make_tensor({T, K}, DType::kFloat32);
        fill_random(in[r].probs, seed++, 0.1f, 1.0f);
        if (with_scales) {
          in[r].scales = Tensor::empty({T, opt.scale_cols}, opt.scale_dtype);
          for (size_t b = 0; b < in[r].scales.nbytes(); ++b)  // nonzero bytes
            static_cast<uint8_t*>(in[r].scales.data())[b] = static_cast<uint8_t>(1 + (seed + b * 7) % 251);
          ++seed;
        }
      }
      EpConfig cfg{W, E, opt.align, tmax, capacity_rows};
      ep_reference::Handle handle;
      std::vector<ep_reference::RankReceive> want = ep_reference::dispatch(in, cfg, handle);
      const int64_t cap = groups[0]->capacity_rows();
      ASSERT_EQ(cap, ep_reference::recv_capacity_rows(cfg, K));
      std::vector<Tensor> y(W), weights(W);
      for (int r = 0; r < W; ++r) {
        y[r] = make_tensor({cap, H}, ydt);
        fill_random(y[r], seed++);
        weights[r] = in[r].probs;
      }
      std::vector<Tensor> want_out = ep_reference::combine(y, handle, weights, ydt, rd.wire);
      std::vector<Tensor> want_unw =
          ep_reference::dispatch_backward(y, handle, ydt, rd.wire);
      std::vector<Tensor> dout(W), want_gy, want_dprobs;
      for (int r = 0; r < W; ++r) {
        dout[r] = make_tensor({rd.tokens[r], H}, ydt);
        fill_random(dout[r], seed++);
      }
      ep_reference::combine_backward(dout, handle, y, weights, want_gy, want_dprobs);

      // GPU, one thread per rank
      std::vector<Tensor> got_x(W), got_probs(W), got_tpe(W), got_off(W), got_out(W), got_out2(W),
          got_unw(W), got_scales(W);
      std::vector<int64_t> got_overflow(W), got_received(W);
      std::vector<Tensor> got_gy(W), got_dprobs(W);
      // Simulated ranks share one GPU: each runs on its own stream, and every
      // operation starts after all ranks are ready for it and ends with the
      // rank's stream synchronised (see create_simulated).
      HostBarrier ready(W);
      EpGroup::run_local(groups, [&](int r) {
        const Device dev = groups[r]->device();
        cudaStream_t st = streams[r];
        const bool trace = simulated && std::getenv("MOEFLOW_TEST_SIM_TRACE");
        int op_no = 0;
        auto op = [&](auto&& f) {
          if (!simulated) return f();
          ready.arrive_and_wait();
          if (trace) std::fprintf(stderr, "rank %d op %d launch\n", r, op_no);
          f();
          if (trace) std::fprintf(stderr, "rank %d op %d launched\n", r, op_no);
          MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(st));
          if (trace) std::fprintf(stderr, "rank %d op %d done\n", r, op_no);
          ++op_no;
        };
        Tensor x = in[r].x.to(dev), ids = (rd.ids64 ? widen_ids(in[r].ids) : in[r].ids).to(dev),
               probs = in[r].probs.to(dev), yy = y[r].to(dev);
        if (rd.slow_rank0 && r == 0 && !simulated) {
          MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        Tensor sc = with_scales ? in[r].scales.to(dev) : Tensor{};
        EpDispatchResult res;
        op([&] {
          // simulated: the others have launched their dispatch and wait on the GPU
          if (rd.slow_rank0 && r == 0 && simulated)
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          res = ep_dispatch(*groups[r], x, ids, probs, sc, st);
        });
        got_received[r] = res.received_tokens;
        got_x[r] = to_host(res.x);
        got_probs[r] = to_host(res.probs);
        EXPECT_EQ(res.scales.defined(), with_scales);
        if (with_scales) got_scales[r] = to_host(res.scales);
        got_tpe[r] = res.plan->tokens_per_expert.to(Device::cpu());
        got_off[r] = res.plan->expert_row_offsets.to(Device::cpu());
        got_overflow[r] = plan_status(*res.plan).overflow;
        Tensor out = Tensor::empty({rd.tokens[r], H}, ydt, dev);
        op([&] {
          fill_bytes(out, 0xFF, st);
          ep_combine(*groups[r], res.handle, yy, true, out, st);
        });
        got_out[r] = out.to(Device::cpu());
        op([&] {
          fill_bytes(out, 0xFF, st);
          ep_combine(*groups[r], res.handle, yy, true, out, st);  // determinism
        });
        got_out2[r] = out.to(Device::cpu());
        op([&] {
          fill_bytes(out, 0xFF, st);
          ep_dispatch_backward(*groups[r], res.handle, yy, out, st);
        });
        got_unw[r] = out.to(Device::cpu());
        {
          Tensor d = dout[r].to(dev), gy = Tensor::empty({cap, H}, ydt, dev);
          Tensor dp = Tensor::empty({rd.tokens[r], K}, DType::kFloat32, dev);
          op([&] {
            fill_bytes(gy, 0xFF, st);
            fill_bytes(dp, 0xFF, st);
            ep_combine_backward(*groups[r], res.handle, d, yy, true, gy, dp, st);
          });
          got_gy[r] = gy.to(Device::cpu());
          got_dprobs[r] = dp.to(Device::cpu());
        }
        // poisoned for the next round: its dispatch must write every row and
        // pad row it reports
        fill_bytes(res.x, 0xFF, st);
        fill_bytes(res.probs, 0xFF, st);
        if (with_scales) fill_bytes(res.scales, 0xFF, st);
        if (simulated) {
          MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(st));
          ready.arrive_and_wait();  // every rank done: nothing runs on the GPU now
        } else {
          MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
        }
      });
      for (int r = 0; r < W; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        const ep_reference::RankReceive& w = want[r];
        EXPECT_EQ(to_vec<int32_t>(got_tpe[r]), to_vec<int32_t>(w.tokens_per_expert));
        EXPECT_EQ(to_vec<int64_t>(got_off[r]), to_vec<int64_t>(w.expert_row_offsets));
        EXPECT_EQ(got_overflow[r], w.dropped);
        const int64_t used = w.total_rows;
        EXPECT_TRUE(same_bytes(got_x[r].data(), w.x.data(), used * H * dtype_size(dt)))
            << "received rows differ";
        EXPECT_TRUE(same_bytes(got_probs[r].data(), w.probs.data(), used * 4))
            << "received probs differ";
        if (with_scales)
          EXPECT_TRUE(same_bytes(got_scales[r].data(), w.scales.data(),
                                 used * opt.scale_cols * dtype_size(opt.scale_dtype)))
              << "received scales differ";
        if (rd.tag_tokens)  // every row holds the token the reference says
          for (int64_t row = 0; row < used; ++row) {
            const int32_t sr = w.src_rank.data_ptr<int32_t>()[row],
                          st = w.src_token.data_ptr<int32_t>()[row];
            const float* gx = got_x[r].data_ptr<float>() + row * H;
            if (sr < 0) {
              ASSERT_EQ(gx[0], 0.0f) << "pad row " << row;
              continue;
            }
            ASSERT_EQ(gx[0], static_cast<float>(sr)) << "row " << row;
            ASSERT_EQ(gx[1], static_cast<float>(st)) << "row " << row;
          }
        const size_t out_bytes = rd.tokens[r] * H * dtype_size(ydt);
        EXPECT_TRUE(same_bytes(got_out[r].data(), want_out[r].data(), out_bytes))
            << "combine differs";
        EXPECT_TRUE(same_bytes(got_out2[r].data(), got_out[r].data(), out_bytes))
            << "combine not deterministic";
        EXPECT_TRUE(same_bytes(got_unw[r].data(), want_unw[r].data(), out_bytes))
            << "dispatch backward differs";
        EXPECT_TRUE(same_bytes(got_gy[r].data(), want_gy[r].data(), used * H * dtype_size(ydt)))
            << "combine backward grad_y differs";
        EXPECT_TRUE(all_close(got_dprobs[r], want_dprobs[r], dot_tolerance(H)))
            << "combine backward dprobs";
      }
    }
  }
}

TEST(GpuEp, OneRankMatchesReference) {
  Round two_pieces{{257}};
  two_pieces.chunks = 2;
  run_rounds(1, {{{257}}, {{0}}, {{300}, false, true}, two_pieces});
}

TEST(GpuEp, OneRankOverflowIsCountedNotWritten) {
  run_rounds(1, {{{257}}}, 256);
}

// The multi-GPU rounds of both backends: uneven tokens (a prime count),
// a rank with 0 tokens, all slots to one rank's experts, tagged tokens.
struct MultiRounds {
  Round uneven, empty_rank, one_rank, tagged;
  explicit MultiRounds(int W) {
    for (int r = 0; r < W; ++r) {
      uneven.tokens.push_back(r == 0 ? 257 : 131 + 2 * r);
      empty_rank.tokens.push_back(r == 0 ? 0 : 293);
      one_rank.tokens.push_back(211);
      tagged.tokens.push_back(97 + r);
    }
    one_rank.one_rank = true;
    tagged.tag_tokens = true;
  }
  // The rounds with the bfloat16 combine wire (EpOptions::combine_wire_dtype).
  std::vector<Round> bf16_wire_rounds() const {
    std::vector<Round> v{uneven, empty_rank, one_rank, tagged};
    Round to_peer = tagged;
    to_peer.one_rank = true;  // rank W-1's tokens too: everything crosses except its own
    v.push_back(to_peer);
    for (Round& r : v) r.wire = DType::kBFloat16;
    v[0].chunks = 1;
    v[2].chunks = 3;
    return v;
  }
  // The four rounds and two more, over the pipeline's piece counts: one
  // transfer, more pieces than some peers have rows, odd counts, grid-stride
  // loops over few blocks, int64 ids, and two pieces (the default: the first
  // holds pipeline_first_share of the tokens).
  std::vector<Round> piece_rounds() const {
    Round e = empty_rank, o = one_rank, t = tagged, u = uneven;
    e.chunks = 1;
    o.chunks = 16;
    t.chunks = 3;
    t.blocks = 3;
    u.chunks = 7;
    u.blocks = 1;
    u.ids64 = true;
    Round two = t;
    two.chunks = 2;
    return {uneven, e, o, t, u, two};
  }
};

TEST(MultiGpuEp, MatchesReference) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  // After the first round, each dispatch sends an eager piece sized from the
  // previous one's counts (rows past this one's count are padding).
  run_rounds(W, MultiRounds(W).piece_rounds());
}

// The bfloat16 combine wire: bitwise the reference with the same wire.
TEST(MultiGpuEp, Bf16CombineWireMatchesReference) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  run_rounds(W, MultiRounds(W).bf16_wire_rounds());
}

TEST(MultiGpuEpNvlink, Bf16CombineWireMatchesReference) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  run_rounds(W, MultiRounds(W).bf16_wire_rounds(), -1, EpBackend::kNvlink);
}

TEST(GpuEpNvlinkSimulated, Bf16CombineWireMatchesReference) {
  run_rounds(4, MultiRounds(4).bf16_wire_rounds(), -1, EpBackend::kNvlink, false, false, 96,
             {DType::kBFloat16, DType::kFloat32}, true);
}

// The same rounds without the eager piece: the rows go in the pipeline's
// pieces only.
TEST(MultiGpuEp, NoEagerPieceMatchesReference) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  g_eager_share = 0.0;
  run_rounds(W, MultiRounds(W).piece_rounds());
  g_eager_share = EpOptions{}.eager_share;
}

// Backend nvlink: the same rounds, bitwise the same results.
TEST(GpuEpNvlink, OneRankMatchesReference) {
  Round ids64{{257}};
  ids64.ids64 = true;
  run_rounds(1, {{{257}}, {{0}}, {{300}, false, true}, ids64}, -1, EpBackend::kNvlink);
}

TEST(MultiGpuEpNvlink, MatchesReference) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  MultiRounds m(W);
  auto& [uneven, empty_rank, one_rank, tagged] = m;
  Round slow = uneven, to_peer = tagged;
  slow.slow_rank0 = true;
  empty_rank.ids64 = true;
  to_peer.one_rank = true;  // rank W-1's tokens too: everything crosses except its own
  run_rounds(W, {uneven, empty_rank, one_rank, tagged, slow, to_peer}, -1, EpBackend::kNvlink);
}

// The dispatch with TMA bulk copies (EpOptions::nvlink_bulk_copies).
TEST(MultiGpuEpNvlink, BulkCopiesMatchReference) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  MultiRounds m(W);
  Round to_peer = m.tagged;
  to_peer.one_rank = true;
  run_rounds(W, {m.uneven, m.empty_rank, m.tagged, to_peer}, -1, EpBackend::kNvlink, true);
  Round full;
  for (int r = 0; r < W; ++r) full.tokens.push_back(280);
  run_rounds(W, {full}, 256, EpBackend::kNvlink, true);  // overflow
}

TEST(MultiGpuEpNvlink, OverflowIsCountedNotWritten) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  Round rd;
  for (int r = 0; r < W; ++r) rd.tokens.push_back(280);
  run_rounds(W, {rd}, 256, EpBackend::kNvlink);
}

// Backend nccl, long rows (8-16 KB): the messages are large enough for
// NCCL's simple protocol, where registered buffers are copied straight into
// and plain ones go through NCCL's own buffers; the same bits.
TEST(MultiGpuEp, LongRowsRegisteredOrNotMatchReference) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  MultiRounds m(W);
  m.tagged.chunks = 3;
  for (const bool reg : {true, false}) {
    SCOPED_TRACE(reg ? "registered" : "plain");
    run_rounds(W, {m.uneven, m.empty_rank, m.tagged}, -1, EpBackend::kNccl, false, reg, 4096);
  }
}

// FP8 dispatch (e4m3 rows with float32 block scales, e5m2 rows with byte
// scales), bf16 expert outputs and gradients: both backends, one rank and
// all GPUs.
TEST(GpuEp, ScalesArgumentErrors) {
  for (const EpBackend b : {EpBackend::kNccl, EpBackend::kNvlink}) {
    EpOptions opt;
    opt.backend = b;
    opt.num_experts = 8;
    opt.topk = 2;
    opt.hidden = 64;
    opt.max_tokens_per_rank = 16;
    opt.scale_cols = 2;
    auto groups = EpGroup::create_local({0}, opt);
    const Device dev = groups[0]->device();
    Tensor x = Tensor::zeros({16, 64}, DType::kBFloat16, dev);
    Tensor ids = random_topk(16, 2, 8, 5).to(dev);
    Tensor probs = Tensor::zeros({16, 2}, DType::kFloat32, dev);
    // a group with scale_cols > 0 takes scales on every dispatch, of its shape and dtype
    EXPECT_THROW(ep_dispatch(*groups[0], x, ids, probs), Error);
    EXPECT_THROW(ep_dispatch(*groups[0], x, ids, probs, Tensor::zeros({16, 3}, DType::kFloat32, dev)),
                 Error);
    EXPECT_THROW(ep_dispatch(*groups[0], x, ids, probs, Tensor::zeros({16, 2}, DType::kFloat16, dev)),
                 Error);
    EpDispatchResult r = ep_dispatch(*groups[0], x, ids, probs, Tensor::zeros({16, 2}, DType::kFloat32, dev));
    EXPECT_EQ(r.scales.sizes(), std::vector<int64_t>({groups[0]->capacity_rows(), 2}));
    // and a group without them refuses them
    opt.scale_cols = 0;
    auto plain = EpGroup::create_local({0}, opt);
    EXPECT_THROW(ep_dispatch(*plain[0], x, ids, probs, Tensor::zeros({16, 2}, DType::kFloat32, dev)),
                 Error);
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    for (const double share : {-0.1, 1.0}) {  // the eager share is in [0, 1)
      EpOptions bad = opt;
      bad.eager_share = share;
      EXPECT_THROW(EpGroup::create_local({0}, bad), Error) << share;
    }
  }
}

// FP8 dispatch (e4m3 rows with float32 block scales, e5m2 rows with byte
// scales), bf16 expert outputs and gradients: both backends, one rank and
// all GPUs.
TEST(GpuEp, Fp8TokensMatchReference) {
  const int W = std::max(1, cuda_device_count());
  Round rd, other;
  for (int r = 0; r < W; ++r) {
    rd.tokens.push_back(r == 0 ? 211 : 97 + r);
    other.tokens.push_back(r == 0 ? 0 : 150);
  }
  for (const EpBackend b : {EpBackend::kNccl, EpBackend::kNvlink}) {
    SCOPED_TRACE(b == EpBackend::kNccl ? "nccl" : "nvlink");
    run_rounds(W, {rd, other}, -1, b, false, false, 96,
               {DType::kFloat8E4M3, DType::kFloat8E5M2});
  }
}

// Backend nvlink with W ranks simulated on one GPU (EpGroup::create_simulated:
// windows in that GPU's memory, counter barriers): the multi-rank logic of the
// kernels (count exchange, tokens crossing once, stages and flags, partials,
// the backward) against the reference where only one GPU is at hand. The
// real-GPU tests above remain the ones that count.
// (MOEFLOW_TEST_SIM_W=3..8 runs it with another world size.)
void simulated_ranks(int W) {
  MultiRounds m(W);
  auto& [uneven, empty_rank, one_rank, tagged] = m;
  Round slow = uneven, to_peer = tagged;
  slow.slow_rank0 = true;
  empty_rank.ids64 = true;
  to_peer.one_rank = true;
  run_rounds(W, {uneven, empty_rank, one_rank, tagged, slow, to_peer}, -1, EpBackend::kNvlink,
             false, false, 96, {DType::kBFloat16, DType::kFloat32}, true);
  // FP8 rows with their scales, bulk copies, an overflow
  run_rounds(W, {uneven, empty_rank}, -1, EpBackend::kNvlink, false, false, 96,
             {DType::kFloat8E4M3, DType::kFloat8E5M2}, true);
  run_rounds(W, {uneven, to_peer}, -1, EpBackend::kNvlink, true, false, 96,
             {DType::kBFloat16, DType::kFloat32}, true);
  Round full;
  for (int r = 0; r < W; ++r) full.tokens.push_back(280);
  run_rounds(W, {full}, 256, EpBackend::kNvlink, false, false, 96, {DType::kBFloat16}, true);
}

TEST(GpuEpNvlinkSimulated, TwoRanksMatchReference) {
  const char* w = std::getenv("MOEFLOW_TEST_SIM_W");
  simulated_ranks(w ? std::atoi(w) : 2);
}
TEST(GpuEpNvlinkSimulated, FourRanksMatchReference) {
  simulated_ranks(4);
}
TEST(GpuEpNvlinkSimulated, EightRanksMatchReference) {
  simulated_ranks(8);
}

TEST(GpuEpNvlinkSimulated, ArgumentErrors) {
  EpOptions opt;
  opt.num_experts = 16;
  opt.topk = 2;
  opt.hidden = 64;
  opt.max_tokens_per_rank = 8;
  EXPECT_THROW(EpGroup::create_simulated(2, 0, opt), Error);  // backend nccl
  opt.backend = EpBackend::kNvlink;
  EXPECT_THROW(EpGroup::create_simulated(1, 0, opt), Error);
  EXPECT_THROW(EpGroup::create_simulated(9, 0, opt), Error);
  EXPECT_THROW(EpGroup::create_simulated(2, cuda_device_count(), opt), Error);
  {  // the bfloat16 combine wire needs 16-byte rows
    EpOptions o = opt;
    o.combine_wire_dtype = DType::kBFloat16;
    o.hidden = 60;
    EXPECT_THROW(EpGroup::create_simulated(2, 0, o), Error);
  }
  int sms = 0;
  MOEFLOW_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  opt.nvlink_blocks = sms / 2 + 1;  // two ranks' kernels would not fit at once
  EXPECT_THROW(EpGroup::create_simulated(2, 0, opt), Error);
  opt.nvlink_blocks = 8;
  auto groups = EpGroup::create_simulated(2, 0, opt);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[1]->rank(), 1);
  EXPECT_EQ(groups[1]->world_size(), 2);
  EXPECT_EQ(groups[0]->nccl_comm(), nullptr);
  EXPECT_THROW(groups[0]->set_nvlink_blocks(sms / 2 + 1), Error);
  groups[0]->set_nvlink_blocks(sms / 2);
}

TEST(MultiGpuEp, OverflowIsCountedNotWritten) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  Round rd;
  for (int r = 0; r < W; ++r) rd.tokens.push_back(280);
  run_rounds(W, {rd}, 256);
}

// Routing entries outside [-1, E) (int64 ids past 2^32 included: never
// narrowed into a valid id) are counted and ignored on the way to every
// rank, and the dispatch then reports them: the same rows per peer as the
// routing with those entries set to -1.
TEST(MultiGpuEp, InvalidIdsAreIgnoredAndReported) {
  const int W = cuda_device_count();
  if (W < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  const int E = 8 * W, K = 4;
  const int64_t H = 64, T = 101;
  EpOptions opt;
  opt.num_experts = E;
  opt.topk = K;
  opt.hidden = H;
  opt.align = 16;
  opt.max_tokens_per_rank = T;
  std::vector<int> devs;
  for (int r = 0; r < W; ++r) devs.push_back(r);
  auto groups = EpGroup::create_local(devs, opt);
  std::vector<std::vector<int64_t>> bad_rows(W), good_rows(W), bad_sent(W), good_sent(W);
  std::vector<int> threw(W, 0);
  EpGroup::run_local(groups, [&](int r) {
    const Device dev = groups[r]->device();
    Tensor ids32 = random_topk(T, K, E, 31 + r, 0.5, 0.05);
    Tensor bad = widen_ids(ids32), good = widen_ids(ids32);
    int64_t* b = bad.data_ptr<int64_t>();
    int64_t* gd = good.data_ptr<int64_t>();
    const int64_t wrong[] = {(int64_t{1} << 32) + 1, E + 3, -7, (int64_t{1} << 40)};
    for (int i = 0; i < 4; ++i) {
      const int64_t at = (17 * i + 5 * r) * K + i % K;
      b[at] = wrong[i];
      gd[at] = -1;
    }
    Tensor x = make_tensor({T, H}, DType::kBFloat16);
    fill_random(x, 3 + r);
    Tensor xd = x.to(dev), probs = make_tensor({T, K}, DType::kFloat32);
    fill_random(probs, 5 + r, 0.1f, 1.0f);
    Tensor pd = probs.to(dev);
    try {
      ep_dispatch(*groups[r], xd, bad.to(dev), pd);
    } catch (const Error& e) {
      threw[r] = std::string(e.what()).find("outside [-1, ") != std::string::npos;
    }
    bad_rows[r] = groups[r]->last_recv_rows();
    bad_sent[r] = groups[r]->last_send_rows();
    ep_dispatch(*groups[r], xd, good.to(dev), pd);
    good_rows[r] = groups[r]->last_recv_rows();
    good_sent[r] = groups[r]->last_send_rows();
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_EQ(threw[r], 1) << "rank " << r;
    EXPECT_EQ(bad_rows[r], good_rows[r]) << "rank " << r;
    EXPECT_EQ(bad_sent[r], good_sent[r]) << "rank " << r;
  }
}

}  // namespace
}  // namespace moeflow::test
