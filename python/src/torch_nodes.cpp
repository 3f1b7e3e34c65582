// moeflow._autograd: torch autograd nodes in C++ for the ops whose Python
// nodes cost most of a call's host time. Here: the routing plan's build,
// permute and unpermute (and their gradients as plain calls, for the grouped
// MLP node's source and sink); the router in torch_router_node.cpp, the
// grouped MLP's forward call in torch_mlp.cpp. Built against the torch found
// at build time (its headers, libtorch and its pybind11: cmake/torch_nodes.cmake);
// moeflow.ops uses it when it loads and falls back to the Python nodes of
// moeflow/ops.py otherwise, with the same outputs and gradients bit for bit
// (python/tests/test_torch_nodes.py).
//
// Outputs are allocated with torch (the caching allocator), every kernel
// runs on torch's current stream of the input's device, nothing
// synchronises with the host: graph-capturable as the Python nodes.
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "moeflow/permute.h"
#include "moeflow/plan.h"
#include "plan_buffers.h"
#include "torch_common.h"

namespace moeflow::python {
namespace {

// One routing plan: moeflow.Plan's two buffers (plan_buffers.h), its
// workspace and sizes, and the RoutingPlan over the buffers.
struct PlanRef {
  at::Tensor buffer64, buffer32, workspace;
  int64_t capacity_arg = -1;  // as given (-1: the worst case)
  RoutingPlan plan;

  PlanRef(at::Tensor b64, at::Tensor b32, at::Tensor ws, int64_t T, int64_t K, int64_t E,
          int64_t align, int64_t capacity)
      : buffer64(std::move(b64)),
        buffer32(std::move(b32)),
        workspace(std::move(ws)),
        capacity_arg(capacity),
        plan(plan_over_buffers(T, static_cast<int>(K), static_cast<int>(E), static_cast<int>(align),
                               capacity, view_of(buffer64, "buffer64"),
                               view_of(buffer32, "buffer32"), api().plan_capacity_rows)) {}

  // What a backward needs to make the plan again (a node cannot hold a
  // PlanRef: saved_data takes IValues).
  void save(AutogradContext* ctx) const {
    ctx->saved_data["plan64"] = buffer64;
    ctx->saved_data["plan32"] = buffer32;
    ctx->saved_data["plan"] = std::vector<int64_t>{plan.num_tokens, plan.topk, plan.num_experts(),
                                                   plan.align(), capacity_arg};
  }
  static RoutingPlan load(AutogradContext* ctx) {
    const auto dims = ctx->saved_data["plan"].toIntVector();
    return plan_over_buffers(
        dims[0], static_cast<int>(dims[1]), static_cast<int>(dims[2]), static_cast<int>(dims[3]),
        dims[4], view_of(ctx->saved_data["plan64"].toTensor(), "buffer64"),
        view_of(ctx->saved_data["plan32"].toTensor(), "buffer32"), api().plan_capacity_rows);
  }
};

// Allocates a plan's buffers on ids' device and builds it there
// (moeflow.Plan).
PlanRef build(const at::Tensor& topk_ids, int64_t E, int64_t align, int64_t capacity,
              bool from_mask) {
  MOEFLOW_CHECK(topk_ids.dim() == 2, from_mask ? "routing_mask" : "topk_ids",
                " must be [T, K], got ", topk_ids.dim(), " dimensions");
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t T = ids.size(0), K = ids.size(1);
  const PlanConfig c = plan_config(static_cast<int>(E), static_cast<int>(align), capacity);
  const int64_t cap = api().plan_capacity_rows(T, static_cast<int>(K), c);
  const size_t ws_bytes = api().plan_workspace_bytes(T, static_cast<int>(K), c);
  const auto opts = ids.options();
  PlanRef p(
      at::empty({plan_buffer64_size(T, static_cast<int>(K), static_cast<int>(E))},
                opts.dtype(at::kLong)),
      at::empty({plan_buffer32_size(static_cast<int>(E), cap)}, opts.dtype(at::kInt)),
      ws_bytes ? at::empty({static_cast<int64_t>(ws_bytes)}, opts.dtype(at::kByte)) : at::Tensor(),
      T, K, E, align, capacity);
  const TensorView ws = opt_view(p.workspace, "workspace");
  if (from_mask)
    api().build_plan_from_mask(view_of(ids, "routing_mask"), p.plan, ws, stream_of(ids));
  else
    api().build_plan(view_of(ids, "topk_ids"), p.plan, ws, stream_of(ids));
  return p;
}

// permute's gradient: dy [capacity, H] -> dx [T, H] in dy's dtype and,
// with dpp [capacity] (the row probs' gradient), dprobs [T, K] float32.
std::pair<at::Tensor, at::Tensor> permute_grad(const at::Tensor& dy_in, const at::Tensor& dpp_in,
                                               const RoutingPlan& plan) {
  const at::Tensor dy = rows(dy_in);
  at::Tensor dx = at::empty({plan.num_tokens, dy.size(1)}, dy.options());
  at::Tensor dpp, dprobs;
  if (dpp_in.defined()) {
    dpp = dpp_in.contiguous();
    dprobs = at::empty({plan.num_tokens, plan.topk}, dy.options().dtype(at::kFloat));
  }
  api().permute_backward(rows_of(dy, "dy"), plan, view_of(dx, "dx"),
                         opt_view(dpp, "dpermuted_probs"), opt_view(dprobs, "dprobs"),
                         stream_of(dy));
  return {dx, dprobs};
}

// unpermute's gradient: dout [T, H] -> dy [rows, H] of `dtype` (pad rows
// zero) and, with the forward's rows y, dprobs [T, K] float32.
std::pair<at::Tensor, at::Tensor> unpermute_grad(const at::Tensor& dout_in, const at::Tensor& y,
                                                 const at::Tensor& probs, int64_t rows_n,
                                                 at::ScalarType dtype, const RoutingPlan& plan) {
  const at::Tensor dout = rows(dout_in);
  at::Tensor dy = at::empty({rows_n, dout.size(1)}, dout.options().dtype(dtype));
  at::Tensor dprobs;
  if (y.defined())
    dprobs = at::empty({plan.num_tokens, plan.topk}, dout.options().dtype(at::kFloat));
  api().unpermute_backward(
      rows_of(dout, "dout"), plan, y.defined() ? rows_of(y, "y_fwd") : TensorView{},
      opt_view(probs, "probs"), view_of(dy, "dy"), opt_view(dprobs, "dprobs"), stream_of(dout));
  return {dy, dprobs};
}

// permute: x [T, H] -> rows [capacity, H] and, with probs, row probs
// [capacity] float32. moeflow.ops._Permute.
struct PermuteNode : torch::autograd::Function<PermuteNode> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const std::optional<at::Tensor>& probs_arg, const PlanRef* ref) {
    const RoutingPlan& plan = ref->plan;
    const at::Tensor probs = probs_arg.value_or(at::Tensor());
    MOEFLOW_CHECK(x.dim() == 2, "x must be [T, H], got ", x.dim(), " dimensions");
    const at::Tensor xr = rows(x);
    const TensorView xv = rows_of(xr, "x");  // (checked before y is made of its dtype)
    at::Tensor y = at::empty({plan.capacity_rows, x.size(1)}, x.options());
    at::Tensor pp;
    if (probs.defined()) pp = at::empty({plan.capacity_rows}, x.options().dtype(at::kFloat));
    PermuteExtras e;
    e.probs = opt_view(probs, "probs");
    e.permuted_probs = opt_view(pp, "permuted_probs");
    api().permute(xv, plan, view_of(y, "y"), e, stream_of(x));
    if (ctx) {
      ctx->set_materialize_grads(false);
      ref->save(ctx);
      ctx->saved_data["x"] = std::vector<int64_t>{
          x.size(0), x.size(1), static_cast<int64_t>(x.scalar_type()), probs.defined()};
    }
    if (!pp.defined()) return {y};  // (a node's outputs are defined tensors)
    return {y, pp};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor dy = grads[0], dpp = grads.size() > 1 ? grads[1] : at::Tensor();
    if (!dy.defined() && !dpp.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const RoutingPlan plan = PlanRef::load(ctx);
    const auto meta = ctx->saved_data["x"].toIntVector();
    if (!dy.defined())
      dy = at::zeros({plan.capacity_rows, meta[1]},
                     dpp.options().dtype(static_cast<at::ScalarType>(meta[2])));
    // probs given (meta[3]): they are edge 1
    if (!(meta[3] && ctx->needs_input_grad(1))) dpp = at::Tensor();
    auto [dx, dprobs] = permute_grad(dy, dpp, plan);
    return {dx, dprobs, at::Tensor()};
  }
};

// unpermute: rows [capacity, H] -> out [T, H], weighted by probs [T, K].
// moeflow.ops._Unpermute.
struct UnpermuteNode : torch::autograd::Function<UnpermuteNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y,
                            const std::optional<at::Tensor>& probs_arg, const PlanRef* ref) {
    const RoutingPlan& plan = ref->plan;
    const at::Tensor probs = probs_arg.value_or(at::Tensor());
    MOEFLOW_CHECK(y.dim() == 2, "y must be [capacity, H], got ", y.dim(), " dimensions");
    const at::Tensor yr = rows(y);
    const TensorView yv = rows_of(yr, "y");
    at::Tensor out = at::empty({plan.num_tokens, y.size(1)}, y.options());
    api().unpermute(yv, plan, view_of(out, "out"), opt_view(probs, "merge_probs"), stream_of(y));
    if (ctx) {
      ref->save(ctx);
      ctx->saved_data["y"] =
          std::vector<int64_t>{yr.size(0), yr.size(1), static_cast<int64_t>(yr.scalar_type())};
      // The backward reads y only for the probs' gradient. (Whether probs
      // require grad, not needs_input_grad: in a forward that runs again
      // inside a backward, checkpointing's recompute, needs_input_grad also
      // reflects that backward's inputs and the saved set would differ.)
      const bool dprobs = probs.defined() && probs.requires_grad();
      ctx->save_for_backward({dprobs ? yr : at::Tensor(), probs});
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const RoutingPlan plan = PlanRef::load(ctx);
    const variable_list saved = ctx->get_saved_variables();
    const auto meta = ctx->saved_data["y"].toIntVector();  // rows, H, dtype
    auto [dy, dprobs] = unpermute_grad(grads[0], saved[0], saved[1], meta[0],
                                       static_cast<at::ScalarType>(meta[2]), plan);
    return {dy, dprobs, at::Tensor()};
  }
};

// Whether the call records an autograd node (else the forward runs alone:
// no node to make).
bool wants_node(const at::Tensor& x, const std::optional<at::Tensor>& probs) {
  return at::GradMode::is_enabled() && (x.requires_grad() || (probs && probs->requires_grad()));
}

py::tuple permute_op(const at::Tensor& x, const std::optional<at::Tensor>& probs_arg,
                     const PlanRef& ref) {
  const std::optional<at::Tensor> probs = contiguous_or_none(probs_arg);
  variable_list out = wants_node(x, probs) ? PermuteNode::apply(x, probs, &ref)
                                           : PermuteNode::forward(nullptr, x, probs, &ref);
  return py::make_tuple(out[0], out.size() > 1 ? out[1] : at::Tensor());
}

at::Tensor unpermute_op(const at::Tensor& y, const std::optional<at::Tensor>& probs_arg,
                        const PlanRef& ref) {
  const std::optional<at::Tensor> probs = contiguous_or_none(probs_arg);
  return wants_node(y, probs) ? UnpermuteNode::apply(y, probs, &ref)
                              : UnpermuteNode::forward(nullptr, y, probs, &ref);
}

// moeflow._C's entry points, set once by the module's import (read-only after).
const ApiTable* g_api = nullptr;

}  // namespace

const ApiTable& api() {
  return *g_api;
}

}  // namespace moeflow::python

PYBIND11_MODULE(_autograd, m) {
  using namespace moeflow::python;
  m.doc() = "moeflow's torch autograd nodes in C++ (plan build, permute, unpermute, router)";
  // The torch this module was built against (moeflow.ops loads it only under that torch).
  m.attr("torch_version") = MOEFLOW_TORCH_VERSION;
  // moeflow errors as moeflow.Error (the type moeflow._C registers), held
  // for the process's life once imported (read-only after this).
  const py::module_ c_module = py::module_::import("moeflow._C");
  static PyObject* error_type = py::object(c_module.attr("Error")).release().ptr();
  g_api = static_cast<const ApiTable*>(PyCapsule_Import(kApiCapsule, 0));
  if (!g_api) throw py::error_already_set();
  if (g_api->version != kApiVersion)
    throw py::import_error("moeflow._autograd and moeflow._C come from different builds");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const moeflow::Error& e) {
      PyErr_SetString(error_type, e.what());
    }
  });

  py::class_<PlanRef>(m, "PlanRef", "A routing plan's buffers, workspace and sizes")
      .def_readonly("buffer64", &PlanRef::buffer64)
      .def_readonly("buffer32", &PlanRef::buffer32)
      .def_readonly("workspace", &PlanRef::workspace)
      .def_property_readonly("capacity_rows",
                             [](const PlanRef& p) { return p.plan.capacity_rows; });
  m.def("build_plan", &build, py::arg("topk_ids"), py::arg("num_experts"), py::arg("align"),
        py::arg("capacity_rows"), py::arg("from_mask"),
        "Allocates a plan's buffers and workspace on topk_ids' device and builds the plan "
        "there (moeflow.Plan)");
  m.def("permute", &permute_op, py::arg("x"), py::arg("probs"), py::arg("plan"),
        "moeflow.ops.permute without scales: (rows, row_probs or None)");
  m.def("unpermute", &unpermute_op, py::arg("y"), py::arg("probs"), py::arg("plan"),
        "moeflow.ops.unpermute");
  // The gradients alone, for the grouped MLP node's permute source and
  // unpermute sink (moeflow/_mlp_io.py).
  m.def(
      "permute_backward",
      [](const at::Tensor& dy, const std::optional<at::Tensor>& dpp, const PlanRef& ref) {
        auto [dx, dprobs] = permute_grad(dy, dpp.value_or(at::Tensor()), ref.plan);
        return py::make_tuple(dx, dprobs);
      },
      py::arg("dy"), py::arg("dpermuted_probs"), py::arg("plan"),
      "(dx [T, H] in dy's dtype, dprobs [T, K] float32 or None)");
  m.def(
      "unpermute_backward",
      [](const at::Tensor& dout, int64_t rows_n, const PlanRef& ref) {
        return unpermute_grad(dout, at::Tensor(), at::Tensor(), rows_n, dout.scalar_type(),
                              ref.plan)
            .first;
      },
      py::arg("dout"), py::arg("rows"), py::arg("plan"),
      "unweighted unpermute's dy [rows, H] in dout's dtype");
  bind_router_node(m);
  bind_mlp(m);
}
