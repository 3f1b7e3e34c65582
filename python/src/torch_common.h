// What moeflow._autograd's nodes share: torch tensors as moeflow
// TensorViews, torch's current stream, the rows of an op's input.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>
#if MOEFLOW_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <optional>

#include "api_table.h"
#include "moeflow/error.h"
#include "moeflow/tensor.h"

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace moeflow::python {

inline DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kDouble:
      return DType::kFloat64;
    case at::kFloat8_e4m3fn:
      return DType::kFloat8E4M3;
    case at::kFloat8_e5m2:
      return DType::kFloat8E5M2;
    case at::kInt:
      return DType::kInt32;
    case at::kLong:
      return DType::kInt64;
    case at::kByte:
      return DType::kUInt8;
    case at::kBool:
      return DType::kBool;
    default:
      MOEFLOW_CHECK(false, name, ": unsupported dtype ", c10::toString(t.scalar_type()),
                    "; moeflow takes float32/16/64, bfloat16, float8 e4m3fn/e5m2, int32/64, "
                    "uint8, bool");
  }
  return DType::kFloat32;
}

// A view of t with its strides (the rows of x, y and their gradients: the
// C++ API checks the layouts it takes).
inline TensorView rows_of(const at::Tensor& t, const char* name) {
  MOEFLOW_CHECK(t.defined(), name, ": a tensor is required");
  MOEFLOW_CHECK(t.dim() <= kMaxDims, name, ": at most ", kMaxDims, " dimensions, got ", t.dim());
  TensorView v;
  v.data = t.data_ptr();
  v.dtype = dtype_of(t, name);
  if (t.is_cuda())
    v.device = Device::cuda(t.get_device());
  else
    MOEFLOW_CHECK(t.is_cpu(), name, ": tensors must be on the CPU or a CUDA device, got ",
                  t.device().str());
  v.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  return v;
}

// A view of a contiguous t (every other tensor argument).
inline TensorView view_of(const at::Tensor& t, const char* name) {
  const TensorView v = rows_of(t, name);
  MOEFLOW_CHECK(v.is_contiguous(), name, ": must be contiguous, got shape ", v.shape_str(),
                " with strides not those of a contiguous array");
  return v;
}

inline TensorView opt_view(const at::Tensor& t, const char* name) {
  return t.defined() ? view_of(t, name) : TensorView{};
}

inline TensorView opt_view(const std::optional<at::Tensor>& t, const char* name) {
  return t ? opt_view(*t, name) : TensorView{};
}

// torch's current stream on t's device (nullptr on the CPU).
inline cudaStream_t stream_of(const at::Tensor& t) {
#if MOEFLOW_WITH_CUDA
  if (t.is_cuda()) return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
#endif
  (void)t;
  return nullptr;
}

// x itself when its rows have unit-stride elements, else a contiguous copy
// (moeflow.ops._rows).
inline at::Tensor rows(const at::Tensor& t) {
  if (t.dim() && t.stride(-1) == 1) return t;
  if (t.numel() == 0) return at::empty(t.sizes(), t.options());
  return t.contiguous();
}

inline std::optional<at::Tensor> contiguous_or_none(const std::optional<at::Tensor>& t) {
  if (t && t->defined()) return t->contiguous();
  return std::nullopt;
}

// The entry points of moeflow._C (set once, when moeflow._autograd is
// imported; torch_nodes.cpp).
const ApiTable& api();

// The router's node (torch_router_node.cpp) and the grouped MLP's forward
// (torch_mlp.cpp).
void bind_router_node(py::module_& m);
void bind_mlp(py::module_& m);

}  // namespace moeflow::python
