// CUDA FP8 quantization in 128 x 128 blocks (the expert weights; policy:
// moeflow/quantize.h): quantize's kBlock128x128 and
// quantize_rowwise_columnwise's, which writes a weight's codes and W^T's
// codes from one read of the weight.
//   The vector kernel (16-byte rows: x's rows 16-byte aligned, C a multiple
//   of 8): one thread block per 128 x 128 block of a matrix, its values held
//   in registers as loaded (thread t: columns [8 (t % 16), +8) of rows
//   t / 16 + 16 i, i < 8; 16-bit x: 32 registers, three blocks per SM): one
//   read of x, the block's amax from the values' bits, then the codes. Both ways, the
//   codes also go to a 16 KB tile in shared memory (swizzled words), and
//   each thread reads 16 words of one word column (4 W^T rows x 16 codes),
//   transposes them in registers (byte permutes) and stores 16 bytes to
//   each of the 4 rows: a warp writes whole 128-byte spans. W^T's block has
//   W's scale (the same values), so W^T's codes are W's codes transposed,
//   bit for bit.
//   Otherwise (strided columns, odd shapes): one thread block per block of
//   q, amax over the block (shared memory reduction), then a second pass
//   that converts and stores; both ways runs it rowwise and columnwise on
//   each matrix.
// No host sync, no allocation; graph-capturable.
#include "cuda/quantize_blocks.cuh"

namespace moeflow::cuda::qblock {
namespace {

// G matrices [R, C] of x and their codes: q [G][R][C] (or none), W^T's
// codes q_t [G][C][R] (kBoth), scales [G][nbr][nbc] and scales_t
// [G][nbc][nbr] (kBoth; or none), strides in elements.
struct Blocks128 {
  int64_t G, R, C, nbr, nbc;
  int64_t x_gs, x_rs;
  uint8_t* q;
  int64_t q_gs, q_rs;
  float* s;
  uint8_t* qt;
  int64_t qt_gs, qt_rs;
  float* st;
  bool pow2;
  bool vec_t;  // q_t's rows and matrices 16-byte aligned: 16-byte stores
};

// The both-ways tile: 128 rows of 32 words (4 codes each), word w of row r
// stored at w ^ swizzle(r), so that the transposing reads (8 rows 16 apart,
// 4 adjacent words, per warp) and the row writes both hit 32 banks.
__device__ __forceinline__ int tile_word(int r, int w) {
  return r * 32 + (w ^ (((r >> 4) & 7) << 2));
}

// Four words a, b, c, d (rows of 4 codes) transposed: out[i] holds byte i of
// a, b, c, d in that order.
__device__ __forceinline__ void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d,
                                             uint32_t (&out)[4]) {
  const uint32_t t0 = __byte_perm(a, b, 0x5140), t1 = __byte_perm(c, d, 0x5140);
  const uint32_t t2 = __byte_perm(a, b, 0x7362), t3 = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(t0, t1, 0x5410);
  out[1] = __byte_perm(t0, t1, 0x7632);
  out[2] = __byte_perm(t2, t3, 0x5410);
  out[3] = __byte_perm(t2, t3, 0x7632);
}

// A thread's piece of a row: 8 values of x as they were loaded (16-bit:
// one 16-byte vector; float32: two), kept raw until the codes are made so
// that a block of 128 x 128 costs 32 registers a thread (16-bit x).
template <typename T>
struct Piece8 {
  static constexpr int kVecs = 8 * static_cast<int>(sizeof(T)) / 16;
  uint4 r[kVecs];
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) r[i] = reinterpret_cast<const uint4*>(p)[i];
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) r[i] = make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ void values(float (&v)[8]) const {
    const T* e = reinterpret_cast<const T*>(r);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_float(e[j]);
  }
  // The max of |v|'s bits: it orders the finite values (its float is their
  // max) and is kNonFinite or above when an inf or NaN is present.
  static constexpr uint32_t kNonFinite = sizeof(T) == 2 ? kNonFinite16<T> : kFp8NonFinite;
  __device__ __forceinline__ uint32_t max_abs_bits() const {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(r);
    uint32_t m = 0;
    if constexpr (sizeof(T) == 2) {
#pragma unroll
      for (int i = 0; i < 4; ++i) m = __vmaxu2(m, w[i] & 0x7FFF7FFFu);
      return max(m & 0xFFFFu, m >> 16);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) m = max(m, w[i] & 0x7FFFFFFFu);
      return m;
    }
  }
  static __device__ __forceinline__ float float_of(uint32_t bits) {
    if constexpr (sizeof(T) == 2)
      return float_of_bits16<T>(bits);
    else
      return __uint_as_float(bits);
  }
};

template <typename T, bool E4M3, bool kBoth>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 3 : 2)
    quantize_128x128_vec_kernel(const T* x, Blocks128 p) {
  static_assert(kThreads == 256 && kBlock == 128, "thread layout");
  using P = Piece8<T>;
  __shared__ float smem[kWarps];
  __shared__ __align__(16) uint32_t tile[kBoth ? kBlock * 32 : 4];
  const int cc = threadIdx.x % 16, rg = threadIdx.x / 16;
  const int64_t per = p.nbr * p.nbc;
  for (int64_t item = blockIdx.x; item < p.G * per; item += gridDim.x) {
    const int64_t g = item / per, br = item % per / p.nbc, bc = item % p.nbc;
    const T* xg = x + g * p.x_gs;
    const int64_t r0 = br * kBlock + rg, c = bc * kBlock + 8 * cc;
    const bool col_in = c < p.C;
    P piece[8];
    uint32_t mb = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t r = r0 + 16 * i;
      if (col_in && r < p.R)
        piece[i].load(xg + r * p.x_rs + c);
      else
        piece[i].zero();  // 0 leaves the amax as it is
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) mb = max(mb, piece[i].max_abs_bits());
    // The same in every thread. Its barriers also keep this block's tile
    // writes below behind the previous block's tile reads.
    mb = block_max_bits(mb, smem);
    const bool finite = mb < P::kNonFinite;
    float m = P::float_of(mb);
    if (!finite) {  // the amax of the finite values (block-uniform branch)
      m = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float v[8];
        piece[i].values(v);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, finite_abs(v[j]));
      }
      m = block_amax(m, smem);
    }
    const float scale = quant::scale_of(m, E4M3, p.pow2);
    const Fp8Divider div(scale, finite);
    if (threadIdx.x == 0) {
      if (p.s != nullptr) p.s[item] = scale;
      if constexpr (kBoth) p.st[g * per + bc * p.nbr + br] = scale;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t r = r0 + 16 * i;
      float v[8];
      piece[i].values(v);
      uint32_t w[2];
      fp8_codes<E4M3>(v, div, w);
      if (p.q != nullptr && col_in && r < p.R)
        *reinterpret_cast<uint2*>(p.q + g * p.q_gs + r * p.q_rs + c) = make_uint2(w[0], w[1]);
      if constexpr (kBoth)  // words 2 cc, 2 cc + 1 stay adjacent under the swizzle
        *reinterpret_cast<uint2*>(tile + tile_word(rg + 16 * i, 2 * cc)) = make_uint2(w[0], w[1]);
    }
    if constexpr (kBoth) {
      __syncthreads();
      // Lane l of warp k: the tile's word column wc = 4 k + l / 8 (W^T's rows
      // 4 wc ..  + 3 of the block) at W's rows 16 (l % 8) .. + 15 of it: a
      // warp stores 4 W^T rows' whole 128-byte spans per instruction.
      const int lane = threadIdx.x % kWarpSize;
      const int wc = 4 * (threadIdx.x / kWarpSize) + lane / 8, rs = 16 * (lane % 8);
      uint32_t col[4][4];  // [W^T row 4 wc + b][word k]: W's rows rs + 4 k .. + 3
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        uint32_t t[4];
        transpose4x4(tile[tile_word(rs + 4 * k, wc)], tile[tile_word(rs + 4 * k + 1, wc)],
                     tile[tile_word(rs + 4 * k + 2, wc)], tile[tile_word(rs + 4 * k + 3, wc)], t);
#pragma unroll
        for (int b = 0; b < 4; ++b) col[b][k] = t[b];
      }
      const int64_t rb = br * kBlock + rs, left = p.R - rb;
      if (left > 0) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const int64_t ct = bc * kBlock + 4 * wc + b;
          if (ct >= p.C) break;
          uint8_t* out = p.qt + g * p.qt_gs + ct * p.qt_rs + rb;
          if (p.vec_t && left >= 16) {
            *reinterpret_cast<uint4*>(out) = make_uint4(col[b][0], col[b][1], col[b][2], col[b][3]);
          } else {
#pragma unroll
            for (int j = 0; j < 16; ++j)
              if (j < left) out[j] = static_cast<uint8_t>(col[b][j / 4] >> (8 * (j % 4)));
          }
        }
      }
    }
  }
}

template <typename T, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    quantize_128x128_kernel(Src<T> src, Dst dst, int64_t nbr, int64_t nbc) {
  __shared__ float smem[kWarps];
  for (int64_t item = blockIdx.x; item < nbr * nbc; item += gridDim.x) {
    const int64_t r0 = (item / nbc) * kBlock, c0 = (item % nbc) * kBlock;
    const int64_t rows = min(static_cast<int64_t>(kBlock), dst.R - r0);
    const int64_t cols = min(static_cast<int64_t>(kBlock), dst.C - c0);
    float m = 0.0f;
    for (int64_t i = threadIdx.x; i < rows * kBlock; i += kThreads) {
      const int64_t c = i % kBlock;
      if (c < cols) m = quant::amax_join(m, quant::amax_term(src.at(r0 + i / kBlock, c0 + c)));
    }
    const float scale = quant::scale_of(block_amax(m, smem), E4M3, dst.pow2);
    if (threadIdx.x == 0) dst.scales[item] = scale;
    for (int64_t i = threadIdx.x; i < rows * kBlock; i += kThreads) {
      const int64_t r = r0 + i / kBlock, c = i % kBlock;
      if (c < cols)
        dst.q[r * dst.q_stride + c0 + c] = to_fp8<E4M3>(__fdiv_rn(src.at(r, c0 + c), scale));
    }
  }
}

template <typename T, bool E4M3, bool kBoth>
void launch_vec(const TensorView& x, const Blocks128& p, cudaStream_t stream) {
  if (p.G * p.nbr * p.nbc == 0) return;
  quantize_128x128_vec_kernel<T, E4M3, kBoth>
      <<<capped_grid(p.G * p.nbr * p.nbc, 1), kThreads, 0, stream>>>(static_cast<const T*>(x.data),
                                                                     p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

// x's rows (and matrices) 16-byte aligned, C a multiple of 8.
bool vec_rows(const TensorView& x, int64_t row_stride, int64_t matrix_stride, int64_t C) {
  const int64_t e = dtype_size(x.dtype);
  return C % 8 == 0 && aligned16(x.data) && (row_stride * e) % 16 == 0 &&
         (matrix_stride * e) % 16 == 0;
}

}  // namespace

void quantize_128x128(const TensorView& x, const QuantizeConfig& config, const Dst& dst,
                      int64_t nbr, int64_t nbc, cudaStream_t stream) {
  if (nbr * nbc == 0) return;
  with_float_type(x.dtype, [&](auto t) {
    using T = decltype(t);
    with_fp8_format(config.out == DType::kFloat8E4M3, [&](auto fmt) {
      constexpr bool E4M3 = decltype(fmt)::value;
      if (!config.columnwise && vec_rows(x, x.strides[0], 0, dst.C) &&
          reinterpret_cast<uintptr_t>(dst.q) % 8 == 0 && dst.q_stride % 8 == 0) {
        const Blocks128 p{1,       dst.R,    dst.C,        nbr,        nbc,     0, x.strides[0],
                          dst.q,   0,        dst.q_stride, dst.scales, nullptr, 0, 0,
                          nullptr, dst.pow2, false};
        launch_vec<T, E4M3, false>(x, p, stream);
        return;
      }
      const int64_t xr = config.columnwise ? 1 : x.strides[0];
      const int64_t xc = config.columnwise ? x.strides[0] : 1;
      quantize_128x128_kernel<T, E4M3><<<capped_grid(nbr * nbc, 1), kThreads, 0, stream>>>(
          Src<T>{static_cast<const T*>(x.data), xr, xc}, dst, nbr, nbc);
      MOEFLOW_CUDA_LAUNCH_CHECK();
    });
  });
}

void quantize_128x128_both_ways(const TensorView& x, const QuantizeConfig& config,
                                const TensorView& q, const TensorView& scales,
                                const TensorView& q_t, const TensorView& scales_t,
                                cudaStream_t stream) {
  const bool grouped = x.ndim == 3;
  const int64_t G = grouped ? x.shape[0] : 1;
  const int64_t R = x.shape[x.ndim - 2], C = x.shape[x.ndim - 1];
  const int64_t nbr = ceil_div(R, int64_t{kBlock}), nbc = ceil_div(C, int64_t{kBlock});
  if (G * R * C == 0) return;
  const int64_t x_rs = x.strides[x.ndim - 2], x_gs = grouped ? x.strides[0] : 0;
  auto* qp = static_cast<uint8_t*>(q.data);
  const int64_t q_rs = qp ? q.strides[q.ndim - 2] : 0, q_gs = qp && grouped ? q.strides[0] : 0;
  auto* qt = static_cast<uint8_t*>(q_t.data);
  const int64_t qt_rs = q_t.strides[q_t.ndim - 2], qt_gs = grouped ? q_t.strides[0] : 0;
  auto* s = static_cast<float*>(scales.data);
  auto* st = static_cast<float*>(scales_t.data);
  const bool vec = vec_rows(x, x_rs, x_gs, C) &&
                   (qp == nullptr ||
                    (reinterpret_cast<uintptr_t>(qp) % 8 == 0 && q_rs % 8 == 0 && q_gs % 8 == 0));
  with_float_type(x.dtype, [&](auto t) {
    using T = decltype(t);
    with_fp8_format(config.out == DType::kFloat8E4M3, [&](auto fmt) {
      constexpr bool E4M3 = decltype(fmt)::value;
      if (vec) {
        const bool vec_t = aligned16(qt) && qt_rs % 16 == 0 && qt_gs % 16 == 0;
        const Blocks128 p{G,    R,    C, nbr, nbc,   x_gs,  x_rs, qp,
                          q_gs, q_rs, s, qt,  qt_gs, qt_rs, st,   config.pow2_scales,
                          vec_t};
        launch_vec<T, E4M3, true>(x, p, stream);
        return;
      }
      // Each matrix rowwise, then columnwise (W^T's codes and scale grid).
      for (int64_t g = 0; g < G; ++g) {
        const T* xg = static_cast<const T*>(x.data) + g * x_gs;
        if (qp != nullptr) {
          const Dst d{qp + g * q_gs, q_rs, R, C, s + g * nbr * nbc, config.pow2_scales};
          quantize_128x128_kernel<T, E4M3><<<capped_grid(nbr * nbc, 1), kThreads, 0, stream>>>(
              Src<T>{xg, x_rs, 1}, d, nbr, nbc);
          MOEFLOW_CUDA_LAUNCH_CHECK();
        }
        const Dst d{qt + g * qt_gs, qt_rs, C, R, st + g * nbr * nbc, config.pow2_scales};
        quantize_128x128_kernel<T, E4M3>
            <<<capped_grid(nbr * nbc, 1), kThreads, 0, stream>>>(Src<T>{xg, 1, x_rs}, d, nbc, nbr);
        MOEFLOW_CUDA_LAUNCH_CHECK();
      }
    });
  });
}

}  // namespace moeflow::cuda::qblock
