// PTX wrappers of the TMA grouped GEMM: tensor loads into shared memory,
// tensor stores / reduce-adds out of it (bulk groups), the register split.
#pragma once

#include <cuda.h>

#include "cuda/bulk.cuh"
#include "cuda/common.cuh"

namespace moeflow::cuda::gemm::sm90tma {

using bulk::mbar_arrive;
using bulk::mbar_expect_tx;
using bulk::mbar_init;
using bulk::mbar_wait;
using bulk::smem_u32;
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// TMA store / reduce-add of one 64-row x 128-byte staging chunk (bulk group).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0,
                                             int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(src)), "r"(c0), "r"(c1)
      : "memory");
}
// The same with an L2 evict-first hint (outputs not read again soon: they
// should not push the operand tiles out of L2).
__device__ __forceinline__ void tma_store_2d_stream(const CUtensorMap* map, const void* src, int c0,
                                                    int c1) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group.L2::cache_hint"
      " [%0, {%2, %3}], [%1], %4;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "l"(policy)
      : "memory");
}
template <bool ADD>
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0,
                                             int c1, int c2) {
  if constexpr (ADD)
    asm volatile(
        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], "
        "[%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
        "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::
            "l"(reinterpret_cast<uint64_t>(map)),
        "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  bulk::commit();
}
// Waits until at most n (0..4) bulk groups of this thread still read shared memory.
__device__ __forceinline__ void bulk_wait_read(int n) {
  bulk::wait_read(n);
}
__device__ __forceinline__ void bulk_wait_all() {
  bulk::wait_all();
}

// Two float32 values rounded to a 2-byte type, packed into one 32-bit register.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float2 v) {
  static_assert(sizeof(T) == 2, "pack2: 2-byte types");
  Pack<T, 2> o;
  o.v[0] = from_float<T>(v.x);
  o.v[1] = from_float<T>(v.y);
  return *reinterpret_cast<const uint32_t*>(&o);
}
// Two adjacent outputs at shared-memory address `addr` (4-byte aligned for
// 2-byte types, 8-byte aligned for float32).
template <typename T>
__device__ __forceinline__ void st_shared_pair(uint32_t addr, float2 v) {
  if constexpr (sizeof(T) == 4)
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
  else
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pack2<T>(v)) : "memory");
}
// stmatrix.x4: four 8 x 8 matrices of 2-byte values; register i of the lane
// holds row lane / 4, columns 2 (lane % 4) and + 1 of matrix i (the mma
// accumulator layout); lanes 8i .. 8i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace moeflow::cuda::gemm::sm90tma
