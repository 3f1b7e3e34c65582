// Shared by the requantize_columnwise tests (CPU and GPU): FP8 rows as codes
// (random codes, NaN codes, an all-zero row) with 1x128 scales (random
// magnitudes, a subnormal-range row), and the composition the op replaces.
#pragma once

#include <random>

#include "moeflow/quantize.h"
#include "test_util.h"

namespace moeflow::test {

struct CodeRows {
  Tensor q, scales;  // CPU: [M, K] fp8, [M, ceil(K/128)] float32
};

inline CodeRows code_rows(int64_t M, int64_t K, DType fmt, uint32_t seed) {
  std::mt19937 rng(seed);
  CodeRows c{make_tensor({M, K}, fmt), make_tensor({M, blocks128(K)}, DType::kFloat32)};
  auto* q = static_cast<uint8_t*>(c.q.data());
  const uint8_t nan = fmt == DType::kFloat8E4M3 ? 0x7F : 0x7E;
  for (int64_t i = 0; i < M * K; ++i) {
    uint8_t b = static_cast<uint8_t>(rng());
    if (fmt == DType::kFloat8E5M2 && (b & 0x7C) == 0x7C) b &= 0xF3;  // finite unless chosen
    if (i % 997 == 5) b = nan;
    if ((i / K) % 7 == 2) b = 0;  // an all-zero row
    q[i] = b;
  }
  auto* s = c.scales.data_ptr<float>();
  for (int64_t i = 0; i < c.scales.numel(); ++i) {
    const int64_t row = i / c.scales.size(1);
    const int e = row % 5 == 3 ? -130 : static_cast<int>(rng() % 41) - 20;
    s[i] = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f, e);
  }
  return c;
}

// dequantize into dtype rows, then their columnwise codes (on q's device).
inline void dequantize_then_columnwise(const Tensor& q, const Tensor& scales, DType dtype,
                                       const QuantizeConfig& config, const Tensor& q_t,
                                       const Tensor& scales_t) {
  Tensor rows = Tensor::empty({q.size(0), q.size(1)}, dtype, q.device());
  QuantizeConfig codes = config;
  codes.out = q.dtype();
  dequantize(q, scales, codes, rows);
  quantize_rowwise_columnwise(rows, config, TensorView{}, TensorView{}, q_t, scales_t);
}

}  // namespace moeflow::test
