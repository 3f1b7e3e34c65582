// FP8 quantization for blockwise FP8 training (DeepSeek-V3 / DeepGEMM
// style): x [M,K] -> q (fp8) + float32 scales, and back. No host
// synchronisation, no allocation; outputs are caller-allocated; CUDA calls
// are graph-capturable. The CPU and CUDA backends agree bit for bit.
//
// Policy (one formula on both backends):
//   amax  = max |x| over the finite elements of a block (or of the tensor),
//           in float32; NaN and +-inf are left out.
//   scale = the dequantization multiplier (x ~= q * scale):
//           amax == 0 (all zeros, empty, or no finite element): 1;
//           else s = amax / fp8_max (float32 IEEE division, round to nearest
//           even), at least 2^-149 (so it is never 0); with pow2_scales, the
//           smallest power of two >= s (exact, from the bits of s).
//           fp8_max = 448 (e4m3) or 57344 (e5m2).
//   q     = fp8(x / scale): float32 IEEE division, then round to nearest even
//           with saturation: finite values and +-inf beyond +-fp8_max become
//           +-fp8_max; NaN becomes the code 0x7F (a NaN in both formats; sign
//           dropped); results too small keep their sign (+-0).
//   dequantize: out = float(q) * scale computed exactly and rounded once to
//           out's dtype (round to nearest even); a NaN result is written as the
//           dtype's canonical NaN (0x7FFFFFFF / 0x7FFF).
// Blocks at the matrix edge are partial: their amax covers the elements present.
#pragma once

#include <cstdint>

#include "moeflow/tensor.h"

namespace moeflow {

enum class QuantScaling : uint8_t {
  kTensorwise,    // one scale for the whole tensor
  kBlock1x128,    // one scale per 1x128 block of a row of q (activations, gradients)
  kBlock128x128,  // one scale per 128x128 block of q (weights)
};

struct QuantizeConfig {
  DType out = DType::kFloat8E4M3;  // kFloat8E4M3 or kFloat8E5M2
  QuantScaling scaling = QuantScaling::kBlock1x128;
  bool pow2_scales = false;  // scales rounded up to powers of two (UE8M0-style)
  // Quantize x^T: q is [K,M] and every block rule above applies to q's rows
  // (1x128 blocks run along M): exactly the rowwise quantization of x^T. For
  // the backward GEMMs (dgrad/wgrad operands).
  bool columnwise = false;
};

// Shapes (R,C) = (M,K) rowwise, (K,M) columnwise; nb(n) = ceil(n/128).
//   x:         [M,K] float32/float16/bfloat16; rows may be strided (stride(1) == 1).
//   q:         [R,C] config.out; rows may be strided (stride(1) == 1).
//   scales:    float32, contiguous: kTensorwise [1]; kBlock1x128 [R, nb(C)];
//              kBlock128x128 [nb(R), nb(C)].
//   workspace: CUDA kTensorwise only: uint8 of >= quantize_workspace_bytes()
//              bytes on x's device (the per-block amax pass writes it; no zeroing
//              needed). Ignored otherwise.
//   rows_used: optional int32/int64 [1] on x's device, kBlock1x128 rowwise
//              only: only rows [0, min(max(n, 0), M)) are quantized; q's and
//              scales' other rows are left as they are. Read on the device.
// CUDA kTensorwise runs two kernels (amax partials, then quantize); the
// others one kernel. All views on one device.
void quantize(TensorView x, const QuantizeConfig& config, TensorView q, TensorView scales,
              TensorView workspace = {}, TensorView rows_used = {}, cudaStream_t stream = nullptr);

// Both orientations in one read of x, for the backward GEMMs' operands.
// kBlock1x128 (activations): q / scales exactly as quantize(x, config)
// writes them (rowwise) and q_t / scales_t as quantize(x, config with
// columnwise = true) writes them: q_t [K,M] (rows may be strided), scales_t
// [K, nb(M)] float32 with any strides (e.g. the transpose of a contiguous
// [nb(M), K]: the layout grouped_gemm_fp8_wgrad reads fastest). CUDA: one
// kernel for 16-bit x with K % 8 == 0 and 16-byte aligned rows (x, q, q_t),
// else quantize's kernels.
// kBlock128x128 (expert weights): x [M,K] or G matrices [G,M,K], each with
// its own block grid; q [G,M,K] and scales [G, nb(M), nb(K)] as quantize
// writes each matrix, q_t [G,K,M] and scales_t [G, nb(K), nb(M)] as
// quantize(columnwise) writes it: W^T's codes for the dgrad, which are W's
// codes and scale grid transposed (transpose_codes of q and scales, without
// writing q). Scales contiguous; q's and q_t's rows may be strided. CUDA:
// one kernel for x with K % 8 == 0 and 16-byte aligned rows (and q's rows
// 8-byte aligned), else two kernels per matrix.
// q and scales may both be undefined (columnwise only). config.columnwise
// must be false. No sync, graph-capturable.
void quantize_rowwise_columnwise(TensorView x, const QuantizeConfig& config, TensorView q,
                                 TensorView scales, TensorView q_t, TensorView scales_t,
                                 cudaStream_t stream = nullptr);

// The columnwise 1x128 codes of rows held as FP8 codes: q_t / scales_t
// exactly as quantize_rowwise_columnwise(dequantize(q, scales) into
// `dtype`, config, {}, {}, q_t, scales_t) writes them, without the 16-bit
// rows (each value rounded to dtype as dequantize rounds it). q [M,K]
// float8_e4m3 / e5m2 rowwise 1x128 codes (stride(1) == 1), scales [M,
// nb(K)] float32 contiguous, dtype bfloat16 / float16; config and q_t,
// scales_t as quantize_rowwise_columnwise's (kBlock1x128, columnwise
// false). CUDA: one kernel, q read once (128 x 128 tiles where K % 8 == 0,
// q's rows are 8-byte and q_t's 16-byte aligned, else per 1x128 block); no
// sync, graph-capturable.
void requantize_columnwise(TensorView q, TensorView scales, DType dtype,
                           const QuantizeConfig& config, TensorView q_t, TensorView scales_t,
                           cudaStream_t stream = nullptr);

// Workspace bytes quantize needs on CUDA for this shape and config (0 unless
// kTensorwise; at most 4 KiB; 0 in a build without CUDA).
size_t quantize_workspace_bytes(int64_t rows, int64_t cols, const QuantizeConfig& config);

// The inverse: out[m,k] = q[m,k] * scale of its block (columnwise: q[k,m]).
//   q:         [R,C] config.out (as quantize wrote it); stride(1) == 1.
//   scales:    float32, contiguous, the shape quantize uses for q.
//   out:       [M,K] float32/float16/bfloat16 (the layout of quantize's x); stride(1) == 1.
//   rows_used: optional int32/int64 [1] on out's device, rowwise only: only
//              rows [0, min(max(n, 0), M)) are dequantized; out's other rows
//              are left as they are (e.g. the rows of a capacity-sized receive
//              buffer that hold tokens). Read on the device (no sync).
void dequantize(TensorView q, TensorView scales, const QuantizeConfig& config, TensorView out,
                TensorView rows_used = {}, cudaStream_t stream = nullptr);

// Per-matrix transpose of FP8 codes, or of their float32 block scales: q
// [G, R, C] -> q_t [G, C, R], q_t[g][c][r] = q[g][r][c], the values as they
// are. What the dgrad needs from the weights' codes (an FP8 GEMM reads both
// operands K-major): W^T's codes are W's transposed and its 128x128 block
// scales W's scale grid transposed, together exactly quantize(columnwise) of
// each matrix. q and q_t contiguous, not overlapping, the same dtype
// (float8_e4m3 / float8_e5m2 / float32), any R and C; [R, C] is read as G =
// 1. CUDA: one kernel, no sync, graph-capturable.
void transpose_codes(TensorView q, TensorView q_t, cudaStream_t stream = nullptr);

}  // namespace moeflow
