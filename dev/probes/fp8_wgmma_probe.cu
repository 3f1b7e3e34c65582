// What the FP8 grouped GEMM's consumer loop can reach with its operands
// already in shared memory: no TMA, no L2, no epilogue. One block per SM,
// W consumer warpgroups, each running `slices` 128-deep K slices of
// wgmma.m64nNk32 (e4m3, both operands from shared memory, 128-byte swizzle,
// two stages alternated) in one of these loop shapes:
//   chain:    the four wgmma of a slice accumulate into one accumulator,
//             wait<1> per slice (no promotion: the tensor pipe's ceiling);
//   promote:  the production loop: four wgmma into a slice accumulator,
//             wait<0>, then acc += part * scale (64 or 96 FFMA per thread);
//   pingpong: two slice accumulators, slice k issued before slice k - 1 is
//             waited on and promoted (wait<1>).
// Prints cycles per slice per warpgroup and the tensor pipe's share: ideal
// cycles (W * 4 wgmma of N / 2 cycles each per slice) over measured.
// Build: configure with -DMOEFLOW_BUILD_EXPERIMENTS=ON, `ninja -C build
// fp8_wgmma_probe`; run build/fp8_wgmma_probe on one Hopper GPU.
#include <cuda_runtime.h>

#include <cstdio>

#include "cuda/gemm/fp8/wgmma.cuh"
#include "cuda/gemm/sm90_cpasync.cuh"
#include "cuda/gemm/tma/ptx.cuh"

namespace {

using namespace moeflow::cuda::gemm;

enum Loop { kChain, kPromote, kPingPong };

template <int N, int W, Loop L>
__global__ void __launch_bounds__(128 * W, 1) probe(int slices, float* out, long long* cycles) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kA = 64 * W * 128, kB = N * 128, kStage = kA + kB;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  // e4m3 codes without NaN (0x7F / 0xFF never appear under the 0x77 mask).
  for (int i = threadIdx.x; i < 2 * kStage; i += blockDim.x)
    smem[i] = static_cast<uint8_t>((i * 37 + 11) & 0x77);
  sm90::fence_proxy_async();
  __syncthreads();
  const int c = threadIdx.x / 128, tid = threadIdx.x % 128;
  const uint64_t da = sm90::smem_desc(smem + c * 64 * 128), db = sm90::smem_desc(smem + kA);
  float acc[N / 2], part[N / 2], part2[L == kPingPong ? N / 2 : 1];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  if constexpr (L == kPingPong)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) part2[i] = 0.0f;
  const float s0 = 1e-3f * (tid + 1), s1 = 2e-3f * (tid + 1);
  const long long t0 = clock64();
  for (int k = 0; k < slices; ++k) {
    const uint64_t off = static_cast<uint64_t>(k & 1) * (kStage >> 4);
    if constexpr (L == kChain) {
      sm90::wgmma_fence();
      sm90::fence_operands(acc);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        fp8::Wgmma8<N>::mma(acc, da + off + 2 * ks, db + off + 2 * ks, 1);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();
      sm90::fence_operands(acc);
    } else if constexpr (L == kPromote) {
      sm90::wgmma_fence();
      sm90::fence_operands(part);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        fp8::Wgmma8<N>::mma(part, da + off + 2 * ks, db + off + 2 * ks, ks > 0 ? 1 : 0);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_operands(part);
#pragma unroll
      for (int i = 0; i < N / 2; ++i) acc[i] = fmaf(part[i], (i % 4) < 2 ? s0 : s1, acc[i]);
    } else {
      // Slice k into part (k even) or part2 (k odd); then slice k - 1's promoted.
      auto issue = [&](float(&d)[N / 2]) {
        sm90::wgmma_fence();
        sm90::fence_operands(d);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          fp8::Wgmma8<N>::mma(d, da + off + 2 * ks, db + off + 2 * ks, ks > 0 ? 1 : 0);
        sm90::wgmma_commit();
      };
      auto promote = [&](float(&d)[N / 2]) {
        sm90::fence_operands(d);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) acc[i] = fmaf(d[i], (i % 4) < 2 ? s0 : s1, acc[i]);
      };
      // (unrolled by two: part2 holds zeros before slice 1)
      issue(part);
      sm90::wgmma_wait<1>();
      promote(part2);
      ++k;
      issue(part2);
      sm90::wgmma_wait<1>();
      promote(part);
    }
  }
  if constexpr (L == kPingPong) {
    sm90::wgmma_wait<0>();
    sm90::fence_operands(part);
    sm90::fence_operands(part2);
  }
  if constexpr (L == kChain) {
    sm90::wgmma_wait<0>();
    sm90::fence_operands(acc);
  }
  const long long t1 = clock64();
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) sum += acc[i];
  if constexpr (L == kPingPong) sum += part[0] + part2[0];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
#endif
}

#define CHECK(x)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

template <int N, int W, Loop L>
void run(const char* name, int sms) {
  const int slices = 4096;
  const size_t smem = 1024 + 2 * size_t(64 * W * 128 + N * 128);
  auto k = probe<N, W, L>;
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  float* out;
  long long* cyc;
  CHECK(cudaMalloc(&out, size_t(sms) * 128 * W * sizeof(float)));
  CHECK(cudaMalloc(&cyc, size_t(sms) * sizeof(long long)));
  k<<<sms, 128 * W, smem>>>(slices, out, cyc);  // warm-up
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  k<<<sms, 128 * W, smem>>>(slices, out, cyc);
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  long long h = 0;
  CHECK(cudaMemcpy(&h, cyc, sizeof(h), cudaMemcpyDeviceToHost));
  const double flops = 2.0 * sms * W * 64.0 * N * 128.0 * slices;
  const double per_slice = double(h) / slices, ideal = W * 4 * (N / 2);
  std::printf(
      "%-28s N=%3d W=%d: %7.1f cycles/slice (ideal %5.0f): tensor %5.1f %%, %7.1f TFLOP/s\n", name,
      N, W, per_slice, ideal, 100.0 * ideal / per_slice, flops / ms / 1e9);
  CHECK(cudaFree(out));
  CHECK(cudaFree(cyc));
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  run<128, 2, kChain>("chain (no promotion)", sms);
  run<192, 2, kChain>("chain (no promotion)", sms);
  run<256, 2, kChain>("chain (no promotion)", sms);
  run<128, 3, kChain>("chain (no promotion)", sms);
  run<128, 2, kPromote>("promote (production loop)", sms);
  run<192, 2, kPromote>("promote (production loop)", sms);
  run<128, 3, kPromote>("promote (production loop)", sms);
  run<128, 2, kPingPong>("pingpong (two slice accs)", sms);
  return 0;
}
