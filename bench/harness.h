// Benchmark harness: median timing of an op (CUDA events with an L2 flush
// before every timed run on the GPU; a steady clock on the CPU), the device
// copy-bandwidth ceiling, and result rows printed as a table or JSON.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moeflow/tensor.h"

namespace moeflow::bench {

struct TimingOptions {
  int warmup = 5;
  int iters = 30;
  bool flush_l2 = true;
};

// Median time of fn() in microseconds on `device` (fn enqueues on `stream`).
double time_us(Device device, cudaStream_t stream, const std::function<void()>& fn,
               const TimingOptions& opt);

// Device copy bandwidth (bytes read + written per second, GB/s) of a large
// device-to-device copy; for the CPU, a large memcpy.
double copy_bandwidth_gbps(Device device, cudaStream_t stream, const TimingOptions& opt);

// Write-only bandwidth (GB/s) of a large memset: the ceiling for
// write-dominated ops such as permute (1 read : K writes).
double write_bandwidth_gbps(Device device, cudaStream_t stream, const TimingOptions& opt);

std::string device_name(Device device);

// A duration in microseconds in a readable unit: "850.3 µs", "12.41 ms",
// "3.20 s" (µs below 1 ms, ms below 1 s, s above). Every printed time uses it.
std::string format_time(double us);

// Progress of a loop over cases on stderr ("\r  what 3/8"), only when stderr
// is a terminal; the line is cleared when done == total.
void print_progress(const std::string& what, size_t done, size_t total);

struct Row {
  std::string case_name;
  std::string op;
  double time_us = 0;
  double bytes = 0;  // counted by hand
  double gbps = 0;
  double ceiling_gbps = 0;
  nlohmann::json extra = nlohmann::json::object();
};

void print_table(const std::string& title, const std::vector<Row>& rows);
nlohmann::json rows_to_json(const std::vector<Row>& rows);

}  // namespace moeflow::bench
