// Probe: how fast can N blocks move bytes into the NVLink peer (push) or from
// it (pull), with plain 16-byte accesses vs bulk (TMA) copies through shared
// memory; plus local copies and reads. Both ranks (two GPUs, one thread each)
// run the same test at the same time, through NCCL symmetric memory (LSA
// pointers). Output: bench/results/nvlink-probe-*.txt.
// Build: nvcc -O2 -std=c++17 -arch=sm_90a -I$NCCL/include nvlink_copy_probe.cu \
//          -L$NCCL/lib -lnccl -o nvlink_copy_probe   (NCCL 2.28+, the device API)
// Run:   NCCL_NVLS_ENABLE=0 ./nvlink_copy_probe
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>
#define CK(x)                                                           \
  do {                                                                  \
    cudaError_t e = (x);                                                \
    if (e) {                                                            \
      printf("CUDA %s @%d: %s\n", #x, __LINE__, cudaGetErrorString(e)); \
      exit(1);                                                          \
    }                                                                   \
  } while (0)
#define NK(x)                                                           \
  do {                                                                  \
    ncclResult_t e = (x);                                               \
    if (e) {                                                            \
      printf("NCCL %s @%d: %s\n", #x, __LINE__, ncclGetErrorString(e)); \
      exit(1);                                                          \
    }                                                                   \
  } while (0)

__device__ __forceinline__ uint32_t su(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

__global__ void peer_ptr(ncclWindow_t win, int peer, void** out) {
  *out = ncclGetLsaPointer(win, 0, peer);
}
__global__ void bar_kernel(ncclDevComm dc) {
  ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dc, ncclTeamTagLsa(), 0);
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}

template <int U>
__global__ void plain_copy(const int4* __restrict__ src, int4* __restrict__ dst, size_t n16) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n16; i += stride) dst[i] = src[i];
}

template <int U>
__global__ void plain_read(const int4* __restrict__ src, size_t n16, int* sink) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  int acc = 0;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678) *sink = acc;
}
// Each warp's lane 0 runs a ring of NB buffers of CH bytes: bulk load, wait,
// bulk store. Chunks are dealt round robin over all warps of the grid.
template <int NB>
__global__ void bulk_copy(const char* src, char* dst, size_t bytes, int CH) {
  extern __shared__ __align__(128) char sm[];
  const int warp = threadIdx.x / 32, nw = blockDim.x / 32;
  __shared__ uint64_t bars[32 * 8];
  if ((threadIdx.x & 31) != 0) return;
  char* buf = sm + (size_t)warp * NB * CH;
  uint64_t* bar = bars + warp * NB;
  for (int b = 0; b < NB; ++b)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su(bar + b)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const size_t nchunks = bytes / CH;
  const size_t gw = (size_t)blockIdx.x * nw + warp, tw = (size_t)gridDim.x * nw;
  uint32_t phase = 0;
  int k = 0;
  // prime: issue loads for the first NB chunks
  size_t c0 = gw;
  for (int b = 0; b < NB; ++b) {
    size_t c = c0 + b * tw;
    if (c >= nchunks) break;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su(bar + b)),
                 "r"(CH)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(su(buf + b * CH)),
        "l"(src + c * CH), "r"(CH), "r"(su(bar + b))
        : "memory");
  }
  for (size_t c = gw, it = 0; c < nchunks; c += tw, ++it) {
    const int b = it % NB;
    const uint32_t par = (it / NB) & 1;
    asm volatile(
        "{.reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W;}" ::"r"(
            su(bar + b)),
        "r"(par)
        : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * CH),
                 "r"(su(buf + b * CH)), "r"(CH)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // refill the buffer of chunk it+NB once its store read it: wait until only
    // the stores issued after it remain... simplest: wait read of this group
    const size_t cn = c + NB * tw;
    if (cn < nchunks) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su(bar + b)),
                   "r"(CH)
                   : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(su(buf + b * CH)),
          "l"(src + cn * CH), "r"(CH), "r"(su(bar + b))
          : "memory");
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    printf("need 2 GPUs, have %d\n", n);
    return 1;
  }
  n = 2;
  ncclUniqueId id;
  NK(ncclGetUniqueId(&id));
  const size_t bytes = 256ull << 20;
  std::vector<std::thread> th;
  for (int r = 0; r < n; ++r)
    th.emplace_back([&, r] {
      CK(cudaSetDevice(r));
      ncclComm_t comm;
      NK(ncclCommInitRank(&comm, n, id, r));
      void* buf;
      NK(ncclMemAlloc(&buf, 2 * bytes));
      ncclWindow_t win;
      NK(ncclCommWindowRegister(comm, buf, 2 * bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
      ncclDevCommRequirements req{};
      req.lsaBarrierCount = 1;
      ncclDevComm dc;
      NK(ncclDevCommCreate(comm, &req, &dc));
      // peer pointer: host-side LSA pointer of the peer's window
      void** pp;
      CK(cudaMalloc(&pp, 8));
      peer_ptr<<<1, 1>>>(win, 1 - r, pp);
      void* peer = nullptr;
      CK(cudaMemcpy(&peer, pp, 8, cudaMemcpyDeviceToHost));
      char* src;
      CK(cudaMalloc(&src, bytes));
      CK(cudaMemset(src, r, bytes));
      char* ldst;
      CK(cudaMalloc(&ldst, bytes));
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      CK(cudaFuncSetAttribute(bulk_copy<2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              200 * 1024));
      CK(cudaFuncSetAttribute(bulk_copy<4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              200 * 1024));
      auto run = [&](const char* name, int blocks, auto launch) {
        bar_kernel<<<1, 128>>>(dc);
        launch();
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        bar_kernel<<<1, 128>>>(dc);
        CK(cudaEventRecord(a));
        for (int it = 0; it < 5; ++it) launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        printf("rank %d %-34s blocks %3d: %5.0f GB/s\n", r, name, blocks, 5.0 * bytes / ms / 1e6);
      };
      char* pdst = (char*)peer;          // push: local src -> peer window
      char* psrc = (char*)peer + bytes;  // pull: peer window (2nd half) -> local
      int* sink;
      CK(cudaMalloc(&sink, 4));
      CK(cudaFuncSetAttribute(bulk_copy<8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              200 * 1024));
      for (int blocks : {32}) {
        run("local read 1024t x4", blocks,
            [&] { plain_read<4><<<blocks, 1024>>>((int4*)src, bytes / 16, sink); });
        run("local read 1024t x8", blocks,
            [&] { plain_read<8><<<blocks, 1024>>>((int4*)src, bytes / 16, sink); });
        run("local read 512t x8", blocks,
            [&] { plain_read<8><<<blocks, 512>>>((int4*)src, bytes / 16, sink); });
        run("local bulk 16w x2 x6K", blocks,
            [&] { bulk_copy<2><<<blocks, 512, 16 * 2 * 6144>>>(src, ldst, bytes, 6144); });
        run("local bulk 16w x2 x2K", blocks,
            [&] { bulk_copy<2><<<blocks, 512, 16 * 2 * 2048>>>(src, ldst, bytes, 2048); });
        run("local bulk 16w x2 x1K", blocks,
            [&] { bulk_copy<2><<<blocks, 512, 16 * 2 * 1024>>>(src, ldst, bytes, 1024); });
        run("local bulk 16w x8 x1K", blocks,
            [&] { bulk_copy<8><<<blocks, 512, 16 * 8 * 1024>>>(src, ldst, bytes, 1024); });
        run("local bulk 8w x8 x3K", blocks,
            [&] { bulk_copy<8><<<blocks, 256, 8 * 8 * 3072>>>(src, ldst, bytes, 3072); });
        run("local plain 512t x4", blocks,
            [&] { plain_copy<4><<<blocks, 512>>>((int4*)src, (int4*)ldst, bytes / 16); });
        run("local plain 512t x8", blocks,
            [&] { plain_copy<8><<<blocks, 512>>>((int4*)src, (int4*)ldst, bytes / 16); });
        run("local plain 1024t x8", blocks,
            [&] { plain_copy<8><<<blocks, 1024>>>((int4*)src, (int4*)ldst, bytes / 16); });
      }
      for (int blocks : {16, 32, 64, 132}) {
        run("push plain 512t", blocks,
            [&] { plain_copy<1><<<blocks, 512>>>((int4*)src, (int4*)pdst, bytes / 16); });
        run("push plain 1024t x4", blocks,
            [&] { plain_copy<4><<<blocks, 1024>>>((int4*)src, (int4*)pdst, bytes / 16); });
        run("push bulk 8w x2 x12K", blocks,
            [&] { bulk_copy<2><<<blocks, 256, 8 * 2 * 12288>>>(src, pdst, bytes, 12288); });
        run("push bulk 4w x4 x12K", blocks,
            [&] { bulk_copy<4><<<blocks, 128, 4 * 4 * 12288>>>(src, pdst, bytes, 12288); });
        run("push bulk 16w x2 x6K", blocks,
            [&] { bulk_copy<2><<<blocks, 512, 16 * 2 * 6144>>>(src, pdst, bytes, 6144); });
        run("pull plain 1024t x4", blocks,
            [&] { plain_copy<4><<<blocks, 1024>>>((int4*)psrc, (int4*)ldst, bytes / 16); });
        run("pull bulk 8w x2 x12K", blocks,
            [&] { bulk_copy<2><<<blocks, 256, 8 * 2 * 12288>>>(psrc, ldst, bytes, 12288); });
        run("local plain 1024t x4", blocks,
            [&] { plain_copy<4><<<blocks, 1024>>>((int4*)src, (int4*)ldst, bytes / 16); });
        run("local bulk 8w x2 x12K", blocks,
            [&] { bulk_copy<2><<<blocks, 256, 8 * 2 * 12288>>>(src, ldst, bytes, 12288); });
      }
      NK(ncclDevCommDestroy(comm, &dc));
      NK(ncclCommWindowDeregister(comm, win));
      NK(ncclMemFree(buf));
      NK(ncclCommDestroy(comm));
    });
  for (auto& t : th) t.join();
  printf("done\n");
}
