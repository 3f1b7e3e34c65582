// Timing and reporting for `moeflow bench`. GPU times are CUDA-event medians
// over many runs after warm-up, with a 256 MiB memset between runs so every
// run starts from a cold L2.
#include "bench/harness.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#ifdef MOEFLOW_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moeflow::bench {

#ifdef MOEFLOW_WITH_CUDA
namespace {
struct L2Flusher {
  void* buf = nullptr;
  size_t bytes = size_t{256} << 20;
  L2Flusher() { MOEFLOW_CUDA_CHECK(cudaMalloc(&buf, bytes)); }
  ~L2Flusher() { cudaFree(buf); }
  void flush(cudaStream_t s) { MOEFLOW_CUDA_CHECK(cudaMemsetAsync(buf, 0, bytes, s)); }
};
}  // namespace
#endif

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double time_us(Device device, cudaStream_t stream, const std::function<void()>& fn,
               const TimingOptions& opt) {
  std::vector<double> times;
  if (device.is_cpu()) {
    for (int i = 0; i < opt.warmup; ++i) fn();
    for (int i = 0; i < opt.iters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      fn();
      auto t1 = std::chrono::steady_clock::now();
      times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    return median(times);
  }
#ifdef MOEFLOW_WITH_CUDA
  static L2Flusher flusher;
  cudaEvent_t start, stop;
  MOEFLOW_CUDA_CHECK(cudaEventCreate(&start));
  MOEFLOW_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < opt.warmup; ++i) fn();
  for (int i = 0; i < opt.iters; ++i) {
    if (opt.flush_l2) flusher.flush(stream);
    MOEFLOW_CUDA_CHECK(cudaEventRecord(start, stream));
    fn();
    MOEFLOW_CUDA_CHECK(cudaEventRecord(stop, stream));
    MOEFLOW_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    MOEFLOW_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms * 1000.0);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(times);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "built without CUDA");
#endif
}

double copy_bandwidth_gbps(Device device, cudaStream_t stream, const TimingOptions& opt) {
  const size_t bytes = device.is_cpu() ? (size_t{256} << 20) : (size_t{1} << 30);
  Tensor a = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kUInt8, device);
  Tensor b = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kUInt8, device);
  fill_bytes(a, 1, stream);
  fill_bytes(b, 2, stream);
  TimingOptions o = opt;
  o.flush_l2 = false;  // 1 GiB does not fit in L2 anyway
  if (device.is_cpu()) o.iters = std::min(o.iters, 5);
  double us = time_us(
      device, stream, [&] { copy(a, b, stream); }, o);
  return 2.0 * bytes / us / 1e3;
}

double write_bandwidth_gbps(Device device, cudaStream_t stream, const TimingOptions& opt) {
  const size_t bytes = device.is_cpu() ? (size_t{256} << 20) : (size_t{1} << 30);
  Tensor a = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kUInt8, device);
  TimingOptions o = opt;
  o.flush_l2 = false;
  if (device.is_cpu()) o.iters = std::min(o.iters, 5);
  double us = time_us(
      device, stream, [&] { fill_bytes(a, 0, stream); }, o);
  return bytes / us / 1e3;
}

std::string device_name(Device device) {
  if (device.is_cpu()) return "CPU (reference backend)";
#ifdef MOEFLOW_WITH_CUDA
  cudaDeviceProp prop;
  MOEFLOW_CUDA_CHECK(cudaGetDeviceProperties(&prop, device.index));
  return fmt::format("{} ({} SMs)", prop.name, prop.multiProcessorCount);
#else
  return "cuda";
#endif
}

std::string format_time(double us) {
  if (us < 1e3) return fmt::format("{:.1f} \u00b5s", us);
  if (us < 1e6) return fmt::format("{:.2f} ms", us / 1e3);
  return fmt::format("{:.2f} s", us / 1e6);
}

void print_progress(const std::string& what, size_t done, size_t total) {
  if (!isatty(STDERR_FILENO)) return;
  if (done < total)
    fmt::print(stderr, "\r  {} {}/{} ", what, done, total);
  else
    fmt::print(stderr, "\r{}\r", std::string(what.size() + 24, ' '));
  std::fflush(stderr);
}

void print_table(const std::string& title, const std::vector<Row>& rows) {
  fmt::print("\n{}\n", title);
  fmt::print("{:<12} {:<26} {:>11} {:>11} {:>10} {:>9}\n", "case", "op", "time", "bytes (MB)",
             "GB/s", "of copy");
  fmt::print("{}\n", std::string(84, '-'));
  for (const Row& r : rows) {
    std::string frac = r.ceiling_gbps > 0 && r.bytes > 0
                           ? fmt::format("{:.0f}%", 100.0 * r.gbps / r.ceiling_gbps)
                           : "-";
    std::string bytes = r.bytes > 0 ? fmt::format("{:.1f}", r.bytes / 1e6) : "-";
    std::string gbps = r.gbps > 0 ? fmt::format("{:.0f}", r.gbps) : "-";
    fmt::print("{:<12} {:<26} {:>11} {:>11} {:>10} {:>9}\n", r.case_name, r.op,
               r.time_us > 0 ? format_time(r.time_us) : "-", bytes, gbps, frac);
  }
  std::fflush(stdout);
}

nlohmann::json rows_to_json(const std::vector<Row>& rows) {
  nlohmann::json out = nlohmann::json::array();
  for (const Row& r : rows) {
    nlohmann::json j = {{"case", r.case_name}, {"op", r.op},     {"time_us", r.time_us},
                        {"bytes", r.bytes},    {"GBps", r.gbps}, {"ceiling_GBps", r.ceiling_gbps}};
    for (auto& [k, v] : r.extra.items()) j[k] = v;
    out.push_back(j);
  }
  return out;
}

}  // namespace moeflow::bench
