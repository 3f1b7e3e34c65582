// Device building blocks of the nvlink backend's fused kernels
// (nvlink_kernels.cu only): per-token flags, row copies (16-byte stores or
// TMA bulk copies), the two roles of a fused kernel, a token's placement in
// dispatch, slot sums and gradient rows.
#pragma once

#include "core/ep_layout.h"
#include "cuda/bulk.cuh"
#include "cuda/common.cuh"
#include "cuda/ep/api.cuh"
#include "cuda/fp8.cuh"

namespace moeflow {
namespace nvl {

constexpr int kMaxExperts = 2048;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 32;    // warps per block of the row kernels (1024 threads, one block per SM)
constexpr int kMaxDest = 40;  // destinations of one token: K <= 32 own slots + W - 1 <= 7 peers
constexpr int kUnroll = 6;    // 16-byte vectors in flight per lane of a row copy

// Per-token signals. Every lane's stores to the peers are made visible
// system-wide before lane 0 stores the flag (release); a waiting warp's lane 0
// spins on the flag (acquire) before the warp reads what it announced (loads
// that bypass L1: the data is written while the kernel runs).
__device__ __forceinline__ void warp_publish() {
  __threadfence_system();
  __syncwarp();
}
__device__ __forceinline__ void st_flag(int32_t* p, int32_t v) {
  st_release_sys(p, v);
}
// Waits for rank `who`'s flag (Window::wait_flag: gives up on a timeout).
__device__ __forceinline__ void warp_wait_flag(const Window& win, const int32_t* p, int32_t v,
                                               int who, int lane) {
  if (lane == 0) win.wait_flag(p, v, who);
  __syncwarp();
}

// Bulk prefetch of [p, p + bytes) into L2 (TMA; 16-byte aligned, bytes % 16
// == 0): the loads that follow hit L2, so a warp's few loads in flight
// cover more bandwidth.
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (bytes > 0)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p),
                 "r"(static_cast<uint32_t>(bytes))
                 : "memory");
#endif
}
// Lane 0 prefetches bytes [from, to) of a row of `len` bytes (clipped).
__device__ __forceinline__ void prefetch_span(const void* row, int64_t from, int64_t to,
                                              int64_t len) {
  if (to > len) to = len;
  if (from < to) prefetch_l2(static_cast<const uint8_t*>(row) + from, to - from);
}
constexpr int kAhead = 4;  // steps of a row prefetched ahead of the loads

// One warp copies a row of n16 16-byte vectors from src to each of the nd
// destinations dst[0..nd), reading every vector once. kCoherent: src is
// written while the kernel runs (loads through L2 only).
template <bool kCoherent>
__device__ __forceinline__ void warp_copy_row(const uint4* __restrict__ src, uint8_t* const* dst,
                                              int nd, int64_t n16, int lane) {
  constexpr int64_t step = 32 * kUnroll * 16;
  if (lane == 0) prefetch_span(src, 0, 2 * step, n16 * 16);
  for (int64_t b = 0; b < n16; b += 32 * kUnroll) {
    if (lane == 0)
      prefetch_span(src, (b / (32 * kUnroll) + 2) * step, (b / (32 * kUnroll) + 3) * step,
                    n16 * 16);
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = b + u * 32 + lane;
      if (i < n16) v[u] = kCoherent ? __ldcg(src + i) : __ldg(src + i);
    }
    for (int d = 0; d < nd; ++d) {
      uint4* o = reinterpret_cast<uint4*>(dst[d]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = b + u * 32 + lane;
        if (i < n16) o[i] = v[u];
      }
    }
  }
}

// The work of the two roles of a fused kernel. Home role (blocks [0, P)): the
// rank's own tokens, warp w takes t = w, w + warps, ... Holder role (blocks
// [P, grid)): the peers' tokens (t, s), t-major, so that it follows the home
// roles of the peers, which publish their tokens in about that order.
template <int NW>
struct Roles {
  bool home;
  int64_t warp, warps;
  __device__ explicit Roles(int P) {
    home = static_cast<int>(blockIdx.x) < P;
    const int64_t b = home ? blockIdx.x : blockIdx.x - P;
    const int64_t nb = home ? P : gridDim.x - P;
    warp = b * NW + threadIdx.x / 32;
    warps = nb * NW;
  }
};

// Tokens a warp has finished but not yet announced: up to `batch` of them are
// announced together after one fence (a fence per token would stall the warp
// on the NVLink round trip each time). Lane i holds entry i.
struct Pending {
  int n = 0;
  int64_t mine = -1;   // lane i: the announcement's index into the flags (-1: none)
  unsigned peers = 0;  // lane i: the ranks to announce it to
  __device__ void add(int64_t idx, unsigned to, int lane) {
    if (lane == n) {
      mine = idx;
      peers = to;
    }
    ++n;
  }
  // Fence, then each entry's flag stored on its ranks.
  __device__ void flush(const Window& win, size_t off_flag, int32_t epoch, int lane) {
    if (n == 0) return;
    warp_publish();
    if (lane < n)
      for (unsigned m = peers; m; m &= m - 1)
        st_flag(static_cast<int32_t*>(win.at(off_flag + size_t(mine) * 4, __ffs(m) - 1)), epoch);
    n = 0;
    __syncwarp();
  }
};
// The holder role's items: (s, t) for every rank s (but this one unless
// `self`) and t < ntok[s], t-major; each warp takes every warps-th item.
template <int NW, typename F>
__device__ __forceinline__ void for_tokens(const Roles<NW>& ro, const int32_t* ntok, int W, int me,
                                           bool self, F&& f) {
  const int n = self ? W : W - 1;
  if (n == 0) return;
  int64_t tm = 0;
  for (int s = 0; s < W; ++s)
    if ((self || s != me) && ntok[s] > tm) tm = ntok[s];
  const int64_t items = tm * n;
  for (int64_t j = ro.warp; j < items; j += ro.warps) {
    const int64_t t = j / n;
    const int si = static_cast<int>(j % n);
    const int s = self ? si : si + (si >= me);
    if (t < ntok[s]) f(s, t);
  }
}

// Lanes with a row >= 0 list those rows of `x` in my[] (k ascending);
// returns how many (warp-wide).
__device__ __forceinline__ int list_rows(uint8_t** my, int64_t row, uint8_t* x, int64_t row_bytes,
                                         int lane) {
  const unsigned mine = __ballot_sync(kFull, row >= 0);
  if (row >= 0) my[__popc(mine & ((1u << lane) - 1u))] = x + row * row_bytes;
  __syncwarp();
  return __popc(mine);
}

// A token's scales row (`src`, scale_bytes) to the rows of its kept slots
// (any rank; lane k < K: slot k's rank q and row, row -1 when none), warp-wide,
// slot by slot: 4-byte words when aligned, else bytes.
__device__ __forceinline__ void place_scales(const Window& win, const Offsets& o, const HomeArgs& a,
                                             const uint8_t* src, int q, int64_t row, int lane) {
  const int64_t sb = a.scale_bytes;
  const bool words = sb % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0;
  for (unsigned m = __ballot_sync(kFull, row >= 0); m; m &= m - 1) {
    const int k = __ffs(m) - 1;
    const int qk = __shfl_sync(kFull, q, k);
    const int64_t rk = __shfl_sync(kFull, row, k);
    uint8_t* dst = static_cast<uint8_t*>(win.at(o.scales + rk * sb, qk));
    if (words)
      for (int64_t j = lane; j < sb / 4; j += 32)
        reinterpret_cast<uint32_t*>(dst)[j] = reinterpret_cast<const uint32_t*>(src)[j];
    else
      for (int64_t j = lane; j < sb; j += 32) dst[j] = src[j];
  }
}
// Dispatch, home role, token t. Lane k < K places slot (t,k): the slot to
// global expert g has rank local_dest[t,k] - local_offsets[g] among this
// rank's slots to g (the local plan); it lands on row first_row[g] + that rank
// of rank g / L when the rank is below fit[g], and is dropped otherwise. The
// slot's prob, row_src and row_k go to its rank, every rank gets the token's
// inv entry. Lists where x[t] goes in my[]: the own kept slots' rows (k
// ascending), then for each peer holding kept slots the row of its only one
// there, or its stage when it holds several; returns how many.
// The lane's slot comes back in q and row (both -1 when none or dropped).
__device__ __forceinline__ int place_token(const Window& win, const Offsets& o, const size_t* x_at,
                                           const HomeArgs& a, int64_t t, int lane, uint8_t** my,
                                           int& q, int64_t& row) {
  const int K = a.K, W = a.W, me = a.me;
  q = -1;
  row = -1;
  float pw = 0.0f;
  if (lane < K) {
    pw = a.probs ? a.probs[t * K + lane] : 0.0f;
    a.probs_out[t * K + lane] = pw;
    const int g = a.ids[t * K + lane];
    if (g >= 0 && g < a.E) {  // ids outside [-1, E) are unrouted (counted by the plan)
      const int64_t rk = a.local_dest[t * K + lane] - a.local_offsets[g];
      if (rk >= 0 && rk < a.fit[g]) {
        row = a.first_row[g] + rk;
        q = g / a.L;
      }
    }
    a.dest_rank[t * K + lane] = q;
    a.dest_row[t * K + lane] = row;
    if (row >= 0) {
      *static_cast<float*>(win.at(o.probs + row * sizeof(float), q)) = pw;
      *static_cast<int32_t*>(win.at(o.row_src + row * sizeof(int32_t), q)) =
          static_cast<int32_t>(me * a.tmax + t);
      *static_cast<int32_t*>(win.at(o.row_k + row * sizeof(int32_t), q)) = lane;
    }
    for (int p = 0; p < W; ++p)
      *static_cast<int32_t*>(
          win.at(o.inv + ((size_t(me) * a.tmax + t) * K + lane) * sizeof(int32_t), p)) =
          q == p ? static_cast<int32_t>(row) : -1;
  }
  if (a.scales) place_scales(win, o, a, a.scales + t * a.scale_bytes, q, row, lane);
  const unsigned own = __ballot_sync(kFull, row >= 0 && q == me);
  if ((own >> lane) & 1u)
    my[__popc(own & ((1u << lane) - 1u))] = win.local + x_at[me] + row * a.row_bytes;
  int nd = __popc(own);
  for (int p = 0; p < W; ++p) {
    const unsigned on = __ballot_sync(kFull, row >= 0 && q == p);
    if (p == me || !on) continue;
    // one slot on p: its row there directly; more: the stage, the holder copies
    const int64_t r1 = __shfl_sync(kFull, row, __ffs(on) - 1);
    if (lane == 0)
      my[nd] = static_cast<uint8_t*>(
          __popc(on) == 1 ? win.at(x_at[p] + r1 * a.row_bytes, p)
                          : win.at(o.stage + (size_t(me) * a.tmax + t) * a.row_bytes, p));
    ++nd;
  }
  return nd;
}

// N floats of a partial row from / to memory (16-byte accesses when N % 4 == 0).
template <int N>
__device__ __forceinline__ void store_floats(float* dst, const float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < N; j += 4)
      *reinterpret_cast<float4*>(dst + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) dst[j] = v[j];
  }
}
template <int N>
__device__ __forceinline__ void load_floats_cg(const float* src, float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < N; j += 4) {
      const float4 f = __ldcg(reinterpret_cast<const float4*>(src + j));
      v[j] = f.x;
      v[j + 1] = f.y;
      v[j + 2] = f.z;
      v[j + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = __ldcg(src + j);
  }
}

// A pack of N elements of T loaded through L2 only (written while the kernel runs).
template <typename T, int N>
__device__ __forceinline__ cuda::Pack<T, N> load_pack_cg(const cuda::Pack<T, N>* p) {
  using P = cuda::Pack<T, N>;
  P v;
  if constexpr (sizeof(P) == 16) {
    const uint4 r = __ldcg(reinterpret_cast<const uint4*>(p));
    memcpy(&v, &r, 16);
  } else if constexpr (sizeof(P) == 8) {
    const uint2 r = __ldcg(reinterpret_cast<const uint2*>(p));
    memcpy(&v, &r, 8);
  } else if constexpr (sizeof(P) == 4) {
    const unsigned r = __ldcg(reinterpret_cast<const unsigned*>(p));
    memcpy(&v, &r, 4);
  } else {
    static_assert(sizeof(P) == 2, "packs of 2, 4, 8 or 16 bytes");
    const unsigned short r = __ldcg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&v, &r, 2);
  }
  return v;
}

// A warp's slots of one token in shared memory, compacted in k order: lane k
// with a bit in `mask` stores its row and weight at its rank in the mask.
struct SlotList {
  int64_t row[32];
  float w[32];
  int k[32];
};
__device__ __forceinline__ int collect_slots(SlotList& l, unsigned mask, int64_t row, float w,
                                             int lane) {
  if ((mask >> lane) & 1u) {
    const int i = __popc(mask & ((1u << lane) - 1u));
    l.row[i] = row;
    l.w[i] = w;
    l.k[i] = lane;
  }
  __syncwarp();
  return __popc(mask);
}

constexpr int kSumWarps = 16;  // warps per block of the combine kernel (128 registers a thread)
constexpr int kBwdWarps = 16;  // of the combine backward kernel (128 registers a thread)
constexpr int kSumKB = 2;      // slots loaded together

// packs (of N elements) per lane per step of the home's sums: 16 float32 values
template <int N>
constexpr int sum_u() {
  return N >= 8 ? 2 : 4;
}
// the same, of the holder's sums
template <int N>
constexpr int hold_u() {
  return N >= 8 ? 2 : 4;
}

// part[u] = sum over the n listed slots (k ascending) of w * y[row] for the N
// elements of pack p0 + u*32 + lane (u < U). n >= 1. kSumKB slots x U packs
// are in flight per lane.
template <typename T, int N, int U = sum_u<N>()>
__device__ __forceinline__ void slot_sum(const T* y, int64_t y_stride, const SlotList& l, int n,
                                         int64_t p0, int64_t packs, int lane, float (&part)[U][N]) {
  using P = cuda::Pack<T, N>;
  constexpr int kSumU = U;
  for (int b = 0; b < n; b += kSumKB) {
    P v[kSumKB][kSumU];
#pragma unroll
    for (int i = 0; i < kSumKB; ++i)
#pragma unroll
      for (int u = 0; u < kSumU; ++u) {
        const int64_t p = p0 + u * 32 + lane;
        if (b + i < n && p < packs)
          v[i][u] = reinterpret_cast<const P*>(y + l.row[b + i] * y_stride)[p];
      }
#pragma unroll
    for (int i = 0; i < kSumKB; ++i) {
      if (b + i >= n) break;
      const float wk = l.w[b + i];
#pragma unroll
      for (int u = 0; u < kSumU; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j)
          part[u][j] = fmaf(wk, cuda::to_float(v[i][u].v[j]), b + i > 0 ? part[u][j] : 0.0f);
    }
  }
}

// Bulk copies (TMA; EpOptions::nvlink_bulk_copies): lane 0 of each warp
// moves the rows through two shared-memory buffers with bulk loads and bulk
// stores, kilobytes per instruction instead of 16 bytes per lane. Blocks of
// kTmaWarps warps.
constexpr int kTmaWarps = 8;
constexpr uint32_t kTmaChunk = 8192;  // bytes per bulk copy
constexpr size_t kTmaSmem = size_t(kTmaWarps) * 2 * kTmaChunk + size_t(kTmaWarps) * 2 * 8;

// One warp's copy pipeline (lane 0 only): buffer b is loaded while the other's
// stores are in flight.
struct TmaPipe {
  uint8_t* buf;        // [2][kTmaChunk]
  uint64_t* bar;       // [2]
  uint32_t phase = 0;  // bit b: the parity bar[b] completes next
  int next = 0;
  __device__ void init(uint8_t* b, uint64_t* mb) {
    buf = b;
    bar = mb;
    cuda::bulk::mbar_init(&bar[0], 1);
    cuda::bulk::mbar_init(&bar[1], 1);
    cuda::bulk::fence_barrier_init();
  }
  __device__ void copy(const uint8_t* src, uint8_t* const* dst, int nd, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += kTmaChunk) {
      const uint32_t n = static_cast<uint32_t>(bytes - off < kTmaChunk ? bytes - off : kTmaChunk);
      const int b = next;
      next ^= 1;
      uint8_t* sb = buf + size_t(b) * kTmaChunk;
      cuda::bulk::wait_read(1);  // the group that last read this buffer is done with it
      cuda::bulk::mbar_expect_tx(&bar[b], n);
      cuda::bulk::load(sb, src + off, n, &bar[b]);
      cuda::bulk::mbar_wait(&bar[b], (phase >> b) & 1u);
      phase ^= 1u << b;
      for (int d = 0; d < nd; ++d) cuda::bulk::store(dst[d] + off, sb, n);
      cuda::bulk::commit();
    }
  }
  // Every bulk store done and ordered before the lane's later stores (flags).
  __device__ void drain() {
    cuda::bulk::wait_all();
    cuda::bulk::fence_async_global();
  }
};

// How a warp moves a row to its destinations: 16-byte loads and stores of
// every lane (LsuMover), or lane 0's bulk copies through shared memory
// (TmaMover). kCoherent: the source was written while the kernel runs.
struct LsuMover {
  __device__ void init(uint8_t*, int, int) {}
  template <bool kCoherent>
  __device__ void copy(const uint8_t* src, uint8_t* const* dst, int nd, int64_t bytes, int lane) {
    warp_copy_row<kCoherent>(reinterpret_cast<const uint4*>(src), dst, nd, bytes / 16, lane);
  }
  __device__ void drain(int) {}
};
// ep_dispatch_quantize's home role: a token's 16-bit row read once, quantized
// 1x128 as quantize() does (fp8.cuh's 512-column chunks, lane l: 16 columns)
// and its codes stored into every listed row; the row's scales land in `sc`
// (the warp's, then placed by place_scales). hidden % 16 == 0.
template <typename T, bool E4M3>
struct QuantizeRows {
  using Elem = T;
  static constexpr bool kOn = true;
  static constexpr int kScaleCols = kMaxQuantCols / 128;
  __device__ static void row(const T* src, uint8_t* const* dst, int nd, int64_t hidden, bool pow2,
                             float* sc, int lane) {
    constexpr int64_t kStep = int64_t{32} * cuda::kFp8PerLane;
    cuda::RawChunk<T> raw;  // the next chunk's loads go out before this one is quantized
    cuda::load_raw(src, int64_t{lane} * cuda::kFp8PerLane, hidden, raw);
    for (int64_t c0 = 0; c0 < hidden; c0 += kStep) {
      const int64_t cl = c0 + int64_t{lane} * cuda::kFp8PerLane;
      float v[cuda::kFp8PerLane];
      cuda::unpack_raw(raw, v);
      if (c0 + kStep < hidden) cuda::load_raw(src, cl + kStep, hidden, raw);
      uint32_t w[cuda::kFp8PerLane / 4];
      const float scale = cuda::quantize_chunk<E4M3>(v, pow2, w);
      for (int d = 0; d < nd; ++d) cuda::store_codes<true>(dst[d], cl, hidden, w);
      if (cl < hidden && lane % cuda::kFp8LanesPerBlock == 0) sc[cl / quant::kBlock] = scale;
    }
  }
};
struct NoQuantize {
  using Elem = uint8_t;
  static constexpr bool kOn = false;
  static constexpr int kScaleCols = 1;
};

struct TmaMover {
  TmaPipe pipe;
  __device__ void init(uint8_t* smem, int wib, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (lane == 0)
      pipe.init(smem + size_t(wib) * 2 * kTmaChunk,
                reinterpret_cast<uint64_t*>(smem + size_t(kTmaWarps) * 2 * kTmaChunk) + 2 * wib);
    __syncwarp();
#endif
  }
  template <bool kCoherent>
  __device__ void copy(const uint8_t* src, uint8_t* const* dst, int nd, int64_t bytes, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (lane == 0) {
      if (kCoherent) cuda::bulk::fence_async_global();  // the bulk loads see what was announced
      pipe.copy(src, dst, nd, bytes);
    }
    __syncwarp();
#endif
  }
  __device__ void drain(int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (lane == 0) pipe.drain();
    __syncwarp();
#endif
  }
};

// Lanes i < n prefetch step `step` (packs [step*per, (step+1)*per) of N
// elements of T) of the listed slot rows.
template <typename T, int N>
__device__ __forceinline__ void prefetch_slots(const T* y, int64_t y_stride, const SlotList& l,
                                               int n, int64_t step, int64_t per, int64_t packs,
                                               int lane) {
  if (lane < n) {
    const int64_t b = sizeof(T) * N;
    prefetch_span(y + l.row[lane] * y_stride, step * per * b, (step + 1) * per * b, packs * b);
  }
}

// grad_y[row] = w * d and <d, y[row]> for one slot row (warp-wide; returns the
// dot product on every lane). 4 packs of d and y in flight per lane.
template <typename T, bool kCoherent>
__device__ __forceinline__ float grad_row(const T* d, const T* yrow, T* grow, float w, int64_t H,
                                          int lane) {
  constexpr int N = 16 / sizeof(T);
  constexpr int kSumU = 4;
  using P = cuda::Pack<T, N>;
  const int64_t packs = H / N;
  float dot = 0.0f;
  for (int64_t p0 = 0; p0 < packs; p0 += 32 * kSumU) {
    uint4 dv[kSumU];
    P yv[kSumU];
#pragma unroll
    for (int u = 0; u < kSumU; ++u) {
      const int64_t p = p0 + u * 32 + lane;
      if (p >= packs) continue;
      dv[u] = kCoherent ? __ldcg(reinterpret_cast<const uint4*>(d) + p)
                        : __ldg(reinterpret_cast<const uint4*>(d) + p);
      yv[u] = reinterpret_cast<const P*>(yrow)[p];
    }
#pragma unroll
    for (int u = 0; u < kSumU; ++u) {
      const int64_t p = p0 + u * 32 + lane;
      if (p >= packs) continue;
      const P& dp = *reinterpret_cast<const P*>(&dv[u]);
      P gv;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float f = cuda::to_float(dp.v[j]);
        gv.v[j] = cuda::from_float<T>(w * f);
        dot = fmaf(f, cuda::to_float(yv[u].v[j]), dot);
      }
      reinterpret_cast<P*>(grow)[p] = gv;
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) dot += __shfl_xor_sync(kFull, dot, m);
  return dot;
}

}  // namespace nvl
}  // namespace moeflow
