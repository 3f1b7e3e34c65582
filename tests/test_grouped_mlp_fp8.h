// Shared body of the grouped MLP's FP8 recipe tests (moeflow/grouped_mlp_fp8.h):
// one problem (an empty expert, pad rows, rows past the groups) run through
// grouped_mlp_fp8_weights / _forward / _backward_dgrad on a device, with the
// bf16 MLP beside it on the same device. Outputs are poisoned first.
#pragma once

#include <cmath>
#include <random>

#include "moeflow/grouped_mlp_fp8.h"
#include "test_util.h"

namespace moeflow::test {

struct Fp8MlpResult {
  Tensor y, h, d_h, dx, dprobs;  // the FP8 recipe (CPU copies)
  Tensor y16, dx16, dprobs16;    // the bf16 MLP
  int64_t used = 0;              // rows inside the groups
  std::vector<int64_t> offsets, real;
};

// The host inputs of one problem: x and dy [rows, 256] bf16 (pad rows zero,
// as permute and unpermute_backward write them), W1 [3, 256, 256] and W2
// [3, 256, 128] bf16, probs [rows], the groups' offsets and real rows.
struct Fp8Inputs {
  Tensor x, dy, w1, w2, probs, offs, real;
};

inline Fp8Inputs fp8_inputs(uint32_t seed, int64_t rows, const std::vector<int64_t>& offsets,
                            const std::vector<int64_t>& real) {
  const int64_t E = 3, H = 256, F = 128, N1 = 2 * F;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto randn = [&](std::vector<int64_t> shape, DType dt, float scale) {
    Tensor t = make_tensor(shape, dt);
    for (int64_t i = 0; i < t.numel(); ++i) detail::store_float(t.data(), dt, i, nd(rng) * scale);
    return t;
  };
  const DType bf = DType::kBFloat16, f32 = DType::kFloat32;
  Fp8Inputs in;
  in.x = randn({rows, H}, bf, 1.0f);
  in.dy = randn({rows, H}, bf, 1.0f);
  in.w1 = randn({E, N1, H}, bf, 1.0f / 16);
  in.w2 = randn({E, H, F}, bf, 1.0f / std::sqrt(128.f));
  in.probs = make_tensor({rows}, f32);
  for (int64_t i = 0; i < rows; ++i) in.probs.data_ptr<float>()[i] = 0.25f + 0.5f * (i % 7) / 7.0f;
  in.offs = make_tensor({E + 1}, DType::kInt64);
  in.real = make_tensor({E}, DType::kInt32);
  for (int64_t e = 0; e <= E; ++e) in.offs.data_ptr<int64_t>()[e] = offsets[e];
  for (int64_t e = 0; e < E; ++e) in.real.data_ptr<int32_t>()[e] = static_cast<int32_t>(real[e]);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t row = offsets[e] + real[e]; row < offsets[e + 1]; ++row)
      for (int64_t k = 0; k < H; ++k) {
        detail::store_float(in.x.data(), bf, row * H + k, 0.0f);
        detail::store_float(in.dy.data(), bf, row * H + k, 0.0f);
      }
  return in;
}

// stream: where the MLP's ops run (the copies and fills on the default one).
inline Fp8MlpResult run_fp8_mlp(Device dev, uint32_t seed, Fp8Recipe recipe = Fp8Recipe::kBlockwise,
                                cudaStream_t stream = nullptr) {
  const int64_t E = 3, H = 256, F = 128, N1 = 2 * F, rows = 192;
  Fp8MlpResult r;
  r.offsets = {0, 48, 48, 176};
  r.real = {40, 0, 120};
  r.used = r.offsets.back();
  const DType bf = DType::kBFloat16, f32 = DType::kFloat32, e4 = DType::kFloat8E4M3;
  const Fp8Inputs in = fp8_inputs(seed, rows, r.offsets, r.real);
  const Tensor &x = in.x, &dy = in.dy, &w1 = in.w1, &w2 = in.w2, &probs = in.probs,
               &offs = in.offs, &real = in.real;
  Tensor xd = x.to(dev), dyd = dy.to(dev), w1d = w1.to(dev), w2d = w2.to(dev), pd = probs.to(dev);
  Tensor offs_d = offs.to(dev), real_d = real.to(dev);  // the layout's storage
  GroupLayout g;
  g.offsets = offs_d;
  g.real_rows = real_d;
  GroupedMlpWeights w;
  w.fc1 = w1d;
  w.fc2 = w2d;
  GroupedMlpConfig cfg;  // SwiGLU, halves
  GroupedMlpFp8Weights q;
  q.recipe = recipe;
  const bool tw = recipe == Fp8Recipe::kTensorwise;  // every scale [1]
  const auto sc = [&](std::vector<int64_t> blocks) {
    return poisoned(tw ? std::vector<int64_t>{1} : blocks, f32, dev);
  };
  Tensor q1 = poisoned({E, N1, H}, e4, dev), s1 = sc({E, N1 / 128, H / 128});
  Tensor q2 = poisoned({E, H, F}, e4, dev), s2 = sc({E, H / 128, F / 128});
  Tensor q1t = poisoned({E, H, N1}, e4, dev), s1t = sc({E, H / 128, N1 / 128});
  Tensor q2t = poisoned({E, F, H}, e4, dev), s2t = sc({E, F / 128, H / 128});
  q.fc1 = q1, q.fc1_scales = s1, q.fc2 = q2, q.fc2_scales = s2;
  q.fc1_t = q1t, q.fc1_t_scales = s1t, q.fc2_t = q2t, q.fc2_t_scales = s2t;
  GroupedMlpFp8Scratch scratch;
  Tensor codes = poisoned({rows * std::max(H, N1)}, DType::kUInt8, dev);
  Tensor scales = poisoned({tw ? 1 : rows * std::max(H, N1) / 128}, f32, dev);
  scratch.codes = codes;
  scratch.scales = scales;

  grouped_mlp_fp8_weights(w, q, stream);
  Tensor y = poisoned({rows, H}, bf, dev), h = poisoned({rows, N1}, bf, dev);
  grouped_mlp_fp8_forward(xd, q, g, pd, cfg, y, h, scratch, stream);
  Tensor d_h = poisoned({rows, N1}, bf, dev), dx = poisoned({rows, H}, bf, dev);
  Tensor dprobs = poisoned({rows}, f32, dev);
  grouped_mlp_fp8_backward_dgrad(dyd, q, g, pd, cfg, h, dx, d_h, dprobs, scratch, stream);

  Tensor y16 = poisoned({rows, H}, bf, dev), h16 = poisoned({rows, N1}, bf, dev);
  Tensor a16 = poisoned({rows, F}, bf, dev), dh16 = poisoned({rows, N1}, bf, dev);
  Tensor dx16 = poisoned({rows, H}, bf, dev), dp16 = poisoned({rows}, f32, dev);
  grouped_mlp_forward(xd, w, g, pd, cfg, y16, GroupedMlpSaved{h16, a16}, stream);
  grouped_mlp_backward_dgrad(dyd, w, g, pd, cfg, GroupedMlpSaved{h16, {}}, dx16, dh16, dp16,
                             stream);
  const Device cpu = Device::cpu();
  r.y = y.to(cpu), r.h = h.to(cpu), r.d_h = d_h.to(cpu), r.dx = dx.to(cpu);
  r.dprobs = dprobs.to(cpu), r.y16 = y16.to(cpu), r.dx16 = dx16.to(cpu), r.dprobs16 = dp16.to(cpu);
  return r;
}

// The FP8 weight gradients (grouped_mlp_fp8_backward_wgrad) on a problem
// with each expert's rows starting at a multiple of 128 (an empty expert,
// pad rows, rows past the groups), h and d_h from the FP8 forward and
// dgrad, beside the 16-bit wgrad on the same h, a and d_h. dw dtype `dwt`;
// with `accumulate`, dw starts at 1 everywhere.
struct Fp8WgradResult {
  Tensor dw1, dw2, dw1_16, dw2_16;  // CPU copies, float32
};

inline Fp8WgradResult run_fp8_wgrad(Device dev, uint32_t seed, DType dwt, bool accumulate,
                                    Fp8Recipe recipe = Fp8Recipe::kBlockwise) {
  const int64_t E = 3, H = 256, F = 128, N1 = 2 * F, rows = 512;
  // Tensorwise: the groups start off the 128-row blocks (any row is fine).
  const bool tw = recipe == Fp8Recipe::kTensorwise;
  const std::vector<int64_t> offsets =
      tw ? std::vector<int64_t>{0, 48, 48, 320} : std::vector<int64_t>{0, 128, 128, 384};
  const std::vector<int64_t> real = {40, 0, 200};
  const DType bf = DType::kBFloat16, f32 = DType::kFloat32, e4 = DType::kFloat8E4M3;
  const Fp8Inputs in = fp8_inputs(seed, rows, offsets, real);
  const Tensor &x = in.x, &dy = in.dy, &w1 = in.w1, &w2 = in.w2, &probs = in.probs,
               &offs = in.offs, &rr = in.real;
  Tensor xd = x.to(dev), dyd = dy.to(dev), pd = probs.to(dev), offs_d = offs.to(dev),
         real_d = rr.to(dev), w1d = w1.to(dev), w2d = w2.to(dev);
  GroupLayout g;
  g.offsets = offs_d;
  g.real_rows = real_d;
  GroupedMlpWeights w;
  w.fc1 = w1d;
  w.fc2 = w2d;
  GroupedMlpConfig cfg;
  const auto sc = [&](std::vector<int64_t> blocks) {
    return poisoned(tw ? std::vector<int64_t>{1} : blocks, f32, dev);
  };
  Tensor q1 = poisoned({E, N1, H}, e4, dev), s1 = sc({E, N1 / 128, H / 128});
  Tensor q2 = poisoned({E, H, F}, e4, dev), s2 = sc({E, H / 128, F / 128});
  Tensor q1t = poisoned({E, H, N1}, e4, dev), s1t = sc({E, H / 128, N1 / 128});
  Tensor q2t = poisoned({E, F, H}, e4, dev), s2t = sc({E, F / 128, H / 128});
  GroupedMlpFp8Weights q{q1, s1, q2, s2, q1t, s1t, q2t, s2t, recipe};
  Tensor codes = poisoned({rows * std::max(H, N1)}, DType::kUInt8, dev);
  Tensor scales = poisoned({rows * std::max(H, N1) / 128}, f32, dev);
  GroupedMlpFp8Scratch scratch{codes, scales};
  grouped_mlp_fp8_weights(w, q);
  Tensor y = poisoned({rows, H}, bf, dev), h = poisoned({rows, N1}, bf, dev);
  grouped_mlp_fp8_forward(xd, q, g, pd, cfg, y, h, scratch);
  Tensor d_h = poisoned({rows, N1}, bf, dev);
  grouped_mlp_fp8_backward_dgrad(dyd, q, g, pd, cfg, h, {}, d_h, {}, scratch);
  // rows past the groups: finite garbage (their own 128-row blocks, never read)
  for (Tensor* t : {&h, &d_h}) {
    Tensor c = t->to(Device::cpu());
    for (int64_t i = offsets[E] * N1; i < rows * N1; ++i)
      detail::store_float(c.data(), bf, i, 3.0f);
    *t = c.to(dev);
  }

  auto start = [&](std::vector<int64_t> shape, DType dt) {
    Tensor t = make_tensor(shape, dt);
    for (int64_t i = 0; i < t.numel(); ++i) detail::store_float(t.data(), dt, i, 1.0f);
    return accumulate ? t.to(dev) : poisoned(shape, dt, dev);
  };
  Tensor dw1 = start({E, N1, H}, dwt), dw2 = start({E, H, F}, dwt);
  Tensor wc = poisoned({rows * (H + N1 + (tw ? std::max(H, N1) : 0))}, DType::kUInt8, dev);
  Tensor ws = poisoned({tw ? 2 : (H + N1) * (rows / 128)}, f32, dev);
  Tensor wa = poisoned({rows * F}, bf, dev);
  grouped_mlp_fp8_backward_wgrad(xd, dyd, g, pd, cfg, h, d_h, dw1, dw2, accumulate,
                                 GroupedMlpFp8WgradScratch{wc, ws, wa}, recipe);
  Tensor a16 = poisoned({rows, F}, bf, dev);
  grouped_mlp_recompute_activation(h, g, pd, cfg, a16);
  Tensor r1 = start({E, N1, H}, dwt), r2 = start({E, H, F}, dwt);
  GroupedMlpGrads grads;
  grads.dw1 = r1;
  grads.dw2 = r2;
  grads.accumulate = accumulate;
  grouped_mlp_backward_wgrad(dyd, xd, g, GroupedMlpSaved{h, a16}, d_h, grads);
  const auto f = [&](const Tensor& t) {
    Tensor c = t.to(Device::cpu()), o = make_tensor(c.sizes(), f32);
    for (int64_t i = 0; i < c.numel(); ++i)
      o.data_ptr<float>()[i] = at(c, i) - (accumulate ? 1.0f : 0.0f);
    return o;
  };
  return {f(dw1), f(dw2), f(r1), f(r2)};
}

// Relative Frobenius error and DeepGEMM's calc_diff over the first n values.
inline std::pair<double, double> fp8_errors(const Tensor& got, const Tensor& want, int64_t n) {
  double num = 0, den = 0, dot = 0, gg = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = at(got, i), b = at(want, i);
    if (std::isnan(a)) return {INFINITY, INFINITY};
    num += (a - b) * (a - b);
    den += b * b;
    dot += a * b;
    gg += a * a;
  }
  return {std::sqrt(num / std::max(den, 1e-30)), 1.0 - 2.0 * dot / std::max(gg + den, 1e-30)};
}

}  // namespace moeflow::test
