// FC1's GLU epilogue for the blockwise FP8 forward (grouped_gemm_fp8_kernel
// with GLU; grouped_mlp_fp8_fc1_forward). The tile walk runs over a's
// columns (Params::n_out = F, 128 per tile). A tile computes its h columns
// in one 128-wide pass (plain activations: h's columns are a's) or two
// (gated: the gate and up columns of its 128 a columns), stores h in bf16
// as the plain forward does after each pass, and after the last quantizes
// a = act(h) * p 1x128 (h and a rounded to bf16 first, the values
// grouped_mlp_activation_quantize computes): a tile holds whole blocks.
//
// Fragment layout (TN = 128, one consumer thread, q = lane % 4):
// acc[4 j + 2 half + b] is the thread's row + 8 half, tile column
// 8 j + 2 q + b, j < 16. a's values end in the same places: value
// (J, half, b) is a's column 8 J + 2 q + b of the tile. The first pass's h
// comes back from global memory (the words the thread itself stored: an L2
// hit, and no shared memory taken from the pipeline's stages). Gated with
// an interleave il = 8 M < 128 (il dividing 128): a pass holds the gate and
// up columns of 64 of a's columns; gate fragment j = (jj / M) 2M + jj % M
// pairs with up fragment j + M, giving a's fragment J = 8 pass + jj.
// il = 128 or halves (il = 0): the first pass is the gate columns, the
// second the up columns in the same places.
#pragma once

#include <cuda_bf16.h>

#include "core/activations.h"
#include "cuda/fp8.cuh"

namespace moeflow::cuda::gemm::fp8 {

struct GluParams {
  int64_t n1 = 0;  // h's columns (W1's rows per group)
  int64_t f = 0;   // a's columns
  int il = 0;      // GLU interleave: 0 (halves) or 8, 16, 32, 64, 128
  int passes = 1;  // 1 plain, 2 gated
  Activation act = Activation::kSwiGLU;
  ActivationParams ap;
  const float* probs = nullptr;  // [rows] or null
  uint8_t* a_q = nullptr;        // [rows, a_stride] e4m3
  int64_t a_stride = 0;
  float* a_scales = nullptr;  // [rows, a_nb] float32
  int64_t a_nb = 0;
  bool pow2 = false;
  int debug = 0;

  // h's first column in pass `s` of the tile at a's column c0.
  __device__ __forceinline__ int64_t h_col(int64_t c0, int s) const {
    if (passes == 1) return c0;
    return il == 0 ? c0 + s * f : 2 * c0 + 128 * s;
  }
};

__device__ __forceinline__ float bf16_round(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float bf16_lo(uint32_t w) {
  return __uint_as_float(w << 16);
}
__device__ __forceinline__ float bf16_hi(uint32_t w) {
  return __uint_as_float(w & 0xFFFF0000u);
}

constexpr bool gated(Activation a) {
  return a == Activation::kSwiGLU || a == Activation::kGeGLU || a == Activation::kClampedQuickGeGLU;
}

// a's value (bf16-rounded) from h's gate and up (bf16 values), p the row's prob.
template <Activation A>
__device__ __forceinline__ float glu_value(const GluParams& g, float gate, float up, float p) {
  return bf16_round(act_forward(A, gate, up, g.ap) * p);
}

// The first pass's h at fragment element k (its word k / 2, as stored).
__device__ __forceinline__ float first_h(const uint32_t (&prev)[32], int k) {
  return k % 2 == 0 ? bf16_lo(prev[k / 2]) : bf16_hi(prev[k / 2]);
}

// acc (the last pass's accumulators) -> a's values, prev the first pass's h.
// Interleave 8 M < 128: fragment J < 8 from the first pass, J >= 8 from this one.
template <Activation A, int M>
__device__ __forceinline__ void glu_interleaved(const GluParams& g, float (&acc)[64],
                                                const uint32_t (&prev)[32], float p0, float p1) {
  float v[32], u[32];
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const int j = (jj / M) * 2 * M + jj % M;
#pragma unroll
    for (int hb = 0; hb < 4; ++hb) {
      const float p = hb < 2 ? p0 : p1;
      v[4 * jj + hb] =
          glu_value<A>(g, bf16_round(acc[4 * j + hb]), bf16_round(acc[4 * (j + M) + hb]), p);
      u[4 * jj + hb] =
          glu_value<A>(g, first_h(prev, 4 * j + hb), first_h(prev, 4 * (j + M) + hb), p);
    }
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    acc[i] = u[i];
    acc[32 + i] = v[i];
  }
}

template <Activation A>
__device__ __forceinline__ void glu_values(const GluParams& g, float (&acc)[64],
                                           const uint32_t (&prev)[32], float p0, float p1) {
  if constexpr (!gated(A)) {  // plain: a = act(h) * p in place
#pragma unroll
    for (int i = 0; i < 64; ++i)
      acc[i] = glu_value<A>(g, bf16_round(acc[i]), 0.0f, (i % 4) < 2 ? p0 : p1);
  } else {
    switch (g.il) {
      case 8:
        return glu_interleaved<A, 1>(g, acc, prev, p0, p1);
      case 16:
        return glu_interleaved<A, 2>(g, acc, prev, p0, p1);
      case 32:
        return glu_interleaved<A, 4>(g, acc, prev, p0, p1);
      case 64:
        return glu_interleaved<A, 8>(g, acc, prev, p0, p1);
      default:  // il = 128 or halves: the first pass was the gate columns
#pragma unroll
        for (int i = 0; i < 64; ++i)
          acc[i] = glu_value<A>(g, first_h(prev, i), bf16_round(acc[i]), (i % 4) < 2 ? p0 : p1);
    }
  }
}

// The 1x128 codes and scale of a's row `row` (half: the thread's first row or
// the one 8 below), a's values in acc (zeros for pad rows), written where
// row < store_hi. The four lanes of a row (lane / 4) share its block; all 32
// lanes must call it. quantize_chunk's policy and arithmetic.
__device__ __forceinline__ void glu_quantize_row(const GluParams& g, const float (&acc)[64],
                                                 int half, int64_t row, bool data, bool store,
                                                 int64_t c0, int q) {
  float v[32];
#pragma unroll
  for (int J = 0; J < 16; ++J) {
    v[2 * J] = data ? acc[4 * J + 2 * half] : 0.0f;
    v[2 * J + 1] = data ? acc[4 * J + 2 * half + 1] : 0.0f;
  }
  uint32_t mb = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) mb = max(mb, abs_bits(v[i]));
  mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
  mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
  const bool finite = mb < kFp8NonFinite;
  float amax = __uint_as_float(mb);
  if (!__all_sync(0xffffffffu, finite)) {  // inf or NaN: the amax of the finite values
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) m = fmaxf(m, finite_abs(v[i]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    amax = m;
  }
  const float scale = quant::scale_of(amax, true, g.pow2);
  const Fp8Divider d(scale, finite);
  if (!store) return;
  uint8_t* dst = g.a_q + row * g.a_stride + c0 + 2 * q;
#pragma unroll
  for (int J = 0; J < 16; ++J) {
    const uint32_t code =
        d.fast ? __nv_cvt_float2_to_fp8x2(make_float2(d.divided(v[2 * J]), d.divided(v[2 * J + 1])),
                                          __NV_SATFINITE, __NV_E4M3)
               : fp8x4_exact<true>(v[2 * J], v[2 * J + 1], 0.0f, 0.0f, d.s);  // (out of line)
    *reinterpret_cast<uint16_t*>(dst + 8 * J) = static_cast<uint16_t>(code);
  }
  if (q == 0) g.a_scales[row * g.a_nb + c0 / 128] = scale;
}

// The GLU epilogue of a tile, after its last pass stored its h: a's values
// from acc (and, gated, the first pass's h read back from `h`: the words
// this thread stored there, at column prev_col; rows past store_hi read as
// 0), then both rows' codes and scales. The activation is dispatched once,
// so that only its code runs (and sits in the instruction cache).
__device__ __forceinline__ void glu_epilogue(const GluParams& g, float (&acc)[64],
                                             const __nv_bfloat16* h, int64_t ldc, int64_t row0,
                                             int64_t prev_col, int64_t store_hi, int64_t data_hi,
                                             int64_t c0, int q) {
  const float p0 = g.probs && row0 < data_hi ? g.probs[row0] : 1.0f;
  const float p1 = g.probs && row0 + 8 < data_hi ? g.probs[row0 + 8] : 1.0f;
  uint32_t prev[32];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + 8 * half;
    const auto* src = reinterpret_cast<const uint32_t*>(h + row * ldc + prev_col + 2 * q);
#pragma unroll
    for (int j = 0; j < 16; ++j)
      prev[2 * j + half] = g.passes == 2 && row < store_hi ? src[4 * j] : 0u;
  }
  switch (g.act) {
    case Activation::kSwiGLU:
      glu_values<Activation::kSwiGLU>(g, acc, prev, p0, p1);
      break;
    case Activation::kGeGLU:
      glu_values<Activation::kGeGLU>(g, acc, prev, p0, p1);
      break;
    case Activation::kClampedQuickGeGLU:
      glu_values<Activation::kClampedQuickGeGLU>(g, acc, prev, p0, p1);
      break;
    case Activation::kGelu:
      glu_values<Activation::kGelu>(g, acc, prev, p0, p1);
      break;
    case Activation::kRelu:
      glu_values<Activation::kRelu>(g, acc, prev, p0, p1);
      break;
    case Activation::kSquaredRelu:
      glu_values<Activation::kSquaredRelu>(g, acc, prev, p0, p1);
      break;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + 8 * half;
    glu_quantize_row(g, acc, half, row, row < data_hi, row < store_hi, c0, q);
  }
}

}  // namespace moeflow::cuda::gemm::fp8
