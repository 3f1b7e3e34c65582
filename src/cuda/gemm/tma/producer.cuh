// The producer of the TMA grouped GEMM (warpgroup 0, one thread; gathered
// A rows: all 128 threads): walks the same tiles and K slices as the
// consumers; for each slice it waits for a free stage, arms the stage's
// "full" mbarrier with the byte count and issues the TMA loads of the A and B
// boxes (or, for gathered A rows, cp.async of the rows in the TMA's swizzled
// layout).
#pragma once

#include "cuda/gemm/tma/ptx.cuh"
#include "cuda/gemm/tma/tile_scheduler.cuh"

namespace moeflow::cuda::gemm::sm90tma {

template <typename TIn, int MODE, typename Epi, bool GATHER>
__device__ __forceinline__ void producer_mainloop(const Params& p, const CUtensorMap& map_a,
                                                  const CUtensorMap& map_w, int32_t num_tiles,
                                                  int stages, int bufs, int desync, int hold) {
  const SmemPtrs sm = carve_smem<Epi>(stages, bufs);
  uint8_t* smem = sm.smem;
  uint64_t* full = sm.full;
  uint64_t* empty = sm.empty;
  const int32_t* tile_start = sm.tile_start;
  constexpr bool gather = GATHER;
  const bool leader = !gather || threadIdx.x == 0;
  // (hint: the group of the tile before, at or before the next tile's)
  auto loads_of = [&](int32_t tile, int hint) {
    return producer_loads<TIn, MODE, Epi>(p, tile_start, tile, hint);
  };
  // Desync: block b starts (b % 8) * desync thousand cycles late, so that
  // the blocks' epilogues (equal-length tiles end together) do not all
  // hit memory at once; a one-off cost of a few microseconds.
  if (desync > 0) {
    const long long until = clock64() + static_cast<long long>(blockIdx.x % 8) * desync * 1000;
    while (clock64() < until) {
    }
  }
  uint32_t it = 0;
  StageRing ring;
  int ps = 0;  // stage of the last slice issued
  Loads cur{};
  if (static_cast<int32_t>(blockIdx.x) < num_tiles) cur = loads_of(blockIdx.x, 0);
  for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    // The next tile's geometry is read after this tile's first loads are
    // issued, so its global-memory latency never starves the consumers.
    const int32_t next = tile + gridDim.x;
    Loads nxt{};
    bool have_next = false;
    // Gathered A: piece threadIdx.x % 8 of tile rows threadIdx.x / 8 + 16 i;
    // where their source rows start, in 16-byte units of A, and which
    // are zero rows (bit i of zrows), so that a slice costs one
    // multiply-add per piece (every instruction here slows the gather).
    uint32_t src16[8], zrows = 0;
    if constexpr (gather) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int64_t row = int64_t{cur.m0} + threadIdx.x / 8 + 16 * i;
        int32_t sr = cur.k_tiles > 0 && row < p.rows ? p.a_rows[row] : -1;
        if (sr >= p.a_src_rows) sr = -1;  // a bad map entry reads nothing (a zero row)
        src16[i] =
            sr < 0 ? 0u : static_cast<uint32_t>(int64_t{sr} * p.lda * int64_t{sizeof(TIn)} / 16);
        if (sr < 0) zrows |= 1u << i;
      }
    }
    for (int kt = 0; kt < cur.k_tiles; ++kt, ++it) {
      uint32_t parity;
      const int s = ring.next(it, stages, parity);
      ps = s;
      mbar_wait(&empty[s], parity ^ 1);
      uint8_t* stage = smem + s * kStageBytes;
      if constexpr (gather) {
        // A rows by cp.async into the 128-byte swizzled layout the TMA
        // would write (16-byte piece c of row r at piece c ^ (r % 8));
        // rows -1 and columns past K are zero-filled.
        const uint8_t* a = static_cast<const uint8_t*>(p.a);
        const int piece = threadIdx.x % 8;
        const int64_t col = int64_t{kt} * kTileK + piece * 8;
        // bytes read per piece: 0 past K and for zero rows (zero-filled,
        // nothing is read at the address)
        const uint32_t n = col < p.k_red ? 16u : 0u;
        const uint8_t* at = a + col * int64_t{sizeof(TIn)};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = threadIdx.x / 8 + 16 * i;
          const uint32_t bytes = (zrows >> i) & 1u ? 0u : n;
          const uint8_t* g = at + uint64_t{src16[i]} * 16;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                           smem_u32(stage + r * 128 + ((piece ^ (r & 7)) << 4))),
                       "l"(g), "r"(bytes)
                       : "memory");
        }
        asm volatile(
            "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&full[s]))
            : "memory");
      }
      if (!leader) {  // gathering threads: the A rows only
        if (kt == 0 && next < num_tiles) {
          nxt = loads_of(next, cur.group);
          have_next = true;
        }
        continue;
      }
      mbar_expect_tx(&full[s], gather ? kStageBytesB : kStageBytes);
      if constexpr (MODE == 2) {  // rows of dC and A: MN-major boxes
        const int r = cur.kr0 + kt * kTileK;
#pragma unroll
        for (int i = 0; i < kTileM / 64; ++i)
          tma_load_2d(stage + i * 8192, &map_a, &full[s], cur.m0 + i * 64, r);
#pragma unroll
        for (int i = 0; i < kTileN / 64; ++i)
          tma_load_2d(stage + kStageBytesA + i * 8192, &map_w, &full[s], cur.n0 + i * 64, r);
        if (kt == cur.k_tiles - 1 && cur.last_rows < kTileK) mbar_arrive(&sm.zreq[s]);
      } else {
        if (!gather) tma_load_2d(stage, &map_a, &full[s], kt * kTileK, cur.m0);
        if constexpr (MODE == 1) {
          // NOTE: reduction rows past N read the next expert's rows; they meet
          // the zero-filled columns of A (dC) past N and add nothing.
#pragma unroll
          for (int i = 0; i < kTileN / 64; ++i)
            tma_load_2d(stage + kStageBytesA + i * 8192, &map_w, &full[s], cur.n0 + i * 64,
                        cur.w_row + kt * kTileK);
        } else if constexpr (Epi::kSplitB) {  // gate rows, then their up rows
          tma_load_2d(stage + kStageBytesA, &map_w, &full[s], kt * kTileK, cur.w_row);
          tma_load_2d(stage + kStageBytesA + kStageBytesB / 2, &map_w, &full[s], kt * kTileK,
                      cur.w_row + p.n_out / 2);
        } else {
          tma_load_2d(stage + kStageBytesA, &map_w, &full[s], kt * kTileK, cur.w_row);
        }
      }
      if (kt == 0 && next < num_tiles) {
        nxt = loads_of(next, cur.group);
        have_next = true;
      }
    }
    if (!have_next && next < num_tiles) nxt = loads_of(next, cur.group);
    if constexpr (Epi::kHelperAct) {
      if (cur.k_tiles > 0) ring.hold_stage(ps, it, hold);
    }
    cur = nxt;
  }
}

}  // namespace moeflow::cuda::gemm::sm90tma
