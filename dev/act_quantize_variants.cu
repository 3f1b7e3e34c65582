// Experiment: the blockwise FP8 recipe's activation quantization (a =
// act(h) * p as e4m3 codes with 1x128 scales, `grouped_mlp_activation_quantize`)
// as production runs it (h read by 16-byte loads: a lane's 16 gate and 16 up
// columns as two 32-byte pieces, codes stored 16 bytes at a time) against the
// same kernel's per-element form (VEC = false), which mlp_ops.cu runs when f
// or the interleave is not a multiple of 16 and which was the only form before.
// Both are checked byte for byte against each other (codes and scales), then
// timed like `moeflow bench` on the dsv3 and mixtral layer cases (uniform
// groups), with the device copy rate as the ceiling. Built with
// -DMOEFLOW_BUILD_EXPERIMENTS=ON; the production choice lives in mlp_ops.cu.
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "bench/bench.h"
#include "bench/harness.h"
#include "cuda/mlp_ops.cu"  // the production kernel and its launch setup

namespace moeflow::cuda {
namespace {

std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor c = t.to(Device::cpu());
  const auto* p = static_cast<const uint8_t*>(c.data());
  return std::vector<uint8_t>(p, p + c.nbytes());
}

}  // namespace
}  // namespace moeflow::cuda

using namespace moeflow;
namespace mc = moeflow::cuda;

int main() {
  const Device dev = Device::cuda(0);
  bench::TimingOptions timing;
  const double copy = bench::copy_bandwidth_gbps(dev, nullptr, timing);
  fmt::print("{}: copy ceiling {:.0f} GB/s\n", bench::device_name(dev), copy);
  fmt::print("{:<9} {:>7} {:>6} {:>12} {:>12} {:>12} {:>12}  {}\n", "case", "rows", "F",
             "16-byte us", "16-byte GB/s", "scalar us", "scalar GB/s", "bitwise");
  struct Shape {
    const char* name;
    int64_t rows, f;
    int experts;
  };
  // dsv3 layer case (8192 tokens x top-8, F 2048, 32 experts), mixtral (16384 x 2, F 14336, 8)
  for (const Shape& s : {Shape{"dsv3", 65536, 2048, 32}, Shape{"mixtral", 32768, 14336, 8}}) {
    std::vector<int64_t> off(s.experts + 1);
    for (int e = 0; e <= s.experts; ++e) off[e] = s.rows / s.experts * e;
    Tensor offsets = Tensor::empty({s.experts + 1}, DType::kInt64, Device::cpu());
    std::memcpy(offsets.data(), off.data(), off.size() * 8);
    offsets = offsets.to(dev);
    MlpRows r;
    r.groups.offsets = offsets;
    r.num_groups = s.experts;
    r.rows = s.rows;
    Tensor h = Tensor::empty({s.rows, 2 * s.f}, DType::kBFloat16, dev);
    fill_uniform(h, 7, -3.0f, 3.0f);
    Tensor probs = Tensor::empty({s.rows}, DType::kFloat32, dev);
    fill_uniform(probs, 8, 0.0f, 1.0f);
    const int64_t nb = (s.f + 127) / 128;
    Tensor q0 = Tensor::empty({s.rows, s.f}, DType::kFloat8E4M3, dev);
    Tensor s0 = Tensor::empty({s.rows, nb}, DType::kFloat32, dev);
    Tensor q1 = Tensor::empty({s.rows, s.f}, DType::kFloat8E4M3, dev);
    Tensor s1 = Tensor::empty({s.rows, nb}, DType::kFloat32, dev);
    fill_bytes(q1, 0xFF);
    fill_bytes(s1, 0xFF);
    const ActivationParams ap{};
    auto production = [&] {
      mc::mlp_activation_quantize(r, h, probs, Activation::kSwiGLU, ap, 0, true, false, q0, s0,
                                    nullptr);
    };
    auto variant = [&] {
      mc::act_quantize_kernel<__nv_bfloat16, Activation::kSwiGLU, true, false>
          <<<static_cast<unsigned>((s.rows + 7) / 8), 256>>>(
              mc::row_map(r), h.data_ptr<__nv_bfloat16>(), 2 * s.f, probs.data_ptr<float>(), ap,
              0, static_cast<uint8_t*>(q1.data()), s.f, s1.data_ptr<float>(), nb, s.f, s.rows,
              false);
    };
    production();
    variant();
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    const bool same = mc::bytes_of(q0) == mc::bytes_of(q1) && mc::bytes_of(s0) == mc::bytes_of(s1);
    // h read once, codes and scales written
    const double bytes = double(s.rows) * (2 * s.f * 2 + s.f + 4 * nb);
    const double t0 = bench::time_us(dev, nullptr, production, timing);
    const double t1 = bench::time_us(dev, nullptr, variant, timing);
    fmt::print("{:<9} {:>7} {:>6} {:>12.1f} {:>12.0f} {:>12.1f} {:>12.0f}  {}\n", s.name, s.rows,
               s.f, t0, bytes / t0 / 1e3, t1, bytes / t1 / 1e3, same ? "equal" : "DIFFERENT");
  }
  return 0;
}
