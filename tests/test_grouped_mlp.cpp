// CPU reference of the grouped expert MLP: gradients against central finite
// differences in float64 for every activation, halves and interleaved GLU
// layouts, biases on/off, router-probability weighting on/off, with empty
// experts and pad rows (which must stay zero and get no gradient).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "cpu/grouped_mlp.h"

namespace moeflow::cpu::mlp {
namespace {

struct Problem {
  Shape s;
  Config c;
  Groups g;
  Params p;
  std::vector<double> x, probs, dy;
};

std::vector<double> random_vec(size_t n, std::mt19937& rng, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = u(rng);
  return v;
}

Problem make(Activation act, int interleave, bool bias, bool weighted, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem pr;
  pr.s = Shape{3, 5, 4};
  pr.c.act = act;
  pr.c.glu_interleave = interleave;
  pr.c.bias1 = pr.c.bias2 = bias;
  pr.c.weighted = weighted;
  pr.c.params.limit = 0.8f;  // small, so the clamps of quick-GeGLU are exercised
  pr.g.offsets = {0, 4, 4, 9};  // expert 1 empty
  pr.g.real = {3, 0, 4};        // rows 3 and 8 are pad rows
  const int64_t N1 = fc1_rows(pr.s, pr.c), H = pr.s.hidden, F = pr.s.ffn, E = pr.s.experts, rows = 9;
  pr.p.w1 = random_vec(E * N1 * H, rng);
  pr.p.b1 = random_vec(E * N1, rng);
  pr.p.w2 = random_vec(E * H * F, rng);
  pr.p.b2 = random_vec(E * H, rng);
  pr.x = random_vec(rows * H, rng);
  pr.probs = random_vec(rows, rng, 0.1, 1.0);
  pr.dy = random_vec(rows * H, rng);
  return pr;
}

double loss(const Problem& pr) {
  std::vector<double> y;
  Saved saved;
  forward(pr.s, pr.c, pr.g, pr.p, pr.x, pr.probs, y, saved);
  double l = 0.0;
  for (size_t i = 0; i < y.size(); ++i) l += y[i] * pr.dy[i];
  return l;
}

// Central differences of loss() with respect to every element of `v`.
void expect_fd(Problem pr, std::vector<double> Problem::*field, std::vector<double> Params::*pfield,
               const std::vector<double>& analytic, const char* name) {
  std::vector<double>& v = field ? pr.*field : pr.p.*pfield;
  ASSERT_EQ(v.size(), analytic.size()) << name;
  const double eps = 1e-6;
  for (size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    v[i] = keep + eps;
    const double lp = loss(pr);
    v[i] = keep - eps;
    const double lm = loss(pr);
    v[i] = keep;
    const double fd = (lp - lm) / (2 * eps);
    ASSERT_NEAR(analytic[i], fd, 1e-6 * (1.0 + std::fabs(fd))) << name << "[" << i << "]";
  }
}

TEST(GroupedMlpReference, GradientsMatchFiniteDifferences) {
  uint32_t seed = 1;
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kClampedQuickGeGLU,
                         Activation::kGelu, Activation::kRelu, Activation::kSquaredRelu}) {
    for (int interleave : {0, 2}) {
      if (interleave && !is_gated(act)) continue;
      for (bool bias : {false, true}) {
        for (bool weighted : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "act " << int(act) << " interleave " << interleave << " bias "
                                            << bias << " weighted " << weighted);
          Problem pr = make(act, interleave, bias, weighted, seed++);
          std::vector<double> y;
          Saved saved;
          forward(pr.s, pr.c, pr.g, pr.p, pr.x, pr.probs, y, saved);
          for (int64_t r : {3, 8})  // pad rows
            for (int64_t o = 0; o < pr.s.hidden; ++o) ASSERT_EQ(y[r * pr.s.hidden + o], 0.0);
          Grads gr;
          backward(pr.s, pr.c, pr.g, pr.p, pr.x, pr.probs, pr.dy, saved, gr);
          for (int64_t r : {3, 8})
            for (int64_t k = 0; k < pr.s.hidden; ++k) ASSERT_EQ(gr.dx[r * pr.s.hidden + k], 0.0);
          expect_fd(pr, &Problem::x, nullptr, gr.dx, "dx");
          expect_fd(pr, nullptr, &Params::w1, gr.dw1, "dw1");
          expect_fd(pr, nullptr, &Params::w2, gr.dw2, "dw2");
          if (bias) {
            expect_fd(pr, nullptr, &Params::b1, gr.db1, "db1");
            expect_fd(pr, nullptr, &Params::b2, gr.db2, "db2");
          }
          if (weighted) expect_fd(pr, &Problem::probs, nullptr, gr.dprobs, "dprobs");
          // the empty expert gets zero weight gradients
          const int64_t N1 = fc1_rows(pr.s, pr.c);
          for (int64_t i = N1 * pr.s.hidden; i < 2 * N1 * pr.s.hidden; ++i) ASSERT_EQ(gr.dw1[i], 0.0);
        }
      }
    }
  }
}

// The interleaved layout is the halves layout with FC1 rows permuted.
TEST(GroupedMlpReference, InterleavedEqualsHalvesWithPermutedRows) {
  Problem halves = make(Activation::kSwiGLU, 0, true, true, 99);
  Problem inter = halves;
  inter.c.glu_interleave = 2;
  const int64_t F = halves.s.ffn, H = halves.s.hidden, N1 = 2 * F;
  for (int e = 0; e < halves.s.experts; ++e)
    for (int64_t j = 0; j < F; ++j)
      for (bool up : {false, true}) {
        const int64_t from = up ? F + j : j;
        const int64_t to = up ? up_col(inter.s, inter.c, j) : gate_col(inter.s, inter.c, j);
        for (int64_t k = 0; k < H; ++k) inter.p.w1[(e * N1 + to) * H + k] = halves.p.w1[(e * N1 + from) * H + k];
        inter.p.b1[e * N1 + to] = halves.p.b1[e * N1 + from];
      }
  std::vector<double> y1, y2;
  Saved s1, s2;
  forward(halves.s, halves.c, halves.g, halves.p, halves.x, halves.probs, y1, s1);
  forward(inter.s, inter.c, inter.g, inter.p, inter.x, inter.probs, y2, s2);
  for (size_t i = 0; i < y1.size(); ++i) ASSERT_DOUBLE_EQ(y1[i], y2[i]);
}

}  // namespace
}  // namespace moeflow::cpu::mlp
