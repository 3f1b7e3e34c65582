// The router's torch autograd node in C++ (moeflow._autograd.router):
// moeflow.ops.router's outputs and gradients bit for bit those of its
// Python node (_router_ops._Router), in one call from Python.
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moeflow/router.h"
#include "router_config.h"
#include "torch_common.h"

namespace moeflow::python {
namespace {

// One router call: the configuration, the inputs that take no gradient,
// and the outputs that are not the node's (no gradient: ids, counts,
// non-finite count).
struct RouterCall {
  RouterConfig config;
  at::Tensor bias, mask, cu;  // contiguous, or undefined
  at::Tensor ids, tpe, nonfinite, seq_tpe;
  bool aux() const { return config.aux_loss_coeff != 0; }
  bool z() const { return config.z_loss_coeff != 0; }
  bool seq() const { return config.seq_aux_loss_coeff != 0; }
  bool losses() const { return aux() || z() || seq(); }
};

// The configuration as a node's saved data (IValues; floats exact in doubles).
std::vector<double> pack(const RouterConfig& c) {
  return {double(c.num_experts), double(c.topk),       double(int(c.score_function)),
          double(c.pre_softmax), double(c.num_groups), double(c.group_topk),
          c.topk_scaling_factor, c.aux_loss_coeff,     c.z_loss_coeff,
          c.seq_aux_loss_coeff};
}
RouterConfig unpack(const std::vector<double>& v) {
  RouterConfig c;
  c.num_experts = int(v[0]);
  c.topk = int(v[1]);
  c.score_function = static_cast<ScoreFunction>(int(v[2]));
  c.pre_softmax = v[3] != 0;
  c.num_groups = int(v[4]);
  c.group_topk = int(v[5]);
  c.topk_scaling_factor = float(v[6]);
  c.aux_loss_coeff = float(v[7]);
  c.z_loss_coeff = float(v[8]);
  c.seq_aux_loss_coeff = float(v[9]);
  return c;
}

// A one-element tensor (a 0-dim loss or its gradient) as the [1] the C++ API takes.
TensorView one_view(const at::Tensor& t, const char* name) {
  if (!t.defined()) return {};
  MOEFLOW_CHECK(t.numel() == 1, name, ": expected one element, got ", t.numel());
  TensorView v = view_of(t, name);
  v.ndim = 1;
  v.shape[0] = 1;
  v.strides[0] = 1;
  return v;
}

// logits [T, E] -> probs [T, K], then the losses that are on (aux, z, seq
// in that order), as the node's outputs.
struct RouterNode : torch::autograd::Function<RouterNode> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits_in,
                               RouterCall* call) {
    const RouterConfig& c = call->config;
    // float32, or float64 on the CPU: the probs and losses in the logits' dtype.
    const at::Tensor logits = logits_in.contiguous();
    const int64_t T = logits.size(0);
    const auto opts = logits.options();
    const auto i32 = opts.dtype(at::kInt);
    call->ids = at::empty({T, c.topk}, i32);
    at::Tensor probs = at::empty({T, c.topk}, opts);
    // The small int32 outputs share one allocation: counts [E], nonfinite [1].
    const at::Tensor small = at::empty({c.num_experts + 1}, i32);
    call->tpe = small.narrow(0, 0, c.num_experts);
    call->nonfinite = small.narrow(0, c.num_experts, 1);
    const int64_t S = call->cu.defined() ? call->cu.size(0) - 1 : 0;
    at::Tensor aux, z, seq, ws;
    if (call->aux()) aux = at::empty({}, opts);
    if (call->z()) z = at::empty({}, opts);
    if (call->seq()) {
      seq = at::empty({}, opts);
      call->seq_tpe = at::empty({S, c.num_experts}, i32);
    }
    if (logits.is_cuda()) {
      const size_t n = api().router_workspace_bytes(T, c, S);
      if (n) ws = at::empty({static_cast<int64_t>(n)}, opts.dtype(at::kByte));
    }
    RouterOutputs out;
    out.topk_ids = view_of(call->ids, "topk_ids");
    out.probs = view_of(probs, "probs");
    out.tokens_per_expert = view_of(call->tpe, "tokens_per_expert");
    out.aux_loss = one_view(aux, "aux_loss");
    out.z_loss = one_view(z, "z_loss");
    out.seq_aux_loss = one_view(seq, "seq_aux_loss");
    out.seq_tokens_per_expert = opt_view(call->seq_tpe, "seq_tokens_per_expert");
    out.nonfinite = view_of(call->nonfinite, "nonfinite");
    const RouterTokenInfo tokens{opt_view(call->mask, "padding_mask"),
                                 opt_view(call->cu, "cu_seqlens")};
    api().router_forward(view_of(logits, "logits"), c, out, opt_view(call->bias, "expert_bias"),
                         opt_view(ws, "workspace"), stream_of(logits), tokens);
    if (ctx) {
      ctx->set_materialize_grads(false);
      ctx->saved_data["cfg"] = pack(c);
      // The backward reads the logits, the choice, the counts (losses) and
      // the token structure.
      ctx->save_for_backward({logits, call->ids, call->losses() ? call->tpe : at::Tensor(),
                              call->mask, call->seq() ? call->cu : at::Tensor(), call->seq_tpe});
    }
    variable_list outs{probs};
    for (const at::Tensor* t : {&aux, &z, &seq})
      if (t->defined()) outs.push_back(*t);
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const RouterConfig c = unpack(ctx->saved_data["cfg"].toDoubleVector());
    at::Tensor dprobs = grads[0], daux, dz, dseq;
    size_t i = 1;
    if (c.aux_loss_coeff != 0) daux = grads[i++];
    if (c.z_loss_coeff != 0) dz = grads[i++];
    if (c.seq_aux_loss_coeff != 0) dseq = grads[i++];
    if (!ctx->needs_input_grad(0) ||
        (!dprobs.defined() && !daux.defined() && !dz.defined() && !dseq.defined()))
      return {at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &ids = saved[1], &tpe = saved[2], &mask = saved[3],
                     &cu = saved[4], &seq_tpe = saved[5];
    dprobs = dprobs.defined() ? dprobs.contiguous() : at::zeros(ids.sizes(), logits.options());
    at::Tensor dlogits = at::empty_like(logits);
    auto one = [](const at::Tensor& g) { return g.defined() ? g.contiguous() : g; };
    daux = one(daux);
    dz = one(dz);
    dseq = one(dseq);
    RouterGrads g;
    g.dprobs = view_of(dprobs, "dprobs");
    g.daux_loss = one_view(daux, "daux_loss");
    g.dz_loss = one_view(dz, "dz_loss");
    g.dseq_aux_loss = one_view(dseq, "dseq_aux_loss");
    const RouterTokenInfo tokens{opt_view(mask, "padding_mask"), opt_view(cu, "cu_seqlens")};
    api().router_backward(view_of(logits, "logits"), view_of(ids, "topk_ids"),
                          opt_view(tpe, "tokens_per_expert"), g, c, view_of(dlogits, "dlogits"),
                          stream_of(logits), tokens, opt_view(seq_tpe, "seq_tokens_per_expert"));
    return {dlogits, at::Tensor()};
  }
};

// moeflow.ops.router: (topk_ids, probs, tokens_per_expert, aux_loss, z_loss,
// seq_aux_loss, nonfinite), the losses None where their coefficient is 0.
py::tuple router_op(const at::Tensor& logits, int64_t topk, const std::string& score_function,
                    bool pre_softmax, int64_t num_groups, int64_t group_topk, double scaling,
                    double aux_coeff, double z_coeff, double seq_coeff,
                    const std::optional<at::Tensor>& expert_bias,
                    const std::optional<at::Tensor>& padding_mask,
                    const std::optional<at::Tensor>& cu_seqlens) {
  MOEFLOW_CHECK(logits.dim() == 2, "logits must be float32 [T, E], got ", logits.dim(),
                " dimensions");
  RouterCall call;
  call.config = router_config(
      static_cast<int>(logits.size(1)), static_cast<int>(topk), score_function, pre_softmax,
      static_cast<int>(num_groups), static_cast<int>(group_topk), static_cast<float>(scaling),
      static_cast<float>(aux_coeff), static_cast<float>(z_coeff), static_cast<float>(seq_coeff));
  call.bias = contiguous_or_none(expert_bias).value_or(at::Tensor());
  call.mask = contiguous_or_none(padding_mask).value_or(at::Tensor());
  call.cu = contiguous_or_none(cu_seqlens).value_or(at::Tensor());
  const variable_list out = at::GradMode::is_enabled() && logits.requires_grad()
                                ? RouterNode::apply(logits, &call)
                                : RouterNode::forward(nullptr, logits, &call);
  size_t i = 1;
  const at::Tensor none;
  const at::Tensor& aux = call.aux() ? out[i++] : none;
  const at::Tensor& z = call.z() ? out[i++] : none;
  const at::Tensor& seq = call.seq() ? out[i++] : none;
  return py::make_tuple(call.ids, out[0], call.tpe, aux, z, seq, call.nonfinite);
}

}  // namespace

void bind_router_node(py::module_& m) {
  m.def("router", &router_op, py::arg("logits"), py::arg("topk"), py::arg("score_function"),
        py::arg("pre_softmax"), py::arg("num_groups"), py::arg("group_topk"),
        py::arg("topk_scaling_factor"), py::arg("aux_loss_coeff"), py::arg("z_loss_coeff"),
        py::arg("seq_aux_loss_coeff"), py::arg("expert_bias"), py::arg("padding_mask"),
        py::arg("cu_seqlens"),
        "moeflow.ops.router: (topk_ids, probs, tokens_per_expert, aux_loss, z_loss, "
        "seq_aux_loss, nonfinite)");
}

}  // namespace moeflow::python
