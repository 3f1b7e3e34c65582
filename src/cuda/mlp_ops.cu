// CUDA backend of the grouped MLP's elementwise steps (see core/mlp_call.h):
// FC2 bias, dGLU with the probability gradient, per-expert bias gradients.
// Deterministic: every sum runs in a fixed order.
#include <cub/block/block_reduce.cuh>
#include <type_traits>

#include "core/activations.h"
#include "core/mlp_call.h"
#include "cuda/act_source.cuh"
#include "cuda/common.cuh"
#include "cuda/fp8.cuh"
#include "cuda/mlp_rows.cuh"

namespace moeflow::cuda {

namespace {

RowMap row_map(const MlpRows& r) {
  return RowMap{r.groups.offsets.data_ptr<int64_t>(),
                r.groups.real_rows.defined() ? r.groups.real_rows.data_ptr<int32_t>() : nullptr,
                static_cast<int>(r.num_groups)};
}

template <typename T>
__global__ void bias_add_kernel(RowMap m, T* y, int64_t ld, const T* bias, int64_t cols,
                                int64_t rows) {
  const int64_t row = blockIdx.x;
  if (row >= rows) return;
  bool data;
  const int e = m.expert_of(row, data);
  if (e < 0 || !data) return;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    y[row * ld + c] = from_float<T>(to_float(y[row * ld + c]) + to_float(bias[e * cols + c]));
}

// The larger finite |value| of two 16-bit values as float bits (inf and NaN
// count 0: the amax policy of quantize_group_rows).
template <typename T>
__device__ __forceinline__ uint32_t finite_abs_bits(T a, T b) {
  const uint32_t x = __float_as_uint(to_float(a)) & 0x7FFFFFFFu;
  const uint32_t y = __float_as_uint(to_float(b)) & 0x7FFFFFFFu;
  return max(x < 0x7F800000u ? x : 0u, y < 0x7F800000u ? y : 0u);
}

// A row's amax bits (each thread's mb) joined into the word; the atomic only
// when it raises the word (one row per block: most rows do not).
struct MaxU32 {
  __device__ __forceinline__ uint32_t operator()(uint32_t a, uint32_t b) const { return max(a, b); }
};
template <int THREADS>
__device__ __forceinline__ void join_row_amax(uint32_t mb, uint32_t* amax) {
  using Reduce = cub::BlockReduce<uint32_t, THREADS>;
  __shared__ typename Reduce::TempStorage tmp;
  const uint32_t b = Reduce(tmp).Reduce(mb, MaxU32{});
  if (threadIdx.x == 0 && b > *static_cast<volatile uint32_t*>(amax)) atomicMax(amax, b);
}

// One block per row: d(a) (columns [n1-f, n1) of d_h) is read into shared
// memory first, then d(h) is written over the row (in place, any interleave).
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
    dglu_kernel(RowMap m, const T* h, T* d_h, int64_t n1, int64_t f, const float* probs,
                Activation act, ActivationParams ap, int il, float* dprobs, int64_t rows,
                uint32_t* amax) {
  extern __shared__ float da[];
  const int64_t row = blockIdx.x;
  if (row >= rows) return;
  bool data;
  const int e = m.expert_of(row, data);
  if (e < 0) return;  // past the groups: untouched
  T* drow = d_h + row * n1;
  if (!data) {  // pad row: no gradient
    for (int64_t c = threadIdx.x; c < n1; c += THREADS) drow[c] = from_float<T>(0.0f);
    if (dprobs && threadIdx.x == 0) dprobs[row] = 0.0f;
    return;
  }
  for (int64_t j = threadIdx.x; j < f; j += THREADS) da[j] = to_float(drow[n1 - f + j]);
  __syncthreads();
  const bool gated = is_gated(act);
  const float p = probs ? probs[row] : 1.0f;
  const T* hrow = h + row * n1;
  float dp = 0.0f;
  uint32_t mb = 0;  // the largest finite |d(h)|'s bits (with amax)
  for (int64_t j = threadIdx.x; j < f; j += THREADS) {
    const int64_t gc = gated ? glu_gate_col(j, il) : j, uc = gated ? glu_up_col(j, il, f) : 0;
    const float g = to_float(hrow[gc]), u = gated ? to_float(hrow[uc]) : 0.0f;
    dp += da[j] * act_forward(act, g, u, ap);
    float dg = 0.0f, du = 0.0f;
    act_backward(act, g, u, da[j] * p, ap, &dg, &du);
    const T tg = from_float<T>(dg), tu = from_float<T>(du);
    drow[gc] = tg;
    if (gated) drow[uc] = tu;
    if (amax) mb = max(mb, finite_abs_bits(tg, gated ? tu : from_float<T>(0.0f)));
  }
  if (amax) join_row_amax<THREADS>(mb, amax);
  if (dprobs) {
    using Reduce = cub::BlockReduce<float, THREADS>;
    __shared__ typename Reduce::TempStorage tmp;
    const float s = Reduce(tmp).Sum(dp);
    if (threadIdx.x == 0) dprobs[row] = s;
  }
}

// The [gate; up] halves layout (and plain activations): column j of d(a)
// sits where d(h) of j's up (gated) or of j itself (plain) goes, so each
// thread reads and rewrites only its own columns: 16-byte vectors, no shared
// staging, the activation a compile-time constant. Needs f % 8 == 0 and
// 16-byte aligned rows.
template <typename T, Activation A, int THREADS>
__global__ void __launch_bounds__(THREADS)
    dglu_halves_kernel(RowMap m, const T* h, T* d_h, int64_t f, const float* probs,
                       ActivationParams ap, float* dprobs, int64_t rows, uint32_t* amax) {
  constexpr bool kGated =
      A == Activation::kSwiGLU || A == Activation::kGeGLU || A == Activation::kClampedQuickGeGLU;
  constexpr int64_t kN1 = kGated ? 2 : 1;
  using V = Pack<T, 8>;
  const int64_t row = blockIdx.x;
  if (row >= rows) return;
  bool data;
  const int e = m.expert_of(row, data);
  if (e < 0) return;  // past the groups: untouched
  V* drow = reinterpret_cast<V*>(d_h + row * kN1 * f);
  const int64_t nv = f / 8;
  if (!data) {  // pad row: no gradient
    V zero;
#pragma unroll
    for (int i = 0; i < 8; ++i) zero.v[i] = from_float<T>(0.0f);
    for (int64_t v = threadIdx.x; v < kN1 * nv; v += THREADS) drow[v] = zero;
    if (dprobs && threadIdx.x == 0) dprobs[row] = 0.0f;
    return;
  }
  const float p = probs ? probs[row] : 1.0f;
  const V* hrow = reinterpret_cast<const V*>(h + row * kN1 * f);
  float dp = 0.0f;
  uint32_t mb = 0;  // the largest finite |d(h)|'s bits (with amax)
  for (int64_t v = threadIdx.x; v < nv; v += THREADS) {
    const V g = hrow[v];
    const V da = drow[(kN1 - 1) * nv + v];
    V u;
    if constexpr (kGated) u = hrow[nv + v];
    V dg, du;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float gv = to_float(g.v[i]), uv = kGated ? to_float(u.v[i]) : 0.0f;
      const float dav = to_float(da.v[i]);
      dp += dav * act_forward(A, gv, uv, ap);
      float dgv = 0.0f, duv = 0.0f;
      act_backward(A, gv, uv, dav * p, ap, &dgv, &duv);
      dg.v[i] = from_float<T>(dgv);
      du.v[i] = from_float<T>(duv);
      if (amax) mb = max(mb, finite_abs_bits(dg.v[i], kGated ? du.v[i] : dg.v[i]));
    }
    drow[v] = dg;
    if constexpr (kGated) drow[nv + v] = du;
  }
  if (amax) join_row_amax<THREADS>(mb, amax);
  if (dprobs) {
    using Reduce = cub::BlockReduce<float, THREADS>;
    __shared__ typename Reduce::TempStorage tmp;
    const float s = Reduce(tmp).Sum(dp);
    if (threadIdx.x == 0) dprobs[row] = s;
  }
}

// dst[e, c] (+)= sum over the data rows of expert e of src[row, c], rows in order.
template <typename T>
__global__ void colsum_kernel(const int64_t* offsets, const int32_t* real, const T* src, int64_t ld,
                              int64_t cols, float* dst, bool accumulate) {
  const int e = blockIdx.y;
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = offsets[e], seg = offsets[e + 1] - r0;
  const int64_t n = real ? max(int64_t{0}, min(int64_t{real[e]}, seg)) : seg;
  float s = 0.0f;
  for (int64_t r = r0; r < r0 + n; ++r) s += to_float(src[r * ld + c]);
  dst[int64_t{e} * cols + c] = accumulate ? dst[int64_t{e} * cols + c] + s : s;
}

// The unfused FC1 epilogue (GPUs without the fused path): one block per row,
// h += bias1 in place, then a = act(h) * p; pad rows of a zeroed.
template <typename T>
__global__ void fc1_epilogue_kernel(RowMap m, T* h, int64_t n1, const T* bias, const float* probs,
                                    Activation act, ActivationParams ap, int il, T* a, int64_t f,
                                    int64_t rows) {
  const int64_t row = blockIdx.x;
  if (row >= rows) return;
  bool data;
  const int e = m.expert_of(row, data);
  if (e < 0) return;
  T* arow = a + row * f;
  if (!data) {
    for (int64_t j = threadIdx.x; j < f; j += blockDim.x) arow[j] = from_float<T>(0.0f);
    return;
  }
  T* hrow = h + row * n1;
  if (bias)
    for (int64_t c = threadIdx.x; c < n1; c += blockDim.x)
      hrow[c] = from_float<T>(to_float(hrow[c]) + to_float(bias[e * n1 + c]));
  __syncthreads();
  const bool gated = is_gated(act);
  const float p = probs ? probs[row] : 1.0f;
  for (int64_t j = threadIdx.x; j < f; j += blockDim.x) {
    const float g = to_float(hrow[gated ? glu_gate_col(j, il) : j]);
    const float u = gated ? to_float(hrow[glu_up_col(j, il, f)]) : 0.0f;
    arow[j] = from_float<T>(act_forward(act, g, u, ap) * p);
  }
}

// The same epilogue, one warp per row and 16-byte vectors (8 columns): needs
// f % 8 == 0, an interleave of 0 or a multiple of 8 (so 8 consecutive a
// columns read 8 consecutive gate and up columns) and 16-byte aligned h, a
// and bias. The activation is a compile-time constant; the arithmetic per
// element is the scalar kernel's (same bits).
template <typename T, Activation A>
__global__ void __launch_bounds__(256)
    fc1_epilogue_vec_kernel(RowMap m, T* h, int64_t n1, const T* bias, const float* probs,
                            ActivationParams ap, int il, T* a, int64_t f, int64_t rows) {
  constexpr bool kGated =
      A == Activation::kSwiGLU || A == Activation::kGeGLU || A == Activation::kClampedQuickGeGLU;
  using V = Pack<T, 8>;
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * int64_t{8} + threadIdx.x / 32;
  if (row >= rows) return;
  bool data;
  const int e = m.expert_of(row, data);
  if (e < 0) return;
  V* arow = reinterpret_cast<V*>(a + row * f);
  const int64_t nv = f / 8;
  if (!data) {
    V zero;
#pragma unroll
    for (int i = 0; i < 8; ++i) zero.v[i] = from_float<T>(0.0f);
    for (int64_t v = lane; v < nv; v += 32) arow[v] = zero;
    return;
  }
  V* hrow = reinterpret_cast<V*>(h + row * n1);
  if (bias) {
    const V* brow = reinterpret_cast<const V*>(bias + e * n1);
    for (int64_t v = lane; v < n1 / 8; v += 32) {
      V x = hrow[v];
      const V b = brow[v];
#pragma unroll
      for (int i = 0; i < 8; ++i) x.v[i] = from_float<T>(to_float(x.v[i]) + to_float(b.v[i]));
      hrow[v] = x;
    }
    __syncwarp();
  }
  const float p = probs ? probs[row] : 1.0f;
  for (int64_t v = lane; v < nv; v += 32) {
    const int64_t j = v * 8;
    const V g = hrow[(kGated ? glu_gate_col(j, il) : j) / 8];
    V u;
    if constexpr (kGated) u = hrow[glu_up_col(j, il, f) / 8];
    V o;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      o.v[i] =
          from_float<T>(act_forward(A, to_float(g.v[i]), kGated ? to_float(u.v[i]) : 0.0f, ap) * p);
    arow[v] = o;
  }
}

// a = act(h) * p in T, quantized 1x128 rowwise: one warp per row, 512
// columns per step (lane l: 16 columns, fp8.cuh's chunk layout). The
// activation's arithmetic is the epilogue kernels' (same bits for a). VEC:
// a lane's 16 gate and 16 up values of h come in 16-byte loads and its codes
// go out in one 16-byte store (f and the interleave multiples of 16, rows
// 16-byte aligned).
template <typename T, Activation A, bool E4M3, bool VEC>
__global__ void __launch_bounds__(256)
    act_quantize_kernel(RowMap m, const T* h, int64_t n1, const float* probs, ActivationParams ap,
                        int il, uint8_t* aq, int64_t aq_stride, float* scales, int64_t nb,
                        int64_t f, int64_t rows, bool pow2) {
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * int64_t{8} + threadIdx.x / 32;
  if (row >= rows) return;  // warp-uniform
  bool data;
  const int e = m.expert_of(row, data);
  if (e < 0) return;
  uint8_t* qrow = aq + row * aq_stride;
  float* srow = scales + row * nb;
  if (!data) {  // a pad row: a zero row quantized
    for (int64_t c = lane; c < f; c += 32) qrow[c] = 0;
    const float one = quant::scale_of(0.0f, E4M3, pow2);
    for (int64_t b = lane; b < nb; b += 32) srow[b] = one;
    return;
  }
  const ActSource<T, A, VEC> src{h, n1, probs, ap, il};
  for (int64_t c0 = 0; c0 < f; c0 += int64_t{kFp8PerLane} * 32) {
    const int64_t cl = c0 + int64_t{lane} * kFp8PerLane;
    float v[kFp8PerLane];
    src.load(row, cl, f, v);
    uint32_t w[kFp8PerLane / 4];
    const float scale = quantize_chunk<E4M3>(v, pow2, w);
    store_codes<VEC>(qrow, cl, f, w);
    if (cl < f && lane % kFp8LanesPerBlock == 0) srow[cl / quant::kBlock] = scale;
  }
}

}  // namespace

void mlp_fc1_epilogue(const MlpRows& r, TensorView h, TensorView bias1, TensorView probs,
                      Activation act, const ActivationParams& ap, int il, TensorView a,
                      cudaStream_t stream) {
  if (r.rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(r.rows);
  const float* pp = probs.defined() ? probs.data_ptr<float>() : nullptr;
  const int64_t f = a.shape[1];
  const auto a16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool vec = f % 8 == 0 && (il == 0 || il % 8 == 0) && a16(h.data) && a16(a.data) &&
                   (!bias1.defined() || a16(bias1.data));
  if (vec) {
    const unsigned vblocks = static_cast<unsigned>((r.rows + 7) / 8);
    auto launch = [&](auto tag, auto act) {
      using T = decltype(tag);
      constexpr Activation A = decltype(act)::value;
      fc1_epilogue_vec_kernel<T, A><<<vblocks, 256, 0, stream>>>(
          row_map(r), h.data_ptr<T>(), h.shape[1], bias1.defined() ? bias1.data_ptr<T>() : nullptr,
          pp, ap, il, a.data_ptr<T>(), f, r.rows);
    };
    with_activation(act, [&](auto A) {
      if (h.dtype == DType::kBFloat16)
        launch(__nv_bfloat16{}, A);
      else
        launch(__half{}, A);
    });
    MOEFLOW_CUDA_LAUNCH_CHECK();
    return;
  }
  if (h.dtype == DType::kBFloat16)
    fc1_epilogue_kernel<<<blocks, 256, 0, stream>>>(
        row_map(r), h.data_ptr<__nv_bfloat16>(), h.shape[1],
        bias1.defined() ? bias1.data_ptr<__nv_bfloat16>() : nullptr, pp, act, ap, il,
        a.data_ptr<__nv_bfloat16>(), a.shape[1], r.rows);
  else
    fc1_epilogue_kernel<<<blocks, 256, 0, stream>>>(
        row_map(r), h.data_ptr<__half>(), h.shape[1],
        bias1.defined() ? bias1.data_ptr<__half>() : nullptr, pp, act, ap, il, a.data_ptr<__half>(),
        a.shape[1], r.rows);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void mlp_activation_quantize(const MlpRows& r, TensorView h, TensorView probs, Activation act,
                             const ActivationParams& ap, int il, bool e4m3, bool pow2,
                             TensorView a_q, TensorView a_scales, cudaStream_t stream) {
  if (r.rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((r.rows + 7) / 8);
  const float* pp = probs.defined() ? probs.data_ptr<float>() : nullptr;
  const int64_t f = a_q.shape[1], stride = a_q.strides[0];
  const auto a16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool vec = f % 16 == 0 && stride % 16 == 0 && a16(a_q.data) && (il == 0 || il % 16 == 0) &&
                   h.shape[1] % 8 == 0 && a16(h.data);
  with_activation(act, [&](auto A) {
    constexpr Activation kA = decltype(A)::value;
    auto launch = [&](auto tag, auto e4, auto v) {
      using T = decltype(tag);
      act_quantize_kernel<T, kA, decltype(e4)::value, decltype(v)::value>
          <<<blocks, 256, 0, stream>>>(
              row_map(r), h.data_ptr<T>(), h.shape[1], pp, ap, il, static_cast<uint8_t*>(a_q.data),
              stride, a_scales.data_ptr<float>(), a_scales.shape[1], f, r.rows, pow2);
    };
    auto by_type = [&](auto e4, auto v) {
      if (h.dtype == DType::kBFloat16)
        launch(__nv_bfloat16{}, e4, v);
      else
        launch(__half{}, e4, v);
    };
    if (e4m3 && vec) return by_type(std::true_type{}, std::true_type{});
    if (e4m3) return by_type(std::true_type{}, std::false_type{});
    if (vec) return by_type(std::false_type{}, std::true_type{});
    by_type(std::false_type{}, std::false_type{});
  });
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void mlp_bias_add(const MlpRows& r, TensorView y, TensorView bias, cudaStream_t stream) {
  if (r.rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(r.rows);
  if (y.dtype == DType::kBFloat16)
    bias_add_kernel<<<blocks, 256, 0, stream>>>(row_map(r), y.data_ptr<__nv_bfloat16>(),
                                                y.strides[0], bias.data_ptr<__nv_bfloat16>(),
                                                y.shape[1], r.rows);
  else
    bias_add_kernel<<<blocks, 256, 0, stream>>>(row_map(r), y.data_ptr<__half>(), y.strides[0],
                                                bias.data_ptr<__half>(), y.shape[1], r.rows);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void mlp_dglu(const MlpRows& r, TensorView h, TensorView d_h, TensorView probs, Activation act,
              const ActivationParams& ap, int il, int64_t f, TensorView dprobs, cudaStream_t stream,
              TensorView d_h_amax) {
  auto* amax = d_h_amax.defined() ? static_cast<uint32_t*>(d_h_amax.data) : nullptr;
  if (amax) MOEFLOW_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(uint32_t), stream));
  if (r.rows == 0) return;
  const float* pp0 = probs.defined() ? probs.data_ptr<float>() : nullptr;
  float* dp0 = dprobs.defined() ? dprobs.data_ptr<float>() : nullptr;
  const auto a16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if ((il == 0 || !is_gated(act)) && f % 8 == 0 && a16(h.data) && a16(d_h.data)) {
    constexpr int kT = 128;
    with_activation(act, [&](auto a) {
      constexpr Activation A = decltype(a)::value;
      if (h.dtype == DType::kBFloat16)
        dglu_halves_kernel<__nv_bfloat16, A, kT><<<static_cast<unsigned>(r.rows), kT, 0, stream>>>(
            row_map(r), h.data_ptr<__nv_bfloat16>(), d_h.data_ptr<__nv_bfloat16>(), f, pp0, ap, dp0,
            r.rows, amax);
      else
        dglu_halves_kernel<__half, A, kT><<<static_cast<unsigned>(r.rows), kT, 0, stream>>>(
            row_map(r), h.data_ptr<__half>(), d_h.data_ptr<__half>(), f, pp0, ap, dp0, r.rows,
            amax);
    });
    MOEFLOW_CUDA_LAUNCH_CHECK();
    return;
  }
  constexpr int kThreads = 256;
  const size_t smem = static_cast<size_t>(f) * 4;
  MOEFLOW_CHECK(smem <= 200 * 1024, "dGLU: F = ", f, " is too wide for one block's shared memory");
  const unsigned blocks = static_cast<unsigned>(r.rows);
  const float* pp = probs.defined() ? probs.data_ptr<float>() : nullptr;
  float* dp = dprobs.defined() ? dprobs.data_ptr<float>() : nullptr;
  if (h.dtype == DType::kBFloat16) {
    auto k = dglu_kernel<__nv_bfloat16, kThreads>;
    MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    k<<<blocks, kThreads, smem, stream>>>(row_map(r), h.data_ptr<__nv_bfloat16>(),
                                          d_h.data_ptr<__nv_bfloat16>(), h.shape[1], f, pp, act, ap,
                                          il, dp, r.rows, amax);
  } else {
    auto k = dglu_kernel<__half, kThreads>;
    MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    k<<<blocks, kThreads, smem, stream>>>(row_map(r), h.data_ptr<__half>(), d_h.data_ptr<__half>(),
                                          h.shape[1], f, pp, act, ap, il, dp, r.rows, amax);
  }
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

namespace {
__global__ void dprobs_from_partials_kernel(RowMap m, const float* part, int64_t ld, int64_t tiles,
                                            float* dprobs, int64_t rows) {
  const int64_t row = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (row >= rows) return;
  bool data;
  if (m.expert_of(row, data) < 0) return;  // past the groups: untouched
  float s = 0.0f;
  for (int64_t t = 0; t < tiles; ++t) s += part[row * ld + t];
  dprobs[row] = data ? s : 0.0f;
}
}  // namespace

void mlp_dprobs_from_partials(const MlpRows& r, const float* part, int64_t part_ld, int64_t tiles,
                              TensorView dprobs, cudaStream_t stream) {
  if (r.rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((r.rows + 255) / 256);
  dprobs_from_partials_kernel<<<blocks, 256, 0, stream>>>(row_map(r), part, part_ld, tiles,
                                                          dprobs.data_ptr<float>(), r.rows);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void mlp_segment_colsum(const MlpRows& r, TensorView src, TensorView dst, bool accumulate,
                        cudaStream_t stream) {
  if (r.num_groups == 0) return;
  const int64_t cols = src.shape[1];
  const dim3 grid(static_cast<unsigned>((cols + 255) / 256), static_cast<unsigned>(r.num_groups));
  const int32_t* real =
      r.groups.real_rows.defined() ? r.groups.real_rows.data_ptr<int32_t>() : nullptr;
  if (src.dtype == DType::kBFloat16)
    colsum_kernel<<<grid, 256, 0, stream>>>(r.groups.offsets.data_ptr<int64_t>(), real,
                                            src.data_ptr<__nv_bfloat16>(), src.strides[0], cols,
                                            dst.data_ptr<float>(), accumulate);
  else
    colsum_kernel<<<grid, 256, 0, stream>>>(r.groups.offsets.data_ptr<int64_t>(), real,
                                            src.data_ptr<__half>(), src.strides[0], cols,
                                            dst.data_ptr<float>(), accumulate);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda
