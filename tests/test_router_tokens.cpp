// CPU router tests of the token structure: the padding mask and
// seq_aux_loss (packed sequences, empty ones): hand-worked cases,
// equivalences (masked = the real tokens alone, one sequence = the aux loss,
// Megatron's fixed-length formula), finite differences, bad input.
#include "core/router_math.h"
#include "router_test_util.h"

namespace moeflow::test {
namespace {

struct RoutedEx : Routed {
  Tensor seq_aux, seq_counts, invalid;
};

Tensor int_tensor(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
  Tensor t = make_tensor(shape, DType::kInt32);
  std::copy(v.begin(), v.end(), t.data_ptr<int32_t>());
  return t;
}

Tensor pad_mask(int64_t T, const std::vector<int64_t>& pads, DType dtype = DType::kUInt8) {
  Tensor m = Tensor::zeros({T}, dtype);
  for (int64_t t : pads) static_cast<uint8_t*>(m.data())[t] = 1;
  return m;
}

// router_forward with a padding mask and/or cu_seqlens, every output poisoned.
RoutedEx route_ex(const Tensor& logits, const RouterConfig& c, const Tensor& mask, const Tensor& cu,
                  const Tensor& bias = {}) {
  const int64_t T = logits.size(0), S = cu.defined() ? cu.size(0) - 1 : 0;
  RoutedEx r;
  static_cast<Routed&>(r) =
      Routed{make_tensor({T, c.topk}, DType::kInt32),     make_tensor({T, c.topk}, DType::kFloat32),
             make_tensor({c.num_experts}, DType::kInt32), make_tensor({1}, DType::kFloat32),
             make_tensor({1}, DType::kFloat32),           make_tensor({1}, DType::kInt32)};
  r.seq_aux = make_tensor({1}, DType::kFloat32);
  r.seq_counts = make_tensor({S, c.num_experts}, DType::kInt32);
  r.invalid = make_tensor({1}, DType::kInt32);
  for (Tensor* t : {&r.ids, &r.probs, &r.counts, &r.aux, &r.z, &r.nonfinite, &r.seq_aux,
                    &r.seq_counts, &r.invalid})
    fill_bytes(*t, 0xFF);
  RouterOutputs o{r.ids,    r.probs,     r.counts,  r.aux,
                  r.z,      r.nonfinite, r.seq_aux, S > 0 ? TensorView(r.seq_counts) : TensorView{},
                  r.invalid};
  RouterTokenInfo info{mask.defined() ? TensorView(mask) : TensorView{},
                       cu.defined() ? TensorView(cu) : TensorView{}};
  router_forward(logits, c, o, bias.defined() ? TensorView(bias) : TensorView{}, {}, nullptr, info);
  return r;
}

// Rows `rows` of a [T,N] float tensor.
Tensor rows_of(const Tensor& x, const std::vector<int64_t>& rows) {
  const int64_t N = x.size(1);
  Tensor y = make_tensor({static_cast<int64_t>(rows.size()), N}, DType::kFloat32);
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy(x.data_ptr<float>() + rows[i] * N, x.data_ptr<float>() + (rows[i] + 1) * N,
              y.data_ptr<float>() + i * N);
  return y;
}

TEST(Router, PaddingMaskEqualsTheRealTokensAlone) {
  const int64_t T = 6;
  const std::vector<int64_t> pads = {1, 4}, real = {0, 2, 3, 5};
  RouterConfig sm = softmax_cfg(8, 2), sg = sigmoid_cfg(8, 3);
  for (RouterConfig* c : {&sm, &sg}) {
    c->aux_loss_coeff = 0.1f;
    c->z_loss_coeff = 0.01f;
  }
  for (const RouterConfig& c : {sm, sg}) {
    for (DType mt : {DType::kUInt8, DType::kBool}) {
      Tensor logits = make_tensor({T, 8}, DType::kFloat32);
      fill_random(logits, 5, -2.0f, 2.0f);
      logits.data_ptr<float>()[1 * 8 + 3] = NAN;  // in a padding row: not counted
      RoutedEx r = route_ex(logits, c, pad_mask(T, pads, mt), {});
      Routed sub = route(rows_of(logits, real), c);
      const int K = c.topk;
      for (size_t i = 0; i < real.size(); ++i)
        for (int k = 0; k < K; ++k) {
          EXPECT_EQ(r.ids.data_ptr<int32_t>()[real[i] * K + k],
                    sub.ids.data_ptr<int32_t>()[i * K + k]);
          EXPECT_EQ(r.probs.data_ptr<float>()[real[i] * K + k],
                    sub.probs.data_ptr<float>()[i * K + k]);
        }
      for (int64_t t : pads)
        for (int k = 0; k < K; ++k) {
          EXPECT_EQ(r.ids.data_ptr<int32_t>()[t * K + k], -1);
          EXPECT_EQ(r.probs.data_ptr<float>()[t * K + k], 0.0f);
        }
      EXPECT_EQ(ints(r.counts), ints(sub.counts));
      EXPECT_EQ(floats(r.aux), floats(sub.aux));  // T = the real tokens
      EXPECT_EQ(floats(r.z), floats(sub.z));
      EXPECT_EQ(ints(r.nonfinite)[0], 0);
      EXPECT_EQ(floats(r.seq_aux)[0], 0.0f);  // coefficient 0
      EXPECT_EQ(ints(r.invalid)[0], 0);

      // Backward: padding rows 0, real rows those of the real tokens alone.
      Tensor g = make_tensor({T, K}, DType::kFloat32);
      fill_random(g, 6);
      Tensor gs = make_tensor({4, K}, DType::kFloat32);
      for (size_t i = 0; i < real.size(); ++i)
        std::copy(g.data_ptr<float>() + real[i] * K, g.data_ptr<float>() + (real[i] + 1) * K,
                  gs.data_ptr<float>() + i * K);
      Tensor one = from({1}, {1}), dl = make_tensor({T, 8}, DType::kFloat32);
      Tensor dls = make_tensor({4, 8}, DType::kFloat32);
      fill_bytes(dl, 0xFF);
      Tensor mask = pad_mask(T, pads, mt);
      router_backward(logits, r.ids, r.counts, RouterGrads{g, one, one}, c, dl, nullptr,
                      RouterTokenInfo{mask, {}});
      router_backward(rows_of(logits, real), sub.ids, sub.counts, RouterGrads{gs, one, one}, c,
                      dls);
      for (int64_t t : pads)
        for (int e = 0; e < 8; ++e) EXPECT_EQ(dl.data_ptr<float>()[t * 8 + e], 0.0f);
      for (size_t i = 0; i < real.size(); ++i)
        for (int e = 0; e < 8; ++e)
          EXPECT_EQ(dl.data_ptr<float>()[real[i] * 8 + e], dls.data_ptr<float>()[i * 8 + e]);
    }
  }
}

TEST(Router, PaddingMaskHandWorked) {
  const float l3 = static_cast<float>(std::log(3.0));
  RouterConfig c = softmax_cfg(2, 1);
  c.aux_loss_coeff = 0.01f;
  c.z_loss_coeff = 0.001f;
  // Token 1 is padding; tokens 0 and 2: s = [0.5,0.5], [0.75,0.25], both to expert 0.
  Tensor logits = from({0, 0, 9, -9, l3, 0}, {3, 2});
  RoutedEx r = route_ex(logits, c, pad_mask(3, {1}), {});
  EXPECT_EQ(ints(r.ids), (std::vector<int32_t>{0, -1, 0}));
  expect_near_all(r.probs, {1, 0, 1});
  EXPECT_EQ(ints(r.counts), (std::vector<int32_t>{2, 0}));
  EXPECT_NEAR(floats(r.aux)[0], 2 * 0.01 / 4 * 2.5, 1e-8);  // as with T = 2
  const double ln2 = std::log(2.0), l4 = std::log(4.0);
  EXPECT_NEAR(floats(r.z)[0], 0.001 * (ln2 * ln2 + l4 * l4) / 2, 1e-9);
  // Every token padding: nothing routed, losses 0.
  RoutedEx none = route_ex(logits, c, pad_mask(3, {0, 1, 2}), {});
  EXPECT_EQ(ints(none.ids), (std::vector<int32_t>{-1, -1, -1}));
  EXPECT_EQ(ints(none.counts), (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(floats(none.aux)[0], 0.0f);
  EXPECT_EQ(floats(none.z)[0], 0.0f);
}

TEST(Router, SeqAuxLossHandWorked) {
  const float l3 = static_cast<float>(std::log(3.0));
  RouterConfig c = softmax_cfg(2, 1);
  c.seq_aux_loss_coeff = 0.03f;
  // s = [0.5,0.5] -> 0, [0.75,0.25] -> 0, [0.25,0.75] -> 1; sequences {0,1}, {}, {2}.
  Tensor logits = from({0, 0, l3, 0, 0, l3}, {3, 2});
  Tensor cu = int_tensor({0, 2, 2, 3}, {4});
  RoutedEx r = route_ex(logits, c, {}, cu);
  EXPECT_EQ(ints(r.seq_counts), (std::vector<int32_t>{2, 0, 0, 0, 0, 1}));
  EXPECT_EQ(ints(r.counts), (std::vector<int32_t>{2, 1}));
  // seq 0: E*c/(K*L^2) * (1.25*2) = 1.25c; seq 2: 2c * 0.75 = 1.5c; mean over S = 3.
  EXPECT_NEAR(floats(r.seq_aux)[0], 2.75 * 0.03 / 3, 1e-8);
  EXPECT_EQ(floats(r.aux)[0], 0.0f);
  EXPECT_EQ(ints(r.invalid)[0], 0);
  // Token 1 padding: seq 0 = {0}: L = 1, 2c * 0.5 = c.
  RoutedEx m = route_ex(logits, c, pad_mask(3, {1}), cu);
  EXPECT_EQ(ints(m.seq_counts), (std::vector<int32_t>{1, 0, 0, 0, 0, 1}));
  EXPECT_NEAR(floats(m.seq_aux)[0], 2.5 * 0.03 / 3, 1e-8);
}

TEST(Router, SeqAuxLossOfOneSequenceIsTheAuxLoss) {
  const int64_t T = 37;
  RouterConfig c = sigmoid_cfg(16, 3);
  c.num_groups = 4;
  c.group_topk = 3;
  c.aux_loss_coeff = c.seq_aux_loss_coeff = 0.02f;
  Tensor logits = make_tensor({T, 16}, DType::kFloat32);
  fill_random(logits, 21, -3.0f, 3.0f);
  Tensor bias = make_tensor({16}, DType::kFloat32);
  fill_random(bias, 22, -0.3f, 0.3f);
  for (bool masked : {false, true}) {
    RoutedEx r = route_ex(logits, c, masked ? pad_mask(T, {0, 7, 36}) : Tensor{},
                          int_tensor({0, static_cast<int32_t>(T)}, {2}), bias);
    EXPECT_NEAR(floats(r.seq_aux)[0], floats(r.aux)[0], 1e-6 * floats(r.aux)[0]);
    EXPECT_EQ(ints(r.seq_counts), ints(r.counts));
  }
}

TEST(Router, SeqAuxLossMatchesMegatronFixedLength) {
  // Megatron's sequence_load_balancing_loss_func on B sequences of L tokens:
  // mean_b sum_e (count[b,e] / (L*K/E)) * mean_t s[t,b,e] * coeff.
  const int B = 3, L = 5, E = 8, K = 2;
  RouterConfig c = softmax_cfg(E, K);
  c.seq_aux_loss_coeff = 0.05f;
  Tensor logits = make_tensor({B * L, E}, DType::kFloat32);
  fill_random(logits, 31, -2.0f, 2.0f);
  RoutedEx r = route_ex(logits, c, {}, int_tensor({0, L, 2 * L, 3 * L}, {B + 1}));
  double want = 0.0;
  for (int b = 0; b < B; ++b) {
    std::vector<double> mean_s(E, 0.0), count(E, 0.0);
    for (int t = b * L; t < (b + 1) * L; ++t) {
      const float* x = logits.data_ptr<float>() + t * E;
      double z = 0.0;
      for (int e = 0; e < E; ++e) z += std::exp(static_cast<double>(x[e]));
      for (int e = 0; e < E; ++e) mean_s[e] += std::exp(static_cast<double>(x[e])) / z / L;
      for (int k = 0; k < K; ++k) count[r.ids.data_ptr<int32_t>()[t * K + k]] += 1;
    }
    for (int e = 0; e < E; ++e) want += count[e] / (L * K / double(E)) * mean_s[e] / B;
  }
  EXPECT_NEAR(floats(r.seq_aux)[0], want * 0.05, 1e-7);
}

TEST(Router, MaskedAndSeqBackwardMatchesFiniteDifferences) {
  const int E = 8;
  const int64_t T = 9;
  std::vector<FdCase> cases = common_fd_cases(E, 0.3f, 0.2f, 0.4f);
  RouterConfig seq_only = softmax_cfg(E, 2);
  seq_only.seq_aux_loss_coeff = 0.5f;
  cases.push_back({"softmax k2 seq only", seq_only, false});

  const float h = 1e-2f;
  Tensor cu = int_tensor({0, 4, 4, 9}, {4});
  for (const FdCase& fc : cases) {
    for (bool masked : {false, true}) {
      SCOPED_TRACE(std::string(fc.name) + (masked ? " masked" : ""));
      const RouterConfig& c = fc.config;
      Tensor mask = masked ? pad_mask(T, {2, 6}) : Tensor{};
      Tensor logits = make_tensor({T, E}, DType::kFloat32);
      fill_random(logits, 41, -2.0f, 2.0f);
      Tensor bias = make_tensor({E}, DType::kFloat32);
      fill_random(bias, 42, -0.2f, 0.2f);
      Tensor biasv = fc.bias ? bias : Tensor{};
      Tensor g = make_tensor({T, c.topk}, DType::kFloat32);
      fill_random(g, 43);
      const float daux = 0.7f, dz = 1.3f, dseq = 0.9f;
      auto loss = [&](const RoutedEx& r) {
        double l = daux * static_cast<double>(floats(r.aux)[0]) +
                   dz * static_cast<double>(floats(r.z)[0]) +
                   dseq * static_cast<double>(floats(r.seq_aux)[0]);
        for (int64_t i = 0; i < T * c.topk; ++i)
          l += static_cast<double>(r.probs.data_ptr<float>()[i]) * g.data_ptr<float>()[i];
        return l;
      };
      RoutedEx base = route_ex(logits, c, mask, cu, biasv);
      Tensor dl = make_tensor({T, E}, DType::kFloat32);
      fill_bytes(dl, 0xFF);
      router_backward(logits, base.ids, base.counts,
                      RouterGrads{g, from({daux}, {1}), from({dz}, {1}), from({dseq}, {1})}, c, dl,
                      nullptr, RouterTokenInfo{masked ? TensorView(mask) : TensorView{}, cu},
                      base.seq_counts);
      int checked = 0;
      for (int64_t i = 0; i < T * E; ++i) {
        const float x0 = logits.data_ptr<float>()[i];
        logits.data_ptr<float>()[i] = x0 + h;
        RoutedEx up = route_ex(logits, c, mask, cu, biasv);
        logits.data_ptr<float>()[i] = x0 - h;
        RoutedEx dn = route_ex(logits, c, mask, cu, biasv);
        logits.data_ptr<float>()[i] = x0;
        if (ints(up.ids) != ints(base.ids) || ints(dn.ids) != ints(base.ids)) continue;
        const double fd = (loss(up) - loss(dn)) / (2.0 * h);
        EXPECT_NEAR(dl.data_ptr<float>()[i], fd, 2e-3 + 2e-3 * std::fabs(fd)) << "element " << i;
        ++checked;
      }
      EXPECT_GT(checked, T * E / 2);
      if (masked)
        for (int64_t t : {2, 6})
          for (int e = 0; e < E; ++e) EXPECT_EQ(dl.data_ptr<float>()[t * E + e], 0.0f);
    }
  }
}

TEST(Router, BadTokenInfo) {
  Tensor logits = make_tensor({3, 8}, DType::kFloat32);
  fill_random(logits, 1);
  Tensor ids = make_tensor({3, 2}, DType::kInt32), probs = make_tensor({3, 2}, DType::kFloat32);
  Tensor counts = make_tensor({8}, DType::kInt32), loss = make_tensor({1}, DType::kFloat32);
  Tensor seq_counts = make_tensor({2, 8}, DType::kInt32);
  RouterConfig c = softmax_cfg(8, 2);
  c.seq_aux_loss_coeff = 0.1f;
  const RouterOutputs out{ids, probs, counts, {}, {}, {}, loss, seq_counts};
  auto run = [&](RouterConfig cfg, RouterOutputs o, TensorView mask, TensorView cu) {
    return message_of([&] { router_forward(logits, cfg, o, {}, {}, nullptr, {mask, cu}); });
  };
  Tensor cu = int_tensor({0, 1, 3}, {3});
  EXPECT_EQ(run(c, out, {}, cu), "no error");
  EXPECT_TRUE(has(run(c, out, {}, {}), "cu_seqlens is required"));
  EXPECT_TRUE(has(run(c, out, {}, make_tensor({3}, DType::kInt64)),
                  "cu_seqlens must be int32 [*] on cpu, got int64 [3]"));
  EXPECT_TRUE(has(run(c, out, {}, int_tensor({0}, {1})),
                  "cu_seqlens must be int32 [S+1] with S >= 1, got int32 [1]"));
  EXPECT_TRUE(has(run(c, out, {}, int_tensor({0, 1, 3, 3}, {2, 2})),
                  "cu_seqlens must be int32 [S+1] with S >= 1, got int32 [2,2]"));
  int32_t fake[3] = {0, 1, 3};
  EXPECT_TRUE(has(run(c, out, {}, TensorView(fake, DType::kInt32, Device::cuda(0), {3})),
                  "cu_seqlens must be int32 [*] on cpu, got int32 [3] on cuda:0"));
  EXPECT_TRUE(has(run(c, out, {}, int_tensor({1, 1, 3}, {3})), "cu_seqlens[0] must be 0, got 1"));
  EXPECT_TRUE(
      has(run(c, out, {}, int_tensor({0, 1, 4}, {3})), "cu_seqlens[S=2] must be T=3, got 4"));
  EXPECT_TRUE(has(run(c, out, {}, int_tensor({0, 4, 3}, {3})),
                  "cu_seqlens must be non-decreasing, got cu_seqlens[1]=4 > cu_seqlens[2]=3"));
  EXPECT_TRUE(has(
      run(c,
          RouterOutputs{ids, probs, counts, {}, {}, {}, loss, make_tensor({3, 8}, DType::kInt32)},
          {}, cu),
      "seq_tokens_per_expert must be int32 [2,8]"));
  EXPECT_TRUE(has(run(c, RouterOutputs{ids, probs, counts, {}, {}, {}, {}, seq_counts}, {}, cu),
                  "seq_aux_loss is required"));
  EXPECT_TRUE(has(run(c, RouterOutputs{ids, probs, counts, {}, {}, {}, loss}, {}, cu),
                  "seq_tokens_per_expert is required"));
  RouterConfig plain = softmax_cfg(8, 2);
  EXPECT_TRUE(has(run(plain, out, make_tensor({4}, DType::kUInt8), {}),
                  "padding_mask must be bool or uint8 [3] on cpu, got uint8 [4]"));
  EXPECT_TRUE(has(run(plain, out, make_tensor({3}, DType::kFloat32), {}),
                  "padding_mask must be bool or uint8 [3]"));
  EXPECT_TRUE(has(run(plain, RouterOutputs{ids, probs, counts, {}, {}, {}, {}, seq_counts}, {}, {}),
                  "seq_tokens_per_expert needs cu_seqlens"));
  plain.seq_aux_loss_coeff = NAN;
  EXPECT_TRUE(has(run(plain, out, {}, cu), "seq_aux_loss_coeff must be finite"));
  // Backward.
  Tensor dl = make_tensor({3, 8}, DType::kFloat32);
  Tensor mask = pad_mask(3, {1});
  auto back = [&](RouterConfig cfg, TensorView tpe, RouterTokenInfo info, TensorView sc) {
    return message_of(
        [&] { router_backward(logits, ids, tpe, RouterGrads{probs}, cfg, dl, nullptr, info, sc); });
  };
  EXPECT_TRUE(has(back(c, counts, {{}, cu}, {}), "seq_tokens_per_expert is required"));
  EXPECT_TRUE(has(back(c, counts, {}, seq_counts), "cu_seqlens is required"));
  EXPECT_TRUE(has(back(c, counts, {{}, int_tensor({0, 4, 3}, {3})}, seq_counts),
                  "cu_seqlens must be non-decreasing"));
  RouterConfig cz = softmax_cfg(8, 2);
  cz.z_loss_coeff = 0.1f;
  EXPECT_EQ(back(cz, {}, {}, {}), "no error");
  EXPECT_TRUE(has(back(cz, {}, {mask, {}}, {}), "tokens_per_expert is required"));
  EXPECT_TRUE(has(back(cz, counts, {make_tensor({2}, DType::kBool), {}}, {}),
                  "padding_mask must be bool or uint8 [3]"));
}

}  // namespace
}  // namespace moeflow::test
