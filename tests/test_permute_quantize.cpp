// CPU permute_quantize tests: bitwise equal to quantize (1x128 rowwise) then
// permute of the fp8 rows with their scales, over uneven routings, align 16
// and 128, dropped slots, K = 1 and 8, H not a multiple of 128, both fp8
// formats, pow2 scales, special values and strided rows; pad rows (codes 0,
// scales 0, probs 0), rows past total_rows untouched; bad input.
// unpermute_backward_quantize: bitwise equal to unpermute_backward into
// dout's dtype then quantize of the written rows, with and without probs;
// pad rows (codes 0, scale 1), rows past total_rows untouched; a hand-worked
// case; bad input.
#include <limits>

#include "test_util.h"

namespace moeflow::test {
namespace {

struct PqCase {
  Case c;
  int64_t capacity;  // -1: the worst case (nothing dropped)
};

const std::vector<PqCase> kPqCases = {
    {{64, 2, 4, 200, 16}, -1},    {{97, 8, 64, 256, 128}, -1}, {{50, 1, 8, 128, 16}, -1},
    {{40, 4, 7, 1000, 1}, -1},    {{120, 8, 16, 136, 16}, 256}, {{33, 1, 4, 40, 128}, 128},
    {{1, 8, 8, 7168, 16}, -1},    {{0, 2, 4, 64, 16}, -1},
};

struct Outputs {
  Tensor y, ys, pp;
};

Outputs run_fused(TensorView x, const RoutingPlan& plan, const QuantizeConfig& cfg,
                  const Tensor& probs) {
  const int64_t H = x.shape[1];
  Outputs o{poisoned({plan.capacity_rows, H}, cfg.out),
            poisoned({plan.capacity_rows, blocks128(H)}, DType::kFloat32),
            poisoned({plan.capacity_rows}, DType::kFloat32)};
  permute_quantize(x, plan, o.y, o.ys, cfg, PermuteExtras{probs, o.pp, {}, {}});
  return o;
}

// The definition: quantize then permute with the scales as side data.
Outputs run_composed(TensorView x, const RoutingPlan& plan, const QuantizeConfig& cfg,
                     const Tensor& probs) {
  const int64_t T = x.shape[0], H = x.shape[1];
  Tensor q = make_tensor({T, H}, cfg.out), s = make_tensor({T, blocks128(H)}, DType::kFloat32);
  quantize(x, cfg, q, s);
  Outputs o{poisoned({plan.capacity_rows, H}, cfg.out),
            poisoned({plan.capacity_rows, blocks128(H)}, DType::kFloat32),
            poisoned({plan.capacity_rows}, DType::kFloat32)};
  permute(q, plan, o.y, PermuteExtras{probs, probs.defined() ? TensorView(o.pp) : TensorView(), s, o.ys});
  return o;
}

void expect_layout(const Outputs& o, const RoutingPlan& plan) {
  const int64_t total = plan_status(plan).total_rows;
  auto row_token = to_vec<int32_t>(plan.row_token);
  for (int64_t r = 0; r < plan.capacity_rows; ++r) {
    if (r >= total) {
      ASSERT_TRUE(row_is(o.y, r, 0xFF) && row_is(o.ys, r, 0xFF)) << "row past total_rows written: " << r;
      ASSERT_TRUE(row_is(o.pp, r, 0xFF)) << r;
    } else if (row_token[r] < 0) {
      ASSERT_TRUE(row_is(o.y, r, 0)) << "pad row codes not 0: " << r;
      ASSERT_TRUE(row_is(o.ys, r, 0)) << "pad row scales not 0: " << r;
      ASSERT_EQ(o.pp.data_ptr<float>()[r], 0.0f);
    } else {
      for (int64_t b = 0; b < o.ys.size(1); ++b)
        ASSERT_GT(o.ys.data_ptr<float>()[r * o.ys.size(1) + b], 0.0f) << "row " << r;
    }
  }
}

TEST(PermuteQuantize, EqualsQuantizeThenPermuteBitwise) {
  uint32_t seed = 1000;
  for (const PqCase& pc : kPqCases) {
    const Case& c = pc.c;
    for (DType dt : {DType::kBFloat16, DType::kFloat32, DType::kFloat16}) {
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        for (bool pow2 : {false, true}) {
          SCOPED_TRACE(name_of(c) + " cap=" + std::to_string(pc.capacity) + " " + dtype_name(dt) +
                       " -> " + dtype_name(out) + (pow2 ? " pow2" : ""));
          Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.1);
          RoutingPlan plan =
              allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, pc.capacity}, Device::cpu());
          build_plan(ids, plan);
          if (pc.capacity > 0 && c.T > 0) ASSERT_GT(plan_status(plan).overflow, 0) << "no drops";
          Tensor x = make_tensor({c.T, c.H}, dt);
          fill_random(x, seed++, -4.0f, 4.0f);
          add_special_rows(x);
          Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
          fill_random(probs, seed++, 0.0f, 1.0f);
          const QuantizeConfig cfg{out, QuantScaling::kBlock1x128, pow2, false};
          Outputs got = run_fused(x, plan, cfg, probs);
          Outputs want = run_composed(x, plan, cfg, probs);
          EXPECT_TRUE(bytes_equal(got.y, want.y));
          EXPECT_TRUE(bytes_equal(got.ys, want.ys));
          EXPECT_TRUE(bytes_equal(got.pp, want.pp));
          expect_layout(got, plan);
        }
      }
    }
  }
}

TEST(PermuteQuantize, HandWorkedScalesAndPadRows) {
  // 3 tokens, top-2, 2 experts, align 16, H = 130 (a full block and a block of 2).
  int32_t idv[] = {1, 0, 0, -1, 1, 0};
  Tensor ids = make_tensor({3, 2}, DType::kInt32);
  std::copy(idv, idv + 6, ids.data_ptr<int32_t>());
  RoutingPlan plan = allocate_plan(3, 2, PlanConfig{2, 16, -1}, Device::cpu());
  build_plan(ids, plan);
  const int64_t H = 130;
  Tensor x = Tensor::zeros({3, H}, DType::kFloat32);
  float* xv = x.data_ptr<float>();
  xv[0 * H + 5] = 448.0f;   // token 0 block 0: amax 448 -> scale 1
  xv[0 * H + 6] = -1.0f;
  xv[0 * H + 129] = 896.0f;  // token 0 block 1: amax 896 -> scale 2
  xv[1 * H + 0] = 300.0f;   // token 1 block 0: 300/448, pow2 -> 1; block 1 all zero -> 1
  xv[2 * H + 128] = 3.0f;   // token 2 block 0 zero -> 1; block 1: 3/448 -> pow2 2^-7
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kBlock1x128, true, false};
  Tensor y = poisoned({plan.capacity_rows, H}, DType::kFloat8E4M3);
  Tensor ys = poisoned({plan.capacity_rows, 2}, DType::kFloat32);
  permute_quantize(x, plan, y, ys, cfg);
  // expert 0: t0 (k1), t1 (k0), t2 (k1) -> rows 0..2, pad 3..15; expert 1: t0, t2 -> 16, 17, pad to 31
  const float* s = ys.data_ptr<float>();
  const auto* q = static_cast<const uint8_t*>(y.data());
  EXPECT_EQ(s[0 * 2 + 0], 1.0f);
  EXPECT_EQ(s[0 * 2 + 1], 2.0f);
  EXPECT_EQ(s[16 * 2 + 0], 1.0f);
  EXPECT_EQ(s[16 * 2 + 1], 2.0f);
  EXPECT_EQ(q[0 * H + 5], 0x7E);    // 448 = e4m3 max
  EXPECT_EQ(q[0 * H + 6], 0xB8);    // -1
  EXPECT_EQ(q[0 * H + 129], 0x7E);  // 896 / 2
  EXPECT_EQ(q[16 * H + 129], 0x7E);
  EXPECT_EQ(s[1 * 2 + 0], 1.0f);
  EXPECT_EQ(s[1 * 2 + 1], 1.0f);
  EXPECT_EQ(s[2 * 2 + 0], 1.0f);
  EXPECT_EQ(s[2 * 2 + 1], 0.0078125f);
  EXPECT_EQ(q[2 * H + 128], 0x7C);  // 3 / 2^-7 = 384 = 1.5 * 2^8
  for (int r : {3, 15, 18, 31}) {
    EXPECT_TRUE(row_is(y, r, 0)) << r;
    EXPECT_TRUE(row_is(ys, r, 0)) << r;
  }
  for (int64_t r = 32; r < plan.capacity_rows; ++r) {
    EXPECT_TRUE(row_is(y, r, 0xFF)) << r;
    EXPECT_TRUE(row_is(ys, r, 0xFF)) << r;
  }
}

TEST(PermuteQuantize, StridedRows) {
  const Case c{77, 4, 8, 300, 16};
  RoutingPlan plan = allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, -1}, Device::cpu());
  build_plan(random_topk(c.T, c.K, c.E, 5), plan);
  Tensor xbuf = make_tensor({c.T, 512}, DType::kBFloat16);
  fill_random(xbuf, 6);
  auto x = TensorView::strided(xbuf.data(), DType::kBFloat16, Device::cpu(), {c.T, c.H}, {512, 1});
  Tensor xc = make_tensor({c.T, c.H}, DType::kBFloat16);
  for (int64_t t = 0; t < c.T; ++t)
    std::memcpy(static_cast<uint8_t*>(xc.data()) + t * c.H * 2,
                static_cast<const uint8_t*>(xbuf.data()) + t * 512 * 2, c.H * 2);
  const QuantizeConfig cfg{};
  Tensor ybuf = poisoned({plan.capacity_rows, 320}, DType::kFloat8E4M3);
  auto y = TensorView::strided(ybuf.data(), DType::kFloat8E4M3, Device::cpu(),
                               {plan.capacity_rows, c.H}, {320, 1});
  Tensor ys = poisoned({plan.capacity_rows, blocks128(c.H)}, DType::kFloat32);
  permute_quantize(x, plan, y, ys, cfg);
  Outputs want = run_composed(xc, plan, cfg, {});
  const int64_t total = plan_status(plan).total_rows;
  for (int64_t r = 0; r < plan.capacity_rows; ++r) {
    const auto* got = static_cast<const uint8_t*>(ybuf.data()) + r * 320;
    const auto* exp = static_cast<const uint8_t*>(want.y.data()) + r * c.H;
    ASSERT_EQ(0, std::memcmp(got, exp, c.H)) << "row " << r;
    for (int64_t h = c.H; h < 320; ++h) ASSERT_EQ(got[h], 0xFF) << "gap written, row " << r;
  }
  EXPECT_TRUE(bytes_equal(ys, want.ys));
  EXPECT_GT(total, 0);
}

TEST(PermuteQuantize, BadInputErrors) {
  const Case c{8, 2, 4, 200, 16};
  RoutingPlan plan = allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, -1}, Device::cpu());
  build_plan(random_topk(c.T, c.K, c.E, 7), plan);
  const int64_t cap = plan.capacity_rows;
  Tensor x = make_tensor({c.T, c.H}, DType::kBFloat16);
  fill_random(x, 8);
  Tensor y = make_tensor({cap, c.H}, DType::kFloat8E4M3);
  Tensor ys = make_tensor({cap, 2}, DType::kFloat32);
  const QuantizeConfig cfg{};
  EXPECT_EQ(message_of([&] { permute_quantize(x, plan, y, ys, cfg); }), "no error");

  Tensor ybf = make_tensor({cap, c.H}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { permute_quantize(x, plan, ybf, ys, cfg); }).find("y must be float8_e4m3"),
            std::string::npos)
      << message_of([&] { permute_quantize(x, plan, ybf, ys, cfg); });
  Tensor y52 = make_tensor({cap, c.H}, DType::kFloat8E5M2);
  EXPECT_NE(message_of([&] { permute_quantize(x, plan, y52, ys, cfg); }).find("y must be float8_e4m3"),
            std::string::npos);
  Tensor ys1 = make_tensor({cap, 1}, DType::kFloat32);
  const std::string want_ys = "y_scales must be float32 [" + std::to_string(cap) + ",2] on cpu";
  EXPECT_NE(message_of([&] { permute_quantize(x, plan, y, ys1, cfg); }).find(want_ys), std::string::npos)
      << message_of([&] { permute_quantize(x, plan, y, ys1, cfg); });
  Tensor ysrows = make_tensor({c.T, 2}, DType::kFloat32);
  EXPECT_NE(message_of([&] { permute_quantize(x, plan, y, ysrows, cfg); }).find(want_ys), std::string::npos);
  Tensor ysbf = make_tensor({cap, 2}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { permute_quantize(x, plan, y, ysbf, cfg); }).find(want_ys), std::string::npos);

  const QuantizeConfig bad{DType::kFloat8E4M3, QuantScaling::kBlock128x128, false, false};
  EXPECT_NE(message_of([&] {
              permute_quantize(x, plan, y, ys, bad);
            }).find("QuantizeConfig.scaling must be kBlock1x128 (1x128 rowwise) or kTensorwise"),
            std::string::npos);
  // kTensorwise takes one scale (test_permute_quantize_tensorwise.cpp).
  const QuantizeConfig tw{DType::kFloat8E4M3, QuantScaling::kTensorwise, false, false};
  EXPECT_NE(message_of([&] {
              permute_quantize(x, plan, y, ys, tw);
            }).find("y_scales must be float32 [1]"),
            std::string::npos);
  // columnwise: the transposed form's shapes (test_permute_quantize_columnwise.cpp)
  const QuantizeConfig colwise{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, true};
  EXPECT_NE(message_of([&] {
              permute_quantize(x, plan, y, ys, colwise);
            }).find("y must be float8_e4m3 [200," + std::to_string(cap) + "]"),
            std::string::npos);
  const QuantizeConfig not_fp8{DType::kBFloat16, QuantScaling::kBlock1x128, false, false};
  EXPECT_NE(message_of([&] { permute_quantize(x, plan, y, ys, not_fp8); })
                .find("QuantizeConfig.out must be float8_e4m3 or float8_e5m2"),
            std::string::npos);

  Tensor x8 = make_tensor({c.T, c.H}, DType::kFloat8E4M3);
  EXPECT_NE(message_of([&] { permute_quantize(x8, plan, y, ys, cfg); })
                .find("x must be float32, bfloat16 or float16"),
            std::string::npos);
  Tensor scales = make_tensor({c.T, 2}, DType::kFloat32);
  Tensor pscales = make_tensor({cap, 2}, DType::kFloat32);
  EXPECT_NE(message_of([&] { permute_quantize(x, plan, y, ys, cfg, PermuteExtras{{}, {}, scales, pscales}); })
                .find("scales and permuted_scales must be empty"),
            std::string::npos);
  Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
  EXPECT_NE(message_of([&] { permute_quantize(x, plan, y, ys, cfg, PermuteExtras{probs, {}, {}, {}}); })
                .find("probs and permuted_probs must be given together"),
            std::string::npos);
}

// The definition of unpermute_backward_quantize: unpermute_backward into a
// [capacity,H] buffer of dout's dtype, then quantize of its rows < total_rows.
Outputs run_bwd_composed(TensorView dout, const RoutingPlan& plan, const QuantizeConfig& cfg,
                         const Tensor& probs) {
  const int64_t H = dout.shape[1];
  Tensor tmp = poisoned({plan.capacity_rows, H}, dout.dtype);
  unpermute_backward(dout, plan, {}, probs.defined() ? TensorView(probs) : TensorView{}, tmp);
  Outputs o{poisoned({plan.capacity_rows, H}, cfg.out),
            poisoned({plan.capacity_rows, blocks128(H)}, DType::kFloat32), Tensor{}};
  const int64_t total = plan_status(plan).total_rows;
  if (total > 0) {
    const auto rows = TensorView::strided(tmp.data(), dout.dtype, Device::cpu(), {total, H}, {H, 1});
    const auto q = TensorView::strided(o.y.data(), cfg.out, Device::cpu(), {total, H}, {H, 1});
    const auto sc = TensorView::strided(o.ys.data(), DType::kFloat32, Device::cpu(),
                                        {total, blocks128(H)}, {blocks128(H), 1});
    quantize(rows, cfg, q, sc);
  }
  return o;
}

TEST(UnpermuteBackwardQuantize, EqualsUnpermuteBackwardThenQuantizeBitwise) {
  uint32_t seed = 3000;
  for (const PqCase& pc : kPqCases) {
    const Case& c = pc.c;
    for (DType dt : {DType::kBFloat16, DType::kFloat32, DType::kFloat16}) {
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        for (bool with_probs : {false, true}) {
          const bool pow2 = (seed % 2) == 0;
          SCOPED_TRACE(name_of(c) + " cap=" + std::to_string(pc.capacity) + " " + dtype_name(dt) +
                       " -> " + dtype_name(out) + (pow2 ? " pow2" : "") +
                       (with_probs ? " probs" : ""));
          Tensor ids = random_topk(c.T, c.K, c.E, seed++, 1.0, 0.1);
          RoutingPlan plan =
              allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, pc.capacity}, Device::cpu());
          build_plan(ids, plan);
          Tensor dout = make_tensor({c.T, c.H}, dt);
          fill_random(dout, seed++, -4.0f, 4.0f);
          add_special_rows(dout);
          Tensor probs;
          if (with_probs) {
            probs = make_tensor({c.T, c.K}, DType::kFloat32);
            fill_random(probs, seed++, -2.0f, 2.0f);
          }
          const QuantizeConfig cfg{out, QuantScaling::kBlock1x128, pow2, false};
          Outputs got{poisoned({plan.capacity_rows, c.H}, out),
                      poisoned({plan.capacity_rows, blocks128(c.H)}, DType::kFloat32), Tensor{}};
          unpermute_backward_quantize(dout, plan, with_probs ? TensorView(probs) : TensorView{},
                                      got.y, got.ys, cfg);
          Outputs want = run_bwd_composed(dout, plan, cfg, probs);
          EXPECT_TRUE(bytes_equal(got.y, want.y));
          EXPECT_TRUE(bytes_equal(got.ys, want.ys));
          const int64_t total = plan_status(plan).total_rows;
          auto row_token = to_vec<int32_t>(plan.row_token);
          for (int64_t r = 0; r < plan.capacity_rows; ++r) {
            if (r >= total) {
              ASSERT_TRUE(row_is(got.y, r, 0xFF) && row_is(got.ys, r, 0xFF)) << "row " << r;
            } else if (row_token[r] < 0) {
              ASSERT_TRUE(row_is(got.y, r, 0)) << "pad row codes not 0: " << r;
              for (int64_t b = 0; b < blocks128(c.H); ++b)
                ASSERT_EQ(got.ys.data_ptr<float>()[r * blocks128(c.H) + b], 1.0f) << r;
            }
          }
        }
      }
    }
  }
}

TEST(UnpermuteBackwardQuantize, HandWorkedSlotScales) {
  // 2 tokens, top-2, 2 experts, align 16, H = 128; probs 1 and 0.5 for token 0.
  int32_t idv[] = {0, 1, 1, -1};
  Tensor ids = make_tensor({2, 2}, DType::kInt32);
  std::copy(idv, idv + 4, ids.data_ptr<int32_t>());
  RoutingPlan plan = allocate_plan(2, 2, PlanConfig{2, 16, -1}, Device::cpu());
  build_plan(ids, plan);
  const int64_t H = 128;
  Tensor dout = Tensor::zeros({2, H}, DType::kFloat32);
  dout.data_ptr<float>()[3] = 896.0f;       // token 0: amax 896
  dout.data_ptr<float>()[H + 7] = -448.0f;  // token 1: amax 448
  Tensor probs = make_tensor({2, 2}, DType::kFloat32);
  const float pv[] = {1.0f, 0.5f, 2.0f, 3.0f};
  std::copy(pv, pv + 4, probs.data_ptr<float>());
  const QuantizeConfig cfg{};
  Tensor y = poisoned({plan.capacity_rows, H}, DType::kFloat8E4M3);
  Tensor ys = poisoned({plan.capacity_rows, 1}, DType::kFloat32);
  unpermute_backward_quantize(dout, plan, probs, y, ys, cfg);
  // expert 0: token 0 (k0) -> row 0, pad 1..15; expert 1: token 0 (k1), token 1 (k0) -> 16, 17
  const float* s = ys.data_ptr<float>();
  const auto* q = static_cast<const uint8_t*>(y.data());
  EXPECT_EQ(s[0], 2.0f);   // 1 * 896 / 448
  EXPECT_EQ(s[16], 1.0f);  // 0.5 * 896 / 448
  EXPECT_EQ(s[17], 2.0f);  // 2 * 448 / 448
  EXPECT_EQ(q[0 * H + 3], 0x7E);
  EXPECT_EQ(q[16 * H + 3], 0x7E);
  EXPECT_EQ(q[17 * H + 7], 0xFE);  // -448
  EXPECT_EQ(s[1], 1.0f);           // a pad row: a zero block's scale
  EXPECT_TRUE(row_is(y, 1, 0));
  for (int64_t r = 32; r < plan.capacity_rows; ++r) EXPECT_TRUE(row_is(y, r, 0xFF)) << r;
}

TEST(UnpermuteBackwardQuantize, BadInputErrors) {
  const Case c{8, 2, 4, 200, 16};
  RoutingPlan plan = allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, -1}, Device::cpu());
  build_plan(random_topk(c.T, c.K, c.E, 9), plan);
  const int64_t cap = plan.capacity_rows;
  Tensor dout = make_tensor({c.T, c.H}, DType::kBFloat16);
  fill_random(dout, 10);
  Tensor y = make_tensor({cap, c.H}, DType::kFloat8E4M3);
  Tensor ys = make_tensor({cap, 2}, DType::kFloat32);
  const QuantizeConfig cfg{};
  EXPECT_EQ(message_of([&] { unpermute_backward_quantize(dout, plan, {}, y, ys, cfg); }), "no error");
  Tensor ybf = make_tensor({cap, c.H}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { unpermute_backward_quantize(dout, plan, {}, ybf, ys, cfg); })
                .find("dy must be float8_e4m3"),
            std::string::npos);
  Tensor ys1 = make_tensor({cap, 1}, DType::kFloat32);
  EXPECT_NE(message_of([&] { unpermute_backward_quantize(dout, plan, {}, y, ys1, cfg); })
                .find("dy_scales must be float32 [" + std::to_string(cap) + ",2] on cpu"),
            std::string::npos);
  Tensor probs_bad = make_tensor({c.T, c.K + 1}, DType::kFloat32);
  EXPECT_NE(message_of([&] { unpermute_backward_quantize(dout, plan, probs_bad, y, ys, cfg); })
                .find("probs must be float32 [8,2] on cpu"),
            std::string::npos);
  Tensor d8 = make_tensor({c.T, c.H}, DType::kFloat8E4M3);
  EXPECT_NE(message_of([&] { unpermute_backward_quantize(d8, plan, {}, y, ys, cfg); })
                .find("dout must be float32, bfloat16 or float16"),
            std::string::npos);
  const QuantizeConfig colwise{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, true};
  EXPECT_NE(message_of([&] { unpermute_backward_quantize(dout, plan, {}, y, ys, colwise); })
                .find("unpermute_backward_quantize: QuantizeConfig.columnwise must be false"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
