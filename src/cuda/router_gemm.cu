// The router GEMM's exact bf16 split (router_split_bf16): one thread per
// element of src, its three parts computed as the CPU reference does and
// written to each block of dst that takes one. The shapes are small (the
// router weight [E,H], the logits' gradient [T,E]); the writes of a warp are
// consecutive columns of one block.
#include <cuda_bf16.h>

#include <algorithm>

#include "core/router_backend.h"
#include "cuda/common.cuh"

namespace moeflow::cuda {
namespace {

constexpr int kSplitThreads = 256;

struct SplitParams {
  const float* src;
  __nv_bfloat16* dst;
  int64_t rows, cols;
  int parts[4];
  int count;
  bool along_columns;
};

__global__ void split_bf16_kernel(SplitParams p) {
  const int64_t n = p.rows * p.cols;
  for (int64_t i = blockIdx.x * int64_t{kSplitThreads} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kSplitThreads) {
    const int64_t r = i / p.cols, c = i - r * p.cols;
    __nv_bfloat16 part[3];
    float rest = p.src[i];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      part[k] = __float2bfloat16_rn(rest);
      rest = __fsub_rn(rest, __bfloat162float(part[k]));
    }
    for (int b = 0; b < p.count; ++b) {
      const int64_t at =
          p.along_columns ? r * (p.count * p.cols) + b * p.cols + c : (b * p.rows + r) * p.cols + c;
      p.dst[at] = part[p.parts[b]];
    }
  }
}

}  // namespace

void router_split_bf16(TensorView src, const Bf16SplitLayout& layout, TensorView dst,
                       cudaStream_t stream) {
  SplitParams p{};
  p.src = src.data_ptr<float>();
  p.dst = dst.data_ptr<__nv_bfloat16>();
  p.rows = src.shape[0];
  p.cols = src.shape[1];
  for (int i = 0; i < 4; ++i) p.parts[i] = layout.parts[i];
  p.count = layout.count;
  p.along_columns = layout.along_columns;
  const int64_t n = p.rows * p.cols;
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>((n + kSplitThreads - 1) / kSplitThreads, 4096);
  split_bf16_kernel<<<static_cast<int>(blocks), kSplitThreads, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda
