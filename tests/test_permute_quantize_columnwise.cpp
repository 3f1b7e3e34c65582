// CPU tests of permute_quantize's columnwise form (QuantizeConfig.columnwise:
// the rows' transposed 1x128 codes, the blockwise FP8 wgrad's operand):
// bitwise against quantize(columnwise) of rows built by hand from
// plan.row_token (pad rows and rows past total_rows zero), over uneven
// routings, align 16 and 128, dropped slots, K = 1, H not a multiple of 128,
// no tokens, both fp8 formats, pow2 scales, special values, scales in both
// layouts; the 128-row blocks past total_rows untouched; a hand-worked case;
// bad input naming the argument.
#include <limits>

#include "test_util.h"

namespace moeflow::test {
namespace {

struct ColCase {
  Case c;
  int64_t capacity;  // -1: the worst case (nothing dropped)
};

const std::vector<ColCase> kColCases = {
    {{64, 2, 4, 200, 16}, -1},    {{97, 8, 64, 256, 128}, -1}, {{50, 1, 8, 128, 16}, -1},
    {{120, 8, 16, 136, 16}, 256}, {{300, 4, 8, 72, 16}, 2048}, {{0, 2, 4, 64, 16}, -1},
};

// The rows [capacity, H] of x's dtype: x[row_token[r]] for r < total_rows
// with a token, zero otherwise.
Tensor rows_by_hand(const Tensor& x, const RoutingPlan& plan) {
  const int64_t H = x.size(1), total = plan_status(plan).total_rows;
  Tensor rows = Tensor::zeros({plan.capacity_rows, H}, x.dtype());
  const auto row_token = to_vec<int32_t>(plan.row_token);
  const size_t rb = static_cast<size_t>(H) * dtype_size(x.dtype());
  for (int64_t r = 0; r < total; ++r)
    if (row_token[r] >= 0)
      std::memcpy(static_cast<uint8_t*>(rows.data()) + r * rb,
                  static_cast<const uint8_t*>(x.data()) + row_token[r] * rb, rb);
  return rows;
}

TEST(PermuteQuantizeColumnwise, EqualsColumnwiseQuantizeOfTheRowsBitwise) {
  uint32_t seed = 3000;
  int layout = 0;
  for (const ColCase& cc : kColCases) {
    const Case& c = cc.c;
    for (DType dt : {DType::kBFloat16, DType::kFloat32, DType::kFloat16}) {
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        for (bool pow2 : {false, true}) {
          const bool transposed_scales = (layout++ % 2) == 0;
          SCOPED_TRACE(name_of(c) + " cap=" + std::to_string(cc.capacity) + " " + dtype_name(dt) +
                       " -> " + dtype_name(out) + (pow2 ? " pow2" : "") +
                       (transposed_scales ? " scales [nb,H]^T" : " scales [H,nb]"));
          Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.1);
          RoutingPlan plan =
              allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, cc.capacity}, Device::cpu());
          build_plan(ids, plan);
          if (cc.capacity > 0 && cc.capacity < c.T * c.K) ASSERT_GT(plan_status(plan).overflow, 0);
          const int64_t cap = plan.capacity_rows, nb = blocks128(cap);
          const int64_t total = plan_status(plan).total_rows;
          Tensor x = make_tensor({c.T, c.H}, dt);
          fill_random(x, seed++, -4.0f, 4.0f);
          add_special_rows(x);

          Tensor y = poisoned({c.H, cap}, out);
          Tensor sbuf = transposed_scales ? poisoned({nb, c.H}, DType::kFloat32)
                                          : poisoned({c.H, nb}, DType::kFloat32);
          const TensorView ys = transposed_scales
                                    ? TensorView::strided(sbuf.data(), DType::kFloat32,
                                                          Device::cpu(), {c.H, nb}, {1, c.H})
                                    : TensorView(sbuf);
          const QuantizeConfig cfg{out, QuantScaling::kBlock1x128, pow2, true};
          permute_quantize(x, plan, y, ys, cfg);

          // The reference: quantize(columnwise) of the rows below the first
          // 128-row block that starts at or past total_rows.
          const int64_t written = std::min(cap, blocks128(total) * 128), wb = blocks128(written);
          Tensor rows = rows_by_hand(x, plan);
          Tensor q = make_tensor({c.H, written}, out), s = make_tensor({c.H, wb}, DType::kFloat32);
          if (written > 0)
            quantize(TensorView::strided(rows.data(), dt, Device::cpu(), {written, c.H}, {c.H, 1}),
                     cfg, q, s);
          const auto* yv = static_cast<const uint8_t*>(y.data());
          const auto* qv = static_cast<const uint8_t*>(q.data());
          const float* sv = sbuf.data_ptr<float>();
          for (int64_t h = 0; h < c.H; ++h) {
            for (int64_t m = 0; m < cap; ++m) {
              const uint8_t want = m < written ? qv[h * written + m] : 0xFF;
              ASSERT_EQ(yv[h * cap + m], want) << "h " << h << " row " << m;
            }
            for (int64_t b = 0; b < nb; ++b) {
              const float got = transposed_scales ? sv[b * c.H + h] : sv[h * nb + b];
              if (b < wb) {
                ASSERT_EQ(got, s.data_ptr<float>()[h * wb + b]) << "h " << h << " block " << b;
              } else {
                uint32_t bits;
                std::memcpy(&bits, &got, 4);
                ASSERT_EQ(bits, 0xFFFFFFFFu) << "block past total_rows written: " << b;
              }
            }
          }
        }
      }
    }
  }
}

TEST(PermuteQuantizeColumnwise, HandWorkedCodesAndUntouchedBlocks) {
  // 3 tokens, top-2, 2 experts, align 16, capacity 256, H = 2.
  // expert 0: t0 (k1), t1 (k0), t2 (k1) -> rows 0..2, pad 3..15;
  // expert 1: t0 (k0), t2 (k0) -> rows 16, 17, pad to 31; total_rows 32.
  int32_t idv[] = {1, 0, 0, -1, 1, 0};
  Tensor ids = make_tensor({3, 2}, DType::kInt32);
  std::copy(idv, idv + 6, ids.data_ptr<int32_t>());
  RoutingPlan plan = allocate_plan(3, 2, PlanConfig{2, 16, 256}, Device::cpu());
  build_plan(ids, plan);
  ASSERT_EQ(plan_status(plan).total_rows, 32);
  float xv[] = {448.0f, -1.0f, 300.0f, 0.0f, 0.0f, 3.0f};
  Tensor x = make_tensor({3, 2}, DType::kFloat32);
  std::copy(xv, xv + 6, x.data_ptr<float>());
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kBlock1x128, true, true};
  Tensor y = poisoned({2, 256}, DType::kFloat8E4M3);
  Tensor ys = poisoned({2, 2}, DType::kFloat32);
  permute_quantize(x, plan, y, ys, cfg);
  const float* s = ys.data_ptr<float>();
  // column 0: amax 448 -> scale 1; 448 -> 0x7E, 300 -> 288 = 0x79.
  // column 1: amax 3 -> 3/448, pow2 2^-7; 3 -> 384 = 0x7C, -1 -> -128 = 0xF0.
  EXPECT_EQ(s[0 * 2 + 0], 1.0f);
  EXPECT_EQ(s[1 * 2 + 0], 0.0078125f);
  const auto* q = static_cast<const uint8_t*>(y.data());
  for (int64_t m = 0; m < 128; ++m) {
    uint8_t c0 = 0, c1 = 0;
    if (m == 0 || m == 16) c0 = 0x7E, c1 = 0xF0;  // t0
    if (m == 1) c0 = 0x79;                        // t1
    if (m == 2 || m == 17) c1 = 0x7C;             // t2
    EXPECT_EQ(q[0 * 256 + m], c0) << "row " << m;
    EXPECT_EQ(q[1 * 256 + m], c1) << "row " << m;
  }
  // rows 128..255: a block past total_rows, untouched (codes and scale)
  for (int64_t m = 128; m < 256; ++m) EXPECT_EQ(q[m], 0xFF) << m;
  uint32_t bits;
  std::memcpy(&bits, &s[1], 4);
  EXPECT_EQ(bits, 0xFFFFFFFFu);
}

TEST(PermuteQuantizeColumnwise, BadInputErrors) {
  const Case c{8, 2, 4, 200, 16};
  RoutingPlan plan = allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, -1}, Device::cpu());
  build_plan(random_topk(c.T, c.K, c.E, 7), plan);
  const int64_t cap = plan.capacity_rows, nb = blocks128(cap);
  Tensor x = make_tensor({c.T, c.H}, DType::kBFloat16);
  fill_random(x, 8);
  Tensor y = make_tensor({c.H, cap}, DType::kFloat8E4M3);
  Tensor ys = make_tensor({c.H, nb}, DType::kFloat32);
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, true};
  auto has = [](const std::string& msg, const std::string& want) {
    return msg.find(want) != std::string::npos ? ::testing::AssertionSuccess()
                                               : ::testing::AssertionFailure() << msg;
  };
  EXPECT_EQ(message_of([&] { permute_quantize(x, plan, y, ys, cfg); }), "no error");

  Tensor yrows = make_tensor({cap, c.H}, DType::kFloat8E4M3);
  EXPECT_TRUE(
      has(message_of([&] { permute_quantize(x, plan, yrows, ys, cfg); }),
          "y must be float8_e4m3 [" + std::to_string(c.H) + "," + std::to_string(cap) + "]"));
  Tensor ysrows = make_tensor({cap, 2}, DType::kFloat32);
  EXPECT_TRUE(
      has(message_of([&] { permute_quantize(x, plan, y, ysrows, cfg); }),
          "y_scales must be float32 [" + std::to_string(c.H) + "," + std::to_string(nb) + "]"));
  const QuantizeConfig big{DType::kFloat8E4M3, QuantScaling::kBlock128x128, false, true};
  EXPECT_TRUE(has(message_of([&] { permute_quantize(x, plan, y, ys, big); }),
                  "QuantizeConfig.columnwise needs scaling kBlock1x128"));
  Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
  Tensor pp = make_tensor({cap}, DType::kFloat32);
  EXPECT_TRUE(has(message_of([&] {
                    permute_quantize(x, plan, y, ys, cfg, PermuteExtras{probs, pp, {}, {}});
                  }),
                  "PermuteExtras must be empty with QuantizeConfig.columnwise"));
  Tensor yt = make_tensor({c.H, cap}, DType::kFloat8E4M3);
  EXPECT_TRUE(has(message_of([&] { permute_quantize(x, plan, y, ys, yt, cfg); }),
                  "y_t must be empty with QuantizeConfig.columnwise"));
  Tensor xi = make_tensor({c.T, c.H}, DType::kInt32);
  EXPECT_TRUE(has(message_of([&] { permute_quantize(xi, plan, y, ys, cfg); }), "x must be"));
  // scales that share addresses (a stride of 0), or lie inside y
  const TensorView ys0 =
      TensorView::strided(ys.data(), DType::kFloat32, Device::cpu(), {c.H, nb}, {1, 0});
  EXPECT_TRUE(has(message_of([&] { permute_quantize(x, plan, y, ys0, cfg); }), "overlap"));
  const TensorView ys_in_y =
      TensorView::strided(y.data(), DType::kFloat32, Device::cpu(), {c.H, nb}, {nb, 1});
  EXPECT_TRUE(
      has(message_of([&] { permute_quantize(x, plan, y, ys_in_y, cfg); }), "must not overlap y"));
}

// Strided x rows and y rows (row strides past H and past capacity), against
// the same call on contiguous copies.
TEST(PermuteQuantizeColumnwise, StridedRows) {
  const Case c{90, 4, 8, 256, 16};
  RoutingPlan plan = allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, -1}, Device::cpu());
  build_plan(random_topk(c.T, c.K, c.E, 11, 1.0, 0.1), plan);
  const int64_t cap = plan.capacity_rows, nb = blocks128(cap);
  Tensor x = make_tensor({c.T, c.H}, DType::kBFloat16);
  fill_random(x, 12, -3.0f, 3.0f);
  const int64_t xs = c.H + 24, ysr = cap + 40;
  Tensor xbuf = make_tensor({c.T, xs}, DType::kBFloat16);
  for (int64_t t = 0; t < c.T; ++t)
    std::memcpy(static_cast<uint8_t*>(xbuf.data()) + t * xs * 2,
                static_cast<const uint8_t*>(x.data()) + t * c.H * 2, c.H * 2);
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, true};
  Tensor want = poisoned({c.H, cap}, DType::kFloat8E4M3),
         want_s = poisoned({c.H, nb}, DType::kFloat32);
  permute_quantize(x, plan, want, want_s, cfg);
  Tensor ybuf = poisoned({c.H, ysr}, DType::kFloat8E4M3),
         got_s = poisoned({c.H, nb}, DType::kFloat32);
  permute_quantize(
      TensorView::strided(xbuf.data(), DType::kBFloat16, Device::cpu(), {c.T, c.H}, {xs, 1}), plan,
      TensorView::strided(ybuf.data(), DType::kFloat8E4M3, Device::cpu(), {c.H, cap}, {ysr, 1}),
      got_s, cfg);
  EXPECT_TRUE(bytes_equal(got_s, want_s));
  for (int64_t h = 0; h < c.H; ++h) {
    const auto* g = static_cast<const uint8_t*>(ybuf.data()) + h * ysr;
    ASSERT_EQ(std::memcmp(g, static_cast<const uint8_t*>(want.data()) + h * cap, cap), 0) << h;
    for (int64_t m = cap; m < ysr; ++m) ASSERT_EQ(g[m], 0xFF) << "past the view: " << h;
  }
}

}  // namespace
}  // namespace moeflow::test
