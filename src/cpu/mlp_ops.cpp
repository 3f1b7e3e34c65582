// CPU backend of the grouped MLP's elementwise steps (see core/mlp_call.h).
#include <algorithm>
#include <vector>

#include "core/internal.h"
#include "core/mlp_call.h"

namespace moeflow::cpu {

namespace {

// Calls fn(expert, first row, data rows) for every expert.
template <typename F>
void for_each_expert(const MlpRows& r, F&& fn) {
  const int64_t* off = r.groups.offsets.data_ptr<int64_t>();
  const int32_t* real =
      r.groups.real_rows.defined() ? r.groups.real_rows.data_ptr<int32_t>() : nullptr;
  for (int64_t e = 0; e < r.num_groups; ++e) {
    const int64_t seg = off[e + 1] - off[e];
    const int64_t data = real ? std::max<int64_t>(0, std::min<int64_t>(real[e], seg)) : seg;
    fn(e, off[e], data);
  }
}

float ld(const TensorView& t, int64_t i) {
  return detail::load_float(t.data, t.dtype, i);
}
void st(const TensorView& t, int64_t i, float v) {
  detail::store_float(t.data, t.dtype, i, v);
}

}  // namespace

void mlp_fc1_epilogue(const MlpRows& r, TensorView h, TensorView bias1, TensorView probs,
                      Activation act, const ActivationParams& ap, int il, TensorView a) {
  const int64_t n1 = h.shape[1], f = a.shape[1];
  const bool gated = is_gated(act);
  const int64_t* off = r.groups.offsets.data_ptr<int64_t>();
  for_each_expert(r, [&](int64_t e, int64_t r0, int64_t data) {
    for (int64_t row = r0 + data; row < off[e + 1]; ++row)  // pad rows: zero activations
      for (int64_t j = 0; j < f; ++j) st(a, row * f + j, 0.0f);
    for (int64_t row = r0; row < r0 + data; ++row) {
      if (bias1.defined())
        for (int64_t c = 0; c < n1; ++c)
          st(h, row * n1 + c, ld(h, row * n1 + c) + ld(bias1, e * n1 + c));
      const float p = probs.defined() ? probs.data_ptr<float>()[row] : 1.0f;
      for (int64_t j = 0; j < f; ++j) {
        const float g = ld(h, row * n1 + (gated ? glu_gate_col(j, il) : j));
        const float u = gated ? ld(h, row * n1 + glu_up_col(j, il, f)) : 0.0f;
        st(a, row * f + j, act_forward(act, g, u, ap) * p);
      }
    }
  });
}

void mlp_bias_add(const MlpRows& r, TensorView y, TensorView bias) {
  const int64_t cols = y.shape[1];
  for_each_expert(r, [&](int64_t e, int64_t r0, int64_t data) {
    for (int64_t row = r0; row < r0 + data; ++row)
      for (int64_t c = 0; c < cols; ++c)
        st(y, row * y.strides[0] + c, ld(y, row * y.strides[0] + c) + ld(bias, e * cols + c));
  });
}

void mlp_dglu(const MlpRows& r, TensorView h, TensorView d_h, TensorView probs, Activation act,
              const ActivationParams& ap, int il, int64_t f, TensorView dprobs) {
  const int64_t n1 = h.shape[1];
  const bool gated = is_gated(act);
  std::vector<float> da(f);
  const int64_t* off = r.groups.offsets.data_ptr<int64_t>();
  // pad rows get zero gradients; rows past the groups are not touched
  std::vector<bool> is_data(off[r.num_groups], false);
  for_each_expert(r, [&](int64_t, int64_t r0, int64_t data) {
    for (int64_t row = r0; row < r0 + data; ++row) is_data[row] = true;
  });
  for (int64_t row = 0; row < off[r.num_groups]; ++row) {
    if (!is_data[row]) {
      for (int64_t c = 0; c < n1; ++c) st(d_h, row * n1 + c, 0.0f);
      if (dprobs.defined()) dprobs.data_ptr<float>()[row] = 0.0f;
      continue;
    }
    for (int64_t j = 0; j < f; ++j) da[j] = ld(d_h, row * n1 + (n1 - f) + j);  // read the row first
    const float p = probs.defined() ? probs.data_ptr<float>()[row] : 1.0f;
    float dp = 0.0f;
    for (int64_t j = 0; j < f; ++j) {
      const int64_t gc = gated ? glu_gate_col(j, il) : j, uc = gated ? glu_up_col(j, il, f) : 0;
      const float g = ld(h, row * n1 + gc), u = gated ? ld(h, row * n1 + uc) : 0.0f;
      dp += da[j] * act_forward(act, g, u, ap);
      float dg = 0.0f, du = 0.0f;
      act_backward(act, g, u, da[j] * p, ap, &dg, &du);
      st(d_h, row * n1 + gc, dg);
      if (gated) st(d_h, row * n1 + uc, du);
    }
    if (dprobs.defined()) dprobs.data_ptr<float>()[row] = dp;
  }
}

void mlp_segment_colsum(const MlpRows& r, TensorView src, TensorView dst, bool accumulate) {
  const int64_t cols = src.shape[1];
  float* out = dst.data_ptr<float>();
  for_each_expert(r, [&](int64_t e, int64_t r0, int64_t data) {
    for (int64_t c = 0; c < cols; ++c) {
      float s = 0.0f;
      for (int64_t row = r0; row < r0 + data; ++row) s += ld(src, row * src.strides[0] + c);
      out[e * cols + c] = accumulate ? out[e * cols + c] + s : s;
    }
  });
}

}  // namespace moeflow::cpu
