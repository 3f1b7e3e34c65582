// The nvlink backend's view of a rank's memory window, shared by its kernels
// (nvlink_kernels.cu), their parameter structs (api.cuh) and the group's
// nvlink state (group.h).
//
// Memory: one NCCL symmetric window per rank (ncclMemAlloc +
// ncclCommWindowRegister); LSA pointers reach the peers' windows. Offsets
// says where each region starts:
//   x [capacity, H], probs [capacity]    the received rows (the result)
//   row_src, row_k [capacity] int32      per row: source rank * tmax + token, k
//                                        (-1: pad row)
//   counts [W][E], ntok [W] int32        the count matrix, the ranks' T
//   inv [W][tmax][K] int32               per peer token and k: its row here (-1)
//   stage [W][tmax][H]                   token rows of the peers, once per token
//                                        (dispatch: x; combine backward: dout)
//   partial [W][tmax][H] float32         per home token: the holder's partial sum
//   dp [tmax][K] float32                 dprobs of this rank's slots
//   flag [W][tmax], epoch int32          per-token announcements, the operation's number
//   scales [capacity][scale bytes]       per-row scales (EpOptions::scale_cols)
// The NCCL device API (nccl_device.h) is inline code compiled into moeflow:
// it must come from the libnccl that runs (checked at group creation).
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>

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
  unsigned* sim_bar = nullptr;  // simulated: [arrived, generation]
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

// Where each part of the window starts (bytes).
struct Offsets {
  size_t x, probs, row_src, row_k, counts, ntok, inv, stage, partial, dp, flag, epoch;
  size_t scales = 0;  // [capacity][scale bytes] (EpOptions::scale_cols)
};

}  // namespace nvl
}  // namespace moeflow
