// The one tolerance table of the tests: values computed in float32 and
// rounded to the output dtype are compared with |got - want| <= atol + rtol*|want|.
#pragma once

#include "moeflow/tensor.h"

namespace moeflow::test {

struct Tolerance {
  double atol;
  double rtol;
};

inline Tolerance tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return {1e-5, 1e-5};
    case DType::kFloat16: return {1e-3, 1e-3};
    case DType::kBFloat16: return {1e-2, 8e-3};
    default: return {0.0, 0.0};  // byte-moved dtypes must match exactly
  }
}

// Dot products (dprobs) over H elements: float32 accumulation against a
// float64 reference.
inline Tolerance dot_tolerance(int64_t hidden) { return {1e-4 * (1.0 + hidden / 256.0), 1e-4}; }

}  // namespace moeflow::test

namespace moeflow::test {

// GEMMs: relative Frobenius-norm error ||got - ref|| / ||ref|| against a
// float64 reference (or cuBLAS), by output dtype (inputs bf16/fp16, float32
// accumulation).
inline double gemm_tolerance(DType out) {
  switch (out) {
    case DType::kFloat32: return 1e-4;
    case DType::kFloat16: return 2e-3;
    case DType::kBFloat16: return 1e-2;
    default: return 0.0;
  }
}

}  // namespace moeflow::test
