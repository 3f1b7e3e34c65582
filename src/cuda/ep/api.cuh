// Expert-parallel kernels: the parameter struct of every EP kernel and a
// declaration of every launcher (the host functions that launch them).
//   nccl_kernels.cu    the nccl backend's kernels (namespace ep_nccl)
//   nvlink_kernels.cu  the nvlink backend's fused kernels (namespace nvl)
// A launcher enqueues on the stream it is given and checks the launch; its
// arguments are trusted (checked in src/core/ep.cpp and at group creation).
// Grids, blocks and shared memory are chosen by the launchers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/ep_backend.h"
#include "cuda/ep/nvlink_window.cuh"
#include "moeflow/tensor.h"

namespace moeflow {

// --- Backend nccl ------------------------------------------------------------
namespace ep_nccl {

constexpr int kMaxWorld = kEpMaxWorld;  // ranks per group (combine keeps one pointer per rank)
constexpr int kMaxChunks = kEpMaxChunks;

// route: a rank's routing message to every peer, fixed size
// (max_tokens_per_rank): [T | pad] then per token its K global ids (-1 where
// unrouted, -2 where invalid: outside [-1, E)) and K probs (float bits, 0
// without probs). The route-counts kernel counts the invalid ones.
constexpr int kRouteHead = 4;  // words before the tokens
__host__ __device__ inline int64_t route_words(int64_t tmax, int K) {
  return kRouteHead + tmax * 2 * K;
}

// First home token of piece c of C (c = C: T). With two pieces, `split`
// (per mille of T, 0: halves) sets where the second starts.
__host__ __device__ inline int64_t piece_start(int64_t T, int c, int C, int split) {
  if (C == 2 && c == 1 && split > 0) return T * split / 1000;
  return T * c / C;
}

// Rows per peer of the eager piece (EpOptions::eager_share), by rank.
struct EagerRows {
  int32_t n[kMaxWorld];
};

// The routing messages of every rank as this rank reads them.
struct RouteView {
  const int32_t* routes;  // [W][words], this rank's own message in its slot
  int64_t words;          // route_words(max_tokens, topk)
  int64_t max_tokens;     // tmax: max_tokens_per_rank (at least 1)
  int world, topk, experts_per_rank, rank;
};

// The caller's routing of this rank's tokens, as the sender side reads it.
struct TokenRouting {
  const void* ids;  // [T,K] int32, or int64 when ids_int64
  bool ids_int64;
  const float* probs;  // [T,K] or null
  int64_t num_tokens;
  int topk, num_experts, experts_per_rank, world, rank;
};

// Sender side: flags[q*T + t] = token t has a slot on rank q, single[q*T + t]
// = exactly one and q is a peer; this rank's routing message.
struct SendFlagsParams {
  TokenRouting routing;
  int32_t* flags;   // [W*T + 1]
  int32_t* single;  // [W*T + 1]
  int32_t* route;   // this rank's message (its slot of the routes)
};
void launch_send_flags(const SendFlagsParams& p, cudaStream_t stream);

// Receiver side: the same two flags over (source q, token t < T_q) for this
// rank: recv_flags[q*tmax + t], then the single flags after N + 1 entries.
struct RecvFlagsParams {
  RouteView route;
  int32_t* recv_flags;  // [2 (N + 1)], N = W * tmax
};
void launch_recv_flags(const RecvFlagsParams& p, cudaStream_t stream);

// Every received row's local ids / probs, its single flag and position,
// from the scan of the receiver's flags.
struct RecvUnpackParams {
  RouteView route;
  const int32_t* recv_flags;      // as RecvFlagsParams
  const int32_t* recv_flag_scan;  // their exclusive scan
  int32_t* recv_ids;              // [rows, K]
  float* recv_probs;              // [rows, K]
  int32_t* recv_single;           // [rows + 1]: the row has one slot here, from a peer
  int32_t* recv_single_pos;       // [rows + 1]: single rows before it
};
void launch_recv_unpack(const RecvUnpackParams& p, cudaStream_t stream);

// Both sides' rows (and single rows) per peer and piece, from the routing
// messages, into zeroed counts: [sent W x (rows C | single C) | received,
// the same | invalid ids].
struct RouteCountsParams {
  RouteView route;
  int pieces;  // C
  int split;   // piece_start's split (per mille)
  int32_t* counts;
};
void launch_route_counts(const RouteCountsParams& p, cudaStream_t stream);

// Per (q, t) with a flag: the row's K local ids and probs in the send
// buffers; own_row_token[j] = t for this rank's j-th own row.
struct PackMetaParams {
  TokenRouting routing;
  const int32_t* flags;    // SendFlagsParams::flags
  const int32_t* rows;     // their exclusive scan: each (q, t)'s send row
  int32_t* send_ids;       // [rows, K]
  float* send_probs;       // [rows, K]
  int32_t* own_row_token;  // [tmax]
};
void launch_pack_meta(const PackMetaParams& p, cudaStream_t stream);

// Token rows of tokens [t0, t1) along the routes, except those for rank
// `skip` (-1: none). With `eager` null, rows j >= hi[q] of each pair to the
// send buffer; otherwise rows lo[q] <= j < hi[q] to row eager_off[q] + j of
// the eager buffer.
struct PackRowsParams {
  const uint8_t* x;
  int64_t x_stride_bytes, row_bytes;
  bool vec;  // 16-byte aligned rows
  int64_t num_tokens, t0, t1;
  int world, skip;
  const int32_t* flags;
  const int32_t* rows;
  uint8_t* send_x;
  EagerRows lo, hi;
  uint8_t* eager;
  EagerRows eager_off;
};
void launch_pack_rows(const PackRowsParams& p, cudaStream_t stream);

// Per-token scales rows into the send buffer (the token rows' layout).
struct PackScalesParams {
  const uint8_t* scales;
  int64_t scale_bytes, num_tokens;
  int world;
  const int32_t* flags;
  const int32_t* rows;
  uint8_t* send_scales;
};
void launch_pack_scales(const PackScalesParams& p, cudaStream_t stream);

// Combine on the rank that holds the slots, received rows [r0, r0 + n): a
// single row's slot row of y as is, any other row its float32 partial (or
// that partial rounded to bfloat16: partial_bf16), at partial row
// r - recv_single_pos[r] - partial_shift.
struct HolderParams {
  const void* y;  // [capacity, H] of y_dtype
  int64_t y_stride, hidden;
  const int64_t* dest_row;  // the receive plan's [rows, K]
  const int32_t* recv_ids;
  const float* weights;  // [rows, K] or null
  int topk;
  int64_t r0, n;
  const int32_t* recv_single;
  const int32_t* recv_single_pos;
  void* partial;      // float32 (or bfloat16) partials
  bool partial_bf16;
  int64_t partial_shift;
  void* single_rows;  // rows of y's dtype
};
// grid_cap: most blocks (the permutes' overlap_blocks, or 4 x SMs).
void launch_holder(const HolderParams& p, DType y_dtype, int64_t grid_cap, cudaStream_t stream);

// out[t] for home tokens [t0, t0 + count): the partials of t added in
// ascending rank order.
struct CombineSumParams {
  const void* back;         // the peers' float32 (back_bf16: bfloat16) partials
  bool back_bf16;
  const void* back_single;  // the peers' single rows (y's dtype)
  const float* partial;     // this rank's own partials
  int rank;
  int64_t self_shift, hidden, num_tokens, t0;
  int world, topk;
  const int32_t* flags;
  const int32_t* rows;
  const int32_t* single;
  const int32_t* single_pos_raw;  // single's scan, offset by *single_base
  const int32_t* single_base;
  const int32_t* send_ids;
  const float* send_probs;
  bool weighted;
  void* out;  // [T, H] of out_dtype
  int64_t out_stride;
};
void launch_combine_sum(const CombineSumParams& p, DType y_dtype, DType out_dtype, bool vec4,
                        int64_t count, cudaStream_t stream);

// dprobs[t,k] from the rank that holds slot (t,k) (0 when none kept it).
struct DprobsParams {
  const float* back;
  const int32_t* send_ids;
  int64_t num_tokens;
  int topk, world;
  const int32_t* flags;
  const int32_t* rows;
  float* dprobs;
};
void launch_dprobs(const DprobsParams& p, cudaStream_t stream);

}  // namespace ep_nccl

// --- Backend nvlink ----------------------------------------------------------
namespace nvl {

constexpr int kMaxRanks = 8;  // ranks of an nvlink group at most

// Step 2 of dispatch (one block): counts exchanged, slot ranges and this
// rank's receive plan.
struct CountsParams {
  Window win;
  size_t off_counts, off_ntok, off_xregion;
  int32_t my_xregion;  // the region of x this rank receives this dispatch in
  const int32_t* my_counts;  // [E] this rank's slots per global expert
  int32_t my_T;
  int E, W, me;
  int64_t capacity;
  int align;
  int64_t* first_row;  // [E]
  int64_t* fit;        // [E]
  int32_t *kept, *padded;
  int64_t *offsets, *total_rows;
  int32_t *overflow, *epoch;
  const int32_t* invalid_src;
  int32_t* invalid_dst;
};
void launch_counts(const CountsParams& p, cudaStream_t stream);

// Pad rows of this rank's layout: rows zeroed; probs 0 and row_src -1 when
// given. A block per expert.
struct Pads {
  int L;
  const int32_t *kept, *padded;
  const int64_t* offsets;
};
struct PadsParams {
  uint8_t* rows;
  int64_t stride_bytes;
  float* recv_probs;  // or null
  int32_t* row_src;
  int64_t row_bytes;
  Pads pads;
  uint8_t* scales;  // or null
  int64_t scale_bytes;
};
void launch_pads(const PadsParams& p, cudaStream_t stream);

// The home role's inputs of the dispatch kernel.
struct HomeArgs {
  const int32_t* ids;
  const float* probs;  // the caller's [T,K] (nullable: 0)
  float* probs_out;    // their copy for combine [T,K]
  int K, E, L, W, me;
  int64_t tmax, row_bytes;
  const int64_t *local_dest, *local_offsets, *first_row, *fit;
  int32_t* dest_rank;
  int64_t* dest_row;
  const uint8_t* scales = nullptr;  // the caller's [T][scale_bytes], or null
  int64_t scale_bytes = 0;
};
// ep_dispatch_quantize: x holds 16-bit tokens (`in`), which the home role
// quantizes 1x128 rowwise into the rows' codes and their float32 scales
// (HomeArgs::scales is null then; hidden % 16 == 0, hidden <= kMaxQuantCols).
struct QuantIn {
  bool on = false;
  DType in = DType::kBFloat16;
  bool e4m3 = true, pow2 = false;
  int64_t hidden = 0;
};
constexpr int64_t kMaxQuantCols = 16384;
struct DispatchParams {
  Window win;
  Offsets o;
  int P;      // blocks of the home role
  int batch;  // tokens announced together
  const uint8_t* x;
  int64_t x_stride_bytes, T;
  HomeArgs a;
  QuantIn quant = {};
};
// bulk: move the rows with TMA bulk copies (else 16-byte stores; always with
// quant).
void launch_dispatch(const DispatchParams& p, bool bulk, unsigned grid, cudaStream_t stream);
// Once per process and device: the bulk-copy kernel's dynamic shared memory.
void prepare_dispatch_kernel();

// A fused kernel of combine or combine backward: the window, the roles'
// split, and where the last dispatch put this rank's slots.
struct FusedArgs {
  Window win;
  Offsets o;
  int P;          // blocks of the home role
  int batch;      // tokens announced together
  int64_t H, Tn;  // hidden, this rank's tokens
  int K, W, me;
  int64_t tmax;
  const int32_t* dest_rank;  // [tmax, K]: the rank of each slot (-1: none)
  const int64_t* dest_row;   // [tmax, K]: its row there
  const float* weights;      // [tmax, K] the slots' probs, or null
  // The holder's side of the dispatch (the window's, copied into the handle):
  const int32_t* inv;    // [W, tmax, K]: the row here of each peer token's slot (-1)
  const int32_t* ntok;   // [W]: each rank's T
  const float* rprobs;   // [capacity]: each received row's prob
};
struct CombineParams {
  FusedArgs f;
  const void* y;
  int64_t y_stride;
  bool weighted;
  bool wire_bf16;  // a peer's sum of several slots crosses as bfloat16
  void* out;
  int64_t out_stride;
};
void launch_combine(const CombineParams& p, DType y_dtype, DType out_dtype, unsigned grid,
                    cudaStream_t stream);

struct CombineBwdParams {
  FusedArgs f;
  const void* dout;
  int64_t dout_stride;
  const void* y;
  int64_t y_stride;
  void* grad_y;
  int64_t g_stride;
};
void launch_combine_bwd(const CombineBwdParams& p, DType dtype, unsigned grid, cudaStream_t stream);

// Rows [0, *total_rows) of `row_bytes` (a multiple of 16) from src to dst
// (at most max_rows): the used rows of a receive layout.
void launch_copy_rows(const uint8_t* src, uint8_t* dst, int64_t row_bytes,
                      const int64_t* total_rows, int64_t max_rows, cudaStream_t stream);
// ids [T,K] (int32/int64) -> local [tmax,K] int32, rows past T unrouted.
void launch_copy_ids(const int64_t* ids, int64_t T, int K, int64_t tmax, int32_t* out,
                     cudaStream_t stream);
// dprobs[t,k] = dp[t,k] for kept slots, 0 for unrouted or dropped ones.
void launch_dprobs(const float* dp, const int32_t* dest_rank, int64_t n, float* dprobs,
                   cudaStream_t stream);
// A standalone LSA barrier over the group's ranks.
void launch_barrier(const Window& win, cudaStream_t stream);
// The start of a combine or combine backward: a barrier, then the
// operation's number.
void launch_op_start(const Window& win, int32_t* epoch, cudaStream_t stream);

}  // namespace nvl
}  // namespace moeflow
