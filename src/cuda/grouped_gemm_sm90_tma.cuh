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
// consumers run the epilogue of the previous one.
//
// Epilogue: each consumer warpgroup writes its 64 x 256 accumulators, chunk by
// chunk (64 rows x 128 bytes), into a ring of 2-5 8 KB staging buffers in the
// 128-byte swizzled layout, and one thread hands the chunk to the TMA unit
// (a tensor store, or a float32 reduce-add for wgrad with beta = 1). The
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

#include <cuda.h>

#include "cuda/bulk.cuh"
#include "cuda/gemm_epilogue.cuh"
#include "cuda/grouped_gemm_sm90.cuh"

namespace moeflow::cuda::gemm::sm90tma {

constexpr int kTileM = 128;
constexpr int kTileN = 256;
constexpr int kTileK = 64;
constexpr int kMaxStages = 4;  // 3 when the group table leaves no room for 4
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kStageBytesA = kTileM * kTileK * 2;
constexpr int kStageBytesB = kTileN * kTileK * 2;
constexpr int kStageBytes = kStageBytesA + kStageBytesB;
constexpr int kChunkBytes = 64 * 128;  // one staging buffer: 64 rows x 128 bytes
constexpr int kMaxBufs = 5;            // staging buffers per consumer warpgroup: 2..5

// Helper mode (Epi::kHelperAct): what a consumer warpgroup tells the helper
// warps about the chunks it staged. Hand-over through named barriers
// (bar.arrive by one side, bar.sync by the other, 128 + 96 threads): id
// kStagedBar + c "consumer c staged its chunks", kFreedBar + c "the helpers
// are done with consumer c's chunks and probabilities" (skipped before the
// first tile and after the last).
// kEpiBar (256 consumer threads): both warpgroups' wgmma reads of the tile's
// last stage are done, so its bytes may hold staged chunks.
constexpr int kHelperBar = 1, kStagedBar = 4, kFreedBar = 6, kEpiBar = 8, kHandOver = 128 + 96;
struct HelperInfo {
  int64_t wg_row0;  // global row of the warpgroup's first row
  int wg_rows;      // rows to store (0..64)
  int data_rows;    // rows holding data (the rest are pad rows)
  int tile_n;       // 256-column tile index
  int tma;          // stored by the TMA (else masked 16-byte copies)
  int group;
  int stage;        // pipeline stage holding the chunks (-1: a pad-only tile, nothing staged)
};
// Helper mode keeps the four 64-column chunks of each consumer warpgroup's
// tile in the pipeline stage of the tile's last K slice, which the consumers
// do not release: warpgroup 0's in the 32 KB of B, warpgroup 1's first two in
// the 16 KB of A and its last two in 16 KB of dedicated staging (the only
// staging helper mode adds to the stages, so four stages fit). The helpers
// release the stage once they are done with both warpgroups' chunks. Meanwhile
// the ring of stages skips the held one (StageRing) for `hold` K slices, so
// the next tile's first slices run with stages - 1 in flight and the rest
// with all of them.
// Chunks 0-1 (gate, or the first half) lie at lo, 2-3 at lo + hi_delta (one
// pointer and an offset: the helpers have few registers to spare).
struct HelperChunks {
  uint8_t* lo;
  int32_t hi_delta;
  __device__ __forceinline__ uint8_t* operator()(int q) const {
    return lo + (q < 2 ? 0 : hi_delta) + (q & 1) * kChunkBytes;
  }
};
__device__ __forceinline__ HelperChunks helper_chunks(uint8_t* smem, int stages, int stage,
                                                      int wg) {
  const int32_t st = stage * kStageBytes;
  return wg == 0 ? HelperChunks{smem + st + kStageBytesA, 2 * kChunkBytes}
                 : HelperChunks{smem + st, stages * kStageBytes - st};
}
static_assert(kStageBytesA == 2 * kChunkBytes && kStageBytesB == 4 * kChunkBytes,
              "helper-mode chunks fill a stage");

// The order in which the producer fills and the consumers drain the stages;
// both sides step it identically (it depends on the tiles' slice counts
// only). A plain ring, except that after a tile the stage of its last slice
// (held for the helpers) is skipped until `hold` more slices were issued.
// Every use of a stage is guarded by its mbarriers, so any common order is
// correct; the parity of stage s's barriers is bit s of `bits`.
struct StageRing {
  int cur = 0;               // the ring position of the next slice
  int excl = -1;             // the held stage, skipped while it < excl_until
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
// Registers per thread after setmaxnreg: the producer warpgroup (helper mode:
// warp 0 the TMA producer, warps 1-3 the helpers) and the consumer
// warpgroups; 128 x producer + 256 x consumer = 384 x 168, what the launch
// bound gives a block. Helper mode gives the helpers 72 (with 56 the fused
// FC1's helpers spilled 64 bytes, the fused dGLU's up to 108), which leaves
// the consumers 216 (their 128 accumulators fit without spills); the plain
// GEMMs keep 56 / 224.
template <typename Epi>
constexpr int kProducerRegs = Epi::kHelperAct ? 72 : 56;
template <typename Epi>
constexpr int kConsumerRegs = Epi::kHelperAct ? 216 : 224;
static_assert(128 * 72 + 256 * 216 == 384 * 168 && 128 * 56 + 256 * 224 == 384 * 168,
              "the register split fills the block's registers");
// Dedicated staging chunks (both warpgroups).
template <typename Epi>
constexpr int staging_chunks(int bufs) {
  return Epi::kHelperAct ? 2 : 2 * bufs;
}
struct HelperBlock {
  HelperInfo info[2];
};

struct Smem {
  // stages (1024-aligned) | staging (staging_chunks()) | bias (2 x Epi::kBiasSmem) |
  // full[] | empty[] | go |
  // zeroed[] | claim[] + broadcast[2] | tile_start[E+1]
  static size_t bytes(int stages, int chunks, int num_groups, int bias_smem) {
    return 1024 + size_t(stages) * kStageBytes + size_t(chunks) * kChunkBytes +
           size_t(2 * bias_smem) + sizeof(HelperBlock) +
           (3 * kMaxStages + 1) * 8 + (kMaxStages + 2) * 4 + size_t(num_groups + 1) * 4;
  }
};

// How the epilogue leaves the kernel (see the header comment).
enum class StoreKind : int { kDirect = 0, kTensor2d = 1, kTensor3d = 2 };

using bulk::mbar_arrive;
using bulk::mbar_expect_tx;
using bulk::mbar_init;
using bulk::mbar_wait;
using bulk::smem_u32;
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// TMA store / reduce-add of one 64-row x 128-byte staging chunk (bulk group).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0,
                                             int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(src)), "r"(c0), "r"(c1)
      : "memory");
}
// The same with an L2 evict-first hint (outputs not read again soon: they
// should not push the operand tiles out of L2).
__device__ __forceinline__ void tma_store_2d_stream(const CUtensorMap* map, const void* src,
                                                    int c0, int c1) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group.L2::cache_hint"
      " [%0, {%2, %3}], [%1], %4;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "l"(policy)
      : "memory");
}
template <bool ADD>
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0,
                                             int c1, int c2) {
  if constexpr (ADD)
    asm volatile(
        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], "
        "[%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
        "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::
            "l"(reinterpret_cast<uint64_t>(map)),
        "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  bulk::commit();
}
// Waits until at most n (0..4) bulk groups of this thread still read shared memory.
__device__ __forceinline__ void bulk_wait_read(int n) {
  bulk::wait_read(n);
}
__device__ __forceinline__ void bulk_wait_all() {
  bulk::wait_all();
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives without waiting: the prior memory accesses of this thread are
// performed for the threads that bar.sync on the same barrier.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
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
// matter. Run by the 128 threads of one consumer warpgroup.
__device__ __forceinline__ void zero_slice_rows(uint8_t* base, int blocks, int from, int tid) {
  const int rows = 64 - from;
  for (int i = tid; i < blocks * rows * 8; i += 128) {
    const int blk = i / (rows * 8), r = from + (i / 8) % rows, chunk = i % 8;
    *reinterpret_cast<uint4*>(base + blk * 8192 + r * 128 + chunk * 16) = make_uint4(0, 0, 0, 0);
  }
}

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
                                          const HelperChunks& st, const float* probs_sm,
                                          int htid) {
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
  named_barrier(kHelperBar, kHelpers);
  if (epi.part != nullptr && htid < inf.wg_rows) {
    float sum = 0.0f;
    if (staged) {
#pragma unroll
      for (int unit = 0; unit < 32; ++unit)
        sum += *reinterpret_cast<const float*>(slot(htid, unit));
    }
    epi.part[(inf.wg_row0 + htid) * epi.part_ld + inf.tile_n] = sum;
  }
  named_barrier(kHelperBar, kHelpers);  // every helper's reads of the chunks are done
}

// MODE 0, forward: A [rows,K] and W_e [N,K] K-major.
// MODE 1, dgrad: A = dC [rows,N] K-major; B = W_e read MN-major (its rows are
//   the reduction), four 64 x 64 boxes per slice.
// MODE 2, wgrad: groups split the reduction rows; A = dC^T and B = A read
//   MN-major from row boxes; the slice holding the group's last rows has the
//   rows past them zeroed in shared memory (they belong to pad rows or the next
//   group); the output is each group's float32 dW, stored or accumulated.
// The epilogue functor (gemm_epilogue.cuh) maps the accumulators to the
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
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* staging = smem + stages * kStageBytes;  // 1024-aligned
  // (helper mode: the rows' probabilities for the helpers instead)
  const int chunks = staging_chunks<Epi>(bufs);
  uint32_t* bias_smem = reinterpret_cast<uint32_t*>(staging + chunks * kChunkBytes);
  static_assert(!Epi::kHelperAct || Epi::kBiasSmem >= kRowProbSmem, "room for the probabilities");
  HelperBlock* hb =
      reinterpret_cast<HelperBlock*>(staging + chunks * kChunkBytes + 2 * Epi::kBiasSmem);
  uint64_t* full = reinterpret_cast<uint64_t*>(hb + 1);
  uint64_t* empty = full + kMaxStages;
  uint64_t* go = empty + kMaxStages;  // consumer 1 starts after consumer 0's first slices
  // wgrad: the weight rows of a group's last slice are zeroed past its end by
  // whichever consumer warpgroup claims the stage first; zeroed[s] tells the other.
  uint64_t* zeroed = go + 1;
  int32_t* claim = reinterpret_cast<int32_t*>(zeroed + kMaxStages);  // + 2 broadcast slots
  int32_t* tile_start = claim + kMaxStages + 2;

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      // the producer's arrive (+ the TMA bytes); gathered A rows: + one
      // cp.async completion arrive per thread of warpgroup 0
      mbar_init(&full[s], GATHER ? 1 + 128 : 1);
      mbar_init(&empty[s], 2);  // one arrive per consumer warpgroup
    }
    mbar_init(go, 1);
    for (int s = 0; s < kMaxStages; ++s) {
      mbar_init(&zeroed[s], 1);
      claim[s] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // The scan borrows the first pipeline stage (no load has been issued yet);
  // ends with a barrier.
  static_assert(sizeof(ScanScratch<kThreads>) <= kStageBytes, "scan scratch must fit in one stage");
  build_tile_prefix_in<kTileM, kTileN, kThreads>(p, tile_start,
                                                 *reinterpret_cast<ScanScratch<kThreads>*>(smem));
  sm90::fence_proxy_async();  // the scan's generic writes, before TMA writes the stage
  __syncthreads();
  const int32_t num_tiles = tile_start[p.num_groups];
  const int wg = threadIdx.x / 128;

  if (wg == 0) {
    // Producer: one thread walks the same tiles and K slices as the consumers
    // (gathered A rows: the 128 threads of warpgroup 0, thread 0 issuing the
    // TMA loads).
    setmaxnreg_dec<kProducerRegs<Epi>>();
    constexpr bool gather = GATHER;
    static_assert(!GATHER || (MODE == 0 && !Epi::kHelperAct), "gathered A rows: plain forward only");
    if (threadIdx.x == 0 || gather) {
      const bool leader = !gather || threadIdx.x == 0;
      // What the producer needs of a tile, in 32-bit (the TMA path keeps rows < 2^31).
      struct Loads {
        int k_tiles, m0, n0, kr0, w_row;
      };
      auto loads_of = [&](int32_t tile) {
        const TileGeom tg = tile_geometry<kTileM, kTileN, TIn>(p, tile_start, tile);
        Loads l;
        l.k_tiles =
            tg.m0 >= tg.m_lim ? 0 : static_cast<int>(ceil_div_dev(tg.k_lim - tg.kr0, kTileK));
        l.m0 = static_cast<int>(tg.m0);
        l.n0 = static_cast<int>(tg.n0);
        l.kr0 = static_cast<int>(tg.kr0);
        l.w_row = static_cast<int>(int64_t{tg.group} * (MODE == 1 ? p.k_red : p.n_out) +
                                   (MODE == 1 ? 0 : (Epi::kSplitB ? tg.n0 / 2 : tg.n0)));
        return l;
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
      if (static_cast<int32_t>(blockIdx.x) < num_tiles) cur = loads_of(blockIdx.x);
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
            src16[i] = sr < 0 ? 0u
                              : static_cast<uint32_t>(int64_t{sr} * p.lda *
                                                      int64_t{sizeof(TIn)} / 16);
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
              asm volatile(
                  "cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                      smem_u32(stage + r * 128 + ((piece ^ (r & 7)) << 4))),
                  "l"(g), "r"(bytes)
                  : "memory");
            }
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                             smem_u32(&full[s]))
                         : "memory");
          }
          if (!leader) {  // gathering threads: the A rows only
            if (kt == 0 && next < num_tiles) {
              nxt = loads_of(next);
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
            nxt = loads_of(next);
            have_next = true;
          }
        }
        if (!have_next && next < num_tiles) nxt = loads_of(next);
        if constexpr (Epi::kHelperAct) {
          if (cur.k_tiles > 0) ring.hold_stage(ps, it, hold);
        }
        cur = nxt;
      }
    } else if constexpr (Epi::kHelperAct) {
      // Helper warps 1-3: for each tile and consumer warpgroup in order, store
      // the staged pre-activation chunks, apply the activation in place over
      // them and store the activation chunks, then hand the buffers back (and
      // release the stage that held them once both warpgroups' are done).
      if (threadIdx.x >= 32) {
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
                buf != nullptr ? *reinterpret_cast<const Pack<TOut, kVec>*>(
                                     buf + r * 128 + ((piece ^ (r & 7)) << 4))
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
            named_barrier(kStagedBar + cw, kHandOver);
            const HelperInfo inf = hb->info[cw];
            // (a pad-only tile staged nothing: its rows are stored as zeros)
            const bool staged = inf.stage >= 0;
            const HelperChunks st =
                staged ? helper_chunks(smem, stages, inf.stage, cw) : HelperChunks{};
            auto chunk = [&](int q) -> const uint8_t* { return staged ? st(q) : nullptr; };
            const float* probs_sm =
                reinterpret_cast<const float*>(bias_smem) + cw * (Epi::kBiasSmem / 4);
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
                    store_chunk(inf, &map_raw, chunk(q), static_cast<TOut*>(epi.raw_ptr()),
                                p.n_out, col0, lim);
                  if (kTwoGroups && q == 1 && inf.tma && htid == 0) bulk_commit();
                }
                if (inf.tma && htid == 0) {
                  bulk_commit();
                  // the chunks are rewritten in place next
                  bulk_wait_read(kTwoGroups ? 1 : 0);
                }
              }
              named_barrier(kHelperBar, kHelpers);
              if (staged) epi.dispatch([&](auto variant) {
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
              named_barrier(kHelperBar, kHelpers);
              for (int q = 0; q < kActChunks; ++q) {
                const int64_t col0 = int64_t{inf.tile_n} * Epi::kOutCols + q * kCw;
                if (col0 < out_cols)
                  store_chunk(inf, &map_c, chunk(q), static_cast<TOut*>(p.c), p.ldc, col0,
                              out_cols);
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
              named_barrier(kHelperBar, kHelpers);
              if (htid == 0) mbar_arrive(&empty[inf.stage]);
            }
            if (tile + static_cast<int32_t>(gridDim.x) < num_tiles)
              named_barrier_arrive(kFreedBar + cw, kHandOver);
          }
        }
        if (htid == 0) bulk_wait_all();
      }
    }
  } else {
    // Consumers: warpgroup c = wg - 1 owns rows c*64 .. c*64+63 of each tile.
    setmaxnreg_inc<kConsumerRegs<Epi>>();
    const int c = wg - 1;
    const int tid = threadIdx.x % 128, lane = threadIdx.x % 32, warp = tid / 32;
    uint8_t* my_staging = staging + c * bufs * kChunkBytes;  // (not in helper mode)
    // What the consumers need of a tile, in 32-bit (the TMA path keeps rows
    // < 2^31): few registers stay live next to the 128 accumulators.
    struct Work {
      int k_tiles, last_rows;  // slices; rows of the final slice (wgrad)
      int m0, n0, group;
      int store_rows, data_rows;  // tile rows that are written / hold data (0..128)
    };
    auto work_of = [&](int32_t tile) {
      const TileGeom tg = tile_geometry<kTileM, kTileN, TIn>(p, tile_start, tile);
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
    };
    uint32_t it = 0, zero_phase = 0;
    StageRing ring;
    int prev_s = 0, buf_i = 0;  // stage of slice it-1; staging buffer
    uint32_t* my_bias = bias_smem + c * (Epi::kBiasSmem / 4);
    bool bias_parity = false;  // helper mode: which of the two bias buffers
    // Stagger: consumer 1 starts `stagger` K slices after consumer 0, so the
    // two warpgroups reach their epilogues at different times and one keeps
    // the tensor cores busy while the other stores (the stages are shared:
    // the lag is bounded by the pipeline depth).
    bool go_sent = c == 1 || stagger <= 0;
    if (c == 1 && stagger > 0) mbar_wait(go, 0);
    Work tw{};
    if (static_cast<int32_t>(blockIdx.x) < num_tiles) tw = work_of(blockIdx.x);
    for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const int32_t next = tile + gridDim.x;
      // The next tile's geometry (a search of the group table, global loads,
      // 64-bit divisions), worked out before the main loop so that its
      // latency hides behind it rather than delaying the epilogue.
      Work nw{};
      if (next < num_tiles) nw = work_of(next);
      float acc[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      sm90::fence_operands(acc);  // start values in place before the first wgmma
      // The epilogue's loads (probabilities, bias) are issued now: their
      // latency hides behind the main loop.
      const int rl0 = warp * 16 + lane / 4;  // the thread's first row in the warpgroup's 64
      const typename Epi::Tile ts =
          epi.load_tile(tw.group, tw.n0, tid, lane, int64_t{tw.m0} + c * 64, rl0,
                        max(0, min(64, tw.data_rows - c * 64)));
      for (int kt = 0; kt < tw.k_tiles; ++kt, ++it) {
        uint32_t parity;
        const int s = ring.next(it, stages, parity);
        mbar_wait(&full[s], parity);
        // gathered A rows came by cp.async (generic proxy): order them before
        // the wgmma reads (async proxy)
        if constexpr (GATHER) sm90::fence_proxy_async();
        if constexpr (MODE == 2) {
          if (kt == tw.k_tiles - 1 && tw.last_rows < kTileK) {
            // The group's last slice: zero the rows past its end. Each
            // warpgroup zeroes its own 64 columns of dC^T; the shared weight
            // rows are zeroed by the warpgroup that claims the stage first,
            // the other waits on zeroed[s] (no lockstep between the two, so
            // the stagger survives).
            uint8_t* stage = smem + s * kStageBytes;
            zero_slice_rows(stage + c * 8192, 1, tw.last_rows, tid);
            if (tid == 0) claim[kMaxStages + c] = atomicAdd(&claim[s], 1);
            named_barrier(2 + c, 128);
            const bool first = claim[kMaxStages + c] == 0;
            if (first)
              zero_slice_rows(stage + kStageBytesA, kTileN / 64, tw.last_rows, tid);
            sm90::fence_proxy_async();
            named_barrier(2 + c, 128);
            const uint32_t parity = (zero_phase >> s) & 1;
            zero_phase ^= 1u << s;
            if (first) {
              if (tid == 0) mbar_arrive(&zeroed[s]);
            } else {
              mbar_wait(&zeroed[s], parity);
              sm90::fence_proxy_async();
              if (tid == 0) atomicExch(&claim[s], 0);  // before this stage is released
            }
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
            Mma::template mma<1, 1>(acc, smem_desc_mn(sa + ks * 16 * 64),
                                    smem_desc_mn(sb + ks * 16 * 64));
          else if constexpr (MODE == 1)
            Mma::template mma<0, 1>(acc, sm90::smem_desc(sa + ks * 16),
                                    smem_desc_mn(sb + ks * 16 * 64));
          else
            Mma::template mma<0, 0>(acc, sm90::smem_desc(sa + ks * 16),
                                    sm90::smem_desc(sb + ks * 16));
        }
        sm90::wgmma_commit();
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
      sm90::wgmma_wait<0>();
      sm90::fence_operands(acc);
      if constexpr (Epi::kHelperAct) {
        // The last slice's stage holds the staged chunks: the helpers release
        // it, and the ring skips it for a while. Wait until the helpers are
        // done with the dedicated chunks and the probabilities this warpgroup
        // last handed them.
        if (tw.k_tiles > 0) ring.hold_stage(prev_s, it, hold);
        if (tile != static_cast<int32_t>(blockIdx.x)) named_barrier(kFreedBar + c, kHandOver);
      } else {
        if (tw.k_tiles > 0 && tid == 0) mbar_arrive(&empty[prev_s]);
      }
      if constexpr (Epi::kHelperAct) {
        // Helper mode: the rows' probabilities for the helpers, at the start
        // of the warpgroup's bias area.
        epi.stage_probs(reinterpret_cast<float*>(my_bias), ts, rl0, lane);
        if constexpr (Epi::kConsumerBias) {
          // The bias, added to the accumulators (one rounding of the sum):
          // the tile's 256 column pairs, one per thread, through shared
          // memory, in the buffer of this tile's parity.
          if (epi.has_bias()) {  // uniform
            uint32_t* sb =
                my_bias + (kRowProbSmem + (bias_parity ? Epi::kBiasPairsSmem : 0)) / 4;
            bias_parity = !bias_parity;
            epi.stage_bias(sb, ts, tid);
            named_barrier(2 + c, 128);
            epi.finish(acc, sb, lane);
          }
        }
      } else {
        if (epi.has_bias()) {  // uniform
          named_barrier(2 + c, 128);  // the previous tile's reads of my_bias are done
          epi.stage_bias(my_bias, ts, tid);
          named_barrier(2 + c, 128);
        }
        epi.finish(acc, my_bias, lane);  // e.g. + bias
      }

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
        if (staged) named_barrier(kEpiBar, 256);
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
                *reinterpret_cast<Pack<TOut, 2>*>(buf + rl * 128 +
                                                  (((byte >> 4) ^ (rl & 7)) << 4) + (byte & 15)) = o;
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
        named_barrier_arrive(kStagedBar + c, kHandOver);
      } else if (wg_rows > 0) {  // uniform over the warpgroup
        const int64_t wg_row0 = int64_t{tw.m0} + c * 64;
        // The TMA may write all 64 rows (rows past the matrix are clipped by the map).
        const bool tma = store_kind != StoreKind::kDirect && (MODE == 2 || wg_rows == 64);
        const int data_rows = max(0, min(64, tw.data_rows - c * 64));
        TOut* out =
            MODE == 2
                ? const_cast<TOut*>(group_base<TOut>(p.c, p.c_ptrs, p.c_group_stride, tw.group))
                : static_cast<TOut*>(p.c);
        constexpr int kCw = 128 / static_cast<int>(sizeof(TOut));  // columns per chunk
        constexpr int kVec = 16 / static_cast<int>(sizeof(TOut));  // elements per 16-byte piece
        // One 64-row x 128-byte chunk: value(jj, half, col) gives the two
        // outputs of fragment column jj (0..kCw/8-1) at output column col.
        auto emit = [&](const auto& value, const CUtensorMap* map, TOut* base, int64_t ld, int col0,
                        int64_t col_lim) {
          if (col0 >= col_lim) return;
          if (tid == 0) bulk_wait_read(bufs - 1);  // the store that last read this buffer is done
          named_barrier(2 + c, 128);
          uint8_t* buf = my_staging + buf_i * kChunkBytes;
          if (++buf_i == bufs) buf_i = 0;
#pragma unroll
          for (int jj = 0; jj < kCw / 8; ++jj) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int rl = rl0 + half * 8;
              const int cl = jj * 8 + 2 * (lane % 4);
              const float2 v =
                  rl < data_rows ? value(jj, half, col0 + cl) : make_float2(0.0f, 0.0f);
              Pack<TOut, 2> o;
              o.v[0] = from_float<TOut>(v.x);
              o.v[1] = from_float<TOut>(v.y);
              const int byte = cl * static_cast<int>(sizeof(TOut));
              *reinterpret_cast<Pack<TOut, 2>*>(buf + rl * 128 + (((byte >> 4) ^ (rl & 7)) << 4) +
                                                (byte & 15)) = o;
            }
          }
          if (tma) sm90::fence_proxy_async();  // generic-proxy writes -> visible to the TMA
          named_barrier(2 + c, 128);
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
              Pack<TOut, kVec> v = *reinterpret_cast<const Pack<TOut, kVec>*>(
                  buf + r * 128 + ((piece ^ (r & 7)) << 4));
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
      tw = nw;
    }
    if (!go_sent && tid == 0) mbar_arrive(go);  // fewer slices than the stagger
    if (tid == 0) bulk_wait_all();
  }
#endif
}

}  // namespace moeflow::cuda::gemm::sm90tma
