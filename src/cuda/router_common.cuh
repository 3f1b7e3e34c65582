// Pieces the CUDA router files share: warp reductions, the loss factors, the
// sequence lookup, and the sequence aux-loss stage (router_seq.cu) that
// router.cu's forward launches.
#pragma once

#include <cstdint>

#include "cuda/common.cuh"

namespace moeflow::cuda::router_detail {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m /= 2) v = v + __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
__device__ __forceinline__ long long warp_sum_ll(long long v) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m /= 2) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o > v ? o : v;
  }
  return v;
}

// The loss factors E * coeff / (K * T * T) (aux) and coeff / T (z), in double
// rounded to float; 0 when T = 0.
__host__ __device__ inline float aux_factor_of(int E, int K, float coeff, int64_t T) {
  const double Td = static_cast<double>(T);
  return T > 0 ? static_cast<float>(static_cast<double>(E) * coeff / (K * Td * Td)) : 0.0f;
}
__host__ __device__ inline float z_factor_of(float coeff, int64_t T) {
  return T > 0 ? static_cast<float>(coeff / static_cast<double>(T)) : 0.0f;
}

// cu_seqlens[i] clamped to [0, T].
__device__ __forceinline__ int64_t clamped_bound(const int32_t* cu, int64_t i, int64_t T) {
  const int64_t v = cu[i];
  return v < 0 ? 0 : (v > T ? T : v);
}

// The sequence of token t: #{i in [1,S): clamped cu[i] <= t} for
// non-decreasing cu_seqlens (a binary search; always in [0, S)).
__device__ __forceinline__ int64_t sequence_of(const int32_t* cu, int64_t S, int64_t T, int64_t t) {
  int64_t lo = 1, hi = S;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (clamped_bound(cu, mid, T) <= t)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo - 1;
}

// The per-sequence aux loss stage of the forward (after route_kernel has
// written the ids): per-sequence column sums of the aux-loss scores, the
// counts seq_tokens_per_expert [S,E], and each sequence's loss term
// E * coeff / (K * S * L_s^2) * sum_e colsum * count into seq_loss [S]
// (router.cu's finalize sums them in sequence order).
struct SeqAuxParams {
  const float* logits;  // [T,E]
  const int32_t* ids;   // [T,K]
  const uint8_t* mask;  // [T] or null
  const int32_t* cu;    // [S+1]
  int64_t num_tokens, num_sequences;
  int num_experts, topk;
  bool softmax;
  float coeff;
  int32_t* seq_counts;  // [S,E] out
  float* seq_loss;      // [S] (workspace)
  void* workspace;      // seq_aux_workspace_bytes(T, E, S) bytes
};

size_t seq_aux_workspace_bytes(int64_t num_tokens, int num_experts, int64_t num_sequences);
void seq_aux_forward(const SeqAuxParams& p, cudaStream_t stream);

}  // namespace moeflow::cuda::router_detail
