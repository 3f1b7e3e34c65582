// The MoE router: router logits -> top-k expert ids, routing probabilities,
// per-expert token counts and the auxiliary losses, forward and backward,
// with Megatron-Core's semantics and option names (moe_router_topk,
// moe_router_score_function, moe_router_pre_softmax, moe_router_num_groups,
// moe_router_group_topk, moe_router_topk_scaling_factor, moe_aux_loss_coeff,
// moe_z_loss_coeff, expert bias for aux-loss-free balancing).
//
// The gating GEMM (logits = x W^T) is the caller's (torch, cuBLAS): the router
// starts from float32 logits. No host synchronisation; outputs are
// caller-allocated; the CUDA path is CUDA-graph safe (sizes come from shapes).
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
};

// Sigmoid scoring: scores = sigmoid(logits); routing scores = scores +
// expert_bias (when given) select the experts (and groups); probs are the
// unbiased scores of the chosen experts, divided by their sum + 1e-20 when
// K > 1.
//
// Losses (T = rows of logits; both 0 when T = 0):
//   aux_loss = E * coeff / (K * T * T) * sum_e (sum_t s[t,e]) * tokens_per_expert[e]
//     s = softmax(logits) over E (softmax), or sigmoid(logits) / (its sum over
//     E + 1e-20) (sigmoid).
//   z_loss = coeff * mean_t (logsumexp_e logits[t,e])^2

// Outputs of router_forward, all on the device of the logits, contiguous.
struct RouterOutputs {
  TensorView topk_ids;           // [T,K] int32: chosen experts, best first
  TensorView probs;              // [T,K] float32: routing probability of each slot
  TensorView tokens_per_expert;  // [E] int32: slots routed to each expert (exact)
  TensorView aux_loss;           // [1] float32; required when aux_loss_coeff != 0
  TensorView z_loss;             // [1] float32; required when z_loss_coeff != 0
  TensorView nonfinite;          // optional [1] int32: tokens with a non-finite logit
};

// Scratch bytes router_forward needs on a CUDA device for T tokens
// (host-computable; the CPU backend needs none).
size_t router_workspace_bytes(int64_t num_tokens, const RouterConfig& config);

// Routes T tokens.
//   logits:      [T,E] float32, contiguous.
//   expert_bias: optional [E] float32 (sigmoid only): added to the scores for
//                selection only.
//   workspace:   uint8 [>= router_workspace_bytes(T, config)] on the device (CUDA).
// Every output is written (losses given with a zero coefficient are set to 0).
// Run to run bitwise deterministic (fixed-order float32 sums, no float atomics).
void router_forward(TensorView logits, const RouterConfig& config, const RouterOutputs& out,
                    TensorView expert_bias = {}, TensorView workspace = {},
                    cudaStream_t stream = nullptr);

// Output gradients reaching the router.
struct RouterGrads {
  TensorView dprobs;     // [T,K] float32
  TensorView daux_loss;  // optional [1] float32 on the device (omitted: 0)
  TensorView dz_loss;    // optional [1] float32 on the device (omitted: 0)
};

// dlogits [T,E] float32 (overwritten) = the gradient of the forward function
// with the expert choice fixed:
//   logits:            [T,E] float32, the forward input
//   topk_ids:          [T,K] int32 from router_forward (ids outside [0,E) are skipped)
//   tokens_per_expert: [E] int32 from router_forward (a constant, as in Megatron;
//                      needed when aux_loss_coeff != 0)
// One pass over the logits; no host sync; graph safe.
void router_backward(TensorView logits, TensorView topk_ids, TensorView tokens_per_expert,
                     const RouterGrads& grads, const RouterConfig& config, TensorView dlogits,
                     cudaStream_t stream = nullptr);

// Aux-loss-free balancing step, on the device:
//   expert_bias[e] += rate * sign(mean(tokens_per_expert) - tokens_per_expert[e])
//   tokens_per_expert: [E] int32; expert_bias: [E] float32 (updated in place).
void router_update_expert_bias(TensorView tokens_per_expert, TensorView expert_bias, float rate,
                               cudaStream_t stream = nullptr);

}  // namespace moeflow
