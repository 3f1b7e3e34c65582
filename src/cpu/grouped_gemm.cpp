// CPU reference for the grouped GEMM: plain triple loops per group with
// float64 accumulation, rounded to float32 and then (bf16 / fp16 outputs) to
// the output's dtype. The oracle for the CUDA kernels.
#include <vector>

#include "core/backends.h"
#include "core/internal.h"
#include "core/quantize_backend.h"

namespace moeflow::cpu {

using detail::load_float;
using detail::store_float;

namespace {

// Element (i, j) of a row-major view with unit inner stride.
float at(const TensorView& v, int64_t i, int64_t j) {
  return load_float(v.data, v.dtype, i * v.strides[0] + j);
}

// v rounded to a 16-bit dtype (nearest even) and back to float.
float rounded_to(float v, DType dt) {
  float r = 0.0f;
  store_float(&r, dt, 0, v);
  return load_float(&r, dt, 0);
}

// Base address of weight e ([n,k] row-major, contiguous).
const void* weight(const GroupedWeights& w, int64_t e, int64_t n, int64_t k) {
  if (w.stacked.defined())
    return static_cast<const uint8_t*>(w.stacked.data) + e * n * k * dtype_size(w.stacked.dtype);
  return reinterpret_cast<const void*>(w.pointers.data_ptr<int64_t>()[e]);
}

// The FP8 references' layout checks (the CUDA kernels flag bad offsets instead).
void check_groups(const int64_t* offsets, const int32_t* real, int64_t E, int64_t rows) {
  for (int64_t e = 0; e < E; ++e) {
    MOEFLOW_CHECK(offsets[e] >= 0 && offsets[e] <= offsets[e + 1] && offsets[e + 1] <= rows,
                  "groups.offsets must be monotone within [0, rows=", rows, "], got offsets[", e,
                  "]=", offsets[e], ", offsets[", e + 1, "]=", offsets[e + 1]);
    if (real)
      MOEFLOW_CHECK(real[e] >= 0 && real[e] <= offsets[e + 1] - offsets[e], "groups.real_rows[", e,
                    "]=", real[e], " must be within [0, ", offsets[e + 1] - offsets[e], "]");
  }
}

}  // namespace

void grouped_gemm(const GroupedGemmCall& c) {
  const int64_t E = c.num_groups, n = c.n, k = c.k;
  const auto* offsets = c.groups.offsets.data_ptr<int64_t>();
  const int32_t* real =
      c.groups.real_rows.defined() ? c.groups.real_rows.data_ptr<int32_t>() : nullptr;
  for (int64_t e = 0; e < E; ++e) {
    MOEFLOW_CHECK(offsets[e] >= 0 && offsets[e] <= offsets[e + 1] && offsets[e + 1] <= c.rows,
                  "groups.offsets must be monotone within [0, rows=", c.rows, "], got offsets[", e,
                  "]=", offsets[e], ", offsets[", e + 1, "]=", offsets[e + 1]);
    if (real)
      MOEFLOW_CHECK(real[e] >= 0 && real[e] <= offsets[e + 1] - offsets[e], "groups.real_rows[", e,
                    "]=", real[e], " must be within [0, ", offsets[e + 1] - offsets[e], "]");
  }
  const DType wdt = c.w.stacked.defined() ? c.w.stacked.dtype : c.w.dtype;
  std::vector<float> wf(n * k), row_a, row_b;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1];
    const int64_t real_end = real ? begin + real[e] : end;
    const void* w = weight(c.w, e, n, k);
    if (c.op == GroupedGemmCall::kForward || c.op == GroupedGemmCall::kDgrad) {
      // Step 1: W_e as float, oriented [out][red] so the inner loop is contiguous.
      const bool fwd = c.op == GroupedGemmCall::kForward;
      const int64_t out_cols = fwd ? n : k, red = fwd ? k : n;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < k; ++j)
          wf[fwd ? i * k + j : j * n + i] = load_float(w, wdt, i * k + j);
      // Step 2: each row (pad rows: zeros).
      row_a.resize(red);
      for (int64_t r = begin; r < end; ++r) {
        const bool data = r < real_end;
        if (data)
          for (int64_t i = 0; i < red; ++i) row_a[i] = at(c.a, r, i);
        for (int64_t j = 0; j < out_cols; ++j) {
          double s = 0.0;
          if (data) {
            const float* wr = wf.data() + j * red;
            for (int64_t i = 0; i < red; ++i) s += static_cast<double>(row_a[i]) * wr[i];
          }
          store_float(c.out.data, c.out.dtype, r * c.out.strides[0] + j, static_cast<float>(s));
        }
      }
    } else {  // wgrad: dW[e][i][j] (+)= sum over real rows r of dC[r][i] * A[r][j]
      // The float32 result, rounded to dW's dtype; with accumulate the old
      // value is added to it (float32 dW: one rounding; bf16 / fp16: to the
      // result rounded to dW's dtype, as the CUDA reduce-add and autograd's
      // grad += g).
      void* dw = const_cast<void*>(weight(c.w, e, n, k));
      std::vector<double> acc(n * k, 0.0);
      row_a.resize(n);
      row_b.resize(k);
      for (int64_t r = begin; r < real_end; ++r) {
        for (int64_t i = 0; i < n; ++i) row_a[i] = at(c.a, r, i);
        for (int64_t j = 0; j < k; ++j) row_b[j] = at(c.b, r, j);
        for (int64_t i = 0; i < n; ++i) {
          const double g = row_a[i];
          double* out = acc.data() + i * k;
          for (int64_t j = 0; j < k; ++j) out[j] += g * row_b[j];
        }
      }
      for (int64_t i = 0; i < n * k; ++i) {
        if (!c.accumulate) {
          store_float(dw, wdt, i, static_cast<float>(acc[i]));
        } else if (wdt == DType::kFloat32) {
          store_float(dw, wdt, i, static_cast<float>(acc[i] + load_float(dw, wdt, i)));
        } else {
          store_float(dw, wdt, i,
                      rounded_to(static_cast<float>(acc[i]), wdt) + load_float(dw, wdt, i));
        }
      }
    }
  }
}

// The blockwise FP8 forward: the products of the dequantized values (code x
// block scale, each exact) summed in float64, rounded to float32, then to
// bf16. The GPU sums each 128-wide K block in float32 before scaling, so the
// two differ by float32 rounding (tests state the bound).
void grouped_gemm_fp8_forward(const Fp8GemmCall& c) {
  const int64_t rows = c.a.shape[0], K = c.a.shape[1], E = c.w.shape[0], N = c.w.shape[1];
  const int64_t kb = K / 128, nb = N / 128;
  const auto* offsets = c.groups.offsets.data_ptr<int64_t>();
  const int32_t* real =
      c.groups.real_rows.defined() ? c.groups.real_rows.data_ptr<int32_t>() : nullptr;
  check_groups(offsets, real, E, rows);
  const auto* qa = static_cast<const uint8_t*>(c.a.data);
  const auto* qw = static_cast<const uint8_t*>(c.w.data);
  const float* sa = c.a_scales.data_ptr<float>();
  const float* sw = c.w_scales.data_ptr<float>();
  // Tensorwise: one scale per operand (the scales [1]); else blockwise.
  const bool tw = c.a_scales.ndim == 1;
  const int64_t ka = tw ? 0 : kb;  // a scale's row stride, in blocks
  std::vector<double> wf(N * K), af(K);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1];
    const int64_t real_end = real ? begin + real[e] : end;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        wf[n * K + k] = static_cast<double>(quant::fp8_value(qw[(e * N + n) * K + k], true)) *
                        sw[tw ? 0 : (e * nb + n / 128) * kb + k / 128];
    for (int64_t r = begin; r < end; ++r) {
      const bool data = r < real_end;
      if (data)
        for (int64_t k = 0; k < K; ++k)
          af[k] = static_cast<double>(quant::fp8_value(qa[r * K + k], true)) *
                  sa[tw ? 0 : r * ka + k / 128];
      for (int64_t n = 0; n < N; ++n) {
        double s = 0.0;
        if (data)
          for (int64_t k = 0; k < K; ++k) s += af[k] * wf[n * K + k];
        store_float(c.c.data, DType::kBFloat16, r * c.c.strides[0] + n, static_cast<float>(s));
      }
    }
  }
}

// The FP8 wgrad (blockwise, or tensorwise: scales [1]): dW[e][n][k] (+)= the sum over group e's
// real rows r of dequant(dc_t[n][r]) x dequant(a_t[k][r]), products exact, summed in float64 and
// rounded to float32; with accumulate the old value is added in float32 (a bf16 dW: to the
// result rounded to bf16, as the CUDA reduce-add does); then rounded to dW's dtype.
void grouped_gemm_fp8_wgrad(const Fp8WgradCall& c) {
  const int64_t N = c.dc_t.shape[0], rows = c.dc_t.shape[1], K = c.a_t.shape[0];
  const int64_t E = c.dw.num_groups();
  const auto* offsets = c.groups.offsets.data_ptr<int64_t>();
  const int32_t* real =
      c.groups.real_rows.defined() ? c.groups.real_rows.data_ptr<int32_t>() : nullptr;
  check_groups(offsets, real, E, rows);
  const bool tw = c.dc_t_scales.ndim == 1;  // tensorwise: one scale per operand
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n_real = real ? real[e] : offsets[e + 1] - offsets[e];
    if (tw)
      MOEFLOW_CHECK(n_real == 0 || offsets[e] % 16 == 0, "grouped_gemm_fp8_wgrad: group ", e,
                    " starts at row ", offsets[e],
                    ", not a multiple of 16 (tensorwise: the FP8 align)");
    else
      MOEFLOW_CHECK(n_real == 0 || offsets[e] % 128 == 0, "grouped_gemm_fp8_wgrad: group ", e,
                    " starts at row ", offsets[e],
                    ", not a multiple of 128 (its rows must be whole scale blocks: align 128)");
  }
  const DType wdt = c.dw.stacked.defined() ? c.dw.stacked.dtype : c.dw.dtype;
  const auto* qd = static_cast<const uint8_t*>(c.dc_t.data);
  const auto* qa = static_cast<const uint8_t*>(c.a_t.data);
  const float* sd = c.dc_t_scales.data_ptr<float>();
  const float* sa = c.a_t_scales.data_ptr<float>();
  const int64_t ld = c.dc_t.strides[0], la = c.a_t.strides[0];
  const int64_t zero[2] = {0, 0};
  const int64_t* sds = tw ? zero : c.dc_t_scales.strides;
  const int64_t* sas = tw ? zero : c.a_t_scales.strides;
  std::vector<double> df, af;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t lo = offsets[e];
    const int64_t n_rows = real ? real[e] : offsets[e + 1] - lo;
    // The group's rows of both operands, dequantized: [N][n_rows], [K][n_rows].
    df.assign(N * n_rows, 0.0);
    af.assign(K * n_rows, 0.0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t r = 0; r < n_rows; ++r)
        df[n * n_rows + r] = static_cast<double>(quant::fp8_value(qd[n * ld + lo + r], true)) *
                             sd[n * sds[0] + (lo + r) / 128 * sds[1]];
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < n_rows; ++r)
        af[k * n_rows + r] = static_cast<double>(quant::fp8_value(qa[k * la + lo + r], true)) *
                             sa[k * sas[0] + (lo + r) / 128 * sas[1]];
    void* dw = const_cast<void*>(weight(c.dw, e, N, K));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        double s = 0.0;
        for (int64_t r = 0; r < n_rows; ++r) s += df[n * n_rows + r] * af[k * n_rows + r];
        float v = static_cast<float>(s);
        if (c.accumulate) {
          // A 16-bit dW: the result rounded to its dtype first (the CUDA
          // reduce-add, autograd's grad += g), then the sum in float32.
          if (wdt != DType::kFloat32) v = rounded_to(v, wdt);
          v += load_float(dw, wdt, n * K + k);
        }
        store_float(dw, wdt, n * K + k, v);
      }
  }
}

}  // namespace moeflow::cpu
