// The public grouped-MLP API (moeflow/grouped_mlp.h) on a given device
// against the float64 reference (cpu/grouped_mlp.h): forward (y, saved h and
// a), backward dgrad (dx, dprobs) and delayed wgrad (dW1, dW2, db1, db2, with
// and without accumulation), for every activation, halves and interleaved GLU
// rows, bias and probs on and off, experts with 0 and 1 rows and pad rows.
// Relative norm errors under the bf16 GEMM bound. Run on the CPU backend here
// (label cpu) and on the GPU by test_gpu (run_mlp_api_case with cuda:0).
// bf16 / fp16 weight gradients: bitwise the float32 ones rounded.
#include "test_mlp_api.h"

namespace moeflow::test {
namespace {

TEST(GroupedMlpApi, CpuMatchesReference) {
  uint32_t seed = 1;
  for (const MlpApiCase& c : mlp_api_cases()) run_mlp_api_case(c, Device::cpu(), seed++);
  uint32_t wide = 900;
  for (const MlpApiCase& c : mlp_api_wide_cases()) run_mlp_api_case(c, Device::cpu(), wide++);
}

// The GLU column map of the backends equals the reference's.
TEST(GroupedMlpApi, GluColumnsMatchReference) {
  for (int il : {0, 8, 16, 32, 64, 128}) {
    const int64_t F = 256;
    cpu::mlp::Shape s{1, 8, F};
    cpu::mlp::Config c;
    c.glu_interleave = il;
    for (int64_t j = 0; j < F; ++j) {
      ASSERT_EQ(glu_gate_col(j, il), cpu::mlp::gate_col(s, c, j)) << "il " << il << " j " << j;
      ASSERT_EQ(glu_up_col(j, il, F), cpu::mlp::up_col(s, c, j)) << "il " << il << " j " << j;
    }
  }
}

// FC1 alone and the activation's backward alone give, bitwise on the CPU,
// the forward's saved h and a and backward_dgrad's d_h and dprobs.
TEST(GroupedMlpApi, Fc1AndActivationBackwardAloneMatchTheMlp) {
  const DType dt = DType::kBFloat16;
  const int64_t E = 3, rows = 48, H = 32, F = 24;
  Tensor offs = make_tensor({E + 1}, DType::kInt64), real = make_tensor({E}, DType::kInt32);
  const int64_t o[] = {0, 16, 16, 48};
  const int32_t rr[] = {13, 0, 20};
  std::copy(o, o + E + 1, offs.data_ptr<int64_t>());
  std::copy(rr, rr + E, real.data_ptr<int32_t>());
  GroupLayout g;
  g.offsets = offs;
  g.real_rows = real;
  uint32_t seed = 40;
  for (Activation act : {Activation::kSwiGLU, Activation::kGelu})
    for (bool weighted : {false, true}) {
      SCOPED_TRACE(std::to_string(static_cast<int>(act)) + (weighted ? " probs" : ""));
      const int64_t N1 = is_gated(act) ? 2 * F : F;
      Tensor x = make_tensor({rows, H}, dt), w1 = make_tensor({E, N1, H}, dt),
             w2 = make_tensor({E, H, F}, dt), b1 = make_tensor({E, N1}, dt),
             probs = make_tensor({rows}, DType::kFloat32), dy = make_tensor({rows, H}, dt);
      fill_random(x, seed++);
      fill_random(w1, seed++, -0.3f, 0.3f);
      fill_random(w2, seed++, -0.3f, 0.3f);
      fill_random(b1, seed++);
      fill_random(probs, seed++, 0.1f, 1.0f);
      fill_random(dy, seed++);
      const TensorView pv = weighted ? TensorView(probs) : TensorView{};
      GroupedMlpWeights w{w1, w2, b1, {}};
      GroupedMlpConfig cfg;
      cfg.activation = act;
      Tensor h = Tensor::zeros({rows, N1}, dt), a = Tensor::zeros({rows, F}, dt),
             y = Tensor::zeros({rows, H}, dt);
      grouped_mlp_forward(x, w, g, pv, cfg, y, {h, a});
      Tensor h1 = Tensor::zeros({rows, N1}, dt), a1 = Tensor::zeros({rows, F}, dt),
             a2 = Tensor::zeros({rows, F}, dt);
      grouped_mlp_fc1_forward(x, w, g, pv, cfg, a1, h1);
      grouped_mlp_fc1_forward(x, w, g, pv, cfg, a2);  // without h
      EXPECT_TRUE(bytes_equal(h1, h)) << "h";
      EXPECT_TRUE(bytes_equal(a1, a)) << "a";
      EXPECT_TRUE(bytes_equal(a2, a)) << "a without h";

      Tensor dx = Tensor::zeros({rows, H}, dt), d_h = Tensor::zeros({rows, N1}, dt),
             dprobs = Tensor::zeros({rows}, DType::kFloat32);
      const TensorView dpv = weighted ? TensorView(dprobs) : TensorView{};
      grouped_mlp_backward_dgrad(dy, w, g, pv, cfg, {h, a}, dx, d_h, dpv);
      // d(a) = dy . W2_e into the last F columns, then the activation's backward
      Tensor d_h2 = Tensor::zeros({rows, N1}, dt), dprobs2 = Tensor::zeros({rows}, DType::kFloat32);
      const int64_t esz = static_cast<int64_t>(dtype_size(dt));
      TensorView d_a = TensorView::strided(static_cast<uint8_t*>(d_h2.data()) + (N1 - F) * esz, dt,
                                           Device::cpu(), {rows, F}, {N1, 1});
      grouped_gemm_dgrad(dy, GroupedWeights::from_stacked(w2), g, d_a);
      grouped_mlp_activation_backward(h, g, pv, cfg, d_h2,
                                      weighted ? TensorView(dprobs2) : TensorView{});
      EXPECT_TRUE(bytes_equal(d_h2, d_h)) << "d_h";
      if (weighted) EXPECT_TRUE(bytes_equal(dprobs2, dprobs)) << "dprobs";

      // backward_dgrad without dx, then backward_fc1_dgrad: the same bits.
      Tensor d_h3 = Tensor::zeros({rows, N1}, dt), dprobs3 = Tensor::zeros({rows}, DType::kFloat32),
             dx3 = Tensor::zeros({rows, H}, dt);
      grouped_mlp_backward_dgrad(dy, w, g, pv, cfg, {h, {}}, {}, d_h3,
                                 weighted ? TensorView(dprobs3) : TensorView{});
      EXPECT_TRUE(bytes_equal(d_h3, d_h)) << "d_h without dx";
      if (weighted) EXPECT_TRUE(bytes_equal(dprobs3, dprobs)) << "dprobs without dx";
      grouped_mlp_backward_fc1_dgrad(d_h3, w, g, cfg, dx3);
      EXPECT_TRUE(bytes_equal(dx3, dx)) << "dx from backward_fc1_dgrad";

      // Weight gradients in two calls (FC2's, then FC1's with only its own
      // operands) equal the joint call.
      Tensor dw1 = Tensor::zeros({E, N1, H}, DType::kFloat32),
             dw2 = Tensor::zeros({E, H, F}, DType::kFloat32),
             db1 = Tensor::zeros({E, N1}, DType::kFloat32);
      grouped_mlp_backward_wgrad(dy, x, g, {h, a}, d_h, GroupedMlpGrads{dw1, dw2, db1, {}});
      Tensor dw1s = Tensor::zeros({E, N1, H}, DType::kFloat32),
             dw2s = Tensor::zeros({E, H, F}, DType::kFloat32),
             db1s = Tensor::zeros({E, N1}, DType::kFloat32);
      grouped_mlp_backward_wgrad(dy, {}, g, {h, a}, {}, GroupedMlpGrads{{}, dw2s, {}, {}});
      grouped_mlp_backward_wgrad({}, x, g, {h, {}}, d_h, GroupedMlpGrads{dw1s, {}, db1s, {}});
      EXPECT_TRUE(bytes_equal(dw2s, dw2)) << "dw2 alone";
      EXPECT_TRUE(bytes_equal(dw1s, dw1)) << "dw1 alone";
      EXPECT_TRUE(bytes_equal(db1s, db1)) << "dbias1 alone";
      EXPECT_NE(message_of([&] {
                  grouped_mlp_backward_wgrad(dy, {}, g, {h, {}}, {},
                                             GroupedMlpGrads{{}, dw2s, {}, {}});
                }).find("grads.dw2 needs saved.a"),
                std::string::npos);
      EXPECT_NE(message_of([&] {
                  grouped_mlp_backward_wgrad({}, {}, g, {h, {}}, d_h,
                                             GroupedMlpGrads{dw1s, {}, {}, {}});
                }).find("grads.dw1 needs x"),
                std::string::npos);
    }
}

// backward_wgrad with bf16 / fp16 dw1 / dw2 (the weights' dtype, stacked or
// E separate tensors) equals, bitwise, the float32 gradients rounded once
// (accumulate: the start values + those, rounded again, as autograd's
// grad += g); dbias stays float32; other dtypes are named.
TEST(GroupedMlpApi, WgradHalfPrecisionGradsAreFloat32Rounded) {
  const int64_t E = 4, rows = 64, H = 32, F = 24, N1 = 2 * F;
  Tensor offs = make_tensor({E + 1}, DType::kInt64), real = make_tensor({E}, DType::kInt32);
  const int64_t o[] = {0, 16, 16, 40, 56};  // expert 1 empty; rows 56.. past the groups
  const int32_t rr[] = {13, 0, 24, 9};
  std::copy(o, o + E + 1, offs.data_ptr<int64_t>());
  std::copy(rr, rr + E, real.data_ptr<int32_t>());
  GroupLayout g;
  g.offsets = offs;
  g.real_rows = real;
  uint32_t seed = 70;
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor x = make_tensor({rows, H}, dt), dy = make_tensor({rows, H}, dt),
           a = make_tensor({rows, F}, dt), h = make_tensor({rows, N1}, dt),
           d_h = make_tensor({rows, N1}, dt);
    for (Tensor* t : {&x, &dy, &a, &h, &d_h}) fill_random(*t, seed++);
    auto rounded = [&](const Tensor& f32) {
      Tensor r = make_tensor(f32.sizes(), dt);
      for (int64_t i = 0; i < f32.numel(); ++i)
        detail::store_float(r.data(), dt, i, f32.data_ptr<float>()[i]);
      return r;
    };
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
      Tensor dw1_32 = make_tensor({E, N1, H}, DType::kFloat32),
             dw2_32 = make_tensor({E, H, F}, DType::kFloat32);
      Tensor dw1_h = make_tensor({E, N1, H}, dt), dw2_h = make_tensor({E, H, F}, dt);
      for (Tensor* t : {&dw1_32, &dw2_32, &dw1_h, &dw2_h}) fill_bytes(*t, 0xFF);
      Tensor init1 = make_tensor({E, N1, H}, dt), init2 = make_tensor({E, H, F}, dt);
      if (accumulate) {  // the 16-bit gradients start at these values
        fill_random(init1, seed++);
        fill_random(init2, seed++);
        std::memcpy(dw1_h.data(), init1.data(), init1.nbytes());
        std::memcpy(dw2_h.data(), init2.data(), init2.nbytes());
      }
      Tensor db1 = Tensor::zeros({E, N1}, DType::kFloat32),
             db2 = Tensor::zeros({E, H}, DType::kFloat32);
      GroupedMlpGrads g32{dw1_32, dw2_32, {}, {}, false};  // the float32 gradients, fresh
      grouped_mlp_backward_wgrad(dy, x, g, {h, a}, d_h, g32);
      // dw2 as E separate tensors (a pointer table over the stacked storage)
      Tensor ptrs = make_tensor({E}, DType::kInt64);
      for (int64_t e = 0; e < E; ++e)
        ptrs.data_ptr<int64_t>()[e] =
            reinterpret_cast<int64_t>(static_cast<uint8_t*>(dw2_h.data()) + e * H * F * 2);
      GroupedMlpGrads gh{dw1_h, {}, db1, db2, accumulate};
      gh.dw2_experts = GroupedWeights::from_pointers(ptrs, dt, H, F);
      grouped_mlp_backward_wgrad(dy, x, g, {h, a}, d_h, gh);
      const auto want = [&](const Tensor& fresh, const Tensor& init) {
        return wgrad_16bit(fresh, dt, accumulate ? &init : nullptr);
      };
      EXPECT_TRUE(bytes_equal(dw1_h, want(dw1_32, init1))) << "dw1";
      EXPECT_TRUE(bytes_equal(dw2_h, want(dw2_32, init2))) << "dw2";
      if (!accumulate)  // the empty expert: zeros
        for (int64_t i = N1 * H; i < 2 * N1 * H; ++i)
          ASSERT_EQ(reinterpret_cast<const uint16_t*>(dw1_h.data())[i], 0);
    }
    // other dtypes are named; dbias stays float32
    const DType other = dt == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
    Tensor dw1_bad = make_tensor({E, N1, H}, other);
    const std::string want = std::string("grads.dw1 must be float32 or ") + dtype_name(dt) +
                             " (the weights' dtype), got " + dtype_name(other);
    EXPECT_NE(message_of([&] {
                grouped_mlp_backward_wgrad(dy, x, g, {h, a}, d_h,
                                           GroupedMlpGrads{dw1_bad, {}, {}, {}, false});
              }).find(want),
              std::string::npos);
    Tensor ptrs = make_tensor({E}, DType::kInt64);
    GroupedMlpGrads bad_ptrs;
    bad_ptrs.dw2_experts = GroupedWeights::from_pointers(ptrs, DType::kInt32, H, F);
    EXPECT_NE(message_of([&] {
                grouped_mlp_backward_wgrad(dy, x, g, {h, a}, d_h, bad_ptrs);
              }).find("grads.dw2_experts must be float32 or"),
              std::string::npos);
    Tensor db_h = make_tensor({E, H}, dt);
    EXPECT_NE(message_of([&] {
                grouped_mlp_backward_wgrad(dy, x, g, {h, a}, d_h,
                                           GroupedMlpGrads{{}, {}, {}, db_h, false});
              }).find("grads.dbias2 must be float32"),
              std::string::npos);
  }
}

TEST(GroupedMlpApi, BadInputIsRejected) {
  Tensor x = make_tensor({16, 40}, DType::kBFloat16),
         w1 = make_tensor({2, 48, 40}, DType::kBFloat16);
  Tensor w2 = make_tensor({2, 40, 24}, DType::kBFloat16), offs = make_tensor({3}, DType::kInt64);
  Tensor y = make_tensor({16, 40}, DType::kBFloat16), h = make_tensor({16, 48}, DType::kBFloat16);
  Tensor a = make_tensor({16, 24}, DType::kBFloat16);
  GroupedMlpWeights w{w1, w2, {}, {}};
  GroupLayout g;
  g.offsets = offs;
  GroupedMlpConfig cfg;
  Tensor w1_bad = make_tensor({2, 40, 40}, DType::kBFloat16);
  EXPECT_NE(message_of([&] {
              grouped_mlp_forward(x, GroupedMlpWeights{w1_bad, w2, {}, {}}, g, {}, cfg, y, {h, a});
            }).find("w.fc1"),
            std::string::npos);
  // separate expert tensors: not together with the stacked weight, and of the right shape
  Tensor ptrs = make_tensor({2}, DType::kInt64);
  ptrs.data_ptr<int64_t>()[0] = reinterpret_cast<int64_t>(w1.data());
  ptrs.data_ptr<int64_t>()[1] = reinterpret_cast<int64_t>(w1.data());
  GroupedMlpWeights both = w;
  both.fc1_experts = GroupedWeights::from_pointers(ptrs, DType::kBFloat16, 48, 40);
  EXPECT_NE(message_of([&] {
              grouped_mlp_forward(x, both, g, {}, cfg, y, {h, a});
            }).find("exactly one"),
            std::string::npos);
  GroupedMlpWeights wrong{{}, w2, {}, {}};
  wrong.fc1_experts = GroupedWeights::from_pointers(ptrs, DType::kBFloat16, 40, 40);
  EXPECT_NE(message_of([&] {
              grouped_mlp_forward(x, wrong, g, {}, cfg, y, {h, a});
            }).find("w.fc1_experts must describe bfloat16 [48,40]"),
            std::string::npos);
  GroupedMlpWeights neither{{}, w2, {}, {}};
  EXPECT_NE(message_of([&] {
              grouped_mlp_forward(x, neither, g, {}, cfg, y, {h, a});
            }).find("w.fc1 or w.fc1_experts"),
            std::string::npos);
  cfg.glu_interleave = 7;
  EXPECT_NE(message_of([&] {
              grouped_mlp_forward(x, w, g, {}, cfg, y, {h, a});
            }).find("glu_interleave"),
            std::string::npos);
  cfg.glu_interleave = 0;
  Tensor a_bad = make_tensor({16, 20}, DType::kBFloat16);
  EXPECT_NE(message_of([&] {
              grouped_mlp_forward(x, w, g, {}, cfg, y, {h, a_bad});
            }).find("saved.a"),
            std::string::npos);
  // recompute: a's F must match h's 2F columns (gated)
  EXPECT_NE(
      message_of([&] { grouped_mlp_recompute_activation(h, g, {}, cfg, a_bad); }).find("h must be"),
      std::string::npos);
  Tensor dprobs = make_tensor({16}, DType::kFloat32);
  EXPECT_NE(message_of([&] {
              grouped_mlp_backward_dgrad(y, w, g, {}, cfg, {h, a}, x, h, dprobs);
            }).find("probs"),
            std::string::npos);
  // wgrad: x, dy and d_h on one device (dy named on another: nothing is read)
  Tensor dw1 = make_tensor({2, 48, 40}, DType::kFloat32),
         db2 = make_tensor({2, 40}, DType::kFloat32);
  TensorView dy_elsewhere = y;
  dy_elsewhere.device = Device::cuda(0);
  EXPECT_NE(message_of([&] {
              grouped_mlp_backward_wgrad(dy_elsewhere, x, g, {h, a}, h,
                                         GroupedMlpGrads{dw1, {}, {}, db2, false});
            }).find("dy must be on cpu (x's device), got cuda:0"),
            std::string::npos);
}

// d(h)'s amax beside the activation's backward, and the codes from it.
TEST(GroupedMlpApi, ActivationBackwardAmax) {
  expect_activation_backward_amax(Device::cpu());
}

// The activation quantized for an FP8 FC2: the composition, bit for bit.
TEST(GroupedMlpApi, ActivationQuantizeIsRecomputeThenQuantize) {
  expect_activation_quantize_is_composition(Device::cpu());
}

TEST(GroupedMlpApi, ActivationQuantizeBadInput) {
  Tensor offs = make_tensor({2}, DType::kInt64);
  offs.data_ptr<int64_t>()[0] = 0;
  offs.data_ptr<int64_t>()[1] = 4;
  GroupLayout g;
  g.offsets = offs;
  Tensor h = make_tensor({4, 256}, DType::kBFloat16);
  fill_random(h, 3);
  Tensor aq = make_tensor({4, 128}, DType::kFloat8E4M3), as = make_tensor({4, 1}, DType::kFloat32);
  const GroupedMlpConfig cfg;
  EXPECT_EQ(message_of([&] { grouped_mlp_activation_quantize(h, g, {}, cfg, QuantizeConfig{}, aq, as); }),
            "no error");
  const QuantizeConfig blocks{DType::kFloat8E4M3, QuantScaling::kBlock128x128, false, false};
  EXPECT_NE(message_of([&] {
              grouped_mlp_activation_quantize(h, g, {}, cfg, blocks, aq, as);
            }).find("QuantizeConfig must be kBlock1x128 or kTensorwise, rowwise"),
            std::string::npos);
  // Tensorwise: one scale.
  const QuantizeConfig tw{DType::kFloat8E4M3, QuantScaling::kTensorwise, false, false};
  EXPECT_NE(message_of([&] {
              grouped_mlp_activation_quantize(h, g, {}, cfg, tw, aq, as);
            }).find("a_scales must be float32 [1] on cpu"),
            std::string::npos);
  Tensor as2 = make_tensor({4, 2}, DType::kFloat32);
  EXPECT_NE(message_of([&] { grouped_mlp_activation_quantize(h, g, {}, cfg, QuantizeConfig{}, aq, as2); })
                .find("a_scales must be float32 [4,1] on cpu"),
            std::string::npos);
  Tensor abf = make_tensor({4, 128}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { grouped_mlp_activation_quantize(h, g, {}, cfg, QuantizeConfig{}, abf, as); })
                .find("a_q must be float8_e4m3 [4,128] on cpu"),
            std::string::npos);
  // The transposed codes: tensorwise only, [F, rows].
  Tensor s1 = make_tensor({1}, DType::kFloat32), at = make_tensor({128, 4}, DType::kFloat8E4M3);
  EXPECT_EQ(message_of([&] { grouped_mlp_activation_quantize(h, g, {}, cfg, tw, aq, s1, at); }),
            "no error");
  EXPECT_NE(message_of([&] {
              grouped_mlp_activation_quantize(h, g, {}, cfg, QuantizeConfig{}, aq, as, at);
            }).find("a_q_t needs QuantizeConfig kTensorwise"),
            std::string::npos);
  Tensor at_bad = make_tensor({4, 128}, DType::kFloat8E4M3);
  EXPECT_NE(message_of([&] {
              grouped_mlp_activation_quantize(h, g, {}, cfg, tw, aq, s1, at_bad);
            }).find("a_q_t must be float8_e4m3 [128,4] on cpu"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
