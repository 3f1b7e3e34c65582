// The TMA grouped GEMM's tile shape, shared-memory layout and register
// split (see kernel.cuh for the algorithm).
#pragma once

#include "cuda/gemm/epilogue_ops.cuh"
#include "cuda/gemm/sm90_cpasync.cuh"

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

struct HelperInfo {
  int64_t wg_row0;  // global row of the warpgroup's first row
  int wg_rows;      // rows to store (0..64)
  int data_rows;    // rows holding data (the rest are pad rows)
  int tile_n;       // 256-column tile index
  int tma;          // stored by the TMA (else masked 16-byte copies)
  int group;
  int stage;  // pipeline stage holding the chunks (-1: a pad-only tile, nothing staged)
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
  // zeroed[] | zreq[] | tile_start[E+1]
  static size_t bytes(int stages, int chunks, int num_groups, int bias_smem) {
    return 1024 + size_t(stages) * kStageBytes + size_t(chunks) * kChunkBytes +
           size_t(2 * bias_smem) + sizeof(HelperBlock) + (4 * kMaxStages + 1) * 8 +
           size_t(num_groups + 1) * 4;
  }
};

// How the epilogue leaves the kernel (see the header comment).
enum class StoreKind : int { kDirect = 0, kTensor2d = 1, kTensor3d = 2 };

// The carve-up of the dynamic shared memory (Smem::bytes() gives its size).
struct SmemPtrs {
  uint8_t* smem;        // pipeline stages, 1024-aligned
  uint8_t* staging;     // epilogue staging chunks (1024-aligned)
  uint32_t* bias_smem;  // 2 x Epi::kBiasSmem (helper mode: the rows' probabilities too)
  HelperBlock* hb;      // what each consumer warpgroup hands the helper warps
  uint64_t* full;       // [kMaxStages] a stage's loads landed
  uint64_t* empty;      // [kMaxStages] both consumer warpgroups released a stage
  uint64_t* go;         // consumer 1 starts after consumer 0's first slices
  uint64_t* zeroed;     // [kMaxStages] wgrad: a slice's rows past the group were zeroed
  uint64_t* zreq;       // [kMaxStages] wgrad: the producer issued a slice to zero
  int32_t* tile_start;  // [E+1] first tile of each group
};
// Each role carves it itself (the same arithmetic everywhere, so that the
// compiler sees every address as an offset of the one allocation).
template <typename Epi>
__device__ __forceinline__ SmemPtrs carve_smem(int stages, int bufs) {
  extern __shared__ uint8_t smem_raw[];
  SmemPtrs sm;
  // (offset from the array itself, not through an integer address: the
  // compiler then reads the carved buffers as shared memory)
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = sm.smem = smem_raw + ((1024u - (base & 1023u)) & 1023u);
  uint8_t* staging = sm.staging = smem + stages * kStageBytes;  // 1024-aligned
  // (helper mode: the rows' probabilities for the helpers instead)
  const int chunks = staging_chunks<Epi>(bufs);
  sm.bias_smem = reinterpret_cast<uint32_t*>(staging + chunks * kChunkBytes);
  static_assert(!Epi::kHelperAct || Epi::kBiasSmem >= kRowProbSmem, "room for the probabilities");
  sm.hb = reinterpret_cast<HelperBlock*>(staging + chunks * kChunkBytes + 2 * Epi::kBiasSmem);
  sm.full = reinterpret_cast<uint64_t*>(sm.hb + 1);
  sm.empty = sm.full + kMaxStages;
  sm.go = sm.empty + kMaxStages;  // consumer 1 starts after consumer 0's first slices
  // wgrad: a group's last slice has its rows past the group zeroed by the
  // zeroing warps (consumer.cuh, wgrad_zero_warps): zreq[s] from the
  // producer to them, zeroed[s] from them to the consumers.
  sm.zeroed = sm.go + 1;
  sm.zreq = sm.zeroed + kMaxStages;
  sm.tile_start = reinterpret_cast<int32_t*>(sm.zreq + kMaxStages);
  return sm;
}

}  // namespace moeflow::cuda::gemm::sm90tma
