// CPU reference for FP8 quantize / dequantize: the oracle for the CUDA
// backend. Scales come from quant::scale_of (shared with the device code);
// the fp8 conversion is a software round-to-nearest-even with saturation that
// matches cvt.rn.satfinite (and cuda_fp8.h's host conversion) bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/internal.h"
#include "core/quantize_backend.h"

namespace moeflow::cpu {

using detail::load_float;
using quant::kBlock;

uint8_t float_to_fp8(float v, bool e4m3) {
  const uint32_t u = quant::bits_of(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return quant::kFp8NaN;
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const float a = std::fabs(v);
  if (a > quant::fp8_max(e4m3)) return sign | (e4m3 ? 0x7E : 0x7B);  // +-inf too
  if (a == 0.0f) return sign;
  const int mbits = e4m3 ? 3 : 2;
  const int emin = e4m3 ? -6 : -14;  // exponent of the smallest normal
  const int bias = e4m3 ? 7 : 15;    // emin + bias == 1 in both formats
  int e;
  std::frexp(a, &e);
  e = std::max(e - 1, emin);  // a in [2^e, 2^(e+1)), or the subnormal range
  // n = a / 2^(e - mbits) rounded to nearest even: n in [0, 2^(mbits+1)]; the
  // scaling is exact (a power of two, the result normal or a small integer).
  const int n = static_cast<int>(std::nearbyint(std::ldexp(a, mbits - e)));
  // Normal: ((e + bias) << mbits) + n - 2^mbits; subnormal (e == emin, n <
  // 2^mbits): n; both equal ((e + bias - 1) << mbits) + n, and n == 2^(mbits+1)
  // carries into the exponent. a <= fp8_max, so no code passes the maximum.
  return sign | static_cast<uint8_t>(((e + bias - 1) << mbits) + n);
}

namespace {

// Where the input element of q(r,c) is: x[r*xr + c*xc].
struct Source {
  const void* data;
  DType dtype;
  int64_t xr, xc;
  float at(int64_t r, int64_t c) const { return load_float(data, dtype, r * xr + c * xc); }
};

Source source_of(TensorView x, bool columnwise) {
  return columnwise ? Source{x.data, x.dtype, 1, x.strides[0]}
                    : Source{x.data, x.dtype, x.strides[0], 1};
}

float amax_of(const Source& s, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float m = 0.0f;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) m = quant::amax_join(m, quant::amax_term(s.at(r, c)));
  return m;
}

// The rows a rows_used count names: min(max(n, 0), rows), or rows without one.
int64_t rows_used_of(TensorView rows_used, int64_t rows) {
  if (!rows_used.defined()) return rows;
  const int64_t n = rows_used.dtype == DType::kInt64 ? *static_cast<const int64_t*>(rows_used.data)
                                                     : *static_cast<const int32_t*>(rows_used.data);
  return std::min(rows, std::max<int64_t>(n, 0));
}

}  // namespace

void quantize(TensorView x, const QuantizeConfig& config, TensorView q, TensorView scales,
              TensorView rows_used) {
  const bool e4m3 = config.out == DType::kFloat8E4M3;
  const Source s = source_of(x, config.columnwise);
  const int64_t R = q.shape[0], C = q.shape[1];
  const int64_t rows = rows_used_of(rows_used, R);
  auto* qv = static_cast<uint8_t*>(q.data);
  auto* sv = static_cast<float*>(scales.data);
  // Quantizes q rows [r0,r1) x cols [c0,c1) with `scale`.
  auto quantize_block = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, float scale) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c)
        qv[r * q.strides[0] + c] = float_to_fp8(quant::div_rn(s.at(r, c), scale), e4m3);
  };
  switch (config.scaling) {
    case QuantScaling::kTensorwise: {
      const float scale = quant::scale_of(amax_of(s, 0, R, 0, C), e4m3, config.pow2_scales);
      sv[0] = scale;
      quantize_block(0, R, 0, C, scale);
      return;
    }
    case QuantScaling::kBlock1x128: {
      const int64_t nb = scales.shape[1];
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock);
          const float scale =
              quant::scale_of(amax_of(s, r, r + 1, c0, c1), e4m3, config.pow2_scales);
          sv[r * nb + b] = scale;
          quantize_block(r, r + 1, c0, c1, scale);
        }
      return;
    }
    case QuantScaling::kBlock128x128: {
      const int64_t nbr = scales.shape[0], nbc = scales.shape[1];
      for (int64_t br = 0; br < nbr; ++br)
        for (int64_t bc = 0; bc < nbc; ++bc) {
          const int64_t r0 = br * kBlock, r1 = std::min(R, r0 + kBlock);
          const int64_t c0 = bc * kBlock, c1 = std::min(C, c0 + kBlock);
          const float scale = quant::scale_of(amax_of(s, r0, r1, c0, c1), e4m3, config.pow2_scales);
          sv[br * nbc + bc] = scale;
          quantize_block(r0, r1, c0, c1, scale);
        }
      return;
    }
  }
}

void quantize_rowwise_columnwise(TensorView x, const QuantizeConfig& config, TensorView q,
                                 TensorView scales, TensorView q_t, TensorView scales_t) {
  if (config.scaling == QuantScaling::kBlock128x128) {
    // Each matrix quantized rowwise, then columnwise (x^T's codes and grid).
    const bool grouped = x.ndim == 3;
    const int64_t G = grouped ? x.shape[0] : 1;
    const int64_t M = x.shape[x.ndim - 2], K = x.shape[x.ndim - 1];
    const int64_t nbm = (M + quant::kBlock - 1) / quant::kBlock;
    const int64_t nbk = (K + quant::kBlock - 1) / quant::kBlock;
    const auto matrix = [&](TensorView v, int64_t g, int64_t r, int64_t c) {
      const int64_t gs = grouped ? v.strides[0] : 0;
      return TensorView::strided(static_cast<char*>(v.data) + g * gs * dtype_size(v.dtype), v.dtype,
                                 v.device, {r, c}, {v.strides[v.ndim - 2], 1});
    };
    QuantizeConfig col = config;
    col.columnwise = true;
    for (int64_t g = 0; g < G; ++g) {
      const TensorView xg = matrix(x, g, M, K);
      if (q.defined())
        cpu::quantize(xg, config, matrix(q, g, M, K),
                      TensorView(static_cast<float*>(scales.data) + g * nbm * nbk, DType::kFloat32,
                                 Device::cpu(), {nbm, nbk}));
      cpu::quantize(xg, col, matrix(q_t, g, K, M),
                    TensorView(static_cast<float*>(scales_t.data) + g * nbm * nbk, DType::kFloat32,
                               Device::cpu(), {nbk, nbm}));
    }
    return;
  }
  if (q.defined()) cpu::quantize(x, config, q, scales);
  QuantizeConfig col = config;
  col.columnwise = true;
  const int64_t K = scales_t.shape[0], nb = scales_t.shape[1];
  std::vector<float> s(static_cast<size_t>(K * nb));
  cpu::quantize(x, col, q_t, TensorView(s.data(), DType::kFloat32, Device::cpu(), {K, nb}));
  auto* out = static_cast<float*>(scales_t.data);
  for (int64_t c = 0; c < K; ++c)
    for (int64_t b = 0; b < nb; ++b)
      out[c * scales_t.strides[0] + b * scales_t.strides[1]] = s[c * nb + b];
}

void requantize_columnwise(TensorView q, TensorView scales, DType dtype,
                           const QuantizeConfig& config, TensorView q_t, TensorView scales_t) {
  Tensor rows = Tensor::empty({q.shape[0], q.shape[1]}, dtype, Device::cpu());
  QuantizeConfig codes = config;
  codes.out = q.dtype;
  cpu::dequantize(q, scales, codes, rows);
  cpu::quantize_rowwise_columnwise(rows, config, TensorView{}, TensorView{}, q_t, scales_t);
}

void dequantize(TensorView q, TensorView scales, const QuantizeConfig& config, TensorView out,
                TensorView rows_used) {
  const bool e4m3 = config.out == DType::kFloat8E4M3;
  const int64_t R = rows_used_of(rows_used, q.shape[0]);
  const int64_t C = q.shape[1];
  const auto* qv = static_cast<const uint8_t*>(q.data);
  const auto* sv = static_cast<const float*>(scales.data);
  const int64_t nbc = scales.ndim == 2 ? scales.shape[1] : 0;
  const int64_t orow = config.columnwise ? 1 : out.strides[0];
  const int64_t ocol = config.columnwise ? out.strides[0] : 1;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      float scale;
      switch (config.scaling) {
        case QuantScaling::kTensorwise:
          scale = sv[0];
          break;
        case QuantScaling::kBlock1x128:
          scale = sv[r * nbc + c / kBlock];
          break;
        default:
          scale = sv[(r / kBlock) * nbc + c / kBlock];
          break;
      }
      const double d =
          static_cast<double>(quant::fp8_value(qv[r * q.strides[0] + c], e4m3)) * scale;
      const int64_t i = r * orow + c * ocol;
      if (d != d) {  // canonical NaN of the dtype
        if (out.dtype == DType::kFloat32)
          static_cast<uint32_t*>(out.data)[i] = 0x7FFFFFFFu;
        else
          static_cast<uint16_t*>(out.data)[i] = 0x7FFF;
      } else if (out.dtype == DType::kFloat32) {
        static_cast<float*>(out.data)[i] = static_cast<float>(d);
      } else {
        detail::store_float(out.data, out.dtype, i, quant::round_to_odd_float(d));
      }
    }
}

void transpose_codes(TensorView q, TensorView q_t) {
  const int64_t G = q.ndim == 3 ? q.shape[0] : 1;
  const int64_t R = q.shape[q.ndim - 2], C = q.shape[q.ndim - 1];
  const size_t es = dtype_size(q.dtype);
  const auto* in = static_cast<const uint8_t*>(q.data);
  auto* out = static_cast<uint8_t*>(q_t.data);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c)
        std::memcpy(out + ((g * C + c) * R + r) * es, in + ((g * R + r) * C + c) * es, es);
}

}  // namespace moeflow::cpu
