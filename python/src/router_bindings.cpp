// moeflow._C's router API (moeflow/router.h): the router forward and
// backward, expert capacity, the expert-bias update and the router GEMM's
// bf16 split, over arrays the caller allocates (outputs and workspaces), on
// the stream given as an integer.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include "arrays.h"
#include "moeflow/router.h"
#include "router_config.h"

using namespace moeflow;

namespace moeflow::python {
namespace {

DropPolicy drop_policy_of(const std::string& s) {
  if (s == "probs") return DropPolicy::kProbs;
  if (s == "position") return DropPolicy::kPosition;
  MOEFLOW_CHECK(false, "drop_policy must be 'probs' or 'position', got '", s, "'");
  return DropPolicy::kProbs;
}

}  // namespace

void bind_router(nb::module_& m) {
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
         const Array& tpe, const std::optional<Array>& aux_loss, const std::optional<Array>& z_loss,
         const std::optional<Array>& seq_aux_loss, const std::optional<Array>& seq_tpe,
         const std::optional<Array>& nonfinite, const std::optional<Array>& invalid_cu_seqlens,
         const std::optional<Array>& bias, const std::optional<Array>& padding_mask,
         const std::optional<Array>& cu_seqlens, const std::optional<Array>& ws, uintptr_t s) {
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
        router_forward(
            view_of(logits, "logits"), router_config(E, K, sf, pre, ng, gk, scale, aux, z, seq),
            out, opt_view(bias, "expert_bias"), opt_view(ws, "workspace"), stream_of(s), tokens);
      },
      nb::arg("logits"), MOEFLOW_ROUTER_CONFIG_ARGS, nb::arg("topk_ids"), nb::arg("probs"),
      nb::arg("tokens_per_expert"), nb::arg("aux_loss").none() = nb::none(),
      nb::arg("z_loss").none() = nb::none(), nb::arg("seq_aux_loss").none() = nb::none(),
      nb::arg("seq_tokens_per_expert").none() = nb::none(),
      nb::arg("nonfinite").none() = nb::none(), nb::arg("invalid_cu_seqlens").none() = nb::none(),
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
  m.def("router_capacity_workspace_bytes", &router_capacity_workspace_bytes, nb::arg("num_tokens"),
        nb::arg("topk"), nb::arg("num_experts"));
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
  // parts: the blocks' parts as digits, e.g. "0120" (Bf16SplitLayout)
  m.def(
      "router_split_bf16",
      [](const Array& src, const std::string& parts, bool along_columns, const Array& dst,
         uintptr_t s) {
        Bf16SplitLayout layout;
        MOEFLOW_CHECK(!parts.empty() && parts.size() <= 4,
                      "parts: expected 1 to 4 digits (0, 1 or 2), got '", parts, "'");
        layout.count = static_cast<int>(parts.size());
        for (size_t i = 0; i < parts.size(); ++i) layout.parts[i] = parts[i] - '0';
        layout.along_columns = along_columns;
        router_split_bf16(view_of(src, "src"), layout, view_of(dst, "dst"), stream_of(s));
      },
      nb::arg("src"), nb::arg("parts"), nb::arg("along_columns"), nb::arg("dst"),
      nb::arg("stream") = 0);
}

}  // namespace moeflow::python
