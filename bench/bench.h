// `moeflow bench` and `moeflow run` entry points, and the routing generator
// they share.
#pragma once

#include <string>
#include <vector>

#include "bench/harness.h"
#include "moeflow/moeflow.h"

namespace moeflow::bench {

// Random router output: scores ~ N(0,1), softmax over E, top-K (distinct
// experts, as a real router gives). ids [T,K] int32, probs [T,K] float32.
struct Routing {
  Tensor ids;
  Tensor probs;
};
Routing random_routing(int64_t T, int E, int K, uint32_t seed, Device device);

struct PermuteBenchOptions {
  std::vector<std::string> presets;
  int align = 16;
  DType dtype = DType::kBFloat16;
  Device device;
  TimingOptions timing;
  std::string json_path;
};
void run_permute_bench(const PermuteBenchOptions& opt);

struct GemmBenchOptions {
  std::vector<std::string> cases;  // empty: all five cases of bench_gemm.cpp
  bool sweep = false;              // rows per expert 64..4096, uniform and skewed
  bool tune = false;               // also time the shared-memory splits of the TMA kernel
  std::vector<int> tune_hold;      // fused FC1 held-stage windows to time, paired with FC1 alone
  bool fp8_tiles = false;          // also time each FP8 forward tile shape against the default
  int sweep_experts = 32;
  std::vector<int64_t> sweep_rows;  // rows per expert in the sweep; empty: 64..4096
  int64_t sweep_k = 2048, sweep_n = 1536;
  Device device;
  TimingOptions timing;
  std::string json_path;
};
void run_gemm_bench(const GemmBenchOptions& opt);
std::vector<int64_t> sweep_split(int E, int64_t R, bool skewed);
// Mildly uneven rows per expert summing to `rows`, multiples of 16 (as peers.py).
std::vector<int64_t> uneven_split(int E, int64_t rows, uint32_t seed);

struct DispatchBenchOptions {
  std::vector<std::string> presets;  // default: dsv3 mixtral
  int gpus = 0;                      // 0: every visible GPU
  int64_t tokens = 0;                // tokens per GPU; 0: the preset's
  int align = 16;
  std::string backend = "nccl";  // nccl | nvlink
  bool bulk_copies = false;      // nvlink: EpOptions::nvlink_bulk_copies
  bool sweep = true;             // also time the pieces / SM-count sweep
  bool fp8 = false;              // e4m3 token rows + float32 scales per 128 columns
  int routings = 1;              // dispatches cycle through this many routings
  TimingOptions timing;
  std::string json_path;
};
// Multi-GPU (CUDA builds only).
void run_dispatch_bench(const DispatchBenchOptions& opt);

struct MlpBenchOptions {
  std::vector<std::string> cases;  // dsv3 mixtral qwen3-30b (default: all)
  Device device;
  TimingOptions timing;
  std::string json_path;
};
void run_mlp_bench(const MlpBenchOptions& opt);

struct QuantizeBenchOptions {
  std::vector<std::string> cases;  // dsv3 mixtral qwen3-30b (default: all)
  Device device;
  TimingOptions timing;
  std::string json_path;
};
void run_quantize_bench(const QuantizeBenchOptions& opt);

struct RunOptions {
  std::string preset = "tiny";
  int align = 16;
  Device device;
  bool backward = true;
  bool ep = false;                  // run --ep: the layer with expert parallelism
  std::string ep_backend = "nccl";  // nccl | nvlink
};
// One MoE token-path step (route, plan, permute, identity experts, unpermute,
// and the backward ops), checked against the expected result. Returns 0 when
// the checks pass.
int run_layer(const RunOptions& opt);
// One expert-parallel MoE layer step on every visible GPU (dispatch ->
// grouped MLP -> combine, and the backward), checked against the layer
// without expert parallelism (CUDA builds only).
int run_ep_layer(const RunOptions& opt);

// "auto" -> cuda:0 when a GPU is present, else cpu; "cpu"; "cuda" / "cuda:N"
// (throws a moeflow::Error saying what is wrong: bad form, no GPU, N too big).
Device parse_device(const std::string& s);
DType parse_float_dtype(const std::string& s);

}  // namespace moeflow::bench
