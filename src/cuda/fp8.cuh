// The float -> fp8 code conversion of the quantization policy
// (moeflow/quantize.h), shared by the CUDA kernels that write fp8: round to
// nearest even with saturation (+-inf too), NaN -> quant::kFp8NaN; and the
// 1x128 block quantization of a warp's 512-column chunk of a row (lane l:
// columns [16 l, 16 l + 16), so 8 lanes share one block).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "core/quantize_backend.h"
#include "cuda/common.cuh"

namespace moeflow::cuda {

template <bool E4M3>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  if (v != v) return quant::kFp8NaN;
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, E4M3 ? __NV_E4M3 : __NV_E5M2));
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
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < kFp8PerLane; ++j) m = quant::amax_join(m, quant::amax_term(v[j]));
#pragma unroll
  for (int o = kFp8LanesPerBlock / 2; o > 0; o >>= 1)
    m = quant::amax_join(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float scale = quant::scale_of(m, E4M3, pow2);
#pragma unroll
  for (int j = 0; j < kFp8PerLane / 4; ++j) w[j] = 0;
#pragma unroll
  for (int j = 0; j < kFp8PerLane; ++j)
    w[j / 4] |= uint32_t{to_fp8<E4M3>(__fdiv_rn(v[j], scale))} << (8 * (j % 4));
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
