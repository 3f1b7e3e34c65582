// The software fp8 conversion every quantize policy rests on: hand values,
// cuda_fp8.h's host conversion (when built with CUDA) over a stride through
// all float32 patterns and every rounding boundary, and the CUDA kernels'
// division by the scale's reciprocal against IEEE division.
#include <cmath>
#include <random>

#include "core/quantize_backend.h"
#include "test_util.h"

#ifdef MOEFLOW_WITH_CUDA
#include <cuda_fp8.h>
#endif

namespace moeflow::test {
namespace {

uint32_t fbits(float f) {
  return quant::bits_of(f);
}

TEST(Quantize, Fp8ConversionMatchesHandValues) {
  using cpu::float_to_fp8;
  // e4m3: 1 = 0x38, 0.5 = 0x30, -1.5 = 0xBC, 448 = 0x7E, min subnormal 2^-9 = 0x01.
  EXPECT_EQ(float_to_fp8(1.0f, true), 0x38);
  EXPECT_EQ(float_to_fp8(0.5f, true), 0x30);
  EXPECT_EQ(float_to_fp8(-1.5f, true), 0xBC);
  EXPECT_EQ(float_to_fp8(448.0f, true), 0x7E);
  EXPECT_EQ(float_to_fp8(0x1p-9f, true), 0x01);
  // ties to even: 17 -> 16 (0x58), 19 -> 20 (0x5A); 2^-10 -> 0, 3*2^-10 -> 2*2^-9
  EXPECT_EQ(float_to_fp8(17.0f, true), 0x58);
  EXPECT_EQ(float_to_fp8(19.0f, true), 0x5A);
  EXPECT_EQ(float_to_fp8(0x1p-10f, true), 0x00);
  EXPECT_EQ(float_to_fp8(-0x1p-10f, true), 0x80);  // sign kept
  EXPECT_EQ(float_to_fp8(0x3p-10f, true), 0x02);
  EXPECT_EQ(float_to_fp8(0x1.1p-10f, true), 0x01);  // just above the tie
  // saturation: 464 is the tie between 448 and (NaN) 480: all -> 448
  EXPECT_EQ(float_to_fp8(464.0f, true), 0x7E);
  EXPECT_EQ(float_to_fp8(500.0f, true), 0x7E);
  EXPECT_EQ(float_to_fp8(-1e30f, true), 0xFE);
  EXPECT_EQ(float_to_fp8(INFINITY, true), 0x7E);
  EXPECT_EQ(float_to_fp8(-INFINITY, true), 0xFE);
  EXPECT_EQ(float_to_fp8(NAN, true), 0x7F);
  EXPECT_EQ(float_to_fp8(-NAN, true), 0x7F);
  // e5m2: 1 = 0x3C, max 57344 = 0x7B, min subnormal 2^-16 = 0x01; 1.125 ties to 1
  EXPECT_EQ(float_to_fp8(1.0f, false), 0x3C);
  EXPECT_EQ(float_to_fp8(1.125f, false), 0x3C);
  EXPECT_EQ(float_to_fp8(1.375f, false), 0x3E);  // tie 1.25|1.5 -> 1.5 (even)
  EXPECT_EQ(float_to_fp8(57344.0f, false), 0x7B);
  EXPECT_EQ(float_to_fp8(61440.0f, false), 0x7B);
  EXPECT_EQ(float_to_fp8(-INFINITY, false), 0xFB);
  EXPECT_EQ(float_to_fp8(0x1p-16f, false), 0x01);
  EXPECT_EQ(float_to_fp8(NAN, false), 0x7F);
  // every finite code round-trips through its value
  for (int c = 0; c < 256; ++c)
    for (bool e4m3 : {true, false}) {
      const float v = quant::fp8_value(static_cast<uint8_t>(c), e4m3);
      if (std::isfinite(v)) EXPECT_EQ(float_to_fp8(v, e4m3), c) << c << " " << e4m3;
    }
  EXPECT_TRUE(std::isnan(quant::fp8_value(0x7F, true)));
  EXPECT_TRUE(std::isnan(quant::fp8_value(0xFF, true)));
  EXPECT_EQ(quant::fp8_value(0x7C, false), INFINITY);
  EXPECT_TRUE(std::isnan(quant::fp8_value(0x7D, false)));
}

#ifdef MOEFLOW_WITH_CUDA
// cuda_fp8.h's host path (the reference semantics of cvt.rn.satfinite).
TEST(Quantize, Fp8ConversionMatchesCudaHostConversion) {
  auto check = [](uint32_t u) {
    const float f = quant::float_of(u);
    for (bool e4m3 : {true, false}) {
      const uint8_t want = static_cast<uint8_t>(
          __nv_cvt_float_to_fp8(f, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2));
      const uint8_t got = cpu::float_to_fp8(f, e4m3);
      if (got != want) {
        ADD_FAILURE() << "bits 0x" << std::hex << u << " e4m3=" << e4m3 << ": got 0x" << int(got)
                      << " want 0x" << int(want);
        return false;
      }
    }
    return true;
  };
  // A stride through all 2^32 patterns, and every pattern whose low mantissa
  // bits sit at or next to a rounding boundary of either format.
  for (uint64_t u = 0; u < (1ull << 32); u += 997)
    if (!check(static_cast<uint32_t>(u))) return;
  for (uint32_t hi = 0; hi < (1u << 16); ++hi)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu})
      if (!check((hi << 16) | lo)) return;
  for (uint32_t hi = 0; hi < (1u << 12); ++hi)  // e5m2/e4m3 ties sit at bits 20/19
    for (uint32_t lo = 0; lo < (1u << 8); ++lo)
      if (!check((hi << 20) | (lo << 12) | 0x0800u) || !check((hi << 20) | (lo << 12))) return;
}
#endif

// quant::div_by_reciprocal (the CUDA kernels' division) against IEEE
// division: bit for bit where it promises (quotients >= 2^-18, scales from
// 2^-80 up), the same fp8 codes below; divisors with hard significands
// (all ones, one ulp off a power of two) and random ones; signed zeros.
TEST(Quantize, ReciprocalDivisionIsCorrectlyRounded) {
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<uint32_t> man(0, (1u << 23) - 1);
  int64_t checked = 0, tiny = 0;
  auto check = [&](float x, float s) {
    const float got = quant::div_by_reciprocal(x, s, 1.0f / s), want = x / s;
    if (std::fabs(want) >= 0x1p-18f) {
      ASSERT_EQ(fbits(got), fbits(want)) << std::hexfloat << x << " / " << s;
      ++checked;
    } else {
      for (bool e4m3 : {true, false})
        ASSERT_EQ(cpu::float_to_fp8(got, e4m3), cpu::float_to_fp8(want, e4m3))
            << std::hexfloat << x << " / " << s;
      ++tiny;
    }
  };
  const uint32_t hard[] = {0x7FFFFF, 0x7FFFFE, 0x000001, 0x000000, 0x400001, 0x3FFFFF, 0x555555};
  for (uint32_t hs : hard)
    for (int i = 0; i < 40000; ++i) {
      const int es = static_cast<int>(rng() % 190) - 80;  // s in [2^-80, 2^110)
      const float s = quant::float_of(static_cast<uint32_t>(es + 127) << 23 | hs);
      const int eq = static_cast<int>(rng() % 32) - 22;  // x / s around [2^-22, 2^10)
      const float x = std::ldexp(1.0f + static_cast<float>(man(rng)) * 0x1p-23f, es + eq);
      check(rng() % 2 ? x : -x, s);
    }
  for (int i = 0; i < 1000000; ++i) {
    const int es = static_cast<int>(rng() % 190) - 80;
    const float s = quant::float_of(static_cast<uint32_t>(es + 127) << 23 | man(rng));
    const int eq = static_cast<int>(rng() % 32) - 22;
    const float x = std::ldexp(1.0f + static_cast<float>(man(rng)) * 0x1p-23f, es + eq);
    check(rng() % 2 ? x : -x, s);
  }
  EXPECT_GT(checked, 900000);
  EXPECT_GT(tiny, 50000);
  for (float s : {1.0f, 0x1p-80f, 3.5f, 0x1.fffffep119f}) {
    EXPECT_EQ(fbits(quant::div_by_reciprocal(0.0f, s, 1.0f / s)), 0u);
    EXPECT_EQ(fbits(quant::div_by_reciprocal(-0.0f, s, 1.0f / s)), 0x80000000u);
  }
}

}  // namespace
}  // namespace moeflow::test
