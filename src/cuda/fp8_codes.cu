// CUDA dequantize and transpose_codes (policy: moeflow/quantize.h):
//   dequantize:      one thread per element, the product formed exactly in
//                    double and rounded once to the output dtype; with
//                    rows_used, the threads past its rows return at once.
//   transpose_codes: 64 x 64-byte tiles through shared memory, 16-byte
//                    loads, byte gathers, 16-byte stores where aligned;
//                    float32 scale grids (small): one thread per element.
// No host sync, no allocation; graph-capturable.
#include <cuda_fp8.h>

#include <type_traits>

#include "core/quantize_backend.h"
#include "cuda/common.cuh"
#include "cuda/fp8.cuh"

namespace moeflow::cuda {
namespace {

using quant::kBlock;

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ void store_out(T* p, double d) {
  if constexpr (std::is_same_v<T, float>) {
    if (d != d)
      *reinterpret_cast<uint32_t*>(p) = 0x7FFFFFFFu;
    else
      *p = static_cast<float>(d);
  } else {
    *p = dequant_round16<T>(d);
  }
}

template <typename T, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* q, int64_t q_stride, int64_t R, int64_t C, const float* scales,
                      QuantScaling scaling, int64_t nbc, T* out, int64_t orow, int64_t ocol,
                      const void* rows_used, bool rows_used64) {
  if (rows_used != nullptr) {  // the rows in use, read on the device
    const int64_t n = rows_used64 ? *static_cast<const int64_t*>(rows_used)
                                  : *static_cast<const int32_t*>(rows_used);
    R = min(R, max(n, int64_t{0}));
  }
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < R * C;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / C, c = i % C;
    float scale;
    if (scaling == QuantScaling::kTensorwise)
      scale = scales[0];
    else if (scaling == QuantScaling::kBlock1x128)
      scale = scales[r * nbc + c / kBlock];
    else
      scale = scales[(r / kBlock) * nbc + c / kBlock];
    const double d = static_cast<double>(quant::fp8_value(q[r * q_stride + c], E4M3)) * scale;
    store_out(out + r * orow + c * ocol, d);
  }
}

// transpose_codes: a 64 x 64 tile of q (rows r0.., columns c0.. of matrix
// g) staged in shared memory, then written as 64 rows of q_t. Thread t moves
// bytes [16 (t % 4), +16) of row t / 4, one 16-byte access when the rows
// are 16-byte aligned (vec_in: q's, vec_out: q_t's) and the span is whole.
constexpr int kTT = 64, kTTPad = 68;  // tile edge, shared-memory row stride (bytes)

__global__ void __launch_bounds__(kThreads)
    transpose_codes_kernel(const uint8_t* q, uint8_t* q_t, int64_t G, int64_t R, int64_t C,
                           bool vec_in, bool vec_out) {
  static_assert(kThreads == 4 * kTT, "one thread per 16 bytes of a tile row");
  __shared__ __align__(16) uint8_t tile[kTT * kTTPad];
  const int64_t tr = (R + kTT - 1) / kTT, tc = (C + kTT - 1) / kTT;
  const int row = threadIdx.x / 4, seg = (threadIdx.x % 4) * 16;
  for (int64_t item = blockIdx.x; item < G * tr * tc; item += gridDim.x) {
    const int64_t g = item / (tr * tc), r0 = (item / tc) % tr * kTT, c0 = item % tc * kTT;
    const uint8_t* in = q + g * R * C;
    uint8_t* out = q_t + g * R * C;
    __syncthreads();  // the previous tile is read out
    {
      const int64_t r = r0 + row, c = c0 + seg;
      uint8_t* dst = tile + row * kTTPad + seg;
      if (vec_in && r < R && c + 16 <= C) {
        const uint4 v = *reinterpret_cast<const uint4*>(in + r * C + c);
        reinterpret_cast<uint32_t*>(dst)[0] = v.x;
        reinterpret_cast<uint32_t*>(dst)[1] = v.y;
        reinterpret_cast<uint32_t*>(dst)[2] = v.z;
        reinterpret_cast<uint32_t*>(dst)[3] = v.w;
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) dst[j] = r < R && c + j < C ? in[r * C + c + j] : 0;
      }
    }
    __syncthreads();
    // q_t row c0 + row, columns r0 + seg ..: tile column `row`, rows seg ..
    const int64_t c = c0 + row, r = r0 + seg;
    if (c >= C) continue;
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < 16; ++j)
      w[j / 4] |= uint32_t{tile[(seg + j) * kTTPad + row]} << (8 * (j % 4));
    if (vec_out && r + 16 <= R) {
      *reinterpret_cast<uint4*>(out + c * R + r) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (r + j < R) out[c * R + r + j] = static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
    }
  }
}

// transpose_codes of float32 scale grids (small): one thread per element.
__global__ void __launch_bounds__(kThreads)
    transpose_f32_kernel(const float* q, float* q_t, int64_t G, int64_t R, int64_t C) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < G * R * C;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t g = i / (R * C), r = i / C % R, c = i % C;
    q_t[(g * C + c) * R + r] = q[i];
  }
}

}  // namespace

void dequantize(TensorView q, TensorView scales, const QuantizeConfig& config, TensorView out,
                TensorView rows_used, cudaStream_t stream) {
  const int64_t R = q.shape[0], C = q.shape[1];
  if (R * C == 0) return;
  const int64_t nbc = scales.ndim == 2 ? scales.shape[1] : 0;
  const int64_t orow = config.columnwise ? 1 : out.strides[0];
  const int64_t ocol = config.columnwise ? out.strides[0] : 1;
  with_float_type(out.dtype, [&](auto t) {
    using T = decltype(t);
    with_fp8_format(config.out == DType::kFloat8E4M3, [&](auto fmt) {
      constexpr bool E4M3 = decltype(fmt)::value;
      dequantize_kernel<T, E4M3><<<capped_grid(R * C, kThreads * 4), kThreads, 0, stream>>>(
          static_cast<const uint8_t*>(q.data), q.strides[0], R, C,
          static_cast<const float*>(scales.data), config.scaling, nbc, static_cast<T*>(out.data),
          orow, ocol, rows_used.data, rows_used.dtype == DType::kInt64);
      MOEFLOW_CUDA_LAUNCH_CHECK();
    });
  });
}

void transpose_codes(TensorView q, TensorView q_t, cudaStream_t stream) {
  const int64_t G = q.ndim == 3 ? q.shape[0] : 1;
  const int64_t R = q.shape[q.ndim - 2], C = q.shape[q.ndim - 1];
  if (q.dtype == DType::kFloat32) {
    transpose_f32_kernel<<<capped_grid(G * R * C, kThreads), kThreads, 0, stream>>>(
        static_cast<const float*>(q.data), static_cast<float*>(q_t.data), G, R, C);
    MOEFLOW_CUDA_LAUNCH_CHECK();
    return;
  }
  const int64_t tiles = G * ceil_div(R, int64_t{kTT}) * ceil_div(C, int64_t{kTT});
  transpose_codes_kernel<<<capped_grid(tiles, 1), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(q.data), static_cast<uint8_t*>(q_t.data), G, R, C,
      C % 16 == 0 && aligned16(q.data), R % 16 == 0 && aligned16(q_t.data));
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda
