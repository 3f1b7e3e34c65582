// The grouped GEMM kernel (portable path: mma.sync m16n8k16, sm_80+), as a
// template over operand layouts, element types and an epilogue functor, so
// that fused consumers (the grouped MLP: bias, GLU, probability scaling)
// instantiate it with their own epilogue.
//
// Algorithm: a persistent grid walks the output tiles of all groups. Each
// block first derives every group's tile count from the device-side offsets
// (a block scan), then maps tile index -> (group, tile) by binary search. Per
// tile: a 4-stage cp.async pipeline fills swizzled shared-memory tiles
// (zero-filled outside the group's rows), 8 warps (2 x 4, 64 x 32 each) run
// ldmatrix (.trans for M- or N-contiguous operands) + mma.sync, and the
// float32 tile is staged in shared memory where the epilogue functor reads
// any element of it before the vectorised, masked store.
#pragma once

#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"

namespace moeflow::cuda::gemm {

constexpr int kTileM = 128;
constexpr int kTileN = 128;
constexpr int kTileK = 32;
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kEpilogueLd = kTileN + 4;  // floats per staged row (bank spread)
constexpr int kRasterBand = 8;           // default m tiles per raster band (L2 reuse of B)

// Where an output tile lies; given to the epilogue functor.
struct TileInfo {
  int group;
  int64_t row0;  // first output row (global row; wgrad: row n of dW)
  int64_t col0;  // first output column
  int64_t rows;  // output rows of this tile that hold data (the rest: pad or past the end)
};

// out(r, c) = acc(r, c). An epilogue reads the staged float32 tile (row-major,
// leading dimension `ld`) and returns the value stored at tile position (r, c).
struct EpilogueIdentity {
  __device__ __forceinline__ float operator()(const TileInfo&, const float* tile, int ld, int r,
                                              int c) const {
    return tile[r * ld + c];
  }
};

struct Params {
  bool reduce_grouped;  // false: groups split the output rows (forward, dgrad);
                        // true: groups split the reduction rows (wgrad)
  int num_groups;
  const int64_t* offsets;    // [E+1]
  const int32_t* real_rows;  // [E] or null
  int32_t* error;            // [1] or null
  int64_t rows;              // rows of the row-major activation matrices
  // A operand (M x Kred): element (m, kr) at a[m*lda + kr] (K-major) or a[kr*lda + m]
  const void* a;
  int64_t lda;
  // B operand (Kred x N): per group base = b_ptrs ? b_ptrs[g] : b + g*b_group_stride;
  // element (kr, n) at base[n*ldb + kr] (K-major) or base[kr*ldb + n]
  const void* b;
  const int64_t* b_ptrs;
  int64_t b_group_stride;
  int64_t ldb;
  // output: rows-grouped -> c[row*ldc + col]; reduce-grouped -> per group base (like B)
  void* c;
  const int64_t* c_ptrs;
  int64_t c_group_stride;
  int64_t ldc;
  bool accumulate;
  int64_t m_out;             // reduce-grouped: output rows of each group (N of dW)
  int64_t n_out;             // output columns
  int64_t k_red;             // rows-grouped: reduction length
  int raster = kRasterBand;  // m tiles per raster band
  int64_t n_store = 0;       // output columns when they differ from n_out (fused GLU: F)
  // Forward on the TMA path only: row m of A is row a_rows[m] of `a` (-1: zeros).
  const int32_t* a_rows = nullptr;
  int64_t a_src_rows = 0;  // rows of `a` when a_rows is given
};

// Shared-memory tile of R rows x C bf16/fp16 elements, in 16-byte chunks with
// an XOR swizzle so that ldmatrix (8 rows x 16 bytes) and cp.async rows are
// free of bank conflicts.
template <int R, int C>
struct SmemTile {
  static constexpr int kChunksPerRow = C / 8;
  static constexpr int kChunks = R * kChunksPerRow;
  __device__ static __forceinline__ int chunk(int row, int col_chunk) {
    const int i = row * kChunksPerRow + col_chunk;
    const int line = i >> 3;
    const int key = kChunksPerRow >= 8 ? (row & 7) : (line & 7);
    return (line << 3) | ((i & 7) ^ key);
  }
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copies a R x C tile of a row-major matrix (rows r0.., cols c0..) into a
// swizzled shared tile; rows >= r_lim or cols >= c_lim read as zeros.
template <int R, int C, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* g, int64_t ld, int64_t r0,
                                          int64_t r_lim, int64_t c0, int64_t c_lim) {
  using Tile = SmemTile<R, C>;
#pragma unroll
  for (int i = 0; i < Tile::kChunks / kThreads; ++i) {
    const int ch = i * kThreads + threadIdx.x;
    const int r = ch / Tile::kChunksPerRow, cc = ch % Tile::kChunksPerRow;
    const int64_t gr = r0 + r, gc = c0 + cc * 8;
    const bool valid = gr < r_lim && gc < c_lim;
    const T* src = valid ? g + gr * ld + gc : g;
    cp_async16(smem + Tile::chunk(r, cc) * 8, src, valid);
  }
}

struct SmemLayout {
  static constexpr int kStageA = kTileM * kTileK;  // elements
  static constexpr int kStageB = kTileN * kTileK;
  static constexpr size_t kPipelineBytes = size_t{kStages} * (kStageA + kStageB) * 2;
  static constexpr size_t kEpilogueBytes = size_t{kTileM} * kEpilogueLd * 4;
  static constexpr size_t kMainBytes =
      kPipelineBytes > kEpilogueBytes ? kPipelineBytes : kEpilogueBytes;
  static size_t bytes(int num_groups) {
    return kMainBytes + size_t(num_groups + 1) * sizeof(int32_t);
  }
};

template <typename T>
__device__ __forceinline__ const T* group_base(const void* base, const int64_t* ptrs,
                                               int64_t stride, int g) {
  return ptrs ? reinterpret_cast<const T*>(ptrs[g]) : static_cast<const T*>(base) + g * stride;
}

// Every block derives the tile count of each group from the device-side
// offsets and writes the exclusive prefix to tile_start[0..E] (shared memory).
// Bad groups (offsets not monotone or past the rows) get no tiles and set
// p.error. Ends with a barrier. `scratch`: shared memory for the scan
// (ScanScratch<THREADS>::kBytes), e.g. pipeline stages not yet in use.
template <int THREADS>
struct ScanScratch {
  using Scan = cub::BlockScan<int32_t, THREADS>;
  typename Scan::TempStorage scan;
  int32_t carry;
};

template <int TM, int TN, int THREADS>
__device__ void build_tile_prefix_in(const Params& p, int32_t* tile_start,
                                     ScanScratch<THREADS>& sc) {
  using Scan = typename ScanScratch<THREADS>::Scan;
  const int E = p.num_groups;
  const int64_t n_tiles = ceil_div_dev(p.n_out, TN);
  if (threadIdx.x == 0) sc.carry = 0;
  bool bad = false;
  for (int e0 = 0; e0 < E; e0 += THREADS) {
    const int e = e0 + threadIdx.x;
    int32_t tiles = 0;
    if (e < E) {
      const int64_t lo = p.offsets[e], hi = p.offsets[e + 1];
      if (lo < 0 || hi < lo || hi > p.rows) {
        bad = true;  // NOTE: a bad group is skipped (no tile reads or writes it)
      } else {
        const int64_t m = p.reduce_grouped ? p.m_out : hi - lo;
        tiles = static_cast<int32_t>(ceil_div_dev(m, TM) * n_tiles);
      }
    }
    int32_t excl, total;
    __syncthreads();
    Scan(sc.scan).ExclusiveSum(tiles, excl, total);
    if (e < E) tile_start[e] = sc.carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) sc.carry += total;
  }
  __syncthreads();
  if (threadIdx.x == 0) tile_start[E] = sc.carry;
  if (__syncthreads_or(bad) && p.error && threadIdx.x == 0) *p.error = 1;
}

// The same with the scan storage in static shared memory.
template <int TM, int TN, int THREADS = kThreads>
__device__ void build_tile_prefix(const Params& p, int32_t* tile_start) {
  __shared__ ScanScratch<THREADS> sc;
  build_tile_prefix_in<TM, TN, THREADS>(p, tile_start, sc);
}

// One output tile: its group and where its operands and output lie.
struct TileGeom {
  int group;
  int64_t m0, m_lim;   // M rows of the operand A (global rows, or n of dW)
  int64_t kr0, k_lim;  // reduction range (absolute)
  int64_t n0;          // first output column
  int64_t store_hi;    // output rows < store_hi are stored (pad rows as zeros)
  int64_t data_rows;   // tile rows [0, data_rows) hold data
  const void* b;       // B operand base of the group
};

template <int TM, int TN, typename TIn>
__device__ __forceinline__ TileGeom tile_geometry(const Params& p, const int32_t* tile_start,
                                                  int32_t tile, int hint = 0) {
  const int E = p.num_groups;
  const int64_t n_tiles = ceil_div_dev(p.n_out, TN);
  // hint: a group at or before the tile's (a block's tiles ascend, so the
  // group of its previous tile): one or two reads in the common case.
  int lo = hint, hi = E - 1;
  if (lo < hi && tile_start[lo + 1] <= tile) ++lo;
  if (lo < hi && tile_start[lo + 1] > tile) hi = lo;
  while (lo < hi) {  // last group with tile_start <= tile
    const int mid = (lo + hi + 1) / 2;
    if (tile_start[mid] <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  TileGeom t;
  t.group = lo;
  const int32_t local = tile - tile_start[lo];
  const int64_t seg_lo = p.offsets[lo], seg_hi = p.offsets[lo + 1];
  // Raster: bands of p.raster m tiles, m fastest within a band, so the
  // blocks running at once share B (weight) tiles in L2 as well as A tiles.
  // The remainder joins the last band (p.raster to 2 p.raster - 1 m tiles):
  // a band of one or two m tiles would read every weight tile for them alone.
  // (32-bit: every tile count fits the int32 tile prefix; divisions by a
  // runtime value cost far less unsigned and in 32 bits)
  const uint32_t m_tiles =
      static_cast<uint32_t>(ceil_div_dev(p.reduce_grouped ? p.m_out : seg_hi - seg_lo, TM));
  const uint32_t rb = static_cast<uint32_t>(p.raster), nt32 = static_cast<uint32_t>(n_tiles);
  const uint32_t last_band = m_tiles > rb ? m_tiles / rb - 1 : 0;
  const uint32_t band = min(static_cast<uint32_t>(local) / (rb * nt32), last_band);
  const uint32_t in_band = static_cast<uint32_t>(local) - band * rb * nt32;
  const uint32_t band_rows = band == last_band ? m_tiles - band * rb : rb;
  const int64_t mt = band * rb + in_band % band_rows, nt = in_band / band_rows;
  int64_t real_hi = seg_hi;
  if (p.real_rows) {
    const int64_t r = p.real_rows[lo];
    real_hi = seg_lo + (r < 0 ? 0 : (r < seg_hi - seg_lo ? r : seg_hi - seg_lo));
  }
  t.n0 = nt * TN;
  if (!p.reduce_grouped) {
    t.m0 = seg_lo + mt * TM;
    t.m_lim = real_hi;
    t.kr0 = 0;
    t.k_lim = p.k_red;
    t.b = group_base<TIn>(p.b, p.b_ptrs, p.b_group_stride, lo);
    t.store_hi = seg_hi;
    t.data_rows = real_hi - t.m0;
  } else {
    t.m0 = mt * TM;
    t.m_lim = p.m_out;
    t.kr0 = seg_lo;
    t.k_lim = real_hi;
    t.b = p.b;
    t.store_hi = p.m_out;
    t.data_rows = p.m_out - t.m0;
  }
  return t;
}

// Stores a staged float32 tile (TM x TN, leading dimension LD) through the
// epilogue: rows < data_rows get epi(...), pad rows zeros, masked by store_hi
// and n_out; 8 columns (one 16- or 32-byte vector) per thread-step.
template <int TM, int TN, int LD, int THREADS, typename TOut, typename Epilogue>
__device__ __forceinline__ void store_tile(const Params& p, const TileGeom& t, const float* s_c,
                                           const Epilogue& epi) {
  TileInfo info{t.group, t.m0, t.n0, t.data_rows};
  TOut* out_base =
      p.reduce_grouped
          ? const_cast<TOut*>(group_base<TOut>(p.c, p.c_ptrs, p.c_group_stride, t.group))
          : static_cast<TOut*>(p.c);
  for (int v = threadIdx.x; v < TM * (TN / 8); v += THREADS) {
    const int r = v / (TN / 8), c = (v % (TN / 8)) * 8;
    const int64_t row = t.m0 + r, col = t.n0 + c;
    if (row >= t.store_hi || col >= p.n_out) continue;
    const bool data = r < t.data_rows;
    Pack<TOut, 8> o;
    TOut* dst = out_base + row * p.ldc + col;
    if (p.accumulate) o = *reinterpret_cast<const Pack<TOut, 8>*>(dst);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float val = data ? epi(info, s_c, LD, r, c + j) : 0.0f;
      // accumulate: the result rounded to TOut, then added and rounded (a
      // 16-bit dW as the TMA kernels' reduce-add and autograd's grad += g)
      const TOut r = from_float<TOut>(val);
      o.v[j] = p.accumulate ? from_float<TOut>(to_float(o.v[j]) + to_float(r)) : r;
    }
    *reinterpret_cast<Pack<TOut, 8>*>(dst) = o;
  }
}

template <typename TIn, typename TOut, bool A_KMAJOR, bool B_KMAJOR, typename Epilogue>
__global__ void __launch_bounds__(kThreads) grouped_gemm_kernel(Params p, Epilogue epi) {
  extern __shared__ __align__(128) uint8_t smem[];
  TIn* s_a = reinterpret_cast<TIn*>(smem);
  TIn* s_b = s_a + kStages * SmemLayout::kStageA;
  float* s_c = reinterpret_cast<float*>(smem);
  int32_t* tile_start = reinterpret_cast<int32_t*>(smem + SmemLayout::kMainBytes);  // [E+1]

  const int E = p.num_groups;

  // Step 1: tiles of every group (from device-side offsets), prefix in smem.
  build_tile_prefix<kTileM, kTileN>(p, tile_start);
  const int32_t num_tiles = tile_start[E];

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warp_m = warp % 2, warp_n = warp / 2;  // 64 x 32 per warp

  for (int32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    // Step 2: tile -> (group, m tile, n tile) and operand geometry.
    const TileGeom tg = tile_geometry<kTileM, kTileN, TIn>(p, tile_start, tile);
    const int64_t m0 = tg.m0, m_lim = tg.m_lim, kr0 = tg.kr0, k_lim = tg.k_lim, n0 = tg.n0;
    const TIn* a = static_cast<const TIn*>(p.a);
    const TIn* b = static_cast<const TIn*>(tg.b);
    // NOTE: a tile of pad rows only (m0 >= real rows) skips the main loop: zeros.
    const int k_tiles = m0 >= m_lim ? 0 : static_cast<int>(ceil_div_dev(k_lim - kr0, kTileK));

    auto load_stage = [&](int kt, int stage) {
      const int64_t k0 = kr0 + int64_t{kt} * kTileK;
      TIn* sa = s_a + stage * SmemLayout::kStageA;
      TIn* sb = s_b + stage * SmemLayout::kStageB;
      if constexpr (A_KMAJOR)
        load_tile<kTileM, kTileK>(sa, a, p.lda, m0, m_lim, k0, k_lim);
      else
        load_tile<kTileK, kTileM>(sa, a, p.lda, k0, k_lim, m0, m_lim);
      if constexpr (B_KMAJOR)
        load_tile<kTileN, kTileK>(sb, b, p.ldb, n0, p.n_out, k0, k_lim);
      else
        load_tile<kTileK, kTileN>(sb, b, p.ldb, k0, k_lim, n0, p.n_out);
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

          // Step 3: the pipelined main loop.
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage(s, s);
      cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      const int next = kt + kStages - 1;
      if (next < k_tiles) load_stage(next, next % kStages);
      cp_async_commit();
      const TIn* sa = s_a + (kt % kStages) * SmemLayout::kStageA;
      const TIn* sb = s_b + (kt % kStages) * SmemLayout::kStageB;
#pragma unroll
      for (int ks = 0; ks < kTileK / 16; ++ks) {
        uint32_t af[4][4], bf[2][4];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          const int mb = warp_m * 64 + mi * 16;
          if constexpr (A_KMAJOR) {
            const int r = mb + (lane % 16), cc = ks * 2 + lane / 16;
            ldmatrix_x4<false>(af[mi], sa + SmemTile<kTileM, kTileK>::chunk(r, cc) * 8);
          } else {
            const int j = lane / 8;
            const int r = ks * 16 + (j / 2) * 8 + lane % 8, cc = (mb + (j % 2) * 8) / 8;
            ldmatrix_x4<true>(af[mi], sa + SmemTile<kTileK, kTileM>::chunk(r, cc) * 8);
          }
        }
#pragma unroll
        for (int pj = 0; pj < 2; ++pj) {
          const int nb = warp_n * 32 + pj * 16;
          const int j = lane / 8;
          if constexpr (B_KMAJOR) {
            const int r = nb + (j / 2) * 8 + lane % 8, cc = ks * 2 + (j % 2);
            ldmatrix_x4<false>(bf[pj], sb + SmemTile<kTileN, kTileK>::chunk(r, cc) * 8);
          } else {
            const int r = ks * 16 + (j % 2) * 8 + lane % 8, cc = (nb + (j / 2) * 8) / 8;
            ldmatrix_x4<true>(bf[pj], sb + SmemTile<kTileK, kTileN>::chunk(r, cc) * 8);
          }
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
          for (int ni = 0; ni < 4; ++ni)
            mma16816<TIn>(acc[mi][ni], af[mi], bf[ni / 2][(ni % 2) * 2],
                          bf[ni / 2][(ni % 2) * 2 + 1]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Step 4: stage the float32 tile, then epilogue + masked vector stores.
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int r = warp_m * 64 + mi * 16 + lane / 4, c = warp_n * 32 + ni * 8 + (lane % 4) * 2;
        s_c[r * kEpilogueLd + c] = acc[mi][ni][0];
        s_c[r * kEpilogueLd + c + 1] = acc[mi][ni][1];
        s_c[(r + 8) * kEpilogueLd + c] = acc[mi][ni][2];
        s_c[(r + 8) * kEpilogueLd + c + 1] = acc[mi][ni][3];
      }
    __syncthreads();
    store_tile<kTileM, kTileN, kEpilogueLd, kThreads, TOut>(p, tg, s_c, epi);
    __syncthreads();  // s_c aliases the pipeline buffers of the next tile
  }
}

}  // namespace moeflow::cuda::gemm
