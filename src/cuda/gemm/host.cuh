// Host helpers shared by the grouped GEMM launchers (grouped_gemm.cu,
// grouped_gemm_fp8.cu): the Hopper check, TMA tensor maps (encoded through
// the driver entry point, no link-time libcuda), the thread's driver
// context, and the dynamic shared memory a kernel may use.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "moeflow/error.h"
#include "moeflow/tuning.h"

namespace moeflow::cuda::gemm::host {

// The wgmma path needs a Hopper GPU and sm_90a code in this build.
inline bool use_sm90(const GemmOptions& o) {
#ifdef MOEFLOW_HAS_SM90A
  if (o.kernel == GemmKernel::kPortable) return false;
  int dev = 0, major = 0;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFLOW_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  return major == 9;
#else
  (void)o;
  return false;
#endif
}

// cuTensorMapEncodeTiled from the driver (no link-time dependency on libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status{};
    MOEFLOW_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                        cudaEnableDefault, &status));
    MOEFLOW_CHECK(f != nullptr && status == cudaDriverEntryPointSuccess,
                  "cuTensorMapEncodeTiled is not available from the driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// Encoding a tensor map needs a current driver context. A thread that has
// made no CUDA runtime call yet (the autograd engine's device thread running
// a backward, say) has none: bind the current device's primary context, as
// the runtime does on its first call.
inline void ensure_current_context() {
  static const PFN_cuCtxGetCurrent_v4000 get_current = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status{};
    MOEFLOW_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &f, 4000, cudaEnableDefault, &status));
    MOEFLOW_CHECK(f != nullptr && status == cudaDriverEntryPointSuccess,
                  "cuCtxGetCurrent is not available from the driver");
    return reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(f);
  }();
  CUcontext ctx = nullptr;
  if (get_current(&ctx) == CUDA_SUCCESS && ctx != nullptr) return;
  int dev = 0;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFLOW_CUDA_CHECK(cudaSetDevice(dev));  // binds the primary context to this thread
  ctx = nullptr;
  MOEFLOW_CHECK(get_current(&ctx) == CUDA_SUCCESS && ctx != nullptr,
                "no CUDA context is current on this thread (device ", dev, ")");
}

inline int64_t addr_of(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

// A TMA map of a row-major tensor: dims[0] innermost (elements), byte
// strides of the outer dims, box in elements, 128-byte swizzle (out of
// bounds: loads read zeros, stores are clipped).
template <int RANK>
CUtensorMap tensor_map(const void* base, CUtensorMapDataType dtype, const int64_t (&dims)[RANK],
                       const int64_t (&byte_strides)[RANK - 1], const int (&box)[RANK]) {
  CUtensorMap map;
  cuuint64_t d[RANK], st[RANK > 1 ? RANK - 1 : 1];
  cuuint32_t b[RANK], es[RANK];
  for (int i = 0; i < RANK; ++i) {
    d[i] = static_cast<cuuint64_t>(dims[i]);
    b[i] = static_cast<cuuint32_t>(box[i]);
    es[i] = 1;
    if (i + 1 < RANK) st[i] = static_cast<cuuint64_t>(byte_strides[i]);
  }
  const CUresult r =
      tensor_map_encoder()(&map, dtype, RANK, const_cast<void*>(base), d, st, b, es,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOEFLOW_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (", int(r), ") for a ", RANK,
                "-d tensor with inner dimension ", dims[0]);
  return map;
}

// A 2D row-major [rows, cols] 16-bit matrix in boxes of box_rows x 64 columns.
inline CUtensorMap tensor_map_2d(const void* base, int64_t rows, int64_t cols, int64_t row_stride_elems,
                          int box_rows) {
  return tensor_map<2>(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {cols, rows}, {row_stride_elems * 2},
                       {64, box_rows});
}

template <typename T>
CUtensorMapDataType tma_dtype() {
  if constexpr (std::is_same_v<T, float>)
    return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  else if constexpr (std::is_same_v<T, __half>)
    return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  else
    return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// Largest dynamic shared memory a block of `kernel` may use on this device.
template <typename Kernel>
size_t max_dynamic_smem(Kernel kernel) {
  int dev = 0, optin = 0;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFLOW_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes attr{};
  MOEFLOW_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return static_cast<size_t>(optin) - attr.sharedSizeBytes;
}

}  // namespace moeflow::cuda::gemm::host
