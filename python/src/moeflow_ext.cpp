// moeflow._C: the C++ API over arrays (torch tensors, numpy, anything that
// speaks DLPack: arrays.h). Every op takes its outputs as caller-allocated
// arrays (the caller's allocator, e.g. torch's caching allocator: nothing is
// allocated here) and a CUDA stream as an integer (0: the legacy default
// stream). The torch autograd wrappers live in moeflow/ops.py; the
// router in router_bindings.cpp, the checkpoint API in
// checkpoint_bindings.cpp, the expert-parallel one in ep_bindings.cpp.
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

#include "api_table.h"
#include "arrays.h"
#include "mlp_config.h"
#include "moeflow/grouped_gemm.h"
#include "moeflow/grouped_mlp.h"
#include "moeflow/moeflow.h"
#include "moeflow/permute.h"
#include "moeflow/plan.h"
#include "moeflow/quantize.h"
#include "moeflow/version.h"
#include "plan_buffers.h"

namespace nb = nanobind;
using namespace moeflow;
using namespace moeflow::python;

namespace {

// A RoutingPlan over caller-allocated arrays (shapes and dtypes as
// allocate_plan makes them, checked here). It holds references to the
// arrays, so they live as long as the plan does.
struct PyPlan {
  RoutingPlan plan;
  std::vector<Array> keep;
};

Tensor adopt(const TensorView& v, const std::vector<int64_t>& shape, DType dtype,
             const char* name) {
  // PyPlan::keep holds the arrays: a non-null owner that frees nothing.
  return adopt_plan_view(v, shape, dtype, name, std::shared_ptr<void>(v.data, [](void*) {}));
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

// The plan over moeflow.Plan's two flat buffers (plan_buffers.h). (Two
// arrays to read per plan instead of nine.)
PyPlan make_plan_from_buffers(int64_t T, int K, int E, int align, int64_t capacity,
                              const Array& buf64, const Array& buf32) {
  PyPlan p;
  p.plan = plan_over_buffers(T, K, E, align, capacity, view_of(buf64, "buffer64"),
                             view_of(buf32, "buffer32"));
  p.keep = {buf64, buf32};
  return p;
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

QuantizeConfig quantize_config(const std::string& out, const std::string& scaling, bool pow2,
                               bool columnwise) {
  QuantizeConfig c;
  if (out == "e4m3")
    c.out = DType::kFloat8E4M3;
  else if (out == "e5m2")
    c.out = DType::kFloat8E5M2;
  else
    MOEFLOW_CHECK(false, "fp8 format must be 'e4m3' or 'e5m2', got '", out, "'");
  if (scaling == "tensorwise")
    c.scaling = QuantScaling::kTensorwise;
  else if (scaling == "1x128")
    c.scaling = QuantScaling::kBlock1x128;
  else if (scaling == "128x128")
    c.scaling = QuantScaling::kBlock128x128;
  else
    MOEFLOW_CHECK(false, "scaling must be 'tensorwise', '1x128' or '128x128', got '", scaling,
                  "'");
  c.pow2_scales = pow2;
  c.columnwise = columnwise;
  return c;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() =
      "moeflow: the MoE token path (router, routing plan, permute, grouped expert MLP) over "
      "DLPack";
  m.attr("__version__") = MOEFLOW_VERSION_STRING;
  nb::exception<Error>(m, "Error", PyExc_RuntimeError);
  // The entry points moeflow._autograd calls (api_table.h): static storage,
  // as long as the process.
  static const ApiTable api = make_api_table();
  m.attr("_api") = nb::capsule(&api, kApiCapsule);
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

  bind_router(m);

  // FP8 quantization (moeflow/quantize.h).
  m.def(
      "quantize_workspace_bytes",
      [](int64_t rows, int64_t cols, const std::string& fmt, const std::string& scaling, bool pow2,
         bool columnwise) {
        return quantize_workspace_bytes(rows, cols, quantize_config(fmt, scaling, pow2, columnwise));
      },
      nb::arg("rows"), nb::arg("cols"), nb::arg("fp8_format"), nb::arg("scaling"),
      nb::arg("pow2_scales"), nb::arg("columnwise"));
  m.def(
      "quantize",
      [](const Array& x, const std::string& fmt, const std::string& scaling, bool pow2,
         bool columnwise, const Array& q, const Array& scales, const std::optional<Array>& ws,
         const std::optional<Array>& rows_used, uintptr_t s) {
        quantize(rows_of(x, "x"), quantize_config(fmt, scaling, pow2, columnwise), rows_of(q, "q"),
                 view_of(scales, "scales"), opt_view(ws, "workspace"),
                 opt_view(rows_used, "rows_used"), stream_of(s));
      },
      nb::arg("x"), nb::arg("fp8_format"), nb::arg("scaling"), nb::arg("pow2_scales"),
      nb::arg("columnwise"), nb::arg("q"), nb::arg("scales"),
      nb::arg("workspace").none() = nb::none(), nb::arg("rows_used").none() = nb::none(),
      nb::arg("stream") = 0);
  m.def(
      "quantize_rowwise_columnwise",
      [](const Array& x, const std::string& fmt, bool pow2, const std::optional<Array>& q,
         const std::optional<Array>& scales, const Array& q_t, const Array& scales_t, uintptr_t s,
         const std::string& scaling) {
        quantize_rowwise_columnwise(rows_of(x, "x"), quantize_config(fmt, scaling, pow2, false),
                                    q && q->is_valid() ? rows_of(*q, "q") : TensorView{},
                                    opt_view(scales, "scales"), rows_of(q_t, "q_t"),
                                    rows_of(scales_t, "scales_t"), stream_of(s));
      },
      nb::arg("x"), nb::arg("fp8_format"), nb::arg("pow2_scales"), nb::arg("q").none(),
      nb::arg("scales").none(), nb::arg("q_t"), nb::arg("scales_t"), nb::arg("stream") = 0,
      nb::arg("scaling") = "1x128");
  m.def(
      "requantize_columnwise",
      [](const Array& q, const Array& scales, bool half_rows, const std::string& fmt, bool pow2,
         const Array& q_t, const Array& scales_t, uintptr_t s) {
        requantize_columnwise(rows_of(q, "q"), view_of(scales, "scales"),
                              half_rows ? DType::kFloat16 : DType::kBFloat16,
                              quantize_config(fmt, "1x128", pow2, false), rows_of(q_t, "q_t"),
                              rows_of(scales_t, "scales_t"), stream_of(s));
      },
      nb::arg("q"), nb::arg("scales"), nb::arg("half_rows"), nb::arg("fp8_format"),
      nb::arg("pow2_scales"), nb::arg("q_t"), nb::arg("scales_t"), nb::arg("stream") = 0);
  m.def(
      "dequantize",
      [](const Array& q, const Array& scales, const std::string& fmt, const std::string& scaling,
         bool pow2, bool columnwise, const Array& out, const std::optional<Array>& rows_used,
         uintptr_t s) {
        dequantize(rows_of(q, "q"), view_of(scales, "scales"),
                   quantize_config(fmt, scaling, pow2, columnwise), rows_of(out, "out"),
                   opt_view(rows_used, "rows_used"), stream_of(s));
      },
      nb::arg("q"), nb::arg("scales"), nb::arg("fp8_format"), nb::arg("scaling"),
      nb::arg("pow2_scales"), nb::arg("columnwise"), nb::arg("out"),
      nb::arg("rows_used").none() = nb::none(), nb::arg("stream") = 0);
  m.def(
      "transpose_codes",
      [](const Array& q, const Array& q_t, uintptr_t s) {
        transpose_codes(view_of(q, "q"), view_of(q_t, "q_t"), stream_of(s));
      },
      nb::arg("q"), nb::arg("q_t"), nb::arg("stream") = 0);

  // Blockwise FP8 grouped GEMM forward (moeflow/grouped_gemm.h).
  m.def(
      "grouped_gemm_fp8_forward",
      [](const Array& a, const Array& a_scales, const Array& w, const Array& w_scales,
         const Array& offsets, const std::optional<Array>& real_rows, const Array& c, uintptr_t s,
         int promote) {
        GemmOptions o;
        o.fp8_promote = promote;
        grouped_gemm_fp8_forward(view_of(a, "a"), view_of(a_scales, "a_scales"), view_of(w, "w"),
                                 view_of(w_scales, "w_scales"), layout(offsets, real_rows),
                                 rows_of(c, "c"), o, stream_of(s));
      },
      nb::arg("a"), nb::arg("a_scales"), nb::arg("w"), nb::arg("w_scales"), nb::arg("offsets"),
      nb::arg("real_rows").none(), nb::arg("c"), nb::arg("stream") = 0,
      nb::arg("fp8_promote") = -1);
  // Tensorwise codes of the groups' real rows (offsets None: every row).
  m.def(
      "quantize_group_rows",
      [](const Array& x, const std::optional<Array>& offsets, const std::optional<Array>& real_rows,
         const std::string& fmt, bool pow2, const Array& q, const Array& scale, uintptr_t s,
         const std::optional<Array>& q_t, const std::optional<Array>& amax) {
        const bool groups = offsets && offsets->is_valid();
        MOEFLOW_CHECK(groups || !(real_rows && real_rows->is_valid()),
                      "quantize_group_rows: real_rows needs offsets (the groups)");
        const GroupLayout g = groups ? layout(*offsets, real_rows) : GroupLayout{};
        const QuantizeConfig c = quantize_config(fmt, "tensorwise", pow2, false);
        const TensorView t = opt_view(q_t, "q_t");
        if (amax && amax->is_valid())
          quantize_group_rows_with_amax(rows_of(x, "x"), g, c, view_of(*amax, "amax"),
                                        rows_of(q, "q"), view_of(scale, "scale"), t, stream_of(s));
        else
          quantize_group_rows(rows_of(x, "x"), g, c, rows_of(q, "q"), view_of(scale, "scale"), t,
                              stream_of(s));
      },
      nb::arg("x"), nb::arg("offsets").none(), nb::arg("real_rows").none(), nb::arg("fp8_format"),
      nb::arg("pow2_scales"), nb::arg("q"), nb::arg("scale"), nb::arg("stream") = 0,
      nb::arg("q_t").none() = nb::none(), nb::arg("amax").none() = nb::none());
  // FP8 grouped GEMM wgrad (variable K; blockwise scales may be strided).
  m.def(
      "grouped_gemm_fp8_wgrad",
      [](const Array& dc_t, const Array& dc_t_scales, const Array& a_t, const Array& a_t_scales,
         const Array& offsets, const std::optional<Array>& real_rows, const Array& dw,
         bool accumulate, const std::optional<Array>& error, uintptr_t s) {
        GroupLayout g = layout(offsets, real_rows);
        g.error = opt_view(error, "error");
        grouped_gemm_fp8_wgrad(rows_of(dc_t, "dc_t"), rows_of(dc_t_scales, "dc_t_scales"),
                               rows_of(a_t, "a_t"), rows_of(a_t_scales, "a_t_scales"), g,
                               GroupedWeights::from_stacked(view_of(dw, "dw")), accumulate,
                               stream_of(s));
      },
      nb::arg("dc_t"), nb::arg("dc_t_scales"), nb::arg("a_t"), nb::arg("a_t_scales"),
      nb::arg("offsets"), nb::arg("real_rows").none(), nb::arg("dw"), nb::arg("accumulate"),
      nb::arg("error").none(), nb::arg("stream") = 0);

  m.def(
      "plan_capacity_rows",
      [](int64_t T, int K, int E, int align, int64_t capacity) {
        return plan_capacity_rows(T, K, plan_config(E, align, capacity));
      },
      nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"), nb::arg("align"),
      nb::arg("capacity_rows"));
  m.def(
      "plan_buffer_layout",
      [](int64_t T, int K, int E, int align, int64_t capacity) {
        const PlanConfig c = plan_config(E, align, capacity);
        const int64_t cap = plan_capacity_rows(T, K, c);
        return nb::make_tuple(cap, plan_workspace_bytes(T, K, c), plan_buffer64_parts(T, K, E),
                              plan_buffer32_parts(E, cap));
      },
      nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"), nb::arg("align"),
      nb::arg("capacity_rows"),
      "(capacity_rows, workspace bytes, the int64 buffer's parts, the int32 buffer's parts) of "
      "moeflow.Plan's two buffers (python/src/plan_buffers.h)");
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
      "permute_quantize",
      [](const AnyArray& x, const PyPlan& p, const AnyArray& y, const Array& y_scales,
         const std::string& fmt, bool pow2, const std::optional<Array>& probs,
         const std::optional<Array>& pprobs, uintptr_t s, const std::string& scaling,
         const std::optional<Array>& y_t, bool columnwise) {
        PermuteExtras e;
        e.probs = opt_view(probs, "probs");
        e.permuted_probs = opt_view(pprobs, "permuted_probs");
        // (the columnwise form's scales take any strides)
        permute_quantize(rows_of(x, "x"), p.plan, rows_of(y, "y"),
                         columnwise ? rows_of(y_scales, "y_scales") : view_of(y_scales, "y_scales"),
                         opt_view(y_t, "y_t"), quantize_config(fmt, scaling, pow2, columnwise), e,
                         stream_of(s));
      },
      nb::arg("x"), nb::arg("plan"), nb::arg("y"), nb::arg("y_scales"), nb::arg("fp8_format"),
      nb::arg("pow2_scales"), nb::arg("probs").none() = nb::none(),
      nb::arg("permuted_probs").none() = nb::none(), nb::arg("stream") = 0,
      nb::arg("scaling") = "1x128", nb::arg("y_t").none() = nb::none(),
      nb::arg("columnwise") = false);
  m.def(
      "unpermute_backward_quantize",
      [](const AnyArray& dout, const PyPlan& p, const std::optional<Array>& probs,
         const AnyArray& dy, const Array& dy_scales, const std::string& fmt, bool pow2, uintptr_t s,
         const std::string& scaling, const std::optional<Array>& dy_t) {
        unpermute_backward_quantize(rows_of(dout, "dout"), p.plan, opt_view(probs, "probs"),
                                    rows_of(dy, "dy"), view_of(dy_scales, "dy_scales"),
                                    opt_view(dy_t, "dy_t"),
                                    quantize_config(fmt, scaling, pow2, false), stream_of(s));
      },
      nb::arg("dout"), nb::arg("plan"), nb::arg("probs").none(), nb::arg("dy"),
      nb::arg("dy_scales"), nb::arg("fp8_format"), nb::arg("pow2_scales"), nb::arg("stream") = 0,
      nb::arg("scaling") = "1x128", nb::arg("dy_t").none() = nb::none());
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
         const Array& h, const std::optional<AnyArray>& dx, const Array& d_h,
         const std::optional<Array>& dprobs, uintptr_t s) {
        GroupedMlpSaved saved{view_of(h, "h"), TensorView{}};
        grouped_mlp_backward_dgrad(
            rows_of(dy, "dy"), mlp_weights(fc1, fc2, b1, b2), layout(offsets, real_rows),
            opt_view(probs, "probs"), mlp_config(act, glu_interleave, alpha, limit, offset), saved,
            dx ? rows_of(*dx, "dx") : TensorView{}, view_of(d_h, "d_h"),
            opt_view(dprobs, "dprobs"), stream_of(s));
      },
      nb::arg("dy"), nb::arg("fc1"), nb::arg("fc2"), nb::arg("bias1").none(),
      nb::arg("bias2").none(), nb::arg("offsets"), nb::arg("real_rows").none(),
      nb::arg("probs").none(), nb::arg("activation"), nb::arg("glu_interleave"), nb::arg("alpha"),
      nb::arg("limit"), nb::arg("offset"), nb::arg("h"), nb::arg("dx").none(), nb::arg("d_h"),
      nb::arg("dprobs").none(), nb::arg("stream") = 0);
  m.def(
      "grouped_mlp_backward_fc1_dgrad",
      [](const Array& d_h, const Array& fc1, const Array& fc2, const Array& offsets,
         const std::optional<Array>& real_rows, const std::string& act, int glu_interleave,
         float alpha, float limit, float offset, const AnyArray& dx, uintptr_t s) {
        grouped_mlp_backward_fc1_dgrad(view_of(d_h, "d_h"), mlp_weights(fc1, fc2, {}, {}),
                                       layout(offsets, real_rows),
                                       mlp_config(act, glu_interleave, alpha, limit, offset),
                                       rows_of(dx, "dx"), stream_of(s));
      },
      nb::arg("d_h"), nb::arg("fc1"), nb::arg("fc2"), nb::arg("offsets"),
      nb::arg("real_rows").none(), nb::arg("activation"), nb::arg("glu_interleave"),
      nb::arg("alpha"), nb::arg("limit"), nb::arg("offset"), nb::arg("dx"),
      nb::arg("stream") = 0);
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
      "grouped_mlp_activation_backward",
      [](const Array& h, const Array& offsets, const std::optional<Array>& real_rows,
         const std::optional<Array>& probs, const std::string& act, int glu_interleave, float alpha,
         float limit, float offset, const Array& d_h, const std::optional<Array>& dprobs,
         uintptr_t s, const std::optional<Array>& d_h_amax) {
        grouped_mlp_activation_backward(
            view_of(h, "h"), layout(offsets, real_rows), opt_view(probs, "probs"),
            mlp_config(act, glu_interleave, alpha, limit, offset), view_of(d_h, "d_h"),
            opt_view(dprobs, "dprobs"), opt_view(d_h_amax, "d_h_amax"), stream_of(s));
      },
      nb::arg("h"), nb::arg("offsets"), nb::arg("real_rows").none(), nb::arg("probs").none(),
      nb::arg("activation"), nb::arg("glu_interleave"), nb::arg("alpha"), nb::arg("limit"),
      nb::arg("offset"), nb::arg("d_h"), nb::arg("dprobs").none(), nb::arg("stream") = 0,
      nb::arg("d_h_amax").none() = nb::none());
  m.def(
      "grouped_mlp_activation_quantize",
      [](const Array& h, const Array& offsets, const std::optional<Array>& real_rows,
         const std::optional<Array>& probs, const std::string& act, int glu_interleave, float alpha,
         float limit, float offset, const std::string& fmt, bool pow2, const AnyArray& a_q,
         const Array& a_scales, uintptr_t s, const std::string& scaling,
         const std::optional<Array>& a_q_t) {
        grouped_mlp_activation_quantize(
            view_of(h, "h"), layout(offsets, real_rows), opt_view(probs, "probs"),
            mlp_config(act, glu_interleave, alpha, limit, offset),
            quantize_config(fmt, scaling, pow2, false), rows_of(a_q, "a_q"),
            view_of(a_scales, "a_scales"), opt_view(a_q_t, "a_q_t"), stream_of(s));
      },
      nb::arg("h"), nb::arg("offsets"), nb::arg("real_rows").none(), nb::arg("probs").none(),
      nb::arg("activation"), nb::arg("glu_interleave"), nb::arg("alpha"), nb::arg("limit"),
      nb::arg("offset"), nb::arg("fp8_format"), nb::arg("pow2_scales"), nb::arg("a_q"),
      nb::arg("a_scales"), nb::arg("stream") = 0, nb::arg("scaling") = "1x128",
      nb::arg("a_q_t").none() = nb::none());
  m.def(
      "grouped_mlp_backward_wgrad",
      [](const std::optional<AnyArray>& dy, const std::optional<AnyArray>& x,
         const Array& offsets, const std::optional<Array>& real_rows,
         const std::optional<Array>& h, const std::optional<Array>& a,
         const std::optional<Array>& d_h, const std::optional<Array>& dw1,
         const std::optional<Array>& dw2, const std::optional<Array>& db1,
         const std::optional<Array>& db2, bool accumulate, uintptr_t s) {
        // h: not read by the weight gradients (may be None)
        GroupedMlpSaved saved{opt_view(h, "h"), opt_view(a, "a")};
        GroupedMlpGrads g;
        g.dw1 = opt_view(dw1, "dw1");
        g.dw2 = opt_view(dw2, "dw2");
        g.dbias1 = opt_view(db1, "dbias1");
        g.dbias2 = opt_view(db2, "dbias2");
        g.accumulate = accumulate;
        grouped_mlp_backward_wgrad(dy ? rows_of(*dy, "dy") : TensorView{},
                                   x ? rows_of(*x, "x") : TensorView{}, layout(offsets, real_rows),
                                   saved, opt_view(d_h, "d_h"), g, stream_of(s));
      },
      nb::arg("dy").none(), nb::arg("x").none(), nb::arg("offsets"), nb::arg("real_rows").none(),
      nb::arg("h").none(), nb::arg("a").none(), nb::arg("d_h").none(), nb::arg("dw1").none(),
      nb::arg("dw2").none(),
      nb::arg("dbias1").none(), nb::arg("dbias2").none(), nb::arg("accumulate"),
      nb::arg("stream") = 0);

  bind_checkpoint(m);
  bind_ep(m);
}
