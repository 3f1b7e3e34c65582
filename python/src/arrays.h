// Array arguments of moeflow._C: what a call receives for an array (a
// torch.Tensor read through its own methods, anything else through DLPack)
// and the TensorViews made from it, with the argument's name in errors.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moeflow/error.h"
#include "moeflow/tensor.h"

namespace nb = nanobind;

namespace moeflow::python {

// An array argument as the call received it: its Python object (kept alive
// while the call uses the memory) and what a view of it needs. A
// torch.Tensor (or subclass) is read through its own methods (data_ptr,
// shape, stride, dtype, device): about a microsecond, and tensors that
// require grad are taken as they are. Anything else goes through DLPack
// (numpy, ...). No constraints are imposed: nanobind would otherwise copy an
// array that does not meet them, and an output written into a copy is lost.
struct Array {
  nb::object obj;
  void* data = nullptr;
  nb::dlpack::dtype dtype{};
  int32_t device_type = 0;
  int32_t device_id = 0;
  std::vector<int64_t> shape, strides;
  bool is_valid() const { return obj.is_valid(); }
};
using AnyArray = Array;  // may have a row stride (the C++ API checks those)

// torch.Tensor and torch's dtypes, looked up once torch has been imported
// (read-only after that: Python objects that live as long as torch does).
struct TorchTypes {
  PyTypeObject* tensor = nullptr;
  std::vector<std::pair<PyObject*, nb::dlpack::dtype>> dtypes;
};

inline const TorchTypes* torch_types() {
  static TorchTypes types;
  if (types.tensor) return &types;
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  if (!torch) return nullptr;  // not imported: nothing passed can be a tensor
  PyObject* tensor = PyObject_GetAttrString(torch, "Tensor");
  if (!tensor || !PyType_Check(tensor)) {
    Py_XDECREF(tensor);
    PyErr_Clear();
    return nullptr;
  }
  using C = nb::dlpack::dtype_code;
  auto dt = [](C code, uint8_t bits) {
    nb::dlpack::dtype d;
    d.code = static_cast<uint8_t>(code);
    d.bits = bits;
    d.lanes = 1;
    return d;
  };
  const std::pair<const char*, nb::dlpack::dtype> names[] = {
      {"float32", dt(C::Float, 32)},        {"float16", dt(C::Float, 16)},
      {"bfloat16", dt(C::Bfloat, 16)},      {"float8_e4m3fn", dt(C::Float8_E4M3FN, 8)},
      {"float8_e5m2", dt(C::Float8_E5M2, 8)}, {"int32", dt(C::Int, 32)},
      {"int64", dt(C::Int, 64)},            {"uint8", dt(C::UInt, 8)},
      {"bool", dt(C::Bool, 8)},             {"float64", dt(C::Float, 64)}};
  for (const auto& [name, d] : names) {
    PyObject* o = PyObject_GetAttrString(torch, name);  // kept: torch's dtype singletons
    if (o) types.dtypes.emplace_back(o, d);
    PyErr_Clear();
  }
  types.tensor = reinterpret_cast<PyTypeObject*>(tensor);
  return &types;
}

inline bool int_tuple(PyObject* t, std::vector<int64_t>& out) {
  if (!t || !PyTuple_Check(t)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(t);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[static_cast<size_t>(i)] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
  }
  return !PyErr_Occurred();
}

// Fills `a` from a torch.Tensor; false (and no Python error set) when it cannot.
inline bool read_torch(PyObject* src, const TorchTypes& tt, Array& a) {
  nb::object ptr = nb::steal(PyObject_CallMethod(src, "data_ptr", nullptr));
  nb::object shape = nb::steal(PyObject_GetAttrString(src, "shape"));
  nb::object stride = nb::steal(PyObject_CallMethod(src, "stride", nullptr));
  nb::object dtype = nb::steal(PyObject_GetAttrString(src, "dtype"));
  nb::object is_cuda = nb::steal(PyObject_GetAttrString(src, "is_cuda"));
  bool ok = ptr.is_valid() && dtype.is_valid() && is_cuda.is_valid() &&
            int_tuple(shape.ptr(), a.shape) && int_tuple(stride.ptr(), a.strides);
  if (ok) {
    a.data = PyLong_AsVoidPtr(ptr.ptr());
    a.dtype = nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Complex), 0, 1};
    for (const auto& [o, d] : tt.dtypes) {
      if (o == dtype.ptr()) a.dtype = d;
    }
    if (is_cuda.ptr() == Py_True) {
      a.device_type = nb::device::cuda::value;
      nb::object dev = nb::steal(PyObject_CallMethod(src, "get_device", nullptr));
      a.device_id = dev.is_valid() ? static_cast<int32_t>(PyLong_AsLong(dev.ptr())) : 0;
    } else {
      nb::object is_cpu = nb::steal(PyObject_GetAttrString(src, "is_cpu"));
      a.device_type = is_cpu.ptr() == Py_True ? static_cast<int32_t>(nb::device::cpu::value) : -1;
    }
    ok = !PyErr_Occurred();
  }
  if (!ok) PyErr_Clear();
  return ok;
}

}  // namespace moeflow::python

namespace nanobind::detail {
template <>
struct type_caster<moeflow::python::Array> {
  using Array = moeflow::python::Array;
  NB_TYPE_CASTER(Array, const_name("Array"))

  bool from_python(handle src, uint8_t flags, cleanup_list* cleanup) noexcept {
    if (src.is_none()) return false;
    const moeflow::python::TorchTypes* tt = moeflow::python::torch_types();
    if (tt && PyObject_TypeCheck(src.ptr(), tt->tensor)) {
      if (!moeflow::python::read_torch(src.ptr(), *tt, value)) return false;
      value.obj = borrow(src);
      return true;
    }
    make_caster<ndarray<>> c;
    if (!c.from_python(src, flags, cleanup)) return false;
    const ndarray<>& nd = c.value;
    value.data = const_cast<void*>(nd.data());
    value.dtype = nd.dtype();
    value.device_type = nd.device_type();
    value.device_id = nd.device_id();
    value.shape.resize(nd.ndim());
    value.strides.resize(nd.ndim());
    for (size_t i = 0; i < nd.ndim(); ++i) {
      value.shape[i] = static_cast<int64_t>(nd.shape(i));
      value.strides[i] = static_cast<int64_t>(nd.stride(i));
    }
    value.obj = borrow(src);
    return true;
  }

  static handle from_cpp(const Array& a, rv_policy, cleanup_list*) noexcept {
    return a.obj.inc_ref();
  }
};
}  // namespace nanobind::detail

namespace moeflow::python {

inline DType dtype_of(const nb::dlpack::dtype& d, const char* name) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(d.code);
  MOEFLOW_CHECK(d.lanes == 1, name, ": vector dtypes are not supported");
  if (code == C::Float && d.bits == 32) return DType::kFloat32;
  if (code == C::Float && d.bits == 16) return DType::kFloat16;
  if (code == C::Float && d.bits == 64) return DType::kFloat64;
  if (code == C::Bfloat && d.bits == 16) return DType::kBFloat16;
  if (code == C::Float8_E4M3FN && d.bits == 8) return DType::kFloat8E4M3;
  if (code == C::Float8_E5M2 && d.bits == 8) return DType::kFloat8E5M2;
  if (code == C::Int && d.bits == 32) return DType::kInt32;
  if (code == C::Int && d.bits == 64) return DType::kInt64;
  if (code == C::UInt && d.bits == 8) return DType::kUInt8;
  if (code == C::Bool && d.bits == 8) return DType::kBool;
  MOEFLOW_CHECK(false, name, ": unsupported dtype (DLPack code ", int(d.code), ", ", int(d.bits),
                " bits); moeflow takes float32/16/64, bfloat16, float8 e4m3fn/e5m2, int32/64, "
                "uint8, bool");
  return DType::kFloat32;
}

inline Device device_of(int32_t type, int32_t id, const char* name) {
  if (type == nb::device::cpu::value) return Device::cpu();
  if (type == nb::device::cuda::value) return Device::cuda(id);
  MOEFLOW_CHECK(false, name, ": arrays must be on the CPU or a CUDA device (DLPack device type ",
                type, ")");
  return Device::cpu();
}

// Any layout (the rows of x, y and their gradients: the C++ API checks them).
inline TensorView rows_of(const Array& a, const char* name) {
  MOEFLOW_CHECK(a.is_valid(), name, ": an array is required");
  MOEFLOW_CHECK(a.shape.size() <= static_cast<size_t>(kMaxDims), name, ": at most ", kMaxDims,
                " dimensions, got ", a.shape.size());
  return TensorView::strided(a.data, dtype_of(a.dtype, name),
                             device_of(a.device_type, a.device_id, name), a.shape, a.strides);
}

// Contiguous (every other array).
inline TensorView view_of(const Array& a, const char* name) {
  const TensorView v = rows_of(a, name);
  MOEFLOW_CHECK(v.is_contiguous(), name, ": must be contiguous, got shape ", v.shape_str(),
                " with strides not those of a contiguous array");
  return v;
}

// None -> an undefined view (the optional arguments of the C++ API).
inline TensorView opt_view(const std::optional<Array>& a, const char* name) {
  return a && a->is_valid() ? view_of(*a, name) : TensorView{};
}

inline cudaStream_t stream_of(uintptr_t s) {
  return reinterpret_cast<cudaStream_t>(s);
}

// --- Returned arrays ------------------------------------------------------------

inline nb::dlpack::dtype dlpack_dtype(DType d) {
  using C = nb::dlpack::dtype_code;
  auto make = [](C code, int bits) {
    nb::dlpack::dtype t;
    t.code = static_cast<uint8_t>(code);
    t.bits = static_cast<uint8_t>(bits);
    t.lanes = 1;
    return t;
  };
  switch (d) {
    case DType::kFloat32:
      return make(C::Float, 32);
    case DType::kFloat16:
      return make(C::Float, 16);
    case DType::kBFloat16:
      return make(C::Bfloat, 16);
    case DType::kFloat8E4M3:
      return make(C::Float8_E4M3FN, 8);
    case DType::kFloat8E5M2:
      return make(C::Float8_E5M2, 8);
    case DType::kInt32:
      return make(C::Int, 32);
    case DType::kInt64:
      return make(C::Int, 64);
    case DType::kUInt8:
      return make(C::UInt, 8);
    case DType::kFloat64:
      return make(C::Float, 64);
    case DType::kBool:
      return make(C::Bool, 8);
  }
  MOEFLOW_CHECK(false, "dtype ", dtype_name(d), " has no DLPack equivalent");
  return make(C::Float, 32);
}

// DType from its name ("bfloat16", "float16", "float32", ... as dtype_name
// writes them; "torch." / "float8_e4m3fn" spellings accepted too).
inline DType dtype_from_name(std::string s) {
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "float8_e4m3fn") s = "float8_e4m3";
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                  DType::kFloat8E5M2, DType::kInt32, DType::kInt64, DType::kUInt8, DType::kBool})
    if (s == dtype_name(d)) return d;
  MOEFLOW_CHECK(false, "dtype: expected float32, float16, bfloat16, float8_e4m3, float8_e5m2, ",
                "int32, int64, uint8 or bool, got '", s, "'");
  return DType::kFloat32;
}

// Returned arrays: nanobind's framework-neutral array object (__dlpack__ and
// the buffer protocol), numpy arrays with an older nanobind.
#if NB_VERSION_MAJOR >= 3 || (NB_VERSION_MAJOR == 2 && NB_VERSION_MINOR >= 2)
using OutArray = nb::ndarray<nb::array_api>;
#else
using OutArray = nb::ndarray<nb::numpy>;
#endif

// The router bindings (router_bindings.cpp).
void bind_router(nb::module_& m);
// The checkpoint bindings (checkpoint_bindings.cpp).
void bind_checkpoint(nb::module_& m);
// The expert-parallel bindings (ep_bindings.cpp).
void bind_ep(nb::module_& m);

}  // namespace moeflow::python
