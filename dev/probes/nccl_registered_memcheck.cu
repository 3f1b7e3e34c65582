// Probe: does compute-sanitizer memcheck report NCCL's own
// send/recv kernel when the buffers are registered with the communicator
// (ncclMemAlloc + ncclCommRegister, as the nccl EP backend's staging
// arena), with no moeflow code involved? Two GPUs in one process, one
// thread per rank, each rank sends `bytes` to the other and checks what
// it received. argv[1] = 1: registered buffers, 0: plain cudaMalloc, 2: one
// registered arena carved into the send and receive buffers (as the EP
// backend's staging arena: registered once, buffers at offsets in it), 3:
// the arena of mode 2 plus a self transfer (ncclSend / ncclRecv to and from
// the own rank, between two ranges of the arena) in each group, as the nccl
// EP backend's combine backward once did.
// Build: nvcc -O2 -o nccl_registered_memcheck nccl_registered_memcheck.cu -lnccl
// Run:   ./nccl_registered_memcheck 1
//        compute-sanitizer --tool memcheck ./nccl_registered_memcheck 1
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t err_ = (x);                                                                  \
    if (err_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)
#define NK(x)                                                                                \
  do {                                                                                       \
    ncclResult_t res_ = (x);                                                                 \
    if (res_ != ncclSuccess) {                                                               \
      std::printf("NCCL error %s at %s:%d\n", ncclGetErrorString(res_), __FILE__, __LINE__); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

int main(int argc, char** argv) {
  const int mode = argc < 2 ? 1 : std::atoi(argv[1]);
  const bool reg = mode != 0, arena = mode >= 2, self = mode == 3;
  const size_t self_bytes = size_t{4} << 20;
  const size_t bytes = size_t{48} << 20;  // about an EP staging arena's size
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::printf("needs 2 GPUs\n");
    return 0;
  }
  int devs[2] = {0, 1};
  ncclComm_t comms[2];
  NK(ncclCommInitAll(comms, 2, devs));
  int bad[2] = {0, 0};
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      CK(cudaSetDevice(r));
      void *send = nullptr, *recv = nullptr, *hs = nullptr, *hr = nullptr, *base = nullptr;
      char* self_recv = nullptr;
      if (arena) {  // [send | 256 B gap | recv | tail]
        const size_t total = 2 * bytes + (size_t{5} << 20);
        NK(ncclMemAlloc(&base, total));
        NK(ncclCommRegister(comms[r], base, total, &hs));
        send = base;
        recv = static_cast<char*>(base) + bytes + 256;
        self_recv = static_cast<char*>(recv) + bytes + 256;  // [self_bytes] in the tail
      } else if (reg) {
        NK(ncclMemAlloc(&send, bytes));
        NK(ncclMemAlloc(&recv, bytes));
        NK(ncclCommRegister(comms[r], send, bytes, &hs));
        NK(ncclCommRegister(comms[r], recv, bytes, &hr));
      } else {
        CK(cudaMalloc(&send, bytes));
        CK(cudaMalloc(&recv, bytes));
      }
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      CK(cudaMemsetAsync(send, 0x10 + r, bytes, s));
      CK(cudaMemsetAsync(recv, 0, bytes, s));
      const int peer = 1 - r;
      for (int it = 0; it < 3; ++it) {  // whole buffer, then an offset range
        const size_t off = it == 0 ? 0 : (size_t{7} << 20) + 4096 * it, len = bytes - off;
        NK(ncclGroupStart());
        NK(ncclSend(static_cast<char*>(send) + off, len, ncclUint8, peer, comms[r], s));
        NK(ncclRecv(static_cast<char*>(recv) + off, len, ncclUint8, peer, comms[r], s));
        if (self) {
          NK(ncclSend(send, self_bytes, ncclUint8, r, comms[r], s));
          NK(ncclRecv(self_recv, self_bytes, ncclUint8, r, comms[r], s));
        }
        NK(ncclGroupEnd());
      }
      CK(cudaStreamSynchronize(s));
      // every byte of a received range must be the sender's fill value
      auto check = [&](const void* d, size_t n, int from) {
        std::vector<unsigned char> h(n);
        CK(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; ++i)
          if (h[i] != 0x10 + from) return 1;
        return 0;
      };
      bad[r] += check(recv, bytes, peer);
      if (self) bad[r] += check(self_recv, self_bytes, r);
      if (arena) {
        NK(ncclCommDeregister(comms[r], hs));
        NK(ncclMemFree(base));
      } else if (reg) {
        NK(ncclCommDeregister(comms[r], hs));
        NK(ncclCommDeregister(comms[r], hr));
        NK(ncclMemFree(send));
        NK(ncclMemFree(recv));
      } else {
        CK(cudaFree(send));
        CK(cudaFree(recv));
      }
      CK(cudaStreamDestroy(s));
    });
  for (auto& t : th) t.join();
  for (int r = 0; r < 2; ++r) ncclCommDestroy(comms[r]);
  std::printf("%s buffers: rank 0 %s, rank 1 %s\n",
              self    ? "one registered arena, with self transfers"
              : arena ? "one registered arena"
              : reg   ? "registered"
                      : "plain",
              bad[0] ? "WRONG" : "ok", bad[1] ? "WRONG" : "ok");
  return bad[0] || bad[1];
}
