// Probe (2026-11-22, H200, compute-sanitizer of CUDA 13.0): racecheck reports
// "Race reported between Write access ... and Read access" (3 errors) on this
// canonical PTX producer/consumer hand-over (bar.arrive by the producers,
// bar.sync by the consumers), although the PTX ISA guarantees that the
// arriving threads' prior accesses are performed for the syncing threads and
// the sum comes out right. The fused FC1's helper hand-over
// (src/cuda/gemm/tma/) uses the same pattern and racecheck reports it
// the same way. Build: nvcc -arch=sm_90a racecheck_bar_arrive.cu
// Does racecheck model bar.arrive -> bar.sync hand-over? 128 producers write
// shared memory and bar.arrive; 96 consumers bar.sync and read; then the
// reverse for buffer reuse.
#include <cstdio>
__global__ void k(int* out) {
  __shared__ int buf[128];
  const int t = threadIdx.x;
  for (int it = 0; it < 4; ++it) {
    if (t < 128) {
      if (it > 0) asm volatile("bar.sync 2, 224;\n" ::: "memory");  // freed
      buf[t] = it * 1000 + t;
      asm volatile("bar.arrive 1, 224;\n" ::: "memory");  // staged
    } else if (t >= 160) {
      asm volatile("bar.sync 1, 224;\n" ::: "memory");
      int s = 0;
      for (int i = t - 160; i < 128; i += 96) s += buf[i];
      atomicAdd(out, s);
      if (it < 3) asm volatile("bar.arrive 2, 224;\n" ::: "memory");
    }
  }
}
int main() {
  int* d;
  cudaMalloc(&d, 4);
  cudaMemset(d, 0, 4);
  k<<<1, 256>>>(d);
  int h = 0;
  cudaMemcpy(&h, d, 4, cudaMemcpyDeviceToHost);
  int want = 0;
  for (int it = 0; it < 4; ++it)
    for (int t = 0; t < 128; ++t) want += it * 1000 + t;
  printf("sum %d want %d\n", h, want);
}
