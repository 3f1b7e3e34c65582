// quantize_group_rows on the CPU (moeflow/grouped_mlp_fp8.h): a hand-worked
// case (the scale from the real rows only; pad rows, an empty group and rows
// past the groups code 0), without groups the same bits as quantize's
// tensorwise scaling, e5m2 with pow2 scales, all-zero data (scale 1), the
// form with the amax given, and argument errors naming the argument.
#include <algorithm>
#include <cmath>

#include "moeflow/grouped_mlp_fp8.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

GroupLayout groups_of(Tensor& offs, Tensor& real, std::vector<int64_t> o, std::vector<int32_t> r) {
  offs = make_tensor({static_cast<int64_t>(o.size())}, DType::kInt64);
  real = make_tensor({static_cast<int64_t>(r.size())}, DType::kInt32);
  std::copy(o.begin(), o.end(), offs.data_ptr<int64_t>());
  std::copy(r.begin(), r.end(), real.data_ptr<int32_t>());
  GroupLayout g;
  g.offsets = offs;
  g.real_rows = real;
  return g;
}

const QuantizeConfig kE4m3{DType::kFloat8E4M3, QuantScaling::kTensorwise, false, false};

// Rows 0-1 (group 0's real rows) hold 1 and -2 at column j % 2; group 0's
// pad row 2, group 2's row 7 (pad) and row 8 (past the groups) hold 1e6 and
// NaN: the amax is 2, the scale 2 / 448; every non-data row is code 0.
TEST(QuantizeGroupRows, HandWorked) {
  Tensor offs, real;
  const GroupLayout g = groups_of(offs, real, {0, 3, 3, 8}, {2, 0, 4});
  const int64_t rows = 9, K = 128;
  Tensor x = make_tensor({rows, K}, DType::kFloat32);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      float v = k % 2 ? -2.0f : 1.0f;
      if (r >= 3 && r < 7) v = 0.5f;
      if (r == 2 || r == 7) v = 1e6f;
      if (r == 8) v = NAN;
      x.data_ptr<float>()[r * K + k] = v;
    }
  Tensor q = poisoned({rows, K}, DType::kFloat8E4M3), s = poisoned({1}, DType::kFloat32);
  quantize_group_rows(x, g, kE4m3, q, s);
  EXPECT_EQ(at(s, 0), 2.0f / 448.0f);
  const auto* qb = static_cast<const uint8_t*>(q.data());
  // 1 / (2/448) = 224 (e4m3 0x76 = 224), -2 -> -448 (0xFE), 0.5 -> 112 (0x6E).
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      uint8_t want = 0;
      if (r < 2) want = k % 2 ? 0xFE : 0x76;
      if (r >= 3 && r < 7) want = 0x6E;
      ASSERT_EQ(qb[r * K + k], want) << "row " << r << " column " << k;
    }
}

// Without groups: the same bits as quantize(kTensorwise) of the whole x,
// NaN and inf included; e5m2 with pow2 scales too.
TEST(QuantizeGroupRows, NoGroupsIsQuantizeTensorwise) {
  const int64_t rows = 33, K = 200;
  Tensor x = make_tensor({rows, K}, DType::kBFloat16);
  fill_random(x, 7, -3.0f, 3.0f);
  detail::store_float(x.data(), DType::kBFloat16, 5, NAN);
  detail::store_float(x.data(), DType::kBFloat16, 77, INFINITY);
  for (const bool e5 : {false, true}) {
    const QuantizeConfig cfg{e5 ? DType::kFloat8E5M2 : DType::kFloat8E4M3,
                             QuantScaling::kTensorwise, e5, false};
    Tensor q = poisoned({rows, K}, cfg.out), s = poisoned({1}, DType::kFloat32);
    quantize_group_rows(x, GroupLayout{}, cfg, q, s);
    Tensor qw = poisoned({rows, K}, cfg.out), sw = poisoned({1}, DType::kFloat32);
    quantize(x, cfg, qw, sw);
    EXPECT_TRUE(bytes_equal(q, qw));
    EXPECT_TRUE(bytes_equal(s, sw));
  }
}

// Only zeros (or no data rows at all): scale 1, codes 0.
TEST(QuantizeGroupRows, NoDataGivesScaleOne) {
  Tensor offs, real;
  const GroupLayout g = groups_of(offs, real, {0, 4}, {0});
  Tensor x = make_tensor({6, 128}, DType::kFloat32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data_ptr<float>()[i] = 5.0f;
  Tensor q = poisoned({6, 128}, DType::kFloat8E4M3), s = poisoned({1}, DType::kFloat32);
  quantize_group_rows(x, g, kE4m3, q, s);
  EXPECT_EQ(at(s, 0), 1.0f);
  for (int64_t r = 0; r < 6; ++r) EXPECT_TRUE(row_is(q, r, 0)) << r;
}

// q_t: the codes transposed, the same q and scale as without it.
TEST(QuantizeGroupRows, TransposedCodesAreQTransposed) {
  Tensor offs, real;
  const GroupLayout g = groups_of(offs, real, {0, 16, 48}, {9, 30});
  const int64_t rows = 50, K = 136;
  Tensor x = make_tensor({rows, K}, DType::kBFloat16);
  fill_random(x, 11, -2.0f, 2.0f);
  Tensor q = poisoned({rows, K}, DType::kFloat8E4M3), s = poisoned({1}, DType::kFloat32);
  quantize_group_rows(x, g, kE4m3, q, s);
  Tensor q2 = poisoned({rows, K}, DType::kFloat8E4M3), s2 = poisoned({1}, DType::kFloat32),
         qt = poisoned({K, rows}, DType::kFloat8E4M3);
  quantize_group_rows(x, g, kE4m3, q2, s2, qt);
  EXPECT_TRUE(bytes_equal(q2, q));
  EXPECT_TRUE(bytes_equal(s2, s));
  int bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k)
      bad += qt.data_ptr<uint8_t>()[k * rows + r] != q.data_ptr<uint8_t>()[r * K + k];
  EXPECT_EQ(bad, 0);
  Tensor qt_bad = make_tensor({rows, K}, DType::kFloat8E4M3);
  EXPECT_NE(message_of([&] {
              quantize_group_rows(x, g, kE4m3, q2, s2, qt_bad);
            }).find("q_t must be float8_e4m3 [136,50]"),
            std::string::npos);
  // q_t overlapping q (from its second row on): refused.
  Tensor both = make_tensor({2 * rows, K}, DType::kFloat8E4M3);
  const TensorView q_in(both.data(), DType::kFloat8E4M3, Device::cpu(), {rows, K}),
      qt_in(static_cast<uint8_t*>(both.data()) + K, DType::kFloat8E4M3, Device::cpu(), {K, rows});
  EXPECT_NE(message_of([&] {
              quantize_group_rows(x, g, kE4m3, q_in, s2, qt_in);
            }).find("q_t must not overlap q"),
            std::string::npos);
}

// quantize_group_rows_with_amax: the data rows' own amax gives
// quantize_group_rows' bits; another amax gives that amax's scale.
TEST(QuantizeGroupRows, WithAmaxIsTheCodesPass) {
  Tensor offs, real;
  const GroupLayout g = groups_of(offs, real, {0, 37, 37, 100}, {30, 0, 50});
  const int64_t rows = 107, K = 200;
  Tensor x = make_tensor({rows, K}, DType::kBFloat16);
  fill_random(x, 21, -3.0f, 3.0f);
  Tensor q = poisoned({rows, K}, DType::kFloat8E4M3), s = poisoned({1}, DType::kFloat32);
  Tensor qt = poisoned({K, rows}, DType::kFloat8E4M3);
  quantize_group_rows(x, g, kE4m3, q, s, qt);
  float amax = 0.0f;  // the data rows: 0-29 and 37-86
  for (int64_t r = 0; r < rows; ++r)
    if (r < 30 || (r >= 37 && r < 87))
      for (int64_t k = 0; k < K; ++k)
        amax = std::max(amax, std::fabs(detail::load_float(x.data(), x.dtype(), r * K + k)));
  EXPECT_EQ(at(s, 0), amax / 448.0f);
  Tensor a = make_tensor({1}, DType::kFloat32);
  a.data_ptr<float>()[0] = amax;
  Tensor q2 = poisoned({rows, K}, DType::kFloat8E4M3), s2 = poisoned({1}, DType::kFloat32);
  Tensor qt2 = poisoned({K, rows}, DType::kFloat8E4M3);
  quantize_group_rows_with_amax(x, g, kE4m3, a, q2, s2, qt2);
  EXPECT_TRUE(bytes_equal(q2, q));
  EXPECT_TRUE(bytes_equal(s2, s));
  EXPECT_TRUE(bytes_equal(qt2, qt));
  a.data_ptr<float>()[0] = 4.0f * amax;
  quantize_group_rows_with_amax(x, g, kE4m3, a, q2, s2);
  EXPECT_EQ(at(s2, 0), 4.0f * amax / 448.0f);
  EXPECT_FALSE(bytes_equal(q2, q));
  Tensor bad = make_tensor({2}, DType::kFloat32);
  EXPECT_NE(message_of([&] {
              quantize_group_rows_with_amax(x, g, kE4m3, bad, q2, s2);
            }).find("amax must be float32 [1]"),
            std::string::npos);
}

TEST(QuantizeGroupRows, BadInputNamesTheArgument) {
  Tensor offs, real;
  const GroupLayout g = groups_of(offs, real, {0, 4}, {4});
  Tensor x = make_tensor({4, 128}, DType::kBFloat16), q = make_tensor({4, 128}, DType::kFloat8E4M3);
  Tensor s = make_tensor({1}, DType::kFloat32), s2 = make_tensor({2}, DType::kFloat32);
  QuantizeConfig blocks = kE4m3;
  blocks.scaling = QuantScaling::kBlock1x128;
  EXPECT_NE(message_of([&] { quantize_group_rows(x, g, blocks, q, s); }).find("kTensorwise"),
            std::string::npos);
  EXPECT_NE(message_of([&] { quantize_group_rows(x, g, kE4m3, q, s2); }).find("scale must be"),
            std::string::npos);
  Tensor q_short = make_tensor({3, 128}, DType::kFloat8E4M3);
  EXPECT_NE(message_of([&] { quantize_group_rows(x, g, kE4m3, q_short, s); }).find("q must be"),
            std::string::npos);
  GroupLayout bad = g;
  Tensor r64 = make_tensor({1}, DType::kInt64);
  bad.real_rows = r64;
  EXPECT_NE(message_of([&] { quantize_group_rows(x, bad, kE4m3, q, s); }).find("groups.real_rows"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
