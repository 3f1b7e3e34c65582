// The grouped GEMM forward on Hopper with TMA and warp specialisation
// (sm_90a): the fastest path, taken when the weights are one stacked tensor.
//
// Algorithm: the persistent tile walk of grouped_gemm.cuh (device offsets,
// block scan of tile counts, binary search per tile) with 128 x 256 tiles and
// three warpgroups. Warpgroup 0 (one thread) is the producer: for every
// 64-wide K slice it waits for a free stage, arms the stage's "full"
// mbarrier with the byte count and issues two TMA loads (A rows of the tile,
// the 256 weight rows of the group) into the 128-byte swizzled layout wgmma
// reads. Warpgroups 1 and 2 consume: each owns 64 x 256 of the tile, waits
// for "full", issues wgmma.m64n256k16 from shared-memory descriptors, keeps
// one wgmma group in flight and frees the stage of the previous group through
// its "empty" mbarrier. The producer runs ahead into the next tile while the
// consumers store the previous one straight from registers.
//
// Rows the TMA box reads past a group's rows belong to the next group (or
// are zero past the matrix); they only feed output rows that are stored as
// zeros (pad rows) or not at all, so they never reach a result.
#pragma once

#include <cuda.h>

#include "cuda/grouped_gemm_sm90.cuh"

namespace moeflow::cuda::gemm::sm90tma {

constexpr int kTileM = 128;
constexpr int kTileN = 256;
constexpr int kTileK = 64;
constexpr int kStages = 4;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kStageBytesA = kTileM * kTileK * 2;
constexpr int kStageBytesB = kTileN * kTileK * 2;
constexpr int kStageBytes = kStageBytesA + kStageBytesB;

struct Smem {
  // stages (1024-aligned) | full[kStages] | empty[kStages] | tile_start[E+1]
  static constexpr size_t kPipelineBytes = size_t{kStages} * kStageBytes;
  static size_t bytes(int num_groups) {
    return 1024 + kPipelineBytes + 2 * kStages * 8 + size_t(num_groups + 1) * 4;
  }
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                            int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Descriptor of an MN-major operand slice: 64-element (128-byte) swizzled rows
// along M/N, 8-row groups along K 1024 bytes apart (SBO), 64-column blocks
// 8 KB apart (LBO). (Checked on an H200: the swapped convention fails.)
__device__ __forceinline__ uint64_t smem_desc_mn(const void* p) {
  const uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return ((addr & 0x3FFFF) >> 4) | (uint64_t{8192 >> 4} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// Zeroes reduction rows [from, 64) of `blocks` consecutive 64 x 64 MN-major
// blocks (8 KB each) of a slice; whole 128-byte rows, so the swizzle does not
// matter. Run by the 256 consumer threads.
__device__ __forceinline__ void zero_slice_rows(uint8_t* base, int blocks, int from, int tid) {
  const int rows = 64 - from;
  for (int i = tid; i < blocks * rows * 8; i += 256) {
    const int blk = i / (rows * 8), r = from + (i / 8) % rows, chunk = i % 8;
    *reinterpret_cast<uint4*>(base + blk * 8192 + r * 128 + chunk * 16) = make_uint4(0, 0, 0, 0);
  }
}

// MODE 0, forward: A [rows,K] and W_e [N,K] K-major.
// MODE 1, dgrad: A = dC [rows,N] K-major; B = W_e read MN-major (its rows are
//   the reduction), four 64 x 64 boxes per slice.
// MODE 2, wgrad: groups split the reduction rows; A = dC^T and B = A read
//   MN-major from row boxes; the slice holding the group's last rows has the
//   rows past them zeroed in shared memory (they belong to pad rows or the next
//   group); the output is each group's float32 dW, stored or accumulated.
template <typename TIn, typename TOut, int MODE>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_tma_kernel(Params p, const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_w) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Smem::kPipelineBytes);
  uint64_t* empty = full + kStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kStages);

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);   // the producer's arrive (+ the TMA bytes)
      mbar_init(&empty[s], 2);  // one arrive per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  build_tile_prefix<kTileM, kTileN, kThreads>(p, tile_start);  // ends with a barrier
  const int32_t num_tiles = tile_start[p.num_groups];
  const int wg = threadIdx.x / 128;

  if (wg == 0) {
    // Producer: one thread walks the same tiles and K slices as the consumers.
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      uint32_t it = 0;
      for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const TileGeom tg = tile_geometry<kTileM, kTileN, TIn>(p, tile_start, tile);
        const int k_tiles =
            tg.m0 >= tg.m_lim ? 0 : static_cast<int>(ceil_div_dev(tg.k_lim - tg.kr0, kTileK));
        const int w_row = static_cast<int>(int64_t{tg.group} * (MODE == 1 ? p.k_red : p.n_out) + (MODE == 1 ? 0 : tg.n0));
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int s = it % kStages;
          mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
          uint8_t* stage = smem + s * kStageBytes;
          mbar_expect_tx(&full[s], kStageBytes);
          if constexpr (MODE == 2) {  // rows of dC and A: MN-major boxes
            const int r = static_cast<int>(tg.kr0) + kt * kTileK;
#pragma unroll
            for (int i = 0; i < kTileM / 64; ++i)
              tma_load_2d(stage + i * 8192, &map_a, &full[s], static_cast<int>(tg.m0) + i * 64, r);
#pragma unroll
            for (int i = 0; i < kTileN / 64; ++i)
              tma_load_2d(stage + kStageBytesA + i * 8192, &map_w, &full[s], static_cast<int>(tg.n0) + i * 64, r);
            continue;
          }
          tma_load_2d(stage, &map_a, &full[s], kt * kTileK, static_cast<int>(tg.m0));
          if constexpr (MODE == 1) {
            // NOTE: reduction rows past N read the next expert's rows; they meet
            // the zero-filled columns of A (dC) past N and add nothing.
#pragma unroll
            for (int i = 0; i < kTileN / 64; ++i)
              tma_load_2d(stage + kStageBytesA + i * 8192, &map_w, &full[s],
                          static_cast<int>(tg.n0) + i * 64, w_row + kt * kTileK);
          } else {
            tma_load_2d(stage + kStageBytesA, &map_w, &full[s], kt * kTileK, w_row);
          }
        }
      }
    }
  } else {
    // Consumers: warpgroup c = wg - 1 owns rows c*64 .. c*64+63 of each tile.
    setmaxnreg_inc<232>();
    const int c = wg - 1;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    uint32_t it = 0;
    for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileGeom tg = tile_geometry<kTileM, kTileN, TIn>(p, tile_start, tile);
      const int k_tiles =
          tg.m0 >= tg.m_lim ? 0 : static_cast<int>(ceil_div_dev(tg.k_lim - tg.kr0, kTileK));
      float acc[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(&full[s], (it / kStages) & 1);
        if constexpr (MODE == 2) {
          const int64_t left = tg.k_lim - (tg.kr0 + int64_t{kt} * kTileK);
          if (left < kTileK) {  // the group's last slice: zero the rows past its end
            uint8_t* stage = smem + s * kStageBytes;
            zero_slice_rows(stage, kTileM / 64, static_cast<int>(left), threadIdx.x - 128);
            zero_slice_rows(stage + kStageBytesA, kTileN / 64, static_cast<int>(left), threadIdx.x - 128);
            sm90::fence_proxy_async();
            asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the two consumer warpgroups
          }
        }
        const TIn* sa = reinterpret_cast<const TIn*>(smem + s * kStageBytes) +
                        (MODE == 2 ? c * 64 * 64 : c * 64 * kTileK);
        const TIn* sb = reinterpret_cast<const TIn*>(smem + s * kStageBytes + kStageBytesA);
        sm90::wgmma_fence();
        sm90::fence_operands(acc);
#pragma unroll
        for (int ks = 0; ks < kTileK / 16; ++ks) {
          using Mma = sm90::Wgmma<TIn, kTileN>;
          if constexpr (MODE == 2)  // both MN-major: 16 K rows of 128 bytes per step
            Mma::template mma<1, 1>(acc, smem_desc_mn(sa + ks * 16 * 64), smem_desc_mn(sb + ks * 16 * 64));
          else if constexpr (MODE == 1)
            Mma::template mma<0, 1>(acc, sm90::smem_desc(sa + ks * 16), smem_desc_mn(sb + ks * 16 * 64));
          else
            Mma::template mma<0, 0>(acc, sm90::smem_desc(sa + ks * 16), sm90::smem_desc(sb + ks * 16));
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>();
        sm90::fence_operands(acc);
        // NOTE: the group of slice it-1 is complete: its stage is free again.
        if (kt > 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[(it - 1) % kStages]);
      }
      sm90::wgmma_wait<0>();
      sm90::fence_operands(acc);
      if (k_tiles > 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[(it - 1) % kStages]);

      // Epilogue straight from registers: rows r, r+8; columns 8j + 2(lane%4) (+1).
      const int64_t r0 = tg.m0 + c * 64 + warp * 16 + lane / 4;
      TOut* out = MODE == 2 ? const_cast<TOut*>(group_base<TOut>(p.c, p.c_ptrs, p.c_group_stride, tg.group))
                            : static_cast<TOut*>(p.c);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = r0 + half * 8;
        if (row >= tg.store_hi) continue;
        const bool data = row - tg.m0 < tg.data_rows;
        // NOTE: with accumulate, the old values are loaded 8 at a time before
        // their stores, so the loads overlap instead of alternating with stores.
        constexpr int kBatch = 8;
#pragma unroll
        for (int j0 = 0; j0 < kTileN / 8; j0 += kBatch) {
          Pack<TOut, 2> old[kBatch];
          if (p.accumulate) {
#pragma unroll
            for (int jj = 0; jj < kBatch; ++jj) {
              const int64_t col = tg.n0 + (j0 + jj) * 8 + (lane % 4) * 2;
              if (col < p.n_out) old[jj] = *reinterpret_cast<const Pack<TOut, 2>*>(out + row * p.ldc + col);
            }
          }
#pragma unroll
          for (int jj = 0; jj < kBatch; ++jj) {
            const int j = j0 + jj;
            const int64_t col = tg.n0 + j * 8 + (lane % 4) * 2;
            if (col >= p.n_out) continue;
            float v0 = data ? acc[j * 4 + half * 2] : 0.0f, v1 = data ? acc[j * 4 + half * 2 + 1] : 0.0f;
            if (p.accumulate) {
              v0 += to_float(old[jj].v[0]);
              v1 += to_float(old[jj].v[1]);
            }
            Pack<TOut, 2> o;
            o.v[0] = from_float<TOut>(v0);
            o.v[1] = from_float<TOut>(v1);
            *reinterpret_cast<Pack<TOut, 2>*>(out + row * p.ldc + col) = o;
          }
        }
      }
    }
  }
#endif
}

}  // namespace moeflow::cuda::gemm::sm90tma
