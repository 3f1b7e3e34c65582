// CPU router with float64 logits (the path float64 gradient checks use):
// forward against the float32 router on well-separated logits (same experts,
// same counts, values within float32 precision), backward against a
// fourth-order central difference of the float64 forward at 1e-7 relative
// (softmax, pre_softmax, sigmoid with groups and bias; aux, z and seq_aux
// losses; with and without a padding mask), capacity dropping on float64
// probs, and the dtype errors (mixed float32/float64, float64 on a CUDA
// device, the float32-only expert-bias update).
#include "test_util.h"

namespace moeflow::test {
namespace {

constexpr DType kF32 = DType::kFloat32;
constexpr DType kF64 = DType::kFloat64;

// Whether the message `msg` contains `part`.
::testing::AssertionResult has(const std::string& msg, const std::string& part) {
  if (msg.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << part << "\"";
}

double get(const Tensor& t, int64_t i) {
  return t.dtype() == kF64 ? t.data_ptr<double>()[i] : t.data_ptr<float>()[i];
}
void set(Tensor& t, int64_t i, double v) {
  if (t.dtype() == kF64)
    t.data_ptr<double>()[i] = v;
  else
    t.data_ptr<float>()[i] = static_cast<float>(v);
}
std::vector<int32_t> ints(const Tensor& t) {
  return std::vector<int32_t>(t.data_ptr<int32_t>(), t.data_ptr<int32_t>() + t.numel());
}
Tensor int_tensor(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
  Tensor t = make_tensor(shape, DType::kInt32);
  std::copy(v.begin(), v.end(), t.data_ptr<int32_t>());
  return t;
}
Tensor scalar(double v, DType dt) {
  Tensor t = make_tensor({1}, dt);
  set(t, 0, v);
  return t;
}
// The same values in another float dtype (float32 -> float64 is exact).
Tensor as(const Tensor& x, DType dt) {
  Tensor y = make_tensor(x.sizes(), dt);
  for (int64_t i = 0; i < x.numel(); ++i) set(y, i, get(x, i));
  return y;
}
Tensor pad_mask(int64_t T, const std::vector<int64_t>& pads) {
  Tensor m = Tensor::zeros({T}, DType::kUInt8);
  for (int64_t t : pads) m.data_ptr<uint8_t>()[t] = 1;
  return m;
}

// Well-separated float32 logits: each token's experts take the values
// 0.45 * (a random rank) - 1.6, plus noise in [-0.02, 0.02].
Tensor separated_logits(int64_t T, int E, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> noise(-0.02f, 0.02f);
  Tensor x = make_tensor({T, E}, kF32);
  std::vector<int> rank(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(rank.begin(), rank.end(), 0);
    std::shuffle(rank.begin(), rank.end(), rng);
    for (int e = 0; e < E; ++e)
      x.data_ptr<float>()[t * E + e] = 0.45f * static_cast<float>(rank[e]) - 1.6f + noise(rng);
  }
  return x;
}

RouterConfig cfg(int E, int K, ScoreFunction f = ScoreFunction::kSoftmax) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = K;
  c.score_function = f;
  return c;
}

// The configurations of the tests, every loss on.
struct Case {
  const char* name;
  RouterConfig config;
  bool bias;
};
std::vector<Case> cases(int E) {
  std::vector<Case> v;
  auto add = [&](const char* name, RouterConfig c, bool bias = false) {
    c.aux_loss_coeff = 0.3f;
    c.z_loss_coeff = 0.2f;
    c.seq_aux_loss_coeff = 0.4f;
    v.push_back({name, c, bias});
  };
  add("softmax k2", cfg(E, 2));
  RouterConfig pre = cfg(E, 3);
  pre.pre_softmax = true;
  pre.topk_scaling_factor = 1.5f;
  add("pre_softmax k3 scaled", pre);
  add("sigmoid k1 bias", cfg(E, 1, ScoreFunction::kSigmoid), true);
  RouterConfig sg = cfg(E, 4, ScoreFunction::kSigmoid);
  sg.num_groups = 4;
  sg.group_topk = 2;
  sg.topk_scaling_factor = 2.5f;
  add("sigmoid k4 grouped scaled bias", sg, true);
  RouterConfig smg = cfg(E, 2);
  smg.num_groups = 2;
  smg.group_topk = 1;
  add("softmax k2 grouped", smg);
  return v;
}

struct Out {
  Tensor ids, probs, counts, aux, z, nonfinite, seq_aux, seq_counts;
};

// router_forward with every output; float outputs in the dtype of the logits.
Out route(const Tensor& logits, const RouterConfig& c, const Tensor& mask, const Tensor& cu,
          const Tensor& bias) {
  const int64_t T = logits.size(0), S = cu.size(0) - 1;
  const DType ft = logits.dtype();
  Out o;
  o.ids = make_tensor({T, c.topk}, DType::kInt32);
  o.probs = make_tensor({T, c.topk}, ft);
  o.counts = make_tensor({c.num_experts}, DType::kInt32);
  o.aux = make_tensor({1}, ft);
  o.z = make_tensor({1}, ft);
  o.nonfinite = make_tensor({1}, DType::kInt32);
  o.seq_aux = make_tensor({1}, ft);
  o.seq_counts = make_tensor({S, c.num_experts}, DType::kInt32);
  for (Tensor* t :
       {&o.ids, &o.probs, &o.counts, &o.aux, &o.z, &o.nonfinite, &o.seq_aux, &o.seq_counts})
    fill_bytes(*t, 0xFF);
  RouterOutputs out{o.ids, o.probs, o.counts, o.aux, o.z, o.nonfinite, o.seq_aux, o.seq_counts};
  router_forward(logits, c, out, bias.defined() ? TensorView(bias) : TensorView{}, {}, nullptr,
                 RouterTokenInfo{mask.defined() ? TensorView(mask) : TensorView{}, cu});
  return o;
}

void expect_close(const Tensor& f32, const Tensor& f64, double rel, const char* what) {
  ASSERT_EQ(f32.numel(), f64.numel()) << what;
  for (int64_t i = 0; i < f64.numel(); ++i) {
    const double want = get(f64, i);
    EXPECT_NEAR(get(f32, i), want, rel * std::max(1.0, std::fabs(want)))
        << what << " [" << i << "]";
  }
}

TEST(RouterF64, ForwardMatchesFloat32) {
  const int E = 8;
  const int64_t T = 11;
  Tensor cu = int_tensor({0, 5, 5, 11}, {4});
  for (const Case& k : cases(E)) {
    for (bool masked : {false, true}) {
      SCOPED_TRACE(std::string(k.name) + (masked ? " masked" : ""));
      const RouterConfig& c = k.config;
      Tensor x32 = separated_logits(T, E, 7);
      x32.data_ptr<float>()[3 * E + 1] = NAN;  // NaN as -inf, in both dtypes
      x32.data_ptr<float>()[4 * E + 6] = -INFINITY;
      Tensor b32 = make_tensor({E}, kF32);
      fill_random(b32, 8, -0.02f, 0.02f);
      Tensor mask = masked ? pad_mask(T, {2, 7}) : Tensor{};
      Out a = route(x32, c, mask, cu, k.bias ? b32 : Tensor{});
      Out b = route(as(x32, kF64), c, mask, cu, k.bias ? as(b32, kF64) : Tensor{});
      EXPECT_EQ(b.probs.dtype(), kF64);
      EXPECT_EQ(ints(a.ids), ints(b.ids));
      EXPECT_EQ(ints(a.counts), ints(b.counts));
      EXPECT_EQ(ints(a.seq_counts), ints(b.seq_counts));
      EXPECT_EQ(ints(a.nonfinite), ints(b.nonfinite));
      EXPECT_EQ(ints(b.nonfinite)[0], 2);
      expect_close(a.probs, b.probs, 1e-6, "probs");
      expect_close(a.aux, b.aux, 1e-6, "aux_loss");
      expect_close(a.z, b.z, 1e-6, "z_loss");
      expect_close(a.seq_aux, b.seq_aux, 1e-6, "seq_aux_loss");
      EXPECT_GT(get(b.aux, 0), 0.0);
      EXPECT_GT(get(b.seq_aux, 0), 0.0);
      if (masked)
        for (int64_t t : {2, 7})
          for (int j = 0; j < c.topk; ++j) {
            EXPECT_EQ(b.ids.data_ptr<int32_t>()[t * c.topk + j], -1);
            EXPECT_EQ(get(b.probs, t * c.topk + j), 0.0);
          }
    }
  }
}

// dlogits against (f(x-2h) - 8 f(x-h) + 8 f(x+h) - f(x+2h)) / 12h of the
// float64 forward (truncation O(h^4), rounding ~1e-13 at h = 1e-3).
TEST(RouterF64, BackwardMatchesFiniteDifferences) {
  const int E = 8;
  const int64_t T = 9;
  const double h = 1e-3;
  Tensor cu = int_tensor({0, 4, 4, 9}, {4});
  for (const Case& k : cases(E)) {
    for (bool masked : {false, true}) {
      SCOPED_TRACE(std::string(k.name) + (masked ? " masked" : ""));
      const RouterConfig& c = k.config;
      Tensor mask = masked ? pad_mask(T, {2, 6}) : Tensor{};
      Tensor x = as(separated_logits(T, E, 41), kF64);
      Tensor bias = make_tensor({E}, kF64);
      for (int e = 0; e < E; ++e) set(bias, e, 0.003 * ((e * 5) % 7) - 0.01);
      if (!k.bias) bias = Tensor{};
      Tensor g = make_tensor({T, c.topk}, kF64);
      std::mt19937 rng(43);
      std::uniform_real_distribution<double> uni(-1.0, 1.0);
      for (int64_t i = 0; i < g.numel(); ++i) set(g, i, uni(rng));
      const double daux = 0.7, dz = 1.3, dseq = 0.9;
      auto loss = [&](const Out& r) {
        double l = daux * get(r.aux, 0) + dz * get(r.z, 0) + dseq * get(r.seq_aux, 0);
        for (int64_t i = 0; i < T * c.topk; ++i) l += get(r.probs, i) * get(g, i);
        return l;
      };
      Out base = route(x, c, mask, cu, bias);
      Tensor dl = make_tensor({T, E}, kF64);
      fill_bytes(dl, 0xFF);
      router_backward(
          x, base.ids, base.counts,
          RouterGrads{g, scalar(daux, kF64), scalar(dz, kF64), scalar(dseq, kF64)}, c, dl, nullptr,
          RouterTokenInfo{mask.defined() ? TensorView(mask) : TensorView{}, cu}, base.seq_counts);
      int checked = 0;
      double max_rel = 0.0;
      for (int64_t i = 0; i < T * E; ++i) {
        const double x0 = get(x, i);
        double f[4];
        bool moved = false;
        const double steps[4] = {-2 * h, -h, h, 2 * h};
        for (int s = 0; s < 4; ++s) {
          set(x, i, x0 + steps[s]);
          Out r = route(x, c, mask, cu, bias);
          moved |= ints(r.ids) != ints(base.ids);
          f[s] = loss(r);
        }
        set(x, i, x0);
        if (moved) continue;  // the choice changed (counted below)
        const double fd = (f[0] - 8.0 * f[1] + 8.0 * f[2] - f[3]) / (12.0 * h);
        const double got = get(dl, i);
        EXPECT_NEAR(got, fd, 1e-7 * std::fabs(fd) + 1e-10) << "element " << i;
        if (std::fabs(fd) > 1e-6) max_rel = std::max(max_rel, std::fabs(got - fd) / std::fabs(fd));
        ++checked;
      }
      EXPECT_EQ(checked, T * E);  // well-separated logits: no choice moves
      EXPECT_LT(max_rel, 1e-7);
      if (masked)
        for (int64_t t : {2, 6})
          for (int e = 0; e < E; ++e) EXPECT_EQ(get(dl, t * E + e), 0.0);
    }
  }
}

// The float64 backward is the float32 backward's double arithmetic, rounded
// to double instead of float.
TEST(RouterF64, BackwardMatchesFloat32) {
  const int E = 8;
  const int64_t T = 9;
  Tensor cu = int_tensor({0, 4, 4, 9}, {4});
  for (const Case& k : cases(E)) {
    SCOPED_TRACE(k.name);
    const RouterConfig& c = k.config;
    Tensor mask = pad_mask(T, {3});
    Tensor x32 = separated_logits(T, E, 5);
    Tensor b32 = make_tensor({E}, kF32);
    fill_random(b32, 6, -0.02f, 0.02f);
    Tensor g32 = make_tensor({T, c.topk}, kF32);
    fill_random(g32, 9);
    Out a = route(x32, c, mask, cu, k.bias ? b32 : Tensor{});
    Tensor d32 = make_tensor({T, E}, kF32), d64 = make_tensor({T, E}, kF64);
    router_backward(x32, a.ids, a.counts,
                    RouterGrads{g32, scalar(0.5, kF32), scalar(0.25, kF32), scalar(2.0, kF32)}, c,
                    d32, nullptr, RouterTokenInfo{mask, cu}, a.seq_counts);
    router_backward(
        as(x32, kF64), a.ids, a.counts,
        RouterGrads{as(g32, kF64), scalar(0.5, kF64), scalar(0.25, kF64), scalar(2.0, kF64)}, c,
        d64, nullptr, RouterTokenInfo{mask, cu}, a.seq_counts);
    for (int64_t i = 0; i < T * E; ++i)
      EXPECT_EQ(d32.data_ptr<float>()[i], static_cast<float>(d64.data_ptr<double>()[i]))
          << "element " << i;
  }
}

TEST(RouterF64, CapacityOnFloat64Probs) {
  // One expert, capacity ceil(6 * 0.5) = 3: the three largest probs are kept
  // (NaN ranks as -inf; equal probs: the lower token first).
  Tensor ids = int_tensor({0, 0, 0, 0, 0, 0}, {6, 1});
  Tensor p = make_tensor({6, 1}, kF64);
  const double v[6] = {0.1, 0.5, 0.5, 0.3, 0.9, NAN};
  for (int i = 0; i < 6; ++i) set(p, i, v[i]);
  RouterCapacityConfig cc;
  cc.num_experts = 1;
  cc.capacity_factor = 0.5;
  Tensor kept = make_tensor({6, 1}, DType::kInt32), dropped = make_tensor({1}, DType::kInt32);
  router_apply_capacity(ids, p, cc, kept, dropped);
  EXPECT_EQ(ints(kept), (std::vector<int32_t>{-1, 0, 0, -1, 0, -1}));
  EXPECT_EQ(ints(dropped)[0], 3);
  // Probs equal in float32 but not in float64: the float64 order decides.
  Tensor ids2 = int_tensor({0, 0}, {2, 1});
  Tensor p2 = make_tensor({2, 1}, kF64);
  set(p2, 0, 0.5);
  set(p2, 1, 0.5 + 1e-12);
  Tensor kept2 = make_tensor({2, 1}, DType::kInt32);
  router_apply_capacity(ids2, p2, cc, kept2);
  EXPECT_EQ(ints(kept2), (std::vector<int32_t>{-1, 0}));
  router_apply_capacity(ids2, as(p2, kF32), cc, kept2);
  EXPECT_EQ(ints(kept2), (std::vector<int32_t>{0, -1}));
}

TEST(RouterF64, MixedDtypesAreErrors) {
  const int E = 8, K = 2;
  const int64_t T = 3;
  RouterConfig c = cfg(E, K);
  c.aux_loss_coeff = 0.1f;
  c.z_loss_coeff = 0.1f;
  c.seq_aux_loss_coeff = 0.1f;
  Tensor cu = int_tensor({0, 3}, {2});
  Tensor x64 = as(separated_logits(T, E, 1), kF64), x32 = separated_logits(T, E, 1);
  Tensor ids = make_tensor({T, K}, DType::kInt32), counts = make_tensor({E}, DType::kInt32);
  Tensor seq_counts = make_tensor({1, E}, DType::kInt32), nf = make_tensor({1}, DType::kInt32);
  Tensor p64 = make_tensor({T, K}, kF64), p32 = make_tensor({T, K}, kF32);
  Tensor s64 = make_tensor({1}, kF64), s32 = make_tensor({1}, kF32);
  auto fwd = [&](const Tensor& x, const Tensor& p, const Tensor& aux, const Tensor& z,
                 const Tensor& sa, const RouterConfig& cf, const Tensor& bias = {}) {
    return message_of([&] {
      router_forward(x, cf, RouterOutputs{ids, p, counts, aux, z, nf, sa, seq_counts},
                     bias.defined() ? TensorView(bias) : TensorView{}, {}, nullptr,
                     RouterTokenInfo{{}, cu});
    });
  };
  EXPECT_EQ(fwd(x64, p64, s64, s64, s64, c), "no error");
  EXPECT_EQ(fwd(x32, p32, s32, s32, s32, c), "no error");
  EXPECT_TRUE(has(fwd(x64, p32, s64, s64, s64, c),
                  "probs must be float64 (the dtype of logits), got float32 [3,2]"));
  EXPECT_TRUE(has(fwd(x32, p64, s32, s32, s32, c),
                  "probs must be float32 (the dtype of logits), got float64 [3,2]"));
  EXPECT_TRUE(has(fwd(x64, p64, s32, s64, s64, c), "aux_loss must be float64"));
  EXPECT_TRUE(has(fwd(x64, p64, s64, s32, s64, c), "z_loss must be float64"));
  EXPECT_TRUE(has(fwd(x64, p64, s64, s64, s32, c), "seq_aux_loss must be float64"));
  EXPECT_TRUE(has(fwd(x32, p32, s32, s32, s64, c), "seq_aux_loss must be float32"));
  RouterConfig sig = cfg(E, K, ScoreFunction::kSigmoid);
  EXPECT_TRUE(has(fwd(x64, p64, s64, s64, s64, sig, make_tensor({E}, kF32)),
                  "expert_bias must be float64 (the dtype of logits), got float32 [8]"));
  EXPECT_EQ(fwd(x64, p64, s64, s64, s64, sig, make_tensor({E}, kF64)), "no error");
  EXPECT_TRUE(has(fwd(x64, make_tensor({T, 3}, kF64), s64, s64, s64, c),
                  "probs must be float64 [3,2] on cpu, got float64 [3,3]"));
  EXPECT_TRUE(has(fwd(make_tensor({T, E}, DType::kFloat16), p32, s32, s32, s32, c),
                  "logits must be float32 or float64 [*,8] on cpu, got float16 [3,8]"));

  auto bwd = [&](const Tensor& x, const Tensor& g, const Tensor& da, const Tensor& dz,
                 const Tensor& ds, const Tensor& dl) {
    return message_of([&] {
      router_backward(x, ids, counts, RouterGrads{g, da, dz, ds}, c, dl, nullptr,
                      RouterTokenInfo{{}, cu}, seq_counts);
    });
  };
  Tensor dl64 = make_tensor({T, E}, kF64), dl32 = make_tensor({T, E}, kF32);
  ASSERT_EQ(fwd(x64, p64, s64, s64, s64, c), "no error");  // valid ids and counts
  EXPECT_EQ(bwd(x64, p64, s64, s64, s64, dl64), "no error");
  EXPECT_EQ(bwd(x64, p64, {}, {}, {}, dl64), "no error");
  EXPECT_TRUE(has(bwd(x64, p32, s64, s64, s64, dl64),
                  "dprobs must be float64 (the dtype of logits), got float32 [3,2]"));
  EXPECT_TRUE(has(bwd(x64, p64, s32, s64, s64, dl64), "daux_loss must be float64"));
  EXPECT_TRUE(has(bwd(x64, p64, s64, s32, s64, dl64), "dz_loss must be float64"));
  EXPECT_TRUE(has(bwd(x64, p64, s64, s64, s32, dl64), "dseq_aux_loss must be float64"));
  EXPECT_TRUE(has(bwd(x64, p64, s64, s64, s64, dl32),
                  "dlogits must be float64 (the dtype of logits), got float32 [3,8]"));
  EXPECT_TRUE(has(bwd(x32, p32, s32, s32, s32, dl64),
                  "dlogits must be float32 (the dtype of logits), got float64 [3,8]"));
  EXPECT_TRUE(has(bwd(x32, p64, s32, s32, s32, dl32), "dprobs must be float32"));

  // The expert-bias update stays float32.
  EXPECT_TRUE(
      has(message_of([&] { router_update_expert_bias(counts, make_tensor({E}, kF64), 0.1f); }),
          "expert_bias must be float32 [8] on cpu, got float64 [8]"));
}

// On a CUDA device the router takes float32 only. The checks come before any
// access, so views of host memory labelled cuda:0 exercise them without a GPU.
TEST(RouterF64, Float64OnCudaIsAnError) {
  const int E = 8, K = 2;
  const int64_t T = 3;
  std::vector<double> mem(T * E);
  const Device gpu = Device::cuda(0);
  TensorView x(mem.data(), kF64, gpu, {T, E});
  TensorView ids(mem.data(), DType::kInt32, gpu, {T, K});
  TensorView p(mem.data(), kF64, gpu, {T, K});
  const std::string want =
      "logits must be float32 on cuda:0 (float64 logits are taken on the CPU only), got float64 "
      "[3,8] on cuda:0";
  EXPECT_TRUE(has(message_of([&] {
                    router_forward(
                        x, cfg(E, K),
                        RouterOutputs{ids, p, TensorView(mem.data(), DType::kInt32, gpu, {E})});
                  }),
                  want));
  EXPECT_TRUE(
      has(message_of([&] { router_backward(x, ids, {}, RouterGrads{p}, cfg(E, K), x); }), want));
  RouterCapacityConfig cc;
  cc.num_experts = E;
  cc.capacity_factor = 1.0;
  EXPECT_TRUE(has(message_of([&] { router_apply_capacity(ids, p, cc, ids); }),
                  "probs must be float32 [3,2] on cuda:0, got float64 [3,2] on cuda:0"));
}

}  // namespace
}  // namespace moeflow::test
