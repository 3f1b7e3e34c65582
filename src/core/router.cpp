// Public router entry points: checks of the configuration and of every
// argument (shape, dtype, device), then dispatch to the CPU or CUDA backend
// by the device of the logits.
#include "moeflow/router.h"

#include <cmath>
#include <utility>
#include <vector>

#include "core/backends.h"
#include "core/internal.h"
#include "core/router_backend.h"

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
  MOEFLOW_CHECK(std::isfinite(c.seq_aux_loss_coeff),
                "RouterConfig.seq_aux_loss_coeff must be finite, got ", c.seq_aux_loss_coeff);
}

// padding_mask [T] bool/uint8 (optional) and cu_seqlens [S+1] int32 (required
// when seq_aux_loss_coeff != 0); returns S (0 without cu_seqlens).
static int64_t check_tokens(const RouterTokenInfo& tokens, const RouterConfig& c, int64_t T,
                            Device dev) {
  if (tokens.padding_mask.defined())
    detail::expect(tokens.padding_mask, "padding_mask",
                   Expect{{DType::kBool, DType::kUInt8}, {T}, dev});
  if (c.seq_aux_loss_coeff == 0.0f && !tokens.cu_seqlens.defined()) return 0;
  detail::expect_defined(tokens.cu_seqlens, "cu_seqlens");
  MOEFLOW_CHECK(tokens.cu_seqlens.ndim == 1 && tokens.cu_seqlens.shape[0] >= 2,
                "cu_seqlens must be int32 [S+1] with S >= 1, got ", tokens.cu_seqlens.str());
  detail::expect(tokens.cu_seqlens, "cu_seqlens", Expect{{DType::kInt32}, {-1}, dev});
  return tokens.cu_seqlens.shape[0] - 1;
}

// The float dtypes a tensor of the router may have on `dev`: float32, and on
// the CPU also float64 (gradient checks).
static std::vector<DType> float_dtypes(Device dev) {
  if (dev.is_cpu()) return {DType::kFloat32, DType::kFloat64};
  return {DType::kFloat32};
}

// logits must be float32 [T,E] (or float64 on the CPU); returns T.
static int64_t check_logits(TensorView logits, const RouterConfig& c) {
  detail::expect_defined(logits, "logits");
  MOEFLOW_CHECK(logits.ndim == 2, "logits must be float32 [T,E=", c.num_experts, "], got ",
                logits.str());
  MOEFLOW_CHECK(logits.device.is_cpu() || logits.dtype != DType::kFloat64,
                "logits must be float32 on ", logits.device.str(),
                " (float64 logits are taken on the CPU only), got ", logits.str());
  detail::expect(logits, "logits",
                 Expect{float_dtypes(logits.device), {-1, c.num_experts}, logits.device});
  return logits.shape[0];
}

// A float tensor that follows the dtype of the logits (float32 or float64).
static void expect_float(const TensorView& v, const char* name, std::vector<int64_t> shape,
                         const TensorView& logits) {
  detail::expect_defined(v, name);
  MOEFLOW_CHECK(v.dtype == logits.dtype, name, " must be ", dtype_name(logits.dtype),
                " (the dtype of logits), got ", v.str());
  detail::expect(v, name, Expect{{logits.dtype}, std::move(shape), logits.device});
}

size_t router_workspace_bytes(int64_t num_tokens, const RouterConfig& config,
                              int64_t num_sequences) {
  check_config(config);
  MOEFLOW_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
  MOEFLOW_CHECK(num_sequences >= 0, "num_sequences must be >= 0, got ", num_sequences);
#ifdef MOEFLOW_WITH_CUDA
  return cuda::router_workspace_bytes(num_tokens, config, num_sequences);
#else
  return 0;
#endif
}

void router_forward(TensorView logits, const RouterConfig& config, const RouterOutputs& out,
                    TensorView expert_bias, TensorView workspace, cudaStream_t stream,
                    const RouterTokenInfo& tokens) {
  check_config(config);
  const int64_t T = check_logits(logits, config);
  const int E = config.num_experts, K = config.topk;
  const Device dev = logits.device;
  if (expert_bias.defined()) {
    MOEFLOW_CHECK(config.score_function == ScoreFunction::kSigmoid,
                  "expert_bias needs score_function kSigmoid, got kSoftmax");
    expect_float(expert_bias, "expert_bias", {E}, logits);
  }
  const int64_t S = check_tokens(tokens, config, T, dev);
  detail::expect(out.topk_ids, "topk_ids", Expect{{DType::kInt32}, {T, K}, dev});
  expect_float(out.probs, "probs", {T, K}, logits);
  detail::expect(out.tokens_per_expert, "tokens_per_expert", Expect{{DType::kInt32}, {E}, dev});
  if (config.aux_loss_coeff != 0.0f || out.aux_loss.defined())
    expect_float(out.aux_loss, "aux_loss", {1}, logits);
  if (config.z_loss_coeff != 0.0f || out.z_loss.defined())
    expect_float(out.z_loss, "z_loss", {1}, logits);
  if (out.nonfinite.defined())
    detail::expect(out.nonfinite, "nonfinite", Expect{{DType::kInt32}, {1}, dev});
  if (config.seq_aux_loss_coeff != 0.0f || out.seq_aux_loss.defined())
    expect_float(out.seq_aux_loss, "seq_aux_loss", {1}, logits);
  if (config.seq_aux_loss_coeff != 0.0f || out.seq_tokens_per_expert.defined()) {
    MOEFLOW_CHECK(S > 0, "seq_tokens_per_expert needs cu_seqlens");
    detail::expect(out.seq_tokens_per_expert, "seq_tokens_per_expert",
                   Expect{{DType::kInt32}, {S, E}, dev});
  }
  if (out.invalid_cu_seqlens.defined())
    detail::expect(out.invalid_cu_seqlens, "invalid_cu_seqlens", Expect{{DType::kInt32}, {1}, dev});
  RouterForwardArgs a;
  a.logits = logits;
  a.config = config;
  a.out = out;
  a.expert_bias = expert_bias;
  a.padding_mask = tokens.padding_mask;
  a.cu_seqlens = S > 0 ? tokens.cu_seqlens : TensorView{};
  a.num_sequences = S;
  if (dev.is_cpu()) return cpu::router_forward(a);
#ifdef MOEFLOW_WITH_CUDA
  // The sequence stage (and its workspace) runs when its counts are wanted.
  const int64_t S_used = out.seq_tokens_per_expert.defined() ? S : 0;
  const size_t need = cuda::router_workspace_bytes(T, config, S_used);
  if (need > 0) {
    detail::expect(workspace, "workspace", Expect{{DType::kUInt8}, {-1}, dev});
    MOEFLOW_CHECK(workspace.nbytes() >= need, "workspace must hold >= ", need,
                  " bytes (router_workspace_bytes), got ", workspace.nbytes());
  }
  a.workspace = workspace;
  const detail::DeviceGuard device_guard(dev);
  cuda::router_forward(a, stream);
#else
  (void)workspace;
  (void)stream;
#endif
}

void router_backward(TensorView logits, TensorView topk_ids, TensorView tokens_per_expert,
                     const RouterGrads& grads, const RouterConfig& config, TensorView dlogits,
                     cudaStream_t stream, const RouterTokenInfo& tokens,
                     TensorView seq_tokens_per_expert) {
  check_config(config);
  const int64_t T = check_logits(logits, config);
  const int E = config.num_experts, K = config.topk;
  const Device dev = logits.device;
  detail::expect(topk_ids, "topk_ids", Expect{{DType::kInt32}, {T, K}, dev});
  expect_float(grads.dprobs, "dprobs", {T, K}, logits);
  const int64_t S = check_tokens(tokens, config, T, dev);
  // With a padding mask the losses' token count comes from tokens_per_expert.
  const bool need_counts = config.aux_loss_coeff != 0.0f ||
                           (tokens.padding_mask.defined() && config.z_loss_coeff != 0.0f);
  if (need_counts || tokens_per_expert.defined())
    detail::expect(tokens_per_expert, "tokens_per_expert", Expect{{DType::kInt32}, {E}, dev});
  if (config.seq_aux_loss_coeff != 0.0f || seq_tokens_per_expert.defined()) {
    MOEFLOW_CHECK(S > 0, "seq_tokens_per_expert needs cu_seqlens");
    detail::expect(seq_tokens_per_expert, "seq_tokens_per_expert",
                   Expect{{DType::kInt32}, {S, E}, dev});
  }
  if (grads.daux_loss.defined()) expect_float(grads.daux_loss, "daux_loss", {1}, logits);
  if (grads.dz_loss.defined()) expect_float(grads.dz_loss, "dz_loss", {1}, logits);
  if (grads.dseq_aux_loss.defined())
    expect_float(grads.dseq_aux_loss, "dseq_aux_loss", {1}, logits);
  expect_float(dlogits, "dlogits", {T, E}, logits);
  RouterBackwardArgs a;
  a.logits = logits;
  a.topk_ids = topk_ids;
  a.tokens_per_expert = tokens_per_expert;
  a.grads = grads;
  a.config = config;
  a.dlogits = dlogits;
  a.padding_mask = tokens.padding_mask;
  a.cu_seqlens = S > 0 ? tokens.cu_seqlens : TensorView{};
  a.seq_tokens_per_expert = seq_tokens_per_expert;
  a.num_sequences = S;
  if (dev.is_cpu()) return cpu::router_backward(a);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::router_backward(a, stream);
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
  const detail::DeviceGuard device_guard(dev);
  cuda::router_update_expert_bias(tokens_per_expert, expert_bias, rate, stream);
#else
  (void)stream;
#endif
}

void router_split_bf16(TensorView src, const Bf16SplitLayout& layout, TensorView dst,
                       cudaStream_t stream) {
  detail::expect_defined(src, "src");
  detail::expect_defined(dst, "dst");
  MOEFLOW_CHECK(src.ndim == 2, "src must be float32 [R,C], got ", src.str());
  const int n = layout.count;
  MOEFLOW_CHECK(n >= 1 && n <= 4, "layout.count must be in [1, 4], got ", n);
  for (int i = 0; i < n; ++i)
    MOEFLOW_CHECK(layout.parts[i] >= 0 && layout.parts[i] <= 2, "layout.parts[", i,
                  "] must be 0, 1 or 2, got ", layout.parts[i]);
  const int64_t R = src.shape[0], C = src.shape[1];
  const Device dev = src.device;
  detail::expect(src, "src", Expect{{DType::kFloat32}, {R, C}, dev});
  detail::expect(
      dst, "dst",
      Expect{{DType::kBFloat16},
             layout.along_columns ? std::vector<int64_t>{R, n * C} : std::vector<int64_t>{n * R, C},
             dev});
  if (dev.is_cpu()) return cpu::router_split_bf16(src, layout, dst);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::router_split_bf16(src, layout, dst, stream);
#else
  (void)stream;
#endif
}

int64_t router_capacity(int64_t num_tokens, int topk, int num_experts, double capacity_factor,
                        int64_t min_capacity) {
  MOEFLOW_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
  MOEFLOW_CHECK(topk >= 1, "topk must be >= 1, got ", topk);
  MOEFLOW_CHECK(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
  MOEFLOW_CHECK(std::isfinite(capacity_factor) && capacity_factor > 0.0,
                "capacity_factor must be finite and > 0, got ", capacity_factor);
  MOEFLOW_CHECK(min_capacity >= 0, "min_capacity must be >= 0, got ", min_capacity);
  // Megatron: math.ceil((num_tokens / num_experts) * capacity_factor), with
  // num_tokens = T * K, in Python floats (double).
  const double c = std::ceil(static_cast<double>(num_tokens * topk) /
                             static_cast<double>(num_experts) * capacity_factor);
  MOEFLOW_CHECK(c < 9.0e18, "capacity too large: ", c);
  const int64_t capacity = static_cast<int64_t>(c);
  return capacity < min_capacity ? min_capacity : capacity;
}

size_t router_capacity_workspace_bytes(int64_t num_tokens, int topk, int num_experts) {
  MOEFLOW_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
  MOEFLOW_CHECK(topk >= 1, "topk must be >= 1, got ", topk);
  MOEFLOW_CHECK(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
#ifdef MOEFLOW_WITH_CUDA
  return cuda::router_capacity_workspace_bytes(num_tokens, topk, num_experts);
#else
  return 0;
#endif
}

void router_apply_capacity(TensorView topk_ids, TensorView probs,
                           const RouterCapacityConfig& config, TensorView kept_ids,
                           TensorView dropped, TensorView workspace, cudaStream_t stream) {
  const int E = config.num_experts;
  MOEFLOW_CHECK(E >= 1, "RouterCapacityConfig.num_experts must be >= 1, got ", E);
  MOEFLOW_CHECK(std::isfinite(config.capacity_factor) && config.capacity_factor > 0.0,
                "RouterCapacityConfig.capacity_factor must be finite and > 0, got ",
                config.capacity_factor);
  MOEFLOW_CHECK(
      config.drop_policy == DropPolicy::kProbs || config.drop_policy == DropPolicy::kPosition,
      "RouterCapacityConfig.drop_policy must be kProbs or kPosition, got ",
      static_cast<int>(config.drop_policy));
  MOEFLOW_CHECK(config.min_capacity >= 0, "RouterCapacityConfig.min_capacity must be >= 0, got ",
                config.min_capacity);
  detail::expect_defined(topk_ids, "topk_ids");
  MOEFLOW_CHECK(topk_ids.ndim == 2 && topk_ids.shape[1] >= 1, "topk_ids must be int32 [T,K], got ",
                topk_ids.str());
  const int64_t T = topk_ids.shape[0];
  const int64_t K = topk_ids.shape[1];
  const Device dev = topk_ids.device;
  detail::expect(topk_ids, "topk_ids", Expect{{DType::kInt32}, {T, K}, dev});
  if (config.drop_policy == DropPolicy::kProbs || probs.defined())
    detail::expect(probs, "probs", Expect{float_dtypes(dev), {T, K}, dev});
  detail::expect(kept_ids, "kept_ids", Expect{{DType::kInt32}, {T, K}, dev});
  if (dropped.defined()) detail::expect(dropped, "dropped", Expect{{DType::kInt32}, {1}, dev});
  MOEFLOW_CHECK(K <= 0x7FFFFFFF && T * K <= 0x7FFFFFFF, "topk_ids has too many slots (", T * K,
                "; at most 2^31 - 1)");
  RouterCapacityArgs a;
  a.topk_ids = topk_ids;
  a.probs = config.drop_policy == DropPolicy::kProbs ? probs : TensorView{};
  a.config = config;
  a.capacity =
      router_capacity(T, static_cast<int>(K), E, config.capacity_factor, config.min_capacity);
  a.kept_ids = kept_ids;
  a.dropped = dropped;
  if (dev.is_cpu()) return cpu::router_apply_capacity(a);
#ifdef MOEFLOW_WITH_CUDA
  const size_t need = cuda::router_capacity_workspace_bytes(T, static_cast<int>(K), E);
  if (need > 0 && a.capacity < T) {
    detail::expect(workspace, "workspace", Expect{{DType::kUInt8}, {-1}, dev});
    MOEFLOW_CHECK(workspace.nbytes() >= need, "workspace must hold >= ", need,
                  " bytes (router_capacity_workspace_bytes), got ", workspace.nbytes());
  }
  a.workspace = workspace;
  const detail::DeviceGuard device_guard(dev);
  cuda::router_apply_capacity(a, stream);
#else
  (void)workspace;
  (void)stream;
#endif
}

}  // namespace moeflow
