// Public FP8 quantize / dequantize entry points: argument checks, then
// dispatch to the CPU or CUDA backend by the device of the input.
#include <utility>
#include <vector>

#include "core/internal.h"
#include "core/quantize_backend.h"

namespace moeflow {

using detail::Expect;

namespace {

const std::vector<DType> kArithFloats = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

int64_t nblocks(int64_t n) {
  return (n + quant::kBlock - 1) / quant::kBlock;
}

void check_config(const QuantizeConfig& c) {
  MOEFLOW_CHECK(c.out == DType::kFloat8E4M3 || c.out == DType::kFloat8E5M2,
                "QuantizeConfig.out must be float8_e4m3 or float8_e5m2, got ", dtype_name(c.out));
  MOEFLOW_CHECK(c.scaling == QuantScaling::kTensorwise || c.scaling == QuantScaling::kBlock1x128 ||
                    c.scaling == QuantScaling::kBlock128x128,
                "QuantizeConfig.scaling must be kTensorwise, kBlock1x128 or kBlock128x128, got ",
                static_cast<int>(c.scaling));
}

// The scales shape for q of shape [R,C].
std::vector<int64_t> scales_shape(int64_t R, int64_t C, QuantScaling s) {
  switch (s) {
    case QuantScaling::kTensorwise:
      return {1};
    case QuantScaling::kBlock1x128:
      return {R, nblocks(C)};
    default:
      return {nblocks(R), nblocks(C)};
  }
}

Expect rows_of(const std::vector<DType>& dtypes, int64_t rows, int64_t cols, Device device) {
  Expect e{dtypes, {rows, cols}, device};
  e.contiguous = false;
  e.inner_unit = true;
  return e;
}

}  // namespace

size_t quantize_workspace_bytes(int64_t rows, int64_t cols, const QuantizeConfig& config) {
  check_config(config);
  MOEFLOW_CHECK(rows >= 0 && cols >= 0,
                "quantize_workspace_bytes: rows and cols must be >= 0, got ", rows, " and ", cols);
#ifdef MOEFLOW_WITH_CUDA
  return cuda::quantize_workspace_bytes(rows, cols, config);
#else
  return 0;
#endif
}

void quantize(TensorView x, const QuantizeConfig& config, TensorView q, TensorView scales,
              TensorView workspace, TensorView rows_used, cudaStream_t stream) {
  check_config(config);
  detail::expect_defined(x, "x");
  MOEFLOW_CHECK(x.ndim == 2, "x must be [M,K], got ", x.str());
  const Device dev = x.device;
  const int64_t M = x.shape[0], K = x.shape[1];
  detail::expect(x, "x", rows_of(kArithFloats, M, K, dev));
  const int64_t R = config.columnwise ? K : M, C = config.columnwise ? M : K;
  detail::expect(q, config.columnwise ? "q (columnwise: [K,M])" : "q",
                 rows_of({config.out}, R, C, dev));
  detail::expect(scales, "scales",
                 Expect{{DType::kFloat32}, scales_shape(R, C, config.scaling), dev});
  if (rows_used.defined()) {
    MOEFLOW_CHECK(config.scaling == QuantScaling::kBlock1x128 && !config.columnwise,
                  "rows_used needs a rowwise kBlock1x128 quantize");
    detail::expect(rows_used, "rows_used", Expect{{DType::kInt32, DType::kInt64}, {1}, dev});
  }
  if (dev.is_cpu()) return cpu::quantize(x, config, q, scales, rows_used);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  const size_t need = cuda::quantize_workspace_bytes(M, K, config);
  if (need > 0) {
    detail::expect(workspace, "workspace", Expect{{DType::kUInt8}, {-1}, dev});
    MOEFLOW_CHECK(workspace.nbytes() >= need, "workspace must hold >= ", need,
                  " bytes (quantize_workspace_bytes), got ", workspace.nbytes());
  }
  cuda::quantize(x, config, q, scales, workspace, rows_used, stream);
#else
  (void)workspace;
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

namespace {

// quantize_rowwise_columnwise's kBlock128x128 arguments: x [M,K] or [G,M,K].
void check_both_ways_128x128(const QuantizeConfig& config, TensorView x, TensorView q,
                             TensorView scales, TensorView q_t, TensorView scales_t) {
  MOEFLOW_CHECK(x.ndim == 2 || x.ndim == 3, "x must be [M,K] or [G,M,K] (kBlock128x128), got ",
                x.str());
  const Device dev = x.device;
  const bool grouped = x.ndim == 3;
  const int64_t G = grouped ? x.shape[0] : 1;
  const int64_t M = x.shape[x.ndim - 2], K = x.shape[x.ndim - 1];
  const auto shape = [&](int64_t r, int64_t c) {
    return grouped ? std::vector<int64_t>{G, r, c} : std::vector<int64_t>{r, c};
  };
  const auto rows = [&](const std::vector<DType>& dtypes, int64_t r, int64_t c) {
    Expect e{dtypes, shape(r, c), dev};
    e.contiguous = false;
    e.inner_unit = true;
    return e;
  };
  detail::expect(x, "x", rows(kArithFloats, M, K));
  if (q.defined()) {
    detail::expect(q, "q", rows({config.out}, M, K));
    detail::expect(scales, "scales", Expect{{DType::kFloat32}, shape(nblocks(M), nblocks(K)), dev});
  }
  detail::expect(q_t, grouped ? "q_t ([G,K,M])" : "q_t ([K,M])", rows({config.out}, K, M));
  detail::expect(scales_t,
                 grouped ? "scales_t ([G, ceil(K/128), ceil(M/128)])"
                         : "scales_t ([ceil(K/128), ceil(M/128)])",
                 Expect{{DType::kFloat32}, shape(nblocks(K), nblocks(M)), dev});
}

}  // namespace

void quantize_rowwise_columnwise(TensorView x, const QuantizeConfig& config, TensorView q,
                                 TensorView scales, TensorView q_t, TensorView scales_t,
                                 cudaStream_t stream) {
  check_config(config);
  MOEFLOW_CHECK(
      config.scaling == QuantScaling::kBlock1x128 || config.scaling == QuantScaling::kBlock128x128,
      "quantize_rowwise_columnwise: config.scaling must be kBlock1x128 or "
      "kBlock128x128, got ",
      static_cast<int>(config.scaling));
  MOEFLOW_CHECK(!config.columnwise,
                "quantize_rowwise_columnwise: config.columnwise must be false (both "
                "orientations are written), got true");
  detail::expect_defined(x, "x");
  MOEFLOW_CHECK(q.defined() == scales.defined(),
                "quantize_rowwise_columnwise: give both q and scales, or neither (columnwise "
                "only), got q ",
                q.defined() ? "defined" : "undefined", " and scales ",
                scales.defined() ? "defined" : "undefined");
  const Device dev = x.device;
  if (config.scaling == QuantScaling::kBlock128x128) {
    check_both_ways_128x128(config, x, q, scales, q_t, scales_t);
  } else {
    MOEFLOW_CHECK(x.ndim == 2, "x must be [M,K], got ", x.str());
    const int64_t M = x.shape[0], K = x.shape[1];
    detail::expect(x, "x", rows_of(kArithFloats, M, K, dev));
    if (q.defined()) {
      detail::expect(q, "q", rows_of({config.out}, M, K, dev));
      detail::expect(scales, "scales", Expect{{DType::kFloat32}, {M, nblocks(K)}, dev});
    }
    detail::expect(q_t, "q_t ([K,M])", rows_of({config.out}, K, M, dev));
    Expect st{{DType::kFloat32}, {K, nblocks(M)}, dev};
    st.contiguous = false;
    detail::expect(scales_t, "scales_t ([K, ceil(M/128)])", st);
  }
  if (dev.is_cpu()) return cpu::quantize_rowwise_columnwise(x, config, q, scales, q_t, scales_t);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::quantize_rowwise_columnwise(x, config, q, scales, q_t, scales_t, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

void requantize_columnwise(TensorView q, TensorView scales, DType dtype,
                           const QuantizeConfig& config, TensorView q_t, TensorView scales_t,
                           cudaStream_t stream) {
  check_config(config);
  MOEFLOW_CHECK(config.scaling == QuantScaling::kBlock1x128 && !config.columnwise,
                "requantize_columnwise: config must be kBlock1x128 with columnwise false (q_t is "
                "the columnwise output)");
  MOEFLOW_CHECK(dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                "requantize_columnwise: dtype (the 16-bit rows' dtype) must be bfloat16 or "
                "float16, got ",
                dtype_name(dtype));
  detail::expect_defined(q, "q");
  MOEFLOW_CHECK(q.ndim == 2, "q must be [M,K], got ", q.str());
  const Device dev = q.device;
  const int64_t M = q.shape[0], K = q.shape[1];
  detail::expect(q, "q", rows_of({DType::kFloat8E4M3, DType::kFloat8E5M2}, M, K, dev));
  detail::expect(scales, "scales", Expect{{DType::kFloat32}, {M, nblocks(K)}, dev});
  detail::expect(q_t, "q_t ([K,M])", rows_of({config.out}, K, M, dev));
  Expect st{{DType::kFloat32}, {K, nblocks(M)}, dev};
  st.contiguous = false;
  detail::expect(scales_t, "scales_t ([K, ceil(M/128)])", st);
  if (dev.is_cpu()) return cpu::requantize_columnwise(q, scales, dtype, config, q_t, scales_t);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::requantize_columnwise(q, scales, dtype, config, q_t, scales_t, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

void dequantize(TensorView q, TensorView scales, const QuantizeConfig& config, TensorView out,
                TensorView rows_used, cudaStream_t stream) {
  check_config(config);
  detail::expect_defined(out, "out");
  MOEFLOW_CHECK(out.ndim == 2, "out must be [M,K], got ", out.str());
  const Device dev = out.device;
  const int64_t M = out.shape[0], K = out.shape[1];
  detail::expect(out, "out", rows_of(kArithFloats, M, K, dev));
  const int64_t R = config.columnwise ? K : M, C = config.columnwise ? M : K;
  detail::expect(q, config.columnwise ? "q (columnwise: [K,M])" : "q",
                 rows_of({config.out}, R, C, dev));
  detail::expect(scales, "scales",
                 Expect{{DType::kFloat32}, scales_shape(R, C, config.scaling), dev});
  if (rows_used.defined()) {
    MOEFLOW_CHECK(!config.columnwise, "rows_used needs a rowwise dequantize (columnwise false)");
    detail::expect(rows_used, "rows_used", Expect{{DType::kInt32, DType::kInt64}, {1}, dev});
  }
  if (dev.is_cpu()) return cpu::dequantize(q, scales, config, out, rows_used);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::dequantize(q, scales, config, out, rows_used, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

void transpose_codes(TensorView q, TensorView q_t, cudaStream_t stream) {
  detail::expect_defined(q, "q");
  MOEFLOW_CHECK(q.ndim == 2 || q.ndim == 3, "q must be [R,C] or [G,R,C], got ", q.str());
  MOEFLOW_CHECK(q.dtype == DType::kFloat8E4M3 || q.dtype == DType::kFloat8E5M2 ||
                    q.dtype == DType::kFloat32,
                "q must be float8_e4m3, float8_e5m2 or float32 (scales), got ",
                dtype_name(q.dtype));
  const Device dev = q.device;
  const std::vector<int64_t> shape = q.sizes();
  std::vector<int64_t> shape_t = shape;
  std::swap(shape_t[q.ndim - 2], shape_t[q.ndim - 1]);
  detail::expect(q, "q", Expect{{q.dtype}, shape, dev});
  detail::expect(q_t, "q_t", Expect{{q.dtype}, shape_t, dev});
  if (q.numel() == 0) return;
  const auto lo = [](const TensorView& v) { return reinterpret_cast<uintptr_t>(v.data); };
  MOEFLOW_CHECK(lo(q) + q.nbytes() <= lo(q_t) || lo(q_t) + q_t.nbytes() <= lo(q),
                "transpose_codes: q and q_t must not overlap (no in-place transpose)");
  if (dev.is_cpu()) return cpu::transpose_codes(q, q_t);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::transpose_codes(q, q_t, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

}  // namespace moeflow
