// CUDA FP8 quantize and quantize_rowwise_columnwise (policy:
// moeflow/quantize.h; shared scalar math: core/quantize_backend.h;
// dequantize and transpose_codes: fp8_codes.cu; the 128x128 blocks of
// weights: quantize_weights.cu).
// Rowwise 1x128 with 16-byte rows (x's and q's rows 16-byte aligned, C a
// multiple of 16; the layout of activations), the vector kernel: one warp
// per 512-column chunk of a row, 16 columns a lane (16-byte loads and
// stores), 8 lanes per block.
// Otherwise (columnwise, strided or odd shapes), simple kernels:
//   kBlock1x128:   one warp per 1x128 block of q (4 elements a lane), warp
//                  shuffle amax, then convert and store.
//   kTensorwise:   kernel 1 writes per-block amax partials into the
//                  workspace; kernel 2 reduces them (every block, in the same
//                  way), writes the scale and converts. No atomics, no memset.
// permute_quantize's columnwise form (declared in
// core/permute_quantize_backend.h) runs the 1x128 tile kernel below with
// its rows gathered from the tokens through plan.row_token, or the simple
// 1x128 kernel on a gathered source; requantize_columnwise the same kernels
// with the rows dequantized from FP8 codes as they are loaded.
// Everything works in q coordinates (columnwise reads x through swapped
// strides). x / scale is __fdiv_rn's quotient (the vector and tile kernels
// get it from Fp8Divider, fp8.cuh), the conversion cvt.rn.satfinite, NaN is
// mapped to 0x7F explicitly. No host sync, no allocation; graph-capturable.
#include <cuda_fp8.h>

#include <algorithm>

#include "core/permute_quantize_backend.h"
#include "core/quantize_backend.h"
#include "cuda/common.cuh"
#include "cuda/fp8.cuh"
#include "cuda/quantize_blocks.cuh"

namespace moeflow::cuda {
namespace {

using namespace qblock;

constexpr int64_t kMaxPartials = 1024;
constexpr int64_t kElemsPerPartial = 2048;

int64_t num_partials(int64_t n) {
  return std::min(kMaxPartials, std::max<int64_t>(1, ceil_div(n, kElemsPerPartial)));
}

// permute_quantize's columnwise form, per element: q(r,c) = rows[c][r], rows
// = x gathered by row_token, zero where a row holds no slot or c >= total
// rows; the 1x128 blocks starting at or past total_rows are skipped.
template <typename T>
struct PermutedColumns {
  const T* x;
  int64_t x_stride;
  const int32_t* row_token;
  const int64_t* total_rows;
  int64_t total;  // *total_rows, read by prepare()
  __device__ __forceinline__ void prepare() { total = *total_rows; }
  __device__ __forceinline__ bool skip(int64_t c0) const { return c0 >= total; }
  __device__ __forceinline__ float at(int64_t r, int64_t c) const {
    const int32_t t = c < total ? row_token[c] : -1;
    return t < 0 ? 0.0f : to_float(x[t * x_stride + r]);
  }
};

// FP8 rows with 1x128 rowwise scales, read as the 16-bit T values
// dequantize makes of them: code times its block's scale, rounded once
// (requantize_columnwise's source).
struct Codes {
  const uint8_t* q = nullptr;
  int64_t q_stride = 0;
  const float* scales = nullptr;  // [M, nb]
  int64_t nb = 0;
  bool e4m3 = true;
  // row m's block k / 128 scale
  __device__ __forceinline__ double scale(int64_t m, int64_t k) const {
    return scales[m * nb + k / kBlock];
  }
  // a code of a block whose scale is s
  template <typename T>
  __device__ __forceinline__ T value(uint8_t code, double s) const {
    return dequant_round16<T>(static_cast<double>(quant::fp8_value(code, e4m3)) * s);
  }
  template <typename T>
  __device__ __forceinline__ T at(int64_t m, int64_t k) const {
    return value<T>(q[m * q_stride + k], scale(m, k));
  }
};

// requantize_columnwise, per element: q(r,c) = rows[c][r] of the codes'
// rows (the per-block path, where the tile kernel cannot load 8 codes).
template <typename T>
struct CodesColumns {
  Codes codes;
  __device__ __forceinline__ void prepare() {}
  __device__ __forceinline__ bool skip(int64_t /*c0*/) const { return false; }
  __device__ __forceinline__ float at(int64_t r, int64_t c) const {
    return to_float(codes.at<T>(c, r));
  }
};

template <typename S, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    quantize_1x128_kernel(S src, Dst dst, int64_t nb, int64_t ss0, int64_t ss1) {
  constexpr int kPerLane = kBlock / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t items = dst.rows() * nb;
  src.prepare();
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
       item < items; item += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t r = item / nb, c0 = (item % nb) * kBlock;
    if (src.skip(c0)) continue;  // (warp-uniform)
    float v[kPerLane];
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t c = c0 + j * kWarpSize + lane;
      v[j] = c < dst.C ? src.at(r, c) : 0.0f;
      m = quant::amax_join(m, quant::amax_term(v[j]));
    }
    const float scale = quant::scale_of(warp_amax(m), E4M3, dst.pow2);
    if (lane == 0) dst.scales[r * ss0 + (item % nb) * ss1] = scale;
    uint8_t* qrow = dst.q + r * dst.q_stride;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t c = c0 + j * kWarpSize + lane;
      if (c < dst.C) qrow[c] = to_fp8<E4M3>(__fdiv_rn(v[j], scale));
    }
  }
}

// kBlock1x128, rowwise, 16-byte rows: warp w handles the 512-column chunk
// `item % chunks` of row `item / chunks` (fp8.cuh's lane layout).
template <typename T, bool E4M3>
__global__ void __launch_bounds__(kThreads, 6)
    quantize_1x128_vec_kernel(const T* x, int64_t x_stride, Dst dst, int64_t nb, int64_t chunks) {
  constexpr int64_t kChunk = int64_t{kFp8PerLane} * kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t items = dst.rows() * chunks;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
       item < items; item += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t r = item / chunks, cl = (item % chunks) * kChunk + int64_t{lane} * kFp8PerLane;
    float v[kFp8PerLane];
    load_chunk<T, true>(x + r * x_stride, cl, dst.C, v);  // 0 past C: the amax is unchanged
    uint32_t w[kFp8PerLane / 4];
    const float scale = quantize_chunk<E4M3>(v, dst.pow2, w);
    store_codes<true>(dst.q + r * dst.q_stride, cl, dst.C, w);
    if (cl < dst.C && lane % kFp8LanesPerBlock == 0) dst.scales[r * nb + cl / kBlock] = scale;
  }
}

// kBlock1x128 of 16-bit x, rowwise and/or columnwise, through a 128 x 128
// tile of x in shared memory (x read once for both outputs). Tile loads:
// 16-byte pieces, zeros outside x. Rowwise (row.q set): thread t reads row
// t / 2, 8-column pieces 2 s + t % 2 (s < 8), twice (amax, then codes), the
// pair's amax joined by a shuffle; after each two pieces the pair swaps one
// piece's codes so that each thread stores 16 consecutive codes (the pair
// one whole 32-byte sector). Columnwise: thread t reads column t / 2 at rows
// t % 2 + 2 j (j < 64), twice; the pair swaps half of its codes so that
// thread h holds rows 32 m + 16 h .. + 15 (m < 4) of q_t's row: again a
// 32-byte sector per pair and store. The tile's row pitch (kTilePitch) puts
// consecutive rows 8 banks apart: both read patterns are free of bank
// conflicts.
constexpr int kTile = 128;
constexpr int kTilePitch = kTile + 16;

struct DstCol {  // the columnwise output: q_t [C, R] and scales_t[c * s0 + block * s1]
  uint8_t* q;
  int64_t q_stride;
  float* scales;
  int64_t s0, s1;
};

// Row m of x as the tile kernel reads it: x's row m, or with row_token set
// (permute_quantize's columnwise form) x's row row_token[m], a zero row
// where that is -1 or m >= *total_rows; tiles starting at or past
// *total_rows are skipped.
struct Gather {
  const int32_t* row_token;
  const int64_t* total_rows;
};

template <typename T, bool E4M3>
__global__ void __launch_bounds__(kThreads, 4)
    quantize_1x128_tile_kernel(const T* x, int64_t x_stride, int64_t M, int64_t K, Dst row,
                               DstCol col, Gather gather, Codes codes) {
  static_assert(sizeof(T) == 2 && kThreads == 2 * kTile, "thread layout");
  constexpr int kVec = 8;  // elements per 16-byte piece
  __shared__ __align__(16) T tile[kTile * kTilePitch];
  __shared__ int64_t src_row[kTile];
  const int t = threadIdx.x, half = t % 2, tr = t / 2;
  const int64_t tiles_k = (K + kTile - 1) / kTile;
  const int64_t tiles = (M + kTile - 1) / kTile * tiles_k;
  const int64_t nbk = tiles_k;
  const int64_t rows = gather.row_token != nullptr ? min(M, *gather.total_rows) : M;
  for (int64_t item = blockIdx.x; item < tiles; item += gridDim.x) {
    const int64_t m0 = (item / tiles_k) * kTile, k0 = (item % tiles_k) * kTile;
    if (m0 >= rows) continue;  // (only with gather: block-uniform)
    __syncthreads();  // the previous tile is read
    if (t < kTile) {
      const int64_t m = m0 + t;
      src_row[t] = m >= rows ? -1 : gather.row_token == nullptr ? m : int64_t{gather.row_token[m]};
    }
    __syncthreads();
    for (int p = t; p < kTile * kTile / kVec; p += kThreads) {
      const int r = p / (kTile / kVec), c = (p % (kTile / kVec)) * kVec;
      uint4 v = make_uint4(0, 0, 0, 0);
      const int64_t sr = src_row[r];
      if (sr >= 0 && k0 + c < K) {
        if (codes.q == nullptr) {
          v = *reinterpret_cast<const uint4*>(x + sr * x_stride + k0 + c);
        } else {  // 8 codes and their block's scale
          const uint2 b = *reinterpret_cast<const uint2*>(codes.q + sr * codes.q_stride + k0 + c);
          const double s = codes.scale(sr, k0 + c);
          uint32_t w[kVec / 2];
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const auto code = static_cast<uint8_t>((j < 4 ? b.x : b.y) >> (8 * (j % 4)));
            const T e = codes.value<T>(code, s);
            const uint32_t bits = reinterpret_cast<const uint16_t&>(e);
            w[j / 2] = j % 2 == 0 ? bits : w[j / 2] | bits << 16;
          }
          v = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
      *reinterpret_cast<uint4*>(tile + r * kTilePitch + c) = v;
    }
    __syncthreads();
    if (row.q != nullptr) {  // row tr, pieces 2 s + half
      const T* src = tile + tr * kTilePitch + half * kVec;
      uint32_t mb = 0;
#pragma unroll
      for (int s = 0; s < 8; ++s) mb = max(mb, max_abs_bits8(src + 2 * s * kVec));
      mb = max(mb, __shfl_xor_sync(0xFFFFFFFFu, mb, 1));
      const bool finite = mb < kNonFinite16<T>;
      float m = float_of_bits16<T>(mb);
      if (!__all_sync(0xFFFFFFFFu, finite)) {  // the amax of the finite values
        m = 0.0f;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          float v[8];
          load8(src + 2 * s * kVec, v);
#pragma unroll
          for (int j = 0; j < 8; ++j) m = fmaxf(m, finite_abs(v[j]));
        }
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
      }
      const float scale = quant::scale_of(m, E4M3, row.pow2);
      const Fp8Divider div(scale, finite);
      const int64_t r = m0 + tr;
      if (half == 0 && r < M) row.scales[r * nbk + k0 / kTile] = scale;
      uint8_t* qrow = row.q + r * row.q_stride + k0;
#pragma unroll
      for (int s = 0; s < 8; s += 2) {  // pieces 2 s + half and 2 s + 2 + half
        float v[8];
        uint32_t a[2], b[2];
        load8(src + 2 * s * kVec, v);
        fp8_codes<E4M3>(v, div, a);
        load8(src + 2 * (s + 1) * kVec, v);
        fp8_codes<E4M3>(v, div, b);
        // thread 0 keeps pieces 2 s, 2 s + 1; thread 1 pieces 2 s + 2, 2 s + 3
        const uint32_t g0 = __shfl_xor_sync(0xFFFFFFFFu, half == 0 ? b[0] : a[0], 1);
        const uint32_t g1 = __shfl_xor_sync(0xFFFFFFFFu, half == 0 ? b[1] : a[1], 1);
        const uint4 codes =
            half == 0 ? make_uint4(a[0], a[1], g0, g1) : make_uint4(g0, g1, b[0], b[1]);
        const int64_t c = (2 * s + 2 * half) * kVec;  // the first of the 16 columns
        if (r < M && k0 + c < K) {
          if (k0 + c + 2 * kVec <= K)
            *reinterpret_cast<uint4*>(qrow + c) = codes;
          else  // K % 8 == 0: the first piece is in, the second is not
            *reinterpret_cast<uint2*>(qrow + c) = make_uint2(codes.x, codes.y);
        }
      }
    }
    {  // column tr, rows half + 2 j
      const T* src = tile + half * kTilePitch + tr;
      const volatile uint16_t* bits = reinterpret_cast<const volatile uint16_t*>(src);
      uint32_t mb = 0;
#pragma unroll 16
      for (int j = 0; j < kTile / 2; ++j) mb = max(mb, bits[2 * j * kTilePitch] & 0x7FFFu);
      mb = max(mb, __shfl_xor_sync(0xFFFFFFFFu, mb, 1));
      const bool finite = mb < kNonFinite16<T>;
      float m = float_of_bits16<T>(mb);
      if (!__all_sync(0xFFFFFFFFu, finite)) {  // the amax of the finite values
        m = 0.0f;
#pragma unroll 16
        for (int j = 0; j < kTile / 2; ++j)
          m = fmaxf(m, finite_abs(to_float(src[2 * j * kTilePitch])));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
      }
      const float scale = quant::scale_of(m, E4M3, row.pow2);
      const Fp8Divider div(scale, finite);
      uint32_t w[16];  // codes of rows half + 2 j, four per word
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = to_float(src[2 * (4 * i + j) * kTilePitch]);
        uint32_t wi[1];
        fp8_codes<E4M3>(v, div, wi);
        w[i] = wi[0];
      }
      // w[i]: rows 8 i + half + {0, 2, 4, 6}. Thread h keeps the 8-row
      // slots 4 m + 2 h, 4 m + 2 h + 1 (m < 4): rows 32 m + 16 h .. + 15. It
      // gives its rows of the partner's slots and takes the partner's of its
      // own, so that after the swap w[lo(n)] holds a slot's even rows and
      // w[hi(n)] its odd rows, for both threads.
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int lo = (n / 2) * 4 + n % 2, hi = lo + 2;  // thread 0's slot, thread 1's
        const uint32_t got = __shfl_xor_sync(0xFFFFFFFFu, half == 0 ? w[hi] : w[lo], 1);
        if (half == 0)
          w[hi] = got;  // the odd rows of slot lo
        else
          w[lo] = got;  // the even rows of slot hi
      }
      uint32_t out[16];  // rows 32 m + 16 h + 4 k' .. + 3 in out[4 m + k']
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int lo = (n / 2) * 4 + n % 2, hi = lo + 2;
        out[2 * n] = __byte_perm(w[lo], w[hi], 0x5140);
        out[2 * n + 1] = __byte_perm(w[lo], w[hi], 0x7362);
      }
      const int64_t c = k0 + tr;
      if (c < K) {
        if (half == 0) col.scales[c * col.s0 + (m0 / kTile) * col.s1] = scale;
        uint8_t* dst = col.q + c * col.q_stride + m0;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int64_t rr = 32 * m + 16 * half;
          if (m0 + rr + 16 <= M) {
            *reinterpret_cast<uint4*>(dst + rr) =
                make_uint4(out[4 * m], out[4 * m + 1], out[4 * m + 2], out[4 * m + 3]);
          } else {
#pragma unroll
            for (int k = 0; k < 16; ++k)
              if (m0 + rr + k < M)
                dst[rr + k] = static_cast<uint8_t>(out[4 * m + k / 4] >> (8 * (k % 4)));
          }
        }
      }
    }
  }
}

// Kernel 1 of kTensorwise: partials[b] = amax of the elements block b visits.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    amax_partials_kernel(Src<T> src, int64_t R, int64_t C, float* partials) {
  __shared__ float smem[kWarps];
  float m = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < R * C;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    m = quant::amax_join(m, quant::amax_term(src.at(i / C, i % C)));
  m = block_amax(m, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

// Kernel 2 of kTensorwise: amax of the partials, the scale, the conversion.
template <typename T, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    quantize_tensorwise_kernel(Src<T> src, Dst dst, const float* partials, int64_t num_partials) {
  __shared__ float smem[kWarps];
  float m = 0.0f;
  for (int64_t i = threadIdx.x; i < num_partials; i += kThreads)
    m = quant::amax_join(m, partials[i]);
  const float scale = quant::scale_of(block_amax(m, smem), E4M3, dst.pow2);
  if (blockIdx.x == 0 && threadIdx.x == 0) dst.scales[0] = scale;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < dst.R * dst.C;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / dst.C, c = i % dst.C;
    dst.q[r * dst.q_stride + c] = to_fp8<E4M3>(__fdiv_rn(src.at(r, c), scale));
  }
}

// The tile kernel's conditions (16-bit x is the caller's): K % 8 == 0, the
// rows of x and of both outputs 16-byte aligned (q: optional).
bool tile_ok(const TensorView& x, const TensorView& q, const TensorView& q_t) {
  const int64_t K = x.shape[1];
  bool ok = K % 8 == 0 && aligned16(x.data) && (x.strides[0] * 2) % 16 == 0 &&
            aligned16(q_t.data) && q_t.strides[0] % 16 == 0;
  if (q.data != nullptr) ok = ok && aligned16(q.data) && q.strides[0] % 16 == 0;
  return ok;
}

// M: x's rows, or with gather the rows of the permuted buffer.
template <typename T, bool E4M3>
void launch_tile(const TensorView& x, int64_t M, const Dst& row, const DstCol& col,
                 const Gather& gather, cudaStream_t stream, const Codes& codes = {}) {
  const int64_t K = x.shape[1];
  const int64_t tiles = ceil_div(M, int64_t{kTile}) * ceil_div(K, int64_t{kTile});
  if (tiles == 0) return;
  quantize_1x128_tile_kernel<T, E4M3><<<capped_grid(tiles, 1), kThreads, 0, stream>>>(
      static_cast<const T*>(x.data), x.strides[0], M, K, row, col, gather, codes);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace

size_t quantize_workspace_bytes(int64_t rows, int64_t cols, const QuantizeConfig& config) {
  if (config.scaling != QuantScaling::kTensorwise) return 0;
  return static_cast<size_t>(num_partials(rows * cols)) * sizeof(float);
}

void quantize(TensorView x, const QuantizeConfig& config, TensorView q, TensorView scales,
              TensorView workspace, TensorView rows_used, cudaStream_t stream) {
  const int64_t R = q.shape[0], C = q.shape[1];
  const int64_t xr = config.columnwise ? 1 : x.strides[0];
  const int64_t xc = config.columnwise ? x.strides[0] : 1;
  Dst dst{static_cast<uint8_t*>(q.data),
          q.strides[0],
          R,
          C,
          static_cast<float*>(scales.data),
          config.pow2_scales,
          rows_used.data,
          rows_used.dtype == DType::kInt64};
  with_float_type(x.dtype, [&](auto t) {
    using T = decltype(t);
    const Src<T> src{static_cast<const T*>(x.data), xr, xc};
    // The vector kernels: rowwise, x's and q's rows 16-byte aligned.
    const bool vec = !config.columnwise && aligned16(x.data) && aligned16(q.data) &&
                     (x.strides[0] * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                     q.strides[0] % 16 == 0;
    with_fp8_format(config.out == DType::kFloat8E4M3, [&](auto fmt) {
      constexpr bool E4M3 = decltype(fmt)::value;
      switch (config.scaling) {
        case QuantScaling::kTensorwise: {
          const int64_t np = num_partials(R * C);
          auto* partials = static_cast<float*>(workspace.data);
          amax_partials_kernel<T>
              <<<static_cast<int>(np), kThreads, 0, stream>>>(src, R, C, partials);
          MOEFLOW_CUDA_LAUNCH_CHECK();
          quantize_tensorwise_kernel<T, E4M3>
              <<<capped_grid(R * C, kThreads * 4), kThreads, 0, stream>>>(src, dst, partials, np);
          MOEFLOW_CUDA_LAUNCH_CHECK();
          return;
        }
        case QuantScaling::kBlock1x128: {
          const int64_t nb = scales.shape[1];
          if (R * nb == 0) return;
          if (vec && C % 16 == 0) {
            const int64_t chunks = ceil_div(C, int64_t{kFp8PerLane} * kWarpSize);
            quantize_1x128_vec_kernel<T, E4M3>
                <<<capped_grid(R * chunks, kWarps), kThreads, 0, stream>>>(src.x, x.strides[0], dst,
                                                                           nb, chunks);
            MOEFLOW_CUDA_LAUNCH_CHECK();
            return;
          }
          if constexpr (sizeof(T) == 2) {
            if (config.columnwise && tile_ok(x, TensorView{}, q)) {
              const DstCol col{dst.q, dst.q_stride, dst.scales, nb, 1};
              launch_tile<T, E4M3>(x, x.shape[0],
                                   Dst{nullptr, 0, 0, 0, nullptr, config.pow2_scales}, col,
                                   Gather{}, stream);
              return;
            }
          }
          quantize_1x128_kernel<Src<T>, E4M3>
              <<<capped_grid(R * nb, kWarps), kThreads, 0, stream>>>(src, dst, nb, nb, 1);
          MOEFLOW_CUDA_LAUNCH_CHECK();
          return;
        }
        case QuantScaling::kBlock128x128:
          quantize_128x128(x, config, dst, scales.shape[0], scales.shape[1], stream);
          return;
      }
    });
  });
}

void quantize_rowwise_columnwise(TensorView x, const QuantizeConfig& config, TensorView q,
                                 TensorView scales, TensorView q_t, TensorView scales_t,
                                 cudaStream_t stream) {
  if (config.scaling == QuantScaling::kBlock128x128)
    return quantize_128x128_both_ways(x, config, q, scales, q_t, scales_t, stream);
  const int64_t M = x.shape[0], K = x.shape[1];
  if (M * K == 0) return;
  const DstCol col{static_cast<uint8_t*>(q_t.data), q_t.strides[0],
                   static_cast<float*>(scales_t.data), scales_t.strides[0], scales_t.strides[1]};
  with_float_type(x.dtype, [&](auto t) {
    using T = decltype(t);
    with_fp8_format(config.out == DType::kFloat8E4M3, [&](auto fmt) {
      constexpr bool E4M3 = decltype(fmt)::value;
      if constexpr (sizeof(T) == 2) {
        if (tile_ok(x, q, q_t)) {
          const Dst row{static_cast<uint8_t*>(q.data),    q.data ? q.strides[0] : 0, M, K,
                        static_cast<float*>(scales.data), config.pow2_scales};
          launch_tile<T, E4M3>(x, M, row, col, Gather{}, stream);
          return;
        }
      }
      if (q.data != nullptr)
        cuda::quantize(x, config, q, scales, TensorView{}, TensorView{}, stream);
      const Src<T> src{static_cast<const T*>(x.data), 1, x.strides[0]};
      const Dst dst{col.q, col.q_stride, K, M, col.scales, config.pow2_scales};
      const int64_t nb = ceil_div(M, int64_t{kBlock});
      quantize_1x128_kernel<Src<T>, E4M3>
          <<<capped_grid(K * nb, kWarps), kThreads, 0, stream>>>(src, dst, nb, col.s0, col.s1);
      MOEFLOW_CUDA_LAUNCH_CHECK();
    });
  });
}

void requantize_columnwise(TensorView q, TensorView scales, DType dtype,
                           const QuantizeConfig& config, TensorView q_t, TensorView scales_t,
                           cudaStream_t stream) {
  const int64_t M = q.shape[0], K = q.shape[1];
  if (M * K == 0) return;
  const DstCol col{static_cast<uint8_t*>(q_t.data), q_t.strides[0],
                   static_cast<float*>(scales_t.data), scales_t.strides[0], scales_t.strides[1]};
  const Codes codes{static_cast<const uint8_t*>(q.data), q.strides[0],
                    static_cast<const float*>(scales.data), scales.shape[1],
                    q.dtype == DType::kFloat8E4M3};
  const TensorView shape(nullptr, dtype, q.device, {M, K});  // (x: not read)
  // the tile kernel: 8 codes per load, q_t's rows 16-byte aligned
  const bool tile = K % 8 == 0 && reinterpret_cast<uintptr_t>(q.data) % 8 == 0 &&
                    (M <= 1 || q.strides[0] % 8 == 0) && aligned16(q_t.data) &&
                    q_t.strides[0] % 16 == 0;
  with_float_type(dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (sizeof(T) == 2) {
      with_fp8_format(config.out == DType::kFloat8E4M3, [&](auto fmt) {
        constexpr bool E4M3 = decltype(fmt)::value;
        if (tile) {
          launch_tile<T, E4M3>(shape, M, Dst{nullptr, 0, 0, 0, nullptr, config.pow2_scales}, col,
                               Gather{}, stream, codes);
          return;
        }
        const CodesColumns<T> src{codes};
        const Dst dst{col.q, col.q_stride, K, M, col.scales, config.pow2_scales};
        const int64_t nb = ceil_div(M, int64_t{kBlock});
        quantize_1x128_kernel<CodesColumns<T>, E4M3>
            <<<capped_grid(K * nb, kWarps), kThreads, 0, stream>>>(src, dst, nb, col.s0, col.s1);
        MOEFLOW_CUDA_LAUNCH_CHECK();
      });
    }
  });
}

void permute_quantize_columnwise(TensorView x, const RoutingPlan& plan, TensorView y,
                                 TensorView y_scales, const QuantizeConfig& config,
                                 cudaStream_t stream) {
  const int64_t M = plan.capacity_rows, K = x.shape[1];
  if (M * K == 0) return;
  const Gather gather{plan.row_token.data_ptr<int32_t>(), plan.total_rows.data_ptr<int64_t>()};
  const DstCol col{static_cast<uint8_t*>(y.data), y.strides[0], static_cast<float*>(y_scales.data),
                   y_scales.strides[0], y_scales.strides[1]};
  with_float_type(x.dtype, [&](auto t) {
    using T = decltype(t);
    with_fp8_format(config.out == DType::kFloat8E4M3, [&](auto fmt) {
      constexpr bool E4M3 = decltype(fmt)::value;
      if constexpr (sizeof(T) == 2) {
        if (tile_ok(x, TensorView{}, y)) {
          launch_tile<T, E4M3>(x, M, Dst{nullptr, 0, 0, 0, nullptr, config.pow2_scales}, col,
                               gather, stream);
          return;
        }
      }
      const PermutedColumns<T> src{static_cast<const T*>(x.data), x.strides[0], gather.row_token,
                                   gather.total_rows, 0};
      const Dst dst{col.q, col.q_stride, K, M, col.scales, config.pow2_scales};
      const int64_t nb = ceil_div(M, int64_t{kBlock});
      quantize_1x128_kernel<PermutedColumns<T>, E4M3>
          <<<capped_grid(K * nb, kWarps), kThreads, 0, stream>>>(src, dst, nb, col.s0, col.s1);
      MOEFLOW_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace moeflow::cuda
