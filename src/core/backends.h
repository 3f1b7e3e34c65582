// The backend entry points behind the public functions. Arguments arrive
// validated (shapes, dtypes, devices); the public function picks the backend
// from the device of its inputs, once.
#pragma once

#include "moeflow/grouped_gemm.h"
#include "moeflow/permute.h"
#include "moeflow/plan.h"
#include "moeflow/tuning.h"

#if defined(__CUDACC__)
#define MOEFLOW_HD __host__ __device__
#else
#define MOEFLOW_HD
#endif

namespace moeflow {

// One routing input in either form. For kMask, topk == num_experts and slot
// (t,k) is routed to expert k when mask[t,k] != 0.
struct RoutingInput {
  enum Kind { kIds32, kIds64, kMask } kind = kIds32;
  const void* data = nullptr;
  int64_t num_tokens = 0;
  int topk = 0;
};

// The plan's scalar bookkeeping computed from the raw per-expert counts:
// shared by both backends so that drop order and padding are defined once.
struct ExpertLayout {
  int32_t kept;    // rows kept for this expert
  int32_t padded;  // kept rounded up to align
  int64_t offset;  // start row of its segment
};
// offset_in: sum of padded *routed* counts of the experts before this one
// (a multiple of align). Returns where the expert lands given the capacity.
MOEFLOW_HD inline ExpertLayout layout_expert(int64_t routed, int64_t offset_in, int64_t capacity,
                                             int align) {
  ExpertLayout l;
  l.offset = offset_in < capacity ? offset_in : capacity;
  int64_t room = capacity - l.offset;
  int64_t kept = routed < room ? routed : room;
  l.kept = static_cast<int32_t>(kept);
  l.padded = static_cast<int32_t>((kept + align - 1) / align * align);
  return l;
}

// One grouped GEMM call, validated. Operands (all row-major):
//   kForward: a = A [rows,K], w = W, out = C [rows,N]
//   kDgrad:   a = dC [rows,N], w = W, out = dA [rows,K]
//   kWgrad:   a = dC [rows,N], b = A [rows,K], w = dW (float32, or the inputs' dtype)
struct GroupedGemmCall {
  enum Op { kForward, kDgrad, kWgrad } op = kForward;
  TensorView a, b, out;
  GroupedWeights w;
  GroupLayout groups;
  bool accumulate = false;
  int64_t rows = 0;        // rows of a (and b, out)
  int64_t num_groups = 0;  // E
  int64_t n = 0, k = 0;    // each weight is [n,k]
  // Forward only (CUDA, Hopper, stacked weights): gathered A rows, int32
  // [rows]: row m of the product uses row a_rows[m] of `a` (-1: a zero row),
  // so tokens received once per GPU can feed every expert they go to
  // without being copied per expert. Values are not checked on the host;
  // entries past a's rows read as zero rows (nothing out of bounds is read).
  TensorView a_rows;
  GemmOptions options;  // kernel choice and tuning (moeflow/tuning.h)
};

// The blockwise FP8 forward (grouped_gemm_fp8_forward): arguments checked.
struct Fp8GemmCall {
  TensorView a, a_scales, w, w_scales, c;
  GroupLayout groups;
  GemmOptions options;  // raster and fp8_tile (moeflow/tuning.h)
};

// The blockwise FP8 wgrad (grouped_gemm_fp8_wgrad): arguments checked.
struct Fp8WgradCall {
  TensorView dc_t, dc_t_scales, a_t, a_t_scales;  // [N, rows], [N, rows/128]; [K, rows], [K, rows/128]
  GroupedWeights dw;                              // [E, N, K] float32 / bf16
  GroupLayout groups;
  bool accumulate = false;
  GemmOptions options;
};

namespace cpu {
void grouped_gemm(const GroupedGemmCall& call);
void grouped_gemm_fp8_forward(const Fp8GemmCall& call);
void grouped_gemm_fp8_wgrad(const Fp8WgradCall& call);
void build_plan(const RoutingInput& in, RoutingPlan& plan);
void permute(TensorView x, const RoutingPlan& plan, TensorView y, const PermuteExtras& extras);
// out[t] = sum_k w[t,k] * y[dest(t,k)]; and, when row_vals is given,
// slot_vals[t,k] = row_vals[dest(t,k)] (0 when dest is -1).
void unpermute(TensorView y, const RoutingPlan& plan, TensorView out, TensorView weights,
               TensorView row_vals, TensorView slot_vals);
void unpermute_backward(TensorView dout, const RoutingPlan& plan, TensorView y_fwd,
                        TensorView probs, TensorView dy, TensorView dprobs);
}  // namespace cpu

namespace cuda {
void grouped_gemm(const GroupedGemmCall& call, cudaStream_t stream);
void grouped_gemm_fp8_forward(const Fp8GemmCall& call, cudaStream_t stream);
void grouped_gemm_fp8_wgrad(const Fp8WgradCall& call, cudaStream_t stream);
size_t plan_workspace_bytes(int64_t num_tokens, int topk, const PlanConfig& config);
void build_plan(const RoutingInput& in, RoutingPlan& plan, TensorView workspace,
                cudaStream_t stream);
void permute(TensorView x, const RoutingPlan& plan, TensorView y, const PermuteExtras& extras,
             cudaStream_t stream);
void unpermute(TensorView y, const RoutingPlan& plan, TensorView out, TensorView weights,
               TensorView row_vals, TensorView slot_vals, cudaStream_t stream);
void unpermute_backward(TensorView dout, const RoutingPlan& plan, TensorView y_fwd,
                        TensorView probs, TensorView dy, TensorView dprobs, cudaStream_t stream);
// Pieces of permute / unpermute for pipelines (expert-parallel dispatch):
// permute_tokens moves plan tokens [first_token, first_token + count), whose
// rows are x_rows[0, count) or, with src_rows, x_rows[src_rows[i]] (device
// int32 [count]; dest_row and probs stay indexed by plan token), and zeroes
// the pad rows when pad_rows; unpermute_tokens writes out rows
// [first_token, first_token + count) only; max_blocks > 0 caps the grid (to
// leave SMs to kernels running beside). Arguments are trusted (internal).
void permute_tokens(TensorView x_rows, int64_t first_token, int64_t count, bool pad_rows,
                    const RoutingPlan& plan, TensorView y, const PermuteExtras& extras,
                    cudaStream_t stream, const int32_t* src_rows = nullptr, int max_blocks = 0);
void unpermute_tokens(TensorView y, const RoutingPlan& plan, int64_t first_token, int64_t count,
                      TensorView out, TensorView weights, TensorView row_vals, TensorView slot_vals,
                      cudaStream_t stream, int max_blocks = 0);
}  // namespace cuda

}  // namespace moeflow
