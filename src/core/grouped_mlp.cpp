// The grouped expert MLP (moeflow/grouped_mlp.h): argument checks and the
// composition of grouped GEMMs and elementwise steps, on the CPU or CUDA
// backend (the device of x decides).
#include "moeflow/grouped_mlp.h"

#include <algorithm>
#include <tuple>

#include "core/internal.h"
#include "core/mlp_call.h"
#include "core/quantize_backend.h"

namespace moeflow {

using detail::Expect;

namespace {

const std::vector<DType> kHalf = {DType::kBFloat16, DType::kFloat16};

struct Dims {
  int64_t rows, hidden, ffn, n1, experts;
  DType dtype;
  Device dev;
  GroupedWeights fc1, fc2;  // stacked or E separate tensors
};

// One FC weight, stacked (name, [E, rows, cols]) or as E separate tensors
// (name_experts, pointers); exactly one of the two.
GroupedWeights weight_of(TensorView stacked, const GroupedWeights& experts, const char* name) {
  const bool separate = experts.stacked.defined() || experts.pointers.defined();
  MOEFLOW_CHECK(stacked.defined() != separate, "w.", name, " or w.", name,
                "_experts: give exactly one of the two (the stacked weight or E separate tensors)");
  if (!separate) {
    MOEFLOW_CHECK(stacked.ndim == 3, "w.", name, " must be [E,N,K], got ", stacked.str());
    MOEFLOW_CHECK(stacked.is_contiguous(), "w.", name, " must be contiguous");
    return GroupedWeights::from_stacked(stacked);
  }
  MOEFLOW_CHECK(experts.pointers.defined() && !experts.stacked.defined(), "w.", name,
                "_experts must come from GroupedWeights::from_pointers");
  MOEFLOW_CHECK(experts.pointers.ndim == 1 && experts.pointers.dtype == DType::kInt64, "w.", name,
                "_experts.pointers must be [E] int64, got ", experts.pointers.str());
  return experts;
}

// FC1's part of the checks (x, fc1, bias1, the layout), for F = ffn.
Dims check_fc1(TensorView x, const GroupedMlpWeights& w, const GroupedMlpConfig& c,
               const GroupLayout& groups, int64_t ffn, const GroupedWeights& w2) {
  const GroupedWeights w1 = weight_of(w.fc1, w.fc1_experts, "fc1");
  Dims d{x.shape[0],
         x.shape[1],
         ffn,
         w1.stacked.defined() ? w1.stacked.shape[1] : w1.n,
         w1.num_groups(),
         x.dtype,
         x.device,
         w1,
         w2};
  const bool gated = is_gated(c.activation);
  detail::expect(x, "x", Expect{kHalf, {d.rows, d.hidden}, d.dev});
  const int64_t n1 = gated ? 2 * d.ffn : d.ffn;
  if (w1.stacked.defined()) {
    detail::expect(w1.stacked, "w.fc1", Expect{{d.dtype}, {d.experts, n1, d.hidden}, d.dev});
  } else {
    detail::expect(w1.pointers, "w.fc1_experts.pointers",
                   Expect{{DType::kInt64}, {d.experts}, d.dev});
    MOEFLOW_CHECK(w1.dtype == d.dtype && w1.n == n1 && w1.k == d.hidden,
                  "w.fc1_experts must describe ", dtype_name(d.dtype), " [", n1, ",", d.hidden,
                  "] tensors, got ", dtype_name(w1.dtype), " [", w1.n, ",", w1.k, "]");
  }
  if (w.bias1.defined())
    detail::expect(w.bias1, "w.bias1", Expect{{d.dtype}, {d.experts, d.n1}, d.dev});
  if (gated && c.glu_interleave != 0)
    MOEFLOW_CHECK(c.glu_interleave > 0 && d.ffn % c.glu_interleave == 0,
                  "config.glu_interleave must divide F=", d.ffn, ", got ", c.glu_interleave);
  detail::expect(groups.offsets, "groups.offsets", Expect{{DType::kInt64}, {d.experts + 1}, d.dev});
  return d;
}

Dims check_weights(TensorView x, const GroupedMlpWeights& w, const GroupedMlpConfig& c,
                   const GroupLayout& groups) {
  MOEFLOW_CHECK(x.defined() && x.ndim == 2, "x must be [rows,H], got ", x.str());
  weight_of(w.fc1, w.fc1_experts, "fc1");
  const GroupedWeights w2 = weight_of(w.fc2, w.fc2_experts, "fc2");
  const Dims d = check_fc1(x, w, c, groups, w2.stacked.defined() ? w2.stacked.shape[2] : w2.k, w2);
  if (w2.stacked.defined()) {
    detail::expect(w2.stacked, "w.fc2", Expect{{d.dtype}, {d.experts, d.hidden, d.ffn}, d.dev});
  } else {
    detail::expect(w2.pointers, "w.fc2_experts.pointers",
                   Expect{{DType::kInt64}, {d.experts}, d.dev});
    MOEFLOW_CHECK(w2.dtype == d.dtype && w2.n == d.hidden, "w.fc2_experts must describe ",
                  dtype_name(d.dtype), " [", d.hidden, ",", d.ffn, "] tensors, got ",
                  dtype_name(w2.dtype), " [", w2.n, ",", w2.k, "]");
  }
  if (w.bias2.defined())
    detail::expect(w.bias2, "w.bias2", Expect{{d.dtype}, {d.experts, d.hidden}, d.dev});
  return d;
}

// saved.a may be left out where it is not read (backward_dgrad).
void check_saved(const GroupedMlpSaved& s, const Dims& d, bool need_a = true) {
  detail::expect(s.h, "saved.h", Expect{{d.dtype}, {d.rows, d.n1}, d.dev});
  MOEFLOW_CHECK(s.h.is_contiguous(), "saved.h must be contiguous");
  if (!need_a && !s.a.defined()) return;
  detail::expect(s.a, "saved.a", Expect{{d.dtype}, {d.rows, d.ffn}, d.dev});
  MOEFLOW_CHECK(s.a.is_contiguous(), "saved.a must be contiguous");
}

MlpRows rows_of(const GroupLayout& g, const Dims& d) {
  return MlpRows{g, d.experts, d.rows};
}

// E of a layout given alone (the elementwise steps take no weights).
int64_t experts_of(const GroupLayout& groups, Device dev) {
  MOEFLOW_CHECK(
      groups.offsets.defined() && groups.offsets.ndim == 1 && groups.offsets.shape[0] >= 2,
      "groups.offsets must be [E+1] int64, got ", groups.offsets.str());
  const int64_t E = groups.offsets.shape[0] - 1;
  detail::expect(groups.offsets, "groups.offsets", Expect{{DType::kInt64}, {E + 1}, dev});
  return E;
}

// h = x · W1_e^T + b1_e, a = act(h) * p: fused into the GEMM where the CUDA
// kernel takes it (h then optional), else the GEMM into h and the epilogue.
void fc1_forward(TensorView x, const GroupedMlpWeights& w, const Dims& d, const GroupLayout& groups,
                 TensorView probs, const GroupedMlpConfig& c, TensorView a, TensorView h,
                 cudaStream_t stream) {
  const MlpRows r = rows_of(groups, d);
  if (d.dev.is_cpu()) {
    grouped_gemm_forward(x, d.fc1, groups, h, c.gemm);
    cpu::mlp_fc1_epilogue(r, h, w.bias1, probs, c.activation, c.params, c.glu_interleave, a);
  } else {
#ifdef MOEFLOW_WITH_CUDA
    const detail::DeviceGuard device_guard(d.dev);
    MlpFc1Call call;
    call.x = x;
    call.w1 = d.fc1.stacked;  // (undefined with separate tensors: not fusable)
    call.groups = groups;
    call.bias1 = w.bias1;
    call.probs = probs;
    call.act = c.activation;
    call.params = c.params;
    call.glu_interleave = c.glu_interleave;
    call.out = a;
    call.raw = h;
    call.rows = d.rows;
    call.num_groups = d.experts;
    call.hidden = d.hidden;
    call.ffn = d.ffn;
    call.options = c.gemm;
    if (call.w1.defined() && cuda::mlp_fc1_fusable(call)) {
      cuda::mlp_fc1_forward(call, stream);
    } else {  // other GPUs / layouts: grouped GEMM, then the epilogue as its own kernel
      MOEFLOW_CHECK(h.defined(), "h (the pre-activation output) is needed where FC1 runs unfused");
      grouped_gemm_forward(x, d.fc1, groups, h, c.gemm, stream);
      cuda::mlp_fc1_epilogue(r, h, w.bias1, probs, c.activation, c.params, c.glu_interleave, a,
                             stream);
    }
#else
    (void)stream;
#endif
  }
}

}  // namespace

void grouped_mlp_fc1_forward(TensorView x, const GroupedMlpWeights& w, const GroupLayout& groups,
                             TensorView probs, const GroupedMlpConfig& c, TensorView a,
                             TensorView h, cudaStream_t stream) {
  MOEFLOW_CHECK(x.defined() && x.ndim == 2, "x must be [rows,H], got ", x.str());
  MOEFLOW_CHECK(a.defined() && a.ndim == 2, "a must be [rows,F], got ", a.str());
  const Dims d = check_fc1(x, w, c, groups, a.shape[1], GroupedWeights{});
  MOEFLOW_CHECK(d.n1 == (is_gated(c.activation) ? 2 * d.ffn : d.ffn), "w.fc1 must have ",
                is_gated(c.activation) ? 2 * d.ffn : d.ffn, " rows per expert for F=", d.ffn,
                ", got ", d.n1);
  detail::expect(a, "a", Expect{{d.dtype}, {d.rows, d.ffn}, d.dev});
  if (h.defined()) detail::expect(h, "h", Expect{{d.dtype}, {d.rows, d.n1}, d.dev});
  if (probs.defined()) detail::expect(probs, "probs", Expect{{DType::kFloat32}, {d.rows}, d.dev});
  if (d.dev.is_cpu() && !h.defined()) {  // the reference needs h: a temporary
    Tensor tmp = Tensor::empty({d.rows, d.n1}, d.dtype);
    return fc1_forward(x, w, d, groups, probs, c, a, tmp, stream);
  }
  fc1_forward(x, w, d, groups, probs, c, a, h, stream);
}

void grouped_mlp_forward(TensorView x, const GroupedMlpWeights& w, const GroupLayout& groups,
                         TensorView probs, const GroupedMlpConfig& c, TensorView y,
                         const GroupedMlpSaved& saved, cudaStream_t stream) {
  const Dims d = check_weights(x, w, c, groups);
  check_saved(saved, d);
  detail::expect(y, "y", Expect{{d.dtype}, {d.rows, d.hidden}, d.dev});
  if (probs.defined()) detail::expect(probs, "probs", Expect{{DType::kFloat32}, {d.rows}, d.dev});
  const MlpRows r = rows_of(groups, d);
  const detail::DeviceGuard device_guard(d.dev);
  fc1_forward(x, w, d, groups, probs, c, saved.a, saved.h, stream);
  grouped_gemm_forward(saved.a, d.fc2, groups, y, c.gemm, stream);
  if (w.bias2.defined()) {
    if (d.dev.is_cpu()) cpu::mlp_bias_add(r, y, w.bias2);
#ifdef MOEFLOW_WITH_CUDA
    else
      cuda::mlp_bias_add(r, y, w.bias2, stream);
#endif
  }
}

void grouped_mlp_backward_dgrad(TensorView dy, const GroupedMlpWeights& w,
                                const GroupLayout& groups, TensorView probs,
                                const GroupedMlpConfig& c, const GroupedMlpSaved& saved,
                                TensorView dx, TensorView d_h, TensorView dprobs,
                                cudaStream_t stream) {
  MOEFLOW_CHECK(dy.defined() && dy.ndim == 2, "dy must be [rows,H], got ", dy.str());
  const Dims d = check_weights(dx.defined() ? dx : dy, w, c, groups);
  check_saved(saved, d, /*need_a=*/false);
  detail::expect(dy, "dy", Expect{{d.dtype}, {d.rows, d.hidden}, d.dev});
  detail::expect(d_h, "d_h", Expect{{d.dtype}, {d.rows, d.n1}, d.dev});
  MOEFLOW_CHECK(d_h.is_contiguous(), "d_h must be contiguous");
  if (probs.defined()) detail::expect(probs, "probs", Expect{{DType::kFloat32}, {d.rows}, d.dev});
  if (dprobs.defined()) {
    MOEFLOW_CHECK(probs.defined(), "dprobs needs probs (the weighted forward)");
    detail::expect(dprobs, "dprobs", Expect{{DType::kFloat32}, {d.rows}, d.dev});
  }
  const int64_t esz = static_cast<int64_t>(dtype_size(d.dtype));
  const MlpRows r = rows_of(groups, d);
  const detail::DeviceGuard device_guard(d.dev);
#ifdef MOEFLOW_WITH_CUDA
  if (d.dev.is_cuda()) {
    // Experimental (off by default, slower today): FC2 dgrad with the dGLU
    // fused, d(a) never leaves the chip. The partial
    // dprobs per 256-column tile go to dx's memory, free until FC1 dgrad
    // writes it (no scratch allocation).
    MlpDgluCall call;
    call.dy = dy;
    call.w2 = d.fc2.stacked;
    call.groups = groups;
    call.h = saved.h;
    call.d_h = d_h;
    call.probs = probs;
    call.act = c.activation;
    call.params = c.params;
    call.glu_interleave = c.glu_interleave;
    call.rows = d.rows;
    call.num_groups = d.experts;
    call.hidden = d.hidden;
    call.ffn = d.ffn;
    call.options = c.gemm;
    const int64_t tiles = (d.ffn + 255) / 256;
    const int64_t ld_bytes = dx.defined() ? dx.strides[0] * esz : 0;
    bool ok = dx.defined() && (!dprobs.defined() || (reinterpret_cast<uintptr_t>(dx.data) % 4 == 0 &&
                                                     ld_bytes % 4 == 0 && ld_bytes / 4 >= tiles));
    if (dprobs.defined()) {
      call.part = static_cast<float*>(dx.data);
      call.part_ld = ld_bytes / 4;
    }
    if (ok && c.gemm.fused_dglu && call.w2.defined() && cuda::mlp_dglu_fusable(call)) {
      cuda::mlp_fc2_dgrad_dglu(call, stream);
      if (dprobs.defined())
        cuda::mlp_dprobs_from_partials(r, call.part, call.part_ld, tiles, dprobs, stream);
      grouped_gemm_dgrad(d_h, d.fc1, groups, dx, c.gemm, stream);
      return;
    }
  }
#endif
  // d(a) = dy · W2_e lands in the last F columns of d_h; dGLU turns d_h into d(h) in place.
  TensorView d_a = TensorView::strided(static_cast<uint8_t*>(d_h.data) + (d.n1 - d.ffn) * esz,
                                       d.dtype, d.dev, {d.rows, d.ffn}, {d.n1, 1});
  grouped_gemm_dgrad(dy, d.fc2, groups, d_a, c.gemm, stream);
  if (d.dev.is_cpu()) {
    cpu::mlp_dglu(r, saved.h, d_h, probs, c.activation, c.params, c.glu_interleave, d.ffn, dprobs);
  } else {
#ifdef MOEFLOW_WITH_CUDA
    cuda::mlp_dglu(r, saved.h, d_h, probs, c.activation, c.params, c.glu_interleave, d.ffn, dprobs,
                   stream);
#endif
  }
  if (dx.defined()) grouped_gemm_dgrad(d_h, d.fc1, groups, dx, c.gemm, stream);
}

void grouped_mlp_backward_fc1_dgrad(TensorView d_h, const GroupedMlpWeights& w,
                                    const GroupLayout& groups, const GroupedMlpConfig& c,
                                    TensorView dx, cudaStream_t stream) {
  const Dims d = check_weights(dx, w, c, groups);
  detail::expect(d_h, "d_h", Expect{{d.dtype}, {d.rows, d.n1}, d.dev});
  MOEFLOW_CHECK(d_h.is_contiguous(), "d_h must be contiguous");
  grouped_gemm_dgrad(d_h, d.fc1, groups, dx, c.gemm, stream);
}

void grouped_mlp_recompute_activation(TensorView h, const GroupLayout& groups, TensorView probs,
                                      const GroupedMlpConfig& c, TensorView a,
                                      cudaStream_t stream) {
  MOEFLOW_CHECK(h.defined() && h.ndim == 2, "h must be [rows,N1], got ", h.str());
  MOEFLOW_CHECK(a.defined() && a.ndim == 2, "a must be [rows,F], got ", a.str());
  const int64_t rows = h.shape[0], f = a.shape[1];
  const bool gated = is_gated(c.activation);
  detail::expect(h, "h", Expect{kHalf, {rows, gated ? 2 * f : f}, h.device});
  detail::expect(a, "a", Expect{{h.dtype}, {rows, f}, h.device});
  MOEFLOW_CHECK(h.is_contiguous() && a.is_contiguous(), "h and a must be contiguous");
  if (probs.defined()) detail::expect(probs, "probs", Expect{{DType::kFloat32}, {rows}, h.device});
  if (gated && c.glu_interleave != 0)
    MOEFLOW_CHECK(c.glu_interleave > 0 && f % c.glu_interleave == 0,
                  "config.glu_interleave must divide F=", f, ", got ", c.glu_interleave);
  const MlpRows r{groups, experts_of(groups, h.device), rows};
  // The forward's epilogue without the bias (h has it already): h is only read.
  if (h.device.is_cpu()) {
    cpu::mlp_fc1_epilogue(r, h, {}, probs, c.activation, c.params, c.glu_interleave, a);
  } else {
#ifdef MOEFLOW_WITH_CUDA
    const detail::DeviceGuard device_guard(h.device);
    cuda::mlp_fc1_epilogue(r, h, {}, probs, c.activation, c.params, c.glu_interleave, a, stream);
#else
    (void)stream;
#endif
  }
}

void grouped_mlp_activation_quantize(TensorView h, const GroupLayout& groups, TensorView probs,
                                     const GroupedMlpConfig& c, const QuantizeConfig& quant,
                                     TensorView a_q, TensorView a_scales, cudaStream_t stream) {
  grouped_mlp_activation_quantize(h, groups, probs, c, quant, a_q, a_scales, TensorView{}, stream);
}

void grouped_mlp_activation_quantize(TensorView h, const GroupLayout& groups, TensorView probs,
                                     const GroupedMlpConfig& c, const QuantizeConfig& quant,
                                     TensorView a_q, TensorView a_scales, TensorView a_q_t,
                                     cudaStream_t stream) {
  MOEFLOW_CHECK(quant.out == DType::kFloat8E4M3 || quant.out == DType::kFloat8E5M2,
                "activation_quantize: QuantizeConfig.out must be float8_e4m3 or float8_e5m2, got ",
                dtype_name(quant.out));
  const bool tw = quant.scaling == QuantScaling::kTensorwise;
  MOEFLOW_CHECK((tw || quant.scaling == QuantScaling::kBlock1x128) && !quant.columnwise,
                "activation_quantize: QuantizeConfig must be kBlock1x128 or kTensorwise, rowwise");
  MOEFLOW_CHECK(h.defined() && h.ndim == 2, "h must be [rows,N1], got ", h.str());
  MOEFLOW_CHECK(a_q.defined() && a_q.ndim == 2, "a_q must be [rows,F], got ", a_q.str());
  const int64_t rows = h.shape[0], f = a_q.shape[1];
  const bool gated = is_gated(c.activation);
  detail::expect(h, "h", Expect{kHalf, {rows, gated ? 2 * f : f}, h.device});
  MOEFLOW_CHECK(h.is_contiguous(), "h must be contiguous");
  Expect qe{{quant.out}, {rows, f}, h.device};
  qe.contiguous = false;
  qe.inner_unit = true;
  detail::expect(a_q, "a_q", qe);
  const int64_t nb = (f + quant::kBlock - 1) / quant::kBlock;
  detail::expect(a_scales, "a_scales",
                 Expect{{DType::kFloat32},
                        tw ? std::vector<int64_t>{1} : std::vector<int64_t>{rows, nb},
                        h.device});
  if (a_q_t.defined()) {
    MOEFLOW_CHECK(tw, "activation_quantize: a_q_t needs QuantizeConfig kTensorwise");
    detail::expect(a_q_t, "a_q_t", Expect{{quant.out}, {f, rows}, h.device});
    const auto* qb = static_cast<const uint8_t*>(a_q.data);
    const auto* tb = static_cast<const uint8_t*>(a_q_t.data);
    const int64_t q_span = rows > 0 ? (rows - 1) * a_q.strides[0] + f : 0;
    MOEFLOW_CHECK(tb + rows * f <= qb || qb + q_span <= tb, "a_q_t must not overlap a_q");
  }
  if (probs.defined()) detail::expect(probs, "probs", Expect{{DType::kFloat32}, {rows}, h.device});
  if (gated && c.glu_interleave != 0)
    MOEFLOW_CHECK(c.glu_interleave > 0 && f % c.glu_interleave == 0,
                  "config.glu_interleave must divide F=", f, ", got ", c.glu_interleave);
  const MlpRows r{groups, experts_of(groups, h.device), rows};
  if (h.device.is_cpu()) {  // the composition: the activation, then quantize of the group rows
    Tensor a = Tensor::empty({rows, f}, h.dtype, Device::cpu());
    cpu::mlp_fc1_epilogue(r, h, {}, probs, c.activation, c.params, c.glu_interleave, a);
    if (tw) return cpu::quantize_group_rows(groups, r.num_groups, a, quant, a_q, a_scales, a_q_t);
    const int64_t* off = groups.offsets.data_ptr<int64_t>();
    const int64_t r0 = std::max<int64_t>(off[0], 0), r1 = std::min<int64_t>(off[r.num_groups], rows);
    if (r1 <= r0) return;
    const int64_t esz = static_cast<int64_t>(dtype_size(h.dtype));
    const auto part = [&](void* base, int64_t stride, int64_t cols, DType dt, int64_t bytes) {
      return TensorView::strided(static_cast<uint8_t*>(base) + r0 * stride * bytes, dt,
                                 Device::cpu(), {r1 - r0, cols}, {stride, 1});
    };
    cpu::quantize(part(a.data(), f, f, h.dtype, esz), quant,
                  part(a_q.data, a_q.strides[0], f, quant.out, 1),
                  part(a_scales.data, nb, nb, DType::kFloat32, 4));
    return;
  }
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(h.device);
  if (tw)
    cuda::mlp_activation_quantize_tensorwise(r, h, probs, c.activation, c.params, c.glu_interleave,
                                             quant.out == DType::kFloat8E4M3, quant.pow2_scales,
                                             a_q, a_scales, a_q_t, stream);
  else
    cuda::mlp_activation_quantize(r, h, probs, c.activation, c.params, c.glu_interleave,
                                  quant.out == DType::kFloat8E4M3, quant.pow2_scales, a_q, a_scales,
                                  stream);
#else
  (void)stream;
#endif
}

void grouped_mlp_activation_backward(TensorView h, const GroupLayout& groups, TensorView probs,
                                     const GroupedMlpConfig& c, TensorView d_h, TensorView dprobs,
                                     cudaStream_t stream) {
  grouped_mlp_activation_backward(h, groups, probs, c, d_h, dprobs, TensorView{}, stream);
}

void grouped_mlp_activation_backward(TensorView h, const GroupLayout& groups, TensorView probs,
                                     const GroupedMlpConfig& c, TensorView d_h, TensorView dprobs,
                                     TensorView d_h_amax, cudaStream_t stream) {
  MOEFLOW_CHECK(h.defined() && h.ndim == 2, "h must be [rows,N1], got ", h.str());
  const int64_t rows = h.shape[0], n1 = h.shape[1];
  const bool gated = is_gated(c.activation);
  MOEFLOW_CHECK(!gated || n1 % 2 == 0, "h must have an even number of columns (gated), got ",
                h.str());
  const int64_t f = gated ? n1 / 2 : n1;
  detail::expect(h, "h", Expect{kHalf, {rows, n1}, h.device});
  detail::expect(d_h, "d_h", Expect{{h.dtype}, {rows, n1}, h.device});
  if (probs.defined()) detail::expect(probs, "probs", Expect{{DType::kFloat32}, {rows}, h.device});
  if (dprobs.defined()) {
    MOEFLOW_CHECK(probs.defined(), "dprobs needs probs (the weighted forward)");
    detail::expect(dprobs, "dprobs", Expect{{DType::kFloat32}, {rows}, h.device});
  }
  if (gated && c.glu_interleave != 0)
    MOEFLOW_CHECK(c.glu_interleave > 0 && f % c.glu_interleave == 0,
                  "config.glu_interleave must divide F=", f, ", got ", c.glu_interleave);
  if (d_h_amax.defined())
    detail::expect(d_h_amax, "d_h_amax", Expect{{DType::kFloat32}, {1}, h.device});
  const MlpRows r{groups, experts_of(groups, h.device), rows};
  if (h.device.is_cpu()) {
    cpu::mlp_dglu(r, h, d_h, probs, c.activation, c.params, c.glu_interleave, f, dprobs);
    if (d_h_amax.defined())
      d_h_amax.data_ptr<float>()[0] = cpu::group_rows_amax(groups, r.num_groups, d_h);
  } else {
#ifdef MOEFLOW_WITH_CUDA
    const detail::DeviceGuard device_guard(h.device);
    cuda::mlp_dglu(r, h, d_h, probs, c.activation, c.params, c.glu_interleave, f, dprobs, stream,
                   d_h_amax);
#else
    (void)stream;
#endif
  }
}

void grouped_mlp_backward_wgrad(TensorView dy, TensorView x, const GroupLayout& groups,
                                const GroupedMlpSaved& saved, TensorView d_h,
                                const GroupedMlpGrads& g, cudaStream_t stream) {
  grouped_mlp_backward_wgrad(dy, x, groups, saved, d_h, g, GemmOptions{}, stream);
}

void grouped_mlp_backward_wgrad(TensorView dy, TensorView x, const GroupLayout& groups,
                                const GroupedMlpSaved& saved, TensorView d_h,
                                const GroupedMlpGrads& g, const GemmOptions& options,
                                cudaStream_t stream) {
  // FC2's gradients read dy (and saved.a for dw2), FC1's read d_h (and x for dw1).
  const bool fc2 = g.dw2.defined() || g.dw2_experts.stacked.defined() ||
                   g.dw2_experts.pointers.defined() || g.dbias2.defined();
  const bool fc1 = g.dw1.defined() || g.dw1_experts.stacked.defined() ||
                   g.dw1_experts.pointers.defined() || g.dbias1.defined();
  MOEFLOW_CHECK(!fc2 || dy.defined(), "backward_wgrad: grads.dw2 / dbias2 need dy");
  MOEFLOW_CHECK(!fc1 || d_h.defined(), "backward_wgrad: grads.dw1 / dbias1 need d_h");
  MOEFLOW_CHECK(!(g.dw2.defined() || g.dw2_experts.stacked.defined() ||
                  g.dw2_experts.pointers.defined()) || saved.a.defined(),
                "backward_wgrad: grads.dw2 needs saved.a");
  MOEFLOW_CHECK(!(g.dw1.defined() || g.dw1_experts.stacked.defined() ||
                  g.dw1_experts.pointers.defined()) || x.defined(),
                "backward_wgrad: grads.dw1 needs x");
  if (!fc1 && !fc2) return;
  const int64_t E = groups.offsets.defined() ? groups.offsets.shape[0] - 1 : 0;
  const int64_t rows = x.defined() ? x.shape[0] : (dy.defined() ? dy.shape[0] : d_h.shape[0]);
  const MlpRows r{groups, E, rows};
  const DType data_dtype = x.defined() ? x.dtype : dy.defined() ? dy.dtype : d_h.dtype;
  const Device dev = x.defined() ? x.device : dy.defined() ? dy.device : d_h.device;
  for (const auto& [v, name] : {std::pair{x, "x"}, std::pair{dy, "dy"}, std::pair{d_h, "d_h"}})
    MOEFLOW_CHECK(!v.defined() || v.device == dev, name, " must be on ", dev.str(), " (",
                  x.defined() ? "x" : "dy", "'s device), got ", v.device.str());
  const detail::DeviceGuard device_guard(dev);
  // Each weight gradient: stacked, E separate tensors, or not asked for;
  // float32 or the weights' dtype (that of x and dy).
  auto grad_of = [&](TensorView stacked, const GroupedWeights& experts, const char* name) {
    const bool separate = experts.stacked.defined() || experts.pointers.defined();
    MOEFLOW_CHECK(!(stacked.defined() && separate), "grads.", name, " and grads.", name,
                  "_experts: give at most one of the two");
    const GroupedWeights gw = separate            ? experts
                              : stacked.defined() ? GroupedWeights::from_stacked(stacked)
                                                  : GroupedWeights{};
    if (separate || stacked.defined()) {
      const DType dt = gw.stacked.defined() ? gw.stacked.dtype : gw.dtype;
      MOEFLOW_CHECK(dt == DType::kFloat32 || dt == data_dtype, "grads.", name,
                    separate ? "_experts" : "", " must be float32 or ", dtype_name(data_dtype),
                    " (the weights' dtype), got ", dtype_name(dt));
    }
    return gw;
  };
  const GroupedWeights dw2 = grad_of(g.dw2, g.dw2_experts, "dw2");
  const GroupedWeights dw1 = grad_of(g.dw1, g.dw1_experts, "dw1");
  if (dw2.stacked.defined() || dw2.pointers.defined())
    grouped_gemm_wgrad(dy, saved.a, groups, dw2, g.accumulate, options, stream);
  if (dw1.stacked.defined() || dw1.pointers.defined())
    grouped_gemm_wgrad(d_h, x, groups, dw1, g.accumulate, options, stream);
  for (const auto& [src, dst, name] :
       {std::tuple{dy, g.dbias2, "grads.dbias2"}, std::tuple{d_h, g.dbias1, "grads.dbias1"}}) {
    if (!dst.defined()) continue;
    detail::expect(dst, name, Expect{{DType::kFloat32}, {E, src.shape[1]}, src.device});
    MOEFLOW_CHECK(dst.is_contiguous(), name, " must be contiguous");
    if (src.device.is_cpu()) cpu::mlp_segment_colsum(r, src, dst, g.accumulate);
#ifdef MOEFLOW_WITH_CUDA
    else
      cuda::mlp_segment_colsum(r, src, dst, g.accumulate, stream);
#endif
  }
}

}  // namespace moeflow
