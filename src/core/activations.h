// Expert-MLP activations as scalar functions usable on the host and the
// device (the CPU reference and, later, the fused GEMM epilogues share them).
// Gated activations take the gate g and up u of one output column; the plain
// ones take g only.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/backends.h"  // MOEFLOW_HD
#include "moeflow/activation.h"

namespace moeflow {

// FC1 output columns of the gate and the up of activation column j, for
// [gate; up] halves (il = 0) or blocks of il gate rows then il up rows.
MOEFLOW_HD inline int64_t glu_gate_col(int64_t j, int il) {
  return il == 0 ? j : (j / il) * 2 * il + j % il;
}
MOEFLOW_HD inline int64_t glu_up_col(int64_t j, int il, int64_t f) {
  return il == 0 ? j + f : glu_gate_col(j, il) + il;
}

MOEFLOW_HD inline bool is_gated(Activation a) {
  return a == Activation::kSwiGLU || a == Activation::kGeGLU || a == Activation::kClampedQuickGeGLU;
}

template <typename T>
MOEFLOW_HD inline T act_sigmoid(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>)
    return __fdividef(1.0f, 1.0f + __expf(-x));  // fast (GEMM epilogues)
#endif
  return T(1) / (T(1) + exp(-x));
}

// out = f(g, u)
template <typename T>
MOEFLOW_HD inline T act_forward(Activation a, T g, T u, const ActivationParams& p) {
  const T kInvSqrt2 = T(0.70710678118654752440);
  switch (a) {
    case Activation::kSwiGLU:
#if defined(__CUDA_ARCH__)
      if constexpr (std::is_same_v<T, float>) return __fdividef(g, 1.0f + __expf(-g)) * u;
#endif
      return g * act_sigmoid(g) * u;
    case Activation::kGeGLU:
      return T(0.5) * g * (T(1) + erf(g * kInvSqrt2)) * u;
    case Activation::kClampedQuickGeGLU: {
      const T gc = g < T(p.limit) ? g : T(p.limit);
      const T uc = u < -T(p.limit) ? -T(p.limit) : (u > T(p.limit) ? T(p.limit) : u);
      return gc * act_sigmoid(T(p.alpha) * gc) * (uc + T(p.offset));
    }
    case Activation::kGelu:
      return T(0.5) * g * (T(1) + erf(g * kInvSqrt2));
    case Activation::kRelu:
      return g > T(0) ? g : T(0);
    case Activation::kSquaredRelu:
      return g > T(0) ? g * g : T(0);
  }
  return T(0);
}

// dg, du = d out / d g, d out / d u, times dout (du is 0 for plain activations).
template <typename T>
MOEFLOW_HD inline void act_backward(Activation a, T g, T u, T dout, const ActivationParams& p,
                                    T* dg, T* du) {
  const T kInvSqrt2 = T(0.70710678118654752440), kInvSqrt2Pi = T(0.39894228040143267794);
  switch (a) {
    case Activation::kSwiGLU: {
      const T s = act_sigmoid(g);
      *dg = dout * u * (s + g * s * (T(1) - s));
      *du = dout * g * s;
      return;
    }
    case Activation::kGeGLU:
    case Activation::kGelu: {
      const T cdf = T(0.5) * (T(1) + erf(g * kInvSqrt2));
      const T pdf = kInvSqrt2Pi * exp(T(-0.5) * g * g);
      const T gelu = g * cdf, dgelu = cdf + g * pdf;
      if (a == Activation::kGelu) {
        *dg = dout * dgelu;
        *du = T(0);
      } else {
        *dg = dout * u * dgelu;
        *du = dout * gelu;
      }
      return;
    }
    case Activation::kClampedQuickGeGLU: {
      const bool g_in = g < T(p.limit);
      const T gc = g_in ? g : T(p.limit);
      const bool u_in = u > -T(p.limit) && u < T(p.limit);
      const T uc = u < -T(p.limit) ? -T(p.limit) : (u > T(p.limit) ? T(p.limit) : u);
      const T s = act_sigmoid(T(p.alpha) * gc);
      const T glu = gc * s;
      *dg = g_in ? dout * (uc + T(p.offset)) * (s + T(p.alpha) * gc * s * (T(1) - s)) : T(0);
      *du = u_in ? dout * glu : T(0);
      return;
    }
    case Activation::kRelu:
      *dg = g > T(0) ? dout : T(0);
      *du = T(0);
      return;
    case Activation::kSquaredRelu:
      *dg = g > T(0) ? T(2) * g * dout : T(0);
      *du = T(0);
      return;
  }
}

}  // namespace moeflow
