// The expert-parallel backend entry points behind the public functions of
// moeflow/ep.h (src/core/ep.cpp checks the arguments, then calls these;
// src/cuda/ep/ implements them). Arguments arrive validated.
#pragma once

#include "moeflow/ep.h"

namespace moeflow {

constexpr int kEpMaxWorld = 64;   // ranks per group
constexpr int kEpMaxChunks = 16;  // EpOptions::pipeline_chunks at most

// Checks the options of a group of `world_size` ranks (every factory calls it).
void check_ep_options(const EpOptions& options, int world_size);
// EpOptions::combine_wire_dtype against the hidden size.
void check_combine_wire(DType wire, int64_t hidden);

namespace cuda {

EpDispatchResult ep_nccl_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                                  TensorView scales, cudaStream_t stream);
// x quantized into the group's staging rows, then ep_nccl_dispatch of them.
EpDispatchResult ep_nccl_dispatch_quantize(EpGroup& group, TensorView x, TensorView ids,
                                           TensorView probs, const QuantizeConfig& quant,
                                           cudaStream_t stream);
// The same on either backend (the nvlink group allocated the staging rows at
// creation).
EpDispatchResult ep_dispatch_quantize_staged(EpGroup& group, TensorView x, TensorView ids,
                                             TensorView probs, const QuantizeConfig& quant,
                                             cudaStream_t stream);
// Backend nvlink: quantized in the dispatch kernel or in two steps, as
// EpOptions::nvlink_quantize_in_dispatch (or its auto choice) says.
EpDispatchResult ep_nvlink_dispatch_quantize(EpGroup& group, TensorView x, TensorView ids,
                                             TensorView probs, const QuantizeConfig& quant,
                                             cudaStream_t stream);
void ep_nccl_combine(EpGroup& group, const EpHandle& handle, TensorView y, bool weighted, TensorView out,
                     cudaStream_t stream);
void ep_nccl_combine_backward(EpGroup& group, const EpHandle& handle, TensorView dout, TensorView y, bool weighted,
                              TensorView grad_y, TensorView dprobs, cudaStream_t stream);

// Throws when an earlier operation's wait on a peer timed out (no sync).
void ep_nvlink_check(EpGroup& group);
// quant: x holds 16-bit tokens, quantized in the dispatch kernel (ep_dispatch_quantize);
// null: x holds tokens of the group's dtype.
EpDispatchResult ep_nvlink_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                                    TensorView scales, const QuantizeConfig* quant,
                                    cudaStream_t stream);
void ep_nvlink_combine(EpGroup& group, const EpHandle& handle, TensorView y, bool weighted, TensorView out,
                       cudaStream_t stream);
void ep_nvlink_combine_backward(EpGroup& group, const EpHandle& handle, TensorView dout, TensorView y, bool weighted,
                                TensorView grad_y, TensorView dprobs, cudaStream_t stream);

}  // namespace cuda
}  // namespace moeflow
