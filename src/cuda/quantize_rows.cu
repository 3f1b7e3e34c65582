// CUDA tensorwise FP8 codes of the rows of a grouped layout (the
// fp8-tensorwise recipe; moeflow/grouped_mlp_fp8.h): quantize_group_rows
// (the rows of x) and the activation's form of
// grouped_mlp_activation_quantize (a = act(h) * p, computed in each pass,
// never stored). Four launches on the stream:
//   1. the scale word zeroed (it collects the amax as float bits first);
//   2. amax: one warp per row, 16 columns a lane, data rows only; each
//      block's max of |v|'s bits (finite values: their order as floats)
//      joins the word with atomicMax (order-free, so deterministic);
//   3. codes: the scale from the amax (quant::scale_of), x / scale
//      (Fp8Divider: bit for bit __fdiv_rn) per lane's 16 values, 16-byte
//      stores where aligned; the other rows written as code 0;
//   4. the word rewritten as the scale (one thread).
// No workspace, no host sync; graph-capturable.
#include <algorithm>
#include <type_traits>

#include "core/activations.h"
#include "core/mlp_call.h"
#include "cuda/common.cuh"
#include "cuda/fp8.cuh"
#include "cuda/mlp_rows.cuh"

namespace moeflow::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The rows of x: lane l's 16 values of chunk cl (0 past cols).
template <typename T, bool VEC>
struct RowsSource {
  const T* x;
  int64_t ld;
  __device__ __forceinline__ void load(int64_t row, int64_t cl, int64_t cols,
                                       float (&v)[kFp8PerLane]) const {
    load_chunk<T, VEC>(x + row * ld, cl, cols, v);
  }
};

// a = act(h) * p in T (the activation kernels' arithmetic: the same bits as
// the a the MLP stores).
template <typename T, Activation A>
struct ActSource {
  const T* h;
  int64_t n1;
  const float* probs;
  ActivationParams ap;
  int il;
  __device__ __forceinline__ void load(int64_t row, int64_t cl, int64_t f,
                                       float (&v)[kFp8PerLane]) const {
    constexpr bool kGated =
        A == Activation::kSwiGLU || A == Activation::kGeGLU || A == Activation::kClampedQuickGeGLU;
    const T* hrow = h + row * n1;
    const float p = probs ? probs[row] : 1.0f;
#pragma unroll
    for (int j = 0; j < kFp8PerLane; ++j) {
      const int64_t col = cl + j;
      v[j] = 0.0f;
      if (col < f) {
        const float g = to_float(hrow[kGated ? glu_gate_col(col, il) : col]);
        const float u = kGated ? to_float(hrow[glu_up_col(col, il, f)]) : 0.0f;
        v[j] = to_float(from_float<T>(act_forward(A, g, u, ap) * p));
      }
    }
  }
};

template <typename S>
__global__ void __launch_bounds__(kThreads)
    rows_amax_kernel(RowMap m, S src, int64_t rows, int64_t cols, uint32_t* amax) {
  __shared__ uint32_t red[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t mb = 0;
  for (int64_t row = int64_t{blockIdx.x} * kWarps + warp; row < rows;
       row += int64_t{gridDim.x} * kWarps) {
    bool data;
    m.expert_of(row, data);
    if (!data) continue;  // warp-uniform
    for (int64_t c0 = 0; c0 < cols; c0 += int64_t{kFp8PerLane} * 32) {
      float v[kFp8PerLane];
      src.load(row, c0 + int64_t{lane} * kFp8PerLane, cols, v);
#pragma unroll
      for (int j = 0; j < kFp8PerLane; ++j) {
        const uint32_t b = abs_bits(v[j]);
        mb = max(mb, b < kFp8NonFinite ? b : 0u);  // inf and NaN left out
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
  if (lane == 0) red[warp] = mb;
  __syncthreads();
  if (warp == 0) {
    mb = lane < kWarps ? red[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
    if (lane == 0 && mb) atomicMax(amax, mb);
  }
}

template <typename S, bool E4M3, bool VEC>
__global__ void __launch_bounds__(kThreads)
    rows_codes_kernel(RowMap m, S src, int64_t rows, int64_t cols, uint8_t* q, int64_t q_stride,
                      const uint32_t* amax, bool pow2) {
  const float scale = quant::scale_of(__uint_as_float(*amax), E4M3, pow2);
  const Fp8Divider fast(scale, true), exact(scale, false);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t row = int64_t{blockIdx.x} * kWarps + warp; row < rows;
       row += int64_t{gridDim.x} * kWarps) {
    bool data;
    m.expert_of(row, data);
    uint8_t* qrow = q + row * q_stride;
    for (int64_t c0 = 0; c0 < cols; c0 += int64_t{kFp8PerLane} * 32) {
      const int64_t cl = c0 + int64_t{lane} * kFp8PerLane;
      uint32_t w[kFp8PerLane / 4] = {0u, 0u, 0u, 0u};
      if (data) {
        float v[kFp8PerLane];
        src.load(row, cl, cols, v);
        uint32_t mb = 0;
#pragma unroll
        for (int j = 0; j < kFp8PerLane; ++j) mb = max(mb, abs_bits(v[j]));
        fp8_codes<E4M3>(v, mb < kFp8NonFinite ? fast : exact, w);
      }
      store_codes<VEC>(qrow, cl, cols, w);
    }
  }
}

template <bool E4M3>
__global__ void scale_from_amax_kernel(float* scale, bool pow2) {
  *scale = quant::scale_of(*scale, E4M3, pow2);  // the word holds the amax's bits
}

// The four launches for any source; vec: 16-byte rows of the source and of q.
template <typename S, typename SV>
void run_tensorwise(const RowMap& m, const S& src, const SV& src_vec, bool vec, int64_t rows,
                    int64_t cols, TensorView q, TensorView scale, bool e4m3, bool pow2,
                    cudaStream_t stream) {
  auto* word = static_cast<uint32_t*>(scale.data);
  MOEFLOW_CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(uint32_t), stream));
  const int64_t cap = int64_t{sm_count()} * 8;
  const unsigned grid =
      static_cast<unsigned>(std::max<int64_t>(1, std::min(cap, (rows + kWarps - 1) / kWarps)));
  auto* qd = static_cast<uint8_t*>(q.data);
  const int64_t qs = q.strides[0];
  if (vec)
    rows_amax_kernel<<<grid, kThreads, 0, stream>>>(m, src_vec, rows, cols, word);
  else
    rows_amax_kernel<<<grid, kThreads, 0, stream>>>(m, src, rows, cols, word);
  MOEFLOW_CUDA_LAUNCH_CHECK();
  const auto codes = [&](auto e4) {
    constexpr bool E4 = decltype(e4)::value;
    if (vec)
      rows_codes_kernel<SV, E4, true>
          <<<grid, kThreads, 0, stream>>>(m, src_vec, rows, cols, qd, qs, word, pow2);
    else
      rows_codes_kernel<S, E4, false>
          <<<grid, kThreads, 0, stream>>>(m, src, rows, cols, qd, qs, word, pow2);
    MOEFLOW_CUDA_LAUNCH_CHECK();
    scale_from_amax_kernel<E4><<<1, 1, 0, stream>>>(static_cast<float*>(scale.data), pow2);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  };
  if (e4m3)
    codes(std::true_type{});
  else
    codes(std::false_type{});
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

RowMap row_map_of(const GroupLayout& g, int64_t num_groups) {
  if (!g.offsets.defined()) return RowMap{nullptr, nullptr, 0};
  return RowMap{g.offsets.data_ptr<int64_t>(),
                g.real_rows.defined() ? g.real_rows.data_ptr<int32_t>() : nullptr,
                static_cast<int>(num_groups)};
}

}  // namespace

void quantize_group_rows(const GroupLayout& groups, int64_t num_groups, TensorView x,
                         const QuantizeConfig& config, TensorView q, TensorView scale,
                         cudaStream_t stream) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  const RowMap m = row_map_of(groups, num_groups);
  const bool e4m3 = config.out == DType::kFloat8E4M3;
  with_float_type(x.dtype, [&](auto t) {
    using T = decltype(t);
    const int64_t ld = x.strides[0];
    const bool vec = cols % 16 == 0 && aligned16(x.data) && (ld * int64_t{sizeof(T)}) % 16 == 0 &&
                     aligned16(q.data) && q.strides[0] % 16 == 0;
    const auto* xd = static_cast<const T*>(x.data);
    run_tensorwise(m, RowsSource<T, false>{xd, ld}, RowsSource<T, true>{xd, ld}, vec, rows, cols, q,
                   scale, e4m3, config.pow2_scales, stream);
  });
}

void mlp_activation_quantize_tensorwise(const MlpRows& r, TensorView h, TensorView probs,
                                        Activation act, const ActivationParams& ap, int il,
                                        bool e4m3, bool pow2, TensorView a_q, TensorView a_scale,
                                        cudaStream_t stream) {
  const RowMap m = row_map_of(r.groups, r.num_groups);
  const int64_t f = a_q.shape[1];
  const bool vec = f % 16 == 0 && aligned16(a_q.data) && a_q.strides[0] % 16 == 0;
  const float* pp = probs.defined() ? probs.data_ptr<float>() : nullptr;
  with_activation(act, [&](auto A) {
    constexpr Activation kA = decltype(A)::value;
    const auto go = [&](auto tag) {
      using T = decltype(tag);
      const ActSource<T, kA> src{h.data_ptr<T>(), h.shape[1], pp, ap, il};
      run_tensorwise(m, src, src, vec, r.rows, f, a_q, a_scale, e4m3, pow2, stream);
    };
    if (h.dtype == DType::kBFloat16)
      go(__nv_bfloat16{});
    else
      go(__half{});
  });
}

}  // namespace moeflow::cuda
