// The blockwise FP8 grouped GEMM wgrad on Hopper (sm_90a), variable K: per
// group e, dW_e (+)= dC_e^T A_e, where the group's rows are the reduction.
// Both operands arrive transposed (quantize's columnwise 1x128 layout, the
// K-major form an FP8 wgmma reads): dc_t [N, rows] and a_t [K, rows] e4m3,
// with float32 scales per 1 x 128 block of their rows (128 rows of dC / A).
// dW [E, N, K] float32 or bf16 (stacked or a pointer per group).
//
// Algorithm: the forward's machinery (fp8/kernel.cuh: warp-specialised
// producer, TMA loads of 128-byte swizzled K slices, the slice's scales
// gathered into shared memory, a slice accumulator promoted into the float32
// tile accumulator every 128 of K) on the reduce-grouped tile walk of the
// bf16 wgrad: each group owns ceil(N / TM) x ceil(K / TN) output tiles, and
// a tile's K slices are the group's rows [offsets[e], offsets[e] + real
// rows) in steps of 128. A group's rows must start at a multiple of 128 so
// that every slice is one scale block of both operands; a group that does
// not sets the error flag and is not written. Promotion scales element
// (i, j) by dc_scale(row i, slice) x a_scale(column j, slice): the column
// scales come from the slot too (TN floats beside the TM row scales).
// The last slice of a group whose real rows end inside it: the consumers
// zero the stage's bytes past the real rows (both operands, all rows) before
// their wgmma, so pad rows are never read, whatever they hold.
// Epilogue (stacked dW): each consumer warpgroup stages its 64 rows in
// 64-row x 128-byte chunks (128-byte swizzle) through a ring of two buffers
// and one thread issues a TMA store of each chunk (accumulate: a TMA
// reduce-add in dW's dtype, so dW is never read by the SMs; bf16: the
// result rounded to bf16, then added and rounded by the L2, as autograd's
// grad += g), so the next tile's main loop starts while the stores drain.
// dW through a pointer per group: stores straight from the accumulators
// (bf16 accumulate: the same two roundings). A group with no real rows
// writes zeros (accumulate: leaves dW as it is).
//
// Tensorwise (TW: dc_scales[0] and a_scales[0], one scale per operand): no
// scale slots, and a group's rows may start at any multiple of 16 (other
// starts are flagged): its slices start at the 128-row boundary before the
// group (whole 128-byte lines per TMA row), the first slice's rows before
// the group zeroed as the last slice's past it; the slices' wgmma chain as in the
// forward's tensorwise loop, promoted by a plain add every `promote` slices,
// and the product of the two scales applied before the epilogue.
#pragma once

#include <type_traits>

#include "cuda/gemm/fp8/kernel.cuh"
#include "cuda/gemm/tma/named_barrier.cuh"

namespace moeflow::cuda::gemm::fp8 {

// The wgrad's scales: element (i, s) of dc_t's [N, rows / 128] scales at
// dc[i * dc_s0 + s * dc_s1] (quantize's layout: s0 = rows / 128, s1 = 1; a
// slice-major [rows / 128, N] layout seen transposed: s0 = 1, which the
// producer gathers in one coalesced read per slice); the same for a_t's.
struct Fp8WgradParams {
  const float* dc_scales;
  int64_t dc_s0, dc_s1;
  const float* a_scales;
  int64_t a_s0, a_s1;
  bool tma_out;  // dW stacked: staged chunks stored by TMA (map_dw); else straight stores
  int promote = 0;  // tensorwise: slices per promotion (0: all of the group's rows)
};

// The epilogue's staging: per consumer warpgroup kBufs chunks of 64 rows x
// 128 bytes (TMA boxes of 128 / sizeof(TOut) columns).
struct WgradStaging {
  static constexpr int kBufs = 2;
  static constexpr int kChunkBytes = 64 * 128;
};

// Shared memory: 1 KB alignment slack, the stages, the staging chunks, the
// scale slots (per stage: TM row scales of dC^T, TN of A^T), the mbarriers,
// the tile prefix.
template <typename T>
struct WgradSmem {
  static constexpr int kSlotFloats = T::kM + T::kN;
  static constexpr int kStagingBytes = T::kConsumers * WgradStaging::kBufs * WgradStaging::kChunkBytes;
  static size_t bytes(int stages, int num_groups) {
    return 1024 + size_t(stages) * T::kStageBytes + kStagingBytes +
           size_t(stages) * kSlotFloats * 4 + 2 * kMaxStages * 8 +
           (size_t(num_groups) + 1) * sizeof(int32_t);
  }
};

// Named barriers (0 is __syncthreads).
enum WgradBarrier : int {
  kBarZeroTail = 1,   // every consumer thread zeroed its share of a stage
  kBarWarpgroup = 2,  // + c: consumer warpgroup c's 128 threads (staging)
};

// Zeroes the bytes outside [lo, hi) of every row of a stage (TM A rows then
// TN B rows, 128-byte rows in the TMA's 128-byte swizzle: 16-byte chunk c
// of row m at chunk c ^ (m % 8)); thread `t` of `threads`.
template <typename Tl>
__device__ __forceinline__ void zero_outside(uint8_t* stage, int lo, int hi, int t, int threads) {
  for (int v = t; v < (Tl::kM + Tl::kN) * 8; v += threads) {
    const int row = v / 8, c = v % 8, b0 = c * 16;
    if (b0 >= lo && b0 + 16 <= hi) continue;  // inside: kept
    uint8_t* chunk = stage + row * 128 + ((c ^ (row & 7)) * 16);
    if (b0 + 16 <= lo || b0 >= hi) {
      *reinterpret_cast<uint4*>(chunk) = make_uint4(0, 0, 0, 0);
    } else {
      for (int i = 0; i < 16; ++i)
        if (b0 + i < lo || b0 + i >= hi) chunk[i] = 0;
    }
  }
}

// The epilogue through staging chunks and TMA (dW stacked [E, N, K]):
// consumer warpgroup c's rows m0 + c*64 .. +63, chunk by chunk of
// 128 / sizeof(TOut) columns; rows past N and columns past K are clipped by
// the map.
template <typename T, typename TOut>
__device__ __forceinline__ void store_staged(const Params& p, const CUtensorMap* map_dw,
                                             const float (&acc)[T::kAcc], const TileGeom& t,
                                             int c, int tid, int lane, int rl0, uint8_t* staging,
                                             int& buf_i) {
  constexpr int kCw = 128 / static_cast<int>(sizeof(TOut));  // columns per chunk
  constexpr bool kF32 = std::is_same_v<TOut, float>;
  const int64_t wg_row0 = t.m0 + c * 64;
  if (wg_row0 >= p.m_out) return;  // uniform over the warpgroup
  uint8_t* mine = staging + c * WgradStaging::kBufs * WgradStaging::kChunkBytes;
#pragma unroll
  for (int qc = 0; qc < T::kN / kCw; ++qc) {
    const int64_t col0 = t.n0 + qc * kCw;
    if (col0 >= p.n_out) break;  // uniform
    if (tid == 0) bulk::wait_read(WgradStaging::kBufs - 1);  // the buffer's last store read it
    sm90tma::named_barrier(kBarWarpgroup + c, 128);
    uint8_t* buf = mine + buf_i * WgradStaging::kChunkBytes;
    if (++buf_i == WgradStaging::kBufs) buf_i = 0;
#pragma unroll
    for (int jj = 0; jj < kCw / 8; ++jj) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = qc * (kCw / 8) + jj, rl = rl0 + half * 8, cl = jj * 8 + 2 * (lane % 4);
        const float x = acc[4 * j + 2 * half], y = acc[4 * j + 2 * half + 1];
        const int byte = cl * static_cast<int>(sizeof(TOut));
        uint8_t* dst = buf + rl * 128 + (((byte >> 4) ^ (rl & 7)) << 4) + (byte & 15);
        if constexpr (kF32)
          *reinterpret_cast<float2*>(dst) = make_float2(x, y);
        else
          *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(x, y);
      }
    }
    sm90::fence_proxy_async();  // generic-proxy writes -> visible to the TMA
    sm90tma::named_barrier(kBarWarpgroup + c, 128);
    if (tid == 0) {
      if (p.accumulate)
        sm90tma::tma_store_3d<true>(map_dw, buf, static_cast<int>(col0),
                                    static_cast<int>(wg_row0), t.group);
      else
        sm90tma::tma_store_3d<false>(map_dw, buf, static_cast<int>(col0),
                                     static_cast<int>(wg_row0), t.group);
      bulk::commit();
    }
  }
}

// The epilogue straight from the accumulators (dW through a pointer per
// group): rows m0 + ra (+ 8) while inside N, column pairs n0 + 8 j + 2 (lane
// % 4) while inside K; with accumulate, eight column pairs' old values are
// loaded together before they are added and stored (bf16: the result
// rounded to bf16 first, as the staged path's reduce-add).
template <typename T, typename TOut>
__device__ __forceinline__ void store_direct(const Params& p, const float (&acc)[T::kAcc],
                                             const TileGeom& t, int ra, int lane) {
  using Pair = std::conditional_t<std::is_same_v<TOut, float>, float2, __nv_bfloat162>;
  TOut* out = const_cast<TOut*>(group_base<TOut>(p.c, p.c_ptrs, p.c_group_stride, t.group));
  const int64_t cols = p.n_out - t.n0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = t.m0 + ra + half * 8;
    if (row >= p.m_out) continue;
    Pair* dst = reinterpret_cast<Pair*>(out + row * p.ldc + t.n0 + 2 * (lane % 4));
#pragma unroll
    for (int j0 = 0; j0 < T::kN / 8; j0 += 8) {
      float2 old[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        old[j] = make_float2(0.0f, 0.0f);
        if (p.accumulate && 8 * (j0 + j) < cols) {
          if constexpr (std::is_same_v<TOut, float>)
            old[j] = dst[4 * (j0 + j)];
          else
            old[j] = __bfloat1622float2(dst[4 * (j0 + j)]);
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (8 * (j0 + j) >= cols) break;
        float x = acc[4 * (j0 + j) + 2 * half], y = acc[4 * (j0 + j) + 2 * half + 1];
        if constexpr (!std::is_same_v<TOut, float>) {
          const float2 r = __bfloat1622float2(__floats2bfloat162_rn(x, y));
          x = r.x, y = r.y;
        }
        x += old[j].x, y += old[j].y;
        if constexpr (std::is_same_v<TOut, float>)
          dst[4 * (j0 + j)] = make_float2(x, y);
        else
          dst[4 * (j0 + j)] = __floats2bfloat162_rn(x, y);
      }
    }
  }
}

template <typename T, typename TOut, bool TW>
__global__ void __launch_bounds__(T::kThreads, 1)
    grouped_gemm_fp8_wgrad_kernel(Params p, Fp8WgradParams q,
                                  const __grid_constant__ CUtensorMap map_dc,
                                  const __grid_constant__ CUtensorMap map_a,
                                  const __grid_constant__ CUtensorMap map_dw, int stages) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int TM = T::kM, TN = T::kN;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // (offset from the array itself: the slots below are read as shared memory)
  uint8_t* smem = smem_raw + ((1024u - (bulk::smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* staging = smem + stages * T::kStageBytes;
  float* slots = reinterpret_cast<float*>(staging + WgradSmem<T>::kStagingBytes);
  constexpr int kSlot = WgradSmem<T>::kSlotFloats;
  uint64_t* full = reinterpret_cast<uint64_t*>(slots + stages * kSlot);
  uint64_t* empty = full + kMaxStages;
  int32_t* tile_start = reinterpret_cast<int32_t*>(empty + kMaxStages);
  // (one empty-barrier arrive per consumer warp, after its reads of the slot)
  // Warp-uniform values broadcast from lane 0 (the forward kernel's reason).
  const int32_t num_tiles = __shfl_sync(
      0xffffffffu, start_pipeline<T>(p, smem, full, empty, tile_start, stages, T::kConsumers * 4),
      0);
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  auto geom = [&](int32_t tile, int hint) {
    return tile_geometry<TM, TN, uint8_t>(p, tile_start, tile, hint);
  };
  // Slices of a tile: 0 for a group without real rows, and for one whose
  // rows do not start on a scale block (tensorwise: on a multiple of 16
  // rows, the FP8 plans' align; flagged below, never written).
  auto misaligned = [](const TileGeom& t) {
    return t.k_lim > t.kr0 && t.kr0 % (TW ? 16 : kBlock) != 0;
  };
  // Where a tile's slices start: the group's first row, or for tensorwise
  // the 128-row boundary before it (whole 128-byte lines per TMA row; the
  // first slice's rows before the group are zeroed like the last's after).
  auto k_base = [](const TileGeom& t) { return TW ? (t.kr0 & ~int64_t{kTileK - 1}) : t.kr0; };
  auto k_tiles_of = [&](const TileGeom& t) {
    return misaligned(t) ? 0 : static_cast<int>(ceil_div_dev(t.k_lim - k_base(t), kTileK));
  };

  if (wg == 0) {
    setmaxnreg_dec<T::kProducerRegs>();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    int s = 0;
    uint32_t parity = 0;
    int group = 0;
    const int m_max = static_cast<int>(p.m_out) - 1, n_max = static_cast<int>(p.n_out) - 1;
    for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileGeom t = geom(tile, group);
      group = t.group;
      const int kt_n = k_tiles_of(t);
      const int m0 = static_cast<int>(t.m0), n0 = static_cast<int>(t.n0);
      const int kr0 = static_cast<int>(k_base(t));
      const int64_t blk0 = t.kr0 / kBlock;
      for (int kt = 0; kt < kt_n; ++kt) {
        bulk::mbar_wait(&empty[s], parity ^ 1u);
        if constexpr (!TW) {
          float* slot = slots + s * kSlot;
          const int64_t blk = blk0 + kt;
          // Rows of dC^T (clamped into N: rows past it are never stored), then
          // rows of A^T (clamped into K).
#pragma unroll
          for (int j = 0; j < (TM + 31) / 32; ++j)
            if (lane + 32 * j < TM)
              cp_async4(
                  slot + lane + 32 * j,
                  q.dc_scales + int64_t{min(m0 + lane + 32 * j, m_max)} * q.dc_s0 + blk * q.dc_s1);
#pragma unroll
          for (int j = 0; j < TN / 32; ++j)
            cp_async4(slot + TM + lane + 32 * j,
                      q.a_scales + int64_t{min(n0 + lane + 32 * j, n_max)} * q.a_s0 + blk * q.a_s1);
        }
        cp_async_arrive(&full[s]);  // (tensorwise: no copies, arrives at once)
        if (lane == 0) {
          uint8_t* stage = smem + s * T::kStageBytes;
          bulk::mbar_expect_tx(&full[s], T::kStageBytes);
          tma_load_2d(stage, &map_dc, &full[s], kr0 + kt * kTileK, m0);
          tma_load_2d(stage + T::kStageBytesA, &map_a, &full[s], kr0 + kt * kTileK, n0);
        }
        if (++s == stages) s = 0, parity ^= 1u;
      }
    }
    return;
  }

  setmaxnreg_inc<T::kConsumerRegs>();
  const int c = wg - 1;
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32;
  const int ctid = threadIdx.x - 128;  // among all consumer threads
  const int rl0 = warp * 16 + lane / 4;
  const uint32_t desc_a0 = static_cast<uint32_t>(sm90::smem_desc(smem + c * 64 * kTileK));
  const uint32_t desc_b0 = static_cast<uint32_t>(sm90::smem_desc(smem + T::kStageBytesA));
  constexpr uint64_t kDescHi = (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
  int s = 0;
  uint32_t parity = 0;
  int group = 0;
  int buf_i = 0;  // the warpgroup's next staging buffer
  for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileGeom t = geom(tile, group);
    group = t.group;
    const bool bad = misaligned(t);
    if (bad) {
      if (ctid == 0 && p.error) *p.error = 1;
      continue;
    }
    const int kt_n = __shfl_sync(0xffffffffu, k_tiles_of(t), 0);
    const int64_t base = k_base(t);
    const int head = static_cast<int>(t.kr0 - base);  // rows before the group (tensorwise)
    const int last_rows = kt_n > 0 ? static_cast<int>(t.k_lim - base) - (kt_n - 1) * kTileK : 0;
    const int ra = c * 64 + rl0;
    float acc[T::kAcc], part[T::kAcc];
#pragma unroll
    for (int i = 0; i < T::kAcc; ++i) acc[i] = 0.0f;
    // Every consumer thread zeroes its share of the rows outside the group
    // (past its real rows in the last slice, before its first row in the
    // first), so that no warpgroup's wgmma reads them.
    const auto zero_last = [&](int kt, int st) {
      const int lo = kt == 0 ? head : 0, hi = kt == kt_n - 1 ? last_rows : kTileK;
      if (lo > 0 || hi < kTileK) {
        zero_outside<T>(smem + st * T::kStageBytes, lo, hi, ctid, T::kConsumers * 128);
        sm90::fence_proxy_async();
        sm90tma::named_barrier(kBarZeroTail, T::kConsumers * 128);
      }
    };
    if constexpr (TW) {
      tensorwise_main_loop<TN, T::kAcc, (T::kStageBytes >> 4)>(acc, part, kt_n, q.promote, s,
                                                               parity, stages, full, empty, desc_a0,
                                                               desc_b0, lane, zero_last);
      const float ts = q.dc_scales[0] * q.a_scales[0];
#pragma unroll
      for (int i = 0; i < T::kAcc; ++i) acc[i] *= ts;
    }
    for (int kt = 0; kt < (TW ? 0 : kt_n); ++kt) {
      bulk::mbar_wait(&full[s], parity);
      zero_last(kt, s);
      const uint32_t off = static_cast<uint32_t>(s) * (T::kStageBytes >> 4);
      sm90::wgmma_fence();
      sm90::fence_operands(part);
#pragma unroll
      for (int ks = 0; ks < kTileK / 32; ++ks)
        Wgmma8<TN>::mma(part, kDescHi | (desc_a0 + off + 2 * ks), kDescHi | (desc_b0 + off + 2 * ks),
                        ks > 0 ? 1 : 0);
      sm90::wgmma_commit();
      const float* slot = slots + s * kSlot;
      const float a0 = slot[ra], a1 = slot[ra + 8];
      sm90::wgmma_wait<0>();
      sm90::fence_operands(part);
      // Fragment element i: row rl0 (+ 8 when i % 4 >= 2), column
      // 8 (i / 4) + 2 (lane % 4) + i % 2; its column scale from the slot.
      const float* col_scales = slot + TM + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < TN / 8; ++j) {
        const float2 b = *reinterpret_cast<const float2*>(col_scales + 8 * j);
        acc[4 * j + 0] = fmaf(part[4 * j + 0], a0 * b.x, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], a0 * b.y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], a1 * b.x, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], a1 * b.y, acc[4 * j + 3]);
      }
      // This warp is done with the stage and its slot (every lane's reads
      // ordered before lane 0's arrive).
      __syncwarp();
      if (lane == 0) bulk::mbar_arrive(&empty[s]);
      if (++s == stages) s = 0, parity ^= 1u;
    }
    if (kt_n == 0 && p.accumulate) continue;  // nothing to add
    if (q.tma_out)
      store_staged<T, TOut>(p, &map_dw, acc, t, c, tid, lane, rl0, staging, buf_i);
    else
      store_direct<T, TOut>(p, acc, t, ra, lane);
  }
  if (tid == 0) bulk::wait_all();  // the staged chunks are read before the block ends
#endif
}

}  // namespace moeflow::cuda::gemm::fp8
