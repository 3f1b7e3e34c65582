// The grouped expert MLP with the blockwise FP8 recipe
// (moeflow/grouped_mlp_fp8.h): argument checks, then the composition of
// public ops (quantize, grouped_gemm_fp8_forward, the activation's quantize
// and backward, transpose_codes; for the FP8 weight gradients
// quantize_rowwise_columnwise and grouped_gemm_fp8_wgrad), on the backend of
// x's device.
#include "moeflow/grouped_mlp_fp8.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "core/activations.h"
#include "core/internal.h"
#include "core/mlp_call.h"

namespace moeflow {

using detail::Expect;

namespace {

constexpr int64_t kB = 128;

struct Fp8Dims {
  int64_t rows, hidden, ffn, n1, experts;
  Device dev;
};

Expect rows_expect(DType dt, int64_t rows, int64_t cols, Device dev) {
  Expect e{{dt}, {rows, cols}, dev};
  e.contiguous = false;
  e.inner_unit = true;
  return e;
}

// E, H, F, N1 from the codes; checks every view of q against them (c null:
// N1 may be F or 2F).
Fp8Dims check_codes(const GroupedMlpFp8Weights& q, const GroupedMlpConfig* c, int64_t rows,
                    Device dev) {
  MOEFLOW_CHECK(q.fc1.defined() && q.fc1.ndim == 3, "q.fc1 must be [E,N1,H], got ", q.fc1.str());
  MOEFLOW_CHECK(q.fc2.defined() && q.fc2.ndim == 3, "q.fc2 must be [E,H,F], got ", q.fc2.str());
  Fp8Dims d{rows, q.fc1.shape[2], q.fc2.shape[2], q.fc1.shape[1], q.fc1.shape[0], dev};
  if (c) {
    const bool gated = is_gated(c->activation);
    MOEFLOW_CHECK(d.n1 == (gated ? 2 * d.ffn : d.ffn), "q.fc1.shape[1] must be ",
                  gated ? "2 x " : "", "F = ", gated ? 2 * d.ffn : d.ffn,
                  " for this activation, got ", d.n1);
  } else {
    MOEFLOW_CHECK(d.n1 == d.ffn || d.n1 == 2 * d.ffn, "q.fc1.shape[1] must be F or 2 x F = ",
                  2 * d.ffn, ", got ", d.n1);
  }
  MOEFLOW_CHECK(d.hidden % kB == 0 && d.ffn % kB == 0 && d.hidden > 0 && d.ffn > 0,
                "the FP8 recipe needs H and F to be positive multiples of 128, got H=", d.hidden,
                " F=", d.ffn);
  const DType e4 = DType::kFloat8E4M3, f32 = DType::kFloat32;
  const int64_t E = d.experts, H = d.hidden, F = d.ffn, N1 = d.n1;
  const auto w = [&](TensorView v, const char* name, std::vector<int64_t> shape, DType dt) {
    if (v.defined()) detail::expect(v, name, Expect{{dt}, std::move(shape), dev});
  };
  detail::expect(q.fc1, "q.fc1", Expect{{e4}, {E, N1, H}, dev});
  detail::expect(q.fc2, "q.fc2", Expect{{e4}, {E, H, F}, dev});
  // Tensorwise: every scale [1].
  const bool tw = q.recipe == Fp8Recipe::kTensorwise;
  MOEFLOW_CHECK(tw || q.recipe == Fp8Recipe::kBlockwise,
                "q.recipe must be kBlockwise or "
                "kTensorwise, got ",
                static_cast<int>(q.recipe));
  using Shape = std::vector<int64_t>;
  const auto sc = [&](Shape blocks) { return tw ? Shape{1} : blocks; };
  detail::expect(q.fc1_scales, "q.fc1_scales", Expect{{f32}, sc({E, N1 / kB, H / kB}), dev});
  detail::expect(q.fc2_scales, "q.fc2_scales", Expect{{f32}, sc({E, H / kB, F / kB}), dev});
  w(q.fc1_t, "q.fc1_t", {E, H, N1}, e4);
  w(q.fc2_t, "q.fc2_t", {E, F, H}, e4);
  w(q.fc1_t_scales, "q.fc1_t_scales", sc({E, H / kB, N1 / kB}), f32);
  w(q.fc2_t_scales, "q.fc2_t_scales", sc({E, F / kB, H / kB}), f32);
  return d;
}

// The first rows x cols codes and rows x cols/128 scales of the scratch, as
// contiguous views (cols a multiple of 128).
struct Operand {
  TensorView codes, scales;
};
Operand scratch_for(const GroupedMlpFp8Scratch& s, const Fp8Dims& d, int64_t cols,
                    Fp8Recipe recipe) {
  const int64_t widest = std::max(d.hidden, d.n1);
  MOEFLOW_CHECK(s.codes.defined() && s.codes.is_contiguous() && s.scales.defined() &&
                    s.scales.is_contiguous(),
                "scratch.codes and scratch.scales must be given, contiguous");
  MOEFLOW_CHECK(s.codes.device == d.dev && s.scales.device == d.dev,
                "scratch.codes and scratch.scales must be on ", d.dev.str());
  MOEFLOW_CHECK(
      (s.codes.dtype == DType::kUInt8 || s.codes.dtype == DType::kFloat8E4M3) &&
          s.codes.numel() >= d.rows * widest,
      "scratch.codes must be uint8 or float8_e4m3 with >= rows x max(H, N1) = ", d.rows * widest,
      " elements, got ", s.codes.str());
  const bool tw = recipe == Fp8Recipe::kTensorwise;
  const int64_t need = tw ? 1 : d.rows * widest / kB;
  MOEFLOW_CHECK(s.scales.dtype == DType::kFloat32 && s.scales.numel() >= need,
                "scratch.scales must be float32 with >= ", need,
                tw ? " element (tensorwise)" : " elements (rows x max(H, N1) / 128)", ", got ",
                s.scales.str());
  MOEFLOW_CHECK(reinterpret_cast<uintptr_t>(s.codes.data) % 16 == 0,
                "scratch.codes must be 16-byte aligned");
  return {TensorView(s.codes.data, DType::kFloat8E4M3, d.dev, {d.rows, cols}),
          tw ? TensorView(s.scales.data, DType::kFloat32, d.dev, {1})
             : TensorView(s.scales.data, DType::kFloat32, d.dev, {d.rows, cols / kB})};
}

QuantizeConfig rows_1x128() {
  return QuantizeConfig{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, false};
}

QuantizeConfig rows_of(Fp8Recipe recipe) {
  return QuantizeConfig{
      DType::kFloat8E4M3,
      recipe == Fp8Recipe::kTensorwise ? QuantScaling::kTensorwise : QuantScaling::kBlock1x128,
      false, false};
}

// src [rows, cols] (rows may be strided) -> its codes in the scratch: 1x128
// blocks, or one scale over the groups' real rows (tensorwise).
Operand quantize_rows(TensorView src, const GroupedMlpFp8Scratch& s, const Fp8Dims& d,
                      const GroupLayout& groups, Fp8Recipe recipe, cudaStream_t stream) {
  const Operand o = scratch_for(s, d, src.shape[1], recipe);
  if (recipe == Fp8Recipe::kTensorwise) {
    quantize_group_rows(src, groups, rows_of(recipe), o.codes, o.scales, stream);
  } else {
    // The rows up to offsets[E] only: the GEMMs read no row past the groups.
    const TensorView used(static_cast<int64_t*>(groups.offsets.data) + d.experts, DType::kInt64,
                          groups.offsets.device, {1});
    quantize(src, rows_1x128(), o.codes, o.scales, {}, used, stream);
  }
  return o;
}

void check_common(const Fp8Dims& d, const GroupLayout& groups, TensorView probs,
                  const GroupedMlpConfig& c, TensorView h) {
  detail::expect(groups.offsets, "groups.offsets", Expect{{DType::kInt64}, {d.experts + 1}, d.dev});
  detail::expect(h, "h", Expect{{DType::kBFloat16}, {d.rows, d.n1}, d.dev});
  if (probs.defined()) detail::expect(probs, "probs", Expect{{DType::kFloat32}, {d.rows}, d.dev});
  if (is_gated(c.activation) && c.glu_interleave != 0)
    MOEFLOW_CHECK(c.glu_interleave > 0 && d.ffn % c.glu_interleave == 0,
                  "config.glu_interleave must divide F=", d.ffn, ", got ", c.glu_interleave);
}

// Operand `slot` (0 or 1) of the wgrad scratch: the columnwise codes [cols,
// rows] after `before` columns' worth, and their scales as the transpose of
// a contiguous [ceil(rows/128), cols] block (the layout the wgrad reads
// fastest).
Operand wgrad_operand(const GroupedMlpFp8WgradScratch& s, int64_t rows, int64_t before,
                      int64_t cols, Device dev) {
  const int64_t nb = (rows + kB - 1) / kB;
  auto* codes = static_cast<uint8_t*>(s.codes.data) + before * rows;
  auto* scales = static_cast<float*>(s.scales.data) + before * nb;
  return {TensorView(codes, DType::kFloat8E4M3, dev, {cols, rows}),
          TensorView::strided(scales, DType::kFloat32, dev, {cols, nb}, {1, cols})};
}

}  // namespace

void quantize_group_rows(TensorView x, const GroupLayout& groups, const QuantizeConfig& config,
                         TensorView q, TensorView scale, cudaStream_t stream) {
  quantize_group_rows(x, groups, config, q, scale, TensorView{}, stream);
}

namespace {

// quantize_group_rows' arguments checked; returns the number of groups.
int64_t check_group_rows(TensorView x, const GroupLayout& groups, const QuantizeConfig& config,
                         TensorView q, TensorView scale, TensorView q_t, const char* op) {
  MOEFLOW_CHECK(config.scaling == QuantScaling::kTensorwise && !config.columnwise, op,
                ": config must be kTensorwise, rowwise");
  MOEFLOW_CHECK(config.out == DType::kFloat8E4M3 || config.out == DType::kFloat8E5M2, op,
                ": config.out must be float8_e4m3 or float8_e5m2, got ", dtype_name(config.out));
  MOEFLOW_CHECK(x.defined() && x.ndim == 2, "x must be [rows,K], got ", x.str());
  const Device dev = x.device;
  const int64_t rows = x.shape[0], cols = x.shape[1];
  detail::expect(x, "x", [&] {
    Expect e = rows_expect(DType::kFloat32, rows, cols, dev);
    e.dtypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
    return e;
  }());
  detail::expect(q, "q", rows_expect(config.out, rows, cols, dev));
  detail::expect(scale, "scale", Expect{{DType::kFloat32}, {1}, dev});
  if (q_t.defined()) {
    detail::expect(q_t, "q_t", Expect{{config.out}, {cols, rows}, dev});
    // (q's last row may be strided: its span is rows * stride)
    const auto* qb = static_cast<const uint8_t*>(q.data);
    const auto* tb = static_cast<const uint8_t*>(q_t.data);
    const int64_t q_span = rows > 0 ? (rows - 1) * q.strides[0] + cols : 0;
    MOEFLOW_CHECK(tb + rows * cols <= qb || qb + q_span <= tb, "q_t must not overlap q");
  }
  int64_t E = 0;
  if (groups.offsets.defined()) {
    MOEFLOW_CHECK(groups.offsets.ndim == 1 && groups.offsets.shape[0] >= 2,
                  "groups.offsets must be [E+1] with E >= 1, got ", groups.offsets.str());
    E = groups.offsets.shape[0] - 1;
    detail::expect(groups.offsets, "groups.offsets", Expect{{DType::kInt64}, {E + 1}, dev});
    if (groups.real_rows.defined())
      detail::expect(groups.real_rows, "groups.real_rows", Expect{{DType::kInt32}, {E}, dev});
  }
  return E;
}

}  // namespace

void quantize_group_rows(TensorView x, const GroupLayout& groups, const QuantizeConfig& config,
                         TensorView q, TensorView scale, TensorView q_t, cudaStream_t stream) {
  const int64_t E = check_group_rows(x, groups, config, q, scale, q_t, "quantize_group_rows");
  if (x.device.is_cpu()) return cpu::quantize_group_rows(groups, E, x, config, q, scale, q_t);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(x.device);
  cuda::quantize_group_rows(groups, E, x, config, q, scale, q_t, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

void quantize_group_rows_with_amax(TensorView x, const GroupLayout& groups,
                                   const QuantizeConfig& config, TensorView amax, TensorView q,
                                   TensorView scale, TensorView q_t, cudaStream_t stream) {
  const int64_t E =
      check_group_rows(x, groups, config, q, scale, q_t, "quantize_group_rows_with_amax");
  detail::expect(amax, "amax", Expect{{DType::kFloat32}, {1}, x.device});
  if (x.device.is_cpu())
    return cpu::quantize_group_rows_with_amax(groups, E, x, config, amax.data_ptr<float>()[0], q,
                                              scale, q_t);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(x.device);
  cuda::quantize_group_rows_with_amax(groups, E, x, config, amax, q, scale, q_t, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

void grouped_mlp_fp8_weights(const GroupedMlpWeights& w, const GroupedMlpFp8Weights& q,
                             cudaStream_t stream) {
  MOEFLOW_CHECK(w.fc1.defined() && w.fc2.defined(),
                "grouped_mlp_fp8_weights needs the stacked weights w.fc1 and w.fc2");
  MOEFLOW_CHECK(q.fc1_t.defined() && q.fc2_t.defined() && q.fc1_t_scales.defined() &&
                    q.fc2_t_scales.defined(),
                "grouped_mlp_fp8_weights writes both orientations: give q.fc1_t, q.fc2_t and "
                "their scales");
  const Device dev = w.fc1.device;
  const Fp8Dims d = check_codes(q, nullptr, 0, dev);
  const int64_t E = d.experts, H = d.hidden, F = d.ffn, N1 = d.n1;
  detail::expect(w.fc1, "w.fc1", Expect{{DType::kBFloat16}, {E, N1, H}, dev});
  detail::expect(w.fc2, "w.fc2", Expect{{DType::kBFloat16}, {E, H, F}, dev});
  const auto flat = [&](TensorView v, DType dt, int64_t r, int64_t c) {
    return TensorView(v.data, dt, dev, {r, c});
  };
  const detail::DeviceGuard device_guard(dev);
  if (q.recipe == Fp8Recipe::kTensorwise) {
    // One scale per weight: the amax of all its experts.
    const QuantizeConfig tw = rows_of(q.recipe);
    quantize_group_rows(flat(w.fc1, DType::kBFloat16, E * N1, H), {}, tw,
                        flat(q.fc1, DType::kFloat8E4M3, E * N1, H), q.fc1_scales, stream);
    quantize_group_rows(flat(w.fc2, DType::kBFloat16, E * H, F), {}, tw,
                        flat(q.fc2, DType::kFloat8E4M3, E * H, F), q.fc2_scales, stream);
    transpose_codes(q.fc1, q.fc1_t, stream);
    transpose_codes(flat(q.fc1_scales, DType::kFloat32, 1, 1),
                    flat(q.fc1_t_scales, DType::kFloat32, 1, 1), stream);
    transpose_codes(q.fc2, q.fc2_t, stream);
    transpose_codes(flat(q.fc2_scales, DType::kFloat32, 1, 1),
                    flat(q.fc2_t_scales, DType::kFloat32, 1, 1), stream);
    return;
  }
  // Each weight's codes both ways from one read of it.
  const QuantizeConfig blocks{DType::kFloat8E4M3, QuantScaling::kBlock128x128, false, false};
  quantize_rowwise_columnwise(w.fc1, blocks, q.fc1, q.fc1_scales, q.fc1_t, q.fc1_t_scales, stream);
  quantize_rowwise_columnwise(w.fc2, blocks, q.fc2, q.fc2_scales, q.fc2_t, q.fc2_t_scales, stream);
}

void grouped_mlp_fp8_forward(TensorView x, const GroupedMlpFp8Weights& q,
                             const GroupLayout& groups, TensorView probs,
                             const GroupedMlpConfig& c, TensorView y, TensorView h,
                             const GroupedMlpFp8Scratch& scratch, cudaStream_t stream) {
  MOEFLOW_CHECK(x.defined() && x.ndim == 2, "x must be [rows,H], got ", x.str());
  const Fp8Dims d = check_codes(q, &c, x.shape[0], x.device);
  detail::expect(x, "x", rows_expect(DType::kBFloat16, d.rows, d.hidden, d.dev));
  detail::expect(y, "y", rows_expect(DType::kBFloat16, d.rows, d.hidden, d.dev));
  check_common(d, groups, probs, c, h);
  const detail::DeviceGuard device_guard(d.dev);
  const Operand xq = quantize_rows(x, scratch, d, groups, q.recipe, stream);
  grouped_gemm_fp8_forward(xq.codes, xq.scales, q.fc1, q.fc1_scales, groups, h, c.gemm, stream);
  const Operand aq = scratch_for(scratch, d, d.ffn, q.recipe);
  grouped_mlp_activation_quantize(h, groups, probs, c, rows_of(q.recipe), aq.codes, aq.scales,
                                  stream);
  grouped_gemm_fp8_forward(aq.codes, aq.scales, q.fc2, q.fc2_scales, groups, y, c.gemm, stream);
}

void grouped_mlp_fp8_backward_dgrad(TensorView dy, const GroupedMlpFp8Weights& q,
                                    const GroupLayout& groups, TensorView probs,
                                    const GroupedMlpConfig& c, TensorView h, TensorView dx,
                                    TensorView d_h, TensorView dprobs,
                                    const GroupedMlpFp8Scratch& scratch, cudaStream_t stream) {
  MOEFLOW_CHECK(dy.defined() && dy.ndim == 2, "dy must be [rows,H], got ", dy.str());
  const Fp8Dims d = check_codes(q, &c, dy.shape[0], dy.device);
  MOEFLOW_CHECK(q.fc2_t.defined() && q.fc2_t_scales.defined() &&
                    (!dx.defined() || (q.fc1_t.defined() && q.fc1_t_scales.defined())),
                "the FP8 dgrad reads q.fc2_t (and q.fc1_t for dx) with their scales "
                "(grouped_mlp_fp8_weights writes them)");
  detail::expect(dy, "dy", rows_expect(DType::kBFloat16, d.rows, d.hidden, d.dev));
  check_common(d, groups, probs, c, h);
  detail::expect(d_h, "d_h", Expect{{DType::kBFloat16}, {d.rows, d.n1}, d.dev});
  MOEFLOW_CHECK(d.rows == 0 || d_h.data != h.data,
                "d_h must not be h (FC2's dgrad writes d_h before the activation's backward reads "
                "h)");
  if (dx.defined()) detail::expect(dx, "dx", rows_expect(DType::kBFloat16, d.rows, d.hidden, d.dev));
  if (dprobs.defined()) {
    MOEFLOW_CHECK(probs.defined(), "dprobs needs probs (the weighted forward)");
    detail::expect(dprobs, "dprobs", Expect{{DType::kFloat32}, {d.rows}, d.dev});
  }
  // d(a) = dy W2 straight into d_h's last F columns; the activation's
  // backward turns d_h into d(h) in place.
  const detail::DeviceGuard device_guard(d.dev);
  const Operand dyq = quantize_rows(dy, scratch, d, groups, q.recipe, stream);
  const TensorView d_a = TensorView::strided(
      static_cast<uint8_t*>(d_h.data) + (d.n1 - d.ffn) * 2, DType::kBFloat16, d.dev,
      {d.rows, d.ffn}, {d.n1, 1});
  grouped_gemm_fp8_forward(dyq.codes, dyq.scales, q.fc2_t, q.fc2_t_scales, groups, d_a, c.gemm,
                           stream);
  grouped_mlp_activation_backward(h, groups, probs, c, d_h, dprobs, stream);
  if (!dx.defined()) return;
  const Operand dhq = quantize_rows(d_h, scratch, d, groups, q.recipe, stream);
  grouped_gemm_fp8_forward(dhq.codes, dhq.scales, q.fc1_t, q.fc1_t_scales, groups, dx, c.gemm,
                           stream);
}

void grouped_mlp_fp8_backward_wgrad(TensorView x, TensorView dy, const GroupLayout& groups,
                                    TensorView probs, const GroupedMlpConfig& c, TensorView h,
                                    TensorView d_h, TensorView dw1, TensorView dw2, bool accumulate,
                                    const GroupedMlpFp8WgradScratch& scratch, cudaStream_t stream) {
  grouped_mlp_fp8_backward_wgrad(x, dy, groups, probs, c, h, d_h, dw1, dw2, accumulate, scratch,
                                 Fp8Recipe::kBlockwise, stream);
}

void grouped_mlp_fp8_backward_wgrad(TensorView x, TensorView dy, const GroupLayout& groups,
                                    TensorView probs, const GroupedMlpConfig& c, TensorView h,
                                    TensorView d_h, TensorView dw1, TensorView dw2, bool accumulate,
                                    const GroupedMlpFp8WgradScratch& scratch, Fp8Recipe recipe,
                                    cudaStream_t stream) {
  const bool tw = recipe == Fp8Recipe::kTensorwise;
  MOEFLOW_CHECK(tw || recipe == Fp8Recipe::kBlockwise,
                "recipe must be kBlockwise or kTensorwise, got ", static_cast<int>(recipe));
  MOEFLOW_CHECK(dw1.defined() || dw2.defined(),
                "grouped_mlp_fp8_backward_wgrad needs dw1, dw2 or both");
  MOEFLOW_CHECK(h.defined() && h.ndim == 2, "h must be [rows,N1], got ", h.str());
  MOEFLOW_CHECK(
      groups.offsets.defined() && groups.offsets.ndim == 1 && groups.offsets.shape[0] >= 2,
      "groups.offsets must be [E+1] with E >= 1, got ", groups.offsets.str());
  const TensorView& xh = dw1.defined() ? x : dy;  // a [rows, H] operand names H
  MOEFLOW_CHECK(xh.defined() && xh.ndim == 2, dw1.defined() ? "x" : "dy", " must be [rows,H], got ",
                xh.str());
  const bool gated = is_gated(c.activation);
  Fp8Dims d{h.shape[0],
            xh.shape[1],
            gated ? h.shape[1] / 2 : h.shape[1],
            h.shape[1],
            groups.offsets.shape[0] - 1,
            h.device};
  MOEFLOW_CHECK(d.hidden % kB == 0 && d.ffn % kB == 0 && d.hidden > 0 && d.ffn > 0 &&
                    (!gated || d.n1 == 2 * d.ffn),
                "the FP8 wgrad needs H and F positive multiples of 128 (h [rows, N1], N1 = ",
                gated ? "2 x " : "", "F), got H=", d.hidden, " N1=", d.n1);
  MOEFLOW_CHECK(d.rows % 16 == 0,
                "the FP8 wgrad needs rows to be a multiple of 16 (16-byte rows "
                "of the transposed codes), got ",
                d.rows);
  check_common(d, groups, probs, c, h);
  const int64_t E = d.experts, H = d.hidden, F = d.ffn, N1 = d.n1, rows = d.rows;
  const int64_t nb = (rows + kB - 1) / kB;
  MOEFLOW_CHECK(scratch.codes.defined() && scratch.codes.is_contiguous() &&
                    scratch.scales.defined() && scratch.scales.is_contiguous(),
                "scratch.codes and scratch.scales must be given, contiguous");
  MOEFLOW_CHECK(scratch.codes.device == d.dev && scratch.scales.device == d.dev,
                "scratch.codes and scratch.scales must be on ", d.dev.str());
  const int64_t need_codes = rows * (H + N1 + (tw ? std::max(H, N1) : 0));
  MOEFLOW_CHECK(
      (scratch.codes.dtype == DType::kUInt8 || scratch.codes.dtype == DType::kFloat8E4M3) &&
          scratch.codes.numel() >= need_codes,
      "scratch.codes must be uint8 or float8_e4m3 with >= rows x (H + N1",
      tw ? " + max(H, N1)" : "", ") = ", need_codes, " elements, got ", scratch.codes.str());
  MOEFLOW_CHECK(reinterpret_cast<uintptr_t>(scratch.codes.data) % 16 == 0,
                "scratch.codes must be 16-byte aligned");
  const int64_t need_scales = tw ? 2 : (H + N1) * nb;
  MOEFLOW_CHECK(scratch.scales.dtype == DType::kFloat32 && scratch.scales.numel() >= need_scales,
                "scratch.scales must be float32 with >= ",
                tw ? "2 (tensorwise)" : "(H + N1) x ceil(rows/128)", " = ", need_scales,
                " elements, got ", scratch.scales.str());
  const detail::DeviceGuard device_guard(d.dev);
  if (tw) {
    // One scale per operand: rowwise codes staged after the two transposed
    // operands, then transposed into their places; scales[0] and [1].
    const QuantizeConfig tcfg = rows_of(recipe);
    auto* base = static_cast<uint8_t*>(scratch.codes.data);
    auto* sc = static_cast<float*>(scratch.scales.data);
    const auto stage = [&](int64_t cols) {
      return TensorView(base + rows * (H + N1), DType::kFloat8E4M3, d.dev, {rows, cols});
    };
    const auto slot = [&](int64_t before, int64_t cols) {
      return TensorView(base + before * rows, DType::kFloat8E4M3, d.dev, {cols, rows});
    };
    const auto scale = [&](int i) { return TensorView(sc + i, DType::kFloat32, d.dev, {1}); };
    const auto rows_t = [&](TensorView src, int64_t before, int i) {
      quantize_group_rows(src, groups, tcfg, stage(src.shape[1]), scale(i),
                          slot(before, src.shape[1]), stream);
    };
    if (dw2.defined()) {
      detail::expect(dy, "dy", rows_expect(DType::kBFloat16, rows, H, d.dev));
      detail::expect(dw2, "dw2", Expect{{DType::kFloat32, DType::kBFloat16}, {E, H, F}, d.dev});
      rows_t(dy, 0, 0);
      grouped_mlp_activation_quantize(h, groups, probs, c, tcfg, stage(F), scale(1), slot(H, F),
                                      stream);
      grouped_gemm_fp8_wgrad(slot(0, H), scale(0), slot(H, F), scale(1), groups,
                             GroupedWeights::from_stacked(dw2), accumulate, c.gemm, stream);
    }
    if (dw1.defined()) {
      detail::expect(x, "x", rows_expect(DType::kBFloat16, rows, H, d.dev));
      detail::expect(d_h, "d_h", rows_expect(DType::kBFloat16, rows, N1, d.dev));
      detail::expect(dw1, "dw1", Expect{{DType::kFloat32, DType::kBFloat16}, {E, N1, H}, d.dev});
      rows_t(d_h, 0, 0);
      rows_t(x, N1, 1);
      grouped_gemm_fp8_wgrad(slot(0, N1), scale(0), slot(N1, H), scale(1), groups,
                             GroupedWeights::from_stacked(dw1), accumulate, c.gemm, stream);
    }
    return;
  }
  const QuantizeConfig cfg = rows_1x128();
  if (dw2.defined()) {
    detail::expect(dy, "dy", rows_expect(DType::kBFloat16, rows, H, d.dev));
    detail::expect(dw2, "dw2", Expect{{DType::kFloat32, DType::kBFloat16}, {E, H, F}, d.dev});
    MOEFLOW_CHECK(scratch.a.defined() && scratch.a.is_contiguous() &&
                      scratch.a.dtype == DType::kBFloat16 && scratch.a.device == d.dev &&
                      scratch.a.numel() >= rows * F,
                  "scratch.a must be bfloat16 on ", d.dev.str(),
                  ", contiguous, with >= rows x F = ", rows * F,
                  " elements (dw2 recomputes a), got ", scratch.a.str());
    const TensorView a(scratch.a.data, DType::kBFloat16, d.dev, {rows, F});
    grouped_mlp_recompute_activation(h, groups, probs, c, a, stream);
    const Operand dyt = wgrad_operand(scratch, rows, 0, H, d.dev);
    const Operand at = wgrad_operand(scratch, rows, H, F, d.dev);
    quantize_rowwise_columnwise(dy, cfg, {}, {}, dyt.codes, dyt.scales, stream);
    quantize_rowwise_columnwise(a, cfg, {}, {}, at.codes, at.scales, stream);
    grouped_gemm_fp8_wgrad(dyt.codes, dyt.scales, at.codes, at.scales, groups,
                           GroupedWeights::from_stacked(dw2), accumulate, stream);
  }
  if (dw1.defined()) {
    detail::expect(x, "x", rows_expect(DType::kBFloat16, rows, H, d.dev));
    detail::expect(d_h, "d_h", rows_expect(DType::kBFloat16, rows, N1, d.dev));
    detail::expect(dw1, "dw1", Expect{{DType::kFloat32, DType::kBFloat16}, {E, N1, H}, d.dev});
    const Operand dht = wgrad_operand(scratch, rows, 0, N1, d.dev);
    const Operand xt = wgrad_operand(scratch, rows, N1, H, d.dev);
    quantize_rowwise_columnwise(d_h, cfg, {}, {}, dht.codes, dht.scales, stream);
    quantize_rowwise_columnwise(x, cfg, {}, {}, xt.codes, xt.scales, stream);
    grouped_gemm_fp8_wgrad(dht.codes, dht.scales, xt.codes, xt.scales, groups,
                           GroupedWeights::from_stacked(dw1), accumulate, stream);
  }
}

}  // namespace moeflow
