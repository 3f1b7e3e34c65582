// moeflow._C's checkpoint API (moeflow/checkpoint.h): safetensors files and
// the expert key layouts, on the host. Its arrays are CPU arrays; the arrays
// it returns are DLPack objects (np.from_dlpack, torch.from_dlpack) over
// memory that they keep alive.
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "arrays.h"
#include "moeflow/checkpoint.h"

using namespace moeflow;

namespace moeflow::python {
namespace {

// --- checkpoint (moeflow/checkpoint.h) ------------------------------------

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

}  // namespace

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
}  // namespace moeflow::python
