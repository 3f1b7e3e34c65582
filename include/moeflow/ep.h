// Expert-parallel dispatch and combine across GPUs (CUDA builds; a build
// without CUDA links these and throws).
//
// W ranks (one GPU each) hold E/W experts each: rank q owns global experts
// [q*E/W, (q+1)*E/W). dispatch() sends every token to the ranks of its
// experts, once per rank, and returns it there permuted by local expert and
// padded to `align`, with its probabilities and a RoutingPlan of the local
// experts whose counts and offsets stay on the device. combine() brings each
// token's expert outputs home and sums them in float32 in a fixed order. The
// results are bitwise those of the CPU reference moeflow/ep_reference.h:
// receive rows ordered by (source rank, token, k) inside each local expert,
// the same capacity and drop rule, partial sums per rank in ascending k, the
// partials of the ranks added in ascending rank order.
//
// Every rank must call each collective operation (dispatch, combine and the
// backward functions) in the same order. Every function enqueues on `stream`
// and returns with its work ordered before later work there. A dispatch
// returns an EpHandle: its received rows and its way back, which combine and
// the backward functions take, so that several dispatches (layers) can be in
// flight and a backward can run long after its forward. How the backends
// work, and their environment knobs: docs/ep.md; the tuning options:
// docs/tuning.md.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "moeflow/plan.h"
#include "moeflow/quantize.h"
#include "moeflow/tensor.h"

struct ncclComm;

namespace moeflow {

// kNccl: grouped ncclSend/ncclRecv over any NCCL transport. The per-peer row
// counts are copied to the host once per dispatch (NCCL send sizes are host
// arguments), so dispatch is not CUDA-graph capturable; combine and the
// backward functions do not synchronise. Token counts may differ per rank
// (including 0) up to max_tokens_per_rank.
// kNvlink: kernels that load and store the peers' memory through NCCL
// symmetric memory (one NVLink domain, NCCL 2.28+, moeflow built against the
// libnccl it runs with). No host synchronisation: dispatch, the MLP and
// combine are capturable in one CUDA graph. received_tokens is -1 and the
// plan's row_token / row_k / dest_row are not filled; combine_backward takes
// y of the gradient dtype. Kernels of one group meet in device-side barriers:
// its operations must not run concurrently, every rank must make the same
// calls with the same nvlink_blocks, and an argument error thrown on one rank
// only leaves the others waiting.
enum class EpBackend { kNccl, kNvlink };

struct EpOptions {
  EpBackend backend = EpBackend::kNccl;
  int num_experts = 0;  // E (global), a multiple of the world size
  int topk = 0;         // K
  int64_t hidden = 0;   // H
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
  // (in (0, 1)); a smaller last piece ends the operations' tails sooner.
  double pipeline_first_share = 0.65;
  // Backend nccl: an eager first piece that leaves before the host has this
  // dispatch's counts: the first floor(eager_share x n) rows for each peer, n
  // being the rows the pair exchanged in the previous dispatch. In [0, 1);
  // 0: off. Every rank must use the same value. Costs a staging buffer of
  // eager_share x max_tokens_per_rank x min(topk, W - 1) rows.
  // MOEFLOW_EP_EAGER overrides it.
  double eager_share = 0.7;
  // Backend nccl: thread blocks of the permute / unpermute kernels that run
  // beside the transfers (0: as many as the GPU holds); fewer leave SMs and
  // memory bandwidth to NCCL's kernels.
  int overlap_blocks = 64;
  // Backend nvlink: thread blocks of its fused kernels (one per SM, at least
  // 2, at most the SMs); the rest of the GPU stays free for compute.
  int nvlink_blocks = 32;
  // Backend nvlink: regions of received rows in the window ([capacity, H] of
  // the token dtype each, 1..16). A dispatch receives into a free region,
  // which its handle then holds until its last copy goes: up to
  // nvlink_recv_regions - 1 dispatches in flight need no copy of their rows.
  // A dispatch finding none free receives into the last region and copies
  // the rows into its handle (as every dispatch does with 1). n + 1 regions
  // for n dispatches in flight take the memory of one region plus n copies.
  // Rows held in the window live as long as the group. Every rank must use
  // the same value. MOEFLOW_NVL_REGIONS overrides it.
  int nvlink_recv_regions = 2;
  // Backend nvlink: dispatch moves token rows with TMA bulk copies through
  // shared memory instead of 16-byte stores (pays off with many SMs).
  // MOEFLOW_NVL_TMA overrides it.
  bool nvlink_bulk_copies = false;
  // Backend nvlink, ep_dispatch_quantize: 1 quantizes in the dispatch kernel
  // (each 16-bit token read once by the home role); 0 quantizes the tokens
  // into a staging buffer of the group first (one pass on the whole GPU),
  // then dispatches the codes; -1 (auto): 1 when topk >= 4, else 0 (2 x
  // H200: the fused path is 1.09x the two steps at top-8, 0.83x at top-2,
  // where the dispatch is bound by the link and the quantize slows its
  // pushes). The staging buffer ([max_tokens_per_rank, H] codes and their
  // scales) is allocated at creation when a group of FP8 tokens with 1x128
  // scales takes the two steps. MOEFLOW_NVL_QUANTIZE=0/1 overrides it.
  int nvlink_quantize_in_dispatch = -1;
  // Backend nccl: the staging buffers NCCL moves come from ncclMemAlloc and
  // are registered with the communicator, so that NCCL copies straight
  // between them (one copy less on the receiver). Every rank must use the
  // same value. MOEFLOW_EP_REGISTER=0/1 overrides it. Where ncclMemAlloc
  // fails the buffers are plain and nccl_buffers_registered() says false.
  bool nccl_register_buffers = true;
  // How long a rank waits for a peer, in seconds (0: forever). Backend nccl:
  // dispatch's host wait for the routing messages; past it, dispatch throws
  // an error naming the ranks whose message did not arrive, after aborting
  // the communicator when the group owns it (from_unique_id, create_local).
  // Backend nvlink: every device-side wait (barriers, per-token flags);
  // past it, the kernels record the missing ranks in host-mapped memory and
  // end, and the next operation (or check()) throws naming them. Either way
  // the group is unusable afterwards.
  double timeout_s = 300.0;
  // What a rank sends home in combine (and dispatch backward) for a token
  // with several slots there: their float32 sum (kFloat32: the result is
  // bitwise ep_reference::combine's), or that sum rounded to bfloat16
  // (kBFloat16: half the bytes; bitwise ep_reference::combine with the same
  // wire dtype; needs hidden % 8 == 0). A token's only slot on a rank crosses
  // as its row of y either way, and the home rank's own slots and the sums
  // of the ranks stay float32. Every rank must use the same value. With
  // capacity drops the nccl backend counts routed slots, not kept ones
  // (docs/ep.md, "The combine wire").
  DType combine_wire_dtype = DType::kFloat32;
};

class EpGroup {
 public:
  // From an existing communicator (not owned, not destroyed). The group lives
  // on the communicator's GPU (ncclCommCuDevice); the current device is left
  // as it was. Destroy the groups of every rank before
  // any rank destroys the communicator (their registered buffers and windows
  // are released through it, with the peers' NCCL proxies).
  static std::unique_ptr<EpGroup> from_comm(ncclComm* comm, const EpOptions& options);
  // From an NCCL unique id broadcast by the framework (all ranks call together;
  // blocks until they have). device: the rank's GPU (-1: the current device);
  // the current device is left as it was.
  static std::unique_ptr<EpGroup> from_unique_id(const std::array<char, 128>& id, int rank,
                                                 int world_size, const EpOptions& options,
                                                 int device = -1);
  static std::array<char, 128> new_unique_id();
  // One group per listed GPU of this process (communicators made together).
  static std::vector<std::unique_ptr<EpGroup>> create_local(const std::vector<int>& devices,
                                                            const EpOptions& options);
  // Testing aid: `world_size` (2..8) ranks of the nvlink backend on one GPU
  // (plain memory windows, counter barriers, no communicator). Drive them
  // like create_local() groups (run_local), each rank's operations on its
  // simulated_stream(); nvlink_blocks is at most SMs / world_size; between
  // operations no rank may wait for the whole device (cudaDeviceSynchronize,
  // cudaFree) while another has launched its next one. Needs, set before
  // CUDA starts (checked): CUDA_MODULE_LOADING=EAGER and
  // CUDA_DEVICE_MAX_CONNECTIONS >= 17 (one set of simulated groups per GPU at
  // a time). Timings say nothing about NVLink (docs/ep.md).
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
  // Changes options().combine_wire_dtype (every rank must use the same value).
  void set_combine_wire_dtype(DType wire);
  ncclComm* nccl_comm() const;
  // A group of create_simulated(): the stream its rank's operations must run
  // on (from a process-wide pool, never destroyed); null for other groups.
  cudaStream_t simulated_stream() const;
  // Backend nccl: whether NCCL accepted the registration of the staging
  // buffers (EpOptions::nccl_register_buffers; NCCL_LOCAL_REGISTER=0 declines).
  bool nccl_buffers_registered() const;
  // Throws if an earlier operation of the group timed out waiting for a peer
  // (EpOptions::timeout_s). No synchronisation: an nvlink operation's timeout
  // is known once the GPU has run it (every operation also checks first).
  void check();
  // Rows of the last dispatch sent to / received from each rank (host values).
  const std::vector<int64_t>& last_send_rows() const;
  const std::vector<int64_t>& last_recv_rows() const;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  explicit EpGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What one dispatch leaves for its combine and backward functions (the way
// back), and the buffers of its received rows. Copyable; the state is shared
// and goes back to its group's pool when the last copy is destroyed (the
// group keeps the pool: a state is allocated only when more dispatches are in
// flight than ever before on that group, so warm up before a CUDA graph
// capture). Host-side, thread-safe to copy and destroy.
class EpHandle {
 public:
  struct State;  // the backend's (src/cuda/ep/group.h)
  EpHandle() = default;
  EpHandle(std::shared_ptr<State> state, const void* group, int64_t num_tokens)
      : state_(std::move(state)), group_(group), num_tokens_(num_tokens) {}
  bool defined() const { return state_ != nullptr; }
  int64_t num_tokens() const { return num_tokens_; }  // T of the dispatch on this rank
  const void* group() const { return group_; }         // the EpGroup it came from
  State& state() const { return *state_; }

 private:
  std::shared_ptr<State> state_;
  const void* group_ = nullptr;
  int64_t num_tokens_ = 0;
};

struct EpDispatchResult {
  TensorView x;             // [capacity, H] received tokens, expert-major, padded; pad rows zero
  TensorView probs;         // [capacity] float32: probability of each row, 0 on pad rows
  TensorView scales;        // [capacity, scale_cols] when dispatched with scales; 0 on pad rows
  const RoutingPlan* plan;  // the local experts' plan (device counts/offsets; overflow = dropped)
  int64_t received_tokens;  // tokens that arrived (host value, known after the count
                            // exchange; -1 on the nvlink backend)
  EpHandle handle;          // owns x, probs, scales and plan: valid while a copy lives
};

// x [T,H] of EpOptions::dtype (T <= max_tokens_per_rank, may be 0), ids
// [T,K] int32/int64 global expert ids (-1: none), probs [T,K] float32
// (optional). Ids outside [-1, E) are treated as unrouted: the nccl backend
// throws after the dispatch completed, the nvlink backend counts them in
// plan->invalid_ids.
EpDispatchResult ep_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                             cudaStream_t stream = nullptr);
// The same with per-token scales [T, scale_cols] (EpOptions::scale_cols and
// scale_dtype), written beside each of the token's rows on the receiver.
EpDispatchResult ep_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                             TensorView scales, cudaStream_t stream = nullptr);

// FP8 dispatch of 16-bit tokens: x [T,H] bfloat16/float16 is quantized on its
// way out as quantize(x, quantize) would (kBlock1x128 rowwise, quantize.out ==
// EpOptions::dtype, pow2_scales as given), and the codes cross with their
// float32 scales. Needs a group of an FP8 dtype with scale_cols = ceil(H/128)
// and scale_dtype float32. The result is bitwise that of quantize(x) ->
// (codes, scales), then ep_dispatch(group, codes, ids, probs, scales).
// Backend nvlink: the dispatch kernel reads x once and stores each token's
// codes into its rows (H % 16 == 0, H <= 16384; 16-byte stores even with
// nvlink_bulk_copies; graph-capturable as ep_dispatch). Backend nccl: x is
// quantized into the group's staging rows first (allocated by the first
// call on the group), then sent as ep_dispatch sends FP8 tokens.
EpDispatchResult ep_dispatch_quantize(EpGroup& group, TensorView x, TensorView ids,
                                      TensorView probs, const QuantizeConfig& quantize,
                                      cudaStream_t stream = nullptr);

// The functions below take the handle of a dispatch of this group (any
// earlier one whose handle is still alive; every rank passes the handle of
// the same dispatch).
//
// y [capacity, H] (the expert outputs of the dispatched rows, float32/float16/
// bfloat16) -> out [T,H] of the handle's dispatch: out[t] = sum over ranks q
// ascending of sum over t's kept slots on q, k ascending, of w * y[row], w =
// the slot's prob when `weighted`, else 1 (each peer's sum of several slots
// rounded to bfloat16 first with EpOptions::combine_wire_dtype kBFloat16).
void ep_combine(EpGroup& group, const EpHandle& handle, TensorView y, bool weighted,
                TensorView out, cudaStream_t stream = nullptr);

// Gradient of dispatch (a combine without weights): grad_recv [capacity,H] ->
// grad_x [T,H].
void ep_dispatch_backward(EpGroup& group, const EpHandle& handle, TensorView grad_recv,
                          TensorView grad_x, cudaStream_t stream = nullptr);

// Gradient of combine: a dispatch of dout [T,H] along the handle's routes.
// grad_y [capacity,H] (dtype of y): w * dout[t] on the row of slot (t,k) (w =
// 1 unless `weighted`), pad rows zero; dprobs [T,K] float32 (optional):
// <dout[t], y[row]> for every kept slot, 0 for unrouted or dropped slots. y:
// the forward input of combine.
void ep_combine_backward(EpGroup& group, const EpHandle& handle, TensorView dout, TensorView y,
                         bool weighted, TensorView grad_y, TensorView dprobs = {},
                         cudaStream_t stream = nullptr);

}  // namespace moeflow
