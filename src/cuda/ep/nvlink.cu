// Expert-parallel dispatch / combine, backend "nvlink" (see moeflow/ep.h and
// docs/ep.md): kernels that load and store the peers' memory through NCCL
// symmetric memory and LSA barriers, with no host synchronisation, so that
// dispatch, the MLP and combine are capturable in one CUDA graph.
//
// Every phase that writes into the peers' windows starts after an LSA barrier
// (they are done reading what it overwrites) and ends with one (it has landed).
// dispatch:
//   1. the rank's slots ranked per global expert: build_plan over its ids with
//      the E global experts (align 1, nothing dropped) gives every slot its
//      rank among the rank's slots to that expert, in (token, k) order;
//   2. one block: barrier, the rank's counts and T stored into every peer's
//      matrix, barrier; from the matrix, where each of its slots lands on its
//      expert's rank (core/ep_layout.h: the reference's layout and drop rule)
//      and the rank's own receive plan (its pad rows zeroed on a side stream);
//   3. one warp per token: x[t] read once and stored into each own kept slot's
//      final row, and once into every peer holding a kept slot (a token
//      crosses to a rank once): straight into its final row there when the
//      peer holds one slot of t, else into the peer's stage; per kept slot
//      its prob, row_src and row_k, and per peer the token's inv entries;
//   4. one warp per peer token with two or more slots here, once announced:
//      copied from the stage into its final rows;
//   5. the used rows, their probs and the holder's way back (inv, ntok)
//      copied from the window into the dispatch's handle, so that later
//      dispatches may rewrite the window while this one's combine waits.
// combine: barrier; on the holder, one warp per peer token with kept slots
// here: the float32 sum of its slots (k ascending, weighted; rounded to
// bfloat16 with EpOptions::combine_wire_dtype) stored into the
// home rank's partial, or, when it holds one slot of the token, that slot's
// row as is (y's type: half the bytes of a float32 partial for 16-bit y; the
// home weights it exactly as the holder would have); one warp per home
// token: own slots summed (k ascending) and the partials of the ranks added,
// ranks ascending: the reference's order, bitwise the nccl backend's.
// combine backward: barrier; dout[t] stored once into the stage of every peer
// holding a slot of t; one warp per received row: grad_y = w * dout (pad rows
// 0) and <dout, y> stored into the home rank's dp; barrier; dprobs.
#include <nccl.h>

#include <string>

#include "core/backends.h"
#include "core/ep_backend.h"
#include "cuda/ep/group.h"

namespace moeflow {

nvl::Window NvlinkState::view() const {
  nvl::Window w{have_win ? win : nullptr, static_cast<uint8_t*>(base), dc};
  w.world = world;
  w.rank = rank;
  w.off_arrive = off.arrive;
  w.off_round = off.round;
  w.off_abort = off.abort;
  w.status = status_dev;
  w.timeout_ns = have_win ? timeout_ns : 0;  // (plain and simulated windows: no timeout)
  if (sim_bar) {
    w.sim_bar = static_cast<unsigned*>(sim_bar.get());
    w.sim_world = static_cast<int>(sim_bases.size());
    for (size_t q = 0; q < sim_bases.size(); ++q) w.sim_base[q] = sim_bases[q];
  }
  return w;
}

std::shared_ptr<void> RecvRegions::take(const std::shared_ptr<RecvRegions>& r, int* region) {
  std::lock_guard<std::mutex> lock(r->mutex);
  for (size_t i = 0; i < r->held.size(); ++i) {
    if (r->held[i]) continue;
    r->held[i] = 1;
    *region = static_cast<int>(i);
    return std::shared_ptr<void>(r.get(), [r, i](void*) {
      std::lock_guard<std::mutex> lock(r->mutex);
      r->held[i] = 0;
    });
  }
  return nullptr;
}

std::shared_ptr<Tensor> CopyBuffers::take(const std::shared_ptr<CopyBuffers>& b) {
  Tensor t;
  {
    std::lock_guard<std::mutex> lock(b->mutex);
    if (!b->free.empty()) {
      t = std::move(b->free.back());
      b->free.pop_back();
    }
  }
  if (!t.defined()) t = Tensor::empty(b->shape, b->dtype, b->device);
  return std::shared_ptr<Tensor>(new Tensor(std::move(t)), [b](Tensor* p) {
    std::lock_guard<std::mutex> lock(b->mutex);
    b->free.push_back(std::move(*p));
    delete p;
  });
}

void NvlinkState::release(ncclComm_t comm) {
  if (have_dc) ncclDevCommDestroy(comm, &dc);
  if (have_win) ncclCommWindowDeregister(comm, win);
  have_dc = have_win = false;
}

// The symmetric window and the buffers of the device-side layout
// (collective: every rank calls it together).
void EpGroup::Impl::init_nvlink() {
  nvl = std::make_unique<NvlinkState>();
  NvlinkState& s = *nvl;
  const int64_t H = opt.hidden, K = opt.topk, E = opt.num_experts;
  const int64_t tmax = size.max_tokens, capacity = size.capacity, row_bytes = size.row_bytes;
  const size_t esz = dtype_size(opt.dtype);
  MOEFLOW_CHECK(row_bytes % 16 == 0, "the nvlink backend needs 16-byte token rows, got hidden=", H,
                " x ", esz, " bytes");
  MOEFLOW_CHECK(E <= 2048, "the nvlink backend takes at most 2048 experts, got ", E);
  MOEFLOW_CHECK(K <= 32, "the nvlink backend takes topk <= 32, got ", K);
  MOEFLOW_CHECK(world <= nvl::kMaxRanks, "the nvlink backend takes at most ", nvl::kMaxRanks,
                " ranks, got ", world);
  MOEFLOW_CHECK(tuning.nvl_recv_regions >= 1 && tuning.nvl_recv_regions <= 16,
                "nvlink_recv_regions (MOEFLOW_NVL_REGIONS) must be in [1, 16], got ",
                tuning.nvl_recv_regions);
  MOEFLOW_CHECK(opt.nvlink_blocks >= 2 && opt.nvlink_blocks <= max_nvlink_blocks(),
                "nvlink_blocks must be in [2, ", max_nvlink_blocks(), "] (the SMs",
                simulated ? " / the simulated ranks" : "",
                ": its roles wait on each other across ranks), got ", opt.nvlink_blocks);
  MOEFLOW_CHECK(capacity < INT32_MAX && int64_t(world) * tmax < INT32_MAX,
                "the nvlink backend indexes rows with int32: capacity ", capacity,
                " and world x max_tokens_per_rank ", int64_t(world) * tmax, " must be < 2^31");
  nvl::Offsets& o = s.off;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += nvl::round_up(bytes);
    return here;
  };
  s.regions = tuning.nvl_recv_regions;
  s.held = std::make_shared<RecvRegions>();
  s.held->held.assign(size_t(s.regions - 1), 0);
  s.copies = std::make_shared<CopyBuffers>();
  s.copies->shape = {capacity, H};
  s.copies->dtype = opt.dtype;
  s.copies->device = Device::cuda(device);
  o.x_region = nvl::round_up(size_t(capacity) * row_bytes);
  o.x = take(o.x_region * size_t(s.regions));
  o.xregion = take(size_t(world) * 4);
  o.probs = take(size_t(capacity) * 4);
  o.row_src = take(size_t(capacity) * 4);
  o.row_k = take(size_t(capacity) * 4);
  o.counts = take(size_t(world) * E * 4);
  o.ntok = take(size_t(world) * 4);
  o.inv = take(size_t(world) * tmax * K * 4);
  o.stage = take(size_t(world) * tmax * std::max(row_bytes, size.grad_row_bytes));
  o.partial = take(size_t(world) * tmax * H * 4);
  o.dp = take(size_t(tmax) * K * 4);
  o.flag = take(size_t(world) * tmax * 4);
  o.epoch = take(4);
  o.scales = take(size_t(capacity) * size.scale_bytes);
  o.arrive = take(size_t(world) * 4);
  o.round = take(4);
  o.abort = take(4);
  s.bytes = at;
  s.world = world;
  s.rank = rank;
  s.timeout_ns = static_cast<unsigned long long>(tuning.timeout_s * 1e9);
  MOEFLOW_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.status_host), 2 * sizeof(int32_t),
                                   cudaHostAllocMapped));
  s.status_host[0] = s.status_host[1] = 0;
  MOEFLOW_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.status_dev),
                                              s.status_host, 0));
  if (world == 1 || simulated) {
    // NCCL gives a one-rank communicator no symmetric memory: the window is
    // plain device memory and the barriers are block-local. Simulated
    // ranks: plain device memory too, joined by create_simulated.
    s.plain = true;
    MOEFLOW_CUDA_CHECK(cudaMalloc(&s.base, s.bytes));
  } else {
    // The device API is inline code compiled against nccl_device.h: it must
    // come from the NCCL that runs (its structures change between releases).
    int version = 0;
    MOEFLOW_NCCL_CHECK(ncclGetVersion(&version));
    MOEFLOW_CHECK(version == NCCL_VERSION_CODE, "the nvlink backend was compiled against NCCL ",
                  NCCL_VERSION_CODE, " (nccl_device.h) but libnccl ", version,
                  " is loaded; build moeflow against the NCCL it runs with (MOEFLOW_NCCL_ROOT)");
    MOEFLOW_NCCL_CHECK(ncclMemAlloc(&s.base, s.bytes));
    const ncclResult_t wr =
        ncclCommWindowRegister(comm, s.base, s.bytes, &s.win, NCCL_WIN_COLL_SYMMETRIC);
    MOEFLOW_CHECK(wr == ncclSuccess, "the nvlink backend needs NCCL symmetric memory ",
                  "(all ranks CUDA peers over NVLink, cuMem enabled): ncclCommWindowRegister ",
                  "returned '", ncclGetErrorString(wr), "'; use backend nccl");
    s.have_win = true;
    ncclDevCommRequirements req{};
    req.lsaBarrierCount = 1;  // no multimem resources (NVLS stays off)
    const ncclResult_t dr = ncclDevCommCreate(comm, &req, &s.dc);
    MOEFLOW_CHECK(dr == ncclSuccess, "the nvlink backend needs the NCCL device API over ",
                  "symmetric memory: ncclDevCommCreate returned '", ncclGetErrorString(dr),
                  "' (NCCL_DEBUG=WARN says why); use backend nccl");
    s.have_dc = true;
    MOEFLOW_CHECK(s.dc.lsaSize == world && s.dc.lsaRank == rank,
                  "the nvlink backend needs all ranks in one NVLink domain: NCCL reports ",
                  s.dc.lsaSize, " of ", world, " ranks reachable (lsa rank ", s.dc.lsaRank,
                  ", rank ", rank, ")");
  }
  MOEFLOW_CUDA_CHECK(cudaMemset(s.base, 0, s.bytes));
  nvl::prepare_dispatch_kernel();
  const Device dev = Device::cuda(device);
  s.local_ids = Tensor::empty({tmax, K}, DType::kInt32, dev);
  PlanConfig lc;
  lc.num_experts = static_cast<int>(E);
  lc.align = 1;
  lc.capacity_rows = tmax * K;
  s.local = allocate_plan(tmax, static_cast<int>(K), lc, dev);
  s.local_ws = Tensor::empty(
      {static_cast<int64_t>(plan_workspace_bytes(tmax, static_cast<int>(K), lc)) + 16},
      DType::kUInt8, dev);
  s.first_row = Tensor::empty({E}, DType::kInt64, dev);
  s.fit = Tensor::empty({E}, DType::kInt64, dev);
  MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
}

namespace {

// Blocks of the home role of a fused kernel (the rest: the holder role).
int home_blocks(const EpGroup::Impl& g, int percent) {
  const int P = g.opt.nvlink_blocks * percent / 100;
  return std::clamp(P, 1, g.opt.nvlink_blocks - 1);
}
unsigned grid(const EpGroup::Impl& g) {
  return static_cast<unsigned>(g.opt.nvlink_blocks);
}

// Pad rows of this rank's receive layout (`recv`: its plan of a dispatch) in
// `rows` (stride in bytes) zeroed.
void zero_pads(EpGroup::Impl& g, const RoutingPlan& recv, uint8_t* rows, int64_t stride_bytes,
               int64_t row_bytes, float* probs, int32_t* row_src, cudaStream_t stream,
               uint8_t* scales = nullptr) {
  const nvl::Pads pads{g.size.experts_per_rank, recv.tokens_per_expert.data_ptr<int32_t>(),
                       recv.padded_tokens_per_expert.data_ptr<int32_t>(),
                       recv.expert_row_offsets.data_ptr<int64_t>()};
  nvl::launch_pads(nvl::PadsParams{rows, stride_bytes, probs, row_src, row_bytes, pads, scales,
                                   g.size.scale_bytes},
                   stream);
}

// Throws when a wait of an earlier operation timed out (read from the
// host-mapped status, no synchronisation).
void check_timeout(EpGroup::Impl& g) {
  const NvlinkState& s = *g.nvl;
  const volatile int32_t* st = s.status_host;
  if (!g.aborted && st[0] == 0) return;
  g.aborted = true;
  std::string missing;
  for (int q = 0; q < g.world; ++q)
    if ((st[1] >> q) & 1) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
  MOEFLOW_CHECK(false, "ep (nvlink) on rank ", g.rank, ": an earlier operation timed out after ",
                g.tuning.timeout_s, " s waiting for rank(s) ",
                missing.empty() ? std::string("(unknown)") : missing,
                " (EpOptions::timeout_s); the group is unusable");
}

// The fused kernel's window, roles and this rank's slots (the handle's
// dispatch).
nvl::FusedArgs fused_args(EpGroup::Impl& g, const EpHandle& handle, int home_percent,
                          bool weighted) {
  NvlinkState& s = *g.nvl;
  EpHandle::State& h = handle.state();
  nvl::FusedArgs f;
  f.win = s.view();
  f.o = s.off;
  f.P = home_blocks(g, home_percent);
  f.batch = g.tuning.nvl_batch;
  f.H = g.opt.hidden;
  f.Tn = handle.num_tokens();
  f.K = g.opt.topk;
  f.W = g.world;
  f.me = g.rank;
  f.tmax = g.size.max_tokens;
  f.dest_rank = h.dest_rank.data_ptr<int32_t>();
  f.dest_row = h.dest_row.data_ptr<int64_t>();
  f.weights = weighted ? h.home_probs.data_ptr<float>() : nullptr;
  f.inv = h.inv.data_ptr<int32_t>();
  f.ntok = h.ntok.data_ptr<int32_t>();
  f.rprobs = h.out_probs.data_ptr<float>();
  return f;
}

}  // namespace

namespace cuda {

void ep_nvlink_check(EpGroup& group) {
  check_timeout(group.impl());
}

EpDispatchResult ep_nvlink_dispatch_quantize(EpGroup& group, TensorView x, TensorView ids,
                                             TensorView probs, const QuantizeConfig& quant,
                                             cudaStream_t stream) {
  if (group.impl().tuning.nvl_quantize_in_dispatch)
    return ep_nvlink_dispatch(group, x, ids, probs, TensorView{}, &quant, stream);
  return ep_dispatch_quantize_staged(group, x, ids, probs, quant, stream);
}

EpDispatchResult ep_nvlink_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                                    TensorView scales, const QuantizeConfig* quant,
                                    cudaStream_t stream) {
  EpGroup::Impl& g = group.impl();
  NvlinkState& s = *g.nvl;
  const nvl::Offsets& o = s.off;
  const int K = g.opt.topk, W = g.world, E = g.opt.num_experts, L = g.size.experts_per_rank;
  const int64_t T = x.shape[0];
  // the rows' scales: the caller's, or those the kernel computes (quant)
  const bool with_scales = scales.defined() || quant != nullptr;
  check_timeout(g);
  EpHandle handle = g.new_handle(T, group);
  EpHandle::State& h = handle.state();
  RoutingPlan& recv = h.plan;
  g.mark("start", stream);
  // 1. the rank's slots ranked per global expert, over the caller's int32 ids
  // as they are (ids outside [-1, E) are unrouted there and counted), int64
  // ids narrowed first. The probs are copied by the dispatch kernel (combine
  // weights with them).
  const int32_t* ids32 = ids.dtype == DType::kInt32 ? ids.data_ptr<int32_t>() : nullptr;
  if (!ids32) {
    if (T * K > 0)
      nvl::launch_copy_ids(ids.data_ptr<int64_t>(), T, K, T, s.local_ids.data_ptr<int32_t>(),
                           stream);
    ids32 = s.local_ids.data_ptr<int32_t>();
  }
  {
    RoutingInput in;
    in.kind = RoutingInput::kIds32;
    in.data = ids32;
    in.num_tokens = T;
    in.topk = K;
    cuda::build_plan(in, s.local, s.local_ws, stream);
  }
  g.mark("plan", stream);
  uint8_t* base = static_cast<uint8_t*>(s.base);
  // The region of x the rows land in: a free one the handle holds, else the
  // last one, copied into the handle at the end.
  int region = s.regions - 1;
  h.region = RecvRegions::take(s.held, &region);
  uint8_t* x_rows = base + o.x + size_t(region) * o.x_region;
  // 2. counts exchanged, slot ranges, this rank's receive plan, its pad rows
  nvl::CountsParams cp;
  cp.win = s.view();
  cp.off_counts = o.counts;
  cp.off_ntok = o.ntok;
  cp.off_xregion = o.xregion;
  cp.my_xregion = region;
  cp.my_counts = s.local.tokens_per_expert.data_ptr<int32_t>();
  cp.my_T = static_cast<int32_t>(T);
  cp.E = E;
  cp.W = W;
  cp.me = g.rank;
  cp.capacity = g.size.capacity;
  cp.align = g.opt.align;
  cp.first_row = s.first_row.data_ptr<int64_t>();
  cp.fit = s.fit.data_ptr<int64_t>();
  cp.kept = recv.tokens_per_expert.data_ptr<int32_t>();
  cp.padded = recv.padded_tokens_per_expert.data_ptr<int32_t>();
  cp.offsets = recv.expert_row_offsets.data_ptr<int64_t>();
  cp.total_rows = recv.total_rows.data_ptr<int64_t>();
  cp.overflow = recv.overflow.data_ptr<int32_t>();
  cp.epoch = reinterpret_cast<int32_t*>(base + o.epoch);
  cp.invalid_src = s.local.invalid_ids.data_ptr<int32_t>();
  cp.invalid_dst = recv.invalid_ids.data_ptr<int32_t>();
  nvl::launch_counts(cp, stream);
  g.mark("counts", stream);
  // The pad rows (nothing else writes them) on the side stream, on the SMs
  // the fused kernel leaves free; the caller's stream waits at the end.
  MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_fork, stream));
  MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(g.streams.side, g.streams.ev_fork, 0));
  zero_pads(g, recv, x_rows, g.size.row_bytes, g.size.row_bytes,
            reinterpret_cast<float*>(base + o.probs), reinterpret_cast<int32_t*>(base + o.row_src),
            g.streams.side, with_scales ? base + o.scales : nullptr);
  MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_join, g.streams.side));
  // 3. the rows: own slots in place, a peer's only slot of a token straight
  // into its row there, several through the peer's stage
  const nvl::HomeArgs home{ids32,
                           probs.defined() ? probs.data_ptr<float>() : nullptr,
                           h.home_probs.data_ptr<float>(),
                           K,
                           E,
                           L,
                           W,
                           g.rank,
                           g.size.max_tokens,
                           g.size.row_bytes,
                           s.local.dest_row.data_ptr<int64_t>(),
                           s.local.expert_row_offsets.data_ptr<int64_t>(),
                           s.first_row.data_ptr<int64_t>(),
                           s.fit.data_ptr<int64_t>(),
                           h.dest_rank.data_ptr<int32_t>(),
                           h.dest_row.data_ptr<int64_t>(),
                           scales.defined() ? static_cast<const uint8_t*>(scales.data) : nullptr,
                           g.size.scale_bytes};
  nvl::DispatchParams dp{s.view(),
                         o,
                         home_blocks(g, g.tuning.nvl_home_percent),
                         g.tuning.nvl_batch,
                         static_cast<const uint8_t*>(x.data),
                         x.strides[0] * int64_t(dtype_size(x.dtype)),
                         T,
                         home};
  if (quant) {
    dp.quant.on = true;
    dp.quant.in = x.dtype;
    dp.quant.e4m3 = quant->out == DType::kFloat8E4M3;
    dp.quant.pow2 = quant->pow2_scales;
    dp.quant.hidden = g.opt.hidden;
  }
  nvl::launch_dispatch(dp, g.tuning.nvl_bulk_copies, grid(g), stream);
  MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(stream, g.streams.ev_join, 0));
  g.mark("rows", stream);
  // 4. the holder's way back and the probs move out of the window into the
  // handle (the next dispatch rewrites them), and the rows unless the handle
  // holds their region: the used rows only.
  const int64_t capacity = g.size.capacity;
  TensorView out_x;
  if (h.region) {
    out_x = TensorView(x_rows, g.opt.dtype, Device::cuda(g.device), {capacity, g.opt.hidden});
  } else {
    h.copy = CopyBuffers::take(s.copies);
    nvl::launch_copy_rows(x_rows, static_cast<uint8_t*>(h.copy->data()), g.size.row_bytes,
                          recv.total_rows.data_ptr<int64_t>(), capacity, stream);
    out_x = *h.copy;
  }
  MOEFLOW_CUDA_CHECK(cudaMemcpyAsync(h.out_probs.data(), base + o.probs, capacity * 4,
                                     cudaMemcpyDeviceToDevice, stream));
  MOEFLOW_CUDA_CHECK(cudaMemcpyAsync(h.inv.data(), base + o.inv, h.inv.nbytes(),
                                     cudaMemcpyDeviceToDevice, stream));
  MOEFLOW_CUDA_CHECK(cudaMemcpyAsync(h.ntok.data(), base + o.ntok, h.ntok.nbytes(),
                                     cudaMemcpyDeviceToDevice, stream));
  if (with_scales)
    nvl::launch_copy_rows(base + o.scales, static_cast<uint8_t*>(h.out_scales.data()),
                          g.size.scale_bytes, recv.total_rows.data_ptr<int64_t>(), capacity,
                          stream);
  g.mark("out", stream);
  g.trace.print("nvlink dispatch", g.rank);
  return EpDispatchResult{out_x, h.out_probs, with_scales ? h.out_scales.view() : TensorView{},
                          &recv, -1,          std::move(handle)};
}

void ep_nvlink_combine(EpGroup& group, const EpHandle& handle, TensorView y, bool weighted,
                       TensorView out, cudaStream_t stream) {
  EpGroup::Impl& g = group.impl();
  NvlinkState& s = *g.nvl;
  const nvl::Offsets& o = s.off;
  uint8_t* base = static_cast<uint8_t*>(s.base);
  check_timeout(g);
  g.mark("start", stream);
  nvl::launch_op_start(s.view(), reinterpret_cast<int32_t*>(base + o.epoch), stream);
  g.mark("barrier", stream);
  nvl::CombineParams p;
  p.f = fused_args(g, handle, g.tuning.nvl_combine_home_percent, weighted);
  p.y = y.data;
  p.y_stride = y.strides[0];
  p.weighted = weighted;
  p.wire_bf16 = g.opt.combine_wire_dtype == DType::kBFloat16;
  p.out = out.data;
  p.out_stride = out.strides[0];
  nvl::launch_combine(p, y.dtype, out.dtype, grid(g), stream);
  g.mark("sum", stream);
  g.trace.print("nvlink combine", g.rank);
}

void ep_nvlink_combine_backward(EpGroup& group, const EpHandle& handle, TensorView dout,
                                TensorView y, bool weighted, TensorView grad_y, TensorView dprobs,
                                cudaStream_t stream) {
  EpGroup::Impl& g = group.impl();
  NvlinkState& s = *g.nvl;
  const nvl::Offsets& o = s.off;
  const int64_t H = g.opt.hidden;
  const int K = g.opt.topk;
  const int64_t esz = int64_t(dtype_size(y.dtype));
  uint8_t* base = static_cast<uint8_t*>(s.base);
  check_timeout(g);
  nvl::launch_op_start(s.view(), reinterpret_cast<int32_t*>(base + o.epoch), stream);
  zero_pads(g, handle.state().plan, static_cast<uint8_t*>(grad_y.data), grad_y.strides[0] * esz,
            H * esz, nullptr, nullptr, stream);
  nvl::CombineBwdParams p;
  p.f = fused_args(g, handle, g.tuning.nvl_home_percent, weighted);
  p.dout = dout.data;
  p.dout_stride = dout.strides[0];
  p.y = y.data;
  p.y_stride = y.strides[0];
  p.grad_y = grad_y.data;
  p.g_stride = grad_y.strides[0];
  nvl::launch_combine_bwd(p, y.dtype, grid(g), stream);
  nvl::launch_barrier(s.view(), stream);  // every dot product has landed at home
  const int64_t T = handle.num_tokens();
  if (dprobs.defined() && T > 0)
    nvl::launch_dprobs(reinterpret_cast<const float*>(base + o.dp),
                       handle.state().dest_rank.data_ptr<int32_t>(), T * K,
                       dprobs.data_ptr<float>(), stream);
}

}  // namespace cuda
}  // namespace moeflow
