// Public router entry points: checks of the configuration and of every
// argument (shape, dtype, device), then dispatch to the CPU or CUDA backend
// by the device of the logits.
#include "moeflow/router.h"

#include <cmath>

#include "core/backends.h"
#include "core/internal.h"

namespace moeflow {

using detail::Expect;

static void check_config(const RouterConfig& c) {
  const int E = c.num_experts;
  MOEFLOW_CHECK(E >= 1, "RouterConfig.num_experts must be >= 1, got ", E);
  MOEFLOW_CHECK(c.topk >= 1 && c.topk <= E, "RouterConfig.topk must be in [1, num_experts=", E,
                "], got ", c.topk);
  MOEFLOW_CHECK(
      c.score_function == ScoreFunction::kSoftmax || c.score_function == ScoreFunction::kSigmoid,
      "RouterConfig.score_function must be kSoftmax or kSigmoid, got ",
      static_cast<int>(c.score_function));
  MOEFLOW_CHECK(!c.pre_softmax || c.score_function == ScoreFunction::kSoftmax,
                "RouterConfig.pre_softmax needs score_function kSoftmax, got kSigmoid");
  MOEFLOW_CHECK(c.num_groups >= 0, "RouterConfig.num_groups must be >= 0, got ", c.num_groups);
  if (c.num_groups > 0) {
    MOEFLOW_CHECK(E % c.num_groups == 0, "RouterConfig.num_groups must divide num_experts=", E,
                  ", got ", c.num_groups);
    MOEFLOW_CHECK(c.group_topk >= 1 && c.group_topk <= c.num_groups,
                  "RouterConfig.group_topk must be in [1, num_groups=", c.num_groups, "], got ",
                  c.group_topk);
    MOEFLOW_CHECK(c.topk % c.group_topk == 0,
                  "RouterConfig.topk must be a multiple of group_topk=", c.group_topk, ", got ",
                  c.topk);
    const int64_t room = static_cast<int64_t>(c.group_topk) * (E / c.num_groups);
    MOEFLOW_CHECK(c.topk <= room,
                  "RouterConfig.topk must be <= group_topk * num_experts / "
                  "num_groups = ",
                  room, ", got ", c.topk);
  } else {
    MOEFLOW_CHECK(c.group_topk == 0,
                  "RouterConfig.group_topk needs num_groups > 0, got group_topk=", c.group_topk,
                  " with num_groups=0");
  }
  MOEFLOW_CHECK(std::isfinite(c.topk_scaling_factor),
                "RouterConfig.topk_scaling_factor must be finite, got ", c.topk_scaling_factor);
  MOEFLOW_CHECK(std::isfinite(c.aux_loss_coeff), "RouterConfig.aux_loss_coeff must be finite, got ",
                c.aux_loss_coeff);
  MOEFLOW_CHECK(std::isfinite(c.z_loss_coeff), "RouterConfig.z_loss_coeff must be finite, got ",
                c.z_loss_coeff);
}

// logits must be float32 [T,E]; returns T.
static int64_t check_logits(TensorView logits, const RouterConfig& c) {
  detail::expect_defined(logits, "logits");
  MOEFLOW_CHECK(logits.ndim == 2, "logits must be float32 [T,E=", c.num_experts, "], got ",
                logits.str());
  detail::expect(logits, "logits", Expect{{DType::kFloat32}, {-1, c.num_experts}, logits.device});
  return logits.shape[0];
}

#ifdef MOEFLOW_WITH_CUDA
static void select_device(Device dev) {
  if (dev.is_cuda()) detail::cuda_set_device(dev.index);
}
#endif

size_t router_workspace_bytes(int64_t num_tokens, const RouterConfig& config) {
  check_config(config);
  MOEFLOW_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
#ifdef MOEFLOW_WITH_CUDA
  return cuda::router_workspace_bytes(num_tokens, config);
#else
  return 0;
#endif
}

void router_forward(TensorView logits, const RouterConfig& config, const RouterOutputs& out,
                    TensorView expert_bias, TensorView workspace, cudaStream_t stream) {
  check_config(config);
  const int64_t T = check_logits(logits, config);
  const int E = config.num_experts, K = config.topk;
  const Device dev = logits.device;
  if (expert_bias.defined()) {
    MOEFLOW_CHECK(config.score_function == ScoreFunction::kSigmoid,
                  "expert_bias needs score_function kSigmoid, got kSoftmax");
    detail::expect(expert_bias, "expert_bias", Expect{{DType::kFloat32}, {E}, dev});
  }
  detail::expect(out.topk_ids, "topk_ids", Expect{{DType::kInt32}, {T, K}, dev});
  detail::expect(out.probs, "probs", Expect{{DType::kFloat32}, {T, K}, dev});
  detail::expect(out.tokens_per_expert, "tokens_per_expert", Expect{{DType::kInt32}, {E}, dev});
  if (config.aux_loss_coeff != 0.0f || out.aux_loss.defined())
    detail::expect(out.aux_loss, "aux_loss", Expect{{DType::kFloat32}, {1}, dev});
  if (config.z_loss_coeff != 0.0f || out.z_loss.defined())
    detail::expect(out.z_loss, "z_loss", Expect{{DType::kFloat32}, {1}, dev});
  if (out.nonfinite.defined())
    detail::expect(out.nonfinite, "nonfinite", Expect{{DType::kInt32}, {1}, dev});
  if (dev.is_cpu()) return cpu::router_forward(logits, config, out, expert_bias);
#ifdef MOEFLOW_WITH_CUDA
  const size_t need = cuda::router_workspace_bytes(T, config);
  if (need > 0) {
    detail::expect(workspace, "workspace", Expect{{DType::kUInt8}, {-1}, dev});
    MOEFLOW_CHECK(workspace.nbytes() >= need, "workspace must hold >= ", need,
                  " bytes (router_workspace_bytes), got ", workspace.nbytes());
  }
  select_device(dev);
  cuda::router_forward(logits, config, out, expert_bias, workspace, stream);
#else
  (void)workspace;
  (void)stream;
#endif
}

void router_backward(TensorView logits, TensorView topk_ids, TensorView tokens_per_expert,
                     const RouterGrads& grads, const RouterConfig& config, TensorView dlogits,
                     cudaStream_t stream) {
  check_config(config);
  const int64_t T = check_logits(logits, config);
  const int E = config.num_experts, K = config.topk;
  const Device dev = logits.device;
  detail::expect(topk_ids, "topk_ids", Expect{{DType::kInt32}, {T, K}, dev});
  detail::expect(grads.dprobs, "dprobs", Expect{{DType::kFloat32}, {T, K}, dev});
  if (config.aux_loss_coeff != 0.0f || tokens_per_expert.defined())
    detail::expect(tokens_per_expert, "tokens_per_expert", Expect{{DType::kInt32}, {E}, dev});
  if (grads.daux_loss.defined())
    detail::expect(grads.daux_loss, "daux_loss", Expect{{DType::kFloat32}, {1}, dev});
  if (grads.dz_loss.defined())
    detail::expect(grads.dz_loss, "dz_loss", Expect{{DType::kFloat32}, {1}, dev});
  detail::expect(dlogits, "dlogits", Expect{{DType::kFloat32}, {T, E}, dev});
  if (dev.is_cpu())
    return cpu::router_backward(logits, topk_ids, tokens_per_expert, grads, config, dlogits);
#ifdef MOEFLOW_WITH_CUDA
  select_device(dev);
  cuda::router_backward(logits, topk_ids, tokens_per_expert, grads, config, dlogits, stream);
#else
  (void)stream;
#endif
}

void router_update_expert_bias(TensorView tokens_per_expert, TensorView expert_bias, float rate,
                               cudaStream_t stream) {
  detail::expect_defined(tokens_per_expert, "tokens_per_expert");
  MOEFLOW_CHECK(tokens_per_expert.ndim == 1, "tokens_per_expert must be int32 [E], got ",
                tokens_per_expert.str());
  const int64_t E = tokens_per_expert.shape[0];
  const Device dev = tokens_per_expert.device;
  detail::expect(tokens_per_expert, "tokens_per_expert", Expect{{DType::kInt32}, {E}, dev});
  detail::expect(expert_bias, "expert_bias", Expect{{DType::kFloat32}, {E}, dev});
  MOEFLOW_CHECK(std::isfinite(rate), "rate must be finite, got ", rate);
  if (dev.is_cpu()) return cpu::router_update_expert_bias(tokens_per_expert, expert_bias, rate);
#ifdef MOEFLOW_WITH_CUDA
  select_device(dev);
  cuda::router_update_expert_bias(tokens_per_expert, expert_bias, rate, stream);
#else
  (void)stream;
#endif
}

}  // namespace moeflow
