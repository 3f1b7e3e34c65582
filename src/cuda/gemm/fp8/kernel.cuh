// The blockwise FP8 grouped GEMM forward on Hopper (sm_90a): C = A W_e^T per
// group, A [rows, K] e4m3 with float32 scales per 1 x 128 block of a row, W
// [E, N, K] e4m3 with float32 scales per 128 x 128 block, C bf16 [rows, N].
//
// Algorithm: the persistent tile walk of the bf16 TMA kernel (device
// offsets, block scan of tile counts, tile -> group search) with TM x TN
// tiles (Tile below) and 128-wide K slices (128 bytes of e4m3: one 128-byte
// swizzled row, the layout the TMA writes and wgmma reads). Warp 0 of
// warpgroup 0 is the producer: per slice it waits for a free stage, lane 0
// issues two TMA loads (the tile's TM A rows, the group's TN weight rows),
// and all lanes gather the slice's scales (TM activation scales, two weight
// scales) into the stage's scale slot with 4-byte cp.async, each lane's
// completion counted on the stage's full barrier. The TM / 64 consumer
// warpgroups own 64 rows each: four wgmma.m64nTNk32 per slice into a slice
// accumulator (the first with scale-d 0), then, once they completed, the
// promotion: acc += slice_acc * a_scale(row, slice) * w_scale(n block,
// slice), in float32, every 128 of K (DeepSeek-V3's recipe). A 192-wide
// tile straddles two 128-column scale blocks (at its column 128 or 64). A
// slice's stage is released once its wgmma completed (an arrive per consumer
// warp, after that warp's reads of the slot). With three consumer
// warpgroups one promotes while the others' wgmma run; with two the tensor
// pipe idles during each promotion (docs/performance.md has the figures).
// Epilogue: rows past the group's real rows are written as zeros, rows past
// the group's segment and columns past N not at all; 4-byte stores straight
// from the accumulators.
//
// Tensorwise (TW: one scale per operand, a_scales[0] and w_scales[0]): no
// scale slots; the slices' wgmma accumulate into the slice accumulator one
// after another (each slice's stage released once the next slice's wgmma
// were issued and it completed), promoted into the float32 accumulator by a
// plain add every `promote` slices (0: once, after the last: fast
// accumulation), and the product of the two scales applied in the epilogue.
#pragma once

#include <cuda_bf16.h>

#include "cuda/bulk.cuh"
#include "cuda/gemm/fp8/wgmma.cuh"
#include "cuda/gemm/portable.cuh"
#include "cuda/gemm/sm90_cpasync.cuh"
#include "cuda/gemm/tma/ptx.cuh"

namespace moeflow::cuda::gemm::fp8 {

constexpr int kTileK = 128;  // K in e4m3 elements (bytes)
constexpr int kMaxStages = 6;
constexpr int kBlock = 128;  // scale block

// A tile shape: TM rows (TM / 64 consumer warpgroups) by TN columns.
template <int TM, int TN>
struct Tile {
  static_assert(TM % 64 == 0 && (TN == 128 || TN == 192), "FP8 tile: TM = 64 c, TN 128 or 192");
  static constexpr int kM = TM, kN = TN;
  static constexpr int kConsumers = TM / 64;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kStageBytesA = TM * kTileK;
  static constexpr int kStageBytesB = TN * kTileK;
  static constexpr int kStageBytes = kStageBytesA + kStageBytesB;
  static constexpr int kAcc = TN / 2;  // float32 accumulators per thread
  // Registers per thread after setmaxnreg (all warpgroups within 64 K).
  static constexpr int kProducerRegs = kConsumers == 2 ? 56 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 224 : 160;
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "register file");
};
using Tile128x128 = Tile<128, 128>;
using Tile128x192 = Tile<128, 192>;
using Tile192x128 = Tile<192, 128>;

// Scales and output beside the bf16 kernel's Params (a, b, c, offsets...).
struct Fp8Params {
  const float* a_scales;  // [rows, K / 128]; tensorwise [1]
  const float* w_scales;  // [E, N / 128, K / 128]; tensorwise [1]
  int64_t k_blocks;       // K / 128
  int64_t n_blocks;       // N / 128
  int promote = 0;        // tensorwise: slices per promotion (0: all of K)
};

// Shared memory: 1 KB alignment slack, the stages, the scale slots (one per
// stage: TM activation scales, then the tile's two weight scales), the
// mbarriers and the tile prefix.
template <typename T>
struct Smem {
  static constexpr int kSlotFloats = T::kM + 4;  // 16-byte multiple
  static size_t bytes(int stages, int num_groups) {
    return 1024 + size_t(stages) * T::kStageBytes + size_t(stages) * kSlotFloats * 4 +
           2 * kMaxStages * 8 + (size_t(num_groups) + 1) * sizeof(int32_t);
  }
};

// 4-byte asynchronous copy global -> shared, and an arrival on `bar` once
// this thread's earlier cp.async completed (not counted in advance: the
// barrier's expected count includes it).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(bulk::smem_u32(smem)), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bulk::smem_u32(bar))
               : "memory");
}

using sm90tma::setmaxnreg_dec;
using sm90tma::setmaxnreg_inc;
using sm90tma::tma_load_2d;

// acc += part * scale, the scale of fragment element i: row half (i % 4 < 2:
// the thread's first row, else its row + 8) and column block (fragment
// column j = i / 4 below JB: the tile's first 128-column scale block, else
// the next).
template <int JB, int N>
__device__ __forceinline__ void promote(float (&acc)[N], const float (&part)[N], float lo0,
                                        float lo1, float hi0, float hi1) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const bool row1 = (i % 4) >= 2;
    const float sc = (i / 4) < JB ? (row1 ? lo1 : lo0) : (row1 ? hi1 : hi0);
    acc[i] = fmaf(part[i], sc, acc[i]);
  }
}

// The tensorwise main loop of both FP8 kernels (one consumer warpgroup's
// tile): kt_n slices chained into `part` in runs of `promote` slices (0:
// one run), each run then added to `acc`. Within a run a slice's stage is
// released once the next slice's wgmma were issued and it completed
// (wait<1>), the run's last at the promotion (wait<0>); one arrive per
// consumer warp. `before(kt, stage)` runs once a slice's stage is full,
// before its wgmma (the wgrad zeroes a group's tail there). The stage
// cursor (s, parity) steps as the producer's.
template <int TN, int kAcc, int kStageUnits, typename Before>
__device__ __forceinline__ void tensorwise_main_loop(float (&acc)[kAcc], float (&part)[kAcc],
                                                     int kt_n, int promote, int& s,
                                                     uint32_t& parity, int stages, uint64_t* full,
                                                     uint64_t* empty, uint32_t desc_a0,
                                                     uint32_t desc_b0, int lane, Before before) {
  constexpr uint64_t kDescHi = (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
  const int run_len = promote > 0 ? promote : kt_n;
  int kt = 0;
  for (int kt0 = 0; kt0 < kt_n; kt0 += run_len) {
    const int n = min(run_len, kt_n - kt0);
    int held = -1;  // the stage of the last slice not yet released
    for (int j = 0; j < n; ++j, ++kt) {
      bulk::mbar_wait(&full[s], parity);
      before(kt, s);
      const uint32_t off = static_cast<uint32_t>(s) * kStageUnits;
      sm90::wgmma_fence();
      sm90::fence_operands(part);
#pragma unroll
      for (int ks = 0; ks < kTileK / 32; ++ks)
        Wgmma8<TN>::mma(part, kDescHi | (desc_a0 + off + 2 * ks),
                        kDescHi | (desc_b0 + off + 2 * ks), (j > 0 || ks > 0) ? 1 : 0);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();
      sm90::fence_operands(part);
      __syncwarp();
      if (lane == 0 && held >= 0) bulk::mbar_arrive(&empty[held]);
      held = s;
      if (++s == stages) s = 0, parity ^= 1u;
    }
    sm90::wgmma_wait<0>();
    sm90::fence_operands(part);
    __syncwarp();
    if (lane == 0) bulk::mbar_arrive(&empty[held]);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] += part[i];
  }
}

// The start of both FP8 kernels: the stages' barriers (full: the TMA's
// expect_tx and each producer lane's scales; empty: `consumer_arrivals`
// arrives), then every group's tile count and their prefix in tile_start
// (the scan borrows the first stage: no load is issued yet). Ends with a
// block barrier; returns the number of tiles.
template <typename T>
__device__ __forceinline__ int32_t start_pipeline(const Params& p, uint8_t* smem, uint64_t* full,
                                                  uint64_t* empty, int32_t* tile_start, int stages,
                                                  int consumer_arrivals) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      bulk::mbar_init(&full[s], 1 + 32);
      bulk::mbar_init(&empty[s], consumer_arrivals);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  static_assert(sizeof(ScanScratch<T::kThreads>) <= T::kStageBytes,
                "scan scratch must fit a stage");
  build_tile_prefix_in<T::kM, T::kN, T::kThreads>(
      p, tile_start, *reinterpret_cast<ScanScratch<T::kThreads>*>(smem));
  sm90::fence_proxy_async();
  __syncthreads();
  return tile_start[p.num_groups];
}

template <typename T, bool TW>
__global__ void __launch_bounds__(T::kThreads, 1)
    grouped_gemm_fp8_kernel(Params p, Fp8Params q, const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_w, int stages) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int TM = T::kM, TN = T::kN;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // (offset from the array itself, not through an integer address: the
  // compiler then knows the slots below are shared memory and reads them so)
  uint8_t* smem = smem_raw + ((1024u - (bulk::smem_u32(smem_raw) & 1023u)) & 1023u);
  float* slots = reinterpret_cast<float*>(smem + stages * T::kStageBytes);
  constexpr int kSlot = Smem<T>::kSlotFloats;
  uint64_t* full = reinterpret_cast<uint64_t*>(slots + stages * kSlot);
  uint64_t* empty = full + kMaxStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kMaxStages);
  // Warp-uniform values broadcast from lane 0, so that the compiler keeps
  // what follows from them (the loop trip counts, the stage cursor, the
  // operand descriptors) in uniform registers.
  const int32_t num_tiles = __shfl_sync(
      0xffffffffu, start_pipeline<T>(p, smem, full, empty, tile_start, stages, T::kConsumers * 4),
      0);
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  auto geom = [&](int32_t tile, int hint) {
    return tile_geometry<TM, TN, uint8_t>(p, tile_start, tile, hint);
  };
  auto k_tiles_of = [&](const TileGeom& t) {
    return t.m0 >= t.m_lim ? 0 : static_cast<int>(ceil_div_dev(p.k_red, kTileK));
  };

  if (wg == 0) {
    setmaxnreg_dec<T::kProducerRegs>();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    int s = 0;  // the stage cursor: stage and phase, stepped once per slice
    uint32_t parity = 0;
    int group = 0;
    for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileGeom t = geom(tile, group);
      group = t.group;
      const int kt_n = k_tiles_of(t);
      const int w_row = static_cast<int>(int64_t{t.group} * p.n_out + t.n0);
      // This lane's scale sources (32-bit row arithmetic: rows < 2^31): rows
      // m0 + lane + 32 j (clamped into A: rows past the segment are never
      // stored), and for lanes 0-1 the weight blocks holding columns n0 and
      // the next 128 (clamped into W).
      const int kb = static_cast<int>(q.k_blocks), r_max = static_cast<int>(p.rows) - 1;
      const int r0 = static_cast<int>(t.m0) + lane;
      const int nb = min(static_cast<int>(t.n0 / kBlock) + lane, static_cast<int>(q.n_blocks) - 1);
      const int w_blk = t.group * static_cast<int>(q.n_blocks) + nb;
      for (int kt = 0; kt < kt_n; ++kt) {
        bulk::mbar_wait(&empty[s], parity ^ 1u);
        if constexpr (!TW) {
          float* slot = slots + s * kSlot;
#pragma unroll
          for (int j = 0; j < (TM + 31) / 32; ++j)
            if (lane + 32 * j < TM)
              cp_async4(slot + lane + 32 * j,
                        q.a_scales + int64_t{min(r0 + 32 * j, r_max)} * kb + kt);
          if (lane < 2) cp_async4(slot + TM + lane, q.w_scales + int64_t{w_blk} * kb + kt);
        }
        cp_async_arrive(&full[s]);  // (tensorwise: no copies, arrives at once)
        if (lane == 0) {
          uint8_t* stage = smem + s * T::kStageBytes;
          bulk::mbar_expect_tx(&full[s], T::kStageBytes);
          tma_load_2d(stage, &map_a, &full[s], kt * kTileK, static_cast<int>(t.m0));
          tma_load_2d(stage + T::kStageBytesA, &map_w, &full[s], kt * kTileK, w_row);
        }
        if (++s == stages) s = 0, parity ^= 1u;
      }
    }
    return;
  }

  // Consumers: warpgroup c owns rows c*64 .. c*64+63 of each tile.
  setmaxnreg_inc<T::kConsumerRegs>();
  const int c = wg - 1;
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32;
  const int rl0 = warp * 16 + lane / 4;  // the thread's first row in the warpgroup's 64
  // Stage 0's operand descriptors; a stage or a 32-byte K step moves only the
  // start address field (address / 16, the low word; every offset stays
  // inside its 14 bits), the high word is the same constant for both.
  const uint32_t desc_a0 = static_cast<uint32_t>(sm90::smem_desc(smem + c * 64 * kTileK));
  const uint32_t desc_b0 = static_cast<uint32_t>(sm90::smem_desc(smem + T::kStageBytesA));
  constexpr uint64_t kDescHi = (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
  int s = 0;  // the stage cursor, stepped once per slice as the producer's
  uint32_t parity = 0;
  int group = 0;
  for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileGeom t = geom(tile, group);
    group = t.group;
    const int kt_n = __shfl_sync(0xffffffffu, k_tiles_of(t), 0);
    const int64_t row0 = t.m0 + c * 64 + rl0;
    const int ra = c * 64 + rl0;  // the thread's rows' places in a scale slot (and + 8)
    const bool split64 = TN > 128 && t.n0 % kBlock != 0;
    float acc[T::kAcc], part[T::kAcc];
#pragma unroll
    for (int i = 0; i < T::kAcc; ++i) acc[i] = 0.0f;
    if constexpr (TW) {
      tensorwise_main_loop<TN, T::kAcc, (T::kStageBytes >> 4)>(acc, part, kt_n, q.promote, s,
                                                               parity, stages, full, empty, desc_a0,
                                                               desc_b0, lane, [](int, int) {});
      const float ts = q.a_scales[0] * q.w_scales[0];
#pragma unroll
      for (int i = 0; i < T::kAcc; ++i) acc[i] *= ts;
    }
    for (int kt = 0; kt < (TW ? 0 : kt_n); ++kt) {
      bulk::mbar_wait(&full[s], parity);
      const uint32_t off = static_cast<uint32_t>(s) * (T::kStageBytes >> 4);
      sm90::wgmma_fence();
      sm90::fence_operands(part);
#pragma unroll
      for (int ks = 0; ks < kTileK / 32; ++ks)
        Wgmma8<TN>::mma(part, kDescHi | (desc_a0 + off + 2 * ks), kDescHi | (desc_b0 + off + 2 * ks),
                        ks > 0 ? 1 : 0);
      sm90::wgmma_commit();
      // The slice's scales, read while its wgmma run.
      const float* slot = slots + s * kSlot;
      const float a0 = slot[ra], a1 = slot[ra + 8], w0 = slot[TM];
      const float w1 = TN > 128 ? slot[TM + 1] : 0.0f;
      const float s0 = a0 * w0, s1 = a1 * w0, h0 = a0 * w1, h1 = a1 * w1;
      sm90::wgmma_wait<0>();
      sm90::fence_operands(part);
      __syncwarp();  // every lane's reads of the slot before lane 0's arrive
      if (lane == 0) bulk::mbar_arrive(&empty[s]);  // one per consumer warp
      if (++s == stages) s = 0, parity ^= 1u;
      // Promotion: the fragment's rows rl0 (i % 4 < 2) and rl0 + 8.
      if (TN > 128 && split64)
        promote<8>(acc, part, s0, s1, h0, h1);
      else
        promote<16>(acc, part, s0, s1, h0, h1);
    }
    // Epilogue: fragment column j: columns 8j + 2 (lane % 4) (+1), stored
    // while inside N (N and n0 are multiples of 64).
    const int64_t store_hi = t.store_hi, data_hi = t.m0 + t.data_rows;
    const int64_t cols = p.n_out - t.n0;
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.c);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + half * 8;
      if (row >= store_hi) continue;
      const bool data = row < data_hi;
      __nv_bfloat16* dst = out + row * p.ldc + t.n0 + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < TN / 8; ++j) {
        if (TN > 128 && 8 * j >= cols) break;
        const float x = data ? acc[4 * j + 2 * half] : 0.0f;
        const float y = data ? acc[4 * j + 2 * half + 1] : 0.0f;
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) = __floats2bfloat162_rn(x, y);
      }
    }
  }
#endif
}

}  // namespace moeflow::cuda::gemm::fp8
