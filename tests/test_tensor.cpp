// TensorView / Tensor bookkeeping, dtype conversions and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/fill.h"
#include "core/internal.h"
#include "moeflow/moeflow.h"

namespace moeflow {
namespace {

TEST(Tensor, ContiguousViewShapeAndStrides) {
  float buf[24];
  TensorView v(buf, DType::kFloat32, Device::cpu(), {2, 3, 4});
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.stride(0), 12);
  EXPECT_EQ(v.stride(1), 4);
  EXPECT_EQ(v.stride(2), 1);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.str(), "float32 [2,3,4] on cpu");
  EXPECT_THROW(v.size(3), Error);
}

TEST(Tensor, StridedViewIsNotContiguous) {
  uint16_t buf[64];
  auto v = TensorView::strided(buf, DType::kBFloat16, Device::cpu(), {4, 8}, {16, 1});
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_EQ(v.stride(0), 16);
}

TEST(Tensor, UndefinedViewAndEmptyTensor) {
  TensorView none;
  EXPECT_FALSE(none.defined());
  EXPECT_EQ(none.str(), "none");
  Tensor empty = Tensor::empty({0, 7}, DType::kBFloat16);
  EXPECT_TRUE(empty.defined());
  EXPECT_EQ(empty.numel(), 0);
}

TEST(Tensor, DTypeSizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kFloat8E5M2), 1u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
  EXPECT_EQ(dtype_size(DType::kBool), 1u);
  EXPECT_STREQ(dtype_name(DType::kFloat8E4M3), "float8_e4m3");
  EXPECT_EQ(Device::cuda(1).str(), "cuda:1");
}

TEST(Tensor, CopyAndZeros) {
  Tensor a = Tensor::empty({3, 5}, DType::kInt32);
  for (int i = 0; i < 15; ++i) a.data_ptr<int32_t>()[i] = i * 7;
  Tensor b = a.to(Device::cpu());
  for (int i = 0; i < 15; ++i) EXPECT_EQ(b.data_ptr<int32_t>()[i], i * 7);
  Tensor z = Tensor::zeros({4}, DType::kFloat32);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(z.data_ptr<float>()[i], 0.0f);
  Tensor wrong = Tensor::empty({5, 3}, DType::kInt32);
  EXPECT_THROW(copy(a, wrong), Error);
}

TEST(DType, Bf16RoundsToNearestEven) {
  using detail::bf16_to_float;
  using detail::float_to_bf16;
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1+2^-7: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 and 1+2^-6: ties to even (1+2^-6).
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_EQ(bf16_to_float(0xC000), -2.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
}

TEST(DType, HalfRoundTripsAndRounds) {
  using detail::float_to_half;
  using detail::half_to_float;
  EXPECT_EQ(float_to_half(1.0f), 0x3C00);
  EXPECT_EQ(float_to_half(-2.0f), 0xC000);
  EXPECT_EQ(float_to_half(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_half(65520.0f), 0x7C00);                      // rounds to inf
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000);         // tie to even: 0
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie to even
  for (uint32_t h = 0; h < 0x7C00; ++h)  // every finite positive half round-trips
    ASSERT_EQ(float_to_half(half_to_float(static_cast<uint16_t>(h))), h) << h;
}

TEST(FillUniform, InRangeDeterministicAndRoundedOnce) {
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    Tensor a = Tensor::empty({257, 33}, dt, Device::cpu());
    Tensor b = Tensor::empty({257, 33}, dt, Device::cpu());
    Tensor c = Tensor::empty({257, 33}, dt, Device::cpu());
    fill_uniform(a, 7, -0.5f, 0.25f);
    fill_uniform(b, 7, -0.5f, 0.25f);
    fill_uniform(c, 8, -0.5f, 0.25f);
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.view().nbytes()), 0) << dtype_name(dt);
    EXPECT_NE(std::memcmp(a.data(), c.data(), a.view().nbytes()), 0) << dtype_name(dt);
    double sum = 0;
    int64_t distinct_signs[2] = {0, 0};
    for (int64_t i = 0; i < a.view().numel(); ++i) {
      const float v = detail::load_float(a.data(), dt, i);
      const float f = detail::uniform_at(7, static_cast<uint64_t>(i), -0.5f, 0.25f);
      ASSERT_GE(f, -0.5f);
      ASSERT_LT(f, 0.25f);
      Tensor one = Tensor::empty({1}, dt, Device::cpu());
      detail::store_float(one.data(), dt, 0, f);
      ASSERT_EQ(v, detail::load_float(one.data(), dt, 0)) << i;  // f rounded once
      sum += v;
      ++distinct_signs[v < 0];
    }
    EXPECT_NEAR(sum / a.view().numel(), -0.125, 0.01) << dtype_name(dt);
    EXPECT_GT(distinct_signs[0], 0);
    EXPECT_GT(distinct_signs[1], 0);
  }
}

TEST(FillUniform, BadArgumentsAreNamed) {
  Tensor i = Tensor::empty({4}, DType::kInt32, Device::cpu());
  Tensor f = Tensor::empty({4}, DType::kFloat32, Device::cpu());
  auto message = [](auto fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message([&] {
              fill_uniform(i, 1, 0.0f, 1.0f);
            }).find("dst must be float32, float16 or bfloat16, got int32"),
            std::string::npos);
  EXPECT_NE(message([&] { fill_uniform(f, 1, 1.0f, 0.0f); }).find("lo must be <= hi"),
            std::string::npos);
}

TEST(Checks, ExpectNamesArgumentExpectedAndActual) {
  uint16_t buf[32];
  TensorView probs(buf, DType::kBFloat16, Device::cpu(), {4, 8});
  try {
    detail::expect(probs, "probs", detail::Expect{{DType::kFloat32}, {4, 8}, Device::cpu()});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("probs must be float32 [4,8] on cpu, got bfloat16 [4,8] on cpu"),
        std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moeflow
