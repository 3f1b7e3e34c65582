// Backend "nvlink" of expert-parallel dispatch / combine (issue 6, first
// version; docs/ep-nvlink-design.md). Included by ep.cu only.
//
// Memory: one NCCL symmetric window per rank (ncclMemAlloc +
// ncclCommWindowRegister), holding the receive rows [capacity, H], their
// probs [capacity], the count matrix int32 [W][E] and the combine's staging
// of the expert outputs [capacity, H]; LSA pointers reach the peers' windows.
//
// dispatch (no host synchronisation):
//   1. the rank's slots ranked per global expert: build_plan over its ids with
//      the E global experts (align 1, nothing dropped) gives every slot its
//      rank among the rank's slots to that expert, in (token, k) order, and the
//      rank's count per expert;
//   2. one block: LSA barrier (the peers are done with the previous round),
//      the rank's counts stored into row `rank` of every peer's count matrix,
//      LSA barrier; then, from the matrix, where each of its slots lands on
//      its expert's rank (core/ep_layout.h, the reference's layout and drop
//      rule) and the rank's own receive plan;
//   3. one warp per token: the row stored straight into its final padded row
//      on each expert's rank (once per kept slot), with its prob; the pad rows
//      of the rank's own layout zeroed;
//   4. one block: LSA barrier (all rows have landed everywhere).
// combine_backward: y copied into the staging, the grad staging's pad rows
// zeroed, LSA barrier; one warp per token pushes w * dout[t] into each kept
// slot's row of the grad staging on its rank and computes dprobs from the
// pulled y rows; LSA barrier; the used rows copied out to grad_y.
// combine: the expert outputs copied into the window's staging, LSA barrier,
// then one warp per token pulls its kept slots' rows from the ranks that hold
// them (k ascending per rank, ranks ascending, float32), the reference's sum
// order, bitwise the nccl backend's.
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
__global__ void counts_kernel(Window win, size_t off_counts,
                              const int32_t* my_counts, int E, int W, int me, int64_t capacity,
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

// Step 3: one warp per token; rank of slot (t,k) among this rank's slots to
// its expert g = local_dest_row - local_offsets[g] (the local plan).
__global__ void rows_kernel(Window win, size_t off_x, size_t off_probs, const uint8_t* x,
                            int64_t x_stride_bytes, int64_t row_bytes, const int32_t* ids,
                            const float* probs, int64_t T, int K, int E, int L,
                            const int64_t* local_dest,
                            const int64_t* local_offsets, const int64_t* first_row,
                            const int64_t* fit, int32_t* dest_rank, int64_t* dest_row) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t t = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; t < T; t += warps) {
    const uint4* src = reinterpret_cast<const uint4*>(x + t * x_stride_bytes);
    for (int k = 0; k < K; ++k) {
      const int g = ids[t * K + k];
      int64_t row = -1;
      int q = -1;
      if (g >= 0 && g < E) {  // ids outside [-1, E) are unrouted (counted by the plan)
        const int64_t rk = local_dest[t * K + k] - local_offsets[g];
        if (rk >= 0 && rk < fit[g]) {
          row = first_row[g] + rk;
          q = g / L;
        }
      }
      if (lane == 0) {
        dest_rank[t * K + k] = row >= 0 ? q : -1;
        dest_row[t * K + k] = row;
      }
      if (row < 0) continue;
      uint4* dst = static_cast<uint4*>(win.at(off_x + row * row_bytes, q));
      for (int64_t v = lane; v < row_bytes / 16; v += 32) dst[v] = src[v];
      if (lane == 0)
        *static_cast<float*>(win.at(off_probs + row * sizeof(float), q)) =
            probs ? probs[t * K + k] : 0.0f;
    }
  }
}

// Pad rows of this rank's own layout: zeros (rows, and probs when given).
__global__ void pads_kernel(uint8_t* recv_x, float* recv_probs, int64_t row_bytes, int L,
                            int align, const int32_t* kept, const int32_t* padded,
                            const int64_t* offsets) {
  const int e = blockIdx.x;
  if (e >= L) return;
  for (int64_t r = offsets[e] + kept[e]; r < offsets[e] + padded[e]; ++r) {
    uint4* dst = reinterpret_cast<uint4*>(recv_x + r * row_bytes);
    for (int64_t v = threadIdx.x; v < row_bytes / 16; v += blockDim.x) dst[v] = make_uint4(0, 0, 0, 0);
    if (threadIdx.x == 0 && recv_probs) recv_probs[r] = 0.0f;
  }
}

// combine: one warp per token, N elements of T per lane access (16 bytes).
template <typename T, typename TOut, int N>
__global__ void pull_kernel(Window win, size_t off_y, int64_t H, int64_t Tn, int K, int W,
                            const int32_t* dest_rank, const int64_t* dest_row,
                            const float* weights, TOut* out, int64_t out_stride) {
  using P = cuda::Pack<T, N>;
  using PO = cuda::Pack<TOut, N>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  const int64_t packs = H / N;
  for (int64_t t = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; t < Tn; t += warps) {
    for (int64_t p = lane; p < packs; p += 32) {
      float acc[N];
      bool first = true;
      for (int q = 0; q < W; ++q) {
        float part[N];
        bool any = false;
        for (int k = 0; k < K; ++k) {
          if (dest_rank[t * K + k] != q) continue;
          const T* yrow = static_cast<const T*>(win.at(off_y + dest_row[t * K + k] * H * sizeof(T), q));
          const P v = reinterpret_cast<const P*>(yrow)[p];
          const float w = weights ? weights[t * K + k] : 1.0f;
#pragma unroll
          for (int j = 0; j < N; ++j)
            part[j] = fmaf(w, cuda::to_float(v.v[j]), any ? part[j] : 0.0f);
          any = true;
        }
        if (!any) continue;
#pragma unroll
        for (int j = 0; j < N; ++j) acc[j] = first ? part[j] : acc[j] + part[j];
        first = false;
      }
      PO o;
#pragma unroll
      for (int j = 0; j < N; ++j) o.v[j] = cuda::from_float<TOut>(first ? 0.0f : acc[j]);
      reinterpret_cast<PO*>(out + t * out_stride)[p] = o;
    }
  }
}

// combine backward, one warp per token: w * dout[t] stored into the grad
// staging row of each kept slot on its rank, and dprobs[t,k] = <dout[t],
// y[row]> with y read from that rank's staging (0 for unrouted / dropped).
template <typename T>
__global__ void push_grad_kernel(Window win, size_t off_y, size_t off_g, int64_t H,
                                 int64_t Tn, int K, const int32_t* dest_rank,
                                 const int64_t* dest_row, const float* weights, const T* dout,
                                 int64_t dout_stride, float* dprobs) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t t = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; t < Tn; t += warps) {
    const T* d = dout + t * dout_stride;
    for (int k = 0; k < K; ++k) {
      const int q = dest_rank[t * K + k];
      float dot = 0.0f;
      if (q >= 0) {
        const int64_t row = dest_row[t * K + k];
        const float w = weights ? weights[t * K + k] : 1.0f;
        T* g = static_cast<T*>(win.at(off_g + row * H * sizeof(T), q));
        const T* y = static_cast<const T*>(win.at(off_y + row * H * sizeof(T), q));
        for (int64_t j = lane; j < H; j += 32) {
          const float dv = cuda::to_float(d[j]);
          g[j] = cuda::from_float<T>(w * dv);
          dot = fmaf(dv, cuda::to_float(y[j]), dot);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      }
      if (dprobs && lane == 0) dprobs[t * K + k] = dot;
    }
  }
}

// Rows [0, total_rows) of src into dst (16-byte vectors; row_bytes % 16 == 0).
__global__ void copy_used_rows_kernel(const uint8_t* src, uint8_t* dst, int64_t dst_stride_bytes,
                                      int64_t row_bytes, const int64_t* total_rows) {
  const int64_t rows = *total_rows, per = row_bytes / 16;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * per;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / per, v = i % per;
    reinterpret_cast<uint4*>(dst + r * dst_stride_bytes)[v] =
        reinterpret_cast<const uint4*>(src + r * row_bytes)[v];
  }
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
  size_t off_x = 0, off_probs = 0, off_counts = 0, off_y = 0, off_g = 0;
  Tensor local_ids;     // [tmax, K] int32
  RoutingPlan local;    // over the E global experts, align 1, nothing dropped
  Tensor local_ws;
  Tensor first_row, fit;           // [E] int64
  Tensor dest_rank, dest_row;      // [tmax, K]
  Tensor probs;                    // [tmax, K] float32: the last dispatch's probs (combine weights)
  RoutingPlan recv;                // this rank's receive plan (counts / offsets on the device)
  Tensor recv_padded;              // [L] int32
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
