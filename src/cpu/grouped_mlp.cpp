// CPU reference of the grouped expert MLP (see grouped_mlp.h): per expert,
// per real row, plain loops in float64.
#include "cpu/grouped_mlp.h"

#include <algorithm>

#include "moeflow/error.h"

namespace moeflow::cpu::mlp {

int64_t fc1_rows(const Shape& s, const Config& c) { return is_gated(c.act) ? 2 * s.ffn : s.ffn; }

int64_t gate_col(const Shape&, const Config& c, int64_t j) {
  if (!is_gated(c.act) || c.glu_interleave == 0) return j;
  const int64_t g = c.glu_interleave;
  return (j / g) * 2 * g + j % g;
}

int64_t up_col(const Shape& s, const Config& c, int64_t j) {
  if (!is_gated(c.act)) return -1;
  if (c.glu_interleave == 0) return s.ffn + j;
  const int64_t g = c.glu_interleave;
  return (j / g) * 2 * g + g + j % g;
}

static void check(const Shape& s, const Config& c, const Groups& g) {
  MOEFLOW_CHECK(s.experts > 0 && s.hidden > 0 && s.ffn > 0, "mlp: experts, hidden and ffn must be > 0");
  MOEFLOW_CHECK(static_cast<int>(g.offsets.size()) == s.experts + 1 && static_cast<int>(g.real.size()) == s.experts,
                "mlp: groups must have E+1 offsets and E real counts");
  MOEFLOW_CHECK(c.glu_interleave == 0 || (is_gated(c.act) && s.ffn % c.glu_interleave == 0),
                "mlp: glu_interleave ", c.glu_interleave, " needs a gated activation and F (", s.ffn,
                ") a multiple of it");
}

void forward(const Shape& s, const Config& c, const Groups& g, const Params& p, const std::vector<double>& x,
             const std::vector<double>& probs, std::vector<double>& y, Saved& saved) {
  check(s, c, g);
  const int64_t H = s.hidden, F = s.ffn, N1 = fc1_rows(s, c), rows = g.offsets[s.experts];
  y.assign(rows * H, 0.0);
  saved.h.assign(rows * N1, 0.0);
  saved.a.assign(rows * F, 0.0);
  for (int e = 0; e < s.experts; ++e) {
    const double* w1 = p.w1.data() + e * N1 * H;
    const double* w2 = p.w2.data() + e * H * F;
    for (int64_t r = g.offsets[e]; r < g.offsets[e] + g.real[e]; ++r) {
      double* h = saved.h.data() + r * N1;
      double* a = saved.a.data() + r * F;
      for (int64_t n = 0; n < N1; ++n) {
        double v = c.bias1 ? p.b1[e * N1 + n] : 0.0;
        for (int64_t k = 0; k < H; ++k) v += w1[n * H + k] * x[r * H + k];
        h[n] = v;
      }
      const double scale = c.weighted ? probs[r] : 1.0;
      for (int64_t j = 0; j < F; ++j) {
        const double u = is_gated(c.act) ? h[up_col(s, c, j)] : 0.0;
        a[j] = act_forward<double>(c.act, h[gate_col(s, c, j)], u, c.params);
      }
      for (int64_t o = 0; o < H; ++o) {
        double v = c.bias2 ? p.b2[e * H + o] : 0.0;
        for (int64_t j = 0; j < F; ++j) v += w2[o * F + j] * scale * a[j];
        y[r * H + o] = v;
      }
    }
  }
}

void backward(const Shape& s, const Config& c, const Groups& g, const Params& p, const std::vector<double>& x,
              const std::vector<double>& probs, const std::vector<double>& dy, const Saved& saved, Grads& gr) {
  check(s, c, g);
  const int64_t H = s.hidden, F = s.ffn, N1 = fc1_rows(s, c), rows = g.offsets[s.experts], E = s.experts;
  gr.dx.assign(rows * H, 0.0);
  gr.dw1.assign(E * N1 * H, 0.0);
  gr.db1.assign(E * N1, 0.0);
  gr.dw2.assign(E * H * F, 0.0);
  gr.db2.assign(E * H, 0.0);
  gr.dprobs.assign(rows, 0.0);
  std::vector<double> da(F), dh(N1);
  for (int e = 0; e < s.experts; ++e) {
    const double* w1 = p.w1.data() + e * N1 * H;
    const double* w2 = p.w2.data() + e * H * F;
    for (int64_t r = g.offsets[e]; r < g.offsets[e] + g.real[e]; ++r) {
      const double* h = saved.h.data() + r * N1;
      const double* a = saved.a.data() + r * F;
      const double* d = dy.data() + r * H;
      const double scale = c.weighted ? probs[r] : 1.0;
      // FC2: dW2 += dy (x) scale*a, db2 += dy, d(scale*a) = W2^T dy
      for (int64_t o = 0; o < H; ++o) {
        if (c.bias2) gr.db2[e * H + o] += d[o];
        for (int64_t j = 0; j < F; ++j) gr.dw2[(e * H + o) * F + j] += d[o] * scale * a[j];
      }
      double dprob = 0.0;
      for (int64_t j = 0; j < F; ++j) {
        double v = 0.0;
        for (int64_t o = 0; o < H; ++o) v += w2[o * F + j] * d[o];
        dprob += v * a[j];
        da[j] = v * scale;
      }
      if (c.weighted) gr.dprobs[r] = dprob;
      // activation
      std::fill(dh.begin(), dh.end(), 0.0);
      for (int64_t j = 0; j < F; ++j) {
        double dg = 0.0, du = 0.0;
        const int64_t gc = gate_col(s, c, j), uc = up_col(s, c, j);
        act_backward<double>(c.act, h[gc], uc >= 0 ? h[uc] : 0.0, da[j], c.params, &dg, &du);
        dh[gc] += dg;
        if (uc >= 0) dh[uc] += du;
      }
      // FC1: dW1 += dh (x) x, db1 += dh, dx = W1^T dh
      for (int64_t n = 0; n < N1; ++n) {
        if (c.bias1) gr.db1[e * N1 + n] += dh[n];
        for (int64_t k = 0; k < H; ++k) {
          gr.dw1[(e * N1 + n) * H + k] += dh[n] * x[r * H + k];
          gr.dx[r * H + k] += w1[n * H + k] * dh[n];
        }
      }
    }
  }
}

}  // namespace moeflow::cpu::mlp
