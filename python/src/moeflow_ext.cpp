// moeflow._C: the C++ API over DLPack arrays (torch, numpy, anything that
// speaks DLPack). Every op takes its outputs as caller-allocated arrays (the
// caller's allocator, e.g. torch's caching allocator: nothing is allocated
// here) and a CUDA stream as an integer (0: the legacy default stream). The
// torch autograd wrappers live in moeflow/ops.py. The checkpoint API
// (safetensors files, expert key layouts) runs on the host: its arrays are
// CPU arrays, and the arrays it returns are DLPack objects (np.from_dlpack,
// torch.from_dlpack) over memory that they keep alive.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moeflow/checkpoint.h"
#include "moeflow/grouped_mlp.h"
#include "moeflow/moeflow.h"
#include "moeflow/permute.h"
#include "moeflow/plan.h"
#include "moeflow/router.h"
#include "moeflow/version.h"

namespace nb = nanobind;
using namespace moeflow;

namespace {

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

const TorchTypes* torch_types() {
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

bool int_tuple(PyObject* t, std::vector<int64_t>& out) {
  if (!t || !PyTuple_Check(t)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(t);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[static_cast<size_t>(i)] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
  }
  return !PyErr_Occurred();
}

// Fills `a` from a torch.Tensor; false (and no Python error set) when it cannot.
bool read_torch(PyObject* src, const TorchTypes& tt, Array& a) {
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

}  // namespace

namespace nanobind::detail {
template <>
struct type_caster<Array> {
  NB_TYPE_CASTER(Array, const_name("Array"))

  bool from_python(handle src, uint8_t flags, cleanup_list* cleanup) noexcept {
    if (src.is_none()) return false;
    const TorchTypes* tt = torch_types();
    if (tt && PyObject_TypeCheck(src.ptr(), tt->tensor)) {
      if (!read_torch(src.ptr(), *tt, value)) return false;
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

namespace {

DType dtype_of(const nb::dlpack::dtype& d, const char* name) {
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

Device device_of(int32_t type, int32_t id, const char* name) {
  if (type == nb::device::cpu::value) return Device::cpu();
  if (type == nb::device::cuda::value) return Device::cuda(id);
  MOEFLOW_CHECK(false, name, ": arrays must be on the CPU or a CUDA device (DLPack device type ",
                type, ")");
  return Device::cpu();
}

// Any layout (the rows of x, y and their gradients: the C++ API checks them).
TensorView rows_of(const Array& a, const char* name) {
  MOEFLOW_CHECK(a.is_valid(), name, ": an array is required");
  MOEFLOW_CHECK(a.shape.size() <= static_cast<size_t>(kMaxDims), name, ": at most ", kMaxDims,
                " dimensions, got ", a.shape.size());
  return TensorView::strided(a.data, dtype_of(a.dtype, name),
                             device_of(a.device_type, a.device_id, name), a.shape, a.strides);
}

// Contiguous (every other array).
TensorView view_of(const Array& a, const char* name) {
  const TensorView v = rows_of(a, name);
  MOEFLOW_CHECK(v.is_contiguous(), name, ": must be contiguous, got shape ", v.shape_str(),
                " with strides not those of a contiguous array");
  return v;
}

// None -> an undefined view (the optional arguments of the C++ API).
TensorView opt_view(const std::optional<Array>& a, const char* name) {
  return a && a->is_valid() ? view_of(*a, name) : TensorView{};
}

cudaStream_t stream_of(uintptr_t s) {
  return reinterpret_cast<cudaStream_t>(s);
}

// A RoutingPlan over caller-allocated arrays (shapes and dtypes as
// allocate_plan makes them, checked here). It holds references to the
// arrays, so they live as long as the plan does.
struct PyPlan {
  RoutingPlan plan;
  std::vector<Array> keep;
};

Tensor adopt(const TensorView& v, const std::vector<int64_t>& shape, DType dtype,
             const char* name) {
  MOEFLOW_CHECK(v.dtype == dtype, "plan.", name, ": expected dtype ", dtype_name(dtype), ", got ",
                dtype_name(v.dtype));
  MOEFLOW_CHECK(v.sizes() == shape, "plan.", name, ": expected shape ",
                TensorView(nullptr, dtype, v.device, shape).shape_str(), ", got ", v.shape_str());
  // PyPlan::keep holds the arrays: a non-null owner that frees nothing.
  return Tensor::adopt(v, std::shared_ptr<void>(v.data, [](void*) {}));
}

PlanConfig plan_config(int E, int align, int64_t capacity) {
  PlanConfig c;
  c.num_experts = E;
  c.align = align;
  c.capacity_rows = capacity;
  return c;
}

PyPlan make_plan(int64_t T, int K, int E, int align, int64_t capacity, const Array& tpe,
                 const Array& padded, const Array& offsets, const Array& dest_row,
                 const Array& row_token, const Array& row_k, const Array& total_rows,
                 const Array& overflow, const Array& invalid_ids) {
  const PlanConfig c = plan_config(E, align, capacity);
  PyPlan p;
  RoutingPlan& r = p.plan;
  r.capacity_rows = plan_capacity_rows(T, K, c);
  r.config = c;
  r.config.capacity_rows = r.capacity_rows;
  r.num_tokens = T;
  r.topk = K;
  const TensorView v0 = view_of(tpe, "tokens_per_expert");
  r.device = v0.device;
  r.tokens_per_expert = adopt(v0, {E}, DType::kInt32, "tokens_per_expert");
  r.padded_tokens_per_expert = adopt(view_of(padded, "padded_tokens_per_expert"), {E},
                                     DType::kInt32, "padded_tokens_per_expert");
  r.expert_row_offsets =
      adopt(view_of(offsets, "expert_row_offsets"), {E + 1}, DType::kInt64, "expert_row_offsets");
  r.dest_row = adopt(view_of(dest_row, "dest_row"), {T, K}, DType::kInt64, "dest_row");
  r.row_token =
      adopt(view_of(row_token, "row_token"), {r.capacity_rows}, DType::kInt32, "row_token");
  r.row_k = adopt(view_of(row_k, "row_k"), {r.capacity_rows}, DType::kInt32, "row_k");
  r.total_rows = adopt(view_of(total_rows, "total_rows"), {1}, DType::kInt64, "total_rows");
  r.overflow = adopt(view_of(overflow, "overflow"), {1}, DType::kInt32, "overflow");
  r.invalid_ids = adopt(view_of(invalid_ids, "invalid_ids"), {1}, DType::kInt32, "invalid_ids");
  for (const Tensor* t : {&r.padded_tokens_per_expert, &r.expert_row_offsets, &r.dest_row,
                          &r.row_token, &r.row_k, &r.total_rows, &r.overflow, &r.invalid_ids})
    MOEFLOW_CHECK(t->device() == r.device, "plan arrays must all be on ", r.device.str(),
                  ", got one on ", t->device().str());
  p.keep = {tpe, padded, offsets, dest_row, row_token, row_k, total_rows, overflow, invalid_ids};
  return p;
}

// The plan over two flat buffers, split as moeflow.Plan splits them:
// int64 [E+1 + T*K + 1] = expert_row_offsets, dest_row, total_rows; int32
// [2E + 2*capacity + 2] = tokens_per_expert, padded_tokens_per_expert,
// row_token, row_k, overflow, invalid_ids. (Two arrays to read per plan
// instead of nine.)
PyPlan make_plan_from_buffers(int64_t T, int K, int E, int align, int64_t capacity,
                              const Array& buf64, const Array& buf32) {
  const PlanConfig c = plan_config(E, align, capacity);
  const int64_t cap = plan_capacity_rows(T, K, c);
  const TensorView b64 = view_of(buf64, "buffer64");
  const TensorView b32 = view_of(buf32, "buffer32");
  const int64_t n64 = E + 1 + T * K + 1, n32 = 2 * E + 2 * cap + 2;
  MOEFLOW_CHECK(b64.dtype == DType::kInt64 && b64.ndim == 1 && b64.shape[0] == n64,
                "buffer64 must be int64 [", n64, "], got ", b64.str());
  MOEFLOW_CHECK(b32.dtype == DType::kInt32 && b32.ndim == 1 && b32.shape[0] == n32,
                "buffer32 must be int32 [", n32, "] on ", b64.device.str(), ", got ", b32.str());
  MOEFLOW_CHECK(b32.device == b64.device, "buffer32 must be on ", b64.device.str(), ", got ",
                b32.str());
  PyPlan p;
  RoutingPlan& r = p.plan;
  r.capacity_rows = cap;
  r.config = c;
  r.config.capacity_rows = cap;
  r.num_tokens = T;
  r.topk = K;
  r.device = b64.device;
  int64_t o64 = 0, o32 = 0;
  auto part = [&](const TensorView& b, int64_t& off, std::vector<int64_t> shape, DType dt,
                  const char* name) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const TensorView v(static_cast<char*>(b.data) + off * static_cast<int64_t>(dtype_size(dt)),
                       dt, b.device, shape);
    off += n;
    return adopt(v, shape, dt, name);
  };
  r.expert_row_offsets = part(b64, o64, {E + 1}, DType::kInt64, "expert_row_offsets");
  r.dest_row = part(b64, o64, {T, K}, DType::kInt64, "dest_row");
  r.total_rows = part(b64, o64, {1}, DType::kInt64, "total_rows");
  r.tokens_per_expert = part(b32, o32, {E}, DType::kInt32, "tokens_per_expert");
  r.padded_tokens_per_expert = part(b32, o32, {E}, DType::kInt32, "padded_tokens_per_expert");
  r.row_token = part(b32, o32, {cap}, DType::kInt32, "row_token");
  r.row_k = part(b32, o32, {cap}, DType::kInt32, "row_k");
  r.overflow = part(b32, o32, {1}, DType::kInt32, "overflow");
  r.invalid_ids = part(b32, o32, {1}, DType::kInt32, "invalid_ids");
  p.keep = {buf64, buf32};
  return p;
}

Activation activation_of(const std::string& s) {
  if (s == "swiglu") return Activation::kSwiGLU;
  if (s == "geglu") return Activation::kGeGLU;
  if (s == "clamped_quick_geglu") return Activation::kClampedQuickGeGLU;
  if (s == "gelu") return Activation::kGelu;
  if (s == "relu") return Activation::kRelu;
  if (s == "squared_relu") return Activation::kSquaredRelu;
  MOEFLOW_CHECK(false, "activation: expected swiglu, geglu, clamped_quick_geglu, gelu, relu or ",
                "squared_relu, got '", s, "'");
  return Activation::kSwiGLU;
}

GroupedMlpConfig mlp_config(const std::string& act, int glu_interleave, float alpha, float limit,
                            float offset) {
  GroupedMlpConfig c;
  c.activation = activation_of(act);
  c.glu_interleave = glu_interleave;
  c.params.alpha = alpha;
  c.params.limit = limit;
  c.params.offset = offset;
  return c;
}

GroupedMlpWeights mlp_weights(const Array& fc1, const Array& fc2, const std::optional<Array>& b1,
                              const std::optional<Array>& b2) {
  GroupedMlpWeights w;
  w.fc1 = view_of(fc1, "fc1");
  w.fc2 = view_of(fc2, "fc2");
  w.bias1 = opt_view(b1, "bias1");
  w.bias2 = opt_view(b2, "bias2");
  return w;
}

GroupLayout layout(const Array& offsets, const std::optional<Array>& real_rows) {
  GroupLayout g;
  g.offsets = view_of(offsets, "offsets");
  g.real_rows = opt_view(real_rows, "real_rows");
  return g;
}

ScoreFunction score_function_of(const std::string& s) {
  if (s == "softmax") return ScoreFunction::kSoftmax;
  if (s == "sigmoid") return ScoreFunction::kSigmoid;
  MOEFLOW_CHECK(false, "score_function: expected softmax or sigmoid, got '", s, "'");
  return ScoreFunction::kSoftmax;
}

RouterConfig router_config(int E, int K, const std::string& score_function, bool pre_softmax,
                           int num_groups, int group_topk, float topk_scaling_factor,
                           float aux_loss_coeff, float z_loss_coeff, float seq_aux_loss_coeff) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = K;
  c.score_function = score_function_of(score_function);
  c.pre_softmax = pre_softmax;
  c.num_groups = num_groups;
  c.group_topk = group_topk;
  c.topk_scaling_factor = topk_scaling_factor;
  c.aux_loss_coeff = aux_loss_coeff;
  c.z_loss_coeff = z_loss_coeff;
  c.seq_aux_loss_coeff = seq_aux_loss_coeff;
  return c;
}

DropPolicy drop_policy_of(const std::string& s) {
  if (s == "probs") return DropPolicy::kProbs;
  if (s == "position") return DropPolicy::kPosition;
  MOEFLOW_CHECK(false, "drop_policy must be 'probs' or 'position', got '", s, "'");
  return DropPolicy::kProbs;
}

// --- checkpoint (moeflow/checkpoint.h) ------------------------------------

nb::dlpack::dtype dlpack_dtype(DType d) {
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
DType dtype_from_name(std::string s) {
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

// A CPU array over `v`'s memory, kept alive by `owner`.
OutArray array_over(const TensorView& v, nb::handle owner) {
  const std::vector<int64_t> sizes = v.sizes();
  std::vector<size_t> shape(sizes.begin(), sizes.end());
  return OutArray(v.data, shape.size(), shape.data(), owner, nullptr, dlpack_dtype(v.dtype),
                  nb::device::cpu::value);
}

// A CPU array that shares (and keeps) a Tensor's storage.
OutArray array_of(const Tensor& t) {
  MOEFLOW_CHECK(t.device().is_cpu(), "expected a CPU tensor, got one on ", t.device().str());
  nb::capsule owner(new Tensor(t), [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  return array_over(t.view(), owner);
}

std::vector<std::pair<std::string, TensorView>> entry_views(
    const std::vector<std::pair<std::string, Array>>& tensors) {
  std::vector<std::pair<std::string, TensorView>> v;
  for (const auto& [key, a] : tensors) v.emplace_back(key, view_of(a, key.c_str()));
  return v;
}

std::vector<TensorView> part_views(const std::vector<Array>& parts, const char* name) {
  std::vector<TensorView> v;
  for (const Array& a : parts) v.push_back(view_of(a, name));
  return v;
}

std::vector<std::pair<std::string, OutArray>> export_arrays(
    const std::vector<std::pair<std::string, Tensor>>& entries) {
  std::vector<std::pair<std::string, OutArray>> out;
  for (const auto& [key, t] : entries) out.emplace_back(key, array_of(t));
  return out;
}

std::string expert_param_repr(const ExpertParam& p) {
  std::string shape;
  for (size_t i = 0; i < p.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(p.shape[i]);
  return "ExpertParam(prefix='" + p.prefix + "', stem='" + p.stem +
         "', num_experts=" + std::to_string(p.num_experts) + ", shape=[" + shape + "], dtype='" +
         dtype_name(p.dtype) + "', glu_interleave=" + std::to_string(p.glu_interleave) + ")";
}

void bind_checkpoint(nb::module_& m) {
  nb::class_<SafetensorsFile>(
      m, "SafetensorsFile",
      "A safetensors file held in memory (header checked entry by entry). view(key) and f[key] "
      "return CPU DLPack arrays over the file's bytes, which keep the file alive.")
      .def_static("read", &SafetensorsFile::read, nb::arg("path"), "Reads a whole file.")
      .def_static(
          "parse",
          [](nb::bytes data, const std::string& name) {
            const auto* b = static_cast<const uint8_t*>(data.data());
            return SafetensorsFile::parse(std::vector<uint8_t>(b, b + data.size()), name);
          },
          nb::arg("data"), nb::arg("name") = "<memory>", "From the bytes of a whole file.")
      .def("keys", &SafetensorsFile::keys, "The tensor keys, sorted.")
      .def("__contains__", &SafetensorsFile::contains, nb::arg("key"))
      .def("__len__", [](const SafetensorsFile& f) { return f.keys().size(); })
      .def_prop_ro("metadata", &SafetensorsFile::metadata, "The __metadata__ strings (a dict).")
      .def(
          "view",
          [](const SafetensorsFile& f, const std::string& key) {
            return array_over(f.view(key), nb::find(&f));
          },
          nb::arg("key"), "The tensor `key` (a CPU DLPack array over the file's bytes).")
      .def(
          "__getitem__",
          [](const SafetensorsFile& f, const std::string& key) {
            return array_over(f.view(key), nb::find(&f));
          },
          nb::arg("key"));

  m.def(
      "write_safetensors",
      [](const std::string& path, const std::vector<std::pair<std::string, Array>>& tensors,
         const std::map<std::string, std::string>& metadata) {
        write_safetensors(path, entry_views(tensors), metadata);
      },
      nb::arg("path"), nb::arg("tensors"),
      nb::arg("metadata") = std::map<std::string, std::string>{},
      "Writes [(key, CPU contiguous array), ...] (keys unique) and the metadata strings as a "
      "safetensors file.");
  m.def(
      "serialize_safetensors",
      [](const std::vector<std::pair<std::string, Array>>& tensors,
         const std::map<std::string, std::string>& metadata) {
        const std::vector<uint8_t> b = serialize_safetensors(entry_views(tensors), metadata);
        return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
      },
      nb::arg("tensors"), nb::arg("metadata") = std::map<std::string, std::string>{},
      "write_safetensors to bytes.");

  nb::enum_<ExpertKeyLayout>(m, "ExpertKeyLayout",
                             "per_expert: <prefix><stem>0 ... <stem>{E-1}; grouped: one "
                             "<prefix><stem> [E, ...].")
      .value("per_expert", ExpertKeyLayout::kPerExpert)
      .value("grouped", ExpertKeyLayout::kGrouped);

  nb::class_<ExpertParam>(m, "ExpertParam",
                          "One expert parameter: a weight [out, in] or bias [out] per expert, "
                          "its keys <prefix><stem> (grouped) or <prefix><stem><i> (per expert); "
                          "glu_interleave is the GLU row order in the file (0: halves).")
      .def(
          "__init__",
          [](ExpertParam* p, const std::string& prefix, const std::string& stem, int num_experts,
             const std::vector<int64_t>& shape, const std::string& dtype, int glu_interleave) {
            new (p) ExpertParam();
            p->prefix = prefix;
            p->stem = stem;
            p->num_experts = num_experts;
            p->shape = shape;
            p->dtype = dtype_from_name(dtype);
            p->glu_interleave = glu_interleave;
          },
          nb::kw_only(), nb::arg("prefix"), nb::arg("stem") = "weight", nb::arg("num_experts"),
          nb::arg("shape"), nb::arg("dtype") = "bfloat16", nb::arg("glu_interleave") = 0)
      .def_rw("prefix", &ExpertParam::prefix)
      .def_rw("stem", &ExpertParam::stem)
      .def_rw("num_experts", &ExpertParam::num_experts)
      .def_rw("shape", &ExpertParam::shape)
      .def_prop_rw(
          "dtype", [](const ExpertParam& p) { return std::string(dtype_name(p.dtype)); },
          [](ExpertParam& p, const std::string& d) { p.dtype = dtype_from_name(d); })
      .def_rw("glu_interleave", &ExpertParam::glu_interleave)
      .def("__repr__", &expert_param_repr);

  m.def("find_expert_layout", &find_expert_layout, nb::arg("file"), nb::arg("param"),
        "The key layout `file` uses for `param` (raises when neither, both, or an incomplete / "
        "extra set of per-expert keys is found).");
  m.def(
      "load_expert_param",
      [](const SafetensorsFile& f, const ExpertParam& p, const Array& dst) {
        load_expert_param(f, p, view_of(dst, "dst"));
      },
      nb::arg("file"), nb::arg("param"), nb::arg("dst"),
      "Loads `param` into `dst` (a CPU [E, ...shape] array, or a list of E arrays of shape) in "
      "the canonical halves row order.");
  m.def(
      "load_expert_param",
      [](const SafetensorsFile& f, const ExpertParam& p, const std::vector<Array>& dst) {
        load_expert_param(f, p, part_views(dst, "dst"));
      },
      nb::arg("file"), nb::arg("param"), nb::arg("dst"));
  m.def(
      "export_expert_param",
      [](const ExpertParam& p, const Array& src, ExpertKeyLayout layout) {
        return export_arrays(export_expert_param(p, view_of(src, "src"), layout));
      },
      nb::arg("param"), nb::arg("src"), nb::arg("layout"),
      "[(key, CPU array), ...] storing `src` (canonical halves rows, a CPU [E, ...shape] array "
      "or a list of E arrays) in `layout` and the GLU row order of `param`.");
  m.def(
      "export_expert_param",
      [](const ExpertParam& p, const std::vector<Array>& src, ExpertKeyLayout layout) {
        return export_arrays(export_expert_param(p, part_views(src, "src"), layout));
      },
      nb::arg("param"), nb::arg("src"), nb::arg("layout"));
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() =
      "moeflow: the MoE token path (router, routing plan, permute, grouped expert MLP) over "
      "DLPack";
  m.attr("__version__") = MOEFLOW_VERSION_STRING;
  nb::exception<Error>(m, "Error", PyExc_RuntimeError);
  m.def("cuda_device_count", &cuda_device_count);
  m.def(
      "build_info",
      []() {
        const BuildInfo b = build_info();
        nb::dict d;
        d["version"] = b.version;
        d["cuda_backend"] = b.cuda_backend;
        auto str_or_none = [](const std::string& s) -> nb::object {
          return s.empty() ? nb::object(nb::none()) : nb::object(nb::str(s.c_str()));
        };
        d["cuda_version"] = str_or_none(b.cuda_version);
        d["nccl_version"] = str_or_none(b.nccl_version);
        nb::list archs;
        for (const std::string& a : b.cuda_archs) archs.append(nb::str(a.c_str()));
        d["cuda_archs"] = archs;
        return d;
      },
      "What this build contains: {'version', 'cuda_backend' (bool), 'cuda_version', "
      "'nccl_version' (str, None without CUDA), 'cuda_archs' (list of str)}.");

  // The router (moeflow/router.h). The RouterConfig fields are keyword
  // arguments, the same in the three calls that take them.
#define MOEFLOW_ROUTER_CONFIG_ARGS                                                            \
  nb::arg("num_experts"), nb::arg("topk"), nb::arg("score_function"), nb::arg("pre_softmax"), \
      nb::arg("num_groups"), nb::arg("group_topk"), nb::arg("topk_scaling_factor"),           \
      nb::arg("aux_loss_coeff"), nb::arg("z_loss_coeff"), nb::arg("seq_aux_loss_coeff")
  m.def(
      "router_workspace_bytes",
      [](int64_t T, int E, int K, const std::string& sf, bool pre, int ng, int gk, float scale,
         float aux, float z, float seq, int64_t num_sequences) {
        return router_workspace_bytes(T, router_config(E, K, sf, pre, ng, gk, scale, aux, z, seq),
                                      num_sequences);
      },
      nb::arg("num_tokens"), MOEFLOW_ROUTER_CONFIG_ARGS, nb::arg("num_sequences") = 0);
  m.def(
      "router_forward",
      [](const Array& logits, int E, int K, const std::string& sf, bool pre, int ng, int gk,
         float scale, float aux, float z, float seq, const Array& ids, const Array& probs,
         const Array& tpe, const std::optional<Array>& aux_loss,
         const std::optional<Array>& z_loss, const std::optional<Array>& seq_aux_loss,
         const std::optional<Array>& seq_tpe, const std::optional<Array>& nonfinite,
         const std::optional<Array>& invalid_cu_seqlens, const std::optional<Array>& bias,
         const std::optional<Array>& padding_mask, const std::optional<Array>& cu_seqlens,
         const std::optional<Array>& ws, uintptr_t s) {
        RouterOutputs out;
        out.topk_ids = view_of(ids, "topk_ids");
        out.probs = view_of(probs, "probs");
        out.tokens_per_expert = view_of(tpe, "tokens_per_expert");
        out.aux_loss = opt_view(aux_loss, "aux_loss");
        out.z_loss = opt_view(z_loss, "z_loss");
        out.seq_aux_loss = opt_view(seq_aux_loss, "seq_aux_loss");
        out.seq_tokens_per_expert = opt_view(seq_tpe, "seq_tokens_per_expert");
        out.nonfinite = opt_view(nonfinite, "nonfinite");
        out.invalid_cu_seqlens = opt_view(invalid_cu_seqlens, "invalid_cu_seqlens");
        RouterTokenInfo tokens{opt_view(padding_mask, "padding_mask"),
                               opt_view(cu_seqlens, "cu_seqlens")};
        router_forward(view_of(logits, "logits"),
                       router_config(E, K, sf, pre, ng, gk, scale, aux, z, seq), out,
                       opt_view(bias, "expert_bias"), opt_view(ws, "workspace"), stream_of(s),
                       tokens);
      },
      nb::arg("logits"), MOEFLOW_ROUTER_CONFIG_ARGS, nb::arg("topk_ids"), nb::arg("probs"),
      nb::arg("tokens_per_expert"), nb::arg("aux_loss").none() = nb::none(),
      nb::arg("z_loss").none() = nb::none(), nb::arg("seq_aux_loss").none() = nb::none(),
      nb::arg("seq_tokens_per_expert").none() = nb::none(),
      nb::arg("nonfinite").none() = nb::none(),
      nb::arg("invalid_cu_seqlens").none() = nb::none(),
      nb::arg("expert_bias").none() = nb::none(), nb::arg("padding_mask").none() = nb::none(),
      nb::arg("cu_seqlens").none() = nb::none(), nb::arg("workspace").none() = nb::none(),
      nb::arg("stream") = 0);
  m.def(
      "router_backward",
      [](const Array& logits, const Array& ids, const std::optional<Array>& tpe, int E, int K,
         const std::string& sf, bool pre, int ng, int gk, float scale, float aux, float z,
         float seq, const Array& dprobs, const std::optional<Array>& daux,
         const std::optional<Array>& dz, const std::optional<Array>& dseq,
         const std::optional<Array>& padding_mask, const std::optional<Array>& cu_seqlens,
         const std::optional<Array>& seq_tpe, const Array& dlogits, uintptr_t s) {
        RouterGrads g;
        g.dprobs = view_of(dprobs, "dprobs");
        g.daux_loss = opt_view(daux, "daux_loss");
        g.dz_loss = opt_view(dz, "dz_loss");
        g.dseq_aux_loss = opt_view(dseq, "dseq_aux_loss");
        RouterTokenInfo tokens{opt_view(padding_mask, "padding_mask"),
                               opt_view(cu_seqlens, "cu_seqlens")};
        router_backward(view_of(logits, "logits"), view_of(ids, "topk_ids"),
                        opt_view(tpe, "tokens_per_expert"), g,
                        router_config(E, K, sf, pre, ng, gk, scale, aux, z, seq),
                        view_of(dlogits, "dlogits"), stream_of(s), tokens,
                        opt_view(seq_tpe, "seq_tokens_per_expert"));
      },
      nb::arg("logits"), nb::arg("topk_ids"), nb::arg("tokens_per_expert").none(),
      MOEFLOW_ROUTER_CONFIG_ARGS, nb::arg("dprobs"), nb::arg("daux_loss").none(),
      nb::arg("dz_loss").none(), nb::arg("dseq_aux_loss").none(), nb::arg("padding_mask").none(),
      nb::arg("cu_seqlens").none(), nb::arg("seq_tokens_per_expert").none(), nb::arg("dlogits"),
      nb::arg("stream") = 0);
#undef MOEFLOW_ROUTER_CONFIG_ARGS
  m.def("router_capacity", &router_capacity, nb::arg("num_tokens"), nb::arg("topk"),
        nb::arg("num_experts"), nb::arg("capacity_factor"), nb::arg("min_capacity") = 0);
  m.def("router_capacity_workspace_bytes", &router_capacity_workspace_bytes,
        nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"));
  m.def(
      "router_apply_capacity",
      [](const Array& ids, const std::optional<Array>& probs, int E, double cf,
         const std::string& policy, int64_t min_capacity, const Array& kept,
         const std::optional<Array>& dropped, const std::optional<Array>& ws, uintptr_t s) {
        RouterCapacityConfig c;
        c.num_experts = E;
        c.capacity_factor = cf;
        c.drop_policy = drop_policy_of(policy);
        c.min_capacity = min_capacity;
        router_apply_capacity(view_of(ids, "topk_ids"), opt_view(probs, "probs"), c,
                              view_of(kept, "kept_ids"), opt_view(dropped, "dropped"),
                              opt_view(ws, "workspace"), stream_of(s));
      },
      nb::arg("topk_ids"), nb::arg("probs").none(), nb::arg("num_experts"),
      nb::arg("capacity_factor"), nb::arg("drop_policy"), nb::arg("min_capacity"),
      nb::arg("kept_ids"), nb::arg("dropped").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0);
  m.def(
      "router_update_expert_bias",
      [](const Array& tpe, const Array& bias, float rate, uintptr_t s) {
        router_update_expert_bias(view_of(tpe, "tokens_per_expert"), view_of(bias, "expert_bias"),
                                  rate, stream_of(s));
      },
      nb::arg("tokens_per_expert"), nb::arg("expert_bias"), nb::arg("rate"), nb::arg("stream") = 0);

  m.def(
      "plan_capacity_rows",
      [](int64_t T, int K, int E, int align, int64_t capacity) {
        return plan_capacity_rows(T, K, plan_config(E, align, capacity));
      },
      nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"), nb::arg("align"),
      nb::arg("capacity_rows"));
  m.def(
      "plan_workspace_bytes",
      [](int64_t T, int K, int E, int align, int64_t capacity) {
        return plan_workspace_bytes(T, K, plan_config(E, align, capacity));
      },
      nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"), nb::arg("align"),
      nb::arg("capacity_rows"));

  nb::class_<PyPlan>(m, "PlanView",
                     "A RoutingPlan over caller-allocated arrays (moeflow.Plan makes them).")
      .def(nb::new_(&make_plan), nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"),
           nb::arg("align"), nb::arg("capacity_rows"), nb::arg("tokens_per_expert"),
           nb::arg("padded_tokens_per_expert"), nb::arg("expert_row_offsets"), nb::arg("dest_row"),
           nb::arg("row_token"), nb::arg("row_k"), nb::arg("total_rows"), nb::arg("overflow"),
           nb::arg("invalid_ids"))
      .def_static("from_buffers", &make_plan_from_buffers, nb::arg("num_tokens"),
                  nb::arg("topk"), nb::arg("num_experts"), nb::arg("align"),
                  nb::arg("capacity_rows"), nb::arg("buffer64"), nb::arg("buffer32"),
                  "The plan over moeflow.Plan's two flat buffers (int64: expert_row_offsets, "
                  "dest_row, total_rows; int32: tokens_per_expert, padded_tokens_per_expert, "
                  "row_token, row_k, overflow, invalid_ids).")
      .def_prop_ro("capacity_rows", [](const PyPlan& p) { return p.plan.capacity_rows; })
      .def_prop_ro("num_tokens", [](const PyPlan& p) { return p.plan.num_tokens; })
      .def_prop_ro("topk", [](const PyPlan& p) { return p.plan.topk; })
      .def_prop_ro("num_experts", [](const PyPlan& p) { return p.plan.num_experts(); })
      .def_prop_ro("align", [](const PyPlan& p) { return p.plan.align(); });

  m.def(
      "build_plan",
      [](const Array& ids, PyPlan& p, const std::optional<Array>& ws, uintptr_t s) {
        build_plan(view_of(ids, "topk_ids"), p.plan, opt_view(ws, "workspace"), stream_of(s));
      },
      nb::arg("topk_ids"), nb::arg("plan"), nb::arg("workspace").none() = nb::none(),
      nb::arg("stream") = 0);
  m.def(
      "build_plan_from_mask",
      [](const Array& mask, PyPlan& p, const std::optional<Array>& ws, uintptr_t s) {
        build_plan_from_mask(view_of(mask, "routing_mask"), p.plan, opt_view(ws, "workspace"),
                             stream_of(s));
      },
      nb::arg("routing_mask"), nb::arg("plan"), nb::arg("workspace").none() = nb::none(),
      nb::arg("stream") = 0);

  m.def(
      "permute",
      [](const AnyArray& x, const PyPlan& p, const AnyArray& y, const std::optional<Array>& probs,
         const std::optional<Array>& pprobs, const std::optional<Array>& scales,
         const std::optional<Array>& pscales, uintptr_t s) {
        PermuteExtras e;
        e.probs = opt_view(probs, "probs");
        e.permuted_probs = opt_view(pprobs, "permuted_probs");
        e.scales = opt_view(scales, "scales");
        e.permuted_scales = opt_view(pscales, "permuted_scales");
        permute(rows_of(x, "x"), p.plan, rows_of(y, "y"), e, stream_of(s));
      },
      nb::arg("x"), nb::arg("plan"), nb::arg("y"), nb::arg("probs").none() = nb::none(),
      nb::arg("permuted_probs").none() = nb::none(), nb::arg("scales").none() = nb::none(),
      nb::arg("permuted_scales").none() = nb::none(), nb::arg("stream") = 0);
  m.def(
      "unpermute",
      [](const AnyArray& y, const PyPlan& p, const AnyArray& out, const std::optional<Array>& probs,
         uintptr_t s) {
        unpermute(rows_of(y, "y"), p.plan, rows_of(out, "out"), opt_view(probs, "merge_probs"),
                  stream_of(s));
      },
      nb::arg("y"), nb::arg("plan"), nb::arg("out"), nb::arg("merge_probs").none() = nb::none(),
      nb::arg("stream") = 0);
  m.def(
      "permute_backward",
      [](const AnyArray& dy, const PyPlan& p, const AnyArray& dx,
         const std::optional<Array>& dpprobs, const std::optional<Array>& dprobs, uintptr_t s) {
        permute_backward(rows_of(dy, "dy"), p.plan, rows_of(dx, "dx"),
                         opt_view(dpprobs, "dpermuted_probs"), opt_view(dprobs, "dprobs"),
                         stream_of(s));
      },
      nb::arg("dy"), nb::arg("plan"), nb::arg("dx"), nb::arg("dpermuted_probs").none() = nb::none(),
      nb::arg("dprobs").none() = nb::none(), nb::arg("stream") = 0);
  m.def(
      "unpermute_backward",
      [](const AnyArray& dout, const PyPlan& p, const std::optional<AnyArray>& y_fwd,
         const std::optional<Array>& probs, const AnyArray& dy, const std::optional<Array>& dprobs,
         uintptr_t s) {
        unpermute_backward(rows_of(dout, "dout"), p.plan,
                           y_fwd ? rows_of(*y_fwd, "y_fwd") : TensorView{},
                           opt_view(probs, "probs"), rows_of(dy, "dy"), opt_view(dprobs, "dprobs"),
                           stream_of(s));
      },
      nb::arg("dout"), nb::arg("plan"), nb::arg("y_fwd").none(), nb::arg("probs").none(),
      nb::arg("dy"),
      nb::arg("dprobs").none() = nb::none(), nb::arg("stream") = 0);

  // The grouped expert MLP (moeflow/grouped_mlp.h) with stacked weights.
  m.def(
      "grouped_mlp_forward",
      [](const AnyArray& x, const Array& fc1, const Array& fc2, const std::optional<Array>& b1,
         const std::optional<Array>& b2, const Array& offsets,
         const std::optional<Array>& real_rows, const std::optional<Array>& probs,
         const std::string& act, int glu_interleave, float alpha, float limit, float offset,
         const AnyArray& y, const Array& h, const Array& a, uintptr_t s) {
        GroupedMlpSaved saved{view_of(h, "h"), view_of(a, "a")};
        grouped_mlp_forward(rows_of(x, "x"), mlp_weights(fc1, fc2, b1, b2),
                            layout(offsets, real_rows), opt_view(probs, "probs"),
                            mlp_config(act, glu_interleave, alpha, limit, offset), rows_of(y, "y"),
                            saved, stream_of(s));
      },
      nb::arg("x"), nb::arg("fc1"), nb::arg("fc2"), nb::arg("bias1").none(),
      nb::arg("bias2").none(), nb::arg("offsets"), nb::arg("real_rows").none(),
      nb::arg("probs").none(), nb::arg("activation"), nb::arg("glu_interleave"), nb::arg("alpha"),
      nb::arg("limit"), nb::arg("offset"), nb::arg("y"), nb::arg("h"), nb::arg("a"),
      nb::arg("stream") = 0);
  m.def(
      "grouped_mlp_backward_dgrad",
      [](const AnyArray& dy, const Array& fc1, const Array& fc2, const std::optional<Array>& b1,
         const std::optional<Array>& b2, const Array& offsets,
         const std::optional<Array>& real_rows, const std::optional<Array>& probs,
         const std::string& act, int glu_interleave, float alpha, float limit, float offset,
         const Array& h, const AnyArray& dx, const Array& d_h, const std::optional<Array>& dprobs,
         uintptr_t s) {
        GroupedMlpSaved saved{view_of(h, "h"), TensorView{}};
        grouped_mlp_backward_dgrad(
            rows_of(dy, "dy"), mlp_weights(fc1, fc2, b1, b2), layout(offsets, real_rows),
            opt_view(probs, "probs"), mlp_config(act, glu_interleave, alpha, limit, offset), saved,
            rows_of(dx, "dx"), view_of(d_h, "d_h"), opt_view(dprobs, "dprobs"), stream_of(s));
      },
      nb::arg("dy"), nb::arg("fc1"), nb::arg("fc2"), nb::arg("bias1").none(),
      nb::arg("bias2").none(), nb::arg("offsets"), nb::arg("real_rows").none(),
      nb::arg("probs").none(), nb::arg("activation"), nb::arg("glu_interleave"), nb::arg("alpha"),
      nb::arg("limit"), nb::arg("offset"), nb::arg("h"), nb::arg("dx"), nb::arg("d_h"),
      nb::arg("dprobs").none(), nb::arg("stream") = 0);
  m.def(
      "grouped_mlp_recompute_activation",
      [](const Array& h, const Array& offsets, const std::optional<Array>& real_rows,
         const std::optional<Array>& probs, const std::string& act, int glu_interleave,
         float alpha, float limit, float offset, const Array& a, uintptr_t s) {
        grouped_mlp_recompute_activation(view_of(h, "h"), layout(offsets, real_rows),
                                         opt_view(probs, "probs"),
                                         mlp_config(act, glu_interleave, alpha, limit, offset),
                                         view_of(a, "a"), stream_of(s));
      },
      nb::arg("h"), nb::arg("offsets"), nb::arg("real_rows").none(), nb::arg("probs").none(),
      nb::arg("activation"), nb::arg("glu_interleave"), nb::arg("alpha"), nb::arg("limit"),
      nb::arg("offset"), nb::arg("a"), nb::arg("stream") = 0);
  m.def(
      "grouped_mlp_backward_wgrad",
      [](const AnyArray& dy, const AnyArray& x, const Array& offsets,
         const std::optional<Array>& real_rows, const Array& h, const Array& a, const Array& d_h,
         const std::optional<Array>& dw1, const std::optional<Array>& dw2,
         const std::optional<Array>& db1, const std::optional<Array>& db2, bool accumulate,
         uintptr_t s) {
        GroupedMlpSaved saved{view_of(h, "h"), view_of(a, "a")};
        GroupedMlpGrads g;
        g.dw1 = opt_view(dw1, "dw1");
        g.dw2 = opt_view(dw2, "dw2");
        g.dbias1 = opt_view(db1, "dbias1");
        g.dbias2 = opt_view(db2, "dbias2");
        g.accumulate = accumulate;
        grouped_mlp_backward_wgrad(rows_of(dy, "dy"), rows_of(x, "x"), layout(offsets, real_rows),
                                   saved, view_of(d_h, "d_h"), g, stream_of(s));
      },
      nb::arg("dy"), nb::arg("x"), nb::arg("offsets"), nb::arg("real_rows").none(), nb::arg("h"),
      nb::arg("a"), nb::arg("d_h"), nb::arg("dw1").none(), nb::arg("dw2").none(),
      nb::arg("dbias1").none(), nb::arg("dbias2").none(), nb::arg("accumulate"),
      nb::arg("stream") = 0);

  bind_checkpoint(m);
}
