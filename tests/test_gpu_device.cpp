// Multi-GPU test (label multigpu): the public ops run on the device of their
// tensors and leave the caller's current device as it was (a PyTorch
// process keeps its own current device; an op on another GPU's tensors
// must not move it). The results match the CPU reference.
#include <cuda_runtime.h>

#include "test_util.h"

namespace moeflow::test {
namespace {

int current_device() {
  int d = -1;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

TEST(MultiGpuDevice, OpsOnAnotherGpuLeaveTheCurrentDevice) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  const Device other = Device::cuda(1);
  MOEFLOW_CUDA_CHECK(cudaSetDevice(0));
  // allocation on the other GPU
  Tensor x_host = make_tensor({2, 256, 384}, DType::kBFloat16);
  fill_random(x_host, 3);
  Tensor x = x_host.to(other);
  EXPECT_EQ(current_device(), 0) << "Tensor::to(cuda:1)";
  const QuantizeConfig blocks{DType::kFloat8E4M3, QuantScaling::kBlock128x128, false, false};
  Tensor q = poisoned({2, 256, 384}, DType::kFloat8E4M3, other);
  Tensor s = poisoned({2, 2, 3}, DType::kFloat32, other);
  Tensor qt = poisoned({2, 384, 256}, DType::kFloat8E4M3, other);
  Tensor st = poisoned({2, 3, 2}, DType::kFloat32, other);
  quantize_rowwise_columnwise(x, blocks, q, s, qt, st);
  EXPECT_EQ(current_device(), 0) << "quantize_rowwise_columnwise on cuda:1";
  const TensorView rows(x.data(), DType::kBFloat16, other, {512, 384});
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, false};
  Tensor q1 = poisoned({512, 384}, DType::kFloat8E4M3, other);
  Tensor s1 = poisoned({512, 3}, DType::kFloat32, other);
  quantize(rows, cfg, q1, s1);
  EXPECT_EQ(current_device(), 0) << "quantize on cuda:1";
  Tensor back = poisoned({512, 384}, DType::kFloat32, other);
  dequantize(q1, s1, cfg, back);
  EXPECT_EQ(current_device(), 0) << "dequantize on cuda:1";
  MOEFLOW_CUDA_CHECK(cudaSetDevice(1));
  MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  MOEFLOW_CUDA_CHECK(cudaSetDevice(0));
  // the work ran on cuda:1, as the CPU reference computes it
  Tensor wq = poisoned({2, 256, 384}, DType::kFloat8E4M3),
         ws = poisoned({2, 2, 3}, DType::kFloat32);
  Tensor wqt = poisoned({2, 384, 256}, DType::kFloat8E4M3),
         wst = poisoned({2, 3, 2}, DType::kFloat32);
  quantize_rowwise_columnwise(x_host, blocks, wq, ws, wqt, wst);
  EXPECT_TRUE(bytes_equal(q.to(Device::cpu()), wq));
  EXPECT_TRUE(bytes_equal(qt.to(Device::cpu()), wqt));
  EXPECT_TRUE(bytes_equal(st.to(Device::cpu()), wst));
  Tensor wq1 = poisoned({512, 384}, DType::kFloat8E4M3), ws1 = poisoned({512, 3}, DType::kFloat32);
  quantize(TensorView(x_host.data(), DType::kBFloat16, Device::cpu(), {512, 384}), cfg, wq1, ws1);
  Tensor wback = poisoned({512, 384}, DType::kFloat32);
  dequantize(wq1, ws1, cfg, wback);
  EXPECT_TRUE(bytes_equal(back.to(Device::cpu()), wback));
  EXPECT_EQ(current_device(), 0);
}

}  // namespace
}  // namespace moeflow::test
