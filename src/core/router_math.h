// Arithmetic the CPU reference and the CUDA router share, so that both
// backends compute bitwise the same routing scores and therefore choose the
// same experts: an exp built from IEEE operations only (no libm), the ranking
// key (score, then lower id first), and the sum order of a warp (32 lane
// partials in ascending index, then a xor butterfly), which the CPU replays.
// NOTE: bitwise agreement needs IEEE float32 on both sides: no fast-math, no
// host fp-contraction (the ISO C++ mode the build uses has it off).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/backends.h"

namespace moeflow::router_math {

constexpr int kLanes = 32;
constexpr float kRenormEps = 1e-20f;  // Megatron's sigmoid renormalisation epsilon

MOEFLOW_HD inline float bits_to_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

MOEFLOW_HD inline uint32_t float_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// a * b rounded on its own: never fused with a following add (nvcc contracts
// a*b + c into an fma by default, which would round differently from the host).
MOEFLOW_HD inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// exp(x) from IEEE-exact operations (fma, rint, multiply), identical on host
// and device: Cody-Waite reduction x = n ln2 + r, a degree-7 polynomial on
// |r| <= ln2/2 (error below one float ulp), scaling by 2^n in two steps.
MOEFLOW_HD inline float exp_exact(float x) {
  if (!(x > -104.0f)) return x != x ? x : 0.0f;       // NaN stays NaN; underflow (and -inf) -> 0
  if (x > 88.72f) return bits_to_float(0x7F800000u);  // +inf
  const float n = rintf(mul_rn(x, 1.44269504f));
  float r = fmaf(n, -0.693145751953125f, x);
  r = fmaf(n, -1.42860682e-6f, r);
  float p = 1.98412698e-4f;  // 1/7!
  p = fmaf(p, r, 1.38888889e-3f);
  p = fmaf(p, r, 8.33333333e-3f);
  p = fmaf(p, r, 4.16666667e-2f);
  p = fmaf(p, r, 1.66666667e-1f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const int ni = static_cast<int>(n);
  const int n1 = ni / 2, n2 = ni - n1;  // each in [-75, 64]
  return mul_rn(mul_rn(p, bits_to_float(static_cast<uint32_t>(n1 + 127) << 23)),
                bits_to_float(static_cast<uint32_t>(n2 + 127) << 23));
}

MOEFLOW_HD inline float sigmoid_exact(float x) {
  return 1.0f / (1.0f + exp_exact(-x));
}

// NOTE: NaN logits are treated as -inf (the policy of router.h).
MOEFLOW_HD inline float sanitize(float x) {
  return x != x ? -bits_to_float(0x7F800000u) : x;
}

// A total order on (score, id): larger key = ranked first. Scores in
// descending order, then ids ascending; NaN ranks as -inf. Every key is > 0.
MOEFLOW_HD inline uint64_t rank_key(float score, int id) {
  uint32_t u = float_to_bits(sanitize(score));
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(id));
}
MOEFLOW_HD inline int rank_key_id(uint64_t key) {
  return static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

// The scaling factor actually applied (Megatron: `if scaling_factor:`).
MOEFLOW_HD inline float effective_scale(float factor) {
  return factor != 0.0f ? factor : 1.0f;
}

// Host replay of a warp sum: lane l sums v[i] for i = l, l+32, ... in order
// (from 0), then the lanes combine as a xor butterfly (16, 8, 4, 2, 1).
// T: float (the warp's arithmetic) or double (the CPU's float64 router).
template <typename T>
inline T lane_order_sum(const T* v, int64_t n) {
  T part[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    T s = T(0);
    for (int64_t i = l; i < n; i += kLanes) s = s + v[i];
    part[l] = s;
  }
  for (int m = kLanes / 2; m >= 1; m /= 2) {
    T next[kLanes];
    for (int l = 0; l < kLanes; ++l) next[l] = part[l] + part[l ^ m];
    for (int l = 0; l < kLanes; ++l) part[l] = next[l];
  }
  return part[0];
}

}  // namespace moeflow::router_math
