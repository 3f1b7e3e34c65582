// The MoE router: router logits -> top-k expert ids, routing probabilities,
// per-expert token counts and the auxiliary losses, forward and backward,
// with Megatron-Core's semantics and option names (moe_router_topk,
// moe_router_score_function, moe_router_pre_softmax, moe_router_num_groups,
// moe_router_group_topk, moe_router_topk_scaling_factor, moe_aux_loss_coeff,
// moe_z_loss_coeff, expert bias for aux-loss-free balancing, the padding
// mask, seq_aux_loss, expert capacity with token dropping).
//
// The gating GEMM (logits = x W^T) is the caller's (torch, cuBLAS): the router
// starts from float32 logits. No host synchronisation; outputs are
// caller-allocated; the CUDA path is CUDA-graph safe (sizes come from shapes).
// Float64 logits are accepted on the CPU only (for float64 gradient checks):
// then expert_bias, probs, aux_loss, z_loss, seq_aux_loss, dprobs, d*_loss and
// dlogits are float64 too (router_apply_capacity takes float64 probs there).
//
// Selection order: experts are ranked by routing score, descending; equal
// scores rank the lower expert id first (groups likewise by group id), so the
// choice is deterministic. Output ids are in that order.
// Non-finite logits: a NaN logit is treated as -inf everywhere (selection,
// probabilities, losses; its gradient is 0); +-inf are used as they are
// (IEEE arithmetic: a +inf logit under softmax gives NaN values). Tokens with
// any non-finite logit are counted in RouterOutputs::nonfinite.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moeflow/tensor.h"

namespace moeflow {

enum class ScoreFunction : uint8_t { kSoftmax, kSigmoid };

struct RouterConfig {
  int num_experts = 0;  // E
  int topk = 0;         // K, in [1, E]
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  // Softmax only. false: top-k of the logits, probs = softmax over the k
  // chosen. true: scores = softmax over all E, top-k of the scores, probs =
  // those scores.
  bool pre_softmax = false;
  // Group-limited routing (0: off): experts form num_groups contiguous groups;
  // a group's score is the sum of its top (topk / group_topk) routing scores;
  // the group_topk best groups are kept and the top-k is taken among their
  // experts. num_groups divides E; topk % group_topk == 0.
  int num_groups = 0;
  int group_topk = 0;
  // probs *= topk_scaling_factor (0 or 1: unchanged).
  float topk_scaling_factor = 1.0f;
  // Switch load-balancing loss and z-loss coefficients (0: not computed).
  float aux_loss_coeff = 0.0f;
  float z_loss_coeff = 0.0f;
  // Per-sequence load-balancing loss coefficient (Megatron's
  // moe_router_load_balancing_type "seq_aux_loss"; 0: not computed). May be
  // on together with aux_loss_coeff, as in Megatron's list of types. Needs
  // RouterTokenInfo::cu_seqlens.
  float seq_aux_loss_coeff = 0.0f;
};

// Optional token structure of a batch, for router_forward and router_backward.
//   padding_mask: [T] bool or uint8, nonzero = padding token. A padding
//                 token is not routed (topk_ids -1, probs 0), is not counted
//                 in tokens_per_expert (nor in nonfinite; its logits are not
//                 read), is kept out of every loss, and its dlogits are 0.
//                 (Megatron-Core keeps padding tokens out of the losses and
//                 the expert-bias counts but still routes them.)
//   cu_seqlens:   [S+1] int32 on the device of the logits: packed sequences,
//                 token t is in sequence s when cu_seqlens[s] <= t <
//                 cu_seqlens[s+1]; cu_seqlens[0] = 0, cu_seqlens[S] = T,
//                 non-decreasing (empty sequences allowed), S >= 1 (a
//                 fixed-length batch of B sequences of L tokens is
//                 0, L, 2L, ..., BL). Needed when seq_aux_loss_coeff != 0.
//                 S comes from the shape; the values stay on the device.
//                 Invalid values: the CPU backend throws; the CUDA backend
//                 reads nothing out of bounds (values are clamped to [0,T]
//                 and token t is taken to be in sequence
//                 #{i in [1,S): cu_seqlens[i] <= t}) and reports them in
//                 RouterOutputs::invalid_cu_seqlens.
struct RouterTokenInfo {
  TensorView padding_mask;
  TensorView cu_seqlens;
};

// Sigmoid scoring: scores = sigmoid(logits); routing scores = scores +
// expert_bias (when given) select the experts (and groups); probs are the
// unbiased scores of the chosen experts, divided by their sum + 1e-20 when
// K > 1.
//
// Losses (T = rows of logits, or with a padding mask the number of real
// tokens, = sum_e tokens_per_expert[e] / K; sums over real tokens only; every
// loss is 0 when T = 0):
//   aux_loss = E * coeff / (K * T * T) * sum_e (sum_t s[t,e]) * tokens_per_expert[e]
//     s = softmax(logits) over E (softmax), or sigmoid(logits) / (its sum over
//     E + 1e-20) (sigmoid). tokens_per_expert counts the slots routed (groups
//     and expert bias included); recent Megatron-Core counts a plain top-k of
//     s instead, which differs only with groups or an expert bias.
//   z_loss = coeff * mean_t (logsumexp_e logits[t,e])^2
//   seq_aux_loss = (1/S) * sum_s E * coeff / (K * L_s * L_s) * sum_e (sum_{t in s} s[t,e]) * c[s,e]
//     the aux loss of each sequence, averaged over the S sequences; L_s = the
//     real tokens of sequence s, c[s,e] = seq_tokens_per_expert[s,e] (slots
//     of sequence s routed to e); a sequence with L_s = 0 adds 0 (and counts
//     in S). Megatron's formula for S sequences of equal length; with a
//     padding mask Megatron takes L_s = (real tokens) / S for every sequence,
//     here each sequence's own count.

// Outputs of router_forward, all on the device of the logits, contiguous.
struct RouterOutputs {
  TensorView topk_ids;           // [T,K] int32: chosen experts, best first
  TensorView probs;              // [T,K] float32: routing probability of each slot
  TensorView tokens_per_expert;  // [E] int32: slots routed to each expert (exact)
  TensorView aux_loss;           // [1] float32; required when aux_loss_coeff != 0
  TensorView z_loss;             // [1] float32; required when z_loss_coeff != 0
  TensorView nonfinite;          // optional [1] int32: tokens with a non-finite logit
  TensorView seq_aux_loss;       // [1] float32; required when seq_aux_loss_coeff != 0
  // [S,E] int32: slots of each sequence routed to each expert (exact);
  // required when seq_aux_loss_coeff != 0 (router_backward reads it);
  // computed whenever given (needs cu_seqlens).
  TensorView seq_tokens_per_expert;
  // optional [1] int32: 1 when cu_seqlens is not a valid partition of the
  // T tokens (CUDA; the CPU backend throws instead and writes 0), else 0.
  TensorView invalid_cu_seqlens;
};

// Scratch bytes router_forward needs on a CUDA device for T tokens
// (host-computable; the CPU backend needs none). num_sequences: S of
// cu_seqlens when seq_tokens_per_expert is wanted (seq_aux_loss_coeff != 0),
// else 0.
size_t router_workspace_bytes(int64_t num_tokens, const RouterConfig& config,
                              int64_t num_sequences = 0);

// Routes T tokens.
//   logits:      [T,E] float32 (float64 on the CPU), contiguous.
//   expert_bias: optional [E] float32 (sigmoid only): added to the scores for
//                selection only.
//   workspace:   uint8 [>= router_workspace_bytes(T, config, S)] on the device (CUDA).
//   tokens:      optional padding mask and sequences (RouterTokenInfo).
// Every output is written (losses given with a zero coefficient are set to 0).
// Run to run bitwise deterministic (fixed-order float32 sums, no float atomics).
void router_forward(TensorView logits, const RouterConfig& config, const RouterOutputs& out,
                    TensorView expert_bias = {}, TensorView workspace = {},
                    cudaStream_t stream = nullptr, const RouterTokenInfo& tokens = {});

// Output gradients reaching the router.
struct RouterGrads {
  TensorView dprobs;         // [T,K] float32
  TensorView daux_loss;      // optional [1] float32 on the device (omitted: 0)
  TensorView dz_loss;        // optional [1] float32 on the device (omitted: 0)
  TensorView dseq_aux_loss;  // optional [1] float32 on the device (omitted: 0)
};

// dlogits [T,E] float32 (overwritten) = the gradient of the forward function
// with the expert choice fixed:
//   logits:            [T,E] float32, the forward input
//   topk_ids:          [T,K] int32 from router_forward (ids outside [0,E) are skipped)
//   tokens_per_expert: [E] int32 from router_forward (a constant, as in Megatron;
//                      needed when aux_loss_coeff != 0, and with a padding mask
//                      when any loss is on: the real token count is
//                      sum_e tokens_per_expert[e] / K, as in Megatron's
//                      get_tokens_per_expert_and_token_count)
//   tokens:            the forward's RouterTokenInfo (padding mask: dlogits
//                      rows of padding tokens are 0; cu_seqlens: needed when
//                      seq_aux_loss_coeff != 0)
//   seq_tokens_per_expert: [S,E] int32 from router_forward (constants; needed
//                      when seq_aux_loss_coeff != 0; L_s = its row sum / K)
// One pass over the logits; no host sync; graph safe.
void router_backward(TensorView logits, TensorView topk_ids, TensorView tokens_per_expert,
                     const RouterGrads& grads, const RouterConfig& config, TensorView dlogits,
                     cudaStream_t stream = nullptr, const RouterTokenInfo& tokens = {},
                     TensorView seq_tokens_per_expert = {});

// Aux-loss-free balancing step, on the device:
//   expert_bias[e] += rate * sign(mean(tokens_per_expert) - tokens_per_expert[e])
//   tokens_per_expert: [E] int32; expert_bias: [E] float32 (updated in place).
void router_update_expert_bias(TensorView tokens_per_expert, TensorView expert_bias, float rate,
                               cudaStream_t stream = nullptr);

// The router GEMM's exact bf16 split (docs/python.md, "The router GEMM"):
// float32 src [R,C] as three bf16 parts whose float32 sum is src,
//   p0 = bf16(src), p1 = bf16(src - p0), p2 = bf16(src - p0 - p1)
// (round to nearest even; the subtractions are exact in float32 for finite
// src; non-finite values give what that arithmetic gives: inf -> inf, NaN,
// NaN). dst holds `count` blocks, block i being part parts[i] (0, 1 or 2):
//   along_columns false: dst [count*R, C] (blocks stacked along the rows);
//   along_columns true:  dst [R, count*C] (side by side).
// src float32 and dst bfloat16, contiguous, on one device. One pass; no
// host sync; graph safe.
struct Bf16SplitLayout {
  int parts[4] = {0, 1, 2, 0};
  int count = 3;  // 1..4
  bool along_columns = false;
};
void router_split_bf16(TensorView src, const Bf16SplitLayout& layout, TensorView dst,
                       cudaStream_t stream = nullptr);

// Expert capacity and token dropping (Megatron's moe_expert_capacity_factor,
// moe_token_drop_policy; apply_router_token_dropping without
// pad_to_capacity), applied to the router's output ids.
enum class DropPolicy : uint8_t {
  kProbs,     // keep each expert's `capacity` slots of highest prob
  kPosition,  // keep each expert's first `capacity` slots in token order
};

struct RouterCapacityConfig {
  int num_experts = 0;           // E
  double capacity_factor = 0.0;  // > 0
  DropPolicy drop_policy = DropPolicy::kProbs;
  int64_t min_capacity = 0;  // get_capacity's min_capacity (0: none)
};

// Per-expert capacity, Megatron's get_capacity(T*K, E, capacity_factor,
// min_capacity): max(ceil(T*K / E * capacity_factor), min_capacity), in
// double arithmetic as Python does it.
int64_t router_capacity(int64_t num_tokens, int topk, int num_experts, double capacity_factor,
                        int64_t min_capacity = 0);

// Scratch bytes router_apply_capacity needs on a CUDA device: host-callable,
// no sync (asks CUB for its sort's scratch on the current CUDA device); 0
// without the CUDA backend.
size_t router_capacity_workspace_bytes(int64_t num_tokens, int topk, int num_experts);

// Drops the slots past each expert's capacity C = router_capacity(T, K, E, ...):
//   topk_ids: [T,K] int32 (router_forward's ids; -1 = unrouted, skipped).
//             Ids outside [-1,E): the CPU backend throws; the CUDA backend
//             treats them as -1.
//   probs:    [T,K] float32 (needed by kProbs; ignored by kPosition).
//   kept_ids: [T,K] int32 out: topk_ids with the dropped slots set to -1
//             (may be topk_ids itself).
//   dropped:  optional [1] int32 out: the number of dropped slots.
//   workspace: uint8 [>= router_capacity_workspace_bytes(T, K, E)] (CUDA;
//             not needed when C >= T).
// Order of an expert's slots: kProbs: prob descending (NaN as -inf; equal
// bits: lower token first, then lower k); kPosition: token, then k. The
// first C are kept. When C >= T nothing is dropped (as in Megatron).
// Deterministic (integer sort, no atomics on values); no host sync; graph safe.
// The router's backward keeps using the original ids: the probabilities and
// their normalisation are those of the forward, as in Megatron where the
// capacity mask is applied after the probs.
void router_apply_capacity(TensorView topk_ids, TensorView probs,
                           const RouterCapacityConfig& config, TensorView kept_ids,
                           TensorView dropped = {}, TensorView workspace = {},
                           cudaStream_t stream = nullptr);

}  // namespace moeflow
