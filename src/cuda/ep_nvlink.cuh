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
//      and the rank's own receive plan; pad rows zeroed;
//   3. one warp per token: x[t] read once and stored into each own kept slot's
//      final row, and once into the stage of every peer holding a kept slot
//      (a token crosses to a rank once); per kept slot its prob, row_src and
//      row_k, and per peer the token's inv entries;
//   4. barrier; one warp per received row from a peer: copied from the stage
//      into its final row.
// combine: barrier; on the holder, one warp per peer token with kept slots
// here: the float32 sum of its slots (k ascending, weighted) stored into the
// home rank's partial; barrier; one warp per home token: own slots summed (k
// ascending) and the partials of the ranks added, ranks ascending: the
// reference's order, bitwise the nccl backend's.
// combine backward: barrier; dout[t] stored once into the stage of every peer
// holding a slot of t; barrier; one warp per received row: grad_y = w * dout
// (pad rows 0) and <dout, y> stored into the home rank's dp; barrier; dprobs.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include "core/ep_layout.h"

namespace moeflow {
namespace nvl {

constexpr size_t kAlign = 256;
inline size_t round_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

// The rank's window as kernels see it: NCCL's LSA pointers into the peers'
// windows, or, for a group of one rank (NCCL gives a one-rank communicator
// no symmetric memory), plain device memory and no barriers.
struct Window {
  ncclWindow_t win;  // null: one rank
  uint8_t* local;    // this rank's window
  ncclDevComm dc;
  __device__ __forceinline__ void* at(size_t off, int q) const {
    return win ? ncclGetLsaPointer(win, off, q) : local + off;
  }
  // An LSA barrier of the whole block with the peers (every thread calls it).
  __device__ __forceinline__ void barrier() const {
    __threadfence_system();  // earlier stores to the peers, before the arrive
    if (!win) {
      __syncthreads();
      return;
    }
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dc, ncclTeamTagLsa(), 0);
    bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);
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

// Step 2 (one block): counts exchanged, slot ranges and the receive plan.
__global__ void counts_kernel(Window win, size_t off_counts, size_t off_ntok,
                              const int32_t* my_counts, int32_t my_T, int E, int W, int me,
                              int64_t capacity,
                              int align, int64_t* first_row, int64_t* fit, int32_t* kept,
                              int32_t* padded, int64_t* offsets, int64_t* total_rows,
                              int32_t* overflow) {
  win.barrier();  // the peers are done with the last round
  for (int i = threadIdx.x; i < W * E; i += blockDim.x) {
    const int p = i / E, g = i % E;
    int32_t* dst = static_cast<int32_t*>(
        win.at(off_counts + (size_t(me) * E + g) * sizeof(int32_t), p));
    *dst = my_counts[g];
  }
  for (int p = threadIdx.x; p < W; p += blockDim.x)
    *static_cast<int32_t*>(win.at(off_ntok + size_t(me) * sizeof(int32_t), p)) = my_T;
  win.barrier();  // every row of the matrix is in
  const int32_t* C = static_cast<const int32_t*>(win.at(off_counts, me));
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    const EpSlotRange r = ep_slot_range(C, W, E, me, g, capacity, align);
    first_row[g] = r.first_row;
    fit[g] = r.fit;
  }
  if (threadIdx.x == 0) {
    int64_t dropped = 0;
    ep_recv_layout(C, W, E, me, capacity, align, kept, offsets, &dropped);
    const int L = E / W;
    for (int e = 0; e < L; ++e) padded[e] = static_cast<int32_t>((kept[e] + align - 1) / align * align);
    *total_rows = offsets[L];
    *overflow = static_cast<int32_t>(dropped);
  }
}

// Where each part of the window starts (bytes).
struct Offsets {
  size_t x, probs, row_src, row_k, counts, ntok, inv, stage, partial, dp;
};

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 8;     // warps per block of the row kernels (256 threads)
constexpr int kMaxDest = 40;  // destinations of one token: K <= 32 own slots + W - 1 <= 7 peers
constexpr int kUnroll = 4;    // 16-byte vectors in flight per lane

// One warp copies a row of n16 16-byte vectors from src to each of the nd
// destinations dst[0..nd), reading every vector once.
__device__ __forceinline__ void warp_copy_row(const uint4* __restrict__ src, uint4* const* dst,
                                              int nd, int64_t n16, int lane) {
  for (int64_t b = 0; b < n16; b += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = b + u * 32 + lane;
      if (i < n16) v[u] = __ldg(src + i);
    }
    for (int d = 0; d < nd; ++d) {
      uint4* o = dst[d];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = b + u * 32 + lane;
        if (i < n16) o[i] = v[u];
      }
    }
  }
}

// Pad rows of this rank's layout: zero rows, zero probs, row_src -1.
__global__ void pads_kernel(uint8_t* recv_x, float* recv_probs, int32_t* row_src,
                            int64_t row_bytes, int L, const int32_t* kept, const int32_t* padded,
                            const int64_t* offsets) {
  const int e = blockIdx.x;
  if (e >= L) return;
  for (int64_t r = offsets[e] + kept[e]; r < offsets[e] + padded[e]; ++r) {
    uint4* dst = reinterpret_cast<uint4*>(recv_x + r * row_bytes);
    for (int64_t v = threadIdx.x; v < row_bytes / 16; v += blockDim.x) dst[v] = make_uint4(0, 0, 0, 0);
    if (threadIdx.x == 0) {
      recv_probs[r] = 0.0f;
      row_src[r] = -1;
    }
  }
}

// Dispatch step 3, one warp per token. The slot (t,k) to global expert g has
// rank local_dest[t,k] - local_offsets[g] among this rank's slots to g (the
// local plan); it lands on row first_row[g] + that rank of rank g / L when the
// rank is below fit[g], and is dropped otherwise.
__global__ void __launch_bounds__(kWarps * 32)
    dispatch_push_kernel(Window win, Offsets o, const uint8_t* x, int64_t x_stride_bytes,
                         int64_t row_bytes, const int32_t* ids, const float* probs, int64_t T,
                         int K, int E, int L, int W, int me, int64_t tmax,
                         const int64_t* local_dest, const int64_t* local_offsets,
                         const int64_t* first_row, const int64_t* fit, int32_t* dest_rank,
                         int64_t* dest_row) {
  __shared__ uint4* dests[kWarps][kMaxDest];
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  uint4** my = dests[wib];
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t t = blockIdx.x * int64_t{kWarps} + wib; t < T; t += warps) {
    int q = -1;
    int64_t row = -1;
    if (lane < K) {
      const int g = ids[t * K + lane];
      if (g >= 0 && g < E) {  // ids outside [-1, E) are unrouted (counted by the plan)
        const int64_t rk = local_dest[t * K + lane] - local_offsets[g];
        if (rk >= 0 && rk < fit[g]) {
          row = first_row[g] + rk;
          q = g / L;
        }
      }
      dest_rank[t * K + lane] = q;
      dest_row[t * K + lane] = row;
      if (row >= 0) {
        *static_cast<float*>(win.at(o.probs + row * sizeof(float), q)) =
            probs ? probs[t * K + lane] : 0.0f;
        *static_cast<int32_t*>(win.at(o.row_src + row * sizeof(int32_t), q)) =
            static_cast<int32_t>(me * tmax + t);
        *static_cast<int32_t*>(win.at(o.row_k + row * sizeof(int32_t), q)) = lane;
      }
      for (int p = 0; p < W; ++p)  // every peer learns where t's slots are on it
        if (p != me)
          *static_cast<int32_t*>(
              win.at(o.inv + ((size_t(me) * tmax + t) * K + lane) * sizeof(int32_t), p)) =
              q == p ? static_cast<int32_t>(row) : -1;
    }
    // destinations: the own kept slots' rows (k ascending), then the stage
    // of each peer holding a kept slot
    const unsigned own = __ballot_sync(kFull, row >= 0 && q == me);
    if ((own >> lane) & 1u)
      my[__popc(own & ((1u << lane) - 1u))] =
          reinterpret_cast<uint4*>(win.local + o.x + row * row_bytes);
    int nd = __popc(own);
    for (int p = 0; p < W; ++p) {
      if (p == me || !__ballot_sync(kFull, row >= 0 && q == p)) continue;
      if (lane == 0)
        my[nd] = static_cast<uint4*>(win.at(o.stage + (size_t(me) * tmax + t) * row_bytes, p));
      ++nd;
    }
    __syncwarp();
    warp_copy_row(reinterpret_cast<const uint4*>(x + t * x_stride_bytes), my, nd, row_bytes / 16,
                  lane);
    __syncwarp();  // the list is rewritten for the next token
  }
}

// Dispatch step 4: every used row that came from a peer, from the stage into
// its final row (rows of this rank's own tokens were stored directly).
__global__ void __launch_bounds__(kWarps * 32)
    expand_kernel(const uint8_t* stage, uint8_t* recv_x, const int32_t* row_src,
                  int64_t row_bytes, int me, int64_t tmax, const int64_t* total_rows) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = *total_rows, warps = int64_t{gridDim.x} * kWarps;
  for (int64_t r = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; r < rows; r += warps) {
    const int32_t st = row_src[r];
    if (st < 0 || st / tmax == me) continue;
    uint4* dst = reinterpret_cast<uint4*>(recv_x + r * row_bytes);
    warp_copy_row(reinterpret_cast<const uint4*>(stage + st * row_bytes), &dst, 1, row_bytes / 16,
                  lane);
  }
}

// N floats of a partial row from / to memory (16-byte stores when N % 4 == 0).
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
__device__ __forceinline__ void load_floats(const float* src, float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < N; j += 4) {
      const float4 f = *reinterpret_cast<const float4*>(src + j);
      v[j] = f.x;
      v[j + 1] = f.y;
      v[j + 2] = f.z;
      v[j + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = src[j];
  }
}

// part = sum over the slots in `mask` (k ascending) of w_k * y[row_k] for the
// N elements at `col`; rows and weights are held by lane k. Every lane of the
// warp calls it (shuffles); only lanes with `ok` load.
template <typename T, int N>
__device__ __forceinline__ void slot_sum(const T* y, int64_t y_stride, unsigned mask, int64_t row,
                                         float w, int64_t col, bool ok, float (&part)[N]) {
  using P = cuda::Pack<T, N>;
  bool any = false;
  while (mask) {
    const int k = __ffs(mask) - 1;
    mask &= mask - 1;
    const int64_t r = __shfl_sync(kFull, row, k);
    const float wk = __shfl_sync(kFull, w, k);
    if (!ok) continue;
    const P v = *reinterpret_cast<const P*>(y + r * y_stride + col);
#pragma unroll
    for (int j = 0; j < N; ++j) part[j] = fmaf(wk, cuda::to_float(v.v[j]), any ? part[j] : 0.0f);
    any = true;
  }
}

// Combine, on the holder: one warp per peer token with kept slots here; its
// float32 partial (slots k ascending, weighted by the received probs when
// `weighted`) stored into the home rank's partial[me][t].
template <typename T, int N>
__global__ void __launch_bounds__(kWarps * 32)
    combine_partial_kernel(Window win, Offsets o, const T* y, int64_t y_stride, int64_t H, int K,
                           int W, int me, int64_t tmax, bool weighted) {
  const int lane = threadIdx.x % 32;
  const int32_t* ntok = reinterpret_cast<const int32_t*>(win.local + o.ntok);
  const int32_t* inv = reinterpret_cast<const int32_t*>(win.local + o.inv);
  const float* rprobs = reinterpret_cast<const float*>(win.local + o.probs);
  int64_t items = 0;
  for (int s = 0; s < W; ++s)
    if (s != me) items += ntok[s];
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t i = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; i < items; i += warps) {
    int s = 0;
    int64_t t = i;
    for (;; ++s) {  // item i -> (peer s, token t)
      if (s == me) continue;
      if (t < ntok[s]) break;
      t -= ntok[s];
    }
    int64_t row = -1;
    float w = 0.0f;
    if (lane < K) {
      row = inv[(size_t(s) * tmax + t) * K + lane];
      if (row >= 0) w = weighted ? rprobs[row] : 1.0f;
    }
    const unsigned mask = __ballot_sync(kFull, row >= 0);
    if (!mask) continue;
    float* dst = static_cast<float*>(win.at(o.partial + (size_t(me) * tmax + t) * H * 4, s));
    for (int64_t p0 = 0; p0 < H / N; p0 += 32) {  // warp-uniform trips (shuffles inside)
      const int64_t p = p0 + lane;
      const bool ok = p < H / N;
      float part[N];
      slot_sum<T, N>(y, y_stride, mask, row, w, p * N, ok, part);
      if (ok) store_floats<N>(dst + p * N, part);
    }
  }
}

// Combine, at home: one warp per token; ranks ascending, the own slots summed
// here (k ascending), the peers' partials read from this rank's window.
template <typename T, typename TOut, int N>
__global__ void __launch_bounds__(kWarps * 32)
    combine_home_kernel(Window win, Offsets o, const T* y, int64_t y_stride, int64_t H,
                        int64_t Tn, int K, int W, int me, int64_t tmax, const int32_t* dest_rank,
                        const int64_t* dest_row, const float* weights, TOut* out,
                        int64_t out_stride) {
  using PO = cuda::Pack<TOut, N>;
  const int lane = threadIdx.x % 32;
  const float* partial = reinterpret_cast<const float*>(win.local + o.partial);
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t t = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; t < Tn; t += warps) {
    int q = -1;
    int64_t row = -1;
    float w = 0.0f;
    if (lane < K) {
      q = dest_rank[t * K + lane];
      row = dest_row[t * K + lane];
      w = weights ? weights[t * K + lane] : 1.0f;
    }
    const unsigned ranks = __reduce_or_sync(kFull, q >= 0 ? 1u << q : 0u);
    const unsigned own = __ballot_sync(kFull, q == me && q >= 0);
    for (int64_t p0 = 0; p0 < H / N; p0 += 32) {  // warp-uniform trips (shuffles inside)
      const int64_t p = p0 + lane;
      const bool ok = p < H / N;
      float acc[N];
      bool first = true;
      for (int r = 0; r < W; ++r) {
        if (!((ranks >> r) & 1u)) continue;
        float part[N];
        if (r == me)
          slot_sum<T, N>(y, y_stride, own, row, w, p * N, ok, part);
        else if (ok)
          load_floats<N>(partial + (size_t(r) * tmax + t) * H + p * N, part);
#pragma unroll
        for (int j = 0; j < N; ++j) acc[j] = first ? part[j] : acc[j] + part[j];
        first = false;
      }
      PO v;
#pragma unroll
      for (int j = 0; j < N; ++j) v.v[j] = cuda::from_float<TOut>(first ? 0.0f : acc[j]);
      if (ok) *reinterpret_cast<PO*>(out + t * out_stride + p * N) = v;
    }
  }
}

// Combine backward, at home: dout[t] stored once into the stage of every peer
// holding a kept slot of t.
__global__ void __launch_bounds__(kWarps * 32)
    push_dout_kernel(Window win, Offsets o, const uint8_t* dout, int64_t dout_stride_bytes,
                     int64_t row_bytes, int64_t Tn, int K, int W, int me, int64_t tmax,
                     const int32_t* dest_rank) {
  __shared__ uint4* dests[kWarps][kMaxDest];
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  uint4** my = dests[wib];
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t t = blockIdx.x * int64_t{kWarps} + wib; t < Tn; t += warps) {
    const int q = lane < K ? dest_rank[t * K + lane] : -1;
    int nd = 0;
    for (int p = 0; p < W; ++p) {
      if (p == me || !__ballot_sync(kFull, q == p)) continue;
      if (lane == 0)
        my[nd] = static_cast<uint4*>(win.at(o.stage + (size_t(me) * tmax + t) * row_bytes, p));
      ++nd;
    }
    if (nd == 0) continue;
    __syncwarp();
    warp_copy_row(reinterpret_cast<const uint4*>(dout + t * dout_stride_bytes), my, nd,
                  row_bytes / 16, lane);
    __syncwarp();
  }
}

// Combine backward, on the holder: one warp per used row: grad_y[r] = w *
// dout[t] (w = the row's prob when `weighted`; pad rows 0), and <dout[t],
// y[r]> stored into dp[t*K + k] of the home rank. dout[t] is this rank's own
// (home == holder) or the home rank's copy in the stage.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    grad_rows_kernel(Window win, Offsets o, const T* dout, int64_t dout_stride, const T* y,
                     int64_t y_stride, T* grad_y, int64_t g_stride, int64_t H, int K, int me,
                     int64_t tmax, bool weighted, const int64_t* total_rows) {
  constexpr int N = 16 / sizeof(T);
  using P = cuda::Pack<T, N>;
  const int lane = threadIdx.x % 32;
  const int32_t* row_src = reinterpret_cast<const int32_t*>(win.local + o.row_src);
  const int32_t* row_k = reinterpret_cast<const int32_t*>(win.local + o.row_k);
  const float* rprobs = reinterpret_cast<const float*>(win.local + o.probs);
  const T* stage = reinterpret_cast<const T*>(win.local + o.stage);
  const int64_t rows = *total_rows, warps = int64_t{gridDim.x} * kWarps;
  for (int64_t r = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; r < rows; r += warps) {
    const int32_t st = row_src[r];
    P* g = reinterpret_cast<P*>(grad_y + r * g_stride);
    if (st < 0) {  // pad row
      P z;
#pragma unroll
      for (int j = 0; j < N; ++j) z.v[j] = cuda::from_float<T>(0.0f);
      for (int64_t p = lane; p < H / N; p += 32) g[p] = z;
      continue;
    }
    const int s = static_cast<int>(st / tmax);
    const int64_t t = st % tmax;
    const T* d = s == me ? dout + t * dout_stride : stage + st * H;
    const float w = weighted ? rprobs[r] : 1.0f;
    float dot = 0.0f;
    for (int64_t p = lane; p < H / N; p += 32) {
      const P dv = reinterpret_cast<const P*>(d)[p];
      const P yv = reinterpret_cast<const P*>(y + r * y_stride)[p];
      P gv;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float f = cuda::to_float(dv.v[j]);
        gv.v[j] = cuda::from_float<T>(w * f);
        dot = fmaf(f, cuda::to_float(yv.v[j]), dot);
      }
      g[p] = gv;
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) dot += __shfl_xor_sync(kFull, dot, m);
    if (lane == 0)
      *static_cast<float*>(win.at(o.dp + (size_t(t) * K + row_k[r]) * sizeof(float), s)) = dot;
  }
}

// dprobs[t,k] = dp[t,k] for kept slots, 0 for unrouted or dropped ones.
__global__ void dprobs_kernel(const float* dp, const int32_t* dest_rank, int64_t n, float* dprobs) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) dprobs[i] = dest_rank[i] >= 0 ? dp[i] : 0.0f;
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
  Tensor local_ids;     // [tmax, K] int32
  RoutingPlan local;    // over the E global experts, align 1, nothing dropped
  Tensor local_ws;
  Tensor first_row, fit;           // [E] int64
  Tensor dest_rank, dest_row;      // [tmax, K]
  Tensor probs;                    // [tmax, K] float32: the last dispatch's probs (combine weights)
  RoutingPlan recv;                // this rank's receive plan (counts / offsets on the device)
  int64_t T = 0;

  nvl::Window view() const {
    return nvl::Window{have_win ? win : nullptr, static_cast<uint8_t*>(base), dc};
  }

  // The device communicator and the window (the memory is freed by the owner).
  void release(ncclComm_t comm) {
    if (have_dc) ncclDevCommDestroy(comm, &dc);
    if (have_win) ncclCommWindowDeregister(comm, win);
    have_dc = have_win = false;
  }
};

}  // namespace moeflow
