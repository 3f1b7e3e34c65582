// The router's backend entry points (CPU and CUDA), with every argument in
// one struct per op. Arguments arrive validated (shapes, dtypes, devices);
// values (cu_seqlens, ids) are the backends' to check.
#pragma once

#include "moeflow/router.h"

namespace moeflow {

struct RouterForwardArgs {
  TensorView logits;  // [T,E]
  RouterConfig config;
  RouterOutputs out;
  TensorView expert_bias;     // or undefined
  TensorView padding_mask;    // [T] bool/uint8 or undefined
  TensorView cu_seqlens;      // [S+1] int32 or undefined (read only with seq_aux_loss_coeff != 0)
  TensorView workspace;       // CUDA
  int64_t num_sequences = 0;  // S (0 without cu_seqlens)
};

struct RouterBackwardArgs {
  TensorView logits, topk_ids, tokens_per_expert;  // tokens_per_expert may be undefined
  RouterGrads grads;
  RouterConfig config;
  TensorView dlogits;
  TensorView padding_mask;           // or undefined
  TensorView cu_seqlens;             // or undefined
  TensorView seq_tokens_per_expert;  // [S,E] or undefined
  int64_t num_sequences = 0;
};

struct RouterCapacityArgs {
  TensorView topk_ids, probs;  // probs undefined for kPosition
  RouterCapacityConfig config;
  int64_t capacity = 0;  // router_capacity(T, K, E, ...)
  TensorView kept_ids, dropped, workspace;
};

namespace cpu {
void router_forward(const RouterForwardArgs& a);
void router_backward(const RouterBackwardArgs& a);
void router_apply_capacity(const RouterCapacityArgs& a);
void router_update_expert_bias(TensorView tokens_per_expert, TensorView expert_bias, float rate);
void router_split_bf16(TensorView src, const Bf16SplitLayout& layout, TensorView dst);
}  // namespace cpu

namespace cuda {
size_t router_workspace_bytes(int64_t num_tokens, const RouterConfig& config,
                              int64_t num_sequences);
void router_forward(const RouterForwardArgs& a, cudaStream_t stream);
void router_backward(const RouterBackwardArgs& a, cudaStream_t stream);
size_t router_capacity_workspace_bytes(int64_t num_tokens, int topk, int num_experts);
void router_apply_capacity(const RouterCapacityArgs& a, cudaStream_t stream);
void router_update_expert_bias(TensorView tokens_per_expert, TensorView expert_bias, float rate,
                               cudaStream_t stream);
void router_split_bf16(TensorView src, const Bf16SplitLayout& layout, TensorView dst,
                       cudaStream_t stream);
}  // namespace cuda

}  // namespace moeflow
