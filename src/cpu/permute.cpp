// CPU reference for permute, unpermute and their backward ops: the oracle for
// the CUDA backend. Sums run in float32 in ascending k order with fused
// multiply-adds, exactly as the CUDA kernels do, so results match bitwise.
#include <cmath>
#include <cstring>
#include <vector>

#include "core/backends.h"
#include "core/internal.h"

namespace moeflow::cpu {

using detail::load_float;
using detail::store_float;

namespace {

// Row r of a [rows, cols] view with unit inner stride, as bytes.
uint8_t* row_ptr(TensorView v, int64_t r) {
  return static_cast<uint8_t*>(v.data) + r * v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
}

// Calls fn(row) for every pad row of every expert segment.
template <typename Fn>
void for_each_pad_row(const RoutingPlan& plan, Fn fn) {
  const auto* kept = plan.tokens_per_expert.data_ptr<int32_t>();
  const auto* padded = plan.padded_tokens_per_expert.data_ptr<int32_t>();
  const auto* offsets = plan.expert_row_offsets.data_ptr<int64_t>();
  for (int e = 0; e < plan.config.num_experts; ++e)
    for (int64_t row = offsets[e] + kept[e]; row < offsets[e] + padded[e]; ++row) fn(row);
}

}  // namespace

void permute(TensorView x, const RoutingPlan& plan, TensorView y, const PermuteExtras& ex) {
  const int64_t row_bytes = x.shape[1] * static_cast<int64_t>(dtype_size(x.dtype));
  const int64_t scale_bytes =
      ex.scales.defined() ? ex.scales.shape[1] * static_cast<int64_t>(dtype_size(ex.scales.dtype)) : 0;
  const auto* dest = plan.dest_row.data_ptr<int64_t>();
  for (int64_t t = 0; t < plan.num_tokens; ++t) {
    for (int k = 0; k < plan.topk; ++k) {
      const int64_t slot = t * plan.topk + k;
      const int64_t row = dest[slot];
      if (row < 0) continue;
      std::memcpy(row_ptr(y, row), row_ptr(x, t), row_bytes);
      if (ex.probs.defined())
        ex.permuted_probs.data_ptr<float>()[row] = ex.probs.data_ptr<float>()[slot];
      if (ex.scales.defined())
        std::memcpy(row_ptr(ex.permuted_scales, row), row_ptr(ex.scales, t), scale_bytes);
    }
  }
  for_each_pad_row(plan, [&](int64_t row) {
    std::memset(row_ptr(y, row), 0, row_bytes);
    if (ex.probs.defined()) ex.permuted_probs.data_ptr<float>()[row] = 0.0f;
    if (ex.scales.defined()) std::memset(row_ptr(ex.permuted_scales, row), 0, scale_bytes);
  });
}

void unpermute(TensorView y, const RoutingPlan& plan, TensorView out, TensorView weights,
               TensorView row_vals, TensorView slot_vals) {
  const int64_t hidden = y.shape[1];
  const auto* dest = plan.dest_row.data_ptr<int64_t>();
  std::vector<float> acc(hidden);
  for (int64_t t = 0; t < plan.num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < plan.topk; ++k) {
      const int64_t slot = t * plan.topk + k;
      const int64_t row = dest[slot];
      if (row_vals.defined())
        slot_vals.data_ptr<float>()[slot] = row >= 0 ? row_vals.data_ptr<float>()[row] : 0.0f;
      if (row < 0) continue;
      const float w = weights.defined() ? weights.data_ptr<float>()[slot] : 1.0f;
      const void* src = row_ptr(y, row);
      for (int64_t h = 0; h < hidden; ++h) acc[h] = std::fma(w, load_float(src, y.dtype, h), acc[h]);
    }
    void* dst = row_ptr(out, t);
    for (int64_t h = 0; h < hidden; ++h) store_float(dst, out.dtype, h, acc[h]);
  }
}

void unpermute_backward(TensorView dout, const RoutingPlan& plan, TensorView y_fwd,
                        TensorView probs, TensorView dy, TensorView dprobs) {
  const int64_t hidden = dout.shape[1];
  const auto* dest = plan.dest_row.data_ptr<int64_t>();
  for (int64_t t = 0; t < plan.num_tokens; ++t) {
    const void* g = row_ptr(dout, t);
    for (int k = 0; k < plan.topk; ++k) {
      const int64_t slot = t * plan.topk + k;
      const int64_t row = dest[slot];
      if (row < 0) {
        if (dprobs.defined()) dprobs.data_ptr<float>()[slot] = 0.0f;
        continue;
      }
      const float w = probs.defined() ? probs.data_ptr<float>()[slot] : 1.0f;
      void* dst = row_ptr(dy, row);
      double dot = 0.0;
      for (int64_t h = 0; h < hidden; ++h) {
        const float gh = load_float(g, dout.dtype, h);
        store_float(dst, dy.dtype, h, w * gh);
        if (dprobs.defined())
          dot += static_cast<double>(gh) * load_float(row_ptr(y_fwd, row), y_fwd.dtype, h);
      }
      if (dprobs.defined()) dprobs.data_ptr<float>()[slot] = static_cast<float>(dot);
    }
  }
  const int64_t row_bytes = hidden * static_cast<int64_t>(dtype_size(dy.dtype));
  for_each_pad_row(plan, [&](int64_t row) { std::memset(row_ptr(dy, row), 0, row_bytes); });
}

}  // namespace moeflow::cpu
