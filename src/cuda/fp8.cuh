// The float -> fp8 code conversion of the quantization policy
// (moeflow/quantize.h), shared by the CUDA kernels that write fp8: round to
// nearest even with saturation (+-inf too), NaN -> quant::kFp8NaN; the
// division by a block's scale (its reciprocal and one correction, bit for bit
// __fdiv_rn, for blocks of finite values); and the 1x128 block quantization
// of a warp's 512-column chunk of a row (lane l: columns [16 l, 16 l + 16),
// so 8 lanes share one block).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/quantize_backend.h"
#include "cuda/common.cuh"

namespace moeflow::cuda {

template <bool E4M3>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  if (v != v) return quant::kFp8NaN;
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, E4M3 ? __NV_E4M3 : __NV_E5M2));
}

// |v|'s bits. Their max over a block orders the finite values as floats (its
// float is the block's amax) and puts inf and NaN at kFp8NonFinite or above.
__device__ __forceinline__ uint32_t abs_bits(float v) {
  return __float_as_uint(v) & 0x7FFFFFFFu;
}
constexpr uint32_t kFp8NonFinite = 0x7F800000u;

// |v| when finite, else 0 (quant::amax_term in float operations, so that the
// rare path of a block with inf or NaN keeps no integer copies alive).
__device__ __forceinline__ float finite_abs(float v) {
  const float a = fabsf(v);
  return a < INFINITY ? a : 0.0f;
}

// x / scale for the codes of one block, bit for bit __fdiv_rn (the policy),
// in three instructions a value instead of a dozen: the scale's reciprocal
// once per block, then quant::div_by_reciprocal. `fast` needs every value of
// the block finite and s >= quant::kMinReciprocalScale; other blocks divide
// with __fdiv_rn and map NaN as to_fp8 does.
struct Fp8Divider {
  float s, y;
  bool fast;
  __device__ __forceinline__ Fp8Divider(float scale, bool finite)
      : s(scale), y(0.0f), fast(finite && scale >= quant::kMinReciprocalScale) {
    if (fast) y = __frcp_rn(scale);
  }
  __device__ __forceinline__ float divided(float x) const {
    return quant::div_by_reciprocal(x, s, y);
  }
};

// Four finite quotients as four codes (two paired conversions), value 0 in the low byte.
template <bool E4M3>
__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
  constexpr __nv_fp8_interpretation_t kFmt = E4M3 ? __NV_E4M3 : __NV_E5M2;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFmt);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kFmt);
  return lo | (hi << 16);
}

// 16-bit values by their bits: |v|'s bits order the finite values and put
// inf / NaN at kNonFinite16<T> or above; the float of the max is the amax.
template <typename T>
constexpr uint32_t kNonFinite16 = std::is_same<T, __half>::value ? 0x7C00u : 0x7F80u;
template <typename T>
__device__ __forceinline__ float float_of_bits16(uint32_t b) {
  if constexpr (std::is_same<T, __half>::value)
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  else
    return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b)));
}
// The max of |v|'s bits over 8 16-bit values in shared memory (a volatile
// 16-byte load: a later pass reads them again rather than the compiler
// keeping them alive in registers).
__device__ __forceinline__ uint32_t max_abs_bits8(const void* p) {
  uint4 r;
  asm volatile("ld.volatile.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
  const uint32_t m = __vmaxu2(__vmaxu2(r.x & 0x7FFF7FFFu, r.y & 0x7FFF7FFFu),
                              __vmaxu2(r.z & 0x7FFF7FFFu, r.w & 0x7FFF7FFFu));
  return max(m & 0xFFFFu, m >> 16);
}

// The same by __fdiv_rn and to_fp8 (any values): the path of the blocks that
// Fp8Divider cannot take, kept out of line so that it costs the fast path no
// registers.
template <bool E4M3>
__device__ __noinline__ uint32_t fp8x4_exact(float a, float b, float c, float d, float s) {
  return uint32_t{to_fp8<E4M3>(__fdiv_rn(a, s))} | uint32_t{to_fp8<E4M3>(__fdiv_rn(b, s))} << 8 |
         uint32_t{to_fp8<E4M3>(__fdiv_rn(c, s))} << 16 |
         uint32_t{to_fp8<E4M3>(__fdiv_rn(d, s))} << 24;
}

// The codes of N values of one block, four per word (value j in byte j % 4
// of word j / 4).
template <bool E4M3, int N>
__device__ __forceinline__ void fp8_codes(const float (&v)[N], const Fp8Divider& d,
                                          uint32_t (&w)[N / 4]) {
  static_assert(N % 4 == 0, "whole words");
  if (d.fast) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
      w[i] = fp8x4<E4M3>(d.divided(v[4 * i]), d.divided(v[4 * i + 1]), d.divided(v[4 * i + 2]),
                         d.divided(v[4 * i + 3]));
  } else {
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
      w[i] = fp8x4_exact<E4M3>(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3], d.s);
  }
}

constexpr int kFp8PerLane = 16;                                 // contiguous columns per lane
constexpr int kFp8LanesPerBlock = quant::kBlock / kFp8PerLane;  // lanes sharing a 1x128 block
static_assert(quant::kBlock % kFp8PerLane == 0 && kFp8LanesPerBlock <= 32, "lane layout");

// Lane l's 16 values v (columns past the row must be 0) quantized with the
// 1x128 block of its 8 lanes: the codes, four per word, and the block's
// scale. All 32 lanes of the warp must call it.
template <bool E4M3>
__device__ __forceinline__ float quantize_chunk(const float (&v)[kFp8PerLane], bool pow2,
                                                uint32_t (&w)[kFp8PerLane / 4]) {
  uint32_t mb = 0;
#pragma unroll
  for (int j = 0; j < kFp8PerLane; ++j) mb = max(mb, abs_bits(v[j]));
#pragma unroll
  for (int o = kFp8LanesPerBlock / 2; o > 0; o >>= 1)
    mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
  const bool finite = mb < kFp8NonFinite;
  float amax = __uint_as_float(mb);
  if (!__all_sync(0xffffffffu, finite)) {  // inf or NaN in the chunk: the amax of the finite values
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < kFp8PerLane; ++j) m = fmaxf(m, finite_abs(v[j]));
#pragma unroll
    for (int o = kFp8LanesPerBlock / 2; o > 0; o >>= 1)
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    amax = m;
  }
  const float scale = quant::scale_of(amax, E4M3, pow2);
  fp8_codes<E4M3>(v, Fp8Divider(scale, finite), w);
  return scale;
}

// Lane l's 16 values at columns [cl, cl + 16) of `src` as floats, 0 past
// `cols` (VEC: 16-byte loads; the row is 16-byte aligned and `cols` a
// multiple of 16).
// The VEC form in two steps, so that a chunk's loads can be issued before
// the previous chunk is quantized: the 16-byte pieces (zeros past `cols`),
// then their values as floats.
template <typename T>
struct RawChunk {
  static constexpr int kVecs = kFp8PerLane * static_cast<int>(sizeof(T)) / 16;
  uint4 r[kVecs];
};
template <typename T>
__device__ __forceinline__ void load_raw(const T* src, int64_t cl, int64_t cols, RawChunk<T>& raw) {
  if (cl < cols) {
    const uint4* p = reinterpret_cast<const uint4*>(src + cl);
#pragma unroll
    for (int i = 0; i < RawChunk<T>::kVecs; ++i) raw.r[i] = p[i];
  } else {
#pragma unroll
    for (int i = 0; i < RawChunk<T>::kVecs; ++i) raw.r[i] = make_uint4(0, 0, 0, 0);
  }
}
template <typename T>
__device__ __forceinline__ void unpack_raw(const RawChunk<T>& raw, float (&v)[kFp8PerLane]) {
  const T* e = reinterpret_cast<const T*>(raw.r);
#pragma unroll
  for (int j = 0; j < kFp8PerLane; ++j) v[j] = to_float(e[j]);
}

template <typename T, bool VEC>
__device__ __forceinline__ void load_chunk(const T* src, int64_t cl, int64_t cols,
                                           float (&v)[kFp8PerLane]) {
  if constexpr (VEC) {
    RawChunk<T> raw;
    load_raw(src, cl, cols, raw);
    unpack_raw(raw, v);
  } else {
#pragma unroll
    for (int j = 0; j < kFp8PerLane; ++j) v[j] = cl + j < cols ? to_float(src[cl + j]) : 0.0f;
  }
}

// dequantize's rounding of a product formed exactly in double: once, to
// nearest even; NaN as the 16-bit type's canonical NaN (0x7FFF).
template <typename T>
__device__ __forceinline__ T dequant_round16(double d) {
  if (d != d) {
    if constexpr (std::is_same<T, __half>::value)
      return __ushort_as_half(0x7FFF);
    else
      return __ushort_as_bfloat16(0x7FFF);
  }
  return from_float<T>(quant::round_to_odd_float(d));
}

// Stores lane l's 16 codes at columns [cl, cl + 16) of an fp8 row (VEC: as one
// 16-byte store; the row is 16-byte aligned and its length a multiple of 16).
template <bool VEC>
__device__ __forceinline__ void store_codes(uint8_t* row, int64_t cl, int64_t cols,
                                            const uint32_t (&w)[kFp8PerLane / 4]) {
  if constexpr (VEC) {
    if (cl < cols) *reinterpret_cast<uint4*>(row + cl) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int j = 0; j < kFp8PerLane; ++j)
      if (cl + j < cols) row[cl + j] = static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
  }
}

}  // namespace moeflow::cuda
