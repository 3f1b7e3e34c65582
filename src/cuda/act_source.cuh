// The activation's values as a row source of the quantize kernels: a =
// act(h) * p from FC1's output h, shared by grouped_mlp_activation_quantize's
// 1x128 kernel (mlp_ops.cu) and its tensorwise passes (quantize_rows.cu).
#pragma once

#include "core/activations.h"
#include "cuda/common.cuh"
#include "cuda/fp8.cuh"

namespace moeflow::cuda {

// a = act(h) * p in T (the activation kernels' arithmetic: the same bits as
// the a the MLP stores). VEC: a lane's 16 gate (and up) values are
// contiguous in h and 16-byte aligned (h's rows 16-byte aligned, f % 16 ==
// 0, the GLU interleave 0 or a multiple of 16): 16-byte loads.
template <typename T, Activation A, bool VEC = false>
struct ActSource {
  static constexpr bool kRaw = false;  // load() only: the values are computed
  const T* h;
  int64_t n1;
  const float* probs;
  ActivationParams ap;
  int il;
  __device__ __forceinline__ void load(int64_t row, int64_t cl, int64_t f,
                                       float (&v)[kFp8PerLane]) const {
    constexpr bool kGated =
        A == Activation::kSwiGLU || A == Activation::kGeGLU || A == Activation::kClampedQuickGeGLU;
    const T* hrow = h + row * n1;
    const float p = probs ? probs[row] : 1.0f;
    if constexpr (VEC) {
      float g[kFp8PerLane], u[kFp8PerLane];
      load_chunk<T, true>(hrow, kGated ? glu_gate_col(cl, il) : cl, cl < f ? n1 : 0, g);
      if constexpr (kGated) load_chunk<T, true>(hrow, glu_up_col(cl, il, f), cl < f ? n1 : 0, u);
#pragma unroll
      for (int j = 0; j < kFp8PerLane; ++j)
        v[j] = cl < f ? to_float(from_float<T>(act_forward(A, g[j], kGated ? u[j] : 0.0f, ap) * p))
                      : 0.0f;
    } else {
#pragma unroll
      for (int j = 0; j < kFp8PerLane; ++j) {
        const int64_t col = cl + j;
        v[j] = 0.0f;
        if (col < f) {
          const float g = to_float(hrow[kGated ? glu_gate_col(col, il) : col]);
          const float u = kGated ? to_float(hrow[glu_up_col(col, il, f)]) : 0.0f;
          v[j] = to_float(from_float<T>(act_forward(A, g, u, ap) * p));
        }
      }
    }
  }
};

}  // namespace moeflow::cuda
