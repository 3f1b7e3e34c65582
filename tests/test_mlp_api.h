// Shared body of the grouped-MLP API tests (CPU and GPU): one case run on a
// device against the float64 reference.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>

#include "cpu/grouped_mlp.h"
#include "moeflow/grouped_mlp.h"
#include "moeflow/grouped_mlp_fp8.h"
#include "test_util.h"

namespace moeflow::test {

struct MlpApiCase {
  Activation act;
  int interleave;  // 0: halves
  bool bias, probs;
  int64_t h, f;
  // FC weights and their float32 gradients as E separate tensors
  // (GroupedMlpWeights::fc1_experts ..., pointer tables) instead of stacked
  bool separate = false;
};

inline std::vector<MlpApiCase> mlp_api_cases() {
  std::vector<MlpApiCase> cases;
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kClampedQuickGeGLU})
    for (int il : {0, 8})
      for (bool bias : {false, true})
        for (bool probs : {false, true}) cases.push_back({act, il, bias, probs, 40, 64});
  for (Activation act : {Activation::kGelu, Activation::kRelu, Activation::kSquaredRelu})
    cases.push_back({act, 0, true, true, 48, 64});
  // separate expert tensors (on Hopper: FC1 unfused, with its own activation kernel)
  cases.push_back({Activation::kSwiGLU, 0, true, true, 40, 64, true});
  cases.push_back({Activation::kGeGLU, 8, false, true, 48, 64, true});
  cases.push_back({Activation::kGelu, 0, true, false, 48, 64, true});
  // an interleave that is not a multiple of 8: the unfused FC1 and the
  // scalar epilogue / recompute kernel (the others take the vectorised one)
  cases.push_back({Activation::kSwiGLU, 4, true, true, 40, 64});
  cases.push_back({Activation::kGeGLU, 4, false, true, 48, 64, true});
  return cases;
}
// F over several 256-column tiles, the last one partial (the fused dGLU's
// per-tile partial dprobs).
inline std::vector<MlpApiCase> mlp_api_wide_cases() {
  return {{Activation::kSwiGLU, 0, true, true, 40, 320},
          {Activation::kGeGLU, 32, false, true, 48, 288}};
}

inline std::vector<double> doubles_of(const Tensor& t, int64_t n = -1) {
  std::vector<double> v(n < 0 ? t.numel() : n);
  for (size_t i = 0; i < v.size(); ++i) v[i] = at(t, static_cast<int64_t>(i));
  return v;
}

inline double rel_norm_error(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// gemm: the GEMMs' kernel choice and tuning (GPU runs of every kernel);
// stream: where the MLP's ops run (the copies and fills on the default one).
inline void run_mlp_api_case(const MlpApiCase& cs, Device dev, uint32_t seed,
                             const GemmOptions& gemm = {}, cudaStream_t stream = nullptr) {
  SCOPED_TRACE("act=" + std::to_string(static_cast<int>(cs.act)) +
               " il=" + std::to_string(cs.interleave) + (cs.bias ? " bias" : "") +
               (cs.probs ? " probs" : "") + (cs.separate ? " separate" : "") + " on " + dev.str());
  const DType dt = DType::kBFloat16;
  const int E = 5;
  // pad rows, an empty expert, and an expert padded far past its rows (a
  // capacity layout: 128-row tiles of pad rows only)
  const std::vector<int64_t> offsets = {0, 32, 32, 48, 80, 400}, real = {29, 0, 1, 32, 7};
  const int64_t rows = offsets.back(), H = cs.h, F = cs.f;
  cpu::mlp::Shape shape{E, H, F};
  cpu::mlp::Config cfg;
  cfg.act = cs.act;
  cfg.glu_interleave = cs.interleave;
  cfg.bias1 = cfg.bias2 = cs.bias;
  cfg.weighted = cs.probs;
  // default clamp limit (7); the clamps' edges are checked in test_grouped_mlp
  const int64_t N1 = cpu::mlp::fc1_rows(shape, cfg);

  Tensor x = make_tensor({rows, H}, dt), w1 = make_tensor({E, N1, H}, dt),
         w2 = make_tensor({E, H, F}, dt);
  Tensor b1 = make_tensor({E, N1}, dt), b2 = make_tensor({E, H}, dt),
         probs = make_tensor({rows}, DType::kFloat32);
  Tensor dy = make_tensor({rows, H}, dt);
  fill_random(x, seed);
  fill_random(w1, seed + 1, -0.3f, 0.3f);
  fill_random(w2, seed + 2, -0.3f, 0.3f);
  fill_random(b1, seed + 3, -0.5f, 0.5f);
  fill_random(b2, seed + 4, -0.5f, 0.5f);
  fill_random(probs, seed + 5, 0.1f, 1.0f);
  fill_random(dy, seed + 6);
  // pad rows of the inputs are zero, as a permute leaves them
  for (int e = 0; e < E; ++e)
    for (int64_t r = offsets[e] + real[e]; r < offsets[e + 1]; ++r)
      for (int64_t j = 0; j < H; ++j) {
        detail::store_float(x.data(), dt, r * H + j, 0.0f);
        detail::store_float(dy.data(), dt, r * H + j, 0.0f);
      }

  cpu::mlp::Groups g{offsets, real};
  cpu::mlp::Params prm{doubles_of(w1), doubles_of(b1), doubles_of(w2), doubles_of(b2)};
  std::vector<double> y_ref;
  cpu::mlp::Saved saved_ref;
  const std::vector<double> xd = doubles_of(x), pd = doubles_of(probs), dyd = doubles_of(dy);
  cpu::mlp::forward(shape, cfg, g, prm, xd, pd, y_ref, saved_ref);

  Tensor offs_t = make_tensor({E + 1}, DType::kInt64), real_t = make_tensor({E}, DType::kInt32);
  for (int e = 0; e <= E; ++e) offs_t.data_ptr<int64_t>()[e] = offsets[e];
  for (int e = 0; e < E; ++e) real_t.data_ptr<int32_t>()[e] = static_cast<int32_t>(real[e]);
  auto on = [&](const Tensor& t) { return t.to(dev); };
  Tensor x_d = on(x), w1_d = on(w1), w2_d = on(w2), b1_d = on(b1), b2_d = on(b2), p_d = on(probs),
         dy_d = on(dy);
  Tensor offs_d = on(offs_t), real_d = on(real_t);
  GroupLayout layout;
  layout.offsets = offs_d;
  layout.real_rows = real_d;
  GroupedMlpWeights w{w1_d, w2_d, cs.bias ? TensorView(b1_d) : TensorView{},
                      cs.bias ? TensorView(b2_d) : TensorView{}};
  // Separate storage: every expert's weight in its own allocation, and a
  // device table of their addresses.
  std::vector<Tensor> keep;
  std::vector<ExpertTable> tables;
  auto separate = [&](const Tensor& stacked, DType d) {
    const int64_t n = stacked.size(1), k = stacked.size(2);
    const size_t bytes = static_cast<size_t>(n * k) * dtype_size(d);
    Tensor host_stacked = stacked.to(Device::cpu());
    std::vector<TensorView> views;
    for (int e = 0; e < E; ++e) {
      Tensor one = make_tensor({n, k}, d);
      std::memcpy(one.data(), static_cast<const uint8_t*>(host_stacked.data()) + e * bytes, bytes);
      keep.push_back(one.to(dev));
      views.push_back(keep.back());
    }
    tables.push_back(make_expert_table(views));
    return tables.back().weights;
  };
  // The E separate tensors of a pointer table, back into one host [E, n, k] tensor.
  auto gather = [&](const GroupedWeights& g) {
    Tensor out = make_tensor({E, g.n, g.k}, g.dtype), ptrs = make_tensor({E}, DType::kInt64);
    copy(g.pointers, ptrs);
    const size_t bytes = static_cast<size_t>(g.n * g.k) * dtype_size(g.dtype);
    for (int e = 0; e < E; ++e) {
      TensorView one(reinterpret_cast<void*>(static_cast<uintptr_t>(ptrs.data_ptr<int64_t>()[e])),
                     g.dtype, dev, {g.n, g.k});
      copy(one, TensorView(static_cast<uint8_t*>(out.data()) + e * bytes, g.dtype, Device::cpu(),
                           {g.n, g.k}));
    }
    return out;
  };
  if (cs.separate) {
    w.fc1_experts = separate(w1_d, dt);
    w.fc2_experts = separate(w2_d, dt);
    w.fc1 = TensorView{};
    w.fc2 = TensorView{};
  }
  GroupedMlpConfig c;
  c.activation = cs.act;
  c.params = cfg.params;
  c.glu_interleave = cs.interleave;
  c.gemm = gemm;
  auto poisoned = [&](std::vector<int64_t> shape_, DType d) {
    Tensor t = Tensor::empty(shape_, d, dev);
    fill_bytes(t, 0xFF);
    return t;
  };
  Tensor y = poisoned({rows, H}, dt), h = poisoned({rows, N1}, dt), a = poisoned({rows, F}, dt);
  const TensorView pv = cs.probs ? TensorView(p_d) : TensorView{};
  grouped_mlp_forward(x_d, w, layout, pv, c, y, GroupedMlpSaved{h, a}, stream);
  // The reference gradients at the pre-activation the device saved (h is
  // checked against the float64 forward below): the backward is a function of
  // saved.h, and a kinked activation (ReLU, the clamps) evaluated at the
  // float64 h would differ wherever rounding moved h across the kink (a few
  // elements in 10^4 per case, up to 5 % of the gradients' norm).
  cpu::mlp::Grads gr;
  {
    cpu::mlp::Saved at_saved_h{doubles_of(h.to(Device::cpu())), saved_ref.a};
    cpu::mlp::backward(shape, cfg, g, prm, xd, pd, dyd, at_saved_h, gr);
  }
  Tensor dx = poisoned({rows, H}, dt), d_h = poisoned({rows, N1}, dt),
         dprobs = poisoned({rows}, DType::kFloat32);
  grouped_mlp_backward_dgrad(dy_d, w, layout, pv, c, GroupedMlpSaved{h, a}, dx, d_h,
                             cs.probs ? TensorView(dprobs) : TensorView{}, stream);
  // Keeping only h: backward_dgrad without saved.a gives the same bits, and
  // a recomputed from h is the forward's a (bitwise on the CPU, within the
  // tolerance on the GPU, where the forward's a may come from the fused FC1).
  {
    Tensor dx2 = poisoned({rows, H}, dt), d_h2 = poisoned({rows, N1}, dt),
           dprobs2 = poisoned({rows}, DType::kFloat32);
    grouped_mlp_backward_dgrad(dy_d, w, layout, pv, c, GroupedMlpSaved{h, {}}, dx2, d_h2,
                               cs.probs ? TensorView(dprobs2) : TensorView{}, stream);
    EXPECT_TRUE(bytes_equal(dx2.to(Device::cpu()), dx.to(Device::cpu()))) << "dx without saved.a";
    EXPECT_TRUE(bytes_equal(d_h2.to(Device::cpu()), d_h.to(Device::cpu())))
        << "d_h without saved.a";
    if (cs.probs)
      EXPECT_TRUE(bytes_equal(dprobs2.to(Device::cpu()), dprobs.to(Device::cpu())))
          << "dprobs without saved.a";
    Tensor a2 = poisoned({rows, F}, dt);
    grouped_mlp_recompute_activation(h, layout, pv, c, a2, stream);
    if (dev.is_cpu()) EXPECT_TRUE(bytes_equal(a2, a)) << "recomputed a";
    std::vector<double> a_want(saved_ref.a);
    if (cs.probs)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < F; ++j) a_want[r * F + j] *= pd[r];
    EXPECT_LE(rel_norm_error(doubles_of(a2.to(Device::cpu())), a_want), 2 * gemm_tolerance(dt))
        << "recomputed a";
  }
  Tensor dw1 = Tensor::zeros({E, N1, H}, DType::kFloat32, dev),
         dw2 = Tensor::zeros({E, H, F}, DType::kFloat32, dev);
  Tensor db1 = Tensor::zeros({E, N1}, DType::kFloat32, dev),
         db2 = Tensor::zeros({E, H}, DType::kFloat32, dev);
  GroupedMlpGrads grads{dw1, dw2, cs.bias ? TensorView(db1) : TensorView{},
                        cs.bias ? TensorView(db2) : TensorView{}, false};
  if (cs.separate) {
    grads.dw1_experts = separate(dw1, DType::kFloat32);
    grads.dw2_experts = separate(dw2, DType::kFloat32);
    grads.dw1 = TensorView{};
    grads.dw2 = TensorView{};
  }
  grouped_mlp_backward_wgrad(dy_d, x_d, layout, GroupedMlpSaved{h, a}, d_h, grads, gemm, stream);
  grads.accumulate = true;  // twice the gradient
  grouped_mlp_backward_wgrad(dy_d, x_d, layout, GroupedMlpSaved{h, a}, d_h, grads, gemm, stream);

  const double tol = gemm_tolerance(dt) * 2;  // two chained bf16 GEMMs
  auto host = [](const Tensor& t) { return t.to(Device::cpu()); };
  EXPECT_LE(rel_norm_error(doubles_of(host(y)), y_ref), tol) << "y";
  EXPECT_LE(rel_norm_error(doubles_of(host(h)), saved_ref.h), tol) << "saved.h";
  std::vector<double> a_ref(saved_ref.a);
  if (cs.probs)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < F; ++j) a_ref[r * F + j] *= pd[r];
  EXPECT_LE(rel_norm_error(doubles_of(host(a)), a_ref), tol) << "saved.a";
  EXPECT_LE(rel_norm_error(doubles_of(host(dx)), gr.dx), 2 * tol) << "dx";
  if (cs.probs) EXPECT_LE(rel_norm_error(doubles_of(host(dprobs)), gr.dprobs), 2 * tol) << "dprobs";
  auto twice = [](std::vector<double> v) {
    for (double& d : v) d *= 2;
    return v;
  };
  const Tensor dw1_h = cs.separate ? gather(grads.dw1_experts) : host(dw1),
               dw2_h = cs.separate ? gather(grads.dw2_experts) : host(dw2);
  EXPECT_LE(rel_norm_error(doubles_of(dw1_h), twice(gr.dw1)), 2 * tol) << "dw1";
  EXPECT_LE(rel_norm_error(doubles_of(dw2_h), twice(gr.dw2)), 2 * tol) << "dw2";
  if (cs.bias) {
    EXPECT_LE(rel_norm_error(doubles_of(host(db1)), twice(gr.db1)), 2 * tol) << "db1";
    EXPECT_LE(rel_norm_error(doubles_of(host(db2)), twice(gr.db2)), 2 * tol) << "db2";
  }
  // pad rows: zero outputs
  Tensor yh = host(y);
  for (int e = 0; e < E; ++e)
    for (int64_t r = offsets[e] + real[e]; r < offsets[e + 1]; ++r)
      ASSERT_EQ(at(yh, r * H), 0.0f) << "pad row " << r;
}

// Three groups of 100 rows on `dev`: rows 0-19 real, 20-31 pad; an empty
// group; rows 32-92 real, 93-95 pad; rows 96-99 past the groups.
struct ThreeGroups {
  Tensor offs, real;
  GroupLayout g;
  explicit ThreeGroups(Device dev) {
    Tensor o = make_tensor({4}, DType::kInt64), r = make_tensor({3}, DType::kInt32);
    const int64_t ov[] = {0, 32, 32, 96};
    const int32_t rv[] = {20, 0, 61};
    std::copy(ov, ov + 4, o.data_ptr<int64_t>());
    std::copy(rv, rv + 3, r.data_ptr<int32_t>());
    offs = o.to(dev);
    real = r.to(dev);
    g.offsets = offs;
    g.real_rows = real;
  }
  static bool is_data(int64_t r) { return r < 20 || (r >= 32 && r < 93); }
};

// grouped_mlp_activation_backward's d_h_amax on `dev`: the same d_h as
// without it, and the largest finite |d(h)| over the real rows of that d_h
// (read back on the host); an inf and a NaN in d(a) of real rows and huge
// values in pad rows and past the groups stay out. The vectorised kernel
// (halves, F % 8 == 0), the general one (interleave 16) and a plain
// activation; then quantize_group_rows_with_amax from it equals
// quantize_group_rows of d_h.
inline void expect_activation_backward_amax(Device dev) {
  const DType dt = DType::kBFloat16;
  const int64_t rows = 100;
  const ThreeGroups groups(dev);
  const GroupLayout& g = groups.g;
  uint32_t seed = 120;
  for (const auto& [act, il, f] : {std::tuple{Activation::kSwiGLU, 0, int64_t{256}},
                                   std::tuple{Activation::kSwiGLU, 16, int64_t{160}},
                                   std::tuple{Activation::kGelu, 0, int64_t{200}}}) {
    SCOPED_TRACE(std::to_string(static_cast<int>(act)) + " il=" + std::to_string(il));
    const int64_t n1 = is_gated(act) ? 2 * f : f;
    Tensor h = make_tensor({rows, n1}, dt), d = make_tensor({rows, n1}, dt);
    Tensor probs = make_tensor({rows}, DType::kFloat32);
    fill_random(h, seed++, -4.0f, 4.0f);
    fill_random(d, seed++, -2.0f, 2.0f);
    fill_random(probs, seed++, 0.1f, 1.0f);
    detail::store_float(d.data(), dt, 3 * n1 + n1 - 1, INFINITY);  // real rows 3 and 40
    detail::store_float(d.data(), dt, 40 * n1 + n1 - 2, NAN);
    for (int64_t r : {25, 97})  // a pad row, a row past the groups
      for (int64_t c = 0; c < n1; ++c) detail::store_float(d.data(), dt, r * n1 + c, 3e4f);
    GroupedMlpConfig cfg;
    cfg.activation = act;
    cfg.glu_interleave = il;
    Tensor h_d = h.to(dev), probs_d = probs.to(dev);
    Tensor d1 = d.to(dev), d2 = d.to(dev), amax = poisoned({1}, DType::kFloat32, dev);
    grouped_mlp_activation_backward(h_d, g, probs_d, cfg, d1);
    grouped_mlp_activation_backward(h_d, g, probs_d, cfg, d2, {}, amax);
    Tensor got = d2.to(Device::cpu());
    EXPECT_TRUE(bytes_equal(got, d1.to(Device::cpu()))) << "d_h with d_h_amax";
    float want = 0.0f;
    for (int64_t r = 0; r < rows; ++r)
      if (ThreeGroups::is_data(r))
        for (int64_t c = 0; c < n1; ++c) {
          const float v = std::fabs(detail::load_float(got.data(), dt, r * n1 + c));
          if (std::isfinite(v)) want = std::max(want, v);
        }
    EXPECT_GT(want, 0.0f);
    EXPECT_EQ(at(amax.to(Device::cpu()), 0), want);
    const QuantizeConfig qc{DType::kFloat8E4M3, QuantScaling::kTensorwise, false, false};
    Tensor q1 = poisoned({rows, n1}, qc.out, dev), s1 = poisoned({1}, DType::kFloat32, dev);
    Tensor q2 = poisoned({rows, n1}, qc.out, dev), s2 = poisoned({1}, DType::kFloat32, dev);
    quantize_group_rows(d2, g, qc, q1, s1);
    quantize_group_rows_with_amax(d2, g, qc, amax, q2, s2);
    EXPECT_TRUE(bytes_equal(q2.to(Device::cpu()), q1.to(Device::cpu())));
    EXPECT_TRUE(bytes_equal(s2.to(Device::cpu()), s1.to(Device::cpu())));
  }
}

// grouped_mlp_activation_quantize on `dev` against the composition on the
// same device: recompute_activation into a of h's dtype, then quantize (1x128
// rowwise) of the group rows; pad rows code 0 / scale 1, rows past the
// groups untouched (poisoned).
inline void expect_activation_quantize_is_composition(Device dev) {
  const DType dt = DType::kBFloat16;
  const int64_t rows = 100;
  const ThreeGroups groups(dev);
  const GroupLayout& g = groups.g;
  uint32_t seed = 90;
  struct Q {
    Activation act;
    int il;
    int64_t f;
    bool probs;
  };
  for (const Q& q :
       {Q{Activation::kSwiGLU, 0, 256, true}, Q{Activation::kSwiGLU, 8, 200, false},
        Q{Activation::kGeGLU, 4, 136, true}, Q{Activation::kGelu, 0, 1000, true},
        Q{Activation::kSquaredRelu, 0, 96, false}, Q{Activation::kSwiGLU, 16, 160, true}}) {
    for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
      const bool pow2 = out == DType::kFloat8E5M2;
      SCOPED_TRACE(std::to_string(static_cast<int>(q.act)) + " il=" + std::to_string(q.il) +
                   " F=" + std::to_string(q.f) + " " + dtype_name(out));
      const int64_t n1 = is_gated(q.act) ? 2 * q.f : q.f, nb = blocks128(q.f);
      Tensor h = make_tensor({rows, n1}, dt), probs = make_tensor({rows}, DType::kFloat32);
      fill_random(h, seed++, -6.0f, 6.0f);
      fill_random(probs, seed++, 0.0f, 1.0f);
      Tensor h_d = h.to(dev), probs_d = probs.to(dev);
      GroupedMlpConfig cfg;
      cfg.activation = q.act;
      cfg.glu_interleave = q.il;
      const QuantizeConfig qc{out, QuantScaling::kBlock1x128, pow2, false};
      const TensorView pv = q.probs ? TensorView(probs_d) : TensorView{};
      Tensor aq = poisoned({rows, q.f}, out, dev), as = poisoned({rows, nb}, DType::kFloat32, dev);
      grouped_mlp_activation_quantize(h_d, g, pv, cfg, qc, aq, as);
      Tensor a = poisoned({rows, q.f}, dt, dev);
      grouped_mlp_recompute_activation(h_d, g, pv, cfg, a);
      Tensor wq = poisoned({rows, q.f}, out, dev), ws = poisoned({rows, nb}, DType::kFloat32, dev);
      const int64_t n = 96;  // the group rows
      auto rows_of = [&](const Tensor& t, int64_t cols, DType d) {
        return TensorView::strided(const_cast<void*>(t.data()), d, dev, {n, cols}, {cols, 1});
      };
      quantize(rows_of(a, q.f, dt), qc, rows_of(wq, q.f, out), rows_of(ws, nb, DType::kFloat32));
      Tensor aq_c = aq.to(Device::cpu()), as_c = as.to(Device::cpu());
      EXPECT_TRUE(bytes_equal(aq_c, wq.to(Device::cpu())));
      EXPECT_TRUE(bytes_equal(as_c, ws.to(Device::cpu())));
      for (int64_t r = 0; r < rows; ++r) {
        const bool pad = (r >= 20 && r < 32) || (r >= 93 && r < 96);
        if (r >= 96) {
          ASSERT_TRUE(row_is(aq_c, r, 0xFF) && row_is(as_c, r, 0xFF)) << "row past groups: " << r;
        } else if (pad) {
          ASSERT_TRUE(row_is(aq_c, r, 0)) << "pad row " << r;
          for (int64_t b = 0; b < nb; ++b) ASSERT_EQ(as_c.data_ptr<float>()[r * nb + b], 1.0f) << r;
        }
      }
      // Tensorwise: the same bits as recompute_activation then
      // quantize_group_rows; pad rows and rows past the groups code 0; the
      // transposed form too.
      const QuantizeConfig tc{out, QuantScaling::kTensorwise, pow2, false};
      Tensor tq = poisoned({rows, q.f}, out, dev), ts = poisoned({1}, DType::kFloat32, dev);
      grouped_mlp_activation_quantize(h_d, g, pv, cfg, tc, tq, ts);
      Tensor cq = poisoned({rows, q.f}, out, dev), cs = poisoned({1}, DType::kFloat32, dev);
      quantize_group_rows(a, g, tc, cq, cs);
      Tensor tq_c = tq.to(Device::cpu());
      EXPECT_TRUE(bytes_equal(tq_c, cq.to(Device::cpu())));
      EXPECT_TRUE(bytes_equal(ts.to(Device::cpu()), cs.to(Device::cpu())));
      for (int64_t r = 0; r < rows; ++r)
        if ((r >= 20 && r < 32) || r >= 93) ASSERT_TRUE(row_is(tq_c, r, 0)) << "row " << r;
      // With the transposed codes: the same codes, and those transposed.
      Tensor tq2 = poisoned({rows, q.f}, out, dev), ts2 = poisoned({1}, DType::kFloat32, dev),
             tt = poisoned({q.f, rows}, out, dev);
      grouped_mlp_activation_quantize(h_d, g, pv, cfg, tc, tq2, ts2, tt);
      EXPECT_TRUE(bytes_equal(tq2.to(Device::cpu()), tq_c));
      EXPECT_TRUE(bytes_equal(ts2.to(Device::cpu()), ts.to(Device::cpu())));
      const Tensor tt_c = tt.to(Device::cpu());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < q.f; ++c)
          ASSERT_EQ(tt_c.data_ptr<uint8_t>()[c * rows + r], tq_c.data_ptr<uint8_t>()[r * q.f + c])
              << "a_q_t[" << c << "][" << r << "]";
    }
  }
}

}  // namespace moeflow::test
