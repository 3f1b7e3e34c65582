// TensorView and Tensor: shape bookkeeping, allocation (host: aligned new;
// CUDA: cudaMalloc through the runtime shims), copies and argument checks.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/fill.h"
#include "core/internal.h"
#include "moeflow/tensor.h"

namespace moeflow {

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

static void init_view(TensorView& v, const int64_t* shape, int ndim) {
  MOEFLOW_CHECK(ndim >= 0 && ndim <= kMaxDims, "tensor rank must be 0..", kMaxDims, ", got ", ndim);
  v.ndim = ndim;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    MOEFLOW_CHECK(shape[d] >= 0, "tensor sizes must be >= 0, got ", shape[d], " in dim ", d);
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= std::max<int64_t>(shape[d], 1);
  }
}

TensorView::TensorView(void* data_, DType dtype_, Device device_,
                       std::initializer_list<int64_t> shape_)
    : data(data_), dtype(dtype_), device(device_) {
  init_view(*this, shape_.begin(), static_cast<int>(shape_.size()));
}

TensorView::TensorView(void* data_, DType dtype_, Device device_,
                       const std::vector<int64_t>& shape_)
    : data(data_), dtype(dtype_), device(device_) {
  init_view(*this, shape_.data(), static_cast<int>(shape_.size()));
}

TensorView TensorView::strided(void* data, DType dtype, Device device,
                               const std::vector<int64_t>& shape,
                               const std::vector<int64_t>& strides) {
  MOEFLOW_CHECK(shape.size() == strides.size(), "strided view: ", shape.size(), " sizes but ",
                strides.size(), " strides");
  TensorView v(data, dtype, device, shape);
  for (size_t d = 0; d < strides.size(); ++d) v.strides[d] = strides[d];
  return v;
}

int64_t TensorView::size(int dim) const {
  MOEFLOW_CHECK(dim >= 0 && dim < ndim, "size(", dim, ") of a rank-", ndim, " tensor");
  return shape[dim];
}

int64_t TensorView::stride(int dim) const {
  MOEFLOW_CHECK(dim >= 0 && dim < ndim, "stride(", dim, ") of a rank-", ndim, " tensor");
  return strides[dim];
}

int64_t TensorView::numel() const {
  if (ndim < 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::shape_str() const { return detail::shape_str(sizes()); }

std::string TensorView::str() const {
  if (!defined()) return "none";
  return std::string(dtype_name(dtype)) + " " + shape_str() + " on " + device.str();
}

// --- Tensor ----------------------------------------------------------------

Tensor Tensor::empty(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t;
  t.view_ = TensorView(nullptr, dtype, device, shape);
  size_t bytes = t.view_.nbytes();
  if (bytes == 0) return t;
  if (device.is_cpu()) {
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    MOEFLOW_CHECK(p != nullptr, "host allocation of ", bytes, " bytes failed");
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    int dev = device.index;
    void* p = detail::cuda_alloc(bytes, dev);
    t.storage_ = std::shared_ptr<void>(p, [dev](void* q) { detail::cuda_free(q, dev); });
  }
  t.view_.data = t.storage_.get();
  return t;
}

Tensor Tensor::adopt(const TensorView& view, std::shared_ptr<void> owner) {
  MOEFLOW_CHECK(view.defined() && view.is_contiguous(), "Tensor::adopt needs a contiguous view, got ",
                view.str());
  MOEFLOW_CHECK(owner != nullptr || view.numel() == 0, "Tensor::adopt needs an owner for ",
                view.str());
  Tensor t;
  t.view_ = view;
  t.storage_ = std::move(owner);
  return t;
}

Tensor Tensor::zeros(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  const detail::DeviceGuard device_guard(device);  // the fill and the wait on its device
  fill_bytes(t, 0);
  if (device.is_cuda()) detail::cuda_stream_sync(nullptr);
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(sizes(), dtype(), device);
  copy(view_, t.view_);
  return t;
}

void copy(TensorView src, TensorView dst, cudaStream_t stream) {
  MOEFLOW_CHECK(src.defined() && dst.defined(), "copy: src and dst must be defined");
  MOEFLOW_CHECK(src.dtype == dst.dtype && src.sizes() == dst.sizes(), "copy: dst must be ",
                src.dtype == dst.dtype ? "" : dtype_name(src.dtype), " ", src.shape_str(),
                ", got ", dst.str());
  MOEFLOW_CHECK(src.is_contiguous() && dst.is_contiguous(), "copy: views must be contiguous");
  size_t bytes = src.nbytes();
  if (bytes == 0) return;
  if (src.device.is_cpu() && dst.device.is_cpu()) {
    std::memcpy(dst.data, src.data, bytes);
    return;
  }
  bool sync = src.device.is_cpu() || dst.device.is_cpu();
  const detail::DeviceGuard device_guard(dst.device.is_cuda() ? dst.device : src.device);
  detail::cuda_copy(dst.data, src.data, bytes, stream, sync);
}

void fill_bytes(TensorView dst, uint8_t byte, cudaStream_t stream) {
  MOEFLOW_CHECK(dst.is_contiguous(), "fill_bytes: view must be contiguous");
  size_t bytes = dst.nbytes();
  if (bytes == 0) return;
  if (dst.device.is_cpu()) {
    std::memset(dst.data, byte, bytes);
  } else {
    const detail::DeviceGuard device_guard(dst.device);
    detail::cuda_fill(dst.data, byte, bytes, stream);
  }
}

void fill_uniform(TensorView dst, uint64_t seed, float lo, float hi, cudaStream_t stream) {
  MOEFLOW_CHECK(dst.is_contiguous(), "fill_uniform: view must be contiguous");
  MOEFLOW_CHECK(dst.dtype == DType::kFloat32 || dst.dtype == DType::kFloat16 ||
                    dst.dtype == DType::kBFloat16,
                "fill_uniform: dst must be float32, float16 or bfloat16, got ",
                dtype_name(dst.dtype));
  MOEFLOW_CHECK(lo <= hi, "fill_uniform: lo must be <= hi, got [", lo, ", ", hi, ")");
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (dst.device.is_cpu()) {
    for (int64_t i = 0; i < n; ++i)
      detail::store_float(dst.data, dst.dtype, i,
                          detail::uniform_at(seed, static_cast<uint64_t>(i), lo, hi));
  } else {
    const detail::DeviceGuard device_guard(dst.device);
    detail::cuda_fill_uniform(dst.data, dst.dtype, n, seed, lo, hi, stream);
  }
}

int cuda_device_count() { return detail::cuda_count(); }

// --- Argument checks -------------------------------------------------------

namespace detail {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) os << ",";
    if (shape[i] < 0) os << "*"; else os << shape[i];
  }
  os << "]";
  return os.str();
}

void expect_defined(const TensorView& v, const char* name) {
  MOEFLOW_CHECK(v.defined(), name, " is required but was not given");
}

void expect(const TensorView& v, const char* name, const Expect& e) {
  expect_defined(v, name);
  bool dtype_ok = e.dtypes.empty() ||
                  std::find(e.dtypes.begin(), e.dtypes.end(), v.dtype) != e.dtypes.end();
  bool shape_ok = static_cast<size_t>(v.ndim) == e.shape.size();
  for (size_t d = 0; shape_ok && d < e.shape.size(); ++d)
    shape_ok = e.shape[d] < 0 || e.shape[d] == v.shape[d];
  bool device_ok = v.device == e.device;
  if (!(dtype_ok && shape_ok && device_ok)) {
    std::ostringstream want;
    if (e.dtypes.empty()) {
      want << "any dtype";
    } else {
      for (size_t i = 0; i < e.dtypes.size(); ++i)
        want << (i ? (i + 1 == e.dtypes.size() ? " or " : ", ") : "") << dtype_name(e.dtypes[i]);
    }
    MOEFLOW_CHECK(false, name, " must be ", want.str(), " ", shape_str(e.shape), " on ",
                  e.device.str(), ", got ", v.str());
  }
  if (e.contiguous) {
    MOEFLOW_CHECK(v.is_contiguous(), name, " must be contiguous, got strides ",
                  shape_str(std::vector<int64_t>(v.strides, v.strides + v.ndim)));
  } else if (e.inner_unit && v.ndim > 0) {
    MOEFLOW_CHECK(v.shape[v.ndim - 1] <= 1 || v.strides[v.ndim - 1] == 1, name,
                  " must have unit stride in its last dim, got strides ",
                  shape_str(std::vector<int64_t>(v.strides, v.strides + v.ndim)));
    for (int d = 0; d + 1 < v.ndim; ++d)
      MOEFLOW_CHECK(v.strides[d] >= 0, name, " must have non-negative strides");
  }
  MOEFLOW_CHECK(v.numel() == 0 || v.data != nullptr, name, " has ", v.numel(),
                " elements but a null data pointer");
}

}  // namespace detail
}  // namespace moeflow
