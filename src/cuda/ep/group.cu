// Expert-parallel groups: creation (from a communicator, a unique id, one
// process's GPUs, or simulated ranks on one GPU), the buffers of the nccl
// backend, the accessors, and the one place where the options and the
// MOEFLOW_* environment overrides are resolved (resolve_tuning).
//
// Every buffer is sized from the options at creation: nothing is allocated
// on the hot path. With EpOptions::nccl_register_buffers the buffers NCCL
// moves live in one ncclMemAlloc arena registered with the communicator.
// The nvlink backend's window is made by init_nvlink (nvlink.cu).
#include <nccl.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cub/device/device_scan.cuh>
#include <exception>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>

#include "core/ep_backend.h"
#include "core/internal.h"
#include "cuda/ep/group.h"
#include "moeflow/ep_reference.h"

namespace moeflow {

namespace {

// Simulated ranks (EpGroup::create_simulated) take their streams from one
// process-wide pool per GPU, made once and never destroyed: the ranks'
// kernels wait on each other, so each stream needs a hardware queue of its
// own, and streams made later in a process (after others were made and
// destroyed) were seen to share one (a rank's kernel then never started).
constexpr int kSimPool = 8;
struct SimStreams {
  cudaStream_t rank[kSimPool] = {}, side[kSimPool] = {};
};
SimStreams& sim_streams(int device) {
  static std::mutex mu;
  static std::map<int, SimStreams> pool;
  std::lock_guard<std::mutex> lock(mu);
  auto it = pool.find(device);
  if (it != pool.end()) return it->second;
  SimStreams s;
  for (int i = 0; i < kSimPool; ++i) {
    MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&s.rank[i], cudaStreamNonBlocking));
    MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&s.side[i], cudaStreamNonBlocking));
  }
  return pool.emplace(device, s).first->second;
}

// The options and their environment overrides, read here only (at group
// creation): MOEFLOW_EP_EAGER, MOEFLOW_EP_EAGER_PARTS, MOEFLOW_EP_REGISTER,
// MOEFLOW_EP_DEBUG_RANGES, MOEFLOW_EP_TRACE, MOEFLOW_NVL_BATCH,
// MOEFLOW_NVL_HOME, MOEFLOW_NVL_CHOME, MOEFLOW_NVL_TMA, MOEFLOW_NVL_REGIONS,
// MOEFLOW_NVL_QUANTIZE.
EpTuning resolve_tuning(const EpOptions& o, int world, int rank, int64_t row_bytes) {
  EpTuning t;
  t.eager_share = o.eager_share;
  if (const char* v = std::getenv("MOEFLOW_EP_EAGER")) t.eager_share = std::atof(v);
  t.eager_share = std::clamp(t.eager_share, 0.0, 0.99);
  // (more parts were slower on 2 x H100)
  if (const char* v = std::getenv("MOEFLOW_EP_EAGER_PARTS"))
    t.eager_parts = std::clamp(std::atoi(v), 1, kMaxEagerParts);
  t.first_piece_permille =
      std::clamp(static_cast<int>(std::lround(o.pipeline_first_share * 1000)), 1, 999);
  t.timeout_s = o.timeout_s;
  if (const char* v = std::getenv("MOEFLOW_EP_TIMEOUT")) t.timeout_s = std::max(0.0, std::atof(v));
  t.register_buffers = o.nccl_register_buffers;
  if (const char* v = std::getenv("MOEFLOW_EP_REGISTER")) t.register_buffers = std::atoi(v) != 0;
  t.debug_ranges = std::getenv("MOEFLOW_EP_DEBUG_RANGES") != nullptr;
  const char* tr = std::getenv("MOEFLOW_EP_TRACE");
  t.trace = tr != nullptr && tr[0] == '1' && rank == 0;
  // nvlink: long rows are announced one by one; the home role's share in
  // combine falls with the slots a rank holds of a token (K / W): the
  // holders' work grows with them, and a token with one slot there costs
  // them only a row copy (docs/ep.md).
  t.nvl_batch = row_bytes >= 12288 ? 1 : 4;
  t.nvl_combine_home_percent =
      world == 1 ? 99  // no peers: no holder work
                 : std::clamp(80 - 10 * static_cast<int>((o.topk + world - 1) / world), 55, 70);
  if (const char* v = std::getenv("MOEFLOW_NVL_BATCH"))
    t.nvl_batch = std::clamp(std::atoi(v), 1, 32);
  if (const char* v = std::getenv("MOEFLOW_NVL_HOME"))
    t.nvl_home_percent = std::clamp(std::atoi(v), 1, 99);
  t.nvl_bulk_copies = o.nvlink_bulk_copies;
  if (const char* v = std::getenv("MOEFLOW_NVL_TMA")) t.nvl_bulk_copies = std::atoi(v) != 0;
  // ep_dispatch_quantize: in the dispatch kernel when a token has several
  // rows to store (docs/ep.md, "How a token moves")
  t.nvl_quantize_in_dispatch =
      o.nvlink_quantize_in_dispatch < 0 ? o.topk >= 4 : o.nvlink_quantize_in_dispatch != 0;
  if (const char* v = std::getenv("MOEFLOW_NVL_QUANTIZE"))
    t.nvl_quantize_in_dispatch = std::atoi(v) != 0;
  t.nvl_recv_regions = o.nvlink_recv_regions;
  if (const char* v = std::getenv("MOEFLOW_NVL_REGIONS")) t.nvl_recv_regions = std::atoi(v);
  if (const char* v = std::getenv("MOEFLOW_NVL_CHOME"))
    t.nvl_combine_home_percent = std::clamp(std::atoi(v), 1, 99);
  return t;
}

}  // namespace

// --- Trace (MOEFLOW_EP_TRACE) --------------------------------------------------
void EpTrace::mark(const std::string& what, cudaStream_t s) {
  if (!on) return;
  if (used == marks.size()) {
    cudaEvent_t e;
    MOEFLOW_CUDA_CHECK(cudaEventCreate(&e));
    marks.push_back({"", e});
  }
  marks[used].first = what;
  MOEFLOW_CUDA_CHECK(cudaEventRecord(marks[used++].second, s));
}

void EpTrace::host_mark(const std::string& what) {
  if (!on) return;
  if (host_stream == nullptr)
    MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&host_stream, cudaStreamNonBlocking));
  mark(what, host_stream);
}

void EpTrace::print(const char* op, int rank) {
  if (!on || used == 0) return;
  for (size_t i = 0; i < used; ++i) MOEFLOW_CUDA_CHECK(cudaEventSynchronize(marks[i].second));
  std::string line = std::string(op) + " trace (rank " + std::to_string(rank) + "):";
  for (size_t i = 1; i < used; ++i) {
    float ms = 0;
    MOEFLOW_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[0].second, marks[i].second));
    line += " " + marks[i].first + " " + std::to_string(static_cast<int>(ms * 1000));
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  used = 0;
}

// --- EpGroup::Impl ----------------------------------------------------------------
EpGroup::Impl::~Impl() {
  // Work of this group may still run (NCCL on the nccl stream, kernels on the
  // callers' streams): let it finish before buffers are deregistered and
  // freed (cudaFree would have waited; ncclMemFree does not).
  // Everything below on the group's device; the caller's is current again at the end.
  const int cur = detail::exchange_device(device);
  // (after a timeout the work of a caller's communicator never ends: not waited for)
  if (!aborted) cudaDeviceSynchronize();
  EpStreams& st = streams;
  for (cudaEvent_t e : {st.ev_start, st.ev_counts, st.ev_fork, st.ev_join, st.ev_scales})
    if (e) cudaEventDestroy(e);
  for (auto& m : trace.marks) cudaEventDestroy(m.second);
  for (cudaEvent_t* arr : {st.ev_piece, st.ev_back, st.ev_packed})
    for (int i = 0; i < kMaxChunks; ++i)
      if (arr[i]) cudaEventDestroy(arr[i]);
  for (int i = 0; i < kMaxEagerParts; ++i)
    for (cudaEvent_t e : {st.ev_eager_packed[i], st.ev_eager_sent[i]})
      if (e) cudaEventDestroy(e);
  if (st.nccl) cudaStreamDestroy(st.nccl);
  if (trace.host_stream) cudaStreamDestroy(trace.host_stream);
  if (st.side && !simulated) cudaStreamDestroy(st.side);  // (pooled when simulated)
  if (buf.host_counts) cudaFreeHost(buf.host_counts);
  // The window and the device communicator go with an owned communicator
  // (deregistering them one group after the other from one thread could
  // wait on the peers); on a caller's communicator they are released here.
  if (nvl && !owns_comm) nvl->release(comm);
  // An owned communicator drops its registrations when destroyed; the
  // arena itself goes (ncclMemFree) with the last tensor over it.
  if (buf.arena_handle && !owns_comm) ncclCommDeregister(comm, buf.arena_handle);
  if (owns_comm && comm) ncclCommDestroy(comm);
  if (nvl && nvl->status_host) cudaFreeHost(nvl->status_host);
  if (nvl && nvl->base) {
    if (nvl->plain)
      cudaFree(nvl->base);
    else
      ncclMemFree(nvl->base);
  }
  detail::restore_device(cur);
}

void EpGroup::Impl::init(ncclComm_t c, bool owns, const EpOptions& o) {
  comm = c;
  owns_comm = owns;
  MOEFLOW_NCCL_CHECK(ncclCommUserRank(comm, &rank));
  MOEFLOW_NCCL_CHECK(ncclCommCount(comm, &world));
  init_common(o);
}

// Rank r of `w` simulated ranks on the current GPU (create_simulated): no
// communicator; the nvlink backend's windows are plain device memory.
void EpGroup::Impl::init_simulated(int r, int w, const EpOptions& o) {
  simulated = true;
  rank = r;
  world = w;
  init_common(o);
}

void EpGroup::Impl::init_common(const EpOptions& o) {
  opt = o;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&device));
  MOEFLOW_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  check_ep_options(o, world);
  EpSizes& z = size;
  z.grad_dtype = dtype_is_arith_float(o.dtype) ? o.dtype : o.backward_dtype;
  z.scale_bytes = o.scale_cols * static_cast<int64_t>(dtype_size(o.scale_dtype));
  z.experts_per_rank = o.num_experts / world;
  z.max_tokens = std::max<int64_t>(o.max_tokens_per_rank, 1);
  z.max_recv_rows = z.max_tokens * world;
  z.max_send_rows = z.max_tokens * std::min(o.topk, world);
  ep_reference::EpConfig rc{world, o.num_experts, o.align, o.max_tokens_per_rank, o.capacity_rows};
  z.capacity = ep_reference::recv_capacity_rows(rc, o.topk);
  z.row_bytes = o.hidden * static_cast<int64_t>(dtype_size(o.dtype));
  z.grad_row_bytes = o.hidden * static_cast<int64_t>(dtype_size(z.grad_dtype));
  tuning = resolve_tuning(o, world, rank, z.row_bytes);
  handles = std::make_shared<EpHandlePool>();
  handles->make = [this] { return make_handle_state(); };  // (called by dispatch only)
  trace.on = tuning.trace;
  const Device dev = Device::cuda(device);
  const int64_t rows_max = z.max_recv_rows;
  size_t scan_bytes = 0;
  MOEFLOW_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes,
                                                   static_cast<const int32_t*>(nullptr),
                                                   static_cast<int32_t*>(nullptr),
                                                   2 * (rows_max + 1)));
  buf.scan_workspace = Tensor::empty({static_cast<int64_t>(scan_bytes) + 16}, DType::kUInt8, dev);
  buf.route_counts = Tensor::empty({4 * world * kMaxChunks + 1}, DType::kInt32, dev);
  buf.own_row_token = Tensor::empty({z.max_tokens}, DType::kInt32, dev);
  MOEFLOW_CUDA_CHECK(
      cudaMallocHost(&buf.host_counts, sizeof(int32_t) * (4 * world * kMaxChunks + 1)));
  z.eager_max_rows =
      world > 1 ? static_cast<int64_t>(std::ceil(tuning.eager_share * z.max_tokens)) : 0;
  z.eager_total_rows =
      world > 1 ? static_cast<int64_t>(
                      std::ceil(tuning.eager_share * z.max_tokens * std::min(o.topk, world - 1)))
                : 0;
  if (o.backend == EpBackend::kNccl) allocate_nccl_buffers(dev);
  const bool quantizes = (o.dtype == DType::kFloat8E4M3 || o.dtype == DType::kFloat8E5M2) &&
                         o.scale_cols == (o.hidden + 127) / 128 && o.scale_dtype == DType::kFloat32;
  if (o.backend == EpBackend::kNvlink && quantizes && !tuning.nvl_quantize_in_dispatch) {
    quant_x = Tensor::empty({z.max_tokens, o.hidden}, o.dtype, dev);
    quant_scales = Tensor::empty({z.max_tokens, o.scale_cols}, DType::kFloat32, dev);
  }
  // The highest priority: NCCL's blocks get the SMs first when the permute
  // kernels that run beside the transfers free them.
  // (The nvlink backend uses no NCCL stream.)
  int lo = 0, hi = 0;
  MOEFLOW_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  if (o.backend == EpBackend::kNccl)
    MOEFLOW_CUDA_CHECK(cudaStreamCreateWithPriority(&streams.nccl, cudaStreamNonBlocking, hi));
  if (simulated)
    streams.side = sim_streams(device).side[rank];
  else
    MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&streams.side, cudaStreamNonBlocking));
  EpStreams& st = streams;
  for (int i = 0; i < kMaxEagerParts; ++i)
    for (cudaEvent_t* e : {&st.ev_eager_packed[i], &st.ev_eager_sent[i]})
      MOEFLOW_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  for (cudaEvent_t* e : {&st.ev_start, &st.ev_counts, &st.ev_fork, &st.ev_join, &st.ev_scales})
    MOEFLOW_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  for (cudaEvent_t* arr : {st.ev_piece, st.ev_back, st.ev_packed})
    for (int i = 0; i < kMaxChunks; ++i)
      MOEFLOW_CUDA_CHECK(cudaEventCreateWithFlags(&arr[i], cudaEventDisableTiming));
}

// The staging buffers and the receive plan of the nccl backend.
void EpGroup::Impl::allocate_nccl_buffers(const Device& dev) {
  const int64_t K = opt.topk, H = opt.hidden;
  const int64_t send_max = size.max_send_rows, rows_max = size.max_recv_rows;
  // What NCCL sends and receives: registered (one arena) or plain.
  struct Buf {
    Tensor* t;
    std::vector<int64_t> shape;
    DType dtype;
  };
  const Buf bufs[] = {
      {&buf.send_x, {send_max, H}, wide_dtype()},
      {&buf.recv_x, {rows_max, H}, wide_dtype()},
      {&buf.held_partials, {rows_max, H}, DType::kFloat32},
      {&buf.home_partials, {send_max, H}, DType::kFloat32},
      {&buf.recv_dprobs, {rows_max, K}, DType::kFloat32},
      {&buf.back_dprobs, {send_max, K}, DType::kFloat32},
      {&buf.send_scales, {send_max, opt.scale_cols}, opt.scale_dtype},
      {&buf.recv_scales, {rows_max, opt.scale_cols}, opt.scale_dtype},
      {&buf.routes, {world, ep_nccl::route_words(size.max_tokens, opt.topk)}, DType::kInt32},
      {&buf.eager_x, {size.eager_total_rows, H}, opt.dtype}};
  bool reg = tuning.register_buffers;
  if (reg && world > 1) {
    std::vector<size_t> off;
    size_t at = 0;
    for (const Buf& b : bufs) {
      off.push_back(at);
      at += (TensorView(nullptr, b.dtype, dev, b.shape).nbytes() + 255) / 256 * 256;
    }
    void* base = nullptr;
    if (ncclMemAlloc(&base, at) == ncclSuccess && base != nullptr) {
      std::shared_ptr<void> owner(base, [](void* p) { ncclMemFree(p); });
      MOEFLOW_NCCL_CHECK(ncclCommRegister(comm, base, at, &buf.arena_handle));
      if (tuning.debug_ranges) {  // diagnostics: where each buffer of the arena lies
        std::fprintf(stderr, "[ep rank %d] arena %p, %zu bytes:", rank, base, at);
        for (size_t i = 0; i < std::size(bufs); ++i)
          std::fprintf(stderr, " %zu@+%zu",
                       TensorView(nullptr, bufs[i].dtype, dev, bufs[i].shape).nbytes(), off[i]);
        std::fprintf(stderr, "\n");
      }
      for (size_t i = 0; i < std::size(bufs); ++i)
        *bufs[i].t = Tensor::adopt(
            TensorView(static_cast<uint8_t*>(base) + off[i], bufs[i].dtype, dev, bufs[i].shape),
            owner);
    } else {
      // No cuMem allocations here: plain buffers, NCCL's own FIFOs.
      cudaGetLastError();
      reg = false;
    }
  }
  if (!reg || world <= 1) {
    for (const Buf& b : bufs) *b.t = Tensor::empty(b.shape, b.dtype, dev);
  }
  buf.recv_flags = Tensor::empty({2 * (rows_max + 1)}, DType::kInt32, dev);
  buf.recv_flag_scan = Tensor::empty({2 * (rows_max + 1)}, DType::kInt32, dev);
  buf.recv_scan_workspace = Tensor::empty({buf.scan_workspace.numel()}, DType::kUInt8, dev);
  PlanConfig pc;
  pc.num_experts = size.experts_per_rank;
  pc.align = opt.align;
  pc.capacity_rows = size.capacity;
  buf.plan_workspace =
      Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(rows_max, opt.topk, pc)) + 16},
                    DType::kUInt8, dev);
}

// --- Dispatch states (EpHandle) -----------------------------------------------------
// One dispatch's buffers, sized from the options like the group's.
std::unique_ptr<EpHandle::State> EpGroup::Impl::make_handle_state() const {
  auto st = std::make_unique<EpHandle::State>();
  const Device dev = Device::cuda(device);
  const int64_t K = opt.topk, H = opt.hidden, cap = size.capacity;
  const int64_t rows_max = size.max_recv_rows, send_max = size.max_send_rows;
  PlanConfig pc;
  pc.num_experts = size.experts_per_rank;
  pc.align = opt.align;
  pc.capacity_rows = cap;
  if (opt.backend == EpBackend::kNccl) {
    st->token_flags = Tensor::empty({2 * (rows_max + 1)}, DType::kInt32, dev);
    st->token_rows = Tensor::empty({2 * (rows_max + 1)}, DType::kInt32, dev);
    st->send_ids = Tensor::empty({send_max, K}, DType::kInt32, dev);
    st->send_probs = Tensor::empty({send_max, K}, DType::kFloat32, dev);
    st->recv_ids = Tensor::empty({rows_max, K}, DType::kInt32, dev);
    st->recv_probs = Tensor::empty({rows_max, K}, DType::kFloat32, dev);
    st->recv_single = Tensor::empty({rows_max + 1}, DType::kInt32, dev);
    st->recv_single_pos = Tensor::empty({rows_max + 1}, DType::kInt32, dev);
    st->plan = allocate_plan(rows_max, opt.topk, pc, dev);
  } else {
    const int64_t tmax = size.max_tokens;
    st->dest_rank = Tensor::empty({tmax, K}, DType::kInt32, dev);
    st->dest_row = Tensor::empty({tmax, K}, DType::kInt64, dev);
    st->home_probs = Tensor::empty({tmax, K}, DType::kFloat32, dev);
    st->inv = Tensor::empty({world, tmax, K}, DType::kInt32, dev);
    st->ntok = Tensor::empty({world}, DType::kInt32, dev);
    st->plan = allocate_plan(1, opt.topk, pc, dev);
  }
  if (opt.backend == EpBackend::kNccl) st->out_x = Tensor::empty({cap, H}, opt.dtype, dev);
  st->out_probs = Tensor::empty({cap}, DType::kFloat32, dev);
  st->out_scales = Tensor::empty({cap, opt.scale_cols}, opt.scale_dtype, dev);
  return st;
}

std::shared_ptr<EpHandle::State> EpHandlePool::acquire(const std::shared_ptr<EpHandlePool>& pool) {
  std::unique_ptr<EpHandle::State> st;
  {
    std::lock_guard<std::mutex> lock(pool->mutex);
    if (!pool->free.empty()) {
      st = std::move(pool->free.back());
      pool->free.pop_back();
    }
  }
  if (!st) {  // more dispatches in flight than ever before: a new state
    st = pool->make();
    std::lock_guard<std::mutex> lock(pool->mutex);
    ++pool->made;
  }
  // NOTE: a state goes back when its last handle goes; work enqueued with it
  // is ordered before the next dispatch that takes it (the group's
  // operations run in one order on every rank, on the caller's stream).
  return std::shared_ptr<EpHandle::State>(st.release(), [pool](EpHandle::State* p) {
    p->region.reset();  // (its window region or copy buffer is free for the next dispatch)
    p->copy.reset();
    std::lock_guard<std::mutex> lock(pool->mutex);
    pool->free.emplace_back(p);
  });
}

EpHandle EpGroup::Impl::new_handle(int64_t num_tokens, const EpGroup& group) {
  return EpHandle(EpHandlePool::acquire(handles), &group, num_tokens);
}

// --- EpGroup ------------------------------------------------------------------------
EpGroup::EpGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EpGroup::~EpGroup() = default;
int EpGroup::rank() const {
  return impl_->rank;
}
int EpGroup::world_size() const {
  return impl_->world;
}
bool EpGroup::nccl_buffers_registered() const {
  return impl_->buf.arena_handle != nullptr;
}
int EpGroup::local_experts() const {
  return impl_->size.experts_per_rank;
}
Device EpGroup::device() const {
  return Device::cuda(impl_->device);
}
int64_t EpGroup::capacity_rows() const {
  return impl_->size.capacity;
}
const EpOptions& EpGroup::options() const {
  return impl_->opt;
}
void EpGroup::set_nvlink_blocks(int blocks) {
  MOEFLOW_CHECK(blocks >= 2 && blocks <= impl_->max_nvlink_blocks(),
                "nvlink_blocks must be in [2, ", impl_->max_nvlink_blocks(),
                "] (the SMs: its roles wait on each other across ranks), got ", blocks);
  impl_->opt.nvlink_blocks = blocks;
}
void EpGroup::set_combine_wire_dtype(DType wire) {
  check_combine_wire(wire, impl_->opt.hidden);
  impl_->opt.combine_wire_dtype = wire;
}
void EpGroup::set_overlap_blocks(int blocks) {
  MOEFLOW_CHECK(blocks >= 0, "overlap_blocks must be >= 0, got ", blocks);
  impl_->opt.overlap_blocks = blocks;
}
void EpGroup::set_pipeline_chunks(int chunks) {
  MOEFLOW_CHECK(chunks >= 1 && chunks <= kMaxChunks, "pipeline_chunks must be in [1, ", kMaxChunks,
                "], got ", chunks);
  impl_->opt.pipeline_chunks = chunks;
}
cudaStream_t EpGroup::simulated_stream() const {
  return impl_->simulated ? sim_streams(impl_->device).rank[impl_->rank] : nullptr;
}
ncclComm* EpGroup::nccl_comm() const {
  return impl_->comm;
}
void EpGroup::check() {
  if (impl_->opt.backend == EpBackend::kNvlink) return cuda::ep_nvlink_check(*this);
  MOEFLOW_CHECK(!impl_->aborted, "ep (nccl) on rank ", impl_->rank,
                ": a dispatch timed out (EpOptions::timeout_s); the group is unusable");
}
const std::vector<int64_t>& EpGroup::last_send_rows() const {
  return impl_->prev_send_rows;
}
const std::vector<int64_t>& EpGroup::last_recv_rows() const {
  return impl_->prev_recv_rows;
}

std::unique_ptr<EpGroup> EpGroup::from_comm(ncclComm* comm, const EpOptions& options) {
  MOEFLOW_CHECK(comm != nullptr, "comm must be an NCCL communicator, got null");
  int dev = -1;
  MOEFLOW_NCCL_CHECK(ncclCommCuDevice(comm, &dev));
  const detail::DeviceGuard guard(Device::cuda(dev));  // the group lives on the comm's GPU
  auto impl = std::make_unique<Impl>();
  impl->init(comm, false, options);
  if (options.backend == EpBackend::kNvlink) impl->init_nvlink();
  return std::unique_ptr<EpGroup>(new EpGroup(std::move(impl)));
}

std::array<char, 128> EpGroup::new_unique_id() {
  ncclUniqueId id;
  MOEFLOW_NCCL_CHECK(ncclGetUniqueId(&id));
  std::array<char, 128> out{};
  static_assert(sizeof(id.internal) == 128, "NCCL unique ids are 128 bytes");
  std::memcpy(out.data(), id.internal, 128);
  return out;
}

std::unique_ptr<EpGroup> EpGroup::from_unique_id(const std::array<char, 128>& id, int rank,
                                                 int world_size, const EpOptions& options,
                                                 int device) {
  MOEFLOW_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
                "rank must be in [0, world_size=", world_size, "), got ", rank);
  if (device >= 0) {  // the caller's device is current again afterwards
    const detail::DeviceGuard guard(Device::cuda(device));
    return from_unique_id(id, rank, world_size, options, -1);
  }
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), 128);
  ncclComm_t comm = nullptr;
  MOEFLOW_NCCL_CHECK(ncclCommInitRank(&comm, world_size, uid, rank));
  auto impl = std::make_unique<Impl>();
  try {
    impl->init(comm, true, options);
    if (options.backend == EpBackend::kNvlink) impl->init_nvlink();
  } catch (...) {
    const bool owned = impl->owns_comm;  // then ~Impl destroys the communicator
    impl.reset();
    if (!owned) ncclCommDestroy(comm);
    throw;
  }
  return std::unique_ptr<EpGroup>(new EpGroup(std::move(impl)));
}

std::vector<std::unique_ptr<EpGroup>> EpGroup::create_local(const std::vector<int>& devices,
                                                            const EpOptions& options) {
  const int n = static_cast<int>(devices.size());
  MOEFLOW_CHECK(n >= 1 && n <= cuda_device_count(), "create_local needs 1..", cuda_device_count(),
                " devices, got ", n);
  std::vector<ncclComm_t> comms(n);
  {  // NCCL switches devices and back to the one current: one of the group's
    const detail::DeviceGuard guard(Device::cuda(devices[0]));
    MOEFLOW_NCCL_CHECK(ncclCommInitAll(comms.data(), n, devices.data()));
  }
  std::vector<std::unique_ptr<EpGroup>> groups;
  for (int i = 0; i < n; ++i) {
    const detail::DeviceGuard guard(Device::cuda(devices[i]));
    auto impl = std::make_unique<Impl>();
    impl->init(comms[i], true, options);
    groups.push_back(std::unique_ptr<EpGroup>(new EpGroup(std::move(impl))));
  }
  if (options.backend == EpBackend::kNvlink)  // collective: one thread per rank
    run_local(groups, [&](int r) { groups[r]->impl().init_nvlink(); });
  return groups;
}

std::vector<std::unique_ptr<EpGroup>> EpGroup::create_simulated(int world_size, int device,
                                                                const EpOptions& options) {
  MOEFLOW_CHECK(options.backend == EpBackend::kNvlink,
                "create_simulated simulates the nvlink backend only (NCCL puts no two ranks on "
                "one GPU), got backend nccl");
  MOEFLOW_CHECK(world_size >= 2 && world_size <= nvl::kMaxSimRanks, "world_size must be in [2, ",
                nvl::kMaxSimRanks, "], got ", world_size);
  MOEFLOW_CHECK(device >= 0 && device < cuda_device_count(), "device must be in [0, ",
                cuda_device_count(), "), got ", device);
  // With lazy module loading, launching a kernel for the first time may wait
  // for the whole GPU, where another rank's kernel spins until this one runs.
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  MOEFLOW_CHECK(loading && std::string(loading) == "EAGER",
                "create_simulated needs CUDA_MODULE_LOADING=EAGER in the environment before CUDA "
                "starts (a kernel loaded lazily while another rank's kernel waits for it can "
                "deadlock the GPU), got ",
                loading ? loading : "(unset: lazy)");
  // Every rank's streams (its caller's, the group's side stream) on their own hardware
  // queue: a kernel queued behind another rank's waiting kernel would never run.
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int need = 2 * kSimPool + 1;
  MOEFLOW_CHECK(conn && std::atoi(conn) >= need,
                "create_simulated needs CUDA_DEVICE_MAX_CONNECTIONS >= ", need,
                " (its pool of 2 streams per rank + the default stream, each on its own hardware "
                "queue; the "
                "maximum is 32) in the environment before CUDA starts, got ",
                conn ? conn : "(unset: 8)");
  const detail::DeviceGuard guard(Device::cuda(device));
  sim_streams(device);  // the pool first, before anything else makes streams
  void* bar = nullptr;
  MOEFLOW_CUDA_CHECK(cudaMalloc(&bar, 2 * sizeof(unsigned)));
  std::shared_ptr<void> shared_bar(bar, [device](void* p) { detail::cuda_free(p, device); });
  MOEFLOW_CUDA_CHECK(cudaMemset(bar, 0, 2 * sizeof(unsigned)));
  std::vector<std::unique_ptr<EpGroup>> groups;
  std::vector<uint8_t*> bases;
  for (int r = 0; r < world_size; ++r) {
    auto impl = std::make_unique<Impl>();
    impl->init_simulated(r, world_size, options);
    impl->init_nvlink();
    bases.push_back(static_cast<uint8_t*>(impl->nvl->base));
    groups.push_back(std::unique_ptr<EpGroup>(new EpGroup(std::move(impl))));
  }
  for (auto& g : groups) {
    g->impl().nvl->sim_bar = shared_bar;
    g->impl().nvl->sim_bases = bases;
  }
  return groups;
}

void EpGroup::run_local(const std::vector<std::unique_ptr<EpGroup>>& groups,
                        const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(groups.size());
  for (size_t i = 0; i < groups.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        MOEFLOW_CUDA_CHECK(cudaSetDevice(groups[i]->device().index));
        fn(static_cast<int>(i));
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace moeflow
