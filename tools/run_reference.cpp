// float64 host references of the grouped expert MLP step of `moeflow run`,
// on a sample (see run_common.h). For one slot (token t, its k-th expert e,
// router prob p), with the roundings to bf16 the kernels' stored tensors
// have:
//   h = bf16(x · W1_e^T)  [2F] = [g; u]     a = bf16(p · silu(g) · u)  [F]
//   y = bf16(a · W2_e^T)  [H]               out[t] = sum over slots of y
//   dy = bf16(dout[t])    da = dy · W2_e    [F]
//   dg = da · p · u · silu'(g), du = da · p · silu(g)   dh = bf16([dg; du])
//   dprob = sum_f da · silu(g) · u          dx[t] = sum over slots of bf16(dh · W1_e)
//   dW1_e += dh ⊗ x                         dW2_e += dy ⊗ a
// Backward values come with the sums of the |terms| of each sum (the scale
// an error of a few bf16 roundings is measured against: these sums cancel
// heavily, so their own norm would magnify harmless rounding differences).
// Weights are read from their patterns (no host copy of the tensors).
#include <cmath>

#include "tools/run_common.h"

namespace moeflow::bench {

namespace {

// Dot product with four partial sums (independent chains).
double dot(const double* a, const float* b, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

double sigmoid(double g) {
  return 1.0 / (1.0 + std::exp(-g));
}

// The token row t of a [T, H] bf16 or float32 host tensor, as float64.
std::vector<double> host_row(const Tensor& t, int64_t row, bool round_to_bf16) {
  const int64_t H = t.size(1);
  std::vector<double> v(H);
  for (int64_t j = 0; j < H; ++j) {
    const double x = t.dtype() == DType::kFloat32
                         ? double(t.data_ptr<float>()[row * H + j])
                         : double(bf16_bits_to_float(t.data_ptr<uint16_t>()[row * H + j]));
    v[j] = round_to_bf16 ? round_bf16(x) : x;
  }
  return v;
}

}  // namespace

std::vector<TokenReference> reference_tokens(const MlpHost& in, const std::vector<int64_t>& tokens,
                                             bool backward) {
  const int64_t H = in.H, F = in.F;
  const int K = in.K;
  std::vector<TokenReference> refs(tokens.size());
  parallel_for(static_cast<int64_t>(tokens.size()), [&](int64_t n) {
    const int64_t t = tokens[n];
    TokenReference& r = refs[n];
    r.out.assign(H, 0.0);
    if (backward) {
      r.dx.assign(H, 0.0);
      r.dx_abs.assign(H, 0.0);
      r.dprobs.assign(K, 0.0);
      r.dprobs_abs.assign(K, 0.0);
    }
    const std::vector<double> x = host_row(in.x, t, false);
    const std::vector<double> dy = backward ? host_row(in.dout, t, true) : std::vector<double>{};
    std::vector<double> g(F), u(F), a(F), da(F), dh(2 * F), dxs(H), dxa(H);
    for (int k = 0; k < K; ++k) {
      const int64_t e = in.ids.data_ptr<int32_t>()[t * K + k];
      if (e < 0) continue;
      const double p = in.probs.data_ptr<float>()[t * K + k];
      // forward: h = [g; u], a, y
      for (int64_t f = 0; f < F; ++f) {
        g[f] = round_bf16(dot(x.data(), in.w1->row((e * 2 * F + f) * H), H));
        u[f] = round_bf16(dot(x.data(), in.w1->row((e * 2 * F + F + f) * H), H));
        a[f] = round_bf16(p * g[f] * sigmoid(g[f]) * u[f]);
      }
      std::fill(da.begin(), da.end(), 0.0);
      for (int64_t j = 0; j < H; ++j) {  // row j of W2_e: y_j and its share of da
        const float* w2 = in.w2->row((e * H + j) * F);
        r.out[j] += round_bf16(dot(a.data(), w2, F));
        if (backward)
          for (int64_t f = 0; f < F; ++f) da[f] += dy[j] * w2[f];
      }
      if (!backward) continue;
      double dprob = 0, dprob_abs = 0;
      for (int64_t f = 0; f < F; ++f) {
        const double s = sigmoid(g[f]), silu = g[f] * s;
        dh[f] = round_bf16(da[f] * p * u[f] * s * (1.0 + g[f] * (1.0 - s)));
        dh[F + f] = round_bf16(da[f] * p * silu);
        dprob += da[f] * silu * u[f];
        dprob_abs += std::fabs(da[f] * silu * u[f]);
      }
      r.dprobs[k] = dprob;
      r.dprobs_abs[k] = dprob_abs;
      std::fill(dxs.begin(), dxs.end(), 0.0);
      std::fill(dxa.begin(), dxa.end(), 0.0);
      for (int64_t f2 = 0; f2 < 2 * F; ++f2) {  // dx row = dh · W1_e
        const float* w1 = in.w1->row((e * 2 * F + f2) * H);
        const double d = dh[f2], da_abs = std::fabs(d);
        for (int64_t j = 0; j < H; ++j) {
          dxs[j] += d * w1[j];
          dxa[j] += da_abs * std::fabs(w1[j]);
        }
      }
      for (int64_t j = 0; j < H; ++j) {
        r.dx[j] += round_bf16(dxs[j]);
        r.dx_abs[j] += dxa[j];
      }
    }
  });
  return refs;
}

ExpertGradReference reference_expert_grads(const MlpHost& in, int e,
                                           const std::vector<int64_t>& cols) {
  const int64_t H = in.H, F = in.F, T = in.T;
  const int K = in.K;
  // the slots routed to e
  std::vector<std::pair<int64_t, double>> slots;  // (token, prob)
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k)
      if (in.ids.data_ptr<int32_t>()[t * K + k] == e)
        slots.emplace_back(t, in.probs.data_ptr<float>()[t * K + k]);
  const int64_t nc = static_cast<int64_t>(cols.size());
  ExpertGradReference r;
  r.dw1_gate.assign(nc, std::vector<double>(H, 0.0));
  r.dw1_up.assign(nc, std::vector<double>(H, 0.0));
  r.dw2_col.assign(nc, std::vector<double>(H, 0.0));
  r.dw1_gate_abs = r.dw1_up_abs = r.dw2_col_abs = r.dw2_col;
  parallel_for(nc, [&](int64_t c) {
    const int64_t f = cols[c];
    const float* w1g = in.w1->row((e * 2 * F + f) * H);
    const float* w1u = in.w1->row((e * 2 * F + F + f) * H);
    std::vector<double> w2c(H);  // column f of W2_e
    for (int64_t j = 0; j < H; ++j) w2c[j] = in.w2->at((e * H + j) * F + f);
    for (const auto& [t, p] : slots) {
      const std::vector<double> x = host_row(in.x, t, false);
      const std::vector<double> dy = host_row(in.dout, t, true);
      const double g = round_bf16(dot(x.data(), w1g, H)), u = round_bf16(dot(x.data(), w1u, H));
      const double s = sigmoid(g), a = round_bf16(p * g * s * u);
      double da = 0;
      for (int64_t j = 0; j < H; ++j) da += dy[j] * w2c[j];
      const double dg = round_bf16(da * p * u * s * (1.0 + g * (1.0 - s)));
      const double du = round_bf16(da * p * g * s);
      for (int64_t j = 0; j < H; ++j) {
        r.dw1_gate[c][j] += dg * x[j];
        r.dw1_up[c][j] += du * x[j];
        r.dw2_col[c][j] += dy[j] * a;
        r.dw1_gate_abs[c][j] += std::fabs(dg * x[j]);
        r.dw1_up_abs[c][j] += std::fabs(du * x[j]);
        r.dw2_col_abs[c][j] += std::fabs(dy[j] * a);
      }
    }
  });
  return r;
}

}  // namespace moeflow::bench
