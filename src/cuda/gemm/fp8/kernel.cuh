// The blockwise FP8 grouped GEMM forward on Hopper (sm_90a): C = A W_e^T per
// group, A [rows, K] e4m3 with float32 scales per 1 x 128 block of a row, W
// [E, N, K] e4m3 with float32 scales per 128 x 128 block, C bf16 [rows, N].
//
// Algorithm: the persistent tile walk of the bf16 TMA kernel (device
// offsets, block scan of tile counts, tile -> group search) with 128 x 128
// tiles and 128-wide K slices (128 bytes of e4m3: one 128-byte swizzled row,
// the layout the TMA writes and wgmma reads). Warpgroup 0, one thread, is
// the producer: per slice it waits for a free stage and issues two TMA loads
// (the tile's 128 A rows, the group's 128 weight rows). Warpgroups 1 and 2
// consume 64 rows each: four wgmma.m64n128k32 per slice into a slice
// accumulator (the first with scale-d 0), then, once they completed, the
// promotion: acc += slice_acc * a_scale(row, slice) * w_scale(n block,
// slice), in float32, every 128 of K (DeepSeek-V3's recipe). A slice's
// stage is released once its wgmma completed; while one warpgroup promotes,
// the tensor cores have only the other's wgmma (docs/performance.md has the
// figures and what was tried).
// Epilogue: rows past the group's real rows are written as zeros, rows past
// the group's segment not at all; 4-byte stores straight from the
// accumulators.
#pragma once

#include <cuda_bf16.h>

#include "cuda/bulk.cuh"
#include "cuda/gemm/portable.cuh"
#include "cuda/gemm/sm90_cpasync.cuh"
#include "cuda/gemm/tma/ptx.cuh"

namespace moeflow::cuda::gemm::fp8 {

constexpr int kTileM = 128, kTileN = 128, kTileK = 128;  // K in e4m3 elements (bytes)
constexpr int kThreads = 384;
constexpr int kStageBytesA = kTileM * kTileK;  // 16 KB
constexpr int kStageBytesB = kTileN * kTileK;  // 16 KB
constexpr int kStageBytes = kStageBytesA + kStageBytesB;
constexpr int kMaxStages = 6;
constexpr int kBlock = 128;  // scale block

// Scales and output beside the bf16 kernel's Params (a, b, c, offsets...).
struct Fp8Params {
  const float* a_scales;  // [rows, K / 128]
  const float* w_scales;  // [E, N / 128, K / 128]
  int64_t k_blocks;       // K / 128
  int64_t n_blocks;       // N / 128
};

// Shared memory: 1 KB alignment slack, the stages, then the mbarriers and
// the tile prefix.
struct Smem {
  static size_t bytes(int stages, int num_groups) {
    return 1024 + size_t(stages) * kStageBytes + 2 * kMaxStages * 8 +
           (size_t(num_groups) + 1) * sizeof(int32_t);
  }
};

// wgmma.m64n128k32, e4m3 x e4m3 -> float32, both operands K-major from
// shared-memory descriptors; d = a b (+ d when accumulate).
__device__ __forceinline__ void wgmma_e4m3_n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
      "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
      "%55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

using sm90tma::setmaxnreg_dec;
using sm90tma::setmaxnreg_inc;
using sm90tma::tma_load_2d;

__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_fp8_kernel(Params p, Fp8Params q, const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_w, int stages) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * kStageBytes);
  uint64_t* empty = full + kMaxStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kMaxStages);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      bulk::mbar_init(&full[s], 1);
      bulk::mbar_init(&empty[s], 2);  // one arrive per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // The scan borrows the first stage (no load is issued yet); ends with a barrier.
  static_assert(sizeof(ScanScratch<kThreads>) <= kStageBytes, "scan scratch must fit a stage");
  build_tile_prefix_in<kTileM, kTileN, kThreads>(
      p, tile_start, *reinterpret_cast<ScanScratch<kThreads>*>(smem));
  sm90::fence_proxy_async();
  __syncthreads();
  const int32_t num_tiles = tile_start[p.num_groups];
  const int wg = threadIdx.x / 128;
  auto geom = [&](int32_t tile, int hint) {
    return tile_geometry<kTileM, kTileN, uint8_t>(p, tile_start, tile, hint);
  };
  auto k_tiles_of = [&](const TileGeom& t) {
    return t.m0 >= t.m_lim ? 0 : static_cast<int>(ceil_div_dev(p.k_red, kTileK));
  };

  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x != 0) return;
    int s = 0;  // the stage cursor: stage and phase, stepped once per slice
    uint32_t parity = 0;
    int group = 0;
    for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileGeom t = geom(tile, group);
      group = t.group;
      const int kt_n = k_tiles_of(t);
      const int w_row = static_cast<int>(int64_t{t.group} * p.n_out + t.n0);
      for (int kt = 0; kt < kt_n; ++kt) {
        bulk::mbar_wait(&empty[s], parity ^ 1u);
        uint8_t* stage = smem + s * kStageBytes;
        bulk::mbar_expect_tx(&full[s], kStageBytes);
        tma_load_2d(stage, &map_a, &full[s], kt * kTileK, static_cast<int>(t.m0));
        tma_load_2d(stage + kStageBytesA, &map_w, &full[s], kt * kTileK, w_row);
        if (++s == stages) s = 0, parity ^= 1u;
      }
    }
    return;
  }

  // Consumers: warpgroup c owns rows c*64 .. c*64+63 of each tile.
  setmaxnreg_inc<232>();
  const int c = wg - 1;
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32;
  const int rl0 = warp * 16 + lane / 4;  // the thread's first row in the warpgroup's 64
  // Stage 0's operand descriptors; a stage or a 32-byte K step moves only the
  // start address field (address / 16; every offset stays inside its 14 bits).
  const uint64_t desc_a0 = sm90::smem_desc(smem + c * 64 * kTileK);
  const uint64_t desc_b0 = sm90::smem_desc(smem + kStageBytesA);
  int s = 0;  // the stage cursor, stepped once per slice as the producer's
  uint32_t parity = 0;
  int group = 0;
  for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileGeom t = geom(tile, group);
    group = t.group;
    const int kt_n = k_tiles_of(t);
    // The rows of this thread's scales (clamped into the matrix: rows past
    // the segment are never stored).
    const int64_t row0 = t.m0 + c * 64 + rl0;
    const int64_t ra = min(row0, p.rows - 1), rb = min(row0 + 8, p.rows - 1);
    const float* sa0 = q.a_scales + ra * q.k_blocks;
    const float* sa1 = q.a_scales + rb * q.k_blocks;
    const float* sw = q.w_scales + (int64_t{t.group} * q.n_blocks + t.n0 / kBlock) * q.k_blocks;
    float acc[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    float na0 = kt_n > 0 ? __ldg(sa0) : 0.0f, na1 = kt_n > 0 ? __ldg(sa1) : 0.0f;
    float nw = kt_n > 0 ? __ldg(sw) : 0.0f;
    for (int kt = 0; kt < kt_n; ++kt) {
      const float s0 = na0 * nw, s1 = na1 * nw;
      if (kt + 1 < kt_n) {  // the next slice's scales, in flight under this one
        na0 = __ldg(++sa0);
        na1 = __ldg(++sa1);
        nw = __ldg(++sw);
      }
      bulk::mbar_wait(&full[s], parity);
      const uint64_t off = static_cast<uint64_t>(s) * (kStageBytes >> 4);
      sm90::wgmma_fence();
      sm90::fence_operands(part);
#pragma unroll
      for (int ks = 0; ks < kTileK / 32; ++ks)
        wgmma_e4m3_n128(part, desc_a0 + off + 2 * ks, desc_b0 + off + 2 * ks, ks > 0 ? 1 : 0);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_operands(part);
      if (tid == 0) bulk::mbar_arrive(&empty[s]);
      if (++s == stages) s = 0, parity ^= 1u;
      // Promotion: the fragment's rows rl0 (i % 4 < 2) and rl0 + 8.
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = fmaf(part[i], (i % 4) < 2 ? s0 : s1, acc[i]);
    }
    // Epilogue: fragment column j: columns 8j + 2 (lane % 4) (+1).
    const int64_t store_hi = t.store_hi, data_hi = t.m0 + t.data_rows;
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.c);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + half * 8;
      if (row >= store_hi) continue;
      const bool data = row < data_hi;
      __nv_bfloat16* dst = out + row * p.ldc + t.n0 + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
        const float x = data ? acc[4 * j + 2 * half] : 0.0f;
        const float y = data ? acc[4 * j + 2 * half + 1] : 0.0f;
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) = __floats2bfloat162_rn(x, y);
      }
    }
  }
#endif
}

}  // namespace moeflow::cuda::gemm::fp8
