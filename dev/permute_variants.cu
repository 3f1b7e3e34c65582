// Experiment: permute kernel variants (vectors in flight per lane, streaming
// stores) on the benchmark presets, timed like `moeflow bench`. Built with
// -DMOEFLOW_BUILD_EXPERIMENTS=ON; the production choice lives in permute.cu.
#include <fmt/format.h>

#include "bench/bench.h"
#include "bench/presets.h"
#include "cuda/permute.cu"  // the production kernels and launch setup

using namespace moeflow;

// persistent: a resident-sized grid walking the items; else one item per warp.
template <int UNROLL, bool STREAM>
void launch(cuda::PermuteLaunch l, bool persistent, cudaStream_t s) {
  l.args.row_vecs = l.row_bytes / 16;
  const auto kernel = cuda::permute_kernel<uint4, UNROLL, STREAM>;
  const int64_t blocks = cuda::grid_blocks(kernel, l.num_items, persistent);
  kernel<<<blocks, cuda::kThreads, 0, s>>>(l.args);
}

int main() {
  const Device dev = Device::cuda(0);
  bench::TimingOptions timing;
  const double write = bench::write_bandwidth_gbps(dev, nullptr, timing);
  fmt::print("{}: write ceiling {:.0f} GB/s\n", bench::device_name(dev), write);
  fmt::print(
      "one item per warp (np) or persistent grid (p); uN: 16-byte vectors in flight per lane; cs: "
      "streaming stores\n");
  fmt::print("{:<10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n", "case", "np-u4", "np-u8+cs", "p-u4",
             "p-u8", "p-u4+cs", "p-u8+cs");
  for (const char* name : {"mixtral", "dsv3", "qwen3-30b"}) {
    const auto& p = bench::find_preset(name);
    const int64_t T = p.num_tokens, H = p.hidden;
    const PlanConfig cfg{p.num_experts, 16, -1};
    auto routing = bench::random_routing(T, p.num_experts, p.topk, 1, dev);
    RoutingPlan plan = allocate_plan(T, p.topk, cfg, dev);
    Tensor ws = Tensor::empty({(int64_t)plan_workspace_bytes(T, p.topk, cfg)}, DType::kUInt8, dev);
    build_plan(routing.ids, plan, ws);
    Tensor x = Tensor::empty({T, H}, DType::kBFloat16, dev);
    fill_bytes(x, 0x3C);
    Tensor y = Tensor::empty({plan.capacity_rows, H}, DType::kBFloat16, dev);
    Tensor pp = Tensor::empty({plan.capacity_rows}, DType::kFloat32, dev);
    auto l = cuda::make_permute_launch(x, plan, y, PermuteExtras{routing.probs, pp, {}, {}});
    const double bytes = double(T + T * p.topk) * H * 2;
    auto gbps = [&](auto fn) { return bytes / bench::time_us(dev, nullptr, fn, timing) / 1e3; };
    fmt::print("{:<10} {:>9.0f} {:>9.0f} {:>9.0f} {:>9.0f} {:>9.0f} {:>9.0f}\n", name,
               gbps([&] { launch<4, false>(l, false, nullptr); }),
               gbps([&] { launch<8, true>(l, false, nullptr); }),
               gbps([&] { launch<4, false>(l, true, nullptr); }),
               gbps([&] { launch<8, false>(l, true, nullptr); }),
               gbps([&] { launch<4, true>(l, true, nullptr); }),
               gbps([&] { launch<8, true>(l, true, nullptr); }));
  }
  return 0;
}
