// CPU reference of the grouped expert MLP (FC1 -> GLU / activation ->
// FC2), forward and backward, in float64 on plain arrays: the oracle for
// the fused CUDA path and for finite-difference gradient checks.
//
// Layout: rows grouped by expert as in a RoutingPlan (offsets [E+1], real
// rows [E]; rows past the real rows of a segment are pad rows: outputs zero,
// never read). FC1 weight [E, N1, H] with N1 = 2F for gated activations, its
// rows either halves [gate; up] or interleaved blocks of `glu_interleave`
// gate rows then as many up rows; FC2 weight [E, H, F]; optional biases
// [E, N1] and [E, H]; optional per-row router probability scaling the
// activation ("weighted" GLU).
#pragma once

#include <cstdint>
#include <vector>

#include "core/activations.h"

namespace moeflow::cpu::mlp {

struct Shape {
  int experts = 0;
  int64_t hidden = 0;  // H
  int64_t ffn = 0;     // F
};

struct Config {
  Activation act = Activation::kSwiGLU;
  ActivationParams params;
  int glu_interleave = 0;  // 0: halves
  bool bias1 = false, bias2 = false;
  bool weighted = false;  // scale the activation by probs[row]
};

struct Groups {
  std::vector<int64_t> offsets;  // [E+1]
  std::vector<int64_t> real;     // [E]
};

struct Params {
  std::vector<double> w1, b1, w2, b2;  // [E][N1][H], [E][N1], [E][H][F], [E][H]
};

struct Saved {
  std::vector<double> h;  // [rows][N1] FC1 output (+ bias)
  std::vector<double> a;  // [rows][F] activation, before the probability scale
};

struct Grads {
  std::vector<double> dx, dw1, db1, dw2, db2, dprobs;
};

int64_t fc1_rows(const Shape& s, const Config& c);
// FC1 output columns of gate and up for activation column j.
int64_t gate_col(const Shape& s, const Config& c, int64_t j);
int64_t up_col(const Shape& s, const Config& c, int64_t j);

// x [rows][H], probs [rows] (with weighted), y [rows][H] out.
void forward(const Shape& s, const Config& c, const Groups& g, const Params& p,
             const std::vector<double>& x, const std::vector<double>& probs, std::vector<double>& y,
             Saved& saved);

// dy [rows][H]; fills every gradient (dprobs only with weighted).
void backward(const Shape& s, const Config& c, const Groups& g, const Params& p,
              const std::vector<double>& x, const std::vector<double>& probs,
              const std::vector<double>& dy, const Saved& saved, Grads& grads);

}  // namespace moeflow::cpu::mlp
