// Internal helpers shared by the core, the CPU reference and the CUDA backend.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "moeflow/tensor.h"

namespace moeflow::detail {

// --- CUDA runtime shims (src/cuda/runtime.cu; they throw without CUDA) ------
void* cuda_alloc(size_t bytes, int device);
void cuda_free(void* ptr, int device) noexcept;
// Copies bytes between any two places (host or device); waits when `sync`.
void cuda_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream, bool sync);
void cuda_fill(void* dst, uint8_t byte, size_t bytes, cudaStream_t stream);
void cuda_fill_uniform(void* dst, DType dtype, int64_t n, uint64_t seed, float lo, float hi,
                       cudaStream_t stream);
void cuda_stream_sync(cudaStream_t stream);
int cuda_count() noexcept;
std::string cuda_error_string(int code);
// Makes `device` current for this thread for the guard's life, then the
// thread's previous device again. Every public function that touches a CUDA
// device holds one over its whole body, so kernels, copies, fills and
// allocations go to the arguments' device and the caller's current device is
// left as it was. The previous device is made current again only if its
// primary context is active: switching back to a device the caller never
// used would create a context there (PyTorch's guard does the same). A CPU
// device does nothing. Nested guards on the same device cost one
// cudaGetDevice each.
class DeviceGuard {
 public:
  explicit DeviceGuard(Device device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;  // the device to make current again; -1: nothing to undo
};
// The same for destructors, without exceptions: exchange_device makes
// `device` current and returns the previous device (-1 if `device` was
// current already or the switch failed); restore_device(previous) makes it
// current again under the guard's rule.
int exchange_device(int device) noexcept;
void restore_device(int previous) noexcept;

// --- Host scalar conversions (round to nearest even, as CUDA's _rn) ---------
float bf16_to_float(uint16_t v);
uint16_t float_to_bf16(float f);
float half_to_float(uint16_t v);
uint16_t float_to_half(float f);
// Element `i` (linear, of a contiguous array) of an arithmetic float dtype.
float load_float(const void* base, DType dtype, int64_t i);
void store_float(void* base, DType dtype, int64_t i, float v);

// --- Argument checks ---------------------------------------------------------
// Checks a view at the API boundary and throws a message of the form
//   "<name> must be <dtypes> [<shape>] on <device>, got <dtype> [<shape>] on <device>".
// shape entries of -1 match any size; an empty `dtypes` matches any dtype.
struct Expect {
  std::vector<DType> dtypes;
  std::vector<int64_t> shape;
  Device device;
  bool contiguous = true;   // require a contiguous view
  bool inner_unit = false;  // require only stride(last) == 1 (rows may be strided)
};
void expect(const TensorView& v, const char* name, const Expect& e);
// A required argument must be a defined view.
void expect_defined(const TensorView& v, const char* name);
std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace moeflow::detail
