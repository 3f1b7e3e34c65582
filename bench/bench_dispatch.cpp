// `moeflow bench dispatch`: expert-parallel dispatch (permute + pad included)
// and combine across the GPUs of this process (one thread per GPU), next to a
// bare NCCL all-to-all (grouped ncclSend/ncclRecv) of the same bytes per peer
// measured in the same run.
//
// Bytes counted: the token rows (H * dtype bytes) that leave a rank for the
// other ranks, once per (token, rank); combine: the float32 partial rows that
// leave a rank (combine sends float32 partial sums so that the result is
// bitwise the reference's), also timed against an all-to-all of the bf16
// token rows coming home (the stricter comparison: what a combine that sums
// in bf16 would move); then again with the bfloat16 wire
// (EpOptions::combine_wire_dtype: the partials rounded, bf16 rows). Both backends send a token's
// only slot on a rank as that slot's bf16 row instead of a float32 partial. The nvlink backend
// (--backend nvlink) moves the same bytes over the links; it also reports the token rows its own
// SMs store (own slots' rows, the peers' stages, the peers' rows expanded here): at a few SMs that
// store traffic, not the links, bounds the dispatch. The routing metadata (K ids + K probs per row)
// is sent too but not counted.
//
// Ceilings, measured first in the same run: the peer copy (every rank copying
// to every peer at once, cudaMemcpyPeerAsync: the link rate with all links
// busy) and a device copy of 1 GiB on each GPU. The physical bound of a
// dispatch is the larger of its bytes out at the peer-copy rate (link) and
// the rows its SMs store at the device-copy rate (local: the two overlap at
// best); of a combine with the bf16 wire, its bytes out at the peer-copy rate.
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <fstream>
#include <functional>
#include <mutex>
#include <thread>

#include "bench/bench.h"
#include "bench/presets.h"
#include "moeflow/ep.h"
#include "moeflow/quantize.h"

namespace moeflow::bench {

namespace {

// Median of per-iteration times (ms) of fn on this rank's stream; every rank
// runs the same number of iterations (fn is collective). `before` runs on
// the host before each iteration, outside the timed span.
double median_ms(const std::function<void()>& fn, cudaStream_t stream, int warmup, int iters,
                 const std::function<void()>& before = {}) {
  for (int i = 0; i < warmup; ++i) {
    if (before) before();
    fn();
  }
  MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  MOEFLOW_CUDA_CHECK(cudaEventCreate(&a));
  MOEFLOW_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    if (before) before();
    MOEFLOW_CUDA_CHECK(cudaEventRecord(a, stream));
    fn();
    MOEFLOW_CUDA_CHECK(cudaEventRecord(b, stream));
    MOEFLOW_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    MOEFLOW_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Every thread waits until all `n` have arrived (reusable).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const long gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return gen_ != gen; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  long gen_ = 0;
};

struct Ceilings {
  std::vector<double> peer_GBps;  // per rank: bytes out per second, every peer at once
  std::vector<double> copy_GBps;  // per rank: bytes copied per second (read + write of them)
};

// The copy ceilings of the ranks' GPUs: each rank copies 256 MiB split over its
// peers (all ranks at once, each iteration started together), and 1 GiB
// within its own memory. Medians per rank.
Ceilings measure_ceilings(const std::vector<int>& devs, int warmup, int iters) {
  const int W = static_cast<int>(devs.size());
  Ceilings c{std::vector<double>(W, 0.0), std::vector<double>(W, 0.0)};
  const size_t peer_bytes = size_t{256} << 20, copy_bytes = size_t{1} << 30;
  const size_t per_peer = W > 1 ? peer_bytes / (W - 1) / 256 * 256 : 0;
  for (int a = 0; a < W; ++a)
    for (int b = 0; b < W; ++b) {
      if (a == b) continue;
      int can = 0;
      MOEFLOW_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, devs[a], devs[b]));
      if (!can) continue;
      MOEFLOW_CUDA_CHECK(cudaSetDevice(devs[a]));
      const cudaError_t e = cudaDeviceEnablePeerAccess(devs[b], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled)
        cudaGetLastError();
      else
        MOEFLOW_CUDA_CHECK(e);
    }
  std::vector<Tensor> src(W), dst(W), recv(W);  // recv[q]: W-1 slots of per_peer bytes on q
  for (int r = 0; r < W; ++r) {
    const Device d = Device::cuda(devs[r]);
    src[r] = Tensor::empty({static_cast<int64_t>(copy_bytes)}, DType::kUInt8, d);
    dst[r] = Tensor::empty({static_cast<int64_t>(copy_bytes)}, DType::kUInt8, d);
    fill_bytes(src[r], 0x3C);
    if (W > 1)
      recv[r] = Tensor::empty({static_cast<int64_t>(per_peer * (W - 1))}, DType::kUInt8, d);
  }
  Barrier barrier(W);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(W);
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      try {
        MOEFLOW_CUDA_CHECK(cudaSetDevice(devs[r]));
        cudaStream_t stream;
        MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        if (W > 1) {  // each iteration started on every rank together
          const double ms = median_ms(
              [&] {
                for (int q = 0; q < W; ++q) {
                  if (q == r) continue;
                  const int slot = r < q ? r : r - 1;  // this rank's slot on q
                  MOEFLOW_CUDA_CHECK(
                      cudaMemcpyPeerAsync(recv[q].data_ptr<uint8_t>() + slot * per_peer, devs[q],
                                          src[r].data_ptr<uint8_t>(), devs[r], per_peer, stream));
                }
              },
              stream, warmup, iters, [&] { barrier.wait(); });
          c.peer_GBps[r] = static_cast<double>(per_peer) * (W - 1) / ms / 1e6;
        }
        const double ms = median_ms(
            [&] {
              MOEFLOW_CUDA_CHECK(cudaMemcpyAsync(dst[r].data(), src[r].data(), copy_bytes,
                                                 cudaMemcpyDeviceToDevice, stream));
            },
            stream, warmup, iters);
        c.copy_GBps[r] = static_cast<double>(copy_bytes) / ms / 1e6;
        MOEFLOW_CUDA_CHECK(cudaStreamDestroy(stream));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return c;
}

}  // namespace

void run_dispatch_bench(const DispatchBenchOptions& opt) {
  MOEFLOW_CHECK(cuda_device_count() > 0, "bench dispatch needs CUDA GPUs; found none");
  int W = opt.gpus > 0 ? opt.gpus : cuda_device_count();
  MOEFLOW_CHECK(W >= 1 && W <= cuda_device_count(), "--gpus must be in [1, ", cuda_device_count(),
                "], got ", W);
  std::vector<int> devs;
  for (int r = 0; r < W; ++r) devs.push_back(r);
  nlohmann::json all = nlohmann::json::array();
  const Ceilings ceil = measure_ceilings(devs, 2, std::max(opt.timing.iters, 5));
  for (int r = 0; r < W; ++r)
    fmt::print(
        "ceilings, rank {}: peer copy {:.0f} GB/s out (to every peer at once), device copy "
        "{:.0f} GB/s (1 GiB)\n",
        r, ceil.peer_GBps[r], ceil.copy_GBps[r]);
  for (const std::string& name : opt.presets) {
    const Preset& p = find_preset(name);
    const int64_t T = opt.tokens > 0 ? opt.tokens : p.num_tokens;
    MOEFLOW_CHECK(p.num_experts % W == 0, "preset ", name, ": ", p.num_experts,
                  " experts do not split over ", W, " GPUs");
    EpOptions eo;
    eo.num_experts = p.num_experts;
    eo.topk = p.topk;
    eo.hidden = p.hidden;
    // --fp8: e4m3 token rows with float32 scales per 128 columns (DeepEP's
    // FP8 dispatch); expert outputs and gradients stay bf16
    eo.dtype = opt.fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
    if (opt.fp8) eo.scale_cols = (p.hidden + 127) / 128;
    eo.align = opt.align;
    eo.max_tokens_per_rank = T;
    const bool nvlink = opt.backend == "nvlink";
    eo.backend = nvlink ? EpBackend::kNvlink : EpBackend::kNccl;
    eo.nvlink_bulk_copies = opt.bulk_copies;
    fmt::print("[{}] W={} T={} per GPU, H={}, E={}, K={}, {}, align {}, backend {}{} ...\n", name,
               W, T, p.hidden, p.num_experts, p.topk,
               opt.fp8 ? "fp8 e4m3 dispatch (+ float32 scales per 128), bf16 combine" : "bf16",
               opt.align, opt.backend,
               opt.routings > 1 ? fmt::format(", {} routings in turn", opt.routings) : "");
    std::fflush(stdout);
    auto groups = EpGroup::create_local(devs, eo);
    if (!nvlink && W > 1)
      fmt::print(
          "  staging buffers registered with NCCL: {}\n",
          groups[0]->nccl_buffers_registered() ? "yes" : "no (MOEFLOW_EP_REGISTER=0 or no cuMem)");
    // nccl: pipeline pieces per peer x blocks of the kernels beside the
    // transfers; nvlink: (1, blocks of its kernels), the SM-count sweep
    const std::vector<std::pair<int, int>> configs =
        !opt.sweep ? std::vector<std::pair<int, int>>{}
        : nvlink   ? std::vector<std::pair<int, int>>{{1, 8}, {1, 16}, {1, 32}, {1, 64}, {1, 132}}
                   : std::vector<std::pair<int, int>>{{1, 0},  {2, 0},  {4, 0},  {1, 32},
                                                      {2, 32}, {4, 32}, {2, 64}, {4, 64}};
    struct Result {
      double dispatch_ms = 0, combine_ms = 0, a2a_ms = 0, a2a_f32_ms = 0, a2a_back_ms = 0;
      double combine_bf16_ms = -1;  // EpOptions::combine_wire_dtype bfloat16 (-1: not run)
      double quant_dispatch_ms = -1;  // --fp8: quantize (1x128) of bf16 tokens + the dispatch
      double fused_quant_ms = -1;     // --fp8: ep_dispatch_quantize of the bf16 tokens
      double out_bytes = 0, back_bytes = 0, link_bytes = 0, wire_back_bytes = 0;
      double wire_back_bytes_bf16 = 0;
      std::vector<double> sweep_dispatch_ms, sweep_combine_ms;  // per configs
    };
    std::vector<Result> res(W);
    EpGroup::run_local(groups, [&](int r) {
      EpGroup& g = *groups[r];
      const Device dev = g.device();
      cudaStream_t stream;
      MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      Routing routing = random_routing(T, p.num_experts, p.topk, 1000 + r, dev);
      // --routings N: each dispatch takes the next of N routings (the byte
      // counts below are those of the first; the others differ by about 1 %)
      std::vector<Routing> routings{routing};
      for (int i = 1; i < opt.routings; ++i)
        routings.push_back(random_routing(T, p.num_experts, p.topk, 1000 + r + 7919 * i, dev));
      size_t call = 0;
      auto next = [&]() -> const Routing& { return routings[call++ % routings.size()]; };
      Tensor x = Tensor::empty({T, p.hidden}, eo.dtype, dev);
      fill_bytes(x, 0x3C, stream);
      Tensor sc, xb;
      if (opt.fp8) {
        sc = Tensor::empty({T, eo.scale_cols}, DType::kFloat32, dev);
        fill_bytes(sc, 0x3C, stream);
        xb = Tensor::empty({T, p.hidden}, DType::kBFloat16, dev);  // the bf16 tokens
        fill_bytes(xb, 0x3C, stream);
      }
      EpDispatchResult d = ep_dispatch(g, x, routing.ids, routing.probs, sc, stream);
      EpHandle last = d.handle;  // the latest timed dispatch's (combine's routes)
      Tensor y = Tensor::empty({g.capacity_rows(), p.hidden}, DType::kBFloat16, dev);
      if (opt.fp8)
        fill_bytes(y, 0x3C, stream);
      else
        copy(d.x, y, stream);
      d = EpDispatchResult{};
      // Each timed dispatch drops the previous handle first, as a layer's
      // handle goes after its backward: one dispatch in flight.
      auto dispatch = [&](const Routing& rt) {
        last = EpHandle();
        last = ep_dispatch(g, x, rt.ids, rt.probs, sc, stream).handle;
      };
      Tensor out = Tensor::empty({T, p.hidden}, DType::kBFloat16, dev);
      Result& rr = res[r];
      const int default_chunks = g.options().pipeline_chunks;
      const int default_blocks = g.options().overlap_blocks;
      const int default_nvl = g.options().nvlink_blocks;
      for (size_t ci = 0; ci < configs.size(); ++ci) {
        const auto [nc, nb] = configs[ci];
        if (r == 0) print_progress("sweep", ci, configs.size());
        g.set_pipeline_chunks(nc);
        if (nvlink)
          g.set_nvlink_blocks(nb);
        else
          g.set_overlap_blocks(nb);
        rr.sweep_dispatch_ms.push_back(median_ms(
            [&] {
              dispatch(next());
            },
            stream, opt.timing.warmup, opt.timing.iters));
        rr.sweep_combine_ms.push_back(median_ms([&] { ep_combine(g, last, y, true, out, stream); },
                                                stream, opt.timing.warmup, opt.timing.iters));
      }
      if (r == 0 && !configs.empty()) print_progress("sweep", configs.size(), configs.size());
      g.set_pipeline_chunks(default_chunks);
      g.set_overlap_blocks(default_blocks);
      g.set_nvlink_blocks(default_nvl);
      rr.dispatch_ms = median_ms(
          [&] {
            dispatch(next());
          },
          stream, opt.timing.warmup, opt.timing.iters);
      rr.combine_ms = median_ms([&] { ep_combine(g, last, y, true, out, stream); }, stream,
                                opt.timing.warmup, opt.timing.iters);
      if (opt.fp8)  // from bf16 tokens: their 1x128 quantization, then the FP8 dispatch
        rr.quant_dispatch_ms = median_ms(
            [&] {
              quantize(xb, QuantizeConfig{}, x, sc, {}, {}, stream);
              dispatch(next());
            },
            stream, opt.timing.warmup, opt.timing.iters);
      if (opt.fp8)  // the same through ep_dispatch_quantize (the group's path)
        rr.fused_quant_ms = median_ms(
            [&] {
              const Routing& rt = next();
              last = EpHandle();
              last = ep_dispatch_quantize(g, xb, rt.ids, rt.probs, QuantizeConfig{}, stream).handle;
            },
            stream, opt.timing.warmup, opt.timing.iters);
      if (p.hidden % 8 == 0) {  // the same combine with the bfloat16 wire
        g.set_combine_wire_dtype(DType::kBFloat16);
        rr.combine_bf16_ms = median_ms([&] { ep_combine(g, last, y, true, out, stream); },
                                       stream, opt.timing.warmup, opt.timing.iters);
        g.set_combine_wire_dtype(DType::kFloat32);
      }
      std::vector<int64_t> sent = g.last_send_rows(), got = g.last_recv_rows();
      const int64_t row = p.hidden * 2;  // bf16 rows (combine)
      double nvl_scale_extra = 0;
      // a dispatched row: the token and its scales (nccl sends the scales
      // once per token and rank, nvlink writes them beside every slot's row:
      // the slots past the first are added below)
      const int64_t drow = p.hidden * int64_t(dtype_size(eo.dtype)) + eo.scale_cols * 4;
      {  // nvlink: counts stay on the device, the same figures from the routings
        const int L = p.num_experts / W;
        std::vector<int64_t> rsent(W, 0), rgot(W, 0);
        nvl_scale_extra = 0;
        for (int s = 0; s < W; ++s) {
          Routing rs = random_routing(T, p.num_experts, p.topk, 1000 + s, dev);
          Tensor ids = rs.ids.to(Device::cpu());
          for (int64_t t = 0; t < T; ++t) {
            std::vector<int> on(W, 0);  // slots of (s, t) on each rank
            int here = 0;               // slots of (s, t) on this rank
            for (int k = 0; k < p.topk; ++k) {
              const int64_t e = ids.dtype() == DType::kInt64
                                    ? ids.data_ptr<int64_t>()[t * p.topk + k]
                                    : ids.data_ptr<int32_t>()[t * p.topk + k];
              if (e < 0) continue;
              ++on[e / L];
              if (e / L == r) ++here;
            }
            // the slot rows here: a peer token's only slot is pushed by the peer
            if (s == r || here >= 2) rr.link_bytes += static_cast<double>(here) * drow;
            // combine sends a peer token's one slot here as a bf16 row, else a float32 partial
            if (s != r && here > 0) rr.wire_back_bytes += here == 1 ? row : p.hidden * 4;
            if (s != r && here > 0) rr.wire_back_bytes_bf16 += row;
            for (int q = 0; q < W; ++q) {
              if (!on[q]) continue;
              if (s == r) ++rsent[q];
              if (q == r) ++rgot[s];
              if (s == r && q != r) {
                rr.link_bytes += static_cast<double>(drow);  // a peer's stage or row
                if (nvlink) nvl_scale_extra += static_cast<double>(on[q] - 1) * eo.scale_cols * 4;
              }
            }
          }
        }
        if (nvlink) {
          sent = rsent;
          got = rgot;
        }
      }
      rr.out_bytes += nvl_scale_extra;
      for (int q = 0; q < W; ++q)
        if (q != r) {
          rr.out_bytes += static_cast<double>(sent[q]) * drow;
          rr.back_bytes += static_cast<double>(got[q]) * p.hidden * 4;
        }
      // Bare NCCL all-to-all of the same per-peer bytes (bf16 rows out; float32 back).
      auto a2a = [&](const std::vector<int64_t>& s_rows, const std::vector<int64_t>& r_rows,
                     int64_t rb) {
        int64_t ns = 0, nr = 0;
        for (int q = 0; q < W; ++q) ns += s_rows[q], nr += r_rows[q];
        Tensor sb = Tensor::empty({std::max<int64_t>(ns * rb, 1)}, DType::kUInt8, dev);
        Tensor rbuf = Tensor::empty({std::max<int64_t>(nr * rb, 1)}, DType::kUInt8, dev);
        return median_ms(
            [&] {
              MOEFLOW_CHECK(ncclGroupStart() == ncclSuccess, "ncclGroupStart");
              int64_t so = 0, ro = 0;
              for (int q = 0; q < W; ++q) {
                if (s_rows[q] > 0)
                  ncclSend(sb.data_ptr<uint8_t>() + so * rb, s_rows[q] * rb, ncclUint8, q,
                           g.nccl_comm(), stream);
                if (r_rows[q] > 0)
                  ncclRecv(rbuf.data_ptr<uint8_t>() + ro * rb, r_rows[q] * rb, ncclUint8, q,
                           g.nccl_comm(), stream);
                so += s_rows[q];
                ro += r_rows[q];
              }
              MOEFLOW_CHECK(ncclGroupEnd() == ncclSuccess, "ncclGroupEnd");
            },
            stream, opt.timing.warmup, opt.timing.iters);
      };
      rr.a2a_ms = a2a(sent, got, drow);
      rr.a2a_f32_ms = a2a(got, sent, p.hidden * 4);
      rr.a2a_back_ms = a2a(got, sent, row);  // the token rows coming home in bf16
      MOEFLOW_CUDA_CHECK(cudaStreamDestroy(stream));
    });
    for (int r = 0; r < W; ++r) {
      const Result& rr = res[r];
      const double d_gbs = rr.out_bytes / rr.dispatch_ms / 1e6,
                   a_gbs = rr.out_bytes / rr.a2a_ms / 1e6;
      const double c_gbs = rr.back_bytes / rr.combine_ms / 1e6,
                   af_gbs = rr.back_bytes / rr.a2a_f32_ms / 1e6;
      if (W == 1)
        fmt::print("  rank 0: dispatch {:>10} | combine {:>10} (one GPU: no bytes leave it)\n",
                   format_time(rr.dispatch_ms * 1e3), format_time(rr.combine_ms * 1e3));
      else
        fmt::print(
            "  rank {}: dispatch {:>10} {:7.1f} GB/s out (NCCL a2a same bytes {:7.1f} GB/s, "
            "ratio {:.2f}) | "
            "combine {:>10} {:7.1f} GB/s out (a2a {:7.1f}, ratio {:.2f}; a2a of the bf16 token "
            "rows {}, ratio {:.2f})\n",
            r, format_time(rr.dispatch_ms * 1e3), d_gbs, a_gbs, d_gbs / a_gbs,
            format_time(rr.combine_ms * 1e3), c_gbs, af_gbs, c_gbs / af_gbs,
            format_time(rr.a2a_back_ms * 1e3), rr.a2a_back_ms / rr.combine_ms);
      if (rr.quant_dispatch_ms > 0)
        fmt::print("          from bf16 tokens (quantize 1x128, then this dispatch): {:>10}, {:.2f} "
                   "M tokens/s\n",
                   format_time(rr.quant_dispatch_ms * 1e3), T / rr.quant_dispatch_ms / 1e3);
      if (rr.fused_quant_ms > 0)
        fmt::print(
            "          from bf16 tokens through ep_dispatch_quantize (nvlink: in the dispatch "
            "kernel or quantized first, EpOptions::nvlink_quantize_in_dispatch): "
            "{:>10}, {:.2f} M tokens/s\n",
            format_time(rr.fused_quant_ms * 1e3), T / rr.fused_quant_ms / 1e3);
      fmt::print("          dispatch: {:.2f} M tokens/s per rank\n", T / rr.dispatch_ms / 1e3);
      std::string sweep;
      for (size_t i = 0; i < configs.size(); ++i)
        sweep += fmt::format(" {}x{}: {}/{}", configs[i].first, configs[i].second,
                             format_time(rr.sweep_dispatch_ms[i] * 1e3),
                             format_time(rr.sweep_combine_ms[i] * 1e3));
      fmt::print("          {}: dispatch/combine:{}\n",
                 nvlink ? "1 x kernel blocks (SMs)" : "pieces x overlap blocks", sweep);
      if (nvlink)
        fmt::print("          token rows stored by this rank's SMs: {:.1f} MB, {:.1f} GB/s\n",
                   rr.link_bytes / 1e6, rr.link_bytes / rr.dispatch_ms / 1e6);
      fmt::print(
          "          combine sends {:.1f} MB (float32 partials, bf16 rows of one-slot tokens), "
          "{:.1f} GB/s\n",
          rr.wire_back_bytes / 1e6, rr.wire_back_bytes / rr.combine_ms / 1e6);
      // The physical bounds (ms): bytes out at the peer-copy rate, rows stored at the copy rate.
      const double link_ms = W > 1 ? rr.out_bytes / ceil.peer_GBps[r] / 1e6 : 0.0;
      const double local_ms = rr.link_bytes / ceil.copy_GBps[r] / 1e6;
      const double bound_ms = std::max(link_ms, local_ms);
      const double back_link_ms = W > 1 ? rr.wire_back_bytes_bf16 / ceil.peer_GBps[r] / 1e6 : 0.0;
      if (W > 1)
        fmt::print(
            "          bound: dispatch {} (link {}, local {}), dispatch at {:.2f}x it; combine "
            "with the bf16 wire {} (link){}\n",
            format_time(bound_ms * 1e3), format_time(link_ms * 1e3), format_time(local_ms * 1e3),
            bound_ms / rr.dispatch_ms, format_time(back_link_ms * 1e3),
            rr.combine_bf16_ms > 0
                ? fmt::format(", combine at {:.2f}x it", back_link_ms / rr.combine_bf16_ms)
                : std::string());
      if (rr.combine_bf16_ms > 0 && W > 1)
        fmt::print(
            "          combine, bf16 wire: {:>10}, sends {:.1f} MB, {:.1f} GB/s (a2a of the bf16 "
            "token rows {}, ratio {:.2f}; float32 wire / bf16 wire {:.2f})\n",
            format_time(rr.combine_bf16_ms * 1e3), rr.wire_back_bytes_bf16 / 1e6,
            rr.wire_back_bytes_bf16 / rr.combine_bf16_ms / 1e6, format_time(rr.a2a_back_ms * 1e3),
            rr.a2a_back_ms / rr.combine_bf16_ms, rr.combine_ms / rr.combine_bf16_ms);
      all.push_back({{"preset", name},
                     {"pipeline_chunks", groups[r]->options().pipeline_chunks},
                     {"overlap_blocks", groups[r]->options().overlap_blocks},
                     {"nccl_buffers_registered", groups[r]->nccl_buffers_registered()},
                     {"sweep_pieces_blocks", configs},
                     {"sweep_dispatch_ms", rr.sweep_dispatch_ms},
                     {"sweep_combine_ms", rr.sweep_combine_ms},
                     {"world", W},
                     {"dtype", dtype_name(eo.dtype)},
                     {"rank", r},
                     {"tokens", T},
                     {"dispatch_us", rr.dispatch_ms * 1e3},
                     {"quantize_dispatch_us", rr.quant_dispatch_ms * 1e3},
                     {"dispatch_quantize_us", rr.fused_quant_ms * 1e3},
                     {"combine_us", rr.combine_ms * 1e3},
                     {"dispatch_GBps", d_gbs},
                     {"combine_GBps", c_gbs},
                     {"nccl_a2a_GBps", a_gbs},
                     {"nccl_a2a_f32_GBps", af_gbs},
                     {"nccl_a2a_back_bf16_us", rr.a2a_back_ms * 1e3},
                     {"combine_vs_bf16_a2a", rr.a2a_back_ms / rr.combine_ms},
                     {"combine_wire_bytes", rr.wire_back_bytes},
                     {"combine_bf16_wire_us", rr.combine_bf16_ms * 1e3},
                     {"combine_bf16_wire_bytes", rr.wire_back_bytes_bf16},
                     {"combine_bf16_wire_vs_bf16_a2a",
                      rr.combine_bf16_ms > 0 ? rr.a2a_back_ms / rr.combine_bf16_ms : 0.0},
                     {"backend", opt.backend},
                     {"bulk_copies", opt.bulk_copies},
                     {"routings", opt.routings},
                     {"sm_store_bytes", rr.link_bytes},
                     {"out_bytes", rr.out_bytes},
                     {"back_bytes", rr.back_bytes},
                     {"peer_copy_GBps", ceil.peer_GBps[r]},
                     {"device_copy_GBps", ceil.copy_GBps[r]},
                     {"dispatch_link_bound_us", link_ms * 1e3},
                     {"dispatch_local_bound_us", local_ms * 1e3},
                     {"dispatch_vs_bound", bound_ms / rr.dispatch_ms},
                     {"combine_bf16_wire_link_bound_us", back_link_ms * 1e3},
                     {"combine_bf16_wire_vs_bound",
                      rr.combine_bf16_ms > 0 ? back_link_ms / rr.combine_bf16_ms : 0.0}});
    }
    std::fflush(stdout);
  }
  if (!opt.json_path.empty()) {
    std::ofstream f(opt.json_path);
    MOEFLOW_CHECK(f.good(), "--json: cannot write '", opt.json_path, "'");
    f << nlohmann::json{{"rows", all}}.dump(1) << "\n";
    fmt::print("wrote {}\n", opt.json_path);
  }
}

}  // namespace moeflow::bench
