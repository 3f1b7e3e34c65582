// The consumers' epilogue of the TMA grouped GEMM: the bias (through shared
// memory), then the 64 x 256 accumulators of each consumer warpgroup leave,
// chunk by chunk (64 rows x 128 bytes), through a ring of staging buffers in
// the 128-byte swizzled layout, by a TMA store / reduce-add issued by one
// thread or by masked 16-byte stores; in helper mode the chunks are staged in
// the last slice's pipeline stage and handed to the helper warps instead.
// A chunk holds 64 rows x 32 float32 or 64 x 64 bf16 / fp16 outputs.
#pragma once

#include "cuda/gemm/tma/named_barrier.cuh"
#include "cuda/gemm/tma/ptx.cuh"
#include "cuda/gemm/tma/tile_scheduler.cuh"

namespace moeflow::cuda::gemm::sm90tma {

// Where a consumer thread sits: warpgroup c (rows c*64 .. c*64+63 of the
// tile), thread tid of it, its lane and its first accumulator row rl0.
struct ConsumerThread {
  int c, tid, lane, rl0;
};

// After the main loop: the bias added to the accumulators (and, in helper
// mode, the rows' probabilities staged for the helpers).
template <typename Epi>
__device__ __forceinline__ void consumer_bias(const Epi& epi, float (&acc)[128],
                                              const typename Epi::Tile& ts, int stages, int bufs,
                                              bool& bias_parity, ConsumerThread th) {
  const int c = th.c, tid = th.tid, lane = th.lane, rl0 = th.rl0;
  uint32_t* my_bias = carve_smem<Epi>(stages, bufs).bias_smem + c * (Epi::kBiasSmem / 4);
  if constexpr (Epi::kHelperAct) {
    // Helper mode: the rows' probabilities for the helpers, at the start
    // of the warpgroup's bias area.
    epi.stage_probs(reinterpret_cast<float*>(my_bias), ts, rl0, lane);
    if constexpr (Epi::kConsumerBias) {
      // The bias, added to the accumulators (one rounding of the sum):
      // the tile's 256 column pairs, one per thread, through shared
      // memory, in the buffer of this tile's parity.
      if (epi.has_bias()) {  // uniform
        uint32_t* sb = my_bias + (kRowProbSmem + (bias_parity ? Epi::kBiasPairsSmem : 0)) / 4;
        bias_parity = !bias_parity;
        epi.stage_bias(sb, ts, tid);
        named_barrier(kBarConsumer + c, 128);
        epi.finish(acc, sb, lane);
      }
    }
  } else {
    if (epi.has_bias()) {                    // uniform
      named_barrier(kBarConsumer + c, 128);  // the previous tile's reads of my_bias are done
      epi.stage_bias(my_bias, ts, tid);
      named_barrier(kBarConsumer + c, 128);
    }
    epi.finish(acc, my_bias, lane);  // e.g. + bias
  }
}

// The tile's outputs of consumer warpgroup c (rows c*64 .. c*64+63).
template <typename TIn, typename TOut, int MODE, typename Epi>
__device__ __forceinline__ void consumer_store(const Params& p, const CUtensorMap& map_c,
                                               const CUtensorMap& map_raw, int stages, int bufs,
                                               StoreKind store_kind, const Epi& epi,
                                               float (&acc)[128], const Work& tw,
                                               const typename Epi::Tile& ts, int prev_s, int& buf_i,
                                               ConsumerThread th) {
  const SmemPtrs sm = carve_smem<Epi>(stages, bufs);
  uint8_t* smem = sm.smem;
  HelperBlock* hb = sm.hb;
  const int c = th.c, tid = th.tid, lane = th.lane, rl0 = th.rl0;
  const int warp = tid / 32;
  // (not in helper mode; one offset from the base, as the compiler folds it best)
  uint8_t* my_staging = sm.smem + (int64_t{stages * kStageBytes} + int64_t{c * bufs * kChunkBytes});
  // Epilogue. Fragment of thread (warp, lane): rows warp*16 + lane/4 (+8),
  // columns 8j + 2(lane%4) (+1), j = 0..31, in acc[4j + 2*half + {0,1}].
  const int wg_rows = min(64, tw.store_rows - c * 64);  // rows this warpgroup writes
  if constexpr (Epi::kHelperAct) {
    // Stage the 256 pre-activation columns (pad rows zero) in this
    // warpgroup's four chunks of the last slice's stage (HelperChunks)
    // and hand them to the helper warps. A pad-only tile (no K slices)
    // holds no stage and stages nothing: the helpers store zeros.
    const int data_rows = max(0, min(64, tw.data_rows - c * 64));
    const bool staged = tw.k_tiles > 0;
    // both warpgroups' wgmma reads of the stage are done
    if (staged) named_barrier(kBarEpilogue, 256);
    const HelperChunks chunks_of = helper_chunks(smem, stages, prev_s, c);
    if (wg_rows > 0 && staged) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint8_t* buf = chunks_of(q);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int rl = rl0 + half * 8;
            const int cl = jj * 8 + 2 * (lane % 4);
            const float2 v = rl < data_rows ? epi.raw_value(acc, q * 8 + jj, half, 0, 0)
                                            : make_float2(0.0f, 0.0f);
            Pack<TOut, 2> o;
            o.v[0] = from_float<TOut>(v.x);
            o.v[1] = from_float<TOut>(v.y);
            const int byte = cl * static_cast<int>(sizeof(TOut));
            *reinterpret_cast<Pack<TOut, 2>*>(buf + rl * 128 + (((byte >> 4) ^ (rl & 7)) << 4) +
                                              (byte & 15)) = o;
          }
        }
      }
      sm90::fence_proxy_async();  // generic-proxy writes -> visible to the TMA
    }
    if (tid == 0) {
      HelperInfo& inf = hb->info[c];
      inf.wg_row0 = int64_t{tw.m0} + c * 64;
      inf.wg_rows = max(0, wg_rows);
      inf.data_rows = data_rows;
      inf.tile_n = tw.n0 / kTileN;
      inf.tma = store_kind != StoreKind::kDirect && wg_rows == 64 && staged;
      inf.group = tw.group;
      inf.stage = staged ? prev_s : -1;
    }
    named_barrier_arrive(kBarStaged + c, kHandOverThreads);
  } else if (wg_rows > 0) {  // uniform over the warpgroup
    const int64_t wg_row0 = int64_t{tw.m0} + c * 64;
    // The TMA may write all 64 rows (rows past the matrix are clipped by the map).
    const bool tma = store_kind != StoreKind::kDirect && (MODE == 2 || wg_rows == 64);
    const int data_rows = max(0, min(64, tw.data_rows - c * 64));
    TOut* out = MODE == 2
                    ? const_cast<TOut*>(group_base<TOut>(p.c, p.c_ptrs, p.c_group_stride, tw.group))
                    : static_cast<TOut*>(p.c);
    constexpr int kCw = 128 / static_cast<int>(sizeof(TOut));  // columns per chunk
    constexpr int kVec = 16 / static_cast<int>(sizeof(TOut));  // elements per 16-byte piece
    // wgrad with accumulate (Megatron's fusion, or a .grad added into): a
    // TMA reduce-add of the chunk in dW's dtype, so the SMs never read dW;
    // a bf16 / fp16 dW gets the result rounded to its dtype, then added and
    // rounded by the L2 (autograd's grad += g). The masked copy does the same.
    auto emit = [&](const auto& value, const CUtensorMap* map, TOut* base, int64_t ld, int col0,
                    int64_t col_lim) {
      if (col0 >= col_lim) return;
      if (tid == 0) bulk_wait_read(bufs - 1);  // the store that last read this buffer is done
      named_barrier(kBarConsumer + c, 128);
      uint8_t* buf = my_staging + buf_i * kChunkBytes;
      if (++buf_i == bufs) buf_i = 0;
      // The chunk's values into the staging buffer.
      {
        if constexpr (sizeof(TOut) == 2) {
          // 2-byte outputs: stmatrix.x4 writes four 8 x 8 matrices of the
          // accumulator fragment per warp (fragment columns jj, jj + 1, row
          // halves 0, 1); lane l addresses row l % 8 of matrix l / 8.
          const int mi = lane / 8;
          const int r = warp * 16 + (mi & 1) * 8 + lane % 8;  // chunk row of the lane's address
          const uint32_t row_s = smem_u32(buf) + r * 128;
          auto stsm = [&](auto masked) {
#pragma unroll
            for (int jj = 0; jj < kCw / 8; jj += 2) {
              uint32_t reg[4];
#pragma unroll
              for (int m = 0; m < 4; ++m) {
                const int j2 = jj + m / 2, half = m % 2;
                const int cl = j2 * 8 + 2 * (lane % 4);
                // (masked: pad rows are stored as zeros)
                const bool data = !decltype(masked)::value || rl0 + half * 8 < data_rows;
                reg[m] = pack2<TOut>(data ? value(j2, half, col0 + cl) : make_float2(0.0f, 0.0f));
              }
              stmatrix_x4(row_s + (((jj + (mi >> 1)) ^ (r & 7)) << 4), reg);
            }
          };
          if (data_rows >= 64)  // uniform: every row of the warpgroup holds data
            stsm(std::false_type{});
          else
            stsm(std::true_type{});
        } else {
#pragma unroll
          for (int jj = 0; jj < kCw / 8; ++jj) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int rl = rl0 + half * 8;
              const int cl = jj * 8 + 2 * (lane % 4);
              const float2 v =
                  rl < data_rows ? value(jj, half, col0 + cl) : make_float2(0.0f, 0.0f);
              const int byte = cl * static_cast<int>(sizeof(TOut));
              st_shared_pair<TOut>(
                  smem_u32(buf) + rl * 128 + (((byte >> 4) ^ (rl & 7)) << 4) + (byte & 15), v);
            }
          }
        }
      }
      if (tma) sm90::fence_proxy_async();  // generic-proxy writes -> visible to the TMA
      named_barrier(kBarConsumer + c, 128);
      if (tma) {
        if (tid == 0) {
          if (store_kind == StoreKind::kTensor3d) {
            if (p.accumulate)
              tma_store_3d<true>(map, buf, col0, static_cast<int>(wg_row0), tw.group);
            else
              tma_store_3d<false>(map, buf, col0, static_cast<int>(wg_row0), tw.group);
          } else {
            tma_store_2d(map, buf, col0, static_cast<int>(wg_row0));
          }
          bulk_commit();
        }
      } else {
        // Masked copy: 64 rows x 8 pieces of 16 bytes, 4 per thread.
#pragma unroll
        for (int i = tid; i < 64 * 8; i += 128) {
          const int r = i / 8, piece = i % 8;
          const int64_t row = wg_row0 + r, col = col0 + piece * kVec;
          if (r >= wg_rows || col >= col_lim) continue;
          Pack<TOut, kVec> v =
              *reinterpret_cast<const Pack<TOut, kVec>*>(buf + r * 128 + ((piece ^ (r & 7)) << 4));
          Pack<TOut, kVec>* dst = reinterpret_cast<Pack<TOut, kVec>*>(base + row * ld + col);
          if (p.accumulate) {
            const Pack<TOut, kVec> old = *dst;
#pragma unroll
            for (int e = 0; e < kVec; ++e)
              v.v[e] = from_float<TOut>(to_float(old.v[e]) + to_float(v.v[e]));
          }
          *dst = v;
        }
      }
    };
    const int tile_n = tw.n0 / kTileN;
    if (epi.save_raw()) {  // the pre-activation tile (256 columns)
#pragma unroll
      for (int q = 0; q < kTileN / kCw; ++q) {
        const int rc = epi.raw_col(tile_n, q);
        // halves: chunks 0-1 are gate columns (< F), 2-3 up columns (F requires % 64 == 0)
        const int64_t lim = (Epi::kSplitB && q < 2) ? p.n_out / 2 : p.n_out;
        emit(
            [&](int jj, int half, int64_t col) {
              return epi.raw_value(acc, q * (kCw / 8) + jj, half, col, tw.group);
            },
            &map_raw, static_cast<TOut*>(epi.raw_ptr()), p.n_out, rc, lim);
      }
    }
    const int64_t out_cols = p.n_store > 0 ? p.n_store : p.n_out;
    // The functor's variant (e.g. the activation) is chosen once per tile,
    // so that each unrolled chunk loop holds one variant's code only.
    epi.dispatch([&](auto variant) {
#pragma unroll
      for (int q = 0; q < Epi::kOutCols / kCw; ++q) {
        emit(
            [&](int jj, int half, int64_t col) {
              return epi.value(variant, acc, q * (kCw / 8) + jj, half, col, tw.group, ts);
            },
            &map_c, out, p.ldc, tile_n * Epi::kOutCols + q * kCw, out_cols);
      }
    });
  }  // rows to store
}

}  // namespace moeflow::cuda::gemm::sm90tma
