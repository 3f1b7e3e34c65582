// requantize_columnwise on the CPU: the composition it names (dequantize
// into 16-bit rows, then their columnwise codes), bit for bit, and its
// argument errors. The CUDA kernel is checked against both in
// test_gpu_requantize.cpp.
#include "test_requantize_util.h"

namespace moeflow::test {
namespace {

TEST(Requantize, ColumnwiseIsDequantizeThenQuantize) {
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kBlock1x128, true, false};
  for (const DType dt : {DType::kBFloat16, DType::kFloat16}) {
    const CodeRows c = code_rows(200, 264, DType::kFloat8E4M3, 3);
    Tensor q_t = poisoned({264, 200}, DType::kFloat8E4M3, Device::cpu());
    Tensor s_t = poisoned({264, 2}, DType::kFloat32, Device::cpu());
    requantize_columnwise(c.q, c.scales, dt, cfg, q_t, s_t);
    Tensor w_t = poisoned({264, 200}, DType::kFloat8E4M3, Device::cpu());
    Tensor ws_t = poisoned({264, 2}, DType::kFloat32, Device::cpu());
    dequantize_then_columnwise(c.q, c.scales, dt, cfg, w_t, ws_t);
    EXPECT_TRUE(bytes_equal(q_t, w_t)) << dtype_name(dt);
    EXPECT_TRUE(bytes_equal(s_t, ws_t)) << dtype_name(dt);
  }
}

TEST(Requantize, BadInputNamesTheArgument) {
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, false};
  const CodeRows c = code_rows(16, 128, DType::kFloat8E4M3, 4);
  Tensor q_t = make_tensor({128, 16}, DType::kFloat8E4M3),
         s_t = make_tensor({128, 1}, DType::kFloat32);
  EXPECT_NE(message_of([&] {
              requantize_columnwise(c.q, c.scales, DType::kFloat32, cfg, q_t, s_t);
            }).find("dtype (the 16-bit rows' dtype) must be bfloat16 or float16"),
            std::string::npos);
  Tensor bad_t = make_tensor({16, 128}, DType::kFloat8E4M3);
  EXPECT_NE(message_of([&] {
              requantize_columnwise(c.q, c.scales, DType::kBFloat16, cfg, bad_t, s_t);
            }).find("q_t ([K,M])"),
            std::string::npos);
  Tensor s_bad = make_tensor({16, 2}, DType::kFloat32);
  EXPECT_NE(message_of([&] {
              requantize_columnwise(c.q, s_bad, DType::kBFloat16, cfg, q_t, s_t);
            }).find("scales must be"),
            std::string::npos);
  QuantizeConfig col = cfg;
  col.columnwise = true;
  EXPECT_NE(message_of([&] {
              requantize_columnwise(c.q, c.scales, DType::kBFloat16, col, q_t, s_t);
            }).find("columnwise false"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
