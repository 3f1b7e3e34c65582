// Thin shims over the CUDA runtime used by the core (allocation, copies,
// fills, device selection), so that only src/cuda includes CUDA headers.
#include <cuda_runtime.h>

#include "core/internal.h"

namespace moeflow::detail {

void* cuda_alloc(size_t bytes, int device) {
  cuda_set_device(device);
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  MOEFLOW_CHECK(err == cudaSuccess, "cudaMalloc of ", bytes, " bytes on cuda:", device,
                " failed: ", cudaGetErrorString(err));
  return p;
}

void cuda_free(void* ptr, int device) noexcept {
  int current = 0;
  if (cudaGetDevice(&current) == cudaSuccess && current != device) cudaSetDevice(device);
  cudaFree(ptr);
  if (current != device) cudaSetDevice(current);
}

void cuda_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream, bool sync) {
  MOEFLOW_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  if (sync) MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void cuda_fill(void* dst, uint8_t byte, size_t bytes, cudaStream_t stream) {
  MOEFLOW_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, stream));
}

void cuda_stream_sync(cudaStream_t stream) { MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream)); }

int cuda_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

std::string cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

void cuda_set_device(int device) {
  int current = -1;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) MOEFLOW_CUDA_CHECK(cudaSetDevice(device));
}

}  // namespace moeflow::detail

#include "cuda/common.cuh"

namespace moeflow::cuda {

int sm_count() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {0};
  int dev = 0;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kMaxDevices && cached[dev] > 0) return cached[dev];
  int n = 0;
  MOEFLOW_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (dev < kMaxDevices) cached[dev] = n;
  return n;
}

}  // namespace moeflow::cuda
