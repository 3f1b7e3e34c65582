// The helper warps of the TMA grouped GEMM's helper mode (Epi::kHelperAct:
// the fused FC1 and the fused dGLU; warps 1-3 of the producer warpgroup).
// The consumers stage their tile's pre-activation (or d(a)) chunks in shared
// memory and hand them over through named barriers; the helpers store them,
// apply the activation (or the dGLU) in place and store the result, so that
// the consumers go on to the next tile's main loop meanwhile.
#pragma once

#include "cuda/gemm/tma/named_barrier.cuh"
#include "cuda/gemm/tma/ptx.cuh"

namespace moeflow::cuda::gemm::sm90tma {

// Helper warps, fused dGLU (EpiMlpDglu): units of one row and 8 columns (one
// 16-byte piece) of the staged d(a) tile (64 rows x 32 units), strided over
// the 96 helpers (neighbouring helpers take neighbouring columns of a row:
// coalesced loads of h and stores of d(h)). Units of 8 columns keep the
// helpers within their registers (16-column units spilled at 56). A unit's
// partial <d(a), act(h)> overwrites its own staged bytes; after a barrier
// helper r < 64 adds row r's 32 partials in column order (deterministic) and
// writes the tile's partial for the row. A pad-only tile (inf.stage < 0)
// staged nothing: its d(h) rows are zeros and so are its partials.
template <typename Epi>
__device__ __forceinline__ void help_dglu(const Epi& epi, const HelperInfo& inf,
                                          const HelperChunks& st, const float* probs_sm, int htid) {
  constexpr int kHelpers = 96;
  const bool staged = inf.stage >= 0;
  auto slot = [&](int r, int unit) {  // piece unit%8 of chunk unit/8
    return st(unit / 8) + r * 128 + (((unit % 8) ^ (r & 7)) << 4);
  };
  epi.dispatch([&](auto variant) {
  // (two units per step: the loads of h of both are in flight together)
#pragma unroll 2
    for (int i = htid; i < 64 * 32; i += kHelpers) {
      const int r = i / 32, unit = i % 32;
      if (r >= inf.wg_rows) continue;
      const int64_t j0 = int64_t{inf.tile_n} * kTileN + unit * 8;
      float dp = 0.0f;
      uint8_t* s0 = slot(r, unit);
      if (j0 < epi.f) {
        using P = Pack<typename std::remove_pointer<decltype(epi.d_h)>::type, 8>;
        const P da = staged ? *reinterpret_cast<const P*>(s0) : P{};
        const bool data = staged && r < inf.data_rows;
        const float prob = data ? epi.staged_prob(probs_sm, r) : 1.0f;
        dp = epi.dglu8(variant, inf.wg_row0 + r, j0, da, data, prob);
      }
      if (staged) *reinterpret_cast<float*>(s0) = dp;
    }
  });
  named_barrier(kBarHelpers, kHelpers);
  if (epi.part != nullptr && htid < inf.wg_rows) {
    float sum = 0.0f;
    if (staged) {
#pragma unroll
      for (int unit = 0; unit < 32; ++unit)
        sum += *reinterpret_cast<const float*>(slot(htid, unit));
    }
    epi.part[(inf.wg_row0 + htid) * epi.part_ld + inf.tile_n] = sum;
  }
  named_barrier(kBarHelpers, kHelpers);  // every helper's reads of the chunks are done
}

// Helper warps 1-3: for each tile and consumer warpgroup in order, store
// the staged pre-activation chunks, apply the activation in place over
// them and store the activation chunks, then hand the buffers back (and
// release the stage that held them once both warpgroups' are done).
template <typename TOut, typename Epi>
__device__ __forceinline__ void helper_warps(const Params& p, const CUtensorMap& map_c,
                                             const CUtensorMap& map_raw, int32_t num_tiles,
                                             int stages, int bufs, const Epi& epi) {
  const SmemPtrs sm = carve_smem<Epi>(stages, bufs);
  uint8_t* smem = sm.smem;
  uint64_t* empty = sm.empty;
  const HelperBlock* hb = sm.hb;
  const uint32_t* bias_smem = sm.bias_smem;
  const int htid = threadIdx.x - 32;  // 0..95
  constexpr int kHelpers = 96;
  constexpr int kCw = 128 / static_cast<int>(sizeof(TOut));
  constexpr int kVec = 16 / static_cast<int>(sizeof(TOut));
  constexpr int kActChunks = Epi::kOutCols / kCw;
  const int64_t out_cols = p.n_store > 0 ? p.n_store : p.n_out;
  // Masked copy of staged chunk `buf` (null: zeros) to columns
  // [col0, col0 + kCw) of rows [row0, row0 + rows) of `base` (row
  // length ld, columns < lim).
  auto copy_out = [&](const uint8_t* buf, TOut* base, int64_t ld, int64_t row0, int rows,
                      int64_t col0, int64_t lim) {
    for (int i = htid; i < 64 * 8; i += kHelpers) {
      const int r = i / 8, piece = i % 8;
      const int64_t col = col0 + piece * kVec;
      if (r >= rows || col >= lim) continue;
      *reinterpret_cast<Pack<TOut, kVec>*>(base + (row0 + r) * ld + col) =
          buf != nullptr
              ? *reinterpret_cast<const Pack<TOut, kVec>*>(buf + r * 128 + ((piece ^ (r & 7)) << 4))
              : Pack<TOut, kVec>{};
    }
  };
  // Staged chunk `buf` to columns [col0, col0 + kCw) of the warpgroup's
  // rows: a TMA store (L2 evict-first: not read again soon) issued by
  // one helper, or masked copies by all.
  auto store_chunk = [&](const HelperInfo& inf, const CUtensorMap* map, const uint8_t* buf,
                         TOut* base, int64_t ld, int64_t col0, int64_t lim) {
    if (inf.tma) {
      if (htid == 0)
        tma_store_2d_stream(map, buf, static_cast<int>(col0), static_cast<int>(inf.wg_row0));
    } else {
      copy_out(buf, base, ld, inf.wg_row0, inf.wg_rows, col0, lim);
    }
  };
  for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    for (int cw = 0; cw < 2; ++cw) {
      named_barrier(kBarStaged + cw, kHandOverThreads);
      const HelperInfo inf = hb->info[cw];
      // (a pad-only tile staged nothing: its rows are stored as zeros)
      const bool staged = inf.stage >= 0;
      const HelperChunks st = staged ? helper_chunks(smem, stages, inf.stage, cw) : HelperChunks{};
      auto chunk = [&](int q) -> const uint8_t* { return staged ? st(q) : nullptr; };
      const float* probs_sm = reinterpret_cast<const float*>(bias_smem) + cw * (Epi::kBiasSmem / 4);
      if constexpr (Epi::kDglu) {
        if (inf.wg_rows > 0) help_dglu(epi, inf, st, probs_sm, htid);
      } else if (inf.wg_rows > 0) {
        if (epi.save_raw()) {
          // Gated (halves): the activation overwrites chunks 0-1 only
          // and reads 2-3, so it waits for the first bulk group (the
          // TMA's reads of chunks 0-1), not for the second.
          constexpr bool kTwoGroups = Epi::GATED && kActChunks <= 2;
          for (int q = 0; q < kTileN / kCw; ++q) {
            const int64_t col0 = epi.raw_col(inf.tile_n, q);
            const int64_t lim = (Epi::kSplitB && q < 2) ? p.n_out / 2 : p.n_out;
            if (col0 < lim)
              store_chunk(inf, &map_raw, chunk(q), static_cast<TOut*>(epi.raw_ptr()), p.n_out, col0,
                          lim);
            if (kTwoGroups && q == 1 && inf.tma && htid == 0) bulk_commit();
          }
          if (inf.tma && htid == 0) {
            bulk_commit();
            // the chunks are rewritten in place next
            bulk_wait_read(kTwoGroups ? 1 : 0);
          }
        }
        named_barrier(kBarHelpers, kHelpers);
        if (staged)
          epi.dispatch([&](auto variant) {
            for (int i = htid; i < kActChunks * 64 * 8; i += kHelpers) {
              const int q = i / 512, r = (i / 8) % 64, piece = i % 8;
              const int off = r * 128 + ((piece ^ (r & 7)) << 4);
              uint8_t* gp = st(q) + off;
              const Pack<TOut, kVec> g = *reinterpret_cast<const Pack<TOut, kVec>*>(gp);
              Pack<TOut, kVec> u{};
              if constexpr (Epi::GATED)
                u = *reinterpret_cast<const Pack<TOut, kVec>*>(st(q + 2) + off);
              const float prob = r < inf.data_rows ? epi.staged_prob(probs_sm, r) : 0.0f;
              Pack<TOut, kVec> o;
#pragma unroll
              for (int e = 0; e < kVec; ++e)
                o.v[e] = from_float<TOut>(epi.act_value(
                    variant, to_float(g.v[e]), Epi::GATED ? to_float(u.v[e]) : 0.0f, prob));
              *reinterpret_cast<Pack<TOut, kVec>*>(gp) = o;
            }
          });
        if (inf.tma) sm90::fence_proxy_async();
        named_barrier(kBarHelpers, kHelpers);
        for (int q = 0; q < kActChunks; ++q) {
          const int64_t col0 = int64_t{inf.tile_n} * Epi::kOutCols + q * kCw;
          if (col0 < out_cols)
            store_chunk(inf, &map_c, chunk(q), static_cast<TOut*>(p.c), p.ldc, col0, out_cols);
        }
        if (inf.tma && htid == 0) {
          bulk_commit();
          bulk_wait_read(0);  // the chunks may be rewritten once released
        }
      }
      if (staged) {
        // Release this warpgroup's share of the stage (the "empty"
        // barrier counts one arrive per warpgroup) once every helper's
        // accesses of the chunks are done, ordered before the TMA
        // writes the stage again. (A pad-only tile's helpers read no
        // chunks; their bar.arrive below orders their other accesses.)
        sm90::fence_proxy_async();
        named_barrier(kBarHelpers, kHelpers);
        if (htid == 0) mbar_arrive(&empty[inf.stage]);
      }
      if (tile + static_cast<int32_t>(gridDim.x) < num_tiles)
        named_barrier_arrive(kBarFreed + cw, kHandOverThreads);
    }
  }
  if (htid == 0) bulk_wait_all();
}

}  // namespace moeflow::cuda::gemm::sm90tma
