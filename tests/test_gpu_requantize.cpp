// requantize_columnwise on the GPU (label gpu): the columnwise 1x128 codes
// of FP8 rows, bit for bit the GPU's composition (dequantize into 16-bit
// rows, then quantize_rowwise_columnwise of them) and the CPU's: e4m3 and
// e5m2 codes in and out, bf16 and fp16 rows, power-of-two scales, NaN codes,
// zero rows, partial tiles (M, K not multiples of 128), both kernels (the
// 128 x 128 tile where q_t's rows are 16-byte aligned, M = 512 and 256; the
// per-block one for M = 300, 129, 1), the scales written transposed
// (strided) or contiguous, outputs poisoned first.
#include <cuda_runtime.h>

#include "gpu_util.h"
#include "test_requantize_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);

TEST(GpuRequantize, ColumnwiseIsDequantizeThenQuantize) {
  ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device";
  struct Case {
    int64_t M, K;
    DType in, out, rows;
    bool pow2, strided_scales;
  };
  const Case cases[] = {
      {300, 256, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kBFloat16, false, true},
      {129, 136, DType::kFloat8E5M2, DType::kFloat8E4M3, DType::kFloat16, true, false},
      {1, 8, DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kBFloat16, false, false},
      {512, 384, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kBFloat16, true, true},
      {256, 264, DType::kFloat8E5M2, DType::kFloat8E5M2, DType::kFloat16, false, false},
      {0, 128, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kBFloat16, false, false}};
  uint32_t seed = 10;
  for (const Case& k : cases) {
    SCOPED_TRACE("M=" + std::to_string(k.M) + " K=" + std::to_string(k.K) + " " + dtype_name(k.in) +
                 " -> " + dtype_name(k.out) + " via " + dtype_name(k.rows));
    const QuantizeConfig cfg{k.out, QuantScaling::kBlock1x128, k.pow2, false};
    const CodeRows c = code_rows(k.M, k.K, k.in, seed++);
    const Tensor q = c.q.to(kGpu), s = c.scales.to(kGpu);
    const int64_t nb = blocks128(k.M);
    // scales_t as [K, nb] or as the transpose of a contiguous [nb, K]
    const auto scales_t = [&](Device d) {
      return k.strided_scales ? poisoned({nb, k.K}, DType::kFloat32, d)
                              : poisoned({k.K, nb}, DType::kFloat32, d);
    };
    const auto view = [&](const Tensor& t) {
      return k.strided_scales
                 ? TensorView::strided(t.data(), DType::kFloat32, t.device(), {k.K, nb}, {1, k.K})
                 : TensorView(t);
    };
    Tensor got = poisoned({k.K, k.M}, k.out, kGpu), got_s = scales_t(kGpu);
    requantize_columnwise(q, s, k.rows, cfg, got, view(got_s));
    Tensor want = poisoned({k.K, k.M}, k.out, kGpu), want_s = scales_t(kGpu);
    Tensor rows = Tensor::empty({k.M, k.K}, k.rows, kGpu);
    QuantizeConfig codes = cfg;
    codes.out = k.in;
    dequantize(q, s, codes, rows);
    quantize_rowwise_columnwise(rows, cfg, TensorView{}, TensorView{}, want, view(want_s));
    Tensor cpu = poisoned({k.K, k.M}, k.out, Device::cpu()), cpu_s = scales_t(Device::cpu());
    requantize_columnwise(c.q, c.scales, k.rows, cfg, cpu, view(cpu_s));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Tensor g = got.to(Device::cpu()), gs = got_s.to(Device::cpu());
    EXPECT_TRUE(bytes_equal(g, want.to(Device::cpu()))) << "q_t against the GPU composition";
    EXPECT_TRUE(bytes_equal(gs, want_s.to(Device::cpu())))
        << "scales_t against the GPU composition";
    EXPECT_TRUE(bytes_equal(g, cpu)) << "q_t against the CPU";
    EXPECT_TRUE(bytes_equal(gs, cpu_s)) << "scales_t against the CPU";
    if (k.M >= 128) EXPECT_FALSE(row_is(g, 0, 0)) << "codes were written";
  }
}

}  // namespace
}  // namespace moeflow::test
