// TensorView (non-owning) and Tensor (owning): the only array types of the
// public API. Shapes and strides are in elements; at most kMaxDims dims.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "moeflow/error.h"

typedef struct CUstream_st* cudaStream_t;

namespace moeflow {

enum class DType : uint8_t {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3,
  kFloat8E5M2,
  kInt32,
  kInt64,
  kUInt8,
  kBool,
  kFloat64,  // the router's CPU backend only (float64 gradient checks)
};

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
// True for float32, float16, bfloat16 (the dtypes ops do arithmetic on; not
// float64, which only the router's CPU backend takes).
bool dtype_is_arith_float(DType dtype);

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static Device cpu() { return Device{DeviceType::kCPU, 0}; }
  static Device cuda(int index = 0) { return Device{DeviceType::kCUDA, index}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  std::string str() const;  // "cpu" or "cuda:N"
  bool operator==(const Device& o) const {
    return type == o.type && (type == DeviceType::kCPU || index == o.index);
  }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

constexpr int kMaxDims = 4;

// A non-owning view of an array. A default-constructed view is "undefined"
// (ndim == -1) and stands for an omitted optional argument. A defined view may
// have zero elements (and then a null data pointer).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int ndim = -1;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0, 0};

  TensorView() = default;
  // A contiguous (row-major) view.
  TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape);
  TensorView(void* data, DType dtype, Device device, const std::vector<int64_t>& shape);
  // A view with explicit strides (in elements).
  static TensorView strided(void* data, DType dtype, Device device,
                            const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& strides);

  bool defined() const { return ndim >= 0; }
  int64_t size(int dim) const;
  int64_t stride(int dim) const;
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  std::vector<int64_t> sizes() const { return std::vector<int64_t>(shape, shape + (ndim > 0 ? ndim : 0)); }
  // "bfloat16 [4096,8] cuda:0" (or "none" when undefined)
  std::string str() const;
  std::string shape_str() const;  // "[4096,8]"

  template <typename T>
  T* data_ptr() const {
    return static_cast<T*>(data);
  }
};

// An owning, contiguous tensor. Copies share the storage (like a shared_ptr).
// Allocation happens here only: never call it on the hot path.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const std::vector<int64_t>& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const std::vector<int64_t>& shape, DType dtype, Device device = Device::cpu());
  // A tensor over memory allocated elsewhere (e.g. by ncclMemAlloc): `view`
  // must be contiguous; `owner` keeps the memory alive (its deleter frees it
  // when the last copy of the tensor goes).
  static Tensor adopt(const TensorView& view, std::shared_ptr<void> owner);

  const TensorView& view() const { return view_; }
  operator TensorView() const { return view_; }
  bool defined() const { return view_.defined(); }
  void* data() const { return view_.data; }
  template <typename T>
  T* data_ptr() const {
    return static_cast<T*>(view_.data);
  }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  int ndim() const { return view_.ndim; }
  int64_t size(int dim) const { return view_.size(dim); }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }
  std::vector<int64_t> sizes() const { return view_.sizes(); }

  // A new tensor on `device` holding a copy (synchronous).
  Tensor to(Device device) const;

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Copies src into dst (same dtype and shape, both contiguous, any devices).
// With a CUDA device involved it enqueues on `stream` and, when either side
// is on the host, waits for the copy to finish.
void copy(TensorView src, TensorView dst, cudaStream_t stream = nullptr);
// Fills every byte of a contiguous view with `byte` (e.g. 0xFF poisons floats as NaN).
void fill_bytes(TensorView dst, uint8_t byte, cudaStream_t stream = nullptr);
// Fills a contiguous float32 / float16 / bfloat16 view with pseudo-random
// values uniform in [lo, hi), element i from a hash of (seed, i): the CPU and
// a GPU give bitwise the same tensor. Enqueued on `stream` (no sync) for a
// CUDA view. Benchmarks fill their operands with it: a GPU's power draw,
// and so its clock, depend on the data (a constant flatters a GEMM).
void fill_uniform(TensorView dst, uint64_t seed, float lo, float hi,
                  cudaStream_t stream = nullptr);

// Number of CUDA devices visible (0 when built without CUDA or none present).
int cuda_device_count();

}  // namespace moeflow
