// Experiment: permute_quantize (tokens -> FP8 expert rows with 1x128 scales)
// with each token's destination rows held in registers for the whole row
// (one shuffle per slot per token, the slot loop unrolled and predicated)
// against the production kernel of permute_quantize.cu, which shuffles each
// routed slot's row out of its lane again for every 512-column chunk. Both
// are checked byte for byte against each other (codes, scales, row probs),
// then timed like `moeflow bench permute` on the mixtral, dsv3 and
// qwen3-235b presets (align 16), against the device copy rate. Built with
// -DMOEFLOW_BUILD_EXPERIMENTS=ON; the production choice lives in
// permute_quantize.cu.
#include <fmt/format.h>

#include <vector>

#include "bench/bench.h"
#include "bench/harness.h"
#include "bench/presets.h"
#include "cuda/permute_quantize.cu"  // the production kernels and launch setup

namespace moeflow::cuda {
namespace {

// Tokens with at most KMAX slots, 16-byte rows (the production kernel's VEC
// form); pad items as the production kernel.
template <typename T, bool E4M3, int KMAX>
__global__ void __launch_bounds__(kThreads, 4) permute_quantize_regs_kernel(Args a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t item = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarpSize;
  if (item >= a.num_tokens + a.num_pad_items) return;
  if (item >= a.num_tokens) {  // pad row: codes 0, scales 0, prob 0
    const int64_t row = a.pads.row_of(item - a.num_tokens);
    if (row < 0) return;
    write_pad_row<true>(a.y + row * a.y_stride, a.y_scales + row * a.nb, a.nb, a.hidden, 0.0f,
                        lane);
    if (lane == 0 && a.permuted_probs) a.permuted_probs[row] = 0.0f;
    return;
  }
  const int64_t t = item;
  const int64_t* dest = a.dest_row + t * a.topk;
  const int64_t mine = lane < a.topk ? dest[lane] : -1;
  if (a.permuted_probs && mine >= 0) a.permuted_probs[mine] = a.probs[t * a.topk + lane];
  // every lane holds every slot's row (int32: capacity < 2^31)
  int32_t rows[KMAX];
#pragma unroll
  for (int k = 0; k < KMAX; ++k) rows[k] = static_cast<int32_t>(__shfl_sync(0xffffffffu, mine, k));
  if (__ballot_sync(0xffffffffu, mine >= 0) == 0) return;  // nothing to write (warp-uniform)

  const T* xrow = reinterpret_cast<const T*>(a.x + t * a.x_stride);
  RawChunk<T> next;
  load_raw(xrow, int64_t{lane} * kPerLane, a.hidden, next);
  for (int64_t c0 = 0; c0 < a.hidden; c0 += kChunk) {
    const int64_t cl = c0 + int64_t{lane} * kPerLane;
    float v[kPerLane];
    const RawChunk<T> cur = next;
    if (c0 + kChunk < a.hidden) load_raw(xrow, cl + kChunk, a.hidden, next);
    unpack_raw(cur, v);
    uint32_t w[kPerLane / 4];
    const float scale = quantize_chunk<E4M3>(v, a.pow2, w);
    const bool lead = cl < a.hidden && lane % kLanesPerBlock == 0;
    const int64_t blk = cl / kBlock;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      if (k >= a.topk || rows[k] < 0) continue;
      store_codes<true>(a.y + int64_t{rows[k]} * a.y_stride, cl, a.hidden, w);
      if (lead) a.y_scales[int64_t{rows[k]} * a.nb + blk] = scale;
    }
  }
}

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
  fmt::print("{:<11} {:>12} {:>8} {:>12} {:>8}  {}\n", "case", "production", "of copy",
             "rows in regs", "of copy", "bitwise");
  for (const char* name : {"mixtral", "dsv3", "qwen3-235b"}) {
    const auto& p = bench::find_preset(name);
    const int64_t T = p.num_tokens, H = p.hidden;
    const int K = p.topk;
    const PlanConfig cfg{p.num_experts, 16, -1};
    auto routing = bench::random_routing(T, p.num_experts, K, 1, dev);
    RoutingPlan plan = allocate_plan(T, K, cfg, dev);
    Tensor ws = Tensor::empty({(int64_t)plan_workspace_bytes(T, K, cfg)}, DType::kUInt8, dev);
    build_plan(routing.ids, plan, ws);
    Tensor x = Tensor::empty({T, H}, DType::kBFloat16, dev);
    fill_uniform(x, 3, -4.0f, 4.0f);
    const int64_t cap = plan.capacity_rows, nb = (H + 127) / 128;
    std::vector<Tensor> out;  // y, scales, row probs of the production kernel, then the variant's
    for (int i = 0; i < 2; ++i) {
      out.push_back(Tensor::empty({cap, H}, DType::kFloat8E4M3, dev));
      out.push_back(Tensor::empty({cap, nb}, DType::kFloat32, dev));
      out.push_back(Tensor::empty({cap}, DType::kFloat32, dev));
    }
    for (Tensor& o : out) fill_bytes(o, 0xFF);
    const QuantizeConfig qc{};
    auto production = [&] {
      mc::permute_quantize(x, plan, out[0], out[1], qc,
                           PermuteExtras{routing.probs, out[2], {}, {}}, nullptr);
    };
    // The production launch's arguments (permute_quantize.cu), for the variant.
    mc::Args a{};
    a.x = static_cast<const uint8_t*>(x.data());
    a.x_stride = H * 2;
    a.y = static_cast<uint8_t*>(out[3].data());
    a.y_stride = H;
    a.y_scales = out[4].data_ptr<float>();
    a.nb = nb;
    a.hidden = H;
    a.dest_row = plan.dest_row.data_ptr<int64_t>();
    a.num_tokens = T;
    a.topk = K;
    a.probs = routing.probs.data_ptr<float>();
    a.permuted_probs = out[5].data_ptr<float>();
    a.pow2 = false;
    a.pads = mc::pads_of(plan);
    a.num_pad_items = mc::pad_items_of(plan);
    const unsigned blocks = static_cast<unsigned>(mc::ceil_div(T + a.num_pad_items, mc::kWarps));
    auto variant = [&] {
      mc::permute_quantize_regs_kernel<__nv_bfloat16, true, 8><<<blocks, mc::kThreads>>>(a);
    };
    production();
    variant();
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    bool same = true;
    for (int i = 0; i < 3; ++i) same = same && mc::bytes_of(out[i]) == mc::bytes_of(out[3 + i]);
    const double bytes = double(T) * H * 2 + double(T * K) * (H + 4 * nb);
    const double g0 = bytes / bench::time_us(dev, nullptr, production, timing) / 1e3;
    const double g1 = bytes / bench::time_us(dev, nullptr, variant, timing) / 1e3;
    fmt::print("{:<11} {:>7.0f} GB/s {:>7.0f}% {:>7.0f} GB/s {:>7.0f}%  {}\n", name, g0,
               100 * g0 / copy, g1, 100 * g1 / copy, same ? "equal" : "DIFFERENT");
  }
  return 0;
}
