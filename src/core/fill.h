// The element function of fill_uniform (moeflow/tensor.h), shared by the CPU
// and the CUDA backend so that both give the same bits.
#pragma once

#include <cstdint>

#include "core/backends.h"  // MOEFLOW_HD

namespace moeflow::detail {

// splitmix64 of (seed, i); 24 random bits as u in [0, 1) (exact in float),
// then lo + (hi - lo) * u rounded twice (no fused multiply-add).
MOEFLOW_HD inline float uniform_at(uint64_t seed, uint64_t i, float lo, float hi) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
#ifdef __CUDA_ARCH__
  return __fadd_rn(lo, __fmul_rn(hi - lo, u));
#else
  volatile float scaled = (hi - lo) * u;  // kept apart from the add (no contraction)
  return lo + scaled;
#endif
}

}  // namespace moeflow::detail
