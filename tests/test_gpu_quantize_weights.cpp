// GPU tests of quantize_rowwise_columnwise with 128x128 blocks (label gpu):
// the CUDA backend against the CPU reference, bitwise (codes both ways and
// both scale grids), on the vector kernel (16-byte rows: whole and partial
// edge blocks, 16-byte and odd q_t rows) and the fallback (rows not 16-byte
// aligned), every input dtype, both fp8 formats, pow2 on and off, with and
// without the rowwise output, NaN / inf / zero blocks. Outputs poisoned; the
// gaps of strided rows must stay as they were. Also graph capture + replay.
#include <cuda_runtime.h>

#include <cmath>

#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);

class GpuQuantizeWeights : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device"; }
};

TensorView rows3(const Tensor& t, int64_t G, int64_t rows, int64_t cols) {
  return TensorView::strided(t.data(), t.dtype(), t.device(), {G, rows, cols},
                             {rows * t.size(2), t.size(2), 1});
}

struct Case {
  int64_t G, M, K, x_pad, q_pad;
};

TEST_F(GpuQuantizeWeights, BothWaysMatchesCpuBitwise) {
  const std::vector<Case> cases = {
      {3, 256, 384, 0, 0},   // whole blocks, 16-byte rows everywhere
      {2, 384, 200, 8, 16},  // partial column blocks, strided rows
      {2, 130, 264, 0, 4},   // partial row blocks; q_t's rows not 16-byte aligned (and q's
                             // not 8-byte: rowwise, the fallback)
      {2, 130, 264, 0, 14},  // q_t's rows 16-byte aligned with a partial last row block
                             // (W^T alone: the vector kernel's short stores)
      {1, 136, 136, 0, 0},   // partial blocks both ways
      {2, 130, 201, 0, 0},   // K odd: the fallback
      {2, 64, 128, 1, 0},    // x's rows not 16-byte aligned: the fallback
      {1, 1, 8, 0, 0}};
  uint32_t seed = 11;
  for (const Case& c : cases)
    for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2})
        for (bool pow2 : {false, true})
          for (bool rowwise : {true, false}) {
            SCOPED_TRACE(std::to_string(c.G) + "x" + std::to_string(c.M) + "x" +
                         std::to_string(c.K) + " " + dtype_name(dt) + " " + dtype_name(out) +
                         " pow2 " + std::to_string(pow2) + " rowwise " + std::to_string(rowwise));
            const int64_t G = c.G, M = c.M, K = c.K, nbm = blocks128(M), nbk = blocks128(K);
            Tensor x = fp8_weights(G, M, K, K + c.x_pad, dt, seed++);
            const QuantizeConfig cfg{out, QuantScaling::kBlock128x128, pow2, false};
            Tensor want[4], got[4];
            for (int side = 0; side < 2; ++side) {
              const Device dev = side == 0 ? Device::cpu() : kGpu;
              Tensor* o = side == 0 ? want : got;
              o[0] = poisoned({G, M, K + c.q_pad}, out, dev);
              o[1] = poisoned({G, nbm, nbk}, DType::kFloat32, dev);
              o[2] = poisoned({G, K, M + c.q_pad}, out, dev);
              o[3] = poisoned({G, nbk, nbm}, DType::kFloat32, dev);
              const Tensor xs = side == 0 ? x : x.to(kGpu);
              quantize_rowwise_columnwise(
                  rows3(xs, G, M, K), cfg, rowwise ? rows3(o[0], G, M, K) : TensorView{},
                  rowwise ? TensorView(o[1]) : TensorView{}, rows3(o[2], G, K, M), o[3]);
            }
            MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
            // poisoned gaps and unwritten outputs compare equal byte for byte
            for (int i = 0; i < 4; ++i)
              ASSERT_TRUE(bytes_equal(got[i].to(Device::cpu()), want[i])) << i;
          }
}

// The weights' codes both ways in a CUDA graph: replays follow new weights.
TEST_F(GpuQuantizeWeights, GraphCaptureReplay) {
  const int64_t G = 2, M = 256, K = 384;
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kBlock128x128, false, false};
  Tensor x = fp8_weights(G, M, K, K, DType::kBFloat16, 5).to(kGpu);
  Tensor q = poisoned({G, M, K}, DType::kFloat8E4M3, kGpu);
  Tensor s = poisoned({G, 2, 3}, DType::kFloat32, kGpu);
  Tensor qt = poisoned({G, K, M}, DType::kFloat8E4M3, kGpu);
  Tensor st = poisoned({G, 3, 2}, DType::kFloat32, kGpu);
  cudaStream_t stream;
  MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  quantize_rowwise_columnwise(x, cfg, q, s, qt, st, stream);
  MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint32_t seed : {21u, 22u}) {
    Tensor host = fp8_weights(G, M, K, K, DType::kBFloat16, seed);
    MOEFLOW_CUDA_CHECK(cudaMemcpy(x.data(), host.data(), host.nbytes(), cudaMemcpyHostToDevice));
    MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
    Tensor wq = poisoned({G, M, K}, DType::kFloat8E4M3), ws = poisoned({G, 2, 3}, DType::kFloat32);
    Tensor wqt = poisoned({G, K, M}, DType::kFloat8E4M3);
    Tensor wst = poisoned({G, 3, 2}, DType::kFloat32);
    quantize_rowwise_columnwise(host, cfg, wq, ws, wqt, wst);
    ASSERT_TRUE(bytes_equal(q.to(Device::cpu()), wq)) << seed;
    ASSERT_TRUE(bytes_equal(s.to(Device::cpu()), ws)) << seed;
    ASSERT_TRUE(bytes_equal(qt.to(Device::cpu()), wqt)) << seed;
    ASSERT_TRUE(bytes_equal(st.to(Device::cpu()), wst)) << seed;
  }
  MOEFLOW_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOEFLOW_CUDA_CHECK(cudaGraphDestroy(graph));
  MOEFLOW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace moeflow::test
