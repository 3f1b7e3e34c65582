// Pieces shared by `moeflow run` and `moeflow run --ep`: the check report
// (one PASS / FAIL / SKIPPED line per check), timed steps, bf16 rounding,
// the deterministic inputs (expert weights as a periodic pattern, filled on
// the device without a host copy of the whole tensor), the grouped expert
// MLP step, and the float64 host references of that step on a sample.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench.h"

namespace moeflow::bench {

// --- Report ------------------------------------------------------------------

// Prints one line per check as it is recorded and sums them up at the end:
// "<title>: OK (N checks passed)" only when nothing failed or was skipped.
class CheckReport {
 public:
  explicit CheckReport(std::string title) : title_(std::move(title)) {}
  void check(bool ok, const std::string& what);
  void skip(const std::string& what, const std::string& reason);
  // Prints the summary line; returns the exit code (0: no failure).
  int finish() const;

 private:
  std::string title_;
  int passed_ = 0, failed_ = 0, skipped_ = 0;
};

// Waits for the work queued on `stream` of `device` (the legacy default
// stream: the whole device); nothing on the CPU.
void sync_device(Device device, cudaStream_t stream = nullptr);

// Prints "  <label> ..." then runs fn, waits for the device and finishes the
// line with the time taken. fn must not print. Returns the microseconds.
double timed_step(Device device, const std::string& label, const std::function<void()>& fn);

// Runs fn(i) for i in [0, n) on up to hardware_concurrency threads.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

// --- bf16 --------------------------------------------------------------------

uint16_t float_to_bf16_bits(float f);  // round to nearest even
float bf16_bits_to_float(uint16_t b);
inline double round_bf16(double v) {
  return bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(v)));
}

// Relative norm error sqrt(sum (g-w)^2 / sum w^2) of float32 `got` against
// float64 `want` (same length).
double rel_norm_error(const float* got, const double* want, int64_t n);
// The same error measured against `scale` (the sums of |terms| of want):
// sqrt(sum (g-w)^2 / sum scale^2); a few bf16 roundings give about 4e-3.
double scaled_error(const float* got, const double* want, const double* scale, int64_t n);

// --- Deterministic inputs ----------------------------------------------------

// Expert weights: element i (linear index over the stacked [E, N, K] tensor)
// is bf16(f(i % period)). FC1 [E, 2F, H]: 2 cos(0.37 (i % 9973)) / sqrt(H);
// FC2 [E, H, F]: sin(0.53 (i % 7919)) / sqrt(F).
class WeightPattern {
 public:
  static WeightPattern fc1(int64_t hidden, int64_t max_row);
  static WeightPattern fc2(int64_t ffn, int64_t max_row);
  float at(int64_t i) const { return values_[static_cast<size_t>(i % period_)]; }
  // Elements [i, i + n) for n <= max_row, contiguous.
  const float* row(int64_t i) const { return values_.data() + i % period_; }
  // Experts [first, first + n) as a stacked bf16 tensor {n, rows, cols} on
  // `device`: one host period, then device copies that double the filled
  // part; returns when they are done.
  Tensor make(int64_t first_expert, int64_t n, int64_t rows, int64_t cols, Device device) const;

 private:
  int64_t period_ = 1;
  std::vector<float> values_;  // period + max_row values (the pattern, extended)
};

// x [T, H] bf16: sin(0.001 i) (+ a shift per rank); dout [T, H] float32 or
// bf16: cos(0.011 ((i + shift) % 10007)). Host tensors.
Tensor make_tokens(int64_t T, int64_t H, int64_t shift);
Tensor make_output_grad(int64_t T, int64_t H, int64_t shift, DType dtype);

// --- The router step (run_router.cpp) ------------------------------------------
// The preset's router on deterministic logits [T, E] on `device`, forward and
// (with backward) backward, checked into `report`; returns its ids and probs
// on `device` for the token path.
Routing run_router_step(const std::string& preset, int64_t T, int E, int K, Device device,
                        bool backward, CheckReport& report);

// --- The expert MLP step -------------------------------------------------------

// Its inputs, all on one device: x [T, H] bf16, probs [T, K] float32,
// w1 [E, 2F, H], w2 [E, H, F] bf16, dout [T, H].
struct MlpInputs {
  Tensor x, probs, w1, w2, dout;
};
// Its outputs, on the same device: out [T, H] f32; with backward: dx [T, H]
// f32, dprobs [rows] f32 (per row of the plan), dw1, dw2 f32.
struct MlpOutputs {
  Tensor out, dx, dprobs, dw1, dw2;
};
// permute (probs along) -> FC1 + probs-weighted SwiGLU -> FC2 -> unpermute,
// and with backward: unpermute_backward -> dgrad (+ dprobs of the rows) ->
// permute_backward, and the weight gradients. *us: its wall time.
MlpOutputs mlp_step(const RoutingPlan& plan, const MlpInputs& in, bool backward, double* us,
                    cudaStream_t stream = nullptr);

// --- float64 references on the host (run_reference.cpp) --------------------

// What the references read, on the host: x [T,H] bf16, ids [T,K] int32,
// probs [T,K] f32, dout [T,H] f32 or bf16, and the weights' patterns.
struct MlpHost {
  int64_t T = 0, H = 0, F = 0;
  int E = 0, K = 0;
  Tensor x, ids, probs, dout;
  const WeightPattern* w1 = nullptr;
  const WeightPattern* w2 = nullptr;
};

// Per token: the forward output [H], and with backward dx [H] and the
// dprobs of its K slots, in float64 with the kernels' bf16 roundings of
// h, a, y (and dy, dh, the dx rows). *_abs: the sums of |terms| of each.
struct TokenReference {
  std::vector<double> out, dx, dprobs;
  std::vector<double> dx_abs, dprobs_abs;
};
std::vector<TokenReference> reference_tokens(const MlpHost& in, const std::vector<int64_t>& tokens,
                                             bool backward);

// Weight gradients of expert e on a sample of FFN columns f: the dW1 rows f
// (gate) and F + f (up), [H] each, and the dW2 column f, [H].
struct ExpertGradReference {
  std::vector<std::vector<double>> dw1_gate, dw1_up, dw2_col;              // [cols][H]
  std::vector<std::vector<double>> dw1_gate_abs, dw1_up_abs, dw2_col_abs;  // sums of |terms|
};
ExpertGradReference reference_expert_grads(const MlpHost& in, int e,
                                           const std::vector<int64_t>& cols);

}  // namespace moeflow::bench
