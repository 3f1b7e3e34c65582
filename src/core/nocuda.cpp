// The CUDA runtime shims for a build without CUDA (MOEFLOW_WITH_CUDA=OFF):
// every CUDA request fails with a clear error.
#include "core/internal.h"

namespace moeflow::detail {

[[noreturn]] static void no_cuda() {
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA (MOEFLOW_WITH_CUDA=OFF)");
}
void* cuda_alloc(size_t, int) { no_cuda(); }
void cuda_free(void*, int) noexcept {}
void cuda_copy(void*, const void*, size_t, cudaStream_t, bool) { no_cuda(); }
void cuda_fill(void*, uint8_t, size_t, cudaStream_t) { no_cuda(); }
void cuda_fill_uniform(void*, DType, int64_t, uint64_t, float, float, cudaStream_t) { no_cuda(); }
void cuda_stream_sync(cudaStream_t) { no_cuda(); }
int cuda_count() noexcept { return 0; }
std::string cuda_error_string(int code) { return "CUDA error " + std::to_string(code); }
DeviceGuard::DeviceGuard(Device device) {
  if (device.is_cuda()) no_cuda();
}
DeviceGuard::~DeviceGuard() = default;
int exchange_device(int) noexcept {
  return -1;
}
void restore_device(int) noexcept {}

}  // namespace moeflow::detail
