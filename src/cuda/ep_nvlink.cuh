// Backend "nvlink" of expert-parallel dispatch / combine (issue 6;
// docs/ep-nvlink-design.md). Included by ep.cu only.
//
// Memory: one NCCL symmetric window per rank (ncclMemAlloc +
// ncclCommWindowRegister); LSA pointers reach the peers' windows. It holds
//   x [capacity, H], probs [capacity]    the received rows (the result)
//   row_src, row_k [capacity] int32      per row: source rank * tmax + token, k
//                                        (-1: pad row)
//   counts [W][E], ntok [W] int32        the count matrix, the ranks' T
//   inv [W][tmax][K] int32               per peer token and k: its row here (-1)
//   stage [W][tmax][H]                   token rows of the peers, once per token
//                                        (dispatch: x; combine backward: dout)
//   partial [W][tmax][H] float32         per home token: the holder's partial sum
//   dp [tmax][K] float32                 dprobs of this rank's slots
// Every phase that writes into the peers' windows starts after an LSA barrier
// (they are done reading what it overwrites) and ends with one (it has landed).
//
// dispatch (no host synchronisation):
//   1. the rank's slots ranked per global expert: build_plan over its ids with
//      the E global experts (align 1, nothing dropped) gives every slot its
//      rank among the rank's slots to that expert, in (token, k) order;
//   2. one block: barrier, the rank's counts and T stored into every peer's
//      matrix, barrier; from the matrix, where each of its slots lands on its
//      expert's rank (core/ep_layout.h: the reference's layout and drop rule)
//      and the rank's own receive plan;
//   3. one warp per token: x[t] read once and stored into each own kept slot's
//      final row, and once into every peer holding a kept slot (a token
//      crosses to a rank once): straight into its final row there when the
//      peer holds one slot of t, else into the peer's stage; per kept slot
//      its prob, row_src and row_k, and per peer the token's inv entries;
//   4. one warp per peer token with two or more slots here, once announced:
//      copied from the stage into its final rows (pad rows: a small kernel
//      on a side stream beside this one).
// combine: barrier; on the holder, one warp per peer token with kept slots
// here: the float32 sum of its slots (k ascending, weighted) stored into the
// home rank's partial, or, when it holds one slot of the token, that slot's
// row as is (y's type: half the bytes of a float32 partial for 16-bit y; the
// home weights it exactly as the holder would have); barrier; one warp per
// home token: own slots summed (k ascending) and the partials of the ranks
// added, ranks ascending: the reference's order, bitwise the nccl backend's.
// combine backward: barrier; dout[t] stored once into the stage of every peer
// holding a slot of t; barrier; one warp per received row: grad_y = w * dout
// (pad rows 0) and <dout, y> stored into the home rank's dp; barrier; dprobs.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include "core/ep_layout.h"
#include "cuda/bulk.cuh"

namespace moeflow {
namespace nvl {

constexpr size_t kAlign = 256;
inline size_t round_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

// The rank's window as kernels see it: NCCL's LSA pointers into the peers'
// windows; for a group of one rank (NCCL gives a one-rank communicator no
// symmetric memory), plain device memory and no barriers; for simulated
// ranks (EpGroup::create_simulated: every rank on one GPU, a testing aid),
// each rank's plain device memory and a counter barrier in device memory.
constexpr int kMaxSimRanks = 8;
struct Window {
  ncclWindow_t win;  // null: one rank, or simulated ranks
  uint8_t* local;    // this rank's window
  ncclDevComm dc;
  unsigned* sim_bar = nullptr;            // simulated: [arrived, generation]
  int sim_world = 0;
  uint8_t* sim_base[kMaxSimRanks] = {};  // simulated: every rank's window
  __device__ __forceinline__ void* at(size_t off, int q) const {
    if (sim_bar) return sim_base[q] + off;
    return win ? ncclGetLsaPointer(win, off, q) : local + off;
  }
  // An LSA barrier of the whole block with the peers (every thread calls it).
  __device__ __forceinline__ void barrier() const {
    __threadfence_system();  // earlier stores to the peers, before the arrive
    if (sim_bar) {
      __syncthreads();
      if (threadIdx.x == 0) sim_barrier();
      __syncthreads();
      return;
    }
    if (!win) {
      __syncthreads();
      return;
    }
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dc, ncclTeamTagLsa(), 0);
    bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);
  }
  // Sense by generation: the last of the sim_world arrivals resets the count
  // and bumps the generation the others wait on (one thread per rank).
  // (The generation is read with acquire loads at GPU scope: a stale value
  // would let a rank through the next barrier early.)
  __device__ __forceinline__ static unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
  __device__ __forceinline__ void sim_barrier() const {
    unsigned* gen = sim_bar + 1;
    const unsigned g = load_acquire(gen);  // read before arriving: it cannot move until we do
    __threadfence();
    if (atomicAdd(sim_bar, 1u) == static_cast<unsigned>(sim_world) - 1u) {
      atomicExch(sim_bar, 0u);
      __threadfence();
      atomicAdd(gen, 1u);
    } else {
      while (load_acquire(gen) == g) __nanosleep(64);
    }
    __threadfence();
  }
};

// A standalone LSA barrier (one block).
__global__ void barrier_kernel(Window w) {
  w.barrier();
}

// ids [T,K] (int32/int64) -> local [tmax,K] int32, rows past T unrouted.
template <typename IdT>
__global__ void copy_ids_kernel(const IdT* ids, int64_t T, int K, int64_t tmax, int32_t* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= tmax * K) return;
  if (i >= T * K) {
    out[i] = -1;
    return;
  }
  const int64_t v = static_cast<int64_t>(ids[i]);
  out[i] = v >= -1 && v <= INT32_MAX ? static_cast<int32_t>(v) : -2;  // -2: invalid, counted
}

constexpr int kMaxExperts = 2048;

// Step 2 (one block): counts exchanged, slot ranges and the receive plan.
__global__ void counts_kernel(Window win, size_t off_counts, size_t off_ntok,
                              const int32_t* my_counts, int32_t my_T, int E, int W, int me,
                              int64_t capacity,
                              int align, int64_t* first_row, int64_t* fit, int32_t* kept,
                              int32_t* padded, int64_t* offsets, int64_t* total_rows,
                              int32_t* overflow, int32_t* epoch, const int32_t* invalid_src,
                              int32_t* invalid_dst) {
  win.barrier();  // the peers are done with the last round
  if (threadIdx.x == 0) *invalid_dst = *invalid_src;  // the plan's count of invalid ids
  if (threadIdx.x == 0) ++*epoch;  // this dispatch's number, which its flags carry
  for (int i = threadIdx.x; i < W * E; i += blockDim.x) {
    const int p = i / E, g = i % E;
    int32_t* dst = static_cast<int32_t*>(
        win.at(off_counts + (size_t(me) * E + g) * sizeof(int32_t), p));
    *dst = my_counts[g];
  }
  for (int p = threadIdx.x; p < W; p += blockDim.x)
    *static_cast<int32_t*>(win.at(off_ntok + size_t(me) * sizeof(int32_t), p)) = my_T;
  win.barrier();  // every row of the matrix is in
  // The layout of every expert from the matrix (core/ep_layout.h), the
  // prefix sums per rank in shared memory.
  __shared__ int32_t routed[kMaxExperts];
  __shared__ int64_t prefix[kMaxExperts];
  __shared__ int64_t dropped;
  const int32_t* C = static_cast<const int32_t*>(win.at(off_counts, me));
  const int L = E / W;
  if (threadIdx.x == 0) dropped = 0;
  for (int g = threadIdx.x; g < E; g += blockDim.x) routed[g] = static_cast<int32_t>(ep_routed(C, W, E, g));
  __syncthreads();
  if (threadIdx.x < W) {
    int64_t pre = 0;
    for (int g = threadIdx.x * L; g < (threadIdx.x + 1) * L; ++g) {
      prefix[g] = pre;
      pre += (routed[g] + align - 1) / align * align;
    }
  }
  __syncthreads();
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    int64_t before = 0;
    for (int s = 0; s < me; ++s) before += C[s * E + g];
    const EpSlotRange r =
        ep_slot_range_at(routed[g], prefix[g], before, C[me * E + g], capacity, align);
    first_row[g] = r.first_row;
    fit[g] = r.fit;
    if (g / L == me) {  // this rank's receive plan
      const int e = g % L;
      const ExpertLayout l = layout_expert(routed[g], prefix[g], capacity, align);
      kept[e] = l.kept;
      padded[e] = l.padded;
      offsets[e] = l.offset;
      if (e == L - 1) offsets[L] = l.offset + l.padded;
      atomicAdd(reinterpret_cast<unsigned long long*>(&dropped),
                static_cast<unsigned long long>(routed[g] - l.kept));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (L == 0) offsets[0] = 0;
    *total_rows = offsets[L];
    *overflow = static_cast<int32_t>(dropped);
  }
}

// Where each part of the window starts (bytes).
struct Offsets {
  size_t x, probs, row_src, row_k, counts, ntok, inv, stage, partial, dp, flag, epoch;
  size_t scales = 0;  // [capacity][scale bytes] (EpOptions::scale_cols)
};

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
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void spin_flag(const int32_t* p, int32_t v) {
  int32_t got;
  do {
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(got) : "l"(p) : "memory");
  } while (got != v);
}
__device__ __forceinline__ void warp_wait_flag(const int32_t* p, int32_t v, int lane) {
  if (lane == 0) spin_flag(p, v);
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
    if (lane == 0) prefetch_span(src, (b / (32 * kUnroll) + 2) * step, (b / (32 * kUnroll) + 3) * step, n16 * 16);
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

// Pad rows of this rank's layout: rows zeroed; probs 0 and row_src -1 when
// given. A block per expert.
struct Pads {
  int L;
  const int32_t *kept, *padded;
  const int64_t* offsets;
};
__global__ void pads_kernel(uint8_t* rows, int64_t stride_bytes, float* recv_probs,
                            int32_t* row_src, int64_t row_bytes, Pads pads, uint8_t* scales,
                            int64_t scale_bytes) {
  const int e = blockIdx.x;
  if (e >= pads.L) return;
  for (int64_t r = pads.offsets[e] + pads.kept[e]; r < pads.offsets[e] + pads.padded[e]; ++r) {
    uint4* dst = reinterpret_cast<uint4*>(rows + r * stride_bytes);
    for (int64_t v = threadIdx.x; v < row_bytes / 16; v += blockDim.x) dst[v] = make_uint4(0, 0, 0, 0);
    if (scales)
      for (int64_t b = threadIdx.x; b < scale_bytes; b += blockDim.x) scales[r * scale_bytes + b] = 0;
    if (threadIdx.x == 0 && recv_probs) {
      recv_probs[r] = 0.0f;
      row_src[r] = -1;
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
  int64_t mine = -1;  // lane i: the announcement's index into the flags (-1: none)
  unsigned peers = 0; // lane i: the ranks to announce it to
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

// Dispatch, home role, token t. Lane k < K places slot (t,k): the slot to
// global expert g has rank local_dest[t,k] - local_offsets[g] among this
// rank's slots to g (the local plan); it lands on row first_row[g] + that rank
// of rank g / L when the rank is below fit[g], and is dropped otherwise. The
// slot's prob, row_src and row_k go to its rank, every rank gets the token's
// inv entry. Lists where x[t] goes in my[]: the own kept slots' rows (k
// ascending), then for each peer holding kept slots the row of its only one
// there, or its stage when it holds several; returns how many.
// Lanes with a row >= 0 list those rows of `x` in my[] (k ascending);
// returns how many (warp-wide).
__device__ __forceinline__ int list_rows(uint8_t** my, int64_t row, uint8_t* x, int64_t row_bytes,
                                         int lane) {
  const unsigned mine = __ballot_sync(kFull, row >= 0);
  if (row >= 0) my[__popc(mine & ((1u << lane) - 1u))] = x + row * row_bytes;
  __syncwarp();
  return __popc(mine);
}

struct HomeArgs {
  const int32_t* ids;
  const float* probs;  // the caller's [T,K] (nullable: 0)
  float* probs_out;    // their copy for combine [T,K]
  int K, E, L, W, me;
  int64_t tmax, row_bytes;
  const int64_t *local_dest, *local_offsets, *first_row, *fit;
  int32_t* dest_rank;
  int64_t* dest_row;
  const uint8_t* scales = nullptr;  // the caller's [T][scale_bytes], or null
  int64_t scale_bytes = 0;
};

// The scales row of token t to the rows of its kept slots (any rank),
// warp-wide, slot by slot: 4-byte words when aligned, else bytes.
__device__ __forceinline__ void place_scales(const Window& win, const Offsets& o,
                                             const HomeArgs& a, int64_t t, int q, int64_t row,
                                             int lane) {
  const int64_t sb = a.scale_bytes;
  const uint8_t* src = a.scales + t * sb;
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
__device__ __forceinline__ int place_token(const Window& win, const Offsets& o, const HomeArgs& a,
                                           int64_t t, int lane, uint8_t** my) {
  const int K = a.K, W = a.W, me = a.me;
  int q = -1;
  int64_t row = -1;
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
  if (a.scales) place_scales(win, o, a, t, q, row, lane);
  const unsigned own = __ballot_sync(kFull, row >= 0 && q == me);
  if ((own >> lane) & 1u) my[__popc(own & ((1u << lane) - 1u))] = win.local + o.x + row * a.row_bytes;
  int nd = __popc(own);
  for (int p = 0; p < W; ++p) {
    const unsigned on = __ballot_sync(kFull, row >= 0 && q == p);
    if (p == me || !on) continue;
    // one slot on p: its row there directly; more: the stage, the holder copies
    const int64_t r1 = __shfl_sync(kFull, row, __ffs(on) - 1);
    if (lane == 0)
      my[nd] = static_cast<uint8_t*>(
          __popc(on) == 1 ? win.at(o.x + r1 * a.row_bytes, p)
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
        if (b + i < n && p < packs) v[i][u] = reinterpret_cast<const P*>(y + l.row[b + i] * y_stride)[p];
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
  uint8_t* buf;   // [2][kTmaChunk]
  uint64_t* bar;  // [2]
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

// The dispatch after the count exchange (one kernel, two roles). Home
// (place_token): x[t] read once and stored into each own kept slot's row and
// once into every peer holding a kept slot of t (its row, or its stage); every
// rank learns (inv) where t's slots are on it, the holders get the slots'
// probs / row_src / row_k; then t is announced to every peer. Holder: once
// (s, t) is announced, a staged row is copied into the rows of t's slots here
// (tokens with one slot here: nothing to do; the flag still orders them
// before the kernel's end).
template <class Mover, int NW>
__global__ void __launch_bounds__(NW * 32)
    dispatch_kernel(Window win, Offsets o, int P, int batch, const uint8_t* x,
                    int64_t x_stride_bytes, int64_t T, HomeArgs a) {
  extern __shared__ __align__(128) uint8_t dyn_smem[];
  __shared__ uint8_t* dests[NW][kMaxDest];
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  uint8_t** my = dests[wib];
  Mover mover;
  mover.init(dyn_smem, wib, lane);
  const Roles<NW> ro(P);
  const int K = a.K, W = a.W, me = a.me;
  const int64_t tmax = a.tmax, row_bytes = a.row_bytes;
  const int32_t epoch = *reinterpret_cast<const int32_t*>(win.local + o.epoch);
  if (ro.home) {
    Pending pend;
    const unsigned peers = ((1u << W) - 1u) & ~(1u << me);
    for (int64_t t = ro.warp; t < T; t += ro.warps) {
      const int nd = place_token(win, o, a, t, lane, my);
      __syncwarp();
      mover.template copy<false>(x + t * x_stride_bytes, my, nd, row_bytes, lane);
      __syncwarp();  // the list is rewritten for the next token
      pend.add(size_t(me) * tmax + t, peers, lane);
      if (pend.n == batch) {
        mover.drain(lane);
        pend.flush(win, o.flag, epoch, lane);
      }
    }
    mover.drain(lane);
    pend.flush(win, o.flag, epoch, lane);
    return;
  }
  const int32_t* ntok = reinterpret_cast<const int32_t*>(win.local + o.ntok);
  const int32_t* inv = reinterpret_cast<const int32_t*>(win.local + o.inv);
  const int32_t* flag = reinterpret_cast<const int32_t*>(win.local + o.flag);
  const uint8_t* stage = win.local + o.stage;
  for_tokens(ro, ntok, W, me, false, [&](int s, int64_t t) {
    const size_t st = size_t(s) * tmax + t;
    warp_wait_flag(flag + st, epoch, lane);
    const int64_t row = lane < K ? __ldcg(inv + st * K + lane) : -1;
    const int n = list_rows(my, row, win.local + o.x, row_bytes, lane);
    if (n <= 1) return;  // an only slot here was stored by the home rank
    mover.template copy<true>(stage + st * row_bytes, my, n, row_bytes, lane);
    __syncwarp();
  });
  mover.drain(lane);
}

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

// The combine (one kernel, two roles). Holder: for each peer token with kept
// slots here, the float32 sum of its slots (k ascending, weighted by the
// received probs when `weighted`) stored into the home rank's partial[me][t]
// (a token with one slot here: that slot's row of y as is), then announced. Home: for each own token, ranks ascending: the own slots
// summed here (k ascending), the peers' partials once announced: the
// reference's order. Rows are prefetched into L2 kAhead steps ahead.
template <typename T, typename TOut, int N>
__global__ void __launch_bounds__(kSumWarps * 32)
    combine_kernel(Window win, Offsets o, int P, int batch, const T* y, int64_t y_stride,
                   int64_t H, int64_t Tn, int K, int W, int me, int64_t tmax,
                   const int32_t* dest_rank, const int64_t* dest_row, const float* weights,
                   bool weighted, TOut* out, int64_t out_stride) {
  constexpr int U = sum_u<N>();
  using PO = cuda::Pack<TOut, N>;
  using PY = cuda::Pack<T, N>;
  __shared__ SlotList lists[kSumWarps];
  const int lane = threadIdx.x % 32;
  SlotList& l = lists[threadIdx.x / 32];
  const int64_t packs = H / N;
  const Roles<kSumWarps> ro(P);
  const int32_t epoch = *reinterpret_cast<const int32_t*>(win.local + o.epoch);
  const int32_t* flag = reinterpret_cast<const int32_t*>(win.local + o.flag);
  if (ro.home) {
    const float* partial = reinterpret_cast<const float*>(win.local + o.partial);
    for (int64_t t = ro.warp; t < Tn; t += ro.warps) {
      int q = -1;
      int64_t row = -1;
      float w = 0.0f;
      if (lane < K) {
        q = dest_rank[t * K + lane];
        row = dest_row[t * K + lane];
        w = weights ? weights[t * K + lane] : 1.0f;
      }
      const unsigned ranks = __reduce_or_sync(kFull, q >= 0 ? 1u << q : 0u);
      // A peer holding one kept slot of t sent that slot's row as is (single
      // bit); its weight (lane r: rank r's) is applied here as the holder's
      // sum would: fmaf(w, y, 0).
      unsigned single = 0;
      float wsingle = 0.0f;
      for (int r = 0; r < W; ++r) {
        const unsigned m = __ballot_sync(kFull, q == r);
        if (r == me || __popc(m) != 1) continue;
        single |= 1u << r;
        const float wr = __shfl_sync(kFull, w, __ffs(m) - 1);
        if (lane == r) wsingle = wr;
      }
      const int n = collect_slots(l, __ballot_sync(kFull, q >= 0 && q == me), row, w, lane);
      for (int st = 0; st < kAhead; ++st) prefetch_slots<T, N>(y, y_stride, l, n, st, 32 * U, packs, lane);
      // lane p < W: the bytes per element of rank p's partial
      const int64_t eb = ((single >> lane) & 1u) ? int64_t{sizeof(T)} : 4;
      if (lane < W && lane != me && ((ranks >> lane) & 1u)) {  // lane p waits for rank p
        spin_flag(flag + size_t(lane) * tmax + t, epoch);
        prefetch_span(partial + (size_t(lane) * tmax + t) * H, 0, kAhead * 32 * U * N * eb, H * eb);
      }
      __syncwarp();
      for (int64_t p0 = 0, st = 0; p0 < packs; p0 += 32 * U, ++st) {
        prefetch_slots<T, N>(y, y_stride, l, n, st + kAhead, 32 * U, packs, lane);
        if (lane < W && lane != me && ((ranks >> lane) & 1u))
          prefetch_span(partial + (size_t(lane) * tmax + t) * H, (st + kAhead) * 32 * U * N * eb,
                        (st + kAhead + 1) * 32 * U * N * eb, H * eb);
        float acc[U][N];
        bool first = true;
        for (int r = 0; r < W; ++r) {
          if (!((ranks >> r) & 1u)) continue;
          float part[U][N];
          if (r == me) {
            slot_sum<T, N, U>(y, y_stride, l, n, p0, packs, lane, part);
          } else if ((single >> r) & 1u) {
            const float ws = __shfl_sync(kFull, wsingle, r);
            const PY* prow = reinterpret_cast<const PY*>(partial + (size_t(r) * tmax + t) * H);
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int64_t p = p0 + u * 32 + lane;
              if (p >= packs) continue;
              const PY v = load_pack_cg<T, N>(prow + p);
#pragma unroll
              for (int j = 0; j < N; ++j) part[u][j] = fmaf(ws, cuda::to_float(v.v[j]), 0.0f);
            }
          } else {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int64_t p = p0 + u * 32 + lane;
              if (p < packs) load_floats_cg<N>(partial + (size_t(r) * tmax + t) * H + p * N, part[u]);
            }
          }
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < N; ++j) acc[u][j] = first ? part[u][j] : acc[u][j] + part[u][j];
          first = false;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t p = p0 + u * 32 + lane;
          if (p >= packs) continue;
          PO v;
#pragma unroll
          for (int j = 0; j < N; ++j) v.v[j] = cuda::from_float<TOut>(first ? 0.0f : acc[u][j]);
          *reinterpret_cast<PO*>(out + t * out_stride + p * N) = v;
        }
      }
      __syncwarp();  // the list is rewritten for the next token
    }
    return;
  }
  const int32_t* ntok = reinterpret_cast<const int32_t*>(win.local + o.ntok);
  const int32_t* inv = reinterpret_cast<const int32_t*>(win.local + o.inv);
  const float* rprobs = reinterpret_cast<const float*>(win.local + o.probs);
  Pending pend;
  for_tokens(ro, ntok, W, me, false, [&](int s, int64_t t) {
    const size_t st = size_t(s) * tmax + t;
    int64_t row = -1;
    float w = 0.0f;
    if (lane < K) {
      row = inv[st * K + lane];
      if (row >= 0) w = weighted ? rprobs[row] : 1.0f;
    }
    const int n = collect_slots(l, __ballot_sync(kFull, row >= 0), row, w, lane);
    if (n == 0) return;
    constexpr int UH = hold_u<N>();
    for (int k = 0; k < kAhead; ++k) prefetch_slots<T, N>(y, y_stride, l, n, k, 32 * UH, packs, lane);
    float* dst = static_cast<float*>(win.at(o.partial + (size_t(me) * tmax + t) * H * 4, s));
    for (int64_t p0 = 0, k = 0; p0 < packs; p0 += 32 * UH, ++k) {
      prefetch_slots<T, N>(y, y_stride, l, n, k + kAhead, 32 * UH, packs, lane);
      if (n == 1) {  // one slot here: its row goes home as is, the home weights it
        const PY* src = reinterpret_cast<const PY*>(y + l.row[0] * y_stride);
        PY v[UH];
#pragma unroll
        for (int u = 0; u < UH; ++u) {
          const int64_t p = p0 + u * 32 + lane;
          if (p < packs) v[u] = src[p];
        }
#pragma unroll
        for (int u = 0; u < UH; ++u) {
          const int64_t p = p0 + u * 32 + lane;
          if (p < packs) reinterpret_cast<PY*>(dst)[p] = v[u];
        }
        continue;
      }
      float part[UH][N];
      slot_sum<T, N, UH>(y, y_stride, l, n, p0, packs, lane, part);
#pragma unroll
      for (int u = 0; u < UH; ++u) {
        const int64_t p = p0 + u * 32 + lane;
        if (p < packs) store_floats<N>(dst + p * N, part[u]);
      }
    }
    __syncwarp();  // the list is rewritten for the next token
    pend.add(size_t(me) * tmax + t, 1u << s, lane);
    if (pend.n == batch) pend.flush(win, o.flag, epoch, lane);
  });
  pend.flush(win, o.flag, epoch, lane);
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

// The combine backward (one kernel, two roles). Home: dout[t] stored once into
// the stage of every peer holding a kept slot of t and announced; the own
// slots' grad_y rows and dot products done here. Holder: once (s, t) is
// announced, grad_y of each of t's rows here from the staged dout, and the dot
// products stored into the home rank's dp[t, k]. Pad rows: pads_kernel.
template <typename T>
__global__ void __launch_bounds__(kBwdWarps * 32)
    combine_bwd_kernel(Window win, Offsets o, int P, int batch, const T* dout, int64_t dout_stride,
                       const T* y, int64_t y_stride, T* grad_y, int64_t g_stride, int64_t H,
                       int64_t Tn, int K, int W, int me, int64_t tmax, const int32_t* dest_rank,
                       const int64_t* dest_row, const float* weights) {
  __shared__ uint8_t* dests[kBwdWarps][kMaxDest];
  __shared__ SlotList lists[kBwdWarps];
  const int lane = threadIdx.x % 32;
  uint8_t** my = dests[threadIdx.x / 32];
  SlotList& l = lists[threadIdx.x / 32];
  const Roles<kBwdWarps> ro(P);
  const int32_t epoch = *reinterpret_cast<const int32_t*>(win.local + o.epoch);
  const int64_t row_bytes = H * int64_t(sizeof(T));
  float* dp_local = reinterpret_cast<float*>(win.local + o.dp);
  if (ro.home) {
    Pending pend;
    for (int64_t t = ro.warp; t < Tn; t += ro.warps) {
      const int q = lane < K ? dest_rank[t * K + lane] : -1;
      const int64_t row = lane < K ? dest_row[t * K + lane] : -1;
      const float w = lane < K && weights ? weights[t * K + lane] : 1.0f;
      int nd = 0;
      unsigned peers = 0;
      for (int p = 0; p < W; ++p) {
        if (p == me || !__ballot_sync(kFull, q == p)) continue;
        if (lane == 0)
          my[nd] = static_cast<uint8_t*>(win.at(o.stage + (size_t(me) * tmax + t) * row_bytes, p));
        ++nd;
        peers |= 1u << p;
      }
      const T* d = dout + t * dout_stride;
      if (nd) {
        __syncwarp();
        warp_copy_row<false>(reinterpret_cast<const uint4*>(d), my, nd, row_bytes / 16, lane);
        __syncwarp();
        pend.add(size_t(me) * tmax + t, peers, lane);
        if (pend.n == batch) pend.flush(win, o.flag, epoch, lane);
      }
      const int n = collect_slots(l, __ballot_sync(kFull, q >= 0 && q == me), row, w, lane);
      for (int i = 0; i < n; ++i) {
        const int64_t r = l.row[i];
        const float dot = grad_row<T, false>(d, y + r * y_stride, grad_y + r * g_stride, l.w[i], H, lane);
        if (lane == 0) dp_local[t * K + l.k[i]] = dot;
      }
      __syncwarp();
    }
    pend.flush(win, o.flag, epoch, lane);
    return;
  }
  const int32_t* ntok = reinterpret_cast<const int32_t*>(win.local + o.ntok);
  const int32_t* inv = reinterpret_cast<const int32_t*>(win.local + o.inv);
  const int32_t* flag = reinterpret_cast<const int32_t*>(win.local + o.flag);
  const float* rprobs = reinterpret_cast<const float*>(win.local + o.probs);
  const T* stage = reinterpret_cast<const T*>(win.local + o.stage);
  for_tokens(ro, ntok, W, me, false, [&](int s, int64_t t) {
    const size_t st = size_t(s) * tmax + t;
    const int64_t row = lane < K ? inv[st * K + lane] : -1;
    const float w = row >= 0 && weights ? rprobs[row] : 1.0f;
    const int n = collect_slots(l, __ballot_sync(kFull, row >= 0), row, w, lane);
    if (n == 0) return;
    warp_wait_flag(flag + st, epoch, lane);
    for (int i = 0; i < n; ++i) {
      const int64_t r = l.row[i];
      const float dot =
          grad_row<T, true>(stage + st * H, y + r * y_stride, grad_y + r * g_stride, l.w[i], H, lane);
      if (lane == 0) *static_cast<float*>(win.at(o.dp + (size_t(t) * K + l.k[i]) * 4, s)) = dot;
    }
    __syncwarp();
  });
}

// dprobs[t,k] = dp[t,k] for kept slots, 0 for unrouted or dropped ones.
__global__ void dprobs_kernel(const float* dp, const int32_t* dest_rank, int64_t n, float* dprobs) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) dprobs[i] = dest_rank[i] >= 0 ? dp[i] : 0.0f;
}

// The start of a combine or combine backward: an LSA barrier (the peers are
// done reading what this operation overwrites in their windows), then the
// operation's number, which its flags carry.
__global__ void op_start_kernel(Window w, int32_t* epoch) {
  w.barrier();
  if (threadIdx.x == 0) ++*epoch;
}

}  // namespace nvl

// Per-group state of the nvlink backend.
struct NvlinkState {
  void* base = nullptr;  // the symmetric allocation (ncclMemAlloc; cudaMalloc when plain)
  size_t bytes = 0;
  bool plain = false;    // one rank: plain device memory, no window, no barriers
  ncclWindow_t win{};
  ncclDevComm dc{};
  bool have_win = false, have_dc = false;
  nvl::Offsets off{};
  int batch = 4;           // tokens a warp announces together (MOEFLOW_NVL_BATCH)
  int home_percent = 60;   // the home role's share of nvlink_blocks (MOEFLOW_NVL_HOME)
  int combine_home_percent = 50;  // the same in combine (by K / W; MOEFLOW_NVL_CHOME)
  bool tma = false;        // dispatch rows moved with bulk copies (MOEFLOW_NVL_TMA)
  Tensor local_ids;     // [tmax, K] int32
  RoutingPlan local;    // over the E global experts, align 1, nothing dropped
  Tensor local_ws;
  Tensor first_row, fit;           // [E] int64
  Tensor dest_rank, dest_row;      // [tmax, K]
  Tensor probs;                    // [tmax, K] float32: the last dispatch's probs (combine weights)
  RoutingPlan recv;                // this rank's receive plan (counts / offsets on the device)
  int64_t T = 0;

  // Simulated ranks (EpGroup::create_simulated): the barrier words shared by
  // the group's ranks and every rank's window.
  std::shared_ptr<void> sim_bar;
  std::vector<uint8_t*> sim_bases;

  nvl::Window view() const {
    nvl::Window w{have_win ? win : nullptr, static_cast<uint8_t*>(base), dc};
    if (sim_bar) {
      w.sim_bar = static_cast<unsigned*>(sim_bar.get());
      w.sim_world = static_cast<int>(sim_bases.size());
      for (size_t q = 0; q < sim_bases.size(); ++q) w.sim_base[q] = sim_bases[q];
    }
    return w;
  }

  // The device communicator and the window (the memory is freed by the owner).
  void release(ncclComm_t comm) {
    if (have_dc) ncclDevCommDestroy(comm, &dc);
    if (have_win) ncclCommWindowDeregister(comm, win);
    have_dc = have_win = false;
  }
};

}  // namespace moeflow
