// The `moeflow` command line: `run` (one checked MoE token-path step on a
// preset; the default when no command is given) and `bench permute | gemm |
// dispatch | mlp`. Arguments are checked here (presets, devices, alignments)
// so that a typo fails at once with the list of valid values.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <filesystem>

#include "bench/bench.h"
#include "bench/presets.h"

using namespace moeflow;

int main(int argc, char** argv) {
  CLI::App app{
      "moeflow: the MoE token path on GPUs (routing plan, permute+pad, grouped expert MLP, "
      "unpermute, expert-parallel dispatch/combine)"};
  app.require_subcommand(0, 1);
  app.fallthrough();
  std::string device = "auto";
  const std::string device_help =
      "where to run: auto (cuda:0 when a GPU is visible, else cpu), cpu, cuda or cuda:N";
  const CLI::Validator device_check(
      [](std::string& s) -> std::string {
        if (s == "auto" || s == "cpu" || s == "cuda") return "";
        if (s.rfind("cuda:", 0) == 0 && s.size() > 5 &&
            s.find_first_not_of("0123456789", 5) == std::string::npos)
          return "";
        return "must be auto, cpu, cuda or cuda:N (N a GPU index), got '" + s + "'";
      },
      "auto|cpu|cuda|cuda:N", "device");
  // --json: its folder must exist and be writable before a long benchmark runs
  const CLI::Validator json_check(
      [](std::string& path) -> std::string {
        const std::filesystem::path parent = std::filesystem::path(path).parent_path();
        const std::string dir = parent.empty() ? "." : parent.string();
        std::error_code ec;
        if (!std::filesystem::is_directory(dir, ec))
          return "cannot write '" + path + "': folder '" + dir + "' does not exist";
        if (access(dir.c_str(), W_OK) != 0)
          return "cannot write '" + path + "': folder '" + dir + "' is not writable";
        return "";
      },
      "FILE", "json");
  const auto align_check = CLI::IsMember({1, 16, 32, 64, 128, 256});
  const auto preset_check = CLI::IsMember(bench::preset_names());
  app.add_option("--device", device, device_help)->check(device_check)->capture_default_str();

  auto* run = app.add_subcommand("run",
                                 "one checked MoE layer step on a preset (default): plan, permute, "
                                 "expert MLP, unpermute, forward and backward");
  bench::RunOptions run_opt;
  const std::string presets_help =
      "model shapes (bench/presets.cpp); big ones run with fewer tokens on the CPU";
  run->add_option("--preset", run_opt.preset, presets_help)
      ->check(preset_check)
      ->capture_default_str();
  run->add_option("--device", device, device_help)->check(device_check)->capture_default_str();
  run->add_option("--align", run_opt.align,
                  "pad each expert to a multiple of this (1,16,32,64,128,256)")
      ->check(align_check)
      ->capture_default_str();
  bool no_backward = false;
  run->add_flag("--no-backward", no_backward,
                "forward only (the backward checks are reported as SKIPPED)");
  auto* ep_flag =
      run->add_flag("--ep", run_opt.ep,
                    "the layer step with expert parallelism over every visible GPU (at least 2: "
                    "dispatch, expert MLP, combine, and their backward), checked against the layer "
                    "without it");
  run->add_option("--backend", run_opt.ep_backend, "with --ep: nccl or nvlink")
      ->check(CLI::IsMember({"nccl", "nvlink"}))
      ->needs(ep_flag)
      ->capture_default_str();

  auto* bench = app.add_subcommand("bench", "benchmarks against the device ceilings");
  bench->require_subcommand(1);
  bench->fallthrough();
  auto* bperm = bench->add_subcommand("permute", "plan build, permute+pad, unpermute, backward");
  std::vector<std::string> bench_presets;
  bperm->add_option("--preset", bench_presets, "presets (default: mixtral dsv3 qwen3-30b)")
      ->check(preset_check);
  bperm->add_option("--device", device, device_help)->check(device_check);
  bench::PermuteBenchOptions bopt;
  bperm->add_option("--align", bopt.align, "per-expert padding (1,16,32,64,128,256)")
      ->check(align_check)
      ->capture_default_str();
  std::string dtype = "bf16";
  bperm->add_option("--dtype", dtype, "bf16, fp16 or fp32")->capture_default_str();
  bperm->add_option("--json", bopt.json_path, "also write the results as JSON to this file")
      ->check(json_check);
  bperm->add_option("--iters", bopt.timing.iters, "timed runs per op (median)")
      ->capture_default_str();

  auto* bgemm = bench->add_subcommand("gemm", "grouped GEMM forward/dgrad/wgrad vs dense cuBLAS");
  bench::GemmBenchOptions gopt;
  bgemm->add_option("--device", device, device_help)->check(device_check);
  bgemm->add_option("--case", gopt.cases,
                    "dsv3-fc1 dsv3-fc2 mixtral-fc1 qwen3-fc1 qwen3-fc2 (default: all)");
  bgemm->add_flag("--sweep", gopt.sweep, "rows per expert 64..4096, uniform and skewed");
  bgemm->add_flag(
      "--tune", gopt.tune,
      "also time the shared-memory splits (stages x epilogue buffers) of the TMA kernel");
  bgemm
      ->add_option("--tune-hold", gopt.tune_hold,
                   "fused FC1: K slices the pipeline skips the stage the helpers hold, each "
                   "value timed in alternation with FC1 alone")
      ->check(CLI::Range(0, 1 << 20));
  bgemm->add_flag("--fp8-tiles", gopt.fp8_tiles,
                  "also time each tile shape of the FP8 forward (128x128, 128x192, 192x128), each "
                  "in alternation with the default");
  bgemm->add_option("--sweep-experts", gopt.sweep_experts, "experts in the sweep")
      ->capture_default_str();
  bgemm
      ->add_option("--sweep-rows", gopt.sweep_rows,
                   "rows per expert in the sweep (default: 64..4096)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  bgemm->add_option("--sweep-k", gopt.sweep_k, "K in the sweep")->capture_default_str();
  bgemm->add_option("--sweep-n", gopt.sweep_n, "N in the sweep")->capture_default_str();
  bgemm->add_option("--json", gopt.json_path, "also write the results as JSON to this file")
      ->check(json_check);
  bgemm->add_option("--iters", gopt.timing.iters, "timed runs per op (median)")
      ->capture_default_str();

  auto* bdisp = bench->add_subcommand(
      "dispatch",
      "expert-parallel dispatch/combine over the GPUs of this host (nccl or nvlink), against a "
      "bare NCCL all-to-all and the bound of the peer-copy and device-copy rates");
  bench::DispatchBenchOptions dopt;
  std::vector<std::string> disp_presets;
  bdisp->add_option("--preset", disp_presets, "presets (default: dsv3 mixtral)")
      ->check(preset_check);
  bdisp->add_option("--gpus", dopt.gpus, "GPUs to use (default: all visible)");
  bdisp->add_option("--tokens", dopt.tokens, "tokens per GPU (default: the preset's)");
  bdisp->add_option("--align", dopt.align, "per-expert padding of the receive layout")
      ->check(align_check)
      ->capture_default_str();
  bdisp->add_option("--backend", dopt.backend, "nccl or nvlink")
      ->check(CLI::IsMember({"nccl", "nvlink"}))
      ->capture_default_str();
  bdisp->add_flag(
      "--bulk-copies", dopt.bulk_copies,
      "backend nvlink: dispatch rows with TMA bulk copies (EpOptions::nvlink_bulk_copies)");
  bdisp
      ->add_option("--routings", dopt.routings,
                   "dispatches cycle through this many routings (new ones each call, as in "
                   "training; the nccl backend's eager piece is sized from the previous one)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  bdisp->add_flag(
      "--fp8", dopt.fp8,
      "FP8 dispatch: e4m3 token rows with float32 scales per 128 columns (bf16 combine)");
  bdisp->add_flag(
      "--no-sweep", [&](int64_t) { dopt.sweep = false; },
      "skip the pieces / SM-count sweep (only the default configuration)");
  bdisp->add_option("--json", dopt.json_path, "also write the results as JSON to this file")
      ->check(json_check);
  bdisp->add_option("--iters", dopt.timing.iters, "timed runs per op (median)")
      ->capture_default_str();

  auto* bmlp = bench->add_subcommand(
      "mlp", "grouped expert MLP forward + backward (SwiGLU, probs-weighted)");
  bench::MlpBenchOptions mopt;
  bmlp->add_option("--device", device, device_help)->check(device_check);
  bmlp->add_option("--case", mopt.cases, "dsv3 mixtral qwen3-30b (default: all)");
  bmlp->add_option("--json", mopt.json_path, "also write the results as JSON to this file")
      ->check(json_check);
  bmlp->add_option("--iters", mopt.timing.iters, "timed runs per op (median)")
      ->capture_default_str();

  auto* bquant = bench->add_subcommand(
      "quantize", "FP8 quantization: activations 1x128, expert weights 128x128 and W^T's codes");
  bench::QuantizeBenchOptions qopt;
  bquant->add_option("--device", device, device_help)->check(device_check);
  bquant->add_option("--case", qopt.cases, "dsv3 mixtral qwen3-30b (default: all)");
  bquant->add_option("--json", qopt.json_path, "also write the results as JSON to this file")
      ->check(json_check);
  bquant->add_option("--iters", qopt.timing.iters, "timed runs per op (median)")
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  try {
    const Device dev = bench::parse_device(device);
    if (*bperm) {
      bopt.presets = bench_presets.empty()
                         ? std::vector<std::string>{"mixtral", "dsv3", "qwen3-30b"}
                         : bench_presets;
      for (const auto& p : bopt.presets) bench::find_preset(p);  // validate before starting
      MOEFLOW_CHECK(is_valid_align(bopt.align),
                    "--align must be one of 1, 16, 32, 64, 128, 256; got ", bopt.align);
      MOEFLOW_CHECK(bopt.timing.iters > 0, "--iters must be > 0; got ", bopt.timing.iters);
      bopt.dtype = bench::parse_float_dtype(dtype);
      bopt.device = dev;
      if (dev.is_cpu()) {  // the reference backend is slow: fewer runs
        bopt.timing.warmup = 1;
        bopt.timing.iters = std::min(bopt.timing.iters, 3);
      }
      bench::run_permute_bench(bopt);
      return 0;
    }
    if (*bgemm) {
#ifdef MOEFLOW_WITH_CUDA
      MOEFLOW_CHECK(gopt.timing.iters > 0, "--iters must be > 0; got ", gopt.timing.iters);
      gopt.device = dev;
      bench::run_gemm_bench(gopt);
      return 0;
#else
      MOEFLOW_CHECK(false, "bench gemm needs the CUDA backend (built without CUDA)");
#endif
    }
    if (*bmlp) {
#ifdef MOEFLOW_WITH_CUDA
      MOEFLOW_CHECK(mopt.timing.iters > 0, "--iters must be > 0; got ", mopt.timing.iters);
      mopt.device = dev;
      bench::run_mlp_bench(mopt);
      return 0;
#else
      MOEFLOW_CHECK(false, "bench mlp needs the CUDA backend (built without CUDA)");
#endif
    }
    if (*bquant) {
#ifdef MOEFLOW_WITH_CUDA
      MOEFLOW_CHECK(qopt.timing.iters > 0, "--iters must be > 0; got ", qopt.timing.iters);
      qopt.device = dev;
      bench::run_quantize_bench(qopt);
      return 0;
#else
      MOEFLOW_CHECK(false, "bench quantize needs the CUDA backend (built without CUDA)");
#endif
    }
    if (*bdisp) {
#ifdef MOEFLOW_WITH_CUDA
      dopt.presets =
          disp_presets.empty() ? std::vector<std::string>{"dsv3", "mixtral"} : disp_presets;
      for (const auto& p : dopt.presets) bench::find_preset(p);
      MOEFLOW_CHECK(is_valid_align(dopt.align),
                    "--align must be one of 1, 16, 32, 64, 128, 256; got ", dopt.align);
      MOEFLOW_CHECK(dopt.timing.iters > 0, "--iters must be > 0; got ", dopt.timing.iters);
      bench::run_dispatch_bench(dopt);
      return 0;
#else
      MOEFLOW_CHECK(false, "bench dispatch needs the CUDA backend (built without CUDA)");
#endif
    }
    MOEFLOW_CHECK(is_valid_align(run_opt.align),
                  "--align must be one of 1, 16, 32, 64, 128, 256; got ", run_opt.align);
    run_opt.device = dev;
    run_opt.backward = !no_backward;
    if (run_opt.ep) {
#ifdef MOEFLOW_WITH_CUDA
      MOEFLOW_CHECK(dev.is_cuda(), "run --ep needs CUDA GPUs (device ", dev.str(), ")");
      return bench::run_ep_layer(run_opt);
#else
      MOEFLOW_CHECK(false, "run --ep needs the CUDA backend (built without CUDA)");
#endif
    }
    return bench::run_layer(run_opt);
  } catch (const Error& e) {
    std::string msg = e.what();
    if (msg.rfind("moeflow: ", 0) == 0) msg = msg.substr(9);
    fmt::print(stderr, "moeflow: error: {}\n", msg);
    return 2;
  }
}
