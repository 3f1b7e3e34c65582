// The state of an expert-parallel group (EpGroup::Impl), in named parts:
// the options resolved at creation, the sizes that follow from them, the
// nccl backend's buffers, the streams and events, what the last dispatch
// left for combine, the step trace, and the nvlink backend's window.
// Internal: included by the .cu files of src/cuda/ep/ only.
//   group.cu   creation, buffers, accessors, options and environment
//   nccl.cu    backend nccl      nvlink.cu  backend nvlink
#pragma once

#include <nccl.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/ep/api.cuh"
#include "moeflow/ep.h"
#include "moeflow/plan.h"

#define MOEFLOW_NCCL_CHECK(expr)                                                             \
  do {                                                                                       \
    const ncclResult_t r_ = (expr);                                                          \
    MOEFLOW_CHECK(r_ == ncclSuccess, "NCCL error in ", #expr, ": ", ncclGetErrorString(r_)); \
  } while (0)

namespace moeflow {

using ep_nccl::EagerRows;
using ep_nccl::kMaxChunks;
using ep_nccl::kMaxWorld;

// EpOptions with the MOEFLOW_* environment overrides applied: read once, at
// group creation (resolve_tuning in group.cu), never on the hot path.
struct EpTuning {
  double eager_share = 0.0;           // eager_share or MOEFLOW_EP_EAGER, clamped to [0, 0.99]
  int eager_parts = 1;                // parts of the eager piece (MOEFLOW_EP_EAGER_PARTS, 1..4)
  int first_piece_permille = 500;     // pipeline_first_share per mille (piece_start's split)
  double timeout_s = 300.0;           // timeout_s or MOEFLOW_EP_TIMEOUT (0: none)
  bool register_buffers = true;       // nccl_register_buffers or MOEFLOW_EP_REGISTER
  bool debug_ranges = false;          // MOEFLOW_EP_DEBUG_RANGES: print the arena and exchanges
  bool trace = false;                 // MOEFLOW_EP_TRACE=1, rank 0: print each step's time
  int nvl_batch = 4;                  // tokens a warp announces together (MOEFLOW_NVL_BATCH)
  int nvl_home_percent = 60;          // the home role's share of nvlink_blocks (MOEFLOW_NVL_HOME)
  int nvl_combine_home_percent = 50;  // the same in combine, by K / W (MOEFLOW_NVL_CHOME)
  bool nvl_bulk_copies = false;       // nvlink_bulk_copies or MOEFLOW_NVL_TMA
  bool nvl_quantize_in_dispatch = true;  // nvlink_quantize_in_dispatch or MOEFLOW_NVL_QUANTIZE
  int nvl_recv_regions = 2;           // nvlink_recv_regions or MOEFLOW_NVL_REGIONS
};
constexpr int kMaxEagerParts = 4;  // parts of the eager piece at most

// Sizes that follow from the options (host values, fixed at creation).
struct EpSizes {
  int experts_per_rank = 0;             // L = E / W: the local experts
  int64_t max_tokens = 0;               // tmax: max_tokens_per_rank, at least 1
  int64_t max_recv_rows = 0;            // W x tmax: a row per (source rank, token)
  int64_t max_send_rows = 0;            // tmax x min(K, W): a row per (token, destination rank)
  int64_t capacity = 0;                 // rows of the dispatch result (ep_reference)
  int64_t row_bytes = 0;                // a token row: H x the token dtype
  DType grad_dtype = DType::kBFloat16;  // combine_backward's rows: the token dtype unless FP8
  int64_t grad_row_bytes = 0;           // H x grad_dtype
  int64_t scale_bytes = 0;              // a token's scales: scale_cols x scale_dtype
  int64_t eager_max_rows = 0;           // eager rows per peer at most: ceil(eager_share x tmax)
  int64_t eager_total_rows = 0;  // the eager send buffer: ceil(eager_share x tmax x min(K, W-1))
};

// The device buffers of the nccl backend (those up to recv_single_pos are
// allocated for both backends, the rest by allocate_nccl_buffers).
struct NcclBuffers {
  Tensor scan_workspace;            // the token flags' scan (EpHandle::State::token_rows)
  Tensor route_counts;             // both sides' rows per peer and piece (launch_route_counts)
  int32_t* host_counts = nullptr;  // pinned copy of route_counts (the host sync)
  Tensor own_row_token;            // [tmax]: the token of this rank's j-th own row
  // Staging buffers NCCL moves (one registered arena, or plain).
  Tensor send_x, recv_x;
  Tensor held_partials;             // holder side of combine: float32 partials, then single rows
  Tensor home_partials;             // home side: the partials (and single rows) that came back
  Tensor recv_dprobs, back_dprobs;  // combine backward
  Tensor send_scales, recv_scales, out_scales;  // scale_cols > 0
  // Every rank's routing message ([W][route_words], this rank's own in its
  // slot, sent from there), the receiver's flags over them, their scan and
  // its workspace.
  Tensor routes, recv_flags, recv_flag_scan, recv_scan_workspace;
  Tensor eager_x;         // the eager piece's send rows (eager_total_rows)
  Tensor plan_workspace;  // build_plan's over the received ids
  void* arena_handle = nullptr;  // ncclCommRegister handle of the arena (null: plain buffers)
};

// What a dispatch of the nccl backend leaves for combine and the backward
// functions (host values). Piece c holds the home tokens [piece_start(c),
// piece_start(c+1)) of each rank; rows of piece c to / from rank q start at
// *_piece[q*(C+1) + c] inside q's range.
struct LastDispatch {
  int64_t num_tokens = 0;                                               // T of this rank
  int64_t received_rows = 0;                                            // rows that arrived
  std::vector<int64_t> send_offset, send_rows, recv_offset, recv_rows;  // per rank
  int pieces = 1;
  std::vector<int64_t> send_piece, recv_piece;
  // combine's way back, split into float32 partials and single rows:
  // offsets per rank and piece prefixes, like the above. The single rows
  // sit after the partial rows in held_partials (holder) and home_partials.
  std::vector<int64_t> back_partial_offset, back_partial_piece;  // home side
  std::vector<int64_t> back_single_offset, back_single_piece;
  std::vector<int64_t> held_partial_offset, held_partial_piece;  // holder side
  std::vector<int64_t> held_single_offset, held_single_piece;
  int64_t back_partial_rows = 0, held_partial_rows = 0;
  // The eager piece's rows per peer (from the previous dispatch's counts,
  // the same number on both sides of a pair) and each peer's start in the
  // eager send buffer.
  EagerRows eager_send{}, eager_recv{}, eager_offset{};
};

// NCCL runs on `nccl` (highest priority); `side` runs work beside the
// caller's stream (dispatch's receiver-side pass, nvlink's pad rows).
struct EpStreams {
  cudaStream_t nccl = nullptr, side = nullptr;
  cudaEvent_t ev_start = nullptr;   // the caller's work before the operation
  cudaEvent_t ev_counts = nullptr;  // the counts copied to the host
  cudaEvent_t ev_fork = nullptr;    // work the side stream starts after
  cudaEvent_t ev_join = nullptr;    // the side stream's work done
  cudaEvent_t ev_scales = nullptr;  // the scales arrived
  cudaEvent_t ev_eager_packed[kMaxEagerParts] = {}, ev_eager_sent[kMaxEagerParts] = {};
  cudaEvent_t ev_piece[kMaxChunks] = {};   // dispatch: piece c arrived; combine: summed
  cudaEvent_t ev_back[kMaxChunks] = {};    // combine: piece c's partials back home
  cudaEvent_t ev_packed[kMaxChunks] = {};  // dispatch: piece c's rows packed
};

// MOEFLOW_EP_TRACE: when each step of a dispatch / combine finished on the
// GPU (us after the step began), printed by rank 0, for tuning the pipeline.
struct EpTrace {
  bool on = false;
  std::vector<std::pair<std::string, cudaEvent_t>> marks;
  size_t used = 0;
  // The host's progress in GPU time: an event recorded on an idle stream
  // completes as soon as the GPU sees it.
  cudaStream_t host_stream = nullptr;
  void mark(const std::string& what, cudaStream_t s);
  void host_mark(const std::string& what);
  void print(const char* op, int rank);
};

// Which regions of received rows in the nvlink window are held by a
// handle (the last one is never held: it receives when none is free).
// Shared with the handles' tokens, which may outlive the group.
struct RecvRegions {
  std::mutex mutex;
  std::vector<char> held;  // [regions - 1]
  // A free region, held until the returned token goes; null when none is.
  static std::shared_ptr<void> take(const std::shared_ptr<RecvRegions>& r, int* region);
};

// Rows a dispatch copied out of the window (no region was free), in
// buffers of [capacity, H] reused across dispatches: one is made only when
// more dispatches than ever before hold a copy at once, so a CUDA graph
// capture after a warm-up with the same dispatches in flight makes none.
// Shared with the handles' tokens, which may outlive the group.
struct CopyBuffers {
  std::mutex mutex;
  std::vector<Tensor> free;
  std::vector<int64_t> shape;
  DType dtype = DType::kBFloat16;
  Device device{};
  static std::shared_ptr<Tensor> take(const std::shared_ptr<CopyBuffers>& b);
};

// The nvlink backend's window and the buffers of its device-side layout.
struct NvlinkState {
  void* base = nullptr;  // the symmetric allocation (ncclMemAlloc; cudaMalloc when plain)
  size_t bytes = 0;
  bool plain = false;  // one rank or simulated: plain device memory, no NCCL window
  ncclWindow_t win{};
  ncclDevComm dc{};
  bool have_win = false, have_dc = false;
  nvl::Offsets off{};
  Tensor local_ids;   // [tmax, K] int32
  RoutingPlan local;  // over the E global experts, align 1, nothing dropped
  Tensor local_ws;
  Tensor first_row, fit;       // [E] int64
  int regions = 1;             // regions of received rows (EpOptions::nvlink_recv_regions)
  std::shared_ptr<RecvRegions> held;
  std::shared_ptr<CopyBuffers> copies;

  // Simulated ranks (EpGroup::create_simulated): the barrier words shared by
  // the group's ranks and every rank's window.
  std::shared_ptr<void> sim_bar;
  std::vector<uint8_t*> sim_bases;

  // Timeouts: the host-mapped status the kernels write (nvl::Window).
  int world = 1, rank = 0;
  unsigned long long timeout_ns = 0;
  int32_t* status_host = nullptr;
  int32_t* status_dev = nullptr;

  nvl::Window view() const;
  // The device communicator and the window (the memory is freed by the owner).
  void release(ncclComm_t comm);
};

// The state of one dispatch (EpHandle): its result and its way back. Made
// by EpHandlePool::make for the group's backend, reused across dispatches.
struct EpHandle::State {
  // Backend nccl. [flags | single] of the dispatch, each W*T + 1 entries
  // (launch_send_flags), and their one exclusive scan: each (q, t)'s send
  // row, then the single rows' prefix offset by the flags' total
  // (token_rows[W*T]). single[q*T + t]: token t has one slot on peer q
  // (combine sends that row of y home instead of a float32 partial).
  Tensor token_flags, token_rows;
  Tensor send_ids, send_probs;     // [send rows, K]: the local ids / probs of each sent row
  Tensor recv_ids, recv_probs;     // [recv rows, K]: the same of each received row
  Tensor recv_single, recv_single_pos;  // the single flag and its scan over the received rows
  RoutingPlan plan;                // the receive plan of the local experts
  LastDispatch last;               // the host-side way back
  // Backend nvlink: where this rank's slots went, their probs, and what the
  // holder side of combine reads (copied out of the window after dispatch).
  Tensor dest_rank, dest_row;  // [tmax, K]
  Tensor home_probs;           // [tmax, K] float32: the slots' probs (combine weights at home)
  Tensor inv, ntok;            // [W, tmax, K] / [W] int32: the window's inv and ntok
  // Both: the result rows (nvlink: probs are also the holder's weights; no
  // x, which is the region below or the copy).
  Tensor out_x, out_probs, out_scales;
  // Backend nvlink: the window region holding this dispatch's rows, when it
  // received into one it holds, else the buffer its rows were copied into
  // (both given back when the state goes back).
  std::shared_ptr<void> region;
  std::shared_ptr<Tensor> copy;

  int32_t* single(int world, int64_t T) { return token_flags.data_ptr<int32_t>() + world * T + 1; }
  int32_t* single_pos_raw(int world, int64_t T) {
    return token_rows.data_ptr<int32_t>() + world * T + 1;
  }
  int32_t* single_pos_base(int world, int64_t T) {
    return token_rows.data_ptr<int32_t>() + world * T;
  }
};

// The group's dispatch states: a handle takes a free one (or a new one, made
// by `make`) and gives it back when its last copy goes. Shared with the
// handles, so a handle may outlive its group.
struct EpHandlePool {
  std::mutex mutex;
  std::vector<std::unique_ptr<EpHandle::State>> free;
  std::function<std::unique_ptr<EpHandle::State>()> make;
  size_t made = 0;  // states made so far
  static std::shared_ptr<EpHandle::State> acquire(const std::shared_ptr<EpHandlePool>& pool);
};

struct EpGroup::Impl {
  ncclComm_t comm = nullptr;  // null for simulated ranks
  bool owns_comm = false;
  bool aborted = false;  // a dispatch timed out (EpOptions::timeout_s): the group is unusable
  int rank = 0, world = 1, device = 0, sm_count = 0;
  bool simulated = false;  // create_simulated: a rank of several on one GPU
  EpOptions opt;           // as given (the setters change the tunable fields)
  EpTuning tuning;
  EpSizes size;
  NcclBuffers buf;
  // ep_dispatch_quantize in two steps (backend nccl; nvlink without
  // nvl_quantize_in_dispatch): the tokens' codes [tmax, H] and 1x128 scales
  // [tmax, ceil(H/128)] (nccl: allocated by the first call; nvlink: at
  // creation, so that a captured dispatch allocates nothing).
  Tensor quant_x, quant_scales;
  EpStreams streams;
  // The previous dispatch's rows to / from each rank (the eager piece's size,
  // last_send_rows / last_recv_rows).
  std::vector<int64_t> prev_send_rows, prev_recv_rows;
  std::shared_ptr<EpHandlePool> handles;
  EpTrace trace;
  std::unique_ptr<NvlinkState> nvl;  // backend nvlink

  ~Impl();
  void init(ncclComm_t c, bool owns, const EpOptions& o);
  void init_simulated(int r, int w, const EpOptions& o);
  void init_common(const EpOptions& o);
  void allocate_nccl_buffers(const Device& dev);
  std::unique_ptr<EpHandle::State> make_handle_state() const;
  EpHandle new_handle(int64_t num_tokens, const EpGroup& group);
  void init_nvlink();  // (nvlink.cu; collective)

  int chunks() const { return std::clamp(opt.pipeline_chunks, 1, kMaxChunks); }
  // Blocks of one nvlink kernel: every SM; simulated ranks share the GPU, and
  // all their kernels must be resident at once (they wait on each other).
  int max_nvlink_blocks() const { return simulated ? sm_count / world : sm_count; }
  // The wider of the token and gradient dtypes: sizes the buffers both
  // kinds of rows go through.
  DType wide_dtype() const {
    return size.grad_row_bytes > size.row_bytes ? size.grad_dtype : opt.dtype;
  }
  void mark(const std::string& what, cudaStream_t s) { trace.mark(what, s); }
  // `waiter` waits for the work issued so far on `from`.
  static void order(cudaEvent_t ev, cudaStream_t from, cudaStream_t waiter) {
    MOEFLOW_CUDA_CHECK(cudaEventRecord(ev, from));
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(waiter, ev, 0));
  }
};

namespace ep_nccl {
// Grouped ncclSend/ncclRecv of per-peer row ranges of two buffers (bytes per
// row): rows [s_off[q], s_off[q] + s_cnt[q]) to rank q, the like from it
// (nccl.cu). exchange_peers: the same without this rank's own range.
void exchange(EpGroup::Impl& g, const uint8_t* send, int64_t send_row_bytes,
              const std::vector<int64_t>& s_off, const std::vector<int64_t>& s_cnt, uint8_t* recv,
              int64_t recv_row_bytes, const std::vector<int64_t>& r_off,
              const std::vector<int64_t>& r_cnt, cudaStream_t stream);
void exchange_peers(EpGroup::Impl& g, const uint8_t* send, int64_t send_row_bytes,
                    const std::vector<int64_t>& s_off, const std::vector<int64_t>& s_cnt,
                    uint8_t* recv, int64_t recv_row_bytes, const std::vector<int64_t>& r_off,
                    const std::vector<int64_t>& r_cnt, cudaStream_t stream);
}  // namespace ep_nccl

inline int64_t addr(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

}  // namespace moeflow
