// Pieces the CUDA quantize kernels share (quantize.cu, quantize_weights.cu):
// the block of 256 threads, the source and destination of a quantization in
// q coordinates, block-wide amax reductions and 16-byte row loads.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "core/quantize_backend.h"
#include "cuda/common.cuh"
#include "cuda/fp8.cuh"

namespace moeflow::cuda::qblock {

using quant::kBlock;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;

// The input element of q(r,c): x[r*xr + c*xc].
template <typename T>
struct Src {
  const T* x;
  int64_t xr, xc;
  __device__ __forceinline__ void prepare() {}
  __device__ __forceinline__ bool skip(int64_t /*c0*/) const { return false; }
  __device__ __forceinline__ float at(int64_t r, int64_t c) const {
    return to_float(x[r * xr + c * xc]);
  }
};

struct Dst {
  uint8_t* q;
  int64_t q_stride;  // elements (bytes) between rows of q
  int64_t R, C;
  float* scales;
  bool pow2;
  const void* rows_used = nullptr;  // optional int32 / int64 count of the rows to write (1x128)
  bool rows_used64 = false;
  __device__ __forceinline__ int64_t rows() const {
    if (rows_used == nullptr) return R;
    const int64_t n = rows_used64 ? *static_cast<const int64_t*>(rows_used)
                                  : *static_cast<const int32_t*>(rows_used);
    return min(R, max(n, int64_t{0}));
  }
};

__device__ __forceinline__ float warp_amax(float m) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1)
    m = quant::amax_join(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return m;
}

// amax over the block's threads; every thread gets it. Reuses `smem` (kWarps floats).
__device__ __forceinline__ float block_amax(float m, float* smem) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  m = warp_amax(m);
  __syncthreads();  // smem free from a previous use
  if (lane == 0) smem[warp] = m;
  __syncthreads();
  m = lane < kWarps ? smem[lane] : 0.0f;
  return warp_amax(m);
}

// The max of `m` over the block's threads; every thread gets it. Reuses `smem`.
__device__ __forceinline__ uint32_t block_max_bits(uint32_t m, float* smem) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  __syncthreads();  // smem free from a previous use
  if (lane == 0) smem[warp] = __uint_as_float(m);
  __syncthreads();
  m = lane < kWarps ? __float_as_uint(smem[lane]) : 0u;
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return m;
}

// 8 consecutive values of a 16-byte aligned row as floats.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  constexpr int kVecs = 8 * sizeof(T) / 16;
  uint4 raw[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) raw[i] = reinterpret_cast<const uint4*>(p)[i];
  const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = to_float(e[j]);
}

// kBlock128x128 of one matrix, rowwise or columnwise (config.columnwise), as
// quantize writes it: dst in q coordinates, nbr x nbc blocks (quantize_weights.cu).
void quantize_128x128(const TensorView& x, const QuantizeConfig& config, const Dst& dst,
                      int64_t nbr, int64_t nbc, cudaStream_t stream);

// quantize_rowwise_columnwise with kBlock128x128 (quantize_weights.cu):
// arguments checked by the core entry point.
void quantize_128x128_both_ways(const TensorView& x, const QuantizeConfig& config,
                                const TensorView& q, const TensorView& scales,
                                const TensorView& q_t, const TensorView& scales_t,
                                cudaStream_t stream);

}  // namespace moeflow::cuda::qblock
