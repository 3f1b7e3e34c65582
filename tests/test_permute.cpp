// CPU permute/unpermute tests: hand-worked rows, random cases against naive
// formulas, backward ops against the adjoint identity and finite differences,
// side data (probs, scales, fp8 bytes), strided rows, edge shapes, bad input.
#include "test_util.h"

namespace moeflow::test {
namespace {

const std::vector<Case> kCases = {
    {0, 2, 4, 8, 16},   {1, 1, 1, 16, 1},    {1, 4, 8, 13, 32},   {17, 2, 8, 64, 16},
    {97, 8, 64, 24, 128}, {131, 4, 7, 33, 256}, {64, 2, 4, 0, 16},  {256, 8, 32, 40, 64},
};

RoutingPlan plan_for(const Case& c, uint32_t seed, double unrouted = 0.1) {
  Tensor ids = random_topk(c.T, c.K, c.E, seed, 1.0, unrouted);
  RoutingPlan plan = allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, -1}, Device::cpu());
  build_plan(ids, plan);
  return plan;
}

TEST(Permute, HandWorkedRowsPadsAndUntouchedTail) {
  // 3 tokens, top-2, 2 experts, align 16.
  int32_t idv[] = {1, 0, 0, -1, 1, 0};
  Tensor ids = make_tensor({3, 2}, DType::kInt32);
  std::copy(idv, idv + 6, ids.data_ptr<int32_t>());
  RoutingPlan plan = allocate_plan(3, 2, PlanConfig{2, 16, -1}, Device::cpu());
  build_plan(ids, plan);
  Tensor x = make_tensor({3, 4}, DType::kFloat32);
  for (int i = 0; i < 12; ++i) x.data_ptr<float>()[i] = static_cast<float>(i + 1);
  Tensor probs = make_tensor({3, 2}, DType::kFloat32);
  float pv[] = {0.6f, 0.4f, 1.0f, 0.0f, 0.7f, 0.3f};
  std::copy(pv, pv + 6, probs.data_ptr<float>());
  Tensor y = poisoned({plan.capacity_rows, 4}, DType::kFloat32);
  Tensor pp = poisoned({plan.capacity_rows}, DType::kFloat32);
  permute(x, plan, y, PermuteExtras{probs, pp, {}, {}});
  // expert 0: t0 (k1), t1 (k0), t2 (k1) -> rows 0..2, pad 3..15; expert 1: t0, t2 -> rows 16, 17
  const float* yv = y.data_ptr<float>();
  EXPECT_EQ(yv[0 * 4], 1.0f);
  EXPECT_EQ(yv[1 * 4], 5.0f);
  EXPECT_EQ(yv[2 * 4 + 3], 12.0f);
  for (int r = 3; r < 16; ++r) EXPECT_TRUE(row_is(y, r, 0)) << r;
  EXPECT_EQ(yv[16 * 4 + 1], 2.0f);
  EXPECT_EQ(yv[17 * 4 + 2], 11.0f);
  for (int r = 18; r < 32; ++r) EXPECT_TRUE(row_is(y, r, 0)) << r;
  for (int64_t r = 32; r < plan.capacity_rows; ++r) EXPECT_TRUE(row_is(y, r, 0xFF)) << r;
  EXPECT_EQ(pp.data_ptr<float>()[0], 0.4f);
  EXPECT_EQ(pp.data_ptr<float>()[1], 1.0f);
  EXPECT_EQ(pp.data_ptr<float>()[5], 0.0f);
  EXPECT_EQ(pp.data_ptr<float>()[16], 0.6f);

  Tensor out = poisoned({3, 4}, DType::kFloat32);
  unpermute(y, plan, out, probs);
  for (int h = 0; h < 4; ++h) {
    EXPECT_FLOAT_EQ(out.data_ptr<float>()[h], 1.0f * (h + 1));        // 0.6 + 0.4
    EXPECT_FLOAT_EQ(out.data_ptr<float>()[4 + h], 1.0f * (h + 5));    // 1.0 (k1 unrouted)
    EXPECT_FLOAT_EQ(out.data_ptr<float>()[8 + h], 1.0f * (h + 9));    // 0.7 + 0.3
  }
}

TEST(Permute, RandomCasesAgainstNaiveFormulas) {
  uint32_t seed = 10;
  for (const Case& c : kCases) {
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(name_of(c) + " " + dtype_name(dt));
      RoutingPlan plan = plan_for(c, seed++);
      auto dest = to_vec<int64_t>(plan.dest_row);
      Tensor x = make_tensor({c.T, c.H}, dt);
      fill_random(x, seed++);
      Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
      fill_random(probs, seed++, 0.0f, 1.0f);
      Tensor y = poisoned({plan.capacity_rows, c.H}, dt);
      Tensor pp = poisoned({plan.capacity_rows}, DType::kFloat32);
      permute(x, plan, y, PermuteExtras{probs, pp, {}, {}});
      const int64_t total = plan_status(plan).total_rows;
      auto row_token = to_vec<int32_t>(plan.row_token);
      for (int64_t r = 0; r < plan.capacity_rows; ++r) {
        if (r >= total) {
          ASSERT_TRUE(row_is(y, r, 0xFF)) << "row past total_rows written: " << r;
        } else if (row_token[r] < 0) {
          ASSERT_TRUE(row_is(y, r, 0)) << "pad row not zero: " << r;
          ASSERT_EQ(pp.data_ptr<float>()[r], 0.0f);
        } else {
          for (int64_t h = 0; h < c.H; ++h) ASSERT_EQ(at(y, r * c.H + h), at(x, row_token[r] * c.H + h));
        }
      }
      // unpermute: naive double-precision weighted sum.
      for (DType out_dt : {DType::kFloat32, dt}) {
        Tensor out = poisoned({c.T, c.H}, out_dt);
        unpermute(y, plan, out, probs);
        Tensor want = make_tensor({c.T, c.H}, DType::kFloat32);
        for (int64_t t = 0; t < c.T; ++t)
          for (int64_t h = 0; h < c.H; ++h) {
            double s = 0;
            for (int k = 0; k < c.K; ++k)
              if (dest[t * c.K + k] >= 0)
                s += double(probs.data_ptr<float>()[t * c.K + k]) * at(y, dest[t * c.K + k] * c.H + h);
            want.data_ptr<float>()[t * c.H + h] = static_cast<float>(s);
          }
        EXPECT_TRUE(all_close(out, want, tolerance(out_dt)));
      }
    }
  }
}

TEST(Permute, RoundTripGivesInputTimesSumOfProbs) {
  Case c{301, 4, 16, 48, 32};
  RoutingPlan plan = plan_for(c, 5, 0.0);
  Tensor x = make_tensor({c.T, c.H}, DType::kFloat32);
  fill_random(x, 6);
  Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
  fill_random(probs, 7, 0.0f, 1.0f);
  Tensor y = poisoned({plan.capacity_rows, c.H}, DType::kFloat32);
  permute(x, plan, y);
  Tensor out = poisoned({c.T, c.H}, DType::kFloat32);
  unpermute(y, plan, out, probs);
  for (int64_t t = 0; t < c.T; ++t) {
    double s = 0;
    for (int k = 0; k < c.K; ++k) s += probs.data_ptr<float>()[t * c.K + k];
    for (int64_t h = 0; h < c.H; ++h)
      ASSERT_NEAR(out.data_ptr<float>()[t * c.H + h], s * x.data_ptr<float>()[t * c.H + h], 1e-5);
  }
}

TEST(Permute, MaskFormUsesTEProbs) {
  const int64_t T = 50, E = 8, H = 16;
  Tensor mask = random_mask(T, E, 2, 9);
  RoutingPlan plan = allocate_plan(T, E, PlanConfig{E, 16, -1}, Device::cpu());
  build_plan_from_mask(mask, plan);
  Tensor x = make_tensor({T, H}, DType::kBFloat16);
  fill_random(x, 10);
  Tensor probs = make_tensor({T, E}, DType::kFloat32);  // the Megatron [T,E] probs
  fill_random(probs, 11, 0.0f, 1.0f);
  Tensor y = poisoned({plan.capacity_rows, H}, DType::kBFloat16);
  Tensor pp = poisoned({plan.capacity_rows}, DType::kFloat32);
  permute(x, plan, y, PermuteExtras{probs, pp, {}, {}});
  auto offsets = to_vec<int64_t>(plan.expert_row_offsets);
  auto row_token = to_vec<int32_t>(plan.row_token);
  for (int e = 0; e < E; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      if (row_token[r] >= 0) {
        ASSERT_TRUE(mask.data_ptr<uint8_t>()[row_token[r] * E + e]);
        ASSERT_EQ(pp.data_ptr<float>()[r], probs.data_ptr<float>()[row_token[r] * E + e]);
      }
}

TEST(Permute, ScalesAndFp8BytesTravelWithRows) {
  Case c{77, 4, 8, 256, 32};
  RoutingPlan plan = plan_for(c, 12);
  for (DType xdt : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    for (auto [sdt, S] : std::vector<std::pair<DType, int64_t>>{{DType::kFloat32, 2},    // 1x128
                                                                {DType::kUInt8, 8}}) {  // MXFP8 1x32
      Tensor x = make_tensor({c.T, c.H}, xdt);
      fill_random(x, 13);
      Tensor scales = make_tensor({c.T, S}, sdt);
      fill_random(scales, 14);
      Tensor y = poisoned({plan.capacity_rows, c.H}, xdt);
      Tensor ys = poisoned({plan.capacity_rows, S}, sdt);
      permute(x, plan, y, PermuteExtras{{}, {}, scales, ys});
      const int64_t total = plan_status(plan).total_rows;
      auto row_token = to_vec<int32_t>(plan.row_token);
      const size_t sb = S * dtype_size(sdt);
      for (int64_t r = 0; r < total; ++r) {
        if (row_token[r] < 0) {
          ASSERT_TRUE(row_is(y, r, 0));
          ASSERT_TRUE(row_is(ys, r, 0));
        } else {
          ASSERT_EQ(0, std::memcmp(static_cast<uint8_t*>(y.data()) + r * c.H,
                                   static_cast<uint8_t*>(x.data()) + row_token[r] * c.H, c.H));
          ASSERT_EQ(0, std::memcmp(static_cast<uint8_t*>(ys.data()) + r * sb,
                                   static_cast<uint8_t*>(scales.data()) + row_token[r] * sb, sb));
        }
      }
    }
  }
}

TEST(Permute, StridedRows) {
  Case c{40, 2, 4, 20, 16};
  RoutingPlan plan = plan_for(c, 15);
  Tensor xbuf = make_tensor({c.T, 32}, DType::kBFloat16);
  fill_random(xbuf, 16);
  auto x = TensorView::strided(xbuf.data(), DType::kBFloat16, Device::cpu(), {c.T, c.H}, {32, 1});
  Tensor xc = make_tensor({c.T, c.H}, DType::kBFloat16);
  for (int64_t t = 0; t < c.T; ++t)
    std::memcpy(xc.data_ptr<uint16_t>() + t * c.H, xbuf.data_ptr<uint16_t>() + t * 32, c.H * 2);
  Tensor y1 = poisoned({plan.capacity_rows, c.H}, DType::kBFloat16);
  Tensor y2 = poisoned({plan.capacity_rows, c.H}, DType::kBFloat16);
  permute(x, plan, y1);
  permute(xc, plan, y2);
  EXPECT_TRUE(bytes_equal(y1, y2));
}

// <permute(x), dy> == <x, permute_backward(dy)>, and dprobs gathers dpermuted_probs.
TEST(PermuteBackward, AdjointIdentityAndProbsGather) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(name_of(c));
    RoutingPlan plan = plan_for(c, 20 + c.T);
    const int64_t total = plan_status(plan).total_rows;
    Tensor x = make_tensor({c.T, c.H}, DType::kFloat32);
    fill_random(x, 21);
    Tensor y = Tensor::zeros({plan.capacity_rows, c.H}, DType::kFloat32);
    permute(x, plan, y);
    Tensor dy = Tensor::zeros({plan.capacity_rows, c.H}, DType::kFloat32);
    Tensor dyr = make_tensor({total, c.H}, DType::kFloat32);
    fill_random(dyr, 22);
    std::memcpy(dy.data(), dyr.data(), dyr.nbytes());
    Tensor dpp = make_tensor({plan.capacity_rows}, DType::kFloat32);
    fill_random(dpp, 23);
    Tensor dx = poisoned({c.T, c.H}, DType::kFloat32);
    Tensor dprobs = poisoned({c.T, c.K}, DType::kFloat32);
    permute_backward(dy, plan, dx, dpp, dprobs);
    double lhs = 0, rhs = 0;
    for (int64_t i = 0; i < total * c.H; ++i) lhs += double(y.data_ptr<float>()[i]) * dy.data_ptr<float>()[i];
    for (int64_t i = 0; i < c.T * c.H; ++i) rhs += double(x.data_ptr<float>()[i]) * dx.data_ptr<float>()[i];
    EXPECT_NEAR(lhs, rhs, 1e-4 * (1 + std::fabs(lhs)));
    auto dest = to_vec<int64_t>(plan.dest_row);
    for (int64_t s = 0; s < c.T * c.K; ++s)
      ASSERT_EQ(dprobs.data_ptr<float>()[s], dest[s] >= 0 ? dpp.data_ptr<float>()[dest[s]] : 0.0f);
  }
}

// L(y, w) = <unpermute(y, w), dout>: dy by the adjoint identity, dprobs by
// central finite differences (L is linear in w, so they are exact up to rounding).
TEST(UnpermuteBackward, AdjointAndFiniteDifferences) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(name_of(c));
    RoutingPlan plan = plan_for(c, 30 + c.T);
    const int64_t total = plan_status(plan).total_rows;
    auto row_token = to_vec<int32_t>(plan.row_token);
    Tensor x = make_tensor({c.T, c.H}, DType::kFloat32);
    fill_random(x, 31);
    Tensor y = poisoned({plan.capacity_rows, c.H}, DType::kFloat32);
    permute(x, plan, y);
    for (int64_t r = 0; r < total; ++r)  // make rows differ from their token
      for (int64_t h = 0; h < c.H; ++h) y.data_ptr<float>()[r * c.H + h] *= 1.0f + 0.01f * (r % 7);
    Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
    fill_random(probs, 32, 0.0f, 1.0f);
    Tensor dout = make_tensor({c.T, c.H}, DType::kFloat32);
    fill_random(dout, 33);
    Tensor dy = poisoned({plan.capacity_rows, c.H}, DType::kFloat32);
    Tensor dprobs = poisoned({c.T, c.K}, DType::kFloat32);
    unpermute_backward(dout, plan, y, probs, dy, dprobs);
    for (int64_t r = 0; r < total; ++r)
      if (row_token[r] < 0) ASSERT_TRUE(row_is(dy, r, 0)) << "pad row of dy not zero";
    for (int64_t r = total; r < plan.capacity_rows; ++r) ASSERT_TRUE(row_is(dy, r, 0xFF));

    auto loss = [&](const Tensor& w) {
      Tensor out = make_tensor({c.T, c.H}, DType::kFloat32);
      unpermute(y, plan, out, w);
      double l = 0;
      for (int64_t i = 0; i < c.T * c.H; ++i) l += double(out.data_ptr<float>()[i]) * dout.data_ptr<float>()[i];
      return l;
    };
    // adjoint: <y, dy> == L(y, w) over the used rows
    double lhs = 0;
    for (int64_t r = 0; r < total; ++r)
      if (row_token[r] >= 0)
        for (int64_t h = 0; h < c.H; ++h)
          lhs += double(y.data_ptr<float>()[r * c.H + h]) * dy.data_ptr<float>()[r * c.H + h];
    EXPECT_NEAR(lhs, loss(probs), 1e-4 * (1 + std::fabs(lhs)));
    // finite differences on a few probs
    for (int64_t s = 0; s < std::min<int64_t>(c.T * c.K, 12); ++s) {
      Tensor wp = probs.to(Device::cpu()), wm = probs.to(Device::cpu());
      const float eps = 0.25f;
      wp.data_ptr<float>()[s] += eps;
      wm.data_ptr<float>()[s] -= eps;
      const double fd = (loss(wp) - loss(wm)) / (2 * eps);
      EXPECT_NEAR(dprobs.data_ptr<float>()[s], fd, 1e-4 * (1 + std::fabs(fd))) << "slot " << s;
    }
  }
}

TEST(Permute, BadInputErrors) {
  Case c{8, 2, 4, 16, 16};
  RoutingPlan plan = plan_for(c, 40);
  Tensor x = make_tensor({c.T, c.H}, DType::kBFloat16);
  Tensor y = make_tensor({plan.capacity_rows, c.H}, DType::kBFloat16);
  Tensor ybad = make_tensor({plan.capacity_rows - 16, c.H}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { permute(x, plan, ybad); }).find("y must be bfloat16 [80,16] on cpu, got bfloat16 [64,16]"),
            std::string::npos)
      << message_of([&] { permute(x, plan, ybad); });
  Tensor yf = make_tensor({plan.capacity_rows, c.H}, DType::kFloat32);
  EXPECT_NE(message_of([&] { permute(x, plan, yf); }).find("y must be bfloat16"), std::string::npos);
  Tensor probs_bf = make_tensor({c.T, c.K}, DType::kBFloat16);
  Tensor pp = make_tensor({plan.capacity_rows}, DType::kFloat32);
  EXPECT_NE(message_of([&] { permute(x, plan, y, PermuteExtras{probs_bf, pp, {}, {}}); })
                .find("probs must be float32 [8,2] on cpu, got bfloat16 [8,2] on cpu"),
            std::string::npos);
  EXPECT_NE(message_of([&] { permute(x, plan, y, PermuteExtras{probs_bf, {}, {}, {}}); })
                .find("probs and permuted_probs must be given together"),
            std::string::npos);
  Tensor xi = make_tensor({c.T, c.H}, DType::kInt32);
  EXPECT_NE(message_of([&] { permute(xi, plan, y); }).find("x must be float32, bfloat16, float16, float8_e4m3 or float8_e5m2"),
            std::string::npos);
  // mismatched device (never dereferenced: the check comes first)
  TensorView xg(x.data(), DType::kBFloat16, Device::cuda(0), {c.T, c.H});
  EXPECT_NE(message_of([&] { permute(xg, plan, y); }).find("x must be float32, bfloat16, float16, float8_e4m3 or float8_e5m2 [8,16] on cpu, got bfloat16 [8,16] on cuda:0"),
            std::string::npos);
  // non-unit inner stride
  auto xs = TensorView::strided(x.data(), DType::kBFloat16, Device::cpu(), {c.T, c.H / 2}, {c.H, 2});
  Tensor y2 = make_tensor({plan.capacity_rows, c.H / 2}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { permute(xs, plan, y2); }).find("x must have unit stride in its last dim"),
            std::string::npos);
  // unpermute: fp8 input is not summable; out of the wrong token count
  Tensor y8 = make_tensor({plan.capacity_rows, c.H}, DType::kFloat8E4M3);
  Tensor out = make_tensor({c.T, c.H}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { unpermute(y8, plan, out); }).find("y must be float32, bfloat16 or float16"),
            std::string::npos);
  Tensor outbad = make_tensor({c.T + 1, c.H}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { unpermute(y, plan, outbad); }).find("out must be float32, bfloat16 or float16 [8,16]"),
            std::string::npos);
  Tensor dprobs = make_tensor({c.T, c.K}, DType::kFloat32);
  Tensor dy = make_tensor({plan.capacity_rows, c.H}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { unpermute_backward(out, plan, {}, {}, dy, dprobs); }).find("dprobs needs y_fwd"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
