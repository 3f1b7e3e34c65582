// Device helpers shared by the CUDA kernels: packed vector loads/stores,
// float conversions, warp utilities, launch checks, device properties.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/internal.h"
#include "moeflow/error.h"

namespace moeflow::cuda {

constexpr int kWarpSize = 32;

// Checks the launch that just happened (configuration errors surface here).
#define MOEFLOW_CUDA_LAUNCH_CHECK() MOEFLOW_CUDA_CHECK(cudaGetLastError())

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// N elements of T moved as one aligned access (N * sizeof(T) <= 16 in one
// instruction; 32 bytes become two).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// fn(T{}) with T the element type of a float dtype (float32 / bfloat16 / float16).
template <typename Fn>
void with_float_type(DType dtype, Fn fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kBFloat16: return fn(__nv_bfloat16{});
    case DType::kFloat16: return fn(__half{});
    default: MOEFLOW_CHECK(false, "unsupported dtype ", dtype_name(dtype));
  }
}

// Number of SMs of the current device (cached per device).
int sm_count();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether p is 16-byte aligned.
inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// ceil(items / per_block) blocks, at least 1 and at most 16 per SM (the
// kernels walk the rest in a grid-stride loop).
inline int capped_grid(int64_t items, int64_t per_block) {
  const int64_t cap = static_cast<int64_t>(sm_count()) * 16;
  return static_cast<int>(std::max<int64_t>(1, std::min(cap, ceil_div(items, per_block))));
}

// fn(std::true_type{}) for e4m3, fn(std::false_type{}) for e5m2.
template <typename Fn>
void with_fp8_format(bool e4m3, Fn fn) {
  if (e4m3)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}
__device__ __forceinline__ int64_t ceil_div_dev(int64_t a, int64_t b) { return (a + b - 1) / b; }

// True when every pointer/stride given is a multiple of `bytes`.
inline bool aligned_to(int64_t bytes, std::initializer_list<int64_t> values) {
  for (int64_t v : values)
    if (v % bytes != 0) return false;
  return true;
}

}  // namespace moeflow::cuda
