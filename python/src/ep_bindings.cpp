// moeflow._C's expert-parallel API (moeflow/ep.h): a group made from an NCCL
// unique id that the framework broadcasts (moeflow.ep.Group does it over a
// torch.distributed process group), dispatch returning a handle, and combine
// and the backward functions taking it. The handle's arrays (the received
// rows and their plan) are DLPack objects over the handle's buffers: they
// keep its state alive. Outputs of combine and the backward functions are
// caller-allocated, streams are integers (0: the legacy default stream).
// FP8 dispatch: the group's backward_dtype, scale_cols and scale_dtype
// (EpOptions) are keyword arguments; dispatch takes the scales, and
// EpHandle.scales are the received rows' scales.
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <array>
#include <cstring>
#include <memory>
#include <string>

#include "arrays.h"
#include "moeflow/ep.h"
#include "moeflow/ep_reference.h"

namespace moeflow::python {
namespace {

struct PyEpGroup {
  std::unique_ptr<EpGroup> group;
};

// One dispatch: its handle and the views of its result.
struct PyEpHandle {
  EpHandle handle;
  EpDispatchResult result;
};

// A device array over `v`, keeping the handle's state alive (returned by
// value: the array owns its reference to the state).
nb::object device_array(const TensorView& v, const EpHandle& h) {
  const std::vector<int64_t> sizes = v.sizes();
  std::vector<size_t> shape(sizes.begin(), sizes.end());
  std::vector<int64_t> strides(v.strides, v.strides + v.ndim);
  nb::capsule owner(new EpHandle(h), [](void* p) noexcept { delete static_cast<EpHandle*>(p); });
  OutArray a(v.data, shape.size(), shape.data(), owner, strides.data(), dlpack_dtype(v.dtype),
             v.device.is_cpu() ? nb::device::cpu::value : nb::device::cuda::value, v.device.index);
  return nb::cast(std::move(a), nb::rv_policy::reference);  // (the capsule owns the state)
}

EpBackend backend_from_name(const std::string& s) {
  if (s == "nccl") return EpBackend::kNccl;
  if (s == "nvlink") return EpBackend::kNvlink;
  MOEFLOW_CHECK(false, "backend: expected 'nccl' or 'nvlink', got '", s, "'");
  return EpBackend::kNccl;
}

void make_group(PyEpGroup* self, nb::bytes unique_id, int rank, int world_size, int device,
                const std::string& backend, int num_experts, int topk, int64_t hidden,
                const std::string& dtype, int align, int64_t max_tokens_per_rank,
                int64_t capacity_rows, double timeout_s, const std::string& backward_dtype,
                int64_t scale_cols, const std::string& scale_dtype,
                const std::string& combine_wire_dtype, const nb::kwargs& options) {
  std::array<char, 128> id{};
  MOEFLOW_CHECK(unique_id.size() == id.size(), "unique_id: expected ", id.size(),
                " bytes (an NCCL unique id), got ", unique_id.size());
  std::memcpy(id.data(), unique_id.c_str(), id.size());
  EpOptions o;
  o.backend = backend_from_name(backend);
  o.num_experts = num_experts;
  o.topk = topk;
  o.hidden = hidden;
  o.dtype = dtype_from_name(dtype);
  // FP8 tokens: the gradient rows' dtype; per-token scales beside the rows
  o.backward_dtype = dtype_from_name(backward_dtype);
  o.scale_cols = scale_cols;
  o.scale_dtype = dtype_from_name(scale_dtype);
  o.align = align;
  o.max_tokens_per_rank = max_tokens_per_rank;
  o.capacity_rows = capacity_rows;
  o.timeout_s = timeout_s;
  o.combine_wire_dtype = dtype_from_name(combine_wire_dtype);
  // The tuning options of EpOptions, by name (docs/tuning.md).
  for (auto [key, value] : options) {
    const std::string k = nb::cast<std::string>(key);
    if (k == "pipeline_chunks")
      o.pipeline_chunks = nb::cast<int>(value);
    else if (k == "pipeline_first_share")
      o.pipeline_first_share = nb::cast<double>(value);
    else if (k == "eager_share")
      o.eager_share = nb::cast<double>(value);
    else if (k == "overlap_blocks")
      o.overlap_blocks = nb::cast<int>(value);
    else if (k == "nvlink_blocks")
      o.nvlink_blocks = nb::cast<int>(value);
    else if (k == "nvlink_bulk_copies")
      o.nvlink_bulk_copies = nb::cast<bool>(value);
    else if (k == "nvlink_recv_regions")
      o.nvlink_recv_regions = nb::cast<int>(value);
    else if (k == "nvlink_quantize_in_dispatch")
      o.nvlink_quantize_in_dispatch = nb::cast<int>(value);
    else if (k == "nccl_register_buffers")
      o.nccl_register_buffers = nb::cast<bool>(value);
    else
      MOEFLOW_CHECK(false, "options: unknown EpOptions field '", k,
                    "' (pipeline_chunks, pipeline_first_share, eager_share, overlap_blocks, "
                    "nvlink_blocks, nvlink_bulk_copies, nvlink_recv_regions, "
                    "nvlink_quantize_in_dispatch, nccl_register_buffers)");
  }
  MOEFLOW_CHECK(device >= 0, "device must be a CUDA device index, got ", device);
  std::unique_ptr<EpGroup> group;
  {
    // (collective: every rank blocks here until all have joined)
    nb::gil_scoped_release release;
    group = EpGroup::from_unique_id(id, rank, world_size, o, device);
  }
  new (self) PyEpGroup{std::move(group)};
}

EpGroup& group_of(PyEpGroup& g) {
  MOEFLOW_CHECK(g.group != nullptr, "the expert-parallel group was closed");
  return *g.group;
}

}  // namespace

void bind_ep(nb::module_& m) {
  m.def(
      "ep_recv_capacity_rows",
      [](int num_experts, int world_size, int topk, int64_t max_tokens_per_rank, int align,
         int64_t capacity_rows) {
        ep_reference::EpConfig c;
        c.world_size = world_size;
        c.num_experts = num_experts;
        c.align = align;
        c.max_tokens_per_rank = max_tokens_per_rank;
        c.capacity_rows = capacity_rows;
        return ep_reference::recv_capacity_rows(c, topk);
      },
      nb::arg("num_experts"), nb::arg("world_size"), nb::arg("topk"),
      nb::arg("max_tokens_per_rank"), nb::arg("align"), nb::arg("capacity_rows") = -1,
      "Receive rows of every rank of an expert-parallel group (moeflow/ep_reference.h).");
  m.def(
      "ep_unique_id",
      [] {
        const std::array<char, 128> id = EpGroup::new_unique_id();
        return nb::bytes(id.data(), id.size());
      },
      "A new NCCL unique id (128 bytes) for EpGroup: made on one rank, broadcast to the others.");

  nb::class_<PyEpHandle>(m, "EpHandle",
                         "One dispatch: its received rows and its way back (moeflow/ep.h).")
      .def_prop_ro("x", [](const PyEpHandle& h) { return device_array(h.result.x, h.handle); })
      .def_prop_ro("probs",
                   [](const PyEpHandle& h) { return device_array(h.result.probs, h.handle); })
      .def_prop_ro("scales",
                   [](const PyEpHandle& h) -> nb::object {
                     if (!h.result.scales.defined()) return nb::none();
                     return device_array(h.result.scales, h.handle);
                   })
      .def_prop_ro("tokens_per_expert",
                   [](const PyEpHandle& h) {
                     return device_array(h.result.plan->tokens_per_expert, h.handle);
                   })
      .def_prop_ro("expert_row_offsets",
                   [](const PyEpHandle& h) {
                     return device_array(h.result.plan->expert_row_offsets, h.handle);
                   })
      .def_prop_ro(
          "total_rows",
          [](const PyEpHandle& h) { return device_array(h.result.plan->total_rows, h.handle); })
      .def_prop_ro(
          "overflow",
          [](const PyEpHandle& h) { return device_array(h.result.plan->overflow, h.handle); })
      .def_prop_ro("num_tokens", [](const PyEpHandle& h) { return h.handle.num_tokens(); })
      .def_prop_ro("received_tokens", [](const PyEpHandle& h) { return h.result.received_tokens; });

  nb::class_<PyEpGroup>(m, "EpGroup",
                        "An expert-parallel group (moeflow/ep.h) over a communicator made from "
                        "an NCCL unique id.")
      .def("__init__", &make_group, nb::arg("unique_id"), nb::arg("rank"), nb::arg("world_size"),
           nb::arg("device"), nb::arg("backend"), nb::arg("num_experts"), nb::arg("topk"),
           nb::arg("hidden"), nb::arg("dtype"), nb::arg("align") = 16,
           nb::arg("max_tokens_per_rank"), nb::arg("capacity_rows") = -1,
           nb::arg("timeout_s") = 300.0, nb::arg("backward_dtype") = "bfloat16",
           nb::arg("scale_cols") = 0, nb::arg("scale_dtype") = "float32",
           nb::arg("combine_wire_dtype") = "float32", nb::arg("options"))
      .def_prop_ro("rank", [](PyEpGroup& g) { return group_of(g).rank(); })
      .def_prop_ro("world_size", [](PyEpGroup& g) { return group_of(g).world_size(); })
      .def_prop_ro("local_experts", [](PyEpGroup& g) { return group_of(g).local_experts(); })
      .def_prop_ro("capacity_rows", [](PyEpGroup& g) { return group_of(g).capacity_rows(); })
      .def(
          "close", [](PyEpGroup& g) { g.group.reset(); },
          "Destroys the group (every rank together); its handles stay readable.")
      .def(
          "dispatch",
          [](PyEpGroup& g, const Array& x, const Array& ids, const std::optional<Array>& probs,
             const std::optional<Array>& scales, uintptr_t s) {
            auto h = std::make_unique<PyEpHandle>();
            EpGroup& group = group_of(g);
            const TensorView xv = view_of(x, "x"), iv = view_of(ids, "ids"),
                             pv = opt_view(probs, "probs"), sv = opt_view(scales, "scales");
            {
              // (backend nccl: the host waits for the peers' routing messages)
              nb::gil_scoped_release release;
              h->result = ep_dispatch(group, xv, iv, pv, sv, stream_of(s));
            }
            h->handle = h->result.handle;
            return h;
          },
          nb::arg("x"), nb::arg("ids"), nb::arg("probs").none(),
          nb::arg("scales").none() = nb::none(), nb::arg("stream") = 0)
      .def(
          "dispatch_quantize",
          [](PyEpGroup& g, const Array& x, const Array& ids, const std::optional<Array>& probs,
             bool pow2_scales, uintptr_t s) {
            auto h = std::make_unique<PyEpHandle>();
            EpGroup& group = group_of(g);
            const TensorView xv = view_of(x, "x"), iv = view_of(ids, "ids"),
                             pv = opt_view(probs, "probs");
            const QuantizeConfig qc{group.options().dtype, QuantScaling::kBlock1x128, pow2_scales,
                                    false};
            {
              nb::gil_scoped_release release;
              h->result = ep_dispatch_quantize(group, xv, iv, pv, qc, stream_of(s));
            }
            h->handle = h->result.handle;
            return h;
          },
          nb::arg("x"), nb::arg("ids"), nb::arg("probs").none(), nb::arg("pow2_scales") = false,
          nb::arg("stream") = 0,
          "ep_dispatch_quantize: 16-bit tokens quantized 1x128 (the group's FP8 dtype) on "
          "their way.")
      .def(
          "combine",
          [](PyEpGroup& g, const PyEpHandle& h, const Array& y, bool weighted, const Array& out,
             uintptr_t s) {
            ep_combine(group_of(g), h.handle, rows_of(y, "y"), weighted, rows_of(out, "out"),
                       stream_of(s));
          },
          nb::arg("handle"), nb::arg("y"), nb::arg("weighted"), nb::arg("out"),
          nb::arg("stream") = 0)
      .def(
          "dispatch_backward",
          [](PyEpGroup& g, const PyEpHandle& h, const Array& grad_rows, const Array& grad_x,
             uintptr_t s) {
            ep_dispatch_backward(group_of(g), h.handle, rows_of(grad_rows, "grad_rows"),
                                 rows_of(grad_x, "grad_x"), stream_of(s));
          },
          nb::arg("handle"), nb::arg("grad_rows"), nb::arg("grad_x"), nb::arg("stream") = 0)
      .def(
          "combine_backward",
          [](PyEpGroup& g, const PyEpHandle& h, const Array& dout, const Array& y, bool weighted,
             const Array& grad_y, const std::optional<Array>& dprobs, uintptr_t s) {
            ep_combine_backward(group_of(g), h.handle, rows_of(dout, "dout"), rows_of(y, "y"),
                                weighted, rows_of(grad_y, "grad_y"), opt_view(dprobs, "dprobs"),
                                stream_of(s));
          },
          nb::arg("handle"), nb::arg("dout"), nb::arg("y"), nb::arg("weighted"), nb::arg("grad_y"),
          nb::arg("dprobs").none(), nb::arg("stream") = 0);
}

}  // namespace moeflow::python
