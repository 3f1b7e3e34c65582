// FP8 quantization: the backend entry points and the scalar math both
// backends share (host and device), so that scales, codes and dequantized
// values are computed by one definition (moeflow/quantize.h states the policy).
//
// Backends work in q coordinates: q is [R,C]; the input element of q(r,c) is
// x[r*xr + c*xc] (rowwise: xr = x.stride(0), xc = 1; columnwise: xr = 1,
// xc = x.stride(0)). Arguments arrive validated.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "moeflow/quantize.h"

#if defined(__CUDACC__)
#define MOEFLOW_QHD __host__ __device__ __forceinline__
#else
#define MOEFLOW_QHD inline
#endif

namespace moeflow {

namespace quant {

constexpr int kBlock = 128;

MOEFLOW_QHD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

MOEFLOW_QHD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// IEEE float32 division, round to nearest even (never fast-math on the device).
MOEFLOW_QHD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// x / s from y = RN(1 / s), bit for bit div_rn(x, s) when x is finite,
// s >= kMinReciprocalScale and |x / s| >= 2^-18 (below that the quotient can
// be off, but it still rounds to the fp8 code of div_rn's): q0 = RN(|x| y)
// is within an ulp, the remainder |x| - s q0 is exact (one fma), and
// RN(q0 + r y) is the correctly rounded quotient (Markstein's theorem); the
// sign comes from x, so -0 stays -0. The CUDA quantize kernels divide this
// way (docs/fp8.md, "Division").
constexpr float kMinReciprocalScale = 0x1p-80f;
MOEFLOW_QHD float div_by_reciprocal(float x, float s, float y) {
#if defined(__CUDA_ARCH__)
  const float a = fabsf(x), q0 = __fmul_rn(a, y);
  return copysignf(__fmaf_rn(__fmaf_rn(-s, q0, a), y, q0), x);
#else
  const float a = std::fabs(x), q0 = a * y;
  return std::copysign(std::fma(std::fma(-s, q0, a), y, q0), x);
#endif
}

MOEFLOW_QHD bool is_finite_bits(float f) {
  return (bits_of(f) & 0x7FFFFFFFu) < 0x7F800000u;
}

// |v| when finite, else 0: the contribution of one element to an amax.
MOEFLOW_QHD float amax_term(float v) {
  return is_finite_bits(v) ? float_of(bits_of(v) & 0x7FFFFFFFu) : 0.0f;
}

MOEFLOW_QHD float amax_join(float a, float b) {
  return a > b ? a : b;
}

MOEFLOW_QHD float fp8_max(bool e4m3) {
  return e4m3 ? 448.0f : 57344.0f;
}

// The dequantization multiplier of a block whose amax is `amax`.
MOEFLOW_QHD float scale_of(float amax, bool e4m3, bool pow2) {
  if (!(amax > 0.0f)) return 1.0f;
  uint32_t b = bits_of(div_rn(amax, fp8_max(e4m3)));
  if (b == 0) b = 1;  // underflow: the smallest subnormal, 2^-149
  if (pow2) {
    const uint32_t exp = b >> 23, man = b & 0x7FFFFFu;
    if (exp == 0) {  // subnormal: the next power-of-two bit pattern (0x800000 = 2^-126)
      uint32_t p = 1;
      while (p < man) p <<= 1;
      b = p;
    } else if (man != 0) {
      b = (exp + 1) << 23;  // exp + 1 <= 254: s <= FLT_MAX / 448
    }
  }
  return float_of(b);
}

constexpr uint8_t kFp8NaN = 0x7F;

// The value of an fp8 code (exact).
MOEFLOW_QHD float fp8_value(uint8_t code, bool e4m3) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80) << 24;
  const uint32_t mag = code & 0x7Fu;
  const int mbits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const uint32_t exp = mag >> mbits, man = mag & ((1u << mbits) - 1);
  if (e4m3 && mag == 0x7F) return float_of(0x7FC00000u | sign);
  if (!e4m3 && exp == 31) return float_of((man ? 0x7FC00000u : 0x7F800000u) | sign);
  // value = n * 2^(e - mbits) with n < 16 and e in [-14, 16]: exact in float32.
  const int e = exp == 0 ? 1 - bias : static_cast<int>(exp) - bias;
  const uint32_t n = exp == 0 ? man : (man | (1u << mbits));
  const float p2 = float_of(static_cast<uint32_t>(e - mbits + 127) << 23);
  return float_of(bits_of(static_cast<float>(n) * p2) | sign);
}

// d (the exact product of an fp8 value and a scale) rounded to float32 with
// round-to-odd: rounding that to bf16/fp16 (nearest even) then rounds d once.
MOEFLOW_QHD float round_to_odd_float(double d) {
  const float f = static_cast<float>(d);  // nearest
  const double fd = static_cast<double>(f);
  if (fd == d || d != d) return f;  // exact (inf included), or NaN
  uint32_t b = bits_of(f);
  if ((b & 0x7FFFFFFFu) == 0x7F800000u) return float_of((b & 0x80000000u) | 0x7F7FFFFFu);
  const bool above = fd < 0 ? fd < d : fd > d;  // |f| > |d|: truncate towards zero
  if (above) b -= 1;
  if (static_cast<double>(float_of(b)) != d) b |= 1;
  return float_of(b);
}

}  // namespace quant

namespace cpu {
void quantize(TensorView x, const QuantizeConfig& config, TensorView q, TensorView scales,
              TensorView rows_used = {});
void quantize_rowwise_columnwise(TensorView x, const QuantizeConfig& config, TensorView q,
                                 TensorView scales, TensorView q_t, TensorView scales_t);
void dequantize(TensorView q, TensorView scales, const QuantizeConfig& config, TensorView out,
                TensorView rows_used = {});
// requantize_columnwise (moeflow/quantize.h), arguments checked: the composition.
void requantize_columnwise(TensorView q, TensorView scales, DType dtype,
                           const QuantizeConfig& config, TensorView q_t, TensorView scales_t);
void transpose_codes(TensorView q, TensorView q_t);
// float32 -> fp8 code (e4m3 or e5m2) by the policy: round to nearest even,
// saturate to +-max (inf included), NaN -> 0x7F. Software; exposed for tests.
uint8_t float_to_fp8(float v, bool e4m3);
}  // namespace cpu

namespace cuda {
size_t quantize_workspace_bytes(int64_t rows, int64_t cols, const QuantizeConfig& config);
void quantize(TensorView x, const QuantizeConfig& config, TensorView q, TensorView scales,
              TensorView workspace, TensorView rows_used, cudaStream_t stream);
void quantize_rowwise_columnwise(TensorView x, const QuantizeConfig& config, TensorView q,
                                 TensorView scales, TensorView q_t, TensorView scales_t,
                                 cudaStream_t stream);
void dequantize(TensorView q, TensorView scales, const QuantizeConfig& config, TensorView out,
                TensorView rows_used, cudaStream_t stream);
void requantize_columnwise(TensorView q, TensorView scales, DType dtype,
                           const QuantizeConfig& config, TensorView q_t, TensorView scales_t,
                           cudaStream_t stream);
void transpose_codes(TensorView q, TensorView q_t, cudaStream_t stream);
}  // namespace cuda

}  // namespace moeflow
