// The consumers of the TMA grouped GEMM (warpgroups 1 and 2): each owns 64
// rows of the 128 x 256 tile, waits for a stage's "full" mbarrier, issues
// wgmma.m64n256k16 from shared-memory descriptors, keeps one wgmma group in
// flight and frees the stage of the previous group through its "empty"
// mbarrier; then the epilogue (epilogue.cuh) while the producer already
// loads the next tile.
#pragma once

#include "cuda/gemm/tma/epilogue.cuh"

namespace moeflow::cuda::gemm::sm90tma {

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
// matter. Run by NT threads (tid 0..NT-1); constant divisions only.
template <int NT>
__device__ __forceinline__ void zero_slice_rows(uint8_t* base, int blocks, int from, int tid) {
  for (int i = tid; i < blocks * 64 * 8; i += NT) {
    const int r = (i / 8) % 64;
    if (r >= from) *reinterpret_cast<uint4*>(base + i * 16) = make_uint4(0, 0, 0, 0);
  }
}

// wgrad: warps 1-3 of warpgroup 0 (idle in the plain GEMM) zero the rows past
// the group in each tile's last slice (both operands: dC^T's 128 columns and
// A's 256, six 8 KB blocks in a row) as soon as its loads land, while the
// consumers still work on earlier slices; the consumers only wait on
// zeroed[s]. They step the same StageRing as the other roles. The producer
// posts each such slice on zreq[s] after issuing its loads, so that the wait
// on full[s] is for that slice's phase (a stage's requests cannot overtake:
// the next one at s needs the consumers to have released this one).
template <typename TIn, typename Epi>
__device__ __forceinline__ void wgrad_zero_warps(const Params& p, int32_t num_tiles, int stages,
                                                 int bufs) {
  constexpr int kZeroThreads = 96;
  const SmemPtrs sm = carve_smem<Epi>(stages, bufs);
  const int tid = threadIdx.x - 32;
  uint32_t it = 0, req_phase = 0;
  StageRing ring;
  for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const Work w = consumer_work<TIn>(p, sm.tile_start, tile);
    if (w.k_tiles == 0) continue;
    uint32_t parity;
    for (int kt = 0; kt + 1 < w.k_tiles; ++kt, ++it) ring.next(it, stages, parity);
    const int s = ring.next(it, stages, parity);
    ++it;
    if (w.last_rows >= kTileK) continue;
    mbar_wait(&sm.zreq[s], (req_phase >> s) & 1u);
    req_phase ^= 1u << s;
    mbar_wait(&sm.full[s], parity);
    zero_slice_rows<kZeroThreads>(sm.smem + s * kStageBytes, 6, w.last_rows, tid);
    sm90::fence_proxy_async();  // the generic stores, before the wgmma reads
    named_barrier(kBarHelpers, kZeroThreads);
    if (tid == 0) mbar_arrive(&sm.zeroed[s]);
  }
}
static_assert(kStageBytesA + kStageBytesB == 6 * 8192, "a wgrad slice: six 64 x 64 blocks");

template <typename TIn, typename TOut, int MODE, typename Epi, bool GATHER>
__device__ __forceinline__ void consumer_mainloop(const Params& p, const CUtensorMap& map_c,
                                                  const CUtensorMap& map_raw, int32_t num_tiles,
                                                  int stages, int bufs, int stagger, int hold,
                                                  StoreKind store_kind, const Epi& epi, int wg) {
  const SmemPtrs sm = carve_smem<Epi>(stages, bufs);
  uint8_t* smem = sm.smem;
  uint64_t* full = sm.full;
  uint64_t* empty = sm.empty;
  uint64_t* go = sm.go;
  const int32_t* tile_start = sm.tile_start;
  const int c = wg - 1;
  const int tid = threadIdx.x % 128, lane = threadIdx.x % 32, warp = tid / 32;
  auto work_of = [&](int32_t tile, int hint) {
    return consumer_work<TIn>(p, tile_start, tile, hint);
  };
  uint32_t it = 0, zero_phase = 0;
  StageRing ring;
  int prev_s = 0, buf_i = 0;  // stage of slice it-1; staging buffer
  bool bias_parity = false;   // helper mode: which of the two bias buffers
  // Stagger: consumer 1 starts `stagger` K slices after consumer 0, so the
  // two warpgroups reach their epilogues at different times and one keeps
  // the tensor cores busy while the other stores (the stages are shared:
  // the lag is bounded by the pipeline depth).
  bool go_sent = c == 1 || stagger <= 0;
  if (c == 1 && stagger > 0) mbar_wait(go, 0);
  Work tw{};
  if (static_cast<int32_t>(blockIdx.x) < num_tiles) tw = work_of(blockIdx.x, 0);
  for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int32_t next = tile + gridDim.x;
    // The next tile's geometry (a search of the group table, global loads,
    // divisions), worked out once the first slice's wgmma runs, so that it
    // hides behind the tensor cores rather than delaying either end.
    Work nw{};
    bool have_next = false;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    sm90::fence_operands(acc);  // start values in place before the first wgmma
    // The epilogue's loads (probabilities, bias) are issued now: their
    // latency hides behind the main loop.
    const int rl0 = warp * 16 + lane / 4;  // the thread's first row in the warpgroup's 64
    const typename Epi::Tile ts = epi.load_tile(tw.group, tw.n0, tid, lane, int64_t{tw.m0} + c * 64,
                                                rl0, max(0, min(64, tw.data_rows - c * 64)));
    for (int kt = 0; kt < tw.k_tiles; ++kt, ++it) {
      uint32_t parity;
      const int s = ring.next(it, stages, parity);
      mbar_wait(&full[s], parity);
      // gathered A rows came by cp.async (generic proxy): order them before
      // the wgmma reads (async proxy)
      if constexpr (GATHER) sm90::fence_proxy_async();
      if constexpr (MODE == 2) {
        if (kt == tw.k_tiles - 1 && tw.last_rows < kTileK) {
          mbar_wait(&sm.zeroed[s], (zero_phase >> s) & 1u);  // wgrad_zero_warps
          zero_phase ^= 1u << s;
          sm90::fence_proxy_async();
        }
      }
      const TIn* sa = reinterpret_cast<const TIn*>(smem + s * kStageBytes) +
                      (MODE == 2 ? c * 64 * 64 : c * 64 * kTileK);
      const TIn* sb = reinterpret_cast<const TIn*>(smem + s * kStageBytes + kStageBytesA);
      // The slice's descriptors once; a K step moves only the start address
      // field (address / 16: 16 K-major elements, or 16 MN-major rows of 64;
      // shared addresses stay below the field's 256 KB).
      const uint64_t da = MODE == 2 ? smem_desc_mn(sa) : sm90::smem_desc(sa);
      const uint64_t db = MODE == 0 ? sm90::smem_desc(sb) : smem_desc_mn(sb);
      constexpr uint64_t kKMajor = 16 * sizeof(TIn) / 16, kMnMajor = 16 * 64 * sizeof(TIn) / 16;
      constexpr uint64_t kStepA = MODE == 2 ? kMnMajor : kKMajor;
      constexpr uint64_t kStepB = MODE == 0 ? kKMajor : kMnMajor;
      sm90::wgmma_fence();
      sm90::fence_operands(acc);
#pragma unroll
      for (int ks = 0; ks < kTileK / 16; ++ks) {
        using Mma = sm90::Wgmma<TIn, kTileN>;
        if constexpr (MODE == 2)  // both MN-major: 16 K rows of 128 bytes per step
          Mma::template mma<1, 1>(acc, da + kStepA * ks, db + kStepB * ks);
        else if constexpr (MODE == 1)
          Mma::template mma<0, 1>(acc, da + kStepA * ks, db + kStepB * ks);
        else
          Mma::template mma<0, 0>(acc, da + kStepA * ks, db + kStepB * ks);
      }
      sm90::wgmma_commit();
      if (kt == 0 && next < num_tiles) {
        nw = work_of(next, tw.group);
        have_next = true;
      }
      sm90::wgmma_wait<1>();
      sm90::fence_operands(acc);
      // NOTE: the group of slice it-1 is complete: its stage is free again.
      if (kt > 0 && tid == 0) mbar_arrive(&empty[prev_s]);
      prev_s = s;
      if (!go_sent && static_cast<int>(it) + 1 >= stagger) {
        if (tid == 0) mbar_arrive(go);
        go_sent = true;
      }
    }
    if (!have_next && next < num_tiles) nw = work_of(next, tw.group);
    sm90::wgmma_wait<0>();
    sm90::fence_operands(acc);
    if constexpr (Epi::kHelperAct) {
      // The last slice's stage holds the staged chunks: the helpers release
      // it, and the ring skips it for a while. Wait until the helpers are
      // done with the dedicated chunks and the probabilities this warpgroup
      // last handed them.
      if (tw.k_tiles > 0) ring.hold_stage(prev_s, it, hold);
      if (tile != static_cast<int32_t>(blockIdx.x)) named_barrier(kBarFreed + c, kHandOverThreads);
    } else {
      if (tw.k_tiles > 0 && tid == 0) mbar_arrive(&empty[prev_s]);
    }
    const ConsumerThread th{c, tid, lane, rl0};
    consumer_bias(epi, acc, ts, stages, bufs, bias_parity, th);
    consumer_store<TIn, TOut, MODE>(p, map_c, map_raw, stages, bufs, store_kind, epi, acc, tw, ts,
                                    prev_s, buf_i, th);
    tw = nw;
  }
  if (!go_sent && tid == 0) mbar_arrive(go);  // fewer slices than the stagger
  if (tid == 0) bulk_wait_all();
}

}  // namespace moeflow::cuda::gemm::sm90tma
