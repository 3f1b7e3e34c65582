// CPU tests of the tensorwise forms of permute_quantize and
// unpermute_backward_quantize against hand-built expectations (not the
// composition the reference is written as): one scale from the amax of the
// kept slots only (a large token routed nowhere stays out of it), each data
// row the codes of its token (times its slot's weight, rounded, in the
// backward form), code 0 on pad rows and on rows past total_rows, the
// transposed codes equal to the codes transposed, permuted_probs as permute
// writes them; bad input naming the argument.
#include <cmath>
#include <limits>

#include "core/quantize_backend.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

struct Routed {
  RoutingPlan plan;
  Tensor x;
  int64_t total = 0;
};

// T tokens, top-K of E, some slots unrouted and token 1 routed nowhere (and
// given the largest values).
Routed make_routed(const Case& c, int64_t capacity, DType dt, uint32_t seed) {
  Tensor ids = random_topk(c.T, c.K, c.E, seed, 1.0, 0.1);
  if (c.T > 1)
    for (int k = 0; k < c.K; ++k) ids.data_ptr<int32_t>()[c.K + k] = -1;
  Routed r;
  r.plan = allocate_plan(c.T, c.K, PlanConfig{c.E, c.align, capacity}, Device::cpu());
  build_plan(ids, r.plan);
  r.total = plan_status(r.plan).total_rows;
  r.x = make_tensor({c.T, c.H}, dt);
  fill_random(r.x, seed + 1, -4.0f, 4.0f);
  if (c.T > 1)
    for (int64_t h = 0; h < c.H; ++h) detail::store_float(r.x.data(), dt, c.H + h, 512.0f);
  return r;
}

// The expected codes of row r (value v(t, k, h) of its slot), code 0 on every
// row without a slot; the scale from the kept slots' values.
template <typename V>
void expect_codes(const Routed& r, const Case& c, const QuantizeConfig& cfg, const Tensor& y,
                  const Tensor& scale, const Tensor& y_t, V value) {
  const RoutingPlan& p = r.plan;
  const auto* dest = p.dest_row.data_ptr<int64_t>();
  float amax = 0.0f;
  for (int64_t t = 0; t < c.T; ++t)
    for (int k = 0; k < c.K; ++k)
      if (dest[t * c.K + k] >= 0)
        for (int64_t h = 0; h < c.H; ++h)
          amax = quant::amax_join(amax, quant::amax_term(value(t, k, h)));
  const bool e4 = cfg.out == DType::kFloat8E4M3;
  const float s = quant::scale_of(amax, e4, cfg.pow2_scales);
  ASSERT_EQ(scale.data_ptr<float>()[0], s);
  if (c.T > 1) ASSERT_LT(amax, 500.0f) << "a token routed nowhere entered the scale";
  std::vector<uint8_t> want(static_cast<size_t>(p.capacity_rows * c.H), 0);
  for (int64_t t = 0; t < c.T; ++t)
    for (int k = 0; k < c.K; ++k) {
      const int64_t row = dest[t * c.K + k];
      if (row < 0) continue;
      for (int64_t h = 0; h < c.H; ++h)
        want[static_cast<size_t>(row * c.H + h)] =
            cpu::float_to_fp8(quant::div_rn(value(t, k, h), s), e4);
    }
  const auto* got = static_cast<const uint8_t*>(y.data());
  for (int64_t i = 0; i < p.capacity_rows * c.H; ++i)
    ASSERT_EQ(got[i], want[static_cast<size_t>(i)]) << "row " << i / c.H << " col " << i % c.H;
  if (!y_t.defined()) return;
  const auto* gt = static_cast<const uint8_t*>(y_t.data());
  for (int64_t row = 0; row < p.capacity_rows; ++row)
    for (int64_t h = 0; h < c.H; ++h)
      ASSERT_EQ(gt[h * p.capacity_rows + row], want[static_cast<size_t>(row * c.H + h)])
          << "y_t[" << h << "][" << row << "]";
}

const std::vector<std::pair<Case, int64_t>> kCases = {
    {{64, 2, 4, 200, 16}, -1}, {{97, 8, 16, 256, 16}, -1}, {{120, 8, 16, 136, 16}, 256},
    {{33, 1, 4, 40, 128}, -1}, {{40, 40, 64, 64, 16}, -1}, {{0, 2, 4, 64, 16}, -1},
};

TEST(PermuteQuantizeTensorwise, OneScaleFromTheKeptSlotsCodesZeroElsewhere) {
  uint32_t seed = 7000;
  for (const auto& [c, capacity] : kCases) {
    for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
      for (const QuantizeConfig cfg :
           {QuantizeConfig{DType::kFloat8E4M3, QuantScaling::kTensorwise},
            QuantizeConfig{DType::kFloat8E5M2, QuantScaling::kTensorwise, true}}) {
        SCOPED_TRACE(name_of(c) + " " + dtype_name(dt) + " -> " + dtype_name(cfg.out));
        Routed r = make_routed(c, capacity, dt, seed);
        seed += 2;
        const int64_t cap = r.plan.capacity_rows;
        Tensor probs = make_tensor({c.T, c.K}, DType::kFloat32);
        fill_random(probs, seed++, 0.0f, 1.0f);
        Tensor y = poisoned({cap, c.H}, cfg.out), scale = poisoned({1}, DType::kFloat32);
        Tensor y_t = poisoned({c.H, cap}, cfg.out), pp = poisoned({cap}, DType::kFloat32);
        permute_quantize(r.x, r.plan, y, scale, y_t, cfg, PermuteExtras{probs, pp, {}, {}});
        expect_codes(r, c, cfg, y, scale, y_t, [&](int64_t t, int, int64_t h) {
          return detail::load_float(r.x.data(), dt, t * c.H + h);
        });
        // permuted_probs as permute writes them: rows past total_rows untouched.
        Tensor rows = make_tensor({cap, c.H}, dt), pp2 = poisoned({cap}, DType::kFloat32);
        permute(r.x, r.plan, rows, PermuteExtras{probs, pp2, {}, {}});
        EXPECT_TRUE(bytes_equal(pp, pp2));
        // Without the transposed output: the same codes and scale.
        Tensor y2 = poisoned({cap, c.H}, cfg.out), scale2 = poisoned({1}, DType::kFloat32);
        permute_quantize(r.x, r.plan, y2, scale2, cfg);
        EXPECT_TRUE(bytes_equal(y2, y));
        EXPECT_TRUE(bytes_equal(scale2, scale));
      }
    }
  }
}

TEST(UnpermuteBackwardQuantizeTensorwise, TheWeightedSlotsRoundedThenOneScale) {
  uint32_t seed = 8000;
  for (const auto& [c, capacity] : kCases) {
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      for (bool with_probs : {false, true}) {
        SCOPED_TRACE(name_of(c) + " " + dtype_name(dt) + (with_probs ? " probs" : ""));
        Routed r = make_routed(c, capacity, dt, seed);
        seed += 2;
        const int64_t cap = r.plan.capacity_rows;
        Tensor probs;
        if (with_probs) {
          probs = make_tensor({c.T, c.K}, DType::kFloat32);
          fill_random(probs, seed++, -2.0f, 2.0f);
        }
        const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kTensorwise};
        Tensor dy = poisoned({cap, c.H}, cfg.out), scale = poisoned({1}, DType::kFloat32);
        Tensor dy_t = poisoned({c.H, cap}, cfg.out);
        unpermute_backward_quantize(r.x, r.plan, with_probs ? TensorView(probs) : TensorView{}, dy,
                                    scale, dy_t, cfg);
        expect_codes(r, c, cfg, dy, scale, dy_t, [&](int64_t t, int k, int64_t h) {
          const float w = with_probs ? probs.data_ptr<float>()[t * c.K + k] : 1.0f;
          Tensor one = make_tensor({1}, dt);  // w * dout rounded to dout's dtype
          detail::store_float(one.data(), dt, 0,
                              w * detail::load_float(r.x.data(), dt, t * c.H + h));
          return detail::load_float(one.data(), dt, 0);
        });
      }
    }
  }
}

TEST(PermuteQuantizeTensorwise, BadInputErrors) {
  const Case c{8, 2, 4, 256, 16};
  Routed r = make_routed(c, -1, DType::kBFloat16, 9);
  const int64_t cap = r.plan.capacity_rows;
  const QuantizeConfig tw{DType::kFloat8E4M3, QuantScaling::kTensorwise};
  Tensor y = make_tensor({cap, c.H}, DType::kFloat8E4M3), s1 = make_tensor({1}, DType::kFloat32);
  Tensor y_t = make_tensor({c.H, cap}, DType::kFloat8E4M3);
  EXPECT_EQ(message_of([&] { permute_quantize(r.x, r.plan, y, s1, y_t, tw); }), "no error");
  EXPECT_EQ(message_of([&] { unpermute_backward_quantize(r.x, r.plan, {}, y, s1, y_t, tw); }),
            "no error");
  Tensor ys = make_tensor({cap, 2}, DType::kFloat32);
  EXPECT_NE(message_of([&] {
              permute_quantize(r.x, r.plan, y, ys, tw);
            }).find("y_scales must be float32 [1] on cpu"),
            std::string::npos)
      << message_of([&] { permute_quantize(r.x, r.plan, y, ys, tw); });
  Tensor bad_t = make_tensor({cap, c.H}, DType::kFloat8E4M3);
  const std::string want_t =
      "y_t must be float8_e4m3 [" + std::to_string(c.H) + "," + std::to_string(cap) + "] on cpu";
  EXPECT_NE(message_of([&] { permute_quantize(r.x, r.plan, y, s1, bad_t, tw); }).find(want_t),
            std::string::npos)
      << message_of([&] { permute_quantize(r.x, r.plan, y, s1, bad_t, tw); });
  const QuantizeConfig block{};
  EXPECT_NE(message_of([&] {
              permute_quantize(r.x, r.plan, y, s1, y_t, block);
            }).find("QuantizeConfig.scaling must be kTensorwise (with the transposed output)"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              unpermute_backward_quantize(r.x, r.plan, {}, y, ys, y_t, block);
            }).find("QuantizeConfig.scaling must be kTensorwise"),
            std::string::npos);
  // y_t over y's bytes.
  Tensor both = make_tensor({2 * cap, c.H}, DType::kFloat8E4M3);
  auto y_view =
      TensorView::strided(both.data(), DType::kFloat8E4M3, Device::cpu(), {cap, c.H}, {c.H, 1});
  auto t_view = TensorView::strided(static_cast<uint8_t*>(both.data()) + c.H, DType::kFloat8E4M3,
                                    Device::cpu(), {c.H, cap}, {cap, 1});
  EXPECT_NE(message_of([&] {
              permute_quantize(r.x, r.plan, y_view, s1, t_view, tw);
            }).find("y_t must not overlap the codes"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
