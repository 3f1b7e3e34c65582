// CPU router tests: hand-worked cases for each score function, pre_softmax,
// grouping, expert bias, scaling, ties, the aux and z losses; random cases
// against a naive top-k; backward against central finite differences of the
// forward; the non-finite policy; the expert-bias update; bad input. The
// padding mask and seq_aux_loss are in test_router_tokens.cpp, capacity
// dropping in test_router_capacity.cpp, float64 logits in test_router_f64.cpp.
#include "core/router_math.h"
#include "router_test_util.h"

namespace moeflow::test {
namespace {

TEST(Router, SoftmaxOverTheChosen) {
  Routed r = route(from({1, 3, 2, 0}, {1, 4}), softmax_cfg(4, 2));
  EXPECT_EQ(ints(r.ids), (std::vector<int32_t>{1, 2}));
  const double e = std::exp(1.0);
  expect_near_all(r.probs, {e / (e + 1), 1 / (e + 1)});
  EXPECT_EQ(ints(r.counts), (std::vector<int32_t>{0, 1, 1, 0}));
  EXPECT_EQ(ints(r.nonfinite), (std::vector<int32_t>{0}));
  EXPECT_EQ(floats(r.aux)[0], 0.0f);  // coefficient 0: written as 0
  EXPECT_EQ(floats(r.z)[0], 0.0f);
}

TEST(Router, PreSoftmax) {
  RouterConfig c = softmax_cfg(4, 2);
  c.pre_softmax = true;
  Routed r = route(from({1, 3, 2, 0}, {1, 4}), c);
  EXPECT_EQ(ints(r.ids), (std::vector<int32_t>{1, 2}));
  const double sum = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  expect_near_all(r.probs, {std::exp(3.0) / sum, std::exp(2.0) / sum});
}

TEST(Router, TiesRankTheLowerIdFirst) {
  Routed r = route(from({0, 0, 0, 0, 1, 2, 2, 1}, {2, 4}), softmax_cfg(4, 2));
  EXPECT_EQ(ints(r.ids), (std::vector<int32_t>{0, 1, 1, 2}));
  expect_near_all(r.probs, {0.5, 0.5, 0.5, 0.5});
  EXPECT_EQ(ints(r.counts), (std::vector<int32_t>{1, 2, 1, 0}));
}

TEST(Router, SigmoidRenormalisedWhenTopkAboveOne) {
  const float l3 = static_cast<float>(std::log(3.0));
  Tensor logits = from({0, l3, -l3, -5}, {1, 4});
  Routed r2 = route(logits, sigmoid_cfg(4, 2));
  EXPECT_EQ(ints(r2.ids), (std::vector<int32_t>{1, 0}));
  expect_near_all(r2.probs, {0.6, 0.4});
  Routed r1 = route(logits, sigmoid_cfg(4, 1));
  EXPECT_EQ(ints(r1.ids), (std::vector<int32_t>{1}));
  expect_near_all(r1.probs, {0.75});
}

TEST(Router, ExpertBiasChangesTheChoiceNotTheProbs) {
  const float l3 = static_cast<float>(std::log(3.0));
  Tensor logits = from({0, l3, -l3, -5}, {1, 4});
  // Routing scores 0.8, 0.75, 0.85, ~0.007: experts 2 then 0.
  Routed r = route(logits, sigmoid_cfg(4, 2), from({0.3f, 0, 0.6f, 0}, {4}));
  EXPECT_EQ(ints(r.ids), (std::vector<int32_t>{2, 0}));
  expect_near_all(r.probs, {0.25 / 0.75, 0.5 / 0.75});
  EXPECT_EQ(ints(r.counts), (std::vector<int32_t>{1, 0, 1, 0}));
}

TEST(Router, ScalingFactor) {
  Tensor logits = from({1, 3, 2, 0}, {1, 4});
  RouterConfig c = softmax_cfg(4, 2);
  c.topk_scaling_factor = 2.5f;
  Routed r = route(logits, c);
  const double e = std::exp(1.0);
  expect_near_all(r.probs, {2.5 * e / (e + 1), 2.5 / (e + 1)}, 2e-6);
  c.topk_scaling_factor = 0.0f;  // none
  expect_near_all(route(logits, c).probs, {e / (e + 1), 1 / (e + 1)});
}

TEST(Router, GroupLimited) {
  // Groups of 2; top-2 per group summed: g0 5, g1 8, g2 6.5, g3 4.5 -> g1, g2.
  Tensor logits = from({5, 0, 4, 4, 3, 3.5f, 0, 4.5f}, {1, 8});
  RouterConfig c = softmax_cfg(8, 4);
  Routed plain = route(logits, c);
  EXPECT_EQ(ints(plain.ids), (std::vector<int32_t>{0, 7, 2, 3}));
  c.num_groups = 4;
  c.group_topk = 2;
  Routed r = route(logits, c);
  EXPECT_EQ(ints(r.ids), (std::vector<int32_t>{2, 3, 5, 4}));
  const double s = 2 * std::exp(4.0) + std::exp(3.5) + std::exp(3.0);
  expect_near_all(r.probs,
                  {std::exp(4.0) / s, std::exp(4.0) / s, std::exp(3.5) / s, std::exp(3.0) / s});
  // One group, topk 2 of 2 groups: a group's score is its single best.
  c.topk = 2;
  Routed r2 = route(logits, c);  // g0 5, g3 4.5 win
  EXPECT_EQ(ints(r2.ids), (std::vector<int32_t>{0, 7}));
}

TEST(Router, GroupLimitedSigmoidWithBias) {
  // Sigmoid scores of 0: 0.5. The bias makes group 1 (experts 2, 3) win.
  Tensor logits = from({2, 1, 0, 0}, {1, 4});
  RouterConfig c = sigmoid_cfg(4, 2);
  c.num_groups = 2;
  c.group_topk = 1;
  EXPECT_EQ(ints(route(logits, c).ids), (std::vector<int32_t>{0, 1}));
  Routed r = route(logits, c, from({0, 0, 0.6f, 0.1f}, {4}));  // 1.7 > 0.88 + 0.73
  EXPECT_EQ(ints(r.ids), (std::vector<int32_t>{2, 3}));
  expect_near_all(r.probs, {0.5, 0.5});
}

TEST(Router, AuxLossSoftmax) {
  const float l3 = static_cast<float>(std::log(3.0));
  RouterConfig c = softmax_cfg(2, 1);
  c.aux_loss_coeff = 0.01f;
  // s = [0.5,0.5], [0.75,0.25]; both choose expert 0: counts [2,0].
  Routed r = route(from({0, 0, l3, 0}, {2, 2}), c);
  EXPECT_EQ(ints(r.counts), (std::vector<int32_t>{2, 0}));
  // E*coeff/(K*T*T) * (1.25 * 2) = 2*0.01/4 * 2.5
  EXPECT_NEAR(floats(r.aux)[0], 0.0125, 1e-8);
}

TEST(Router, AuxLossSigmoid) {
  const float l3 = static_cast<float>(std::log(3.0));
  RouterConfig c = sigmoid_cfg(2, 1);
  c.aux_loss_coeff = 0.1f;
  // sigmoid [0.5,0.75] normalised [0.4,0.6]; expert 1 chosen.
  Routed r = route(from({0, l3}, {1, 2}), c);
  EXPECT_EQ(ints(r.counts), (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(floats(r.aux)[0], 2 * 0.1 * 0.6, 1e-7);
}

TEST(Router, ZLoss) {
  const float l3 = static_cast<float>(std::log(3.0));
  RouterConfig c = softmax_cfg(2, 1);
  c.z_loss_coeff = 0.001f;
  Routed r = route(from({0, 0, l3, 0}, {2, 2}), c);
  const double ln2 = std::log(2.0);
  EXPECT_NEAR(floats(r.z)[0], 0.001 * 2.5 * ln2 * ln2, 1e-9);
}

TEST(Router, ZeroTokens) {
  RouterConfig c = softmax_cfg(4, 2);
  c.aux_loss_coeff = 0.01f;
  c.z_loss_coeff = 0.01f;
  Routed r = route(make_tensor({0, 4}, DType::kFloat32), c);
  EXPECT_EQ(ints(r.counts), (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ(floats(r.aux)[0], 0.0f);
  EXPECT_EQ(floats(r.z)[0], 0.0f);
  EXPECT_EQ(ints(r.nonfinite)[0], 0);
}

TEST(Router, ExactExpMatchesLibm) {
  // Relative error within 2 ulp on the normal range, one subnormal step below.
  for (float x = -103.0f; x < 88.0f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    const double got = router_math::exp_exact(x);
    const double tol = x > -87.0f ? 2.5e-7 * want : 1.5e-45;
    ASSERT_LE(std::fabs(got - want), tol) << "x=" << x;
  }
  EXPECT_EQ(router_math::exp_exact(-INFINITY), 0.0f);
  EXPECT_TRUE(std::isinf(router_math::exp_exact(INFINITY)));
  EXPECT_TRUE(std::isnan(router_math::exp_exact(NAN)));
}

TEST(Router, RandomAgainstNaiveTopk) {
  const int64_t T = 64;
  for (int E : {8, 64, 256}) {
    for (int K : {1, 2, 8}) {
      Tensor logits = make_tensor({T, E}, DType::kFloat32);
      fill_random(logits, 7 + E + K, -3.0f, 3.0f);
      // Equal logits in places, to exercise ties.
      for (int64_t t = 0; t < T; t += 3)
        logits.data_ptr<float>()[t * E + E - 1] = logits.data_ptr<float>()[t * E];
      Routed r = route(logits, softmax_cfg(E, K));
      std::vector<int32_t> counts(E, 0);
      for (int64_t t = 0; t < T; ++t) {
        const float* x = logits.data_ptr<float>() + t * E;
        std::vector<int> order(E);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return x[a] > x[b]; });
        double s = 0.0;
        for (int k = 0; k < K; ++k) s += std::exp(static_cast<double>(x[order[k]]) - x[order[0]]);
        for (int k = 0; k < K; ++k) {
          ASSERT_EQ(r.ids.data_ptr<int32_t>()[t * K + k], order[k]) << "t=" << t << " k=" << k;
          EXPECT_NEAR(r.probs.data_ptr<float>()[t * K + k],
                      std::exp(static_cast<double>(x[order[k]]) - x[order[0]]) / s, 1e-6);
          ++counts[order[k]];
        }
      }
      EXPECT_EQ(ints(r.counts), counts);
    }
  }
}

TEST(Router, NonFiniteLogits) {
  Tensor logits = from({NAN, 1, 0, 2, 0, 1, 2, 3}, {2, 4});
  Routed r = route(logits, softmax_cfg(4, 4));
  EXPECT_EQ(ints(r.nonfinite)[0], 1);
  // NaN ranks as -inf: last, with probability 0.
  EXPECT_EQ(ints(r.ids), (std::vector<int32_t>{3, 1, 2, 0, 3, 2, 1, 0}));
  EXPECT_EQ(r.probs.data_ptr<float>()[3], 0.0f);
  for (float p : floats(r.probs)) EXPECT_TRUE(std::isfinite(p));
  RouterConfig c = softmax_cfg(4, 2);
  c.pre_softmax = true;
  c.z_loss_coeff = 0.1f;
  c.aux_loss_coeff = 0.1f;
  Routed rp = route(logits, c);
  for (float p : floats(rp.probs)) EXPECT_TRUE(std::isfinite(p));
  EXPECT_TRUE(std::isfinite(floats(rp.aux)[0]));
  EXPECT_TRUE(std::isfinite(floats(rp.z)[0]));
  // The gradient at a NaN logit is 0, finite elsewhere.
  Tensor dprobs = from({1, 1, 1, 1}, {2, 2});
  Tensor daux = from({1}, {1}), dz = from({1}, {1});
  Tensor dl = make_tensor({2, 4}, DType::kFloat32);
  router_backward(logits, rp.ids, rp.counts, RouterGrads{dprobs, daux, dz}, c, dl);
  EXPECT_EQ(dl.data_ptr<float>()[0], 0.0f);
  for (float v : floats(dl)) EXPECT_TRUE(std::isfinite(v));
  // Sigmoid: NaN scores as sigmoid(-inf) = 0.
  Routed rs = route(logits, sigmoid_cfg(4, 2));
  EXPECT_EQ(ints(rs.ids), (std::vector<int32_t>{3, 1, 3, 2}));
  EXPECT_EQ(ints(rs.nonfinite)[0], 1);
}

// Loss = sum probs*g + daux*aux + dz*z, with the forward's choice.
TEST(Router, BackwardMatchesFiniteDifferences) {
  const int E = 8;
  std::vector<FdCase> cases = common_fd_cases(E, 0.3f, 0.2f, 0.0f);
  RouterConfig sm_grouped = softmax_cfg(E, 2);
  sm_grouped.num_groups = 2;
  sm_grouped.group_topk = 1;
  sm_grouped.aux_loss_coeff = 0.3f;
  sm_grouped.z_loss_coeff = 0.2f;
  cases.push_back({"softmax k2 grouped", sm_grouped, false});

  const int64_t T = 5;
  const float h = 1e-2f;
  for (const FdCase& fc : cases) {
    SCOPED_TRACE(fc.name);
    const RouterConfig& c = fc.config;
    Tensor logits = make_tensor({T, E}, DType::kFloat32);
    fill_random(logits, 11, -2.0f, 2.0f);
    Tensor bias = make_tensor({E}, DType::kFloat32);
    fill_random(bias, 12, -0.2f, 0.2f);
    Tensor g = make_tensor({T, c.topk}, DType::kFloat32);
    fill_random(g, 13);
    const float daux = 0.7f, dz = 1.3f;
    Tensor biasv = fc.bias ? bias : Tensor{};
    auto loss = [&](const Routed& r) {
      double l =
          daux * static_cast<double>(floats(r.aux)[0]) + dz * static_cast<double>(floats(r.z)[0]);
      for (int64_t i = 0; i < T * c.topk; ++i)
        l += static_cast<double>(r.probs.data_ptr<float>()[i]) * g.data_ptr<float>()[i];
      return l;
    };
    Routed base = route(logits, c, biasv);
    Tensor dl = make_tensor({T, E}, DType::kFloat32);
    fill_bytes(dl, 0xFF);
    router_backward(logits, base.ids, base.counts,
                    RouterGrads{g, from({daux}, {1}), from({dz}, {1})}, c, dl);
    int checked = 0;
    for (int64_t i = 0; i < T * E; ++i) {
      const float x0 = logits.data_ptr<float>()[i];
      logits.data_ptr<float>()[i] = x0 + h;
      Routed up = route(logits, c, biasv);
      logits.data_ptr<float>()[i] = x0 - h;
      Routed dn = route(logits, c, biasv);
      logits.data_ptr<float>()[i] = x0;
      if (ints(up.ids) != ints(base.ids) || ints(dn.ids) != ints(base.ids))
        continue;  // choice moved
      const double fd = (loss(up) - loss(dn)) / (2.0 * h);
      EXPECT_NEAR(dl.data_ptr<float>()[i], fd, 2e-3 + 2e-3 * std::fabs(fd)) << "element " << i;
      ++checked;
    }
    EXPECT_GT(checked, T * E / 2);
  }
}

TEST(Router, UpdateExpertBias) {
  Tensor counts = make_tensor({4}, DType::kInt32);
  int32_t cv[] = {4, 2, 3, 3};
  std::copy(cv, cv + 4, counts.data_ptr<int32_t>());
  Tensor bias = from({0.5f, 0.5f, 0.5f, -1.0f}, {4});
  router_update_expert_bias(counts, bias, 0.125f);  // mean 3
  EXPECT_EQ(floats(bias), (std::vector<float>{0.375f, 0.625f, 0.5f, -1.0f}));
}

TEST(Router, BadInput) {
  Tensor logits = make_tensor({3, 8}, DType::kFloat32);
  fill_random(logits, 1);
  Tensor ids = make_tensor({3, 2}, DType::kInt32), probs = make_tensor({3, 2}, DType::kFloat32);
  Tensor counts = make_tensor({8}, DType::kInt32), loss = make_tensor({1}, DType::kFloat32);
  const RouterOutputs out{ids, probs, counts, {}, {}, {}};
  auto run = [&](RouterConfig c, RouterOutputs o, TensorView lg, TensorView bias = {}) {
    return message_of([&] { router_forward(lg, c, o, bias); });
  };
  RouterConfig c = softmax_cfg(8, 2);
  EXPECT_EQ(run(c, out, logits), "no error");
  EXPECT_TRUE(
      has(run(softmax_cfg(8, 0), out, logits), "topk must be in [1, num_experts=8], got 0"));
  EXPECT_TRUE(
      has(run(softmax_cfg(8, 9), out, logits), "topk must be in [1, num_experts=8], got 9"));
  RouterConfig g = c;
  g.num_groups = 3;
  g.group_topk = 1;
  EXPECT_TRUE(has(run(g, out, logits), "num_groups must divide num_experts=8, got 3"));
  g.num_groups = 4;
  g.group_topk = 5;
  EXPECT_TRUE(has(run(g, out, logits), "group_topk must be in [1, num_groups=4], got 5"));
  g.group_topk = 0;
  EXPECT_TRUE(has(run(g, out, logits), "group_topk must be in [1, num_groups=4], got 0"));
  RouterConfig g3 = softmax_cfg(8, 3);
  g3.num_groups = 4;
  g3.group_topk = 2;
  EXPECT_TRUE(has(run(g3, out, logits), "topk must be a multiple of group_topk=2, got 3"));
  RouterConfig g4 = softmax_cfg(8, 4);
  g4.num_groups = 4;
  g4.group_topk = 1;
  EXPECT_TRUE(has(run(g4, out, logits),
                  "topk must be <= group_topk * num_experts / num_groups = 2, got 4"));
  RouterConfig ps = sigmoid_cfg(8, 2);
  ps.pre_softmax = true;
  EXPECT_TRUE(has(run(ps, out, logits), "pre_softmax needs score_function kSoftmax"));
  Tensor half = make_tensor({3, 8}, DType::kFloat16);
  EXPECT_TRUE(has(run(c, out, half), "logits must be float32 or float64 [*,8]"));
  EXPECT_TRUE(has(run(c, out, half), "got float16 [3,8]"));
  EXPECT_TRUE(has(
      run(softmax_cfg(6, 2), RouterOutputs{ids, probs, make_tensor({6}, DType::kInt32)}, logits),
      "logits must be float32 or float64 [*,6]"));
  Tensor probs_bad = make_tensor({3, 3}, DType::kFloat32);
  EXPECT_TRUE(
      has(run(c, RouterOutputs{ids, probs_bad, counts}, logits), "probs must be float32 [3,2]"));
  EXPECT_TRUE(
      has(run(c, RouterOutputs{probs, probs, counts}, logits), "topk_ids must be int32 [3,2]"));
  EXPECT_TRUE(has(run(c, RouterOutputs{ids, probs, {}}, logits), "tokens_per_expert is required"));
  RouterConfig ca = c;
  ca.aux_loss_coeff = 0.01f;
  EXPECT_TRUE(has(run(ca, out, logits), "aux_loss is required"));
  RouterConfig cz = c;
  cz.z_loss_coeff = 0.01f;
  EXPECT_TRUE(has(run(cz, out, logits), "z_loss is required"));
  EXPECT_TRUE(has(run(c, out, logits, make_tensor({8}, DType::kFloat32)),
                  "expert_bias needs score_function kSigmoid"));
  EXPECT_TRUE(has(run(sigmoid_cfg(8, 2), out, logits, make_tensor({7}, DType::kFloat32)),
                  "expert_bias must be float32 [8]"));
  // Backward.
  Tensor dl = make_tensor({3, 8}, DType::kFloat32);
  EXPECT_TRUE(
      has(message_of([&] { router_backward(logits, ids, counts, RouterGrads{probs_bad}, c, dl); }),
          "dprobs must be float32 [3,2]"));
  EXPECT_TRUE(has(message_of([&] { router_backward(logits, ids, {}, RouterGrads{probs}, ca, dl); }),
                  "tokens_per_expert is required"));
  EXPECT_TRUE(
      has(message_of([&] { router_backward(logits, ids, counts, RouterGrads{probs}, c, probs); }),
          "dlogits must be float32 [3,8]"));
  EXPECT_TRUE(has(
      message_of([&] { router_update_expert_bias(counts, make_tensor({8}, DType::kInt32), 0.1f); }),
      "expert_bias must be float32 [8]"));
}

// router_split_bf16 on hand-worked values: v = 1 + 2^-9 + 2^-18 + 2^-23
// (parts 1, 2^-9, 2^-18 + 2^-23), 3 (3, 0, 0), -(1 + 2^-7 + 2^-8) (a tie,
// to even: -(1 + 2^-6), then +2^-8, 0) and inf (inf, NaN, NaN); both layouts.
TEST(RouterSplitBf16, HandWorkedPartsAndLayouts) {
  const float v[4] = {1.0f + std::ldexp(1.0f, -9) + std::ldexp(1.0f, -18) + std::ldexp(1.0f, -23),
                      3.0f, -(1.0f + std::ldexp(1.0f, -7) + std::ldexp(1.0f, -8)),
                      std::numeric_limits<float>::infinity()};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float part[4][3] = {
      {1.0f, std::ldexp(1.0f, -9), std::ldexp(1.0f, -18) + std::ldexp(1.0f, -23)},
      {3.0f, 0.0f, 0.0f},
      {-(1.0f + std::ldexp(1.0f, -6)), std::ldexp(1.0f, -8), 0.0f},
      {std::numeric_limits<float>::infinity(), nan, nan}};
  Tensor src = Tensor::empty({2, 2}, DType::kFloat32);
  std::copy(v, v + 4, src.data_ptr<float>());
  auto check = [&](const Tensor& dst, int64_t at, int element, int p) {
    const float got = detail::bf16_to_float(dst.data_ptr<uint16_t>()[at]);
    const float want = part[element][p];
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "element " << element << " part " << p;
    } else {
      EXPECT_EQ(got, want) << "element " << element << " part " << p;
    }
  };
  const int rows_parts[4] = {0, 1, 2, 0};
  Bf16SplitLayout rows;  // "0120", stacked along the rows: [8,2]
  rows.count = 4;
  Tensor d = poisoned({8, 2}, DType::kBFloat16);
  router_split_bf16(src, rows, d);
  for (int b = 0; b < 4; ++b)
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 2; ++c) check(d, (b * 2 + r) * 2 + c, r * 2 + c, rows_parts[b]);
  Bf16SplitLayout cols;  // "0001", side by side: [2,8]
  cols.count = 4;
  const int cols_parts[4] = {0, 0, 0, 1};
  std::copy(cols_parts, cols_parts + 4, cols.parts);
  cols.along_columns = true;
  Tensor e = poisoned({2, 8}, DType::kBFloat16);
  router_split_bf16(src, cols, e);
  for (int r = 0; r < 2; ++r)
    for (int b = 0; b < 4; ++b)
      for (int c = 0; c < 2; ++c) check(e, r * 8 + b * 2 + c, r * 2 + c, cols_parts[b]);
  // The three parts sum to each finite value exactly.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(part[i][0] + part[i][1] + part[i][2], v[i]);
}

TEST(RouterSplitBf16, BadInputNamesTheArgument) {
  Tensor src = make_tensor({3, 4}, DType::kFloat32);
  Bf16SplitLayout l;  // "012" along the rows: [9,4]
  auto msg = [&](const TensorView& s, const Bf16SplitLayout& layout, const TensorView& d) {
    return message_of([&] { router_split_bf16(s, layout, d); });
  };
  EXPECT_TRUE(
      has(msg(src, l, make_tensor({9, 5}, DType::kBFloat16)), "dst must be bfloat16 [9,4]"));
  EXPECT_TRUE(has(msg(src, l, make_tensor({9, 4}, DType::kFloat16)), "dst must be bfloat16 [9,4]"));
  EXPECT_TRUE(
      has(msg(make_tensor({3, 4}, DType::kBFloat16), l, make_tensor({9, 4}, DType::kBFloat16)),
          "src must be float32 [3,4]"));
  EXPECT_TRUE(has(msg(make_tensor({12}, DType::kFloat32), l, make_tensor({9, 4}, DType::kBFloat16)),
                  "src must be float32 [R,C]"));
  Bf16SplitLayout bad = l;
  bad.parts[1] = 3;
  EXPECT_TRUE(has(msg(src, bad, make_tensor({9, 4}, DType::kBFloat16)),
                  "layout.parts[1] must be 0, 1 or 2, got 3"));
  bad = l;
  bad.count = 5;
  EXPECT_TRUE(has(msg(src, bad, make_tensor({15, 4}, DType::kBFloat16)),
                  "layout.count must be in [1, 4], got 5"));
}

}  // namespace
}  // namespace moeflow::test
