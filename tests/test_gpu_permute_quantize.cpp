// GPU tests (label gpu) of permute_quantize: the CUDA kernel against the CPU
// reference (quantize then permute), bitwise, on preset-like shapes (H = 7168
// included), both fp8 formats, pow2 scales, dropped slots, K > 32, unaligned
// rows (the byte path); outputs poisoned with 0xFF first (rows past
// total_rows must stay poisoned); CUDA graph capture + replay with new routings.
// unpermute_backward_quantize the same way, with and without probs. The
// tensorwise forms of both (every row written, the transposed codes). The
// columnwise form of permute_quantize (the blockwise wgrad's operand).
#include <cuda_runtime.h>

#include <limits>

#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);

class GpuPermuteQuantize : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device"; }
};

struct Built {
  RoutingPlan cpu, gpu;
};

Built build_both(const Tensor& ids, const PlanConfig& cfg) {
  const int64_t T = ids.size(0);
  const int K = static_cast<int>(ids.size(1));
  Built b;
  b.cpu = allocate_plan(T, K, cfg, Device::cpu());
  b.gpu = allocate_plan(T, K, cfg, kGpu);
  Tensor ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(T, K, cfg))}, DType::kUInt8, kGpu);
  build_plan(ids, b.cpu);
  build_plan(ids.to(kGpu), b.gpu, ws);
  MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(to_vec<int64_t>(b.gpu.dest_row), to_vec<int64_t>(b.cpu.dest_row));
  return b;
}

struct Out {
  Tensor y, ys, pp;
};

Out poisoned_outputs(const RoutingPlan& plan, int64_t H, DType out, Device dev) {
  return Out{poisoned({plan.capacity_rows, H}, out, dev),
             poisoned({plan.capacity_rows, blocks128(H)}, DType::kFloat32, dev),
             poisoned({plan.capacity_rows}, DType::kFloat32, dev)};
}

// Every byte of rows >= total_rows is still 0xFF.
void expect_tail_poisoned(const Tensor& t, int64_t total) {
  const int64_t rb = t.numel() / std::max<int64_t>(t.size(0), 1) * dtype_size(t.dtype());
  const auto* p = static_cast<const uint8_t*>(t.data());
  for (int64_t i = total * rb; i < t.size(0) * rb; ++i)
    ASSERT_EQ(p[i], 0xFF) << "row past total_rows written: " << i / rb;
}

void add_special_values(Tensor& x) {
  const int64_t T = x.size(0), H = x.size(1);
  if (T < 3 || H < 3) return;
  for (int64_t h = 0; h < H; ++h) detail::store_float(x.data(), x.dtype(), h, 0.0f);
  detail::store_float(x.data(), x.dtype(), H + 1, std::numeric_limits<float>::quiet_NaN());
  detail::store_float(x.data(), x.dtype(), H + 2, std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < H; ++h)
    detail::store_float(x.data(), x.dtype(), 2 * H + h, 1.0e-5f * static_cast<float>(h % 5));
}

struct PqCase {
  Case c;
  int64_t capacity;  // -1: worst case
  std::vector<DType> dtypes;
};

const std::vector<PqCase> kPqCases = {
    {{1024, 8, 256, 7168, 128}, -1, {DType::kBFloat16}},  // DeepSeek-V3-like
    {{2048, 2, 8, 4096, 16}, -1, {DType::kBFloat16, DType::kFloat32}},  // Mixtral-like
    {{1000, 6, 64, 2048, 16}, -1, {DType::kBFloat16, DType::kFloat16}},
    {{513, 4, 32, 1000, 32}, -1, {DType::kBFloat16, DType::kFloat32}},  // H % 16 != 0: byte path
    {{257, 8, 16, 136, 16}, 512, {DType::kBFloat16}},                   // dropped slots
    {{300, 1, 8, 256, 16}, -1, {DType::kFloat16}},                      // K = 1
    {{64, 40, 64, 384, 16}, -1, {DType::kBFloat16}},                    // K > 32
    {{0, 2, 4, 256, 16}, -1, {DType::kBFloat16}},                       // no tokens
};

TEST_F(GpuPermuteQuantize, MatchesCpuBitwise) {
  uint32_t seed = 4000;
  for (const PqCase& pc : kPqCases) {
    const Case& c = pc.c;
    for (DType dt : pc.dtypes) {
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        for (bool pow2 : {false, true}) {
          SCOPED_TRACE(name_of(c) + " cap=" + std::to_string(pc.capacity) + " " + dtype_name(dt) +
                       " -> " + dtype_name(out) + (pow2 ? " pow2" : ""));
          Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.05);
          Built b = build_both(ids, PlanConfig{c.E, c.align, pc.capacity});
          Tensor x = make_tensor({c.T, c.H}, dt);
          fill_random(x, seed++, -8.0f, 8.0f);
          add_special_values(x);
          Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
          fill_random(probs, seed++, 0.0f, 1.0f);
          const QuantizeConfig cfg{out, QuantScaling::kBlock1x128, pow2, false};
          Out want = poisoned_outputs(b.cpu, c.H, out, Device::cpu());
          permute_quantize(x, b.cpu, want.y, want.ys, cfg, PermuteExtras{probs, want.pp, {}, {}});
          Out got = poisoned_outputs(b.gpu, c.H, out, kGpu);
          permute_quantize(x.to(kGpu), b.gpu, got.y, got.ys, cfg,
                           PermuteExtras{probs.to(kGpu), got.pp, {}, {}});
          MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
          Tensor y = got.y.to(Device::cpu()), ys = got.ys.to(Device::cpu()), pp = got.pp.to(Device::cpu());
          EXPECT_TRUE(bytes_equal(y, want.y));
          EXPECT_TRUE(bytes_equal(ys, want.ys));
          EXPECT_TRUE(bytes_equal(pp, want.pp));
          const int64_t total = plan_status(b.cpu).total_rows;
          expect_tail_poisoned(y, total);
          expect_tail_poisoned(ys, total);
          expect_tail_poisoned(pp, total);
        }
      }
    }
  }
}

// Strided x (row stride 1032 elements: rows 16-byte aligned, then misaligned by
// a 1-element offset) against the CPU reference on the same view.
TEST_F(GpuPermuteQuantize, StridedAndMisalignedRows) {
  const Case c{300, 4, 16, 1024, 16};
  Tensor ids = random_topk(c.T, c.K, c.E, 77);
  Built b = build_both(ids, PlanConfig{c.E, c.align, -1});
  const int64_t stride = 1032;
  Tensor xbuf = make_tensor({c.T + 1, stride}, DType::kBFloat16);
  fill_random(xbuf, 78, -3.0f, 3.0f);
  Tensor xbuf_g = xbuf.to(kGpu);
  for (int64_t offset : {0, 1}) {
    SCOPED_TRACE(offset);
    auto elem = [&](const Tensor& t) { return static_cast<uint8_t*>(t.data()) + offset * 2; };
    auto x_c = TensorView::strided(elem(xbuf), DType::kBFloat16, Device::cpu(), {c.T, c.H}, {stride, 1});
    auto x_g = TensorView::strided(elem(xbuf_g), DType::kBFloat16, kGpu, {c.T, c.H}, {stride, 1});
    const QuantizeConfig cfg{};
    Out want = poisoned_outputs(b.cpu, c.H, cfg.out, Device::cpu());
    permute_quantize(x_c, b.cpu, want.y, want.ys, cfg);
    Out got = poisoned_outputs(b.gpu, c.H, cfg.out, kGpu);
    permute_quantize(x_g, b.gpu, got.y, got.ys, cfg);
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(bytes_equal(got.y.to(Device::cpu()), want.y));
    EXPECT_TRUE(bytes_equal(got.ys.to(Device::cpu()), want.ys));
  }
}

// build_plan + permute_quantize captured in one CUDA graph; replays with new
// routings and tokens (copied into the captured buffers) must equal the CPU reference.
TEST_F(GpuPermuteQuantize, GraphCaptureReplayWithNewRoutings) {
  const Case c{1500, 8, 64, 2048, 128};
  const PlanConfig cfg{c.E, c.align, -1};
  const QuantizeConfig qcfg{DType::kFloat8E4M3, QuantScaling::kBlock1x128, true, false};
  cudaStream_t stream;
  MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RoutingPlan plan = allocate_plan(c.T, c.K, cfg, kGpu);
  Tensor ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(c.T, c.K, cfg))}, DType::kUInt8, kGpu);
  Tensor ids_g = Tensor::empty({c.T, c.K}, DType::kInt32, kGpu);
  Tensor x_g = Tensor::empty({c.T, c.H}, DType::kBFloat16, kGpu);
  Tensor probs_g = Tensor::empty({c.T, c.K}, DType::kFloat32, kGpu);
  Out got{Tensor::empty({plan.capacity_rows, c.H}, qcfg.out, kGpu),
          Tensor::empty({plan.capacity_rows, blocks128(c.H)}, DType::kFloat32, kGpu),
          Tensor::empty({plan.capacity_rows}, DType::kFloat32, kGpu)};
  // and the columnwise form (the blockwise wgrad's operand) in the same graph
  QuantizeConfig ccfg = qcfg;
  ccfg.columnwise = true;
  Tensor yt = Tensor::empty({c.H, plan.capacity_rows}, qcfg.out, kGpu);
  Tensor yts = Tensor::empty({c.H, blocks128(plan.capacity_rows)}, DType::kFloat32, kGpu);
  // Warm-up outside the capture (module load).
  copy(random_topk(c.T, c.K, c.E, 1), ids_g, stream);
  build_plan(ids_g, plan, ws, stream);
  permute_quantize(x_g, plan, got.y, got.ys, qcfg, PermuteExtras{probs_g, got.pp, {}, {}}, stream);
  permute_quantize(x_g, plan, yt, yts, ccfg, {}, stream);
  MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));

  cudaGraph_t graph;
  MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  build_plan(ids_g, plan, ws, stream);
  permute_quantize(x_g, plan, got.y, got.ys, qcfg, PermuteExtras{probs_g, got.pp, {}, {}}, stream);
  permute_quantize(x_g, plan, yt, yts, ccfg, {}, stream);
  MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE(replay);
    Tensor ids = random_topk(c.T, c.K, c.E, 500 + replay, replay * 1.0, 0.05);
    Tensor x = make_tensor({c.T, c.H}, DType::kBFloat16);
    fill_random(x, 600 + replay, -5.0f, 5.0f);
    Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
    fill_random(probs, 700 + replay, 0.0f, 1.0f);
    copy(ids, ids_g, stream);
    copy(x, x_g, stream);
    copy(probs, probs_g, stream);
    fill_bytes(got.y, 0xFF, stream);
    fill_bytes(got.ys, 0xFF, stream);
    fill_bytes(got.pp, 0xFF, stream);
    fill_bytes(yt, 0xFF, stream);
    fill_bytes(yts, 0xFF, stream);
    MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));

    RoutingPlan cpu_plan = allocate_plan(c.T, c.K, cfg, Device::cpu());
    build_plan(ids, cpu_plan);
    Out want = poisoned_outputs(cpu_plan, c.H, qcfg.out, Device::cpu());
    permute_quantize(x, cpu_plan, want.y, want.ys, qcfg, PermuteExtras{probs, want.pp, {}, {}});
    EXPECT_TRUE(bytes_equal(got.y.to(Device::cpu()), want.y));
    EXPECT_TRUE(bytes_equal(got.ys.to(Device::cpu()), want.ys));
    EXPECT_TRUE(bytes_equal(got.pp.to(Device::cpu()), want.pp));
    Tensor want_t = poisoned({c.H, cpu_plan.capacity_rows}, qcfg.out);
    Tensor want_ts = poisoned({c.H, blocks128(cpu_plan.capacity_rows)}, DType::kFloat32);
    permute_quantize(x, cpu_plan, want_t, want_ts, ccfg);
    EXPECT_TRUE(bytes_equal(yt.to(Device::cpu()), want_t));
    EXPECT_TRUE(bytes_equal(yts.to(Device::cpu()), want_ts));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The columnwise form: the tile kernel (16-bit x, H % 8 == 0, aligned rows)
// and the per-element path (float32 x; H = 1001: rows not 16-byte aligned)
// against the CPU reference, bitwise, both scale layouts, outputs poisoned
// (the 128-row blocks past total_rows must stay so).
TEST_F(GpuPermuteQuantize, ColumnwiseMatchesCpuBitwise) {
  const std::vector<PqCase> cases = {
      {{1024, 8, 256, 7168, 128}, -1, {DType::kBFloat16}},
      {{2048, 2, 8, 4096, 16}, -1, {DType::kBFloat16, DType::kFloat32}},
      {{513, 4, 32, 1000, 32}, -1, {DType::kFloat16}},
      {{300, 4, 8, 1001, 16}, -1, {DType::kBFloat16}},
      {{257, 8, 16, 136, 16}, 512, {DType::kBFloat16}},
      {{100, 2, 4, 256, 16}, 4096, {DType::kBFloat16}},  // blocks past total_rows
      {{0, 2, 4, 256, 16}, -1, {DType::kBFloat16}},
  };
  uint32_t seed = 5000;
  int layout = 0;
  for (const PqCase& pc : cases) {
    const Case& c = pc.c;
    for (DType dt : pc.dtypes) {
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        const bool transposed = (layout % 2) == 0, pow2 = (layout / 2) % 2 == 0;
        ++layout;
        SCOPED_TRACE(name_of(c) + " cap=" + std::to_string(pc.capacity) + " " + dtype_name(dt) +
                     " -> " + dtype_name(out) + (pow2 ? " pow2" : "") +
                     (transposed ? " scales [nb,H]^T" : ""));
        Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.05);
        Built b = build_both(ids, PlanConfig{c.E, c.align, pc.capacity});
        Tensor x = make_tensor({c.T, c.H}, dt);
        fill_random(x, seed++, -8.0f, 8.0f);
        add_special_values(x);
        const int64_t cap = b.cpu.capacity_rows, nb = blocks128(cap);
        const QuantizeConfig cfg{out, QuantScaling::kBlock1x128, pow2, true};
        auto scales_of = [&](Tensor& buf) {
          return transposed ? TensorView::strided(buf.data(), DType::kFloat32, buf.device(),
                                                  {c.H, nb}, {1, c.H})
                            : TensorView(buf);
        };
        const std::vector<int64_t> sshape =
            transposed ? std::vector<int64_t>{nb, c.H} : std::vector<int64_t>{c.H, nb};
        Tensor want = poisoned({c.H, cap}, out), want_s = poisoned(sshape, DType::kFloat32);
        permute_quantize(x, b.cpu, want, scales_of(want_s), cfg);
        Tensor got = poisoned({c.H, cap}, out, kGpu);
        Tensor got_s = poisoned(sshape, DType::kFloat32, kGpu);
        permute_quantize(x.to(kGpu), b.gpu, got, scales_of(got_s), cfg);
        MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
        EXPECT_TRUE(bytes_equal(got.to(Device::cpu()), want));
        EXPECT_TRUE(bytes_equal(got_s.to(Device::cpu()), want_s));
        if (pc.capacity == 4096) {  // the last blocks are left poisoned
          Tensor g = got.to(Device::cpu());
          EXPECT_EQ(static_cast<const uint8_t*>(g.data())[cap - 1], 0xFF);
        }
      }
    }
  }
}

TEST_F(GpuPermuteQuantize, UnpermuteBackwardQuantizeMatchesCpuBitwise) {
  uint32_t seed = 6000;
  for (const PqCase& pc : kPqCases) {
    const Case& c = pc.c;
    for (DType dt : pc.dtypes) {
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        for (bool with_probs : {false, true}) {
          const bool pow2 = with_probs;
          SCOPED_TRACE(name_of(c) + " cap=" + std::to_string(pc.capacity) + " " + dtype_name(dt) +
                       " -> " + dtype_name(out) + (with_probs ? " probs pow2" : ""));
          Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.05);
          Built b = build_both(ids, PlanConfig{c.E, c.align, pc.capacity});
          Tensor dout = make_tensor({c.T, c.H}, dt);
          fill_random(dout, seed++, -8.0f, 8.0f);
          add_special_values(dout);
          Tensor probs;
          if (with_probs) {
            probs = make_tensor({c.T, c.K}, DType::kFloat32);
            fill_random(probs, seed++, -2.0f, 2.0f);
          }
          const QuantizeConfig cfg{out, QuantScaling::kBlock1x128, pow2, false};
          Out want = poisoned_outputs(b.cpu, c.H, out, Device::cpu());
          unpermute_backward_quantize(dout, b.cpu, with_probs ? TensorView(probs) : TensorView{},
                                      want.y, want.ys, cfg);
          Out got = poisoned_outputs(b.gpu, c.H, out, kGpu);
          Tensor probs_g = with_probs ? probs.to(kGpu) : Tensor{};
          unpermute_backward_quantize(dout.to(kGpu), b.gpu,
                                      with_probs ? TensorView(probs_g) : TensorView{}, got.y,
                                      got.ys, cfg);
          MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
          Tensor y = got.y.to(Device::cpu()), ys = got.ys.to(Device::cpu());
          EXPECT_TRUE(bytes_equal(y, want.y));
          EXPECT_TRUE(bytes_equal(ys, want.ys));
          const int64_t total = plan_status(b.cpu).total_rows;
          expect_tail_poisoned(y, total);
          expect_tail_poisoned(ys, total);
        }
      }
    }
  }
}

// The tensorwise forms of both ops: CUDA against the CPU reference, bitwise,
// every row (all rows are written: codes 0 where no slot), the transposed
// codes, the rows' probs, the scale; special values (NaN, inf: out of the
// amax), strided and misaligned tokens, each preset-like case; then both
// captured in one CUDA graph with a plan build and replayed with new
// routings.
struct TwOut {
  Tensor y, s, t, pp;
};

TwOut tw_outputs(const RoutingPlan& plan, int64_t H, DType out, Device dev, bool transposed) {
  return TwOut{poisoned({plan.capacity_rows, H}, out, dev), poisoned({1}, DType::kFloat32, dev),
               transposed ? poisoned({H, plan.capacity_rows}, out, dev) : Tensor{},
               poisoned({plan.capacity_rows}, DType::kFloat32, dev)};
}

void expect_tw_equal(const TwOut& got, const TwOut& want, bool probs_out) {
  EXPECT_TRUE(bytes_equal(got.y.to(Device::cpu()), want.y));
  EXPECT_TRUE(bytes_equal(got.s.to(Device::cpu()), want.s));
  if (want.t.defined()) EXPECT_TRUE(bytes_equal(got.t.to(Device::cpu()), want.t));
  if (probs_out) EXPECT_TRUE(bytes_equal(got.pp.to(Device::cpu()), want.pp));
}

TEST_F(GpuPermuteQuantize, TensorwiseMatchesCpuBitwise) {
  uint32_t seed = 9000;
  for (const PqCase& pc : kPqCases) {
    const Case& c = pc.c;
    for (DType dt : pc.dtypes) {
      for (int form = 0; form < 4; ++form) {  // permute / unpermute_backward, (no) probs
        const bool bwd = form >= 2, with_probs = form % 2 == 1;
        const bool transposed = (seed % 3) != 0;
        const QuantizeConfig cfg{(seed % 2) ? DType::kFloat8E4M3 : DType::kFloat8E5M2,
                                 QuantScaling::kTensorwise, (seed % 4) == 1, false};
        SCOPED_TRACE(name_of(c) + " cap=" + std::to_string(pc.capacity) + " " + dtype_name(dt) +
                     " -> " + dtype_name(cfg.out) + (bwd ? " unpermute_backward" : " permute") +
                     (with_probs ? " probs" : "") + (transposed ? " transposed" : "") +
                     (cfg.pow2_scales ? " pow2" : ""));
        Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.05);
        Built b = build_both(ids, PlanConfig{c.E, c.align, pc.capacity});
        Tensor x = make_tensor({c.T, c.H}, dt);
        fill_random(x, seed++, -8.0f, 8.0f);
        add_special_values(x);
        Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
        fill_random(probs, seed++, bwd ? -2.0f : 0.0f, 2.0f);
        Tensor probs_g = probs.to(kGpu);
        TwOut want = tw_outputs(b.cpu, c.H, cfg.out, Device::cpu(), transposed);
        TwOut got = tw_outputs(b.gpu, c.H, cfg.out, kGpu, transposed);
        if (bwd) {
          unpermute_backward_quantize(x, b.cpu, with_probs ? TensorView(probs) : TensorView{},
                                      want.y, want.s, want.t, cfg);
          unpermute_backward_quantize(x.to(kGpu), b.gpu,
                                      with_probs ? TensorView(probs_g) : TensorView{}, got.y, got.s,
                                      got.t, cfg);
        } else {
          const PermuteExtras ec =
              with_probs ? PermuteExtras{probs, want.pp, {}, {}} : PermuteExtras{};
          const PermuteExtras eg =
              with_probs ? PermuteExtras{probs_g, got.pp, {}, {}} : PermuteExtras{};
          permute_quantize(x, b.cpu, want.y, want.s, want.t, cfg, ec);
          permute_quantize(x.to(kGpu), b.gpu, got.y, got.s, got.t, cfg, eg);
        }
        MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
        expect_tw_equal(got, want, with_probs && !bwd);
        if (with_probs && !bwd)
          expect_tail_poisoned(got.pp.to(Device::cpu()), plan_status(b.cpu).total_rows);
      }
    }
  }
}

TEST_F(GpuPermuteQuantize, TensorwiseStridedRows) {
  const Case c{300, 4, 16, 1024, 16};
  Built b = build_both(random_topk(c.T, c.K, c.E, 91), PlanConfig{c.E, c.align, -1});
  const int64_t stride = 1032;
  Tensor xbuf = make_tensor({c.T + 1, stride}, DType::kBFloat16);
  fill_random(xbuf, 92, -3.0f, 3.0f);
  Tensor xbuf_g = xbuf.to(kGpu);
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kTensorwise};
  for (int64_t offset : {0, 1}) {  // 16-byte aligned rows, then not
    SCOPED_TRACE(offset);
    auto elem = [&](const Tensor& t) { return static_cast<uint8_t*>(t.data()) + offset * 2; };
    auto x_c =
        TensorView::strided(elem(xbuf), DType::kBFloat16, Device::cpu(), {c.T, c.H}, {stride, 1});
    auto x_g = TensorView::strided(elem(xbuf_g), DType::kBFloat16, kGpu, {c.T, c.H}, {stride, 1});
    for (bool bwd : {false, true}) {
      TwOut want = tw_outputs(b.cpu, c.H, cfg.out, Device::cpu(), true);
      TwOut got = tw_outputs(b.gpu, c.H, cfg.out, kGpu, true);
      if (bwd) {
        unpermute_backward_quantize(x_c, b.cpu, {}, want.y, want.s, want.t, cfg);
        unpermute_backward_quantize(x_g, b.gpu, {}, got.y, got.s, got.t, cfg);
      } else {
        permute_quantize(x_c, b.cpu, want.y, want.s, want.t, cfg);
        permute_quantize(x_g, b.gpu, got.y, got.s, got.t, cfg);
      }
      MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
      expect_tw_equal(got, want, false);
    }
  }
}

TEST_F(GpuPermuteQuantize, TensorwiseGraphCaptureReplayWithNewRoutings) {
  const Case c{1500, 8, 64, 2048, 16};
  const PlanConfig cfg{c.E, c.align, -1};
  const QuantizeConfig qcfg{DType::kFloat8E4M3, QuantScaling::kTensorwise};
  cudaStream_t stream;
  MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RoutingPlan plan = allocate_plan(c.T, c.K, cfg, kGpu);
  Tensor ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(c.T, c.K, cfg))},
                            DType::kUInt8, kGpu);
  Tensor ids_g = Tensor::empty({c.T, c.K}, DType::kInt32, kGpu);
  Tensor x_g = Tensor::empty({c.T, c.H}, DType::kBFloat16, kGpu);
  Tensor probs_g = Tensor::empty({c.T, c.K}, DType::kFloat32, kGpu);
  TwOut fwd = tw_outputs(plan, c.H, qcfg.out, kGpu, true);
  TwOut bwd = tw_outputs(plan, c.H, qcfg.out, kGpu, true);
  auto enqueue = [&] {
    build_plan(ids_g, plan, ws, stream);
    permute_quantize(x_g, plan, fwd.y, fwd.s, fwd.t, qcfg, PermuteExtras{probs_g, fwd.pp, {}, {}},
                     stream);
    unpermute_backward_quantize(x_g, plan, probs_g, bwd.y, bwd.s, bwd.t, qcfg, stream);
  };
  copy(random_topk(c.T, c.K, c.E, 1), ids_g, stream);
  enqueue();  // warm-up outside the capture (module load)
  MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue();
  MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE(replay);
    Tensor ids = random_topk(c.T, c.K, c.E, 800 + replay, replay * 1.0, 0.05);
    Tensor x = make_tensor({c.T, c.H}, DType::kBFloat16);
    fill_random(x, 900 + replay, -5.0f, 5.0f);
    Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
    fill_random(probs, 1000 + replay, 0.0f, 1.0f);
    copy(ids, ids_g, stream);
    copy(x, x_g, stream);
    copy(probs, probs_g, stream);
    for (const TwOut* o : {&fwd, &bwd})
      for (const Tensor* t : {&o->y, &o->s, &o->t, &o->pp}) fill_bytes(*t, 0xFF, stream);
    MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
    RoutingPlan cpu_plan = allocate_plan(c.T, c.K, cfg, Device::cpu());
    build_plan(ids, cpu_plan);
    TwOut want_f = tw_outputs(cpu_plan, c.H, qcfg.out, Device::cpu(), true);
    TwOut want_b = tw_outputs(cpu_plan, c.H, qcfg.out, Device::cpu(), true);
    permute_quantize(x, cpu_plan, want_f.y, want_f.s, want_f.t, qcfg,
                     PermuteExtras{probs, want_f.pp, {}, {}});
    unpermute_backward_quantize(x, cpu_plan, probs, want_b.y, want_b.s, want_b.t, qcfg);
    expect_tw_equal(fwd, want_f, true);
    expect_tw_equal(bwd, want_b, false);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace moeflow::test
