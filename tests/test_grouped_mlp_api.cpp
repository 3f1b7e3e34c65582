// The public grouped-MLP API (moeflow/grouped_mlp.h) on a given device
// against the float64 reference (cpu/grouped_mlp.h): forward (y, saved h and
// a), backward dgrad (dx, dprobs) and delayed wgrad (dW1, dW2, db1, db2, with
// and without accumulation), for every activation, halves and interleaved GLU
// rows, bias and probs on and off, experts with 0 and 1 rows and pad rows.
// Relative norm errors under the bf16 GEMM bound. Run on the CPU backend here
// (label cpu) and on the GPU by test_gpu (run_mlp_api_case with cuda:0).
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
}

}  // namespace
}  // namespace moeflow::test
