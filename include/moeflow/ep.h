// Expert-parallel dispatch and combine across GPUs (CUDA builds only).
//
// W ranks (one GPU each) hold E/W experts each: rank q owns global experts
// [q*E/W, (q+1)*E/W). dispatch() sends every token to the ranks of its
// experts — once per rank, however many of its experts live there — and
// returns it already permuted by local expert and padded to `align`, with its
// probabilities and a RoutingPlan of the local experts whose counts and
// offsets stay on the device (what the grouped GEMM / MLP reads). combine()
// brings each token's expert outputs home and sums them in float32 in a fixed
// order. The results are bitwise those of the CPU reference in
// moeflow/dispatch.h (ep_reference), whose semantics this backend follows:
// receive rows ordered by (source rank, token, k) inside each local expert,
// the same capacity and drop rule, partial sums per rank in ascending k, the
// partials of the ranks added in ascending rank order.
//
// Backend "nccl": every rank sends each peer a fixed-size routing message
// (its token count, top-k ids and probs) with NCCL; the per-peer row counts
// that follow from them are copied to the host once per dispatch (NCCL send
// sizes are host arguments: this is the one host synchronisation of the
// path, so dispatch is not CUDA-graph capturable; the nvlink backend removes
// it), then grouped ncclSend/ncclRecv move exact row ranges, except the
// eager first piece (EpOptions::eager_share), which leaves before the sync.
// Works over any NCCL transport.
// The transfers run on an internal stream of the group, in pieces, so that
// packing, permuting and the combine's partial sums overlap them; every
// function returns with all its work ordered before later work on `stream`.
// Token counts may differ per rank (including 0) up to max_tokens_per_rank,
// with no extra all-reduce. Combine sends float32 partial sums home, except
// for a token with one slot on a rank: that slot's row of y goes home as is
// (half the bytes for 16-bit y) and is weighted there, with the same bits.
//
// Every rank must call each collective operation (dispatch, combine and the
// backward functions) in the same order. The views returned point into
// buffers the group owns and stay valid until the next dispatch on it.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <vector>

#include "moeflow/plan.h"
#include "moeflow/tensor.h"

struct ncclComm;

namespace moeflow {

// kNccl: grouped ncclSend/ncclRecv, any NCCL transport, one host sync per
// dispatch. kNvlink: kernels that load and store the peers' memory through
// NCCL symmetric memory and LSA barriers (one NVLink domain, NCCL 2.28+; the
// device API is compiled in, so moeflow must be built against the libnccl it
// runs with), no host synchronisation: dispatch, the MLP and combine are
// capturable in one CUDA graph. A token crosses to a rank once and is
// expanded there into its slots' rows; combine sums each token's slots on the
// rank that holds them and sends one float32 partial home, or, for a token
// with one slot on that rank, the slot's row of y itself (half the bytes when
// y is 16-bit; the result is the same bits). received_tokens is
// -1 (the count stays on the device) and the plan's row_token / row_k /
// dest_row are not filled; combine_backward takes y of the gradient dtype
// (the token dtype, or EpOptions::backward_dtype with FP8 tokens). One
// stream per group: its kernels meet in device-side barriers, so operations
// of one group must not run concurrently, every rank must make the same calls
// with the same nvlink_blocks, and an argument error thrown on one rank only
// leaves the others waiting. See docs/ep-nvlink-design.md.
enum class EpBackend { kNccl, kNvlink };

struct EpOptions {
  EpBackend backend = EpBackend::kNccl;
  int num_experts = 0;              // E (global), a multiple of the world size
  int topk = 0;                     // K
  int64_t hidden = 0;               // H
  // Token dtype of dispatch: float32/float16/bfloat16, or float8 e4m3/e5m2
  // (FP8 dispatch: rows of H bytes, their block scales as `scales`; the
  // nvlink backend needs 16-byte rows). Combine takes expert outputs of any
  // float dtype.
  DType dtype = DType::kBFloat16;
  // With FP8 tokens: the dtype of combine_backward's dout (and, on the nvlink
  // backend, of its y and grad_y); float32/float16/bfloat16. Float token
  // dtypes use their own.
  DType backward_dtype = DType::kBFloat16;
  int align = 16;                   // receive segments padded to this many rows
  int64_t max_tokens_per_rank = 0;  // bound on T of every rank (sizes all buffers)
  int64_t capacity_rows = -1;       // receive rows; -1: the worst case (ep_reference)
  // Per-token scales that travel with the rows (e.g. the float32 block scales
  // of FP8 rows: H / 128 columns): [T, scale_cols] of scale_dtype; 0: none.
  // With scale_cols > 0 every dispatch on every rank takes scales.
  int64_t scale_cols = 0;
  DType scale_dtype = DType::kFloat32;
  // Token rows (dispatch) and partial rows (combine) cross in this many pieces
  // per peer (1..16), so that the receiver's permute and the sender's
  // unpermute run while the rest is in flight; 1 = one transfer.
  int pipeline_chunks = 2;
  // Backend nccl, two pieces: the first piece's share of each rank's tokens
  // (in (0, 1)). The last piece's permute (dispatch) and sums (combine) are
  // the operations' tails, so a smaller last piece ends them sooner: 0.65 was
  // 1-3 % faster than halves on 2 x H100 (docs/perf/ep-nccl-2xh200-2026-11-22.md).
  double pipeline_first_share = 0.65;
  // Backend nccl: an eager first piece. NCCL's send sizes are host arguments,
  // so the rows for a peer could leave only after the host has this
  // dispatch's counts. The eager piece does not wait: it carries the first
  // floor(eager_share x n) rows for each peer, n being the rows this rank and
  // that peer exchanged in the previous dispatch (both sides know it, so no
  // message is needed), as a block of that fixed size (rows past this
  // dispatch's count are padding, never read); the rest follows in the
  // pieces above once the counts are known. In [0, 1); 0: off (the first
  // dispatch of a group has none). Every rank must use the same value.
  // Costs a staging buffer of eager_share x max_tokens_per_rank x
  // min(topk, W - 1) rows. MOEFLOW_EP_EAGER overrides it. On 2 x H100 the
  // mixtral dispatch took 488-498 us with 0.7 against 525-535 us without,
  // also with the routing changing every call; dsv3 about the same
  // (docs/perf/ep-nccl-2xh200-2026-11-22.md).
  double eager_share = 0.7;
  // Thread blocks of the permute / unpermute kernels that run beside the
  // transfers (0: as many as the GPU holds). Fewer leave SMs and memory
  // bandwidth to NCCL's kernels (2 pieces x 64 blocks measured best on two
  // H200s: docs/perf/ep-nccl-h200-2026-11-22.md).
  int overlap_blocks = 64;
  // Backend nvlink: thread blocks of its dispatch and combine kernels (one
  // per SM; HybridEP's num_blocks_permute). The rest of the GPU stays free
  // for compute that overlaps the transfers.
  int nvlink_blocks = 32;
  // Backend nvlink: dispatch moves token rows with TMA bulk copies through
  // shared memory instead of 16-byte stores. Same speed at 32 SMs (both are
  // bound by the SMs' store rate), faster with many SMs (2 x H200, dsv3 at
  // 132 SMs: 448 vs 521 us; docs/perf/ep-nvlink-2xh200-2026-11-22.md).
  bool nvlink_bulk_copies = false;
  // Backend nccl: the staging buffers NCCL moves come from ncclMemAlloc and
  // are registered with the communicator (ncclCommRegister), so that NCCL's
  // send/recv over NVLink copies straight between them instead of through
  // its own FIFO buffers (one copy less on the receiver). Every rank must use
  // the same value. MOEFLOW_EP_REGISTER=0/1 overrides it. On by default:
  // 2 x H100, registered vs plain in one run, mixtral dispatch 572 vs 663 us,
  // combine 645 vs 822 us; dsv3 798 vs 989 / 1190 vs 1317 us
  // (docs/perf/ep-nccl-2xh200-2026-11-22.md). Where ncclMemAlloc fails (no
  // cuMem support) the buffers are plain device memory and
  // nccl_buffers_registered() says false.
  bool nccl_register_buffers = true;
};

class EpGroup {
 public:
  // From an existing communicator (not owned, not destroyed). The current CUDA
  // device must be the rank's GPU. Destroy the groups of every rank before
  // any rank destroys the communicator (their registered buffers and windows
  // are released through it, with the peers' NCCL proxies).
  static std::unique_ptr<EpGroup> from_comm(ncclComm* comm, const EpOptions& options);
  // From an NCCL unique id broadcast by the framework (all ranks call together).
  static std::unique_ptr<EpGroup> from_unique_id(const std::array<char, 128>& id, int rank,
                                                 int world_size, const EpOptions& options);
  static std::array<char, 128> new_unique_id();
  // One group per listed GPU of this process (communicators made together).
  static std::vector<std::unique_ptr<EpGroup>> create_local(const std::vector<int>& devices,
                                                            const EpOptions& options);
  // Testing aid: `world_size` (2..8) ranks of the nvlink backend on one GPU,
  // for checking the multi-rank logic where only one GPU is at hand. Each
  // rank's window is plain memory of that GPU, the barriers are counters in
  // device memory, and no NCCL communicator exists (nccl_comm() is null).
  // Drive them like create_local() groups (run_local), each rank's
  // operations on its simulated_stream(); all ranks' kernels must be
  // resident at once, so nvlink_blocks is at most SMs / world_size, and
  // between operations no rank may call anything that waits for the whole
  // device (cudaDeviceSynchronize, cudaFree) while another rank has already
  // launched its next operation. Set before CUDA starts (both checked):
  // CUDA_MODULE_LOADING=EAGER (with lazy loading, a kernel's first launch may
  // wait for the whole GPU while another rank's kernel waits for it) and
  // CUDA_DEVICE_MAX_CONNECTIONS=32 (at least 17: the ranks' streams, taken
  // from a pool made at the first call, need a hardware queue each; so use
  // one set of simulated groups per GPU at a time). Timings say nothing about
  // NVLink.
  static std::vector<std::unique_ptr<EpGroup>> create_simulated(int world_size, int device,
                                                                const EpOptions& options);
  // Runs fn(rank) on one thread per group (each with its device current) and
  // rethrows the first error: the way to drive create_local() groups.
  static void run_local(const std::vector<std::unique_ptr<EpGroup>>& groups,
                        const std::function<void(int rank)>& fn);

  ~EpGroup();
  EpGroup(const EpGroup&) = delete;
  EpGroup& operator=(const EpGroup&) = delete;

  int rank() const;
  int world_size() const;
  int local_experts() const;
  Device device() const;
  int64_t capacity_rows() const;
  const EpOptions& options() const;
  // Changes options().pipeline_chunks (every rank must use the same value).
  void set_pipeline_chunks(int chunks);
  void set_overlap_blocks(int blocks);
  void set_nvlink_blocks(int blocks);
  ncclComm* nccl_comm() const;
  // A group of create_simulated(): the stream its rank's operations must run
  // on (from a process-wide pool, never destroyed); null for other groups.
  cudaStream_t simulated_stream() const;
  // Backend nccl: whether NCCL accepted the registration of the staging
  // buffers (EpOptions::nccl_register_buffers; NCCL_LOCAL_REGISTER=0 declines).
  bool nccl_buffers_registered() const;
  // Rows of the last dispatch sent to / received from each rank (host values).
  const std::vector<int64_t>& last_send_rows() const;
  const std::vector<int64_t>& last_recv_rows() const;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  explicit EpGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct EpDispatchResult {
  TensorView x;             // [capacity, H] received tokens, expert-major, padded; pad rows zero
  TensorView probs;         // [capacity] float32: probability of each row, 0 on pad rows
  TensorView scales;        // [capacity, scale_cols] when dispatched with scales; 0 on pad rows
  const RoutingPlan* plan;  // the local experts' plan (device counts/offsets; overflow = dropped)
  int64_t received_tokens;  // tokens that arrived (host value, known after the count
                            // exchange; -1 on the nvlink backend)
};

// x [T,H] (T <= max_tokens_per_rank, may be 0), ids [T,K] int32/int64 global
// expert ids (-1: none), probs [T,K] float32.
EpDispatchResult ep_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                             cudaStream_t stream = nullptr);
// The same with per-token scales [T, scale_cols] (EpOptions::scale_cols and
// scale_dtype), written beside each of the token's rows on the receiver.
EpDispatchResult ep_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                             TensorView scales, cudaStream_t stream = nullptr);

// y [capacity, H] (the expert outputs of the dispatched rows, float32/float16/
// bfloat16) -> out [T,H] of the last dispatch: out[t] = sum over ranks q
// ascending of sum over t's kept slots on q, k ascending, of w * y[row], w =
// the slot's prob when `weighted`, else 1.
void ep_combine(EpGroup& group, TensorView y, bool weighted, TensorView out,
                cudaStream_t stream = nullptr);

// Gradient of dispatch (a combine without weights): grad_recv [capacity,H] ->
// grad_x [T,H].
void ep_dispatch_backward(EpGroup& group, TensorView grad_recv, TensorView grad_x,
                          cudaStream_t stream = nullptr);

// Gradient of combine: a dispatch of dout [T,H] along the last dispatch's
// routes. grad_y [capacity,H] (dtype of y): w * dout[t] on the row of slot
// (t,k) (w = 1 unless `weighted`), pad rows zero; dprobs [T,K] float32
// (optional): <dout[t], y[row]> for every kept slot, 0 for unrouted or
// dropped slots. y: the forward input of combine.
void ep_combine_backward(EpGroup& group, TensorView dout, TensorView y, bool weighted,
                         TensorView grad_y, TensorView dprobs = {}, cudaStream_t stream = nullptr);

}  // namespace moeflow
