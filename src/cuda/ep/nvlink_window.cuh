// The nvlink backend's view of a rank's memory window, shared by its kernels
// (nvlink_kernels.cu), their parameter structs (api.cuh) and the group's
// nvlink state (group.h).
//
// Memory: one NCCL symmetric window per rank (ncclMemAlloc +
// ncclCommWindowRegister); LSA pointers reach the peers' windows. Offsets
// says where each region starts:
//   x [regions][capacity, H]             the received rows (the result), in
//                                        EpOptions::nvlink_recv_regions regions
//   xregion [W] int32                    the region each rank receives the
//                                        current dispatch's rows in
//   probs [capacity]                     the received rows' probs
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
//   arrive [W], round, abort int32       the timed barrier: each rank's last round
//                                        here, this rank's round, its abort word
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

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(int32_t* p, int32_t v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

struct Window {
  ncclWindow_t win;  // null: one rank, or simulated ranks
  uint8_t* local;    // this rank's window
  ncclDevComm dc;
  unsigned* sim_bar = nullptr;  // simulated: [arrived, generation]
  int sim_world = 0;
  uint8_t* sim_base[kMaxSimRanks] = {};  // simulated: every rank's window
  // Timeouts (EpOptions::timeout_s, real windows): waits on the peers give
  // up after timeout_ns, record the ranks they waited for in the host-mapped
  // status ([0]: timed out, [1]: mask of the missing ranks) and set this
  // rank's abort word, which ends every other wait of the group at once.
  int world = 1, rank = 0;
  size_t off_arrive = 0, off_round = 0, off_abort = 0;
  int32_t* status = nullptr;
  unsigned long long timeout_ns = 0;  // 0: no timeout (NCCL's LSA barrier)

  __device__ __forceinline__ void* at(size_t off, int q) const {
    if (sim_bar) return sim_base[q] + off;
    return win ? ncclGetLsaPointer(win, off, q) : local + off;
  }
  __device__ __forceinline__ int32_t* abort_word() const {
    return reinterpret_cast<int32_t*>(local + off_abort);
  }
  // Gives up a wait for rank `who` (one thread).
  __device__ __forceinline__ void time_out(int who) const {
    atomicOr(status + 1, 1 << who);
    atomicExch(status, 1);
    __threadfence_system();
    st_release_sys(abort_word(), 1);
  }
  // Waits until *p == v (one thread), stored by rank `who`.
  __device__ __forceinline__ void wait_flag(const int32_t* p, int32_t v, int who) const {
    if (!timeout_ns) {
      while (ld_acquire_sys(p) != v) {
      }
      return;
    }
    const unsigned long long t0 = now_ns();
    for (unsigned n = 0; ld_acquire_sys(p) != v; ++n) {
      if ((n & 255u) != 255u) continue;
      if (ld_acquire_sys(abort_word())) return;
      if (now_ns() - t0 > timeout_ns) return time_out(who);
    }
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
    if (timeout_ns) return timed_barrier();
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dc, ncclTeamTagLsa(), 0);
    bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);
  }
  // Round r of the group's barriers (every rank counts them alike): thread p
  // stores r into rank p's arrive[me]; thread q waits for arrive[q] >= r here.
  __device__ __forceinline__ void timed_barrier() const {
    __shared__ int32_t round;
    __syncthreads();
    if (threadIdx.x == 0) {
      int32_t* r = reinterpret_cast<int32_t*>(local + off_round);
      round = ++*r;
    }
    __syncthreads();
    const int i = static_cast<int>(threadIdx.x);
    if (i < world)
      st_release_sys(static_cast<int32_t*>(at(off_arrive + size_t(rank) * sizeof(int32_t), i)),
                     round);
    if (i < world && i != rank) {
      const int32_t* mine = reinterpret_cast<const int32_t*>(local + off_arrive) + i;
      const unsigned long long t0 = now_ns();
      for (unsigned n = 0; ld_acquire_sys(mine) < round; ++n) {
        if ((n & 63u) != 63u) continue;
        if (ld_acquire_sys(abort_word())) break;
        if (now_ns() - t0 > timeout_ns) {
          time_out(i);
          break;
        }
        __nanosleep(128);
      }
      __threadfence_system();
    }
    __syncthreads();
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
  size_t x_region = 0;  // bytes of one region of x
  size_t xregion = 0;   // [W] int32: each rank's region of this dispatch
  size_t x, probs, row_src, row_k, counts, ntok, inv, stage, partial, dp, flag, epoch;
  size_t scales = 0;  // [capacity][scale bytes] (EpOptions::scale_cols)
  size_t arrive = 0, round = 0, abort = 0;  // the timed barrier and the abort word
};

}  // namespace nvl
}  // namespace moeflow
