// Hopper bulk-copy (TMA) and mbarrier primitives shared by the kernels that
// move whole rows through shared memory (grouped GEMM epilogues, the nvlink
// dispatch). sm_90 PTX: callers compile them for sm_90 and newer only.
#pragma once

#include <cstdint>

namespace moeflow::cuda::bulk {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global memory
// into shared memory; completes a transaction of `bar`.
__device__ __forceinline__ void load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
// bytes from shared memory to global memory (any GPU the address maps to), in
// the current bulk group.
__device__ __forceinline__ void store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most n (0..4) bulk groups of this thread still read shared
// memory (n > 4 waits for at most 4).
__device__ __forceinline__ void wait_read(int n) {
  switch (n) {
    case 0:
      asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
      break;
    case 1:
      asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
      break;
    case 2:
      asm volatile("cp.async.bulk.wait_group.read 2;\n" ::: "memory");
      break;
    case 3:
      asm volatile("cp.async.bulk.wait_group.read 3;\n" ::: "memory");
      break;
    default:
      asm volatile("cp.async.bulk.wait_group.read 4;\n" ::: "memory");
      break;
  }
}
__device__ __forceinline__ void wait_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Waits until every bulk group of this thread has completed (its writes done).
__device__ __forceinline__ void wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Orders this thread's completed bulk (async proxy) writes before its later
// generic memory operations.
__device__ __forceinline__ void fence_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

}  // namespace moeflow::cuda::bulk
