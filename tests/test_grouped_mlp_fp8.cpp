// The grouped MLP's FP8 recipes on the CPU (moeflow/grouped_mlp_fp8.h):
// y, dx and dprobs of the blockwise and the tensorwise recipe against the bf16 MLP within the FP8
// bound of docs/fp8.md (relative Frobenius error < 0.1, calc_diff < 5e-3), pad rows zero, rows past
// the groups untouched, W^T's codes equal to the columnwise quantization of each expert, argument
// errors; the FP8 weight gradients against the 16-bit ones within the same bound.
#include "test_grouped_mlp_fp8.h"

namespace moeflow::test {
namespace {

class GroupedMlpFp8Recipes : public ::testing::TestWithParam<Fp8Recipe> {};

TEST_P(GroupedMlpFp8Recipes, AgainstBf16WithinBound) {
  const Fp8MlpResult r = run_fp8_mlp(Device::cpu(), 1, GetParam());
  const int64_t H = 256, used = r.used;
  for (auto [name, got, want, n] :
       {std::tuple{"y", &r.y, &r.y16, used * H}, std::tuple{"dx", &r.dx, &r.dx16, used * H},
        std::tuple{"dprobs", &r.dprobs, &r.dprobs16, used}}) {
    const auto [rel, cd] = fp8_errors(*got, *want, n);
    EXPECT_LT(rel, 0.1) << name;
    EXPECT_LT(cd, 5e-3) << name;
    RecordProperty(std::string(name) + "_rel", std::to_string(rel));
  }
  for (size_t e = 0; e < r.real.size(); ++e)  // pad rows: zeros
    for (int64_t row = r.offsets[e] + r.real[e]; row < r.offsets[e + 1]; ++row)
      for (int64_t k = 0; k < H; ++k) {
        ASSERT_EQ(at(r.y, row * H + k), 0.0f) << "y row " << row;
        ASSERT_EQ(at(r.dx, row * H + k), 0.0f) << "dx row " << row;
      }
  const auto* yb = static_cast<const uint16_t*>(r.y.data());
  for (int64_t i = used * H; i < r.y.numel(); ++i) ASSERT_EQ(yb[i], 0xFFFF) << "past the groups";
}

TEST_P(GroupedMlpFp8Recipes, Fp8WgradAgainstBf16WithinBound) {
  for (DType dwt : {DType::kBFloat16, DType::kFloat32})
    for (bool acc : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dwt)) + (acc ? " accumulate" : ""));
      const Fp8WgradResult r = run_fp8_wgrad(Device::cpu(), 5, dwt, acc, GetParam());
      for (auto [name, got, want] :
           {std::tuple{"dw1", &r.dw1, &r.dw1_16}, std::tuple{"dw2", &r.dw2, &r.dw2_16}}) {
        const auto [rel, cd] = fp8_errors(*got, *want, got->numel());
        EXPECT_LT(rel, 0.1) << name;
        EXPECT_LT(cd, 5e-3) << name;
      }
      // expert 1 has no rows: zero gradient (or the start value, accumulated)
      for (const Tensor* t : {&r.dw1, &r.dw2}) {
        const int64_t per = t->numel() / 3;
        for (int64_t i = per; i < 2 * per; ++i) ASSERT_EQ(at(*t, i), 0.0f) << i;
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Recipes, GroupedMlpFp8Recipes,
                         ::testing::Values(Fp8Recipe::kBlockwise, Fp8Recipe::kTensorwise),
                         [](const auto& info) {
                           return info.param == Fp8Recipe::kBlockwise ? "blockwise" : "tensorwise";
                         });

TEST(GroupedMlpFp8, Fp8WgradNeedsAlignedGroups) {
  const DType bf = DType::kBFloat16, f32 = DType::kFloat32;
  const int64_t rows = 256, H = 128, F = 128;
  Tensor x = make_tensor({rows, H}, bf), dy = make_tensor({rows, H}, bf);
  Tensor h = make_tensor({rows, 2 * F}, bf), d_h = make_tensor({rows, 2 * F}, bf);
  fill_random(x, 1);
  fill_random(dy, 2);
  fill_random(h, 3);
  fill_random(d_h, 4);
  Tensor offs = make_tensor({3}, DType::kInt64);
  offs.data_ptr<int64_t>()[0] = 0;
  offs.data_ptr<int64_t>()[1] = 48;  // the second expert starts off a multiple of 128
  offs.data_ptr<int64_t>()[2] = 256;
  GroupLayout g;
  g.offsets = offs;
  Tensor dw1 = make_tensor({2, 2 * F, H}, f32), dw2 = make_tensor({2, H, F}, f32);
  Tensor wc = make_tensor({rows * (H + 2 * F)}, DType::kUInt8);
  Tensor ws = make_tensor({(H + 2 * F) * 2}, f32), wa = make_tensor({rows * F}, bf);
  const GroupedMlpFp8WgradScratch s{wc, ws, wa};
  EXPECT_NE(message_of([&] {
              grouped_mlp_fp8_backward_wgrad(x, dy, g, {}, {}, h, d_h, dw1, dw2, false, s);
            }).find("not a multiple of 128"),
            std::string::npos);
  const GroupedMlpFp8WgradScratch small{wc, make_tensor({10}, f32), wa};
  EXPECT_NE(message_of([&] {
              grouped_mlp_fp8_backward_wgrad(x, dy, g, {}, {}, h, d_h, dw1, dw2, false, small);
            }).find("scratch.scales must be float32 with >= (H + N1) x ceil(rows/128) = 768"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              grouped_mlp_fp8_backward_wgrad(x, dy, g, {}, {}, h, d_h, {}, {}, false, s);
            }).find("needs dw1, dw2 or both"),
            std::string::npos);
  Tensor bad_dw2 = make_tensor({2, H, 2 * F}, f32);
  EXPECT_NE(message_of([&] {
              grouped_mlp_fp8_backward_wgrad(x, dy, g, {}, {}, h, d_h, {}, bad_dw2, false, s);
            }).find("dw2 must be"),
            std::string::npos);
}

TEST(GroupedMlpFp8, WeightsBothOrientations) {
  const int64_t E = 2, N = 256, K = 128;
  Tensor w1 = make_tensor({E, N, K}, DType::kBFloat16), w2 = make_tensor({E, K, N / 2},
                                                                         DType::kBFloat16);
  fill_random(w1, 3, -2.0f, 2.0f);
  fill_random(w2, 4, -2.0f, 2.0f);
  GroupedMlpWeights w;
  w.fc1 = w1;
  w.fc2 = w2;
  const DType e4 = DType::kFloat8E4M3, f32 = DType::kFloat32;
  Tensor q1 = poisoned({E, N, K}, e4), s1 = poisoned({E, N / 128, K / 128}, f32);
  Tensor q2 = poisoned({E, K, N / 2}, e4), s2 = poisoned({E, K / 128, N / 256}, f32);
  Tensor q1t = poisoned({E, K, N}, e4), s1t = poisoned({E, K / 128, N / 128}, f32);
  Tensor q2t = poisoned({E, N / 2, K}, e4), s2t = poisoned({E, N / 256, K / 128}, f32);
  GroupedMlpFp8Weights q{q1, s1, q2, s2, q1t, s1t, q2t, s2t};
  grouped_mlp_fp8_weights(w, q);
  const QuantizeConfig col{e4, QuantScaling::kBlock128x128, false, true};
  // Each W^T's codes and scales are the columnwise quantization of W_e.
  const auto check = [&](const Tensor& wt, const Tensor& qt, const Tensor& st, int64_t R,
                         int64_t C) {
    for (int64_t e = 0; e < E; ++e) {
      TensorView we(static_cast<uint16_t*>(wt.data()) + e * R * C, DType::kBFloat16,
                    Device::cpu(), {R, C});
      Tensor cq = poisoned({C, R}, e4), cs = poisoned({C / 128, R / 128}, f32);
      quantize(we, col, cq, cs);
      ASSERT_EQ(std::memcmp(cq.data(), qt.data_ptr<uint8_t>() + e * C * R, C * R), 0) << e;
      ASSERT_EQ(std::memcmp(cs.data(), st.data_ptr<float>() + e * (C / 128) * (R / 128),
                            cs.nbytes()),
                0)
          << e;
    }
  };
  check(w1, q1t, s1t, N, K);
  check(w2, q2t, s2t, K, N / 2);
}

TEST(GroupedMlpFp8, BadInputNamesTheArgument) {
  const DType e4 = DType::kFloat8E4M3, f32 = DType::kFloat32, bf = DType::kBFloat16;
  Tensor q1 = make_tensor({1, 256, 200}, e4), s1 = make_tensor({1, 2, 2}, f32);
  Tensor q2 = make_tensor({1, 200, 128}, e4), s2 = make_tensor({1, 2, 1}, f32);
  GroupedMlpFp8Weights q{q1, s1, q2, s2, {}, {}, {}, {}};
  Tensor x = make_tensor({16, 200}, bf), y = make_tensor({16, 200}, bf),
         h = make_tensor({16, 256}, bf);
  Tensor offs = make_tensor({2}, DType::kInt64);
  offs.data_ptr<int64_t>()[0] = 0;
  offs.data_ptr<int64_t>()[1] = 16;
  GroupLayout g;
  g.offsets = offs;
  EXPECT_NE(message_of([&] { grouped_mlp_fp8_forward(x, q, g, {}, {}, y, h, {}); })
                .find("multiples of 128, got H=200"),
            std::string::npos);
  Tensor q1b = make_tensor({1, 256, 128}, e4), s1b = make_tensor({1, 2, 1}, f32);
  Tensor q2b = make_tensor({1, 128, 128}, e4), s2b = make_tensor({1, 1, 1}, f32);
  GroupedMlpFp8Weights qb{q1b, s1b, q2b, s2b, {}, {}, {}, {}};
  Tensor xb = make_tensor({16, 128}, bf), yb = make_tensor({16, 128}, bf);
  EXPECT_NE(message_of([&] { grouped_mlp_fp8_forward(xb, qb, g, {}, {}, yb, h, {}); })
                .find("scratch.codes and scratch.scales must be given"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              grouped_mlp_fp8_backward_dgrad(yb, qb, g, {}, {}, h, xb, h, {}, {});
            }).find("reads q.fc2_t"),
            std::string::npos);
  Tensor x16 = make_tensor({16, 128}, DType::kFloat16);
  EXPECT_NE(message_of([&] { grouped_mlp_fp8_forward(x16, qb, g, {}, {}, yb, h, {}); })
                .find("x must be bfloat16"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
