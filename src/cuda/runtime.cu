// Thin shims over the CUDA runtime used by the core (allocation, copies,
// fills, device selection), so that only src/cuda includes CUDA headers.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "core/fill.h"
#include "core/internal.h"

namespace moeflow::detail {

namespace {
// Whether `device`'s primary context is active (created and not released),
// through the driver's entry points (no link-time dependency on libcuda).
// When the driver cannot say, it answers yes: the caller's device is restored.
bool primary_context_active(int device) noexcept {
  using GetFn = CUresult (*)(CUdevice*, int);
  using StateFn = CUresult (*)(CUdevice, unsigned int*, int*);
  static const auto fns = [] {
    void* get = nullptr;
    void* state = nullptr;
    cudaDriverEntryPointQueryResult q1{}, q2{};
    const cudaError_t e1 =
        cudaGetDriverEntryPointByVersion("cuDeviceGet", &get, 2000, cudaEnableDefault, &q1);
    const cudaError_t e2 = cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &state,
                                                            7000, cudaEnableDefault, &q2);
    if (e1 != cudaSuccess || e2 != cudaSuccess) cudaGetLastError();  // these queries' own error
    if (e1 != cudaSuccess || q1 != cudaDriverEntryPointSuccess) get = nullptr;
    if (e2 != cudaSuccess || q2 != cudaDriverEntryPointSuccess) state = nullptr;
    return std::pair<GetFn, StateFn>{reinterpret_cast<GetFn>(get),
                                     reinterpret_cast<StateFn>(state)};
  }();
  if (fns.first == nullptr || fns.second == nullptr) return true;
  CUdevice dev = 0;
  unsigned int flags = 0;
  int active = 0;
  if (fns.first(&dev, device) != CUDA_SUCCESS) return true;
  if (fns.second(dev, &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}
}  // namespace

int exchange_device(int device) noexcept {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  if (current == device) return -1;
  if (cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return current;
}

void restore_device(int previous) noexcept {
  if (previous < 0 || !primary_context_active(previous)) return;
  if (cudaSetDevice(previous) != cudaSuccess) cudaGetLastError();
}

DeviceGuard::DeviceGuard(Device device) {
  if (!device.is_cuda()) return;
  int current = -1;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&current));
  if (current == device.index) return;
  const cudaError_t e = cudaSetDevice(device.index);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not left pending for a later, unrelated check
    MOEFLOW_CHECK(false, "cannot make cuda:", device.index, " current: ", cudaGetErrorString(e));
  }
  previous_ = current;
}

DeviceGuard::~DeviceGuard() {
  restore_device(previous_);
}

void* cuda_alloc(size_t bytes, int device) {
  const DeviceGuard guard(Device::cuda(device));
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  MOEFLOW_CHECK(err == cudaSuccess, "cudaMalloc of ", bytes, " bytes on cuda:", device,
                " failed: ", cudaGetErrorString(err));
  return p;
}

void cuda_free(void* ptr, int device) noexcept {
  const int previous = exchange_device(device);
  if (cudaFree(ptr) != cudaSuccess) cudaGetLastError();
  restore_device(previous);
}

void cuda_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream, bool sync) {
  MOEFLOW_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  if (sync) MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void cuda_fill(void* dst, uint8_t byte, size_t bytes, cudaStream_t stream) {
  MOEFLOW_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, stream));
}

namespace {
template <typename T>
__global__ void fill_uniform_kernel(T* dst, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = uniform_at(seed, static_cast<uint64_t>(i), lo, hi);
    if constexpr (std::is_same_v<T, float>)
      dst[i] = v;
    else if constexpr (std::is_same_v<T, __half>)
      dst[i] = __float2half_rn(v);
    else
      dst[i] = __float2bfloat16_rn(v);
  }
}
}  // namespace

void cuda_fill_uniform(void* dst, DType dtype, int64_t n, uint64_t seed, float lo, float hi,
                       cudaStream_t stream) {
  const int threads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 4096));
  if (dtype == DType::kFloat32)
    fill_uniform_kernel<<<blocks, threads, 0, stream>>>(static_cast<float*>(dst), n, seed, lo, hi);
  else if (dtype == DType::kFloat16)
    fill_uniform_kernel<<<blocks, threads, 0, stream>>>(static_cast<__half*>(dst), n, seed, lo, hi);
  else
    fill_uniform_kernel<<<blocks, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), n, seed,
                                                        lo, hi);
  MOEFLOW_CUDA_CHECK(cudaGetLastError());
}

void cuda_stream_sync(cudaStream_t stream) {
  MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
}

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
