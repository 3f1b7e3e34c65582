// Backend entry of the fused FC1 of the grouped expert MLP (internal): the
// grouped GEMM x · W1_e^T with bias, activation and router-probability scale
// in its epilogue, optionally saving the pre-activation output for backward.
#pragma once

#include "core/activations.h"
#include "core/backends.h"

namespace moeflow {

struct MlpFc1Call {
  TensorView x;          // [rows, H] bf16/fp16
  TensorView w1;         // [E, N1, H] stacked, same dtype; N1 = 2F gated, F plain
  GroupLayout groups;
  TensorView bias1;      // [E, N1] same dtype, or undefined
  TensorView probs;      // [rows] float32, or undefined
  Activation act = Activation::kSwiGLU;
  ActivationParams params;
  int glu_interleave = 0;  // gated: 0 = halves, else the block size (8..128)
  TensorView out;        // [rows, F] same dtype
  TensorView raw;        // [rows, N1] contiguous, or undefined
  int64_t rows = 0, num_groups = 0, hidden = 0, ffn = 0;
};

namespace cuda {
// Hopper (sm_90a) only for now; throws on other GPUs.
void mlp_fc1_forward(const MlpFc1Call& call, cudaStream_t stream);
}  // namespace cuda

}  // namespace moeflow
