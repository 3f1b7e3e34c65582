// The order of work in the TMA grouped GEMM. Tiles: a persistent walk,
// block b takes tiles b, b + gridDim.x, ... of the prefix over all groups'
// tile counts (build_tile_prefix_in / tile_geometry of portable.cuh, which
// also order the m tiles in raster bands). Stages: every role steps the same
// StageRing over the tiles' K slices.
#pragma once

#include "cuda/gemm/tma/params.cuh"

namespace moeflow::cuda::gemm::sm90tma {

// The order in which the producer fills and the consumers drain the stages;
// both sides step it identically (it depends on the tiles' slice counts
// only). A plain ring, except that after a tile the stage of its last slice
// (held for the helpers) is skipped until `hold` more slices were issued.
// Every use of a stage is guarded by its mbarriers, so any common order is
// correct; the parity of stage s's barriers is bit s of `bits`.
struct StageRing {
  int cur = 0;    // the ring position of the next slice
  int excl = -1;  // the held stage, skipped while it < excl_until
  uint32_t excl_until = 0;
  uint32_t bits = 0;
  // The stage of slice `it` and its phase parity.
  __device__ __forceinline__ int next(uint32_t it, int stages, uint32_t& parity) {
    int s = cur;
    if (++cur == stages) cur = 0;
    if (s == excl && it < excl_until) {
      s = cur;
      if (++cur == stages) cur = 0;
    }
    parity = (bits >> s) & 1u;
    bits ^= 1u << s;
    return s;
  }
  // After a tile whose last slice `it - 1` used stage `last`.
  __device__ __forceinline__ void hold_stage(int last, uint32_t it, int hold) {
    excl = last;
    excl_until = it + static_cast<uint32_t>(hold);
  }
};

// What the producer needs of a tile, in 32-bit (the TMA path keeps rows < 2^31).
struct Loads {
  int k_tiles, m0, n0, kr0, w_row, group;
  int last_rows;  // rows of the final slice (wgrad)
};
template <typename TIn, int MODE, typename Epi>
__device__ __forceinline__ Loads producer_loads(const Params& p, const int32_t* tile_start,
                                                int32_t tile, int hint = 0) {
  const TileGeom tg = tile_geometry<kTileM, kTileN, TIn>(p, tile_start, tile, hint);
  Loads l;
  l.k_tiles = tg.m0 >= tg.m_lim ? 0 : static_cast<int>(ceil_div_dev(tg.k_lim - tg.kr0, kTileK));
  l.m0 = static_cast<int>(tg.m0);
  l.n0 = static_cast<int>(tg.n0);
  l.kr0 = static_cast<int>(tg.kr0);
  l.group = tg.group;
  l.last_rows = static_cast<int>(tg.k_lim - tg.kr0 - int64_t{l.k_tiles - 1} * kTileK);
  l.w_row = static_cast<int>(int64_t{tg.group} * (MODE == 1 ? p.k_red : p.n_out) +
                             (MODE == 1 ? 0 : (Epi::kSplitB ? tg.n0 / 2 : tg.n0)));
  return l;
}

// What the consumers need of a tile, in 32-bit (the TMA path keeps rows
// < 2^31): few registers stay live next to the 128 accumulators.
struct Work {
  int k_tiles, last_rows;  // slices; rows of the final slice (wgrad)
  int m0, n0, group;
  int store_rows, data_rows;  // tile rows that are written / hold data (0..128)
};
template <typename TIn>
__device__ __forceinline__ Work consumer_work(const Params& p, const int32_t* tile_start,
                                              int32_t tile, int hint = 0) {
  const TileGeom tg = tile_geometry<kTileM, kTileN, TIn>(p, tile_start, tile, hint);
  const int64_t red = tg.k_lim - tg.kr0;
  Work w;
  w.k_tiles = tg.m0 >= tg.m_lim ? 0 : static_cast<int>(ceil_div_dev(red, kTileK));
  w.last_rows = static_cast<int>(red - int64_t{w.k_tiles - 1} * kTileK);
  w.m0 = static_cast<int>(tg.m0);
  w.n0 = static_cast<int>(tg.n0);
  w.group = tg.group;
  w.store_rows = static_cast<int>(min(int64_t{kTileM}, max(int64_t{0}, tg.store_hi - tg.m0)));
  w.data_rows = static_cast<int>(min(int64_t{kTileM}, max(int64_t{0}, tg.data_rows)));
  return w;
}

}  // namespace moeflow::cuda::gemm::sm90tma
