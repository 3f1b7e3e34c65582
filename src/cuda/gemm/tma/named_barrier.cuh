// The named barriers (bar.sync / bar.arrive ids) of the TMA grouped GEMM.
// Id 0 is __syncthreads(). Consumer warpgroup c uses kBarConsumer + c for its
// own 128 threads; helper mode hands chunks over through kBarStaged + c
// (consumer c staged its chunks) and kBarFreed + c (the helpers are done with
// consumer c's chunks and probabilities; skipped before the first tile and
// after the last), bar.arrive by one side and bar.sync by the other, with
// kHandOverThreads (128 consumer + 96 helper threads).
#pragma once

namespace moeflow::cuda::gemm::sm90tma {

enum NamedBarrier : int {
  kBarHelpers = 1,   // the 96 helper warps' threads
  kBarConsumer = 2,  // + c: consumer warpgroup c (128 threads)
  kBarStaged = 4,    // + c: consumer c staged its chunks for the helpers
  kBarFreed = 6,     // + c: the helpers are done with consumer c's chunks
  // Both consumer warpgroups (256 threads): both warpgroups' wgmma reads of
  // the tile's last stage are done, so its bytes may hold staged chunks.
  kBarEpilogue = 8,
};
constexpr int kHandOverThreads = 128 + 96;

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives without waiting: the prior memory accesses of this thread are
// performed for the threads that bar.sync on the same barrier.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace moeflow::cuda::gemm::sm90tma
