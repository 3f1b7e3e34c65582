// The grouped GEMM (forward, dgrad, wgrad) on Hopper with TMA and warp
// specialisation (sm_90a): the fastest path, taken when the weights are one
// stacked tensor. This file wires the roles together; each role has its file:
// producer.cuh (TMA loads), consumer.cuh (wgmma main loop), epilogue.cuh
// (the consumers' stores), helpers.cuh (helper warps of the fused MLP
// epilogues); params.cuh (tile shape, shared memory), named_barrier.cuh,
// tile_scheduler.cuh (order of tiles and stages), ptx.cuh.
//
// Algorithm: the persistent tile walk of portable.cuh (device offsets,
// block scan of tile counts, binary search per tile) with 128 x 256 tiles and
// three warpgroups. Warpgroup 0 (one thread) is the producer: for every
// 64-wide K slice it waits for a free stage, arms the stage's "full"
// mbarrier with the byte count and issues two TMA loads (A rows of the tile,
// the 256 weight rows of the group) into the 128-byte swizzled layout wgmma
// reads. Warpgroups 1 and 2 consume: each owns 64 x 256 of the tile, waits
// for "full", issues wgmma.m64n256k16 from shared-memory descriptors, keeps
// one wgmma group in flight and frees the stage of the previous group through
// its "empty" mbarrier. The producer runs ahead into the next tile while the
// consumers run the epilogue of the previous one. The other warps of
// warpgroup 0 are the helpers of the fused MLP epilogues (helpers.cuh) or, in
// wgrad, zero the rows past a group in its last slice (consumer.cuh).
//
// Epilogue: each consumer warpgroup writes its 64 x 256 accumulators, chunk by
// chunk (64 rows x 128 bytes), into a ring of 2-5 8 KB staging buffers in the
// 128-byte swizzled layout, and one thread hands the chunk to the TMA unit
// (a tensor store, or for wgrad with accumulate a reduce-add in dW's dtype:
// a bf16 / fp16 dW gets autograd's grad += g arithmetic). The
// stores drain while the warpgroup already runs the next tile's main loop; a
// buffer is rewritten only after the TMA has read it. Where a warpgroup's 64
// rows run past the rows it may write (the tail of a group whose next rows
// belong to another expert), or no tensor map describes the output (dW as a
// pointer array), the warpgroup copies the chunk out with masked 16-byte
// stores instead.
//
// Rows the TMA box reads past a group's rows belong to the next group (or
// are zero past the matrix); they only feed output rows that are stored as
// zeros (pad rows) or not at all, so they never reach a result.
#pragma once

#include "cuda/gemm/tma/consumer.cuh"
#include "cuda/gemm/tma/helpers.cuh"
#include "cuda/gemm/tma/producer.cuh"

namespace moeflow::cuda::gemm::sm90tma {

// MODE 0, forward: A [rows,K] and W_e [N,K] K-major.
// MODE 1, dgrad: A = dC [rows,N] K-major; B = W_e read MN-major (its rows are
//   the reduction), four 64 x 64 boxes per slice.
// MODE 2, wgrad: groups split the reduction rows; A = dC^T and B = A read
//   MN-major from row boxes; the slice holding the group's last rows has the
//   rows past them zeroed in shared memory (they belong to pad rows or the next
//   group) by warps 1-3 of warpgroup 0, ahead of the consumers; the output is each group's dW (float32, or the inputs' bf16 /
//   fp16: float32 accumulators rounded once), stored or accumulated.
// The epilogue functor (epilogue_ops.cuh) maps the accumulators to the
// output: identity, or the fused FC1 bias + activation + probability scale,
// which also stores the pre-activation values through map_raw.
// GATHER (forward only): row m of A is row p.a_rows[m] (a template flag, so
// that the other kernels' producer carries none of its registers), read by
// the 128 threads of warpgroup 0 with cp.async, 8 threads per row (a 16-byte
// piece each: a warp's request covers four whole 128-byte lines).
template <typename TIn, typename TOut, int MODE, typename Epi = EpiIdentity, bool GATHER = false>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_tma_kernel(Params p, const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_w,
                            const __grid_constant__ CUtensorMap map_c,
                            const __grid_constant__ CUtensorMap map_raw, int stages, int bufs,
                            int stagger, int desync, int hold, StoreKind store_kind, Epi epi) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const SmemPtrs sm = carve_smem<Epi>(stages, bufs);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      // the producer's arrive (+ the TMA bytes); gathered A rows: + one
      // cp.async completion arrive per thread of warpgroup 0
      mbar_init(&sm.full[s], GATHER ? 1 + 128 : 1);
      mbar_init(&sm.empty[s], 2);  // one arrive per consumer warpgroup
    }
    mbar_init(sm.go, 1);
    for (int s = 0; s < kMaxStages; ++s) {
      mbar_init(&sm.zeroed[s], 1);
      mbar_init(&sm.zreq[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // The scan borrows the first pipeline stage (no load has been issued yet);
  // ends with a barrier.
  static_assert(sizeof(ScanScratch<kThreads>) <= kStageBytes, "scan scratch must fit in one stage");
  build_tile_prefix_in<kTileM, kTileN, kThreads>(
      p, sm.tile_start, *reinterpret_cast<ScanScratch<kThreads>*>(sm.smem));
  sm90::fence_proxy_async();  // the scan's generic writes, before TMA writes the stage
  __syncthreads();
  // Warp-uniform values broadcast from lane 0, so that the compiler keeps
  // what follows from them (trip counts, stage cursors, descriptors) in
  // uniform registers.
  const int32_t num_tiles = __shfl_sync(0xffffffffu, sm.tile_start[p.num_groups], 0);
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (wg == 0) {
    // Producer: one thread walks the same tiles and K slices as the consumers
    // (gathered A rows: the 128 threads of warpgroup 0, thread 0 issuing the
    // TMA loads).
    setmaxnreg_dec<kProducerRegs<Epi>>();
    static_assert(!GATHER || (MODE == 0 && !Epi::kHelperAct),
                  "gathered A rows: plain forward only");
    if (threadIdx.x == 0 || GATHER) {
      producer_mainloop<TIn, MODE, Epi, GATHER>(p, map_a, map_w, num_tiles, stages, bufs, desync,
                                                hold);
    } else if constexpr (Epi::kHelperAct) {
      if (threadIdx.x >= 32) helper_warps<TOut>(p, map_c, map_raw, num_tiles, stages, bufs, epi);
    } else if constexpr (MODE == 2) {
      if (threadIdx.x >= 32) wgrad_zero_warps<TIn, Epi>(p, num_tiles, stages, bufs);
    }
  } else {
    // Consumers: warpgroup c = wg - 1 owns rows c*64 .. c*64+63 of each tile.
    setmaxnreg_inc<kConsumerRegs<Epi>>();
    consumer_mainloop<TIn, TOut, MODE, Epi, GATHER>(p, map_c, map_raw, num_tiles, stages, bufs,
                                                    stagger, hold, store_kind, epi, wg);
  }
#endif
}

}  // namespace moeflow::cuda::gemm::sm90tma
