// CPU FP8 quantize/dequantize tests: hand-worked scales and codes (ties to
// even, saturation, NaN/inf, zero blocks, pow2 and subnormal scales),
// partial edge blocks against a naive formula, strided rows, columnwise ==
// rowwise of x^T, round-trip error bounds, exact round trips, dequantize
// rounding once, rows_used counts, bad input; transpose_codes against
// columnwise quantization. The fp8 conversion itself: test_fp8_conversion.cpp.
#include <cmath>
#include <cstring>
#include <map>

#include "core/quantize_backend.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

constexpr DType kE4 = DType::kFloat8E4M3;
constexpr DType kE5 = DType::kFloat8E5M2;
const QuantScaling kScalings[] = {QuantScaling::kTensorwise, QuantScaling::kBlock1x128,
                                  QuantScaling::kBlock128x128};

Tensor from_floats(int64_t M, int64_t K, const std::vector<float>& v,
                   DType dtype = DType::kFloat32) {
  Tensor x = make_tensor({M, K}, dtype);
  for (int64_t i = 0; i < M * K; ++i) detail::store_float(x.data(), dtype, i, v[i]);
  return x;
}

struct Quantized {
  Tensor q, scales;
};

Quantized run(TensorView x, const QuantizeConfig& cfg) {
  const int64_t M = x.shape[0], K = x.shape[1];
  const int64_t R = cfg.columnwise ? K : M, C = cfg.columnwise ? M : K;
  Quantized r{poisoned({R, C}, cfg.out),
              poisoned(scales_shape(R, C, cfg.scaling), DType::kFloat32)};
  quantize(x, cfg, r.q, r.scales);
  return r;
}

uint8_t code(const Tensor& q, int64_t i) {
  return q.data_ptr<uint8_t>()[i];
}
uint32_t fbits(float f) {
  return quant::bits_of(f);
}

TEST(Quantize, Block1x128HandWorked) {
  // Row 0: amax 896 -> scale 2; row 1: zeros -> scale 1; row 2: only NaN/inf
  // -> scale 1; row 3: amax 448 with inf/NaN beside it -> scale 1.
  const int64_t K = 128;
  std::vector<float> v(4 * K, 0.0f);
  v[0] = 896.0f;
  v[1] = 1.0f;
  v[2] = -3.0f;
  v[3] = 34.0f;  // 17 after division: ties to 16
  v[4] = 38.0f;  // 19: ties to 20
  v[2 * K + 0] = NAN;
  v[2 * K + 1] = INFINITY;
  v[2 * K + 2] = -INFINITY;
  v[3 * K + 0] = -448.0f;
  v[3 * K + 1] = INFINITY;
  v[3 * K + 2] = NAN;
  v[3 * K + 3] = -INFINITY;
  v[3 * K + 4] = 0x1p-10f;
  Tensor x = from_floats(4, K, v);
  Quantized r = run(x, QuantizeConfig{kE4, QuantScaling::kBlock1x128, false, false});
  const float* s = r.scales.data_ptr<float>();
  EXPECT_EQ(s[0], 2.0f);
  EXPECT_EQ(s[1], 1.0f);
  EXPECT_EQ(s[2], 1.0f);
  EXPECT_EQ(s[3], 1.0f);
  EXPECT_EQ(code(r.q, 0), 0x7E);
  EXPECT_EQ(code(r.q, 1), 0x30);
  EXPECT_EQ(code(r.q, 2), 0xBC);
  EXPECT_EQ(code(r.q, 3), 0x58);
  EXPECT_EQ(code(r.q, 4), 0x5A);
  for (int64_t i = 5; i < 2 * K; ++i) ASSERT_EQ(code(r.q, i), 0) << i;
  EXPECT_EQ(code(r.q, 2 * K + 0), 0x7F);
  EXPECT_EQ(code(r.q, 2 * K + 1), 0x7E);
  EXPECT_EQ(code(r.q, 2 * K + 2), 0xFE);
  EXPECT_EQ(code(r.q, 3 * K + 0), 0xFE);
  EXPECT_EQ(code(r.q, 3 * K + 1), 0x7E);
  EXPECT_EQ(code(r.q, 3 * K + 2), 0x7F);
  EXPECT_EQ(code(r.q, 3 * K + 3), 0xFE);
  EXPECT_EQ(code(r.q, 3 * K + 4), 0x00);  // half the smallest subnormal: tie to 0

  // Non-power-of-two scale: amax 1 -> 1/448 (IEEE); 1 / (1/448) rounds to 448.
  std::vector<float> w(K, 0.25f);
  w[7] = -1.0f;
  Quantized r2 =
      run(from_floats(1, K, w), QuantizeConfig{kE4, QuantScaling::kBlock1x128, false, false});
  const volatile float d448 = 448.0f;
  const float s_want = 1.0f / d448;
  EXPECT_EQ(fbits(r2.scales.data_ptr<float>()[0]), fbits(s_want));
  EXPECT_EQ(code(r2.q, 7), cpu::float_to_fp8(-1.0f / s_want, true));
  EXPECT_EQ(code(r2.q, 0), cpu::float_to_fp8(0.25f / s_want, true));
}

TEST(Quantize, Pow2AndSubnormalScales) {
  auto scale_for = [](float amax, DType out, bool pow2) {
    std::vector<float> v(128, 0.0f);
    v[5] = -amax;
    Quantized r =
        run(from_floats(1, 128, v), QuantizeConfig{out, QuantScaling::kBlock1x128, pow2, false});
    return r.scales.data_ptr<float>()[0];
  };
  EXPECT_EQ(scale_for(896.0f, kE4, true), 2.0f);  // exact power of two stays
  EXPECT_EQ(scale_for(900.0f, kE4, true), 4.0f);
  EXPECT_EQ(scale_for(1.0f, kE4, true), 0x1p-8f);  // 1/448 in (2^-9, 2^-8]
  EXPECT_EQ(scale_for(57344.0f, kE5, true), 1.0f);
  EXPECT_EQ(scale_for(57345.0f, kE5, true), 2.0f);
  EXPECT_EQ(scale_for(0.0f, kE4, true), 1.0f);
  // 2^-130 / 448 is subnormal (1170 * 2^-149); the next power of two is 2^-138.
  const volatile float d448 = 448.0f;
  EXPECT_EQ(fbits(scale_for(0x1p-130f, kE4, false)), fbits(0x1p-130f / d448));
  EXPECT_EQ(fbits(scale_for(0x1p-130f, kE4, false)), 1170u);
  EXPECT_EQ(scale_for(0x1p-130f, kE4, true), 0x1p-138f);
  // 2^-149 / 448 underflows to 0: the scale is clamped to 2^-149.
  EXPECT_EQ(fbits(scale_for(0x1p-149f, kE4, false)), 1u);
  EXPECT_EQ(fbits(scale_for(0x1p-149f, kE4, true)), 1u);
  // Around the largest float: FLT_MAX / 448, rounded up to 2^120.
  EXPECT_EQ(scale_for(3.4028235e38f, kE4, true), 0x1p120f);
}

// Naive reference: amax over the finite elements present, scale by the
// policy's formula, codes from the software converter.
void expect_matches_naive(const Tensor& x, const QuantizeConfig& cfg, const Quantized& r) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t R = cfg.columnwise ? K : M, C = cfg.columnwise ? M : K;
  const bool e4 = cfg.out == kE4;
  auto xv = [&](int64_t rr, int64_t cc) {
    return cfg.columnwise ? at(x, cc * K + rr) : at(x, rr * C + cc);
  };
  auto block = [&](int64_t rr, int64_t cc) -> std::pair<int64_t, int64_t> {
    if (cfg.scaling == QuantScaling::kTensorwise) return {0, 0};
    if (cfg.scaling == QuantScaling::kBlock1x128) return {rr, cc / 128};
    return {rr / 128, cc / 128};
  };
  std::map<std::pair<int64_t, int64_t>, float> amax;
  for (int64_t rr = 0; rr < R; ++rr)
    for (int64_t cc = 0; cc < C; ++cc) {
      const float a = std::fabs(xv(rr, cc));
      float& m = amax[block(rr, cc)];
      if (std::isfinite(a)) m = std::max(m, a);
    }
  const int64_t nbc = cfg.scaling == QuantScaling::kTensorwise ? 1 : r.scales.size(1);
  for (auto& [b, m] : amax) {
    float s = m > 0 ? m / quant::fp8_max(e4) : 1.0f;
    if (s == 0) s = 0x1p-149f;
    if (cfg.pow2_scales && m > 0) {
      float p = 0x1p-149f;
      while (p < s) p *= 2;
      s = p;
    }
    ASSERT_EQ(fbits(r.scales.data_ptr<float>()[b.first * nbc + b.second]), fbits(s))
        << "block " << b.first << "," << b.second;
  }
  for (int64_t rr = 0; rr < R; ++rr)
    for (int64_t cc = 0; cc < C; ++cc) {
      const auto b = block(rr, cc);
      const float s = r.scales.data_ptr<float>()[b.first * nbc + b.second];
      ASSERT_EQ(code(r.q, rr * C + cc), cpu::float_to_fp8(xv(rr, cc) / s, e4)) << rr << "," << cc;
    }
}

TEST(Quantize, PartialEdgeBlocksAgainstNaive) {
  uint32_t seed = 1;
  for (auto [M, K] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {3, 130}, {129, 257}, {130, 128}, {5, 0}, {0, 7}}) {
    for (QuantScaling sc : kScalings)
      for (DType out : {kE4, kE5})
        for (bool pow2 : {false, true})
          for (bool colw : {false, true}) {
            SCOPED_TRACE(std::to_string(M) + "x" + std::to_string(K) + " scaling " +
                         std::to_string(int(sc)) + " " + dtype_name(out) + " pow2 " +
                         std::to_string(pow2) + " col " + std::to_string(colw));
            Tensor x = make_tensor({M, K}, DType::kFloat32);
            fill_random(x, seed++, -3.0f, 3.0f);
            // a different magnitude per row, so block amaxes differ
            for (int64_t i = 0; i < M * K; ++i)
              x.data_ptr<float>()[i] *= std::ldexp(1.0f, int(i / std::max<int64_t>(K, 1) % 9) - 4);
            if (M * K > 3) x.data_ptr<float>()[M * K / 2] = NAN;
            QuantizeConfig cfg{out, sc, pow2, colw};
            expect_matches_naive(x, cfg, run(x, cfg));
          }
  }
}

TEST(Quantize, ColumnwiseIsRowwiseOfTranspose) {
  const int64_t M = 200, K = 300;
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    Tensor x = make_tensor({M, K}, dt);
    fill_random(x, 7, -5.0f, 5.0f);
    Tensor xt = make_tensor({K, M}, dt);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k)
        detail::store_float(xt.data(), dt, k * M + m, at(x, m * K + k));
    for (QuantScaling sc : kScalings)
      for (bool pow2 : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " scaling " + std::to_string(int(sc)));
        Quantized a = run(x, QuantizeConfig{kE4, sc, pow2, true});
        Quantized b = run(xt, QuantizeConfig{kE4, sc, pow2, false});
        EXPECT_TRUE(bytes_equal(a.q, b.q));
        EXPECT_TRUE(bytes_equal(a.scales, b.scales));
        // dequantize gives back x's layout
        Tensor da = poisoned({M, K}, DType::kFloat32), db = poisoned({K, M}, DType::kFloat32);
        dequantize(a.q, a.scales, QuantizeConfig{kE4, sc, pow2, true}, da);
        dequantize(b.q, b.scales, QuantizeConfig{kE4, sc, pow2, false}, db);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t k = 0; k < K; ++k)
            ASSERT_EQ(fbits(at(da, m * K + k)), fbits(at(db, k * M + m))) << m << "," << k;
      }
  }
}

// quantize_rowwise_columnwise writes exactly quantize's two orientations;
// scales_t may be a strided view (the transpose of a [nb(M), K] buffer).
TEST(Quantize, RowwiseColumnwiseIsBothQuantizes) {
  const int64_t M = 260, K = 136, nbm = 3;
  Tensor x = make_tensor({M, K}, DType::kBFloat16);
  fill_random(x, 11, -3.0f, 3.0f);
  const QuantizeConfig cfg{kE4, QuantScaling::kBlock1x128, false, false};
  Quantized row = run(x, cfg);
  Quantized col = run(x, QuantizeConfig{kE4, QuantScaling::kBlock1x128, false, true});
  Tensor q = poisoned({M, K}, kE4), s = poisoned({M, 2}, DType::kFloat32);
  Tensor qt = poisoned({K, M}, kE4), st = poisoned({nbm, K}, DType::kFloat32);
  quantize_rowwise_columnwise(
      x, cfg, q, s, qt,
      TensorView::strided(st.data(), DType::kFloat32, Device::cpu(), {K, nbm}, {1, K}));
  EXPECT_TRUE(bytes_equal(q, row.q));
  EXPECT_TRUE(bytes_equal(s, row.scales));
  EXPECT_TRUE(bytes_equal(qt, col.q));
  for (int64_t c = 0; c < K; ++c)
    for (int64_t b = 0; b < nbm; ++b)
      ASSERT_EQ(fbits(at(st, b * K + c)), fbits(at(col.scales, c * nbm + b))) << c << "," << b;
  // columnwise only
  Tensor qt2 = poisoned({K, M}, kE4), st2 = poisoned({K, nbm}, DType::kFloat32);
  quantize_rowwise_columnwise(x, cfg, TensorView{}, TensorView{}, qt2, st2);
  EXPECT_TRUE(bytes_equal(qt2, col.q));
  EXPECT_TRUE(bytes_equal(st2, col.scales));
  // bad input names the argument
  QuantizeConfig bad = cfg;
  bad.scaling = QuantScaling::kTensorwise;
  EXPECT_NE(message_of([&] {
              quantize_rowwise_columnwise(x, bad, q, s, qt, st2);
            }).find("config.scaling must be kBlock1x128"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              quantize_rowwise_columnwise(x, cfg, q, s, qt, st);
            }).find("scales_t ([K, ceil(M/128)]) must be float32 [136,3]"),
            std::string::npos);
}

// The dgrad's weight codes: transpose_codes of each matrix's 128x128-block
// codes equals the columnwise quantization of that matrix, and the scales
// are the rowwise ones transposed.
TEST(Quantize, TransposeCodesIsColumnwiseQuantize) {
  const int64_t G = 3, R = 256, C = 200;
  Tensor x = make_tensor({G * R, C}, DType::kBFloat16);
  fill_random(x, 11, -3.0f, 3.0f);
  const QuantizeConfig row{kE4, QuantScaling::kBlock128x128, false, false};
  const QuantizeConfig col{kE4, QuantScaling::kBlock128x128, false, true};
  Quantized a = run(x, row);  // [G*R, C]: R % 128 == 0, so no block spans two matrices
  Tensor qt = poisoned({G, C, R}, kE4);
  transpose_codes(TensorView(a.q.data(), kE4, Device::cpu(), {G, R, C}), qt);
  const int64_t nbr = R / 128, nbc = (C + 127) / 128;
  for (int64_t g = 0; g < G; ++g) {
    TensorView xg(static_cast<uint8_t*>(x.data()) + g * R * C * 2, DType::kBFloat16,
                  Device::cpu(), {R, C});
    Quantized b = run(xg, col);  // [C, R]
    ASSERT_EQ(std::memcmp(b.q.data(), qt.data_ptr<uint8_t>() + g * C * R, C * R), 0) << g;
    for (int64_t i = 0; i < nbc; ++i)
      for (int64_t j = 0; j < nbr; ++j)
        ASSERT_EQ(fbits(b.scales.data_ptr<float>()[i * nbr + j]),
                  fbits(a.scales.data_ptr<float>()[(g * nbr + j) * nbc + i]))
            << g << "," << i << "," << j;
  }
  // [R, C] is one matrix; bad input names the argument.
  Tensor q2 = make_tensor({5, 3}, kE5), q2t = poisoned({3, 5}, kE5);
  for (int i = 0; i < 15; ++i) q2.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(i);
  transpose_codes(q2, q2t);
  for (int r = 0; r < 5; ++r)
    for (int c = 0; c < 3; ++c) ASSERT_EQ(q2t.data_ptr<uint8_t>()[c * 5 + r], r * 3 + c);
  auto msg = [](auto fn) { return message_of(fn); };
  EXPECT_NE(msg([&] { transpose_codes(q2, make_tensor({5, 3}, kE5)); })
                .find("q_t must be float8_e5m2 [3,5]"),
            std::string::npos);
  EXPECT_NE(msg([&] { transpose_codes(q2, make_tensor({3, 5}, kE4)); }).find("q_t must be"),
            std::string::npos);
  EXPECT_NE(msg([&] { transpose_codes(make_tensor({5, 3}, DType::kBFloat16), q2t); })
                .find("q must be float8_e4m3, float8_e5m2 or float32 (scales), got bfloat16"),
            std::string::npos);
  // The scale grids: W^T's scales are W's transposed.
  Tensor st = poisoned({G, nbc, nbr}, DType::kFloat32);
  transpose_codes(TensorView(a.scales.data(), DType::kFloat32, Device::cpu(), {G, nbr, nbc}), st);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nbc; ++i)
      for (int64_t j = 0; j < nbr; ++j)
        ASSERT_EQ(fbits(st.data_ptr<float>()[(g * nbc + i) * nbr + j]),
                  fbits(a.scales.data_ptr<float>()[(g * nbr + j) * nbc + i]));
  EXPECT_NE(msg([&] { transpose_codes(make_tensor({15}, kE5), q2t); }).find("q must be [R,C]"),
            std::string::npos);
  Tensor sq = make_tensor({4, 4}, kE4);
  EXPECT_NE(msg([&] { transpose_codes(sq, sq); }).find("must not overlap"), std::string::npos);
}

TEST(Quantize, StridedRowsMatchContiguous) {
  const int64_t M = 37, K = 250, ld = 260;
  Tensor big = make_tensor({M, ld}, DType::kBFloat16);
  fill_random(big, 3);
  TensorView xs = TensorView::strided(big.data(), DType::kBFloat16, Device::cpu(), {M, K}, {ld, 1});
  Tensor x = make_tensor({M, K}, DType::kBFloat16);
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(x.data_ptr<uint16_t>() + m * K, big.data_ptr<uint16_t>() + m * ld, K * 2);
  for (QuantScaling sc : kScalings)
    for (bool colw : {false, true}) {
      const int64_t R = colw ? K : M, C = colw ? M : K, qld = C + 9;
      QuantizeConfig cfg{kE5, sc, false, colw};
      Quantized want = run(x, cfg);
      Tensor qbig = poisoned({R, qld}, kE5);
      TensorView qs = TensorView::strided(qbig.data(), kE5, Device::cpu(), {R, C}, {qld, 1});
      Tensor scales = poisoned(scales_shape(R, C, sc), DType::kFloat32);
      quantize(xs, cfg, qs, scales);
      EXPECT_TRUE(bytes_equal(scales, want.scales));
      for (int64_t r = 0; r < R; ++r) {
        ASSERT_EQ(
            std::memcmp(qbig.data_ptr<uint8_t>() + r * qld, want.q.data_ptr<uint8_t>() + r * C, C),
            0)
            << r;
        for (int64_t c = C; c < qld; ++c) ASSERT_EQ(qbig.data_ptr<uint8_t>()[r * qld + c], 0xFF);
      }
      // strided dequantize output, gaps untouched
      Tensor obig = poisoned({M, ld}, DType::kBFloat16);
      TensorView os =
          TensorView::strided(obig.data(), DType::kBFloat16, Device::cpu(), {M, K}, {ld, 1});
      Tensor o = poisoned({M, K}, DType::kBFloat16);
      dequantize(qs, scales, cfg, os);
      dequantize(want.q, want.scales, cfg, o);
      for (int64_t m = 0; m < M; ++m) {
        ASSERT_EQ(
            std::memcmp(obig.data_ptr<uint16_t>() + m * ld, o.data_ptr<uint16_t>() + m * K, K * 2),
            0);
        for (int64_t k = K; k < ld; ++k) ASSERT_EQ(obig.data_ptr<uint16_t>()[m * ld + k], 0xFFFF);
      }
    }
}

TEST(Quantize, RoundTripWithinFp8Error) {
  const int64_t M = 150, K = 333;
  Tensor x = make_tensor({M, K}, DType::kFloat32);
  fill_random(x, 11, -1.0f, 1.0f);
  for (int64_t i = 0; i < M * K; ++i) x.data_ptr<float>()[i] *= std::ldexp(1.0f, int(i % 23) - 11);
  for (QuantScaling sc : kScalings)
    for (DType out : {kE4, kE5})
      for (bool pow2 : {false, true})
        for (bool colw : {false, true}) {
          QuantizeConfig cfg{out, sc, pow2, colw};
          Quantized r = run(x, cfg);
          Tensor y = poisoned({M, K}, DType::kFloat32);
          dequantize(r.q, r.scales, cfg, y);
          const double rel = out == kE4 ? 0x1p-4 : 0x1p-3;
          // The bound is relative to the block amax (subnormal codes included).
          const int64_t R = colw ? K : M, C = colw ? M : K;
          std::vector<double> err_ok(M * K);
          for (int64_t rr = 0; rr < R; ++rr)
            for (int64_t cc = 0; cc < C; ++cc) {
              double amax = 0;
              const int64_t r0 = sc == QuantScaling::kBlock128x128
                                     ? rr / 128 * 128
                                     : (sc == QuantScaling::kTensorwise ? 0 : rr);
              const int64_t r1 = sc == QuantScaling::kBlock128x128
                                     ? std::min(R, r0 + 128)
                                     : (sc == QuantScaling::kTensorwise ? R : rr + 1);
              const int64_t c0 = sc == QuantScaling::kTensorwise ? 0 : cc / 128 * 128;
              const int64_t c1 = sc == QuantScaling::kTensorwise ? C : std::min(C, c0 + 128);
              if ((rr == r0 || sc == QuantScaling::kBlock1x128) && cc == c0) {
                for (int64_t a = r0; a < r1; ++a)
                  for (int64_t b = c0; b < c1; ++b) {
                    const int64_t i = colw ? b * K + a : a * K + b;
                    amax = std::max(amax, std::fabs(double(x.data_ptr<float>()[i])));
                  }
                for (int64_t a = r0; a < r1; ++a)
                  for (int64_t b = c0; b < c1; ++b)
                    err_ok[colw ? b * K + a : a * K + b] = rel * amax;
              }
            }
          for (int64_t i = 0; i < M * K; ++i) {
            const double e = std::fabs(double(y.data_ptr<float>()[i]) - x.data_ptr<float>()[i]);
            ASSERT_LE(e, err_ok[i] * (1 + 1e-6))
                << "element " << i << " scaling " << int(sc) << " " << dtype_name(out) << " pow2 "
                << pow2 << " col " << colw;
          }
        }
}

TEST(Quantize, RepresentableValuesRoundTripExactly) {
  // Every finite code times 2^-3 (block amax = fp8_max * 2^-3, so the scale is
  // exactly 2^-3, with or without pow2): q gives the codes back, dequantize the values.
  for (DType out : {kE4, kE5}) {
    const bool e4 = out == kE4;
    std::vector<float> v;
    for (int c = 0; c < 256; ++c) {
      const float f = quant::fp8_value(static_cast<uint8_t>(c), e4);
      if (std::isfinite(f)) v.push_back(f * 0.125f);
    }
    const int64_t K = static_cast<int64_t>(v.size());
    for (QuantScaling sc : kScalings)
      for (bool pow2 : {false, true})
        for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
          QuantizeConfig cfg{out, sc, pow2, false};
          Tensor x = from_floats(1, K, v, dt);
          Quantized r = run(x, cfg);
          for (int64_t b = 0; b < r.scales.numel(); ++b)
            EXPECT_EQ(r.scales.data_ptr<float>()[b], 0.125f);
          Tensor y = poisoned({1, K}, dt);
          dequantize(r.q, r.scales, cfg, y);
          EXPECT_TRUE(bytes_equal(y, x))
              << dtype_name(out) << " " << dtype_name(dt) << " " << int(sc);
        }
  }
}

TEST(Quantize, DequantizeRoundsOnce) {
  // 1.5 * 0x1.0caaaap+0 = 1.57421869...: just below the bf16 tie 1.57421875.
  // Rounded once -> 1.5703125; through float32 first it would become 1.578125.
  auto deq = [](uint8_t c, float s, DType dt) {
    Tensor q = make_tensor({1, 1}, kE4), sc = make_tensor({1}, DType::kFloat32),
           o = make_tensor({1, 1}, dt);
    q.data_ptr<uint8_t>()[0] = c;
    sc.data_ptr<float>()[0] = s;
    dequantize(q, sc, QuantizeConfig{kE4, QuantScaling::kTensorwise, false, false}, o);
    return o;
  };
  EXPECT_EQ(at(deq(0x3C, 0x1.0caaaap+0f, DType::kBFloat16), 0), 1.5703125f);
  EXPECT_EQ(at(deq(0x3E, 0x1.02db6ep+0f, DType::kBFloat16), 0), 1.7734375f);  // 1.75 * s
  EXPECT_EQ(at(deq(0x38, 3.0f, DType::kFloat32), 0), 3.0f);
  EXPECT_EQ(at(deq(0xBC, 0.5f, DType::kFloat16), 0), -0.75f);
  // NaN -> the dtype's canonical NaN; overflow of the output dtype -> inf
  EXPECT_EQ(deq(0x7F, 1.0f, DType::kBFloat16).data_ptr<uint16_t>()[0], 0x7FFF);
  EXPECT_EQ(deq(0xFF, 1.0f, DType::kFloat32).data_ptr<uint32_t>()[0], 0x7FFFFFFFu);
  EXPECT_EQ(deq(0x7F, 1.0f, DType::kFloat16).data_ptr<uint16_t>()[0], 0x7FFF);
  EXPECT_EQ(at(deq(0x7E, 1024.0f, DType::kFloat16), 0), INFINITY);
  EXPECT_EQ(at(deq(0x7E, 3e38f, DType::kFloat32), 0), INFINITY);
  EXPECT_EQ(at(deq(0xFE, 3e38f, DType::kBFloat16), 0), -INFINITY);
}

// dequantize with rows_used: the first n rows as the whole dequantize writes
// them, the rest untouched; n clamped to [0, M]; int32 and int64 counts.
TEST(Quantize, DequantizeRowsUsed) {
  const int64_t M = 300, K = 260;
  Tensor x = make_tensor({M, K}, DType::kFloat32);
  fill_random(x, 5, -3.0f, 3.0f);
  for (QuantScaling sc : kScalings) {
    const QuantizeConfig cfg{kE4, sc, false, false};
    Quantized r = run(x, cfg);
    Tensor full = poisoned({M, K}, DType::kBFloat16);
    dequantize(r.q, r.scales, cfg, full);
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{129}, M - 1, M, M + 7, int64_t{-3}})
      for (DType cd : {DType::kInt32, DType::kInt64}) {
        SCOPED_TRACE("scaling " + std::to_string(int(sc)) + " n " + std::to_string(n) + " " +
                     dtype_name(cd));
        const Tensor count = count_tensor(n, cd);
        Tensor o = poisoned({M, K}, DType::kBFloat16);
        dequantize(r.q, r.scales, cfg, o, count);
        const int64_t used = std::min(M, std::max<int64_t>(n, 0));
        ASSERT_EQ(std::memcmp(o.data_ptr<uint16_t>(), full.data_ptr<uint16_t>(), used * K * 2), 0);
        for (int64_t i = used * K; i < M * K; ++i) ASSERT_EQ(o.data_ptr<uint16_t>()[i], 0xFFFF);
      }
  }
}

// quantize with rows_used (1x128 rowwise): the first n rows' codes and
// scales as the whole quantize writes them, the rest untouched.
TEST(Quantize, QuantizeRowsUsed) {
  const int64_t M = 300, K = 260, nb = 3;
  Tensor x = make_tensor({M, K}, DType::kBFloat16);
  fill_random(x, 9, -3.0f, 3.0f);
  const QuantizeConfig cfg{kE4, QuantScaling::kBlock1x128, false, false};
  Quantized full = run(x, cfg);
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{129}, M, M + 7, int64_t{-3}})
    for (DType cd : {DType::kInt32, DType::kInt64}) {
      SCOPED_TRACE("n " + std::to_string(n) + " " + dtype_name(cd));
      const Tensor count = count_tensor(n, cd);
      Tensor q = poisoned({M, K}, kE4), s = poisoned({M, nb}, DType::kFloat32);
      quantize(x, cfg, q, s, {}, count);
      const int64_t used = std::min(M, std::max<int64_t>(n, 0));
      ASSERT_EQ(std::memcmp(q.data_ptr<uint8_t>(), full.q.data_ptr<uint8_t>(), used * K), 0);
      ASSERT_EQ(std::memcmp(s.data_ptr<float>(), full.scales.data_ptr<float>(), used * nb * 4), 0);
      for (int64_t i = used * K; i < M * K; ++i) ASSERT_EQ(q.data_ptr<uint8_t>()[i], 0xFF);
      for (int64_t i = used * nb * 4; i < M * nb * 4; ++i)
        ASSERT_EQ(reinterpret_cast<const uint8_t*>(s.data_ptr<float>())[i], 0xFF);
    }
}

TEST(Quantize, BadInput) {
  Tensor x = make_tensor({4, 200}, DType::kFloat32);
  fill_random(x, 1);
  Tensor q = make_tensor({4, 200}, kE4), qt = make_tensor({200, 4}, kE4);
  Tensor s = make_tensor({4, 2}, DType::kFloat32);
  const QuantizeConfig cfg{kE4, QuantScaling::kBlock1x128, false, false};
  EXPECT_NO_THROW(quantize(x, cfg, q, s));
  auto msg = [](auto fn) { return message_of(fn); };
  EXPECT_NE(msg([&] {
              quantize(make_tensor({4, 200}, DType::kInt32), cfg, q, s);
            }).find("x must be float32, bfloat16 or float16 [4,200] on cpu, got int32"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              quantize(make_tensor({4, 200, 1}, DType::kFloat32), cfg, q, s);
            }).find("x must be [M,K]"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              quantize(x, cfg, make_tensor({4, 200}, kE5), s);
            }).find("q must be float8_e4m3 [4,200]"),
            std::string::npos)
      << msg([&] {
           quantize(x, cfg, make_tensor({4, 200}, kE5), s);
         });
  EXPECT_NE(msg([&] {
              quantize(x, QuantizeConfig{kE4, QuantScaling::kBlock1x128, false, true}, q, s);
            }).find("q (columnwise: [K,M]) must be"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              quantize(x, cfg, q, make_tensor({4, 1}, DType::kFloat32));
            }).find("scales must be float32 [4,2]"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              quantize(x, QuantizeConfig{kE4, QuantScaling::kBlock128x128, false, false}, q, s);
            }).find("scales must be float32 [1,2]"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              quantize(x, QuantizeConfig{kE4, QuantScaling::kTensorwise, false, true}, qt, s);
            }).find("scales must be float32 [1]"),
            std::string::npos);
  EXPECT_NE(
      msg([&] { quantize(x, QuantizeConfig{DType::kBFloat16}, q, s); }).find("QuantizeConfig.out"),
      std::string::npos);
  EXPECT_NE(msg([&] {
              quantize(x, QuantizeConfig{kE4, static_cast<QuantScaling>(7)}, q, s);
            }).find("QuantizeConfig.scaling"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              quantize(x, cfg, q, make_tensor({4, 2}, DType::kFloat16));
            }).find("scales must be float32"),
            std::string::npos);
  // non-unit inner stride
  TensorView xs = TensorView::strided(x.data(), DType::kFloat32, Device::cpu(), {4, 100}, {200, 2});
  EXPECT_NE(msg([&] { quantize(xs, cfg, q, s); }).find("x must have unit stride"),
            std::string::npos);
  EXPECT_NE(msg([&] { quantize(TensorView{}, cfg, q, s); }).find("x"), std::string::npos);
  // dequantize
  Tensor out = make_tensor({4, 200}, DType::kFloat32);
  EXPECT_NO_THROW(dequantize(q, s, cfg, out));
  EXPECT_NE(msg([&] {
              dequantize(q, s, cfg, make_tensor({4, 200}, DType::kInt64));
            }).find("out must be float32, bfloat16 or float16"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              dequantize(q, s, cfg, make_tensor({4, 201}, DType::kFloat32));
            }).find("q must be float8_e4m3 [4,201]"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              dequantize(q, make_tensor({2, 4}, DType::kFloat32), cfg, out);
            }).find("scales must be float32 [4,2]"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              dequantize(q, s, cfg, out, make_tensor({1}, DType::kFloat32));
            }).find("rows_used must be int32 or int64 [1]"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              dequantize(q, s, cfg, out, make_tensor({2}, DType::kInt64));
            }).find("rows_used must be int32 or int64 [1]"),
            std::string::npos);
  {
    QuantizeConfig colw = cfg;
    colw.columnwise = true;
    Tensor qc = make_tensor({200, 4}, kE4), sc = make_tensor({200, 1}, DType::kFloat32);
    EXPECT_NE(msg([&] {
                dequantize(qc, sc, colw, out, make_tensor({1}, DType::kInt64));
              }).find("rows_used needs a rowwise dequantize"),
              std::string::npos);
  }
  EXPECT_NE(msg([&] {
              quantize(x, cfg, q, s, {}, make_tensor({1}, DType::kFloat32));
            }).find("rows_used must be int32 or int64 [1]"),
            std::string::npos);
  {
    const QuantizeConfig blocks{kE4, QuantScaling::kBlock128x128, false, false};
    EXPECT_NE(msg([&] {
                quantize(x, blocks, q, make_tensor({1, 2}, DType::kFloat32), {},
                         make_tensor({1}, DType::kInt64));
              }).find("rows_used needs a rowwise kBlock1x128 quantize"),
              std::string::npos);
  }
  EXPECT_EQ(quantize_workspace_bytes(4, 200, cfg), 0u);
}

}  // namespace
}  // namespace moeflow::test
