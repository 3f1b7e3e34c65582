// The check report, timed steps, bf16 rounding, the deterministic inputs and
// the expert-MLP step of `moeflow run` (see run_common.h). Weights are a
// periodic pattern: one period (plus a row) is computed on the host, copied
// to the device, and the filled prefix is doubled with device copies (the
// prefix length stays a multiple of the period, so every element keeps its
// value), so a 15 GB tensor costs a few copies and no host memory.
#include "tools/run_common.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#ifdef MOEFLOW_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moeflow::bench {

// --- Report ------------------------------------------------------------------

void CheckReport::check(bool ok, const std::string& what) {
  (ok ? passed_ : failed_)++;
  fmt::print("  {:<7} {}\n", ok ? "PASS" : "FAIL", what);
  std::fflush(stdout);
}

void CheckReport::skip(const std::string& what, const std::string& reason) {
  ++skipped_;
  fmt::print("  {:<7} {} ({})\n", "SKIPPED", what, reason);
  std::fflush(stdout);
}

int CheckReport::finish() const {
  const int total = passed_ + failed_ + skipped_;
  if (failed_ > 0)
    fmt::print("{}: FAILED {} of {} checks{} (see above)\n", title_, failed_, total,
               skipped_ ? fmt::format(", SKIPPED {}", skipped_) : "");
  else if (skipped_ > 0)
    fmt::print("{}: PASSED {} checks, SKIPPED {} (see above)\n", title_, passed_, skipped_);
  else
    fmt::print("{}: OK ({} checks passed)\n", title_, passed_);
  std::fflush(stdout);
  return failed_ > 0 ? 1 : 0;
}

void sync_device(Device device, cudaStream_t stream) {
  if (!device.is_cuda()) return;
#ifdef MOEFLOW_WITH_CUDA
  if (stream != nullptr) {
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  int current = 0;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&current));
  MOEFLOW_CUDA_CHECK(cudaSetDevice(device.index));
  MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  MOEFLOW_CUDA_CHECK(cudaSetDevice(current));
#else
  (void)stream;
#endif
}

double timed_step(Device device, const std::string& label, const std::function<void()>& fn) {
  fmt::print("  {:<44} ", label + " ...");
  std::fflush(stdout);
  sync_device(device);
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  sync_device(device);
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("{:>10}\n", format_time(us));
  std::fflush(stdout);
  return us;
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  const int64_t workers = std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> threads;
  for (int64_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
}

// --- bf16 --------------------------------------------------------------------

uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double rel_norm_error(const float* got, const double* want, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = got[i] - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

double scaled_error(const float* got, const double* want, const double* scale, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = got[i] - want[i];
    num += d * d;
    den += scale[i] * scale[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

// --- Deterministic inputs ----------------------------------------------------

namespace {

// One period of f, bf16-rounded, extended by max_row values.
std::vector<float> pattern_values(int64_t period, int64_t max_row,
                                  const std::function<float(int64_t)>& f) {
  std::vector<float> values(static_cast<size_t>(period + max_row));
  for (int64_t i = 0; i < period + max_row; ++i)
    values[i] = bf16_bits_to_float(float_to_bf16_bits(f(i % period)));
  return values;
}

}  // namespace

WeightPattern WeightPattern::fc1(int64_t hidden, int64_t max_row) {
  WeightPattern w;
  w.period_ = 9973;
  w.values_ = pattern_values(w.period_, max_row, [&](int64_t i) {
    return 2.0f * std::cos(0.37f * static_cast<float>(i)) / std::sqrt(float(hidden));
  });
  return w;
}

WeightPattern WeightPattern::fc2(int64_t ffn, int64_t max_row) {
  WeightPattern w;
  w.period_ = 7919;
  w.values_ = pattern_values(w.period_, max_row, [&](int64_t i) {
    return std::sin(0.53f * static_cast<float>(i)) / std::sqrt(float(ffn));
  });
  return w;
}

Tensor WeightPattern::make(int64_t first_expert, int64_t n, int64_t rows, int64_t cols,
                           Device device) const {
  Tensor t = Tensor::empty({n, rows, cols}, DType::kBFloat16, device);
  const int64_t total = t.numel(), first = first_expert * rows * cols;
  if (total == 0) return t;
  // one chunk on the host: a multiple of the period, about 1M elements
  const int64_t chunk =
      std::min(total, period_ * std::max<int64_t>(1, (int64_t{1} << 20) / period_));
  Tensor host = Tensor::empty({chunk}, DType::kBFloat16);
  for (int64_t i = 0; i < chunk; ++i)
    host.data_ptr<uint16_t>()[i] = float_to_bf16_bits(at(first + i));
  auto* base = t.data_ptr<uint16_t>();
  copy(host, TensorView(base, DType::kBFloat16, device, {chunk}));
  for (int64_t filled = chunk; filled < total; filled *= 2) {
    const int64_t n_copy = std::min(filled, total - filled);
    copy(TensorView(base, DType::kBFloat16, device, {n_copy}),
         TensorView(base + filled, DType::kBFloat16, device, {n_copy}));
  }
  sync_device(device);  // the copies ran on the legacy default stream
  return t;
}

Tensor make_tokens(int64_t T, int64_t H, int64_t shift) {
  Tensor x = Tensor::empty({T, H}, DType::kBFloat16);
  auto* p = x.data_ptr<uint16_t>();
  for (int64_t i = 0; i < T * H; ++i)
    p[i] = float_to_bf16_bits(std::sin(0.001f * static_cast<float>(i + shift)));
  return x;
}

Tensor make_output_grad(int64_t T, int64_t H, int64_t shift, DType dtype) {
  Tensor d = Tensor::empty({T, H}, dtype);
  for (int64_t i = 0; i < T * H; ++i) {
    const float v = std::cos(0.011f * static_cast<float>((i + shift) % 10007));
    if (dtype == DType::kFloat32)
      d.data_ptr<float>()[i] = v;
    else
      d.data_ptr<uint16_t>()[i] = float_to_bf16_bits(v);
  }
  return d;
}

// --- The expert MLP step -------------------------------------------------------

MlpOutputs mlp_step(const RoutingPlan& plan, const MlpInputs& in, bool backward, double* us,
                    cudaStream_t stream) {
  const Device dev = in.x.device();
  const int64_t T = in.x.size(0), H = in.x.size(1), F = in.w2.size(2), rows = plan.capacity_rows;
  const int64_t E = in.w1.size(0);
  Tensor xr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
  Tensor pr = Tensor::empty({rows}, DType::kFloat32, dev);
  Tensor h = Tensor::empty({rows, 2 * F}, DType::kBFloat16, dev);
  Tensor a = Tensor::empty({rows, F}, DType::kBFloat16, dev);
  Tensor yr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
  MlpOutputs o;
  o.out = Tensor::empty({T, H}, DType::kFloat32, dev);
  Tensor dyr, dxr, dh;
  if (backward) {
    dyr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
    dxr = Tensor::empty({rows, H}, DType::kBFloat16, dev);
    dh = Tensor::empty({rows, 2 * F}, DType::kBFloat16, dev);
    o.dprobs = Tensor::empty({rows}, DType::kFloat32, dev);
    o.dx = Tensor::empty({T, H}, DType::kFloat32, dev);
    o.dw1 = Tensor::empty({E, 2 * F, H}, DType::kFloat32, dev);
    o.dw2 = Tensor::empty({E, H, F}, DType::kFloat32, dev);
  }
  const GroupLayout groups = GroupLayout::from_plan(plan);
  GroupedMlpWeights w;
  w.fc1 = in.w1;
  w.fc2 = in.w2;
  const GroupedMlpConfig cfg{};  // SwiGLU, [gate; up] halves
  const GroupedMlpSaved saved{h, a};
  sync_device(dev, stream);
  const auto t0 = std::chrono::steady_clock::now();
  permute(in.x, plan, xr, PermuteExtras{in.probs, pr, {}, {}}, stream);
  grouped_mlp_forward(xr, w, groups, pr, cfg, yr, saved, stream);
  unpermute(yr, plan, o.out, {}, stream);
  GroupedMlpGrads grads;  // dW1, dW2 = (accumulate off)
  grads.dw1 = o.dw1;
  grads.dw2 = o.dw2;
  if (backward) {
    unpermute_backward(in.dout, plan, {}, {}, dyr, {}, stream);
    grouped_mlp_backward_dgrad(dyr, w, groups, pr, cfg, saved, dxr, dh, o.dprobs, stream);
    permute_backward(dxr, plan, o.dx, {}, {}, stream);
    grouped_mlp_backward_wgrad(dyr, xr, groups, saved, dh, grads, stream);
  }
  sync_device(dev, stream);
  *us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

}  // namespace moeflow::bench
