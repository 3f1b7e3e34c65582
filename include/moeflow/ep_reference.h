// Expert-parallel dispatch and combine: the in-process reference.
//
// W ranks each hold E/W experts (rank q: global experts [q*E/W, (q+1)*E/W)).
// Every rank's tokens travel to the ranks of their experts and arrive already
// permuted by local expert and padded to `align`, as one RoutingPlan-like
// layout per rank; combine brings each token's expert outputs home and sums
// them in float32 in a fixed order.
//
// This header holds the CPU reference that simulates all W ranks in one
// process (the oracle for the NCCL and NVLink backends, and runnable in CI).
// Its semantics, which the device backends must reproduce bit for bit:
//   - Receive layout of rank q: local experts in order, each segment padded to
//     `align` rows; inside an expert, rows ordered by (source rank, token, k).
//     Pad rows are zeros (data, probs). Rows past the used rows are untouched.
//   - Capacity (rows per rank): max_tokens_per_rank * W * min(K, E/W) +
//     (E/W) * (align-1), rounded up to align, or a caller-given multiple of
//     align; what does not fit is dropped as in plan.h (experts in order, the
//     tail of the one that fits partially and all later ones) and counted.
//   - combine: out[t] = sum over ranks q ascending of partial_q[t], where
//     partial_q[t] = sum over k ascending (slots of t on rank q, kept) of
//     fma(w[t,k], y_q[row], .) in float32, the first partial taken as is. With
//     W = 1 this is exactly unpermute. With a bfloat16 wire
//     (EpOptions::combine_wire_dtype), partial_q[t] of a peer q != r holding
//     several slots of t is rounded to bfloat16 (nearest even) first.
#pragma once

#include <cstdint>
#include <vector>

#include "moeflow/quantize.h"
#include "moeflow/tensor.h"

namespace moeflow::ep_reference {

struct EpConfig {
  int world_size = 1;             // W
  int num_experts = 0;            // E (global), a multiple of W
  int align = 1;                  // 1, 16, 32, 64, 128, 256
  int64_t max_tokens_per_rank = 0;  // bound on T of every rank (sizes the receive buffers)
  int64_t capacity_rows = -1;     // per rank; -1: the worst case above
};

// Receive-buffer rows of every rank (host-computable from the config).
int64_t recv_capacity_rows(const EpConfig& config, int topk);

// What one rank sends: tokens x [T,H] (float32/bfloat16/float16; T may be 0
// and may differ per rank), ids [T,K] int32/int64 global expert ids (-1: none),
// probs [T,K] float32, scales optional [T,S] (any dtype, e.g. the float32
// block scales of FP8 rows; the same S and dtype on every rank): they travel
// with their token's rows.
struct RankInput {
  Tensor x, ids, probs, scales;
};

// What one rank receives, all on the CPU.
struct RankReceive {
  Tensor x;                  // [capacity, H] dtype of the inputs
  Tensor probs;              // [capacity] float32
  Tensor scales;             // [capacity, S] when the inputs had scales (pad rows 0)
  Tensor tokens_per_expert;  // [E/W] int32 rows kept per local expert
  Tensor expert_row_offsets; // [E/W+1] int64
  Tensor src_rank, src_token, src_k;  // [capacity] int32, -1 on pad rows
  int64_t total_rows = 0;
  int64_t dropped = 0;       // slots routed here that did not fit
};

// The way back: for every source rank r and slot (t,k), the receiving rank
// and row (-1 when unrouted or dropped).
struct Handle {
  EpConfig config;
  int topk = 0;
  std::vector<Tensor> dest_rank;  // per source rank: [T_r,K] int32
  std::vector<Tensor> dest_row;   // per source rank: [T_r,K] int64
  std::vector<Tensor> recv_tokens_per_expert;   // per receiving rank: [E/W] int32
  std::vector<Tensor> recv_expert_row_offsets;  // per receiving rank: [E/W+1] int64
};

// Simulates dispatch on all ranks. inputs.size() must equal W.
std::vector<RankReceive> dispatch(const std::vector<RankInput>& inputs, const EpConfig& config,
                                  Handle& handle);

// ep_dispatch_quantize's reference: each rank's x (bfloat16/float16, no
// scales given) quantized by quantize(x, quantize) (kBlock1x128 rowwise),
// then dispatch() of the codes with their float32 scales.
std::vector<RankReceive> dispatch_quantize(const std::vector<RankInput>& inputs,
                                           const EpConfig& config, const QuantizeConfig& quantize,
                                           Handle& handle);

// y[q]: expert outputs of rank q, [capacity, H] (float32/bfloat16/float16).
// weights[r]: [T_r,K] float32 (or an undefined tensor for w = 1).
// Returns out[r] [T_r,H] in `out_dtype`. wire_dtype: float32 or bfloat16
// (the peers' partials of several slots rounded, see above).
std::vector<Tensor> combine(const std::vector<Tensor>& y, const Handle& handle,
                            const std::vector<Tensor>& weights, DType out_dtype,
                            DType wire_dtype = DType::kFloat32);

// Gradient of dispatch (a combine without weights): grad_x[r] [T_r,H].
std::vector<Tensor> dispatch_backward(const std::vector<Tensor>& grad_recv, const Handle& handle,
                                      DType out_dtype, DType wire_dtype = DType::kFloat32);

// Gradient of combine: grad_y[q] [capacity,H] (w * dout sent to each row, pad
// rows zero) and dprobs[r] [T_r,K] = <dout[r][t], y_q[row]> (0 when unrouted).
void combine_backward(const std::vector<Tensor>& dout, const Handle& handle,
                      const std::vector<Tensor>& y, const std::vector<Tensor>& weights,
                      std::vector<Tensor>& grad_y, std::vector<Tensor>& dprobs);

}  // namespace moeflow::ep_reference
