// CUDA permute_quantize: permute with 1x128 rowwise FP8 quantization fused in
// (policy: moeflow/quantize.h; shared scalar math: core/quantize_backend.h).
//
// One warp per work item: first the T tokens, then the pad items (expert, r)
// as in permute. A token's warp walks its row in chunks of 512 columns (the
// next chunk's loads issued before the current one is quantized); lane l
// holds columns [16 l, 16 l + 16) of the chunk, so the 8 lanes 8g..8g+7 hold
// one 1x128 block. Per chunk: load (x is read once), amax over the block
// (3 xor shuffles within the 8 lanes), quant::scale_of, codes by Fp8Divider
// (__fdiv_rn's quotients) and paired cvt.rn.satfinite (NaN -> 0x7F, as
// quantize.cu; fp8.cuh's quantize_chunk), then every routed slot
// (lowest k first) gets the 16 codes as one 16-byte store per lane and the
// block's scale from the block's first lane. Pad items write code 0, scale 0
// and prob 0. Dropped / unrouted slots write nothing. Rows that are not
// 16-byte aligned (or H % 16 != 0) take the same path with byte stores.
//
// unpermute_backward_quantize: the same layout and quantization, the other
// way: a token's warp reads its row of dout once and writes every routed
// slot's row of dy as FP8 with its scales. Without probs the K rows are one
// quantization of dout's row; with probs slot k quantizes round(w_k * dout)
// (rounded to dout's dtype first, as unpermute_backward writes dy), so each
// slot has its own scales. Pad items write code 0 and the scale quantize
// gives a zero block (unpermute_backward zeroes pad rows).
// No host sync, no allocation; graph-capturable.
#include <cuda_fp8.h>

#include <type_traits>

#include "core/permute_quantize_backend.h"
#include "core/quantize_backend.h"
#include "cuda/common.cuh"
#include "cuda/fp8.cuh"

namespace moeflow::cuda {
namespace {

using quant::kBlock;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kPerLane = kFp8PerLane;              // contiguous columns per lane
constexpr int kLanesPerBlock = kFp8LanesPerBlock;  // lanes sharing one 1x128 block
constexpr int64_t kChunk = int64_t{kPerLane} * kWarpSize;

// The pad rows of all experts, (expert, r) flattened into pad items (the
// layout permute.cu uses); item i is a row when row_of(i) >= 0.
struct PadRows {
  const int32_t* kept;
  const int32_t* padded;
  const int64_t* offsets;
  int align;

  __device__ int64_t row_of(int64_t i) const {
    const int e = static_cast<int>(i / (align - 1));
    const int64_t r = i % (align - 1);
    return r < padded[e] - kept[e] ? offsets[e] + kept[e] + r : -1;
  }
};

// A pad row: codes 0 and `scale` for every block.
template <bool VEC>
__device__ __forceinline__ void write_pad_row(uint8_t* yrow, float* scales, int64_t nb,
                                              int64_t hidden, float scale, int lane) {
  if constexpr (VEC) {
    for (int64_t v = lane; v < hidden / 16; v += kWarpSize)
      reinterpret_cast<uint4*>(yrow)[v] = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t c = lane; c < hidden; c += kWarpSize) yrow[c] = 0;
  }
  for (int64_t b = lane; b < nb; b += kWarpSize) scales[b] = scale;
}

struct Args {
  const uint8_t* x;
  int64_t x_stride;  // bytes
  uint8_t* y;
  int64_t y_stride;  // bytes
  float* y_scales;   // [capacity, nb], contiguous
  int64_t nb;
  int64_t hidden;
  const int64_t* dest_row;
  int64_t num_tokens;
  int topk;
  const float* probs;     // [T,K] or null
  float* permuted_probs;  // [capacity] or null
  bool pow2;
  PadRows pads;
  int64_t num_pad_items;
};

// VEC: 16-byte aligned rows and H % 16 == 0 (a lane's 16 columns are all in or all out).
template <typename T, bool E4M3, bool VEC>
__global__ void __launch_bounds__(kThreads, 4) permute_quantize_kernel(Args a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t item = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarpSize;
  if (item >= a.num_tokens + a.num_pad_items) return;

  if (item >= a.num_tokens) {  // pad row: codes 0, scales 0, prob 0
    const int64_t row = a.pads.row_of(item - a.num_tokens);
    if (row < 0) return;
    write_pad_row<VEC>(a.y + row * a.y_stride, a.y_scales + row * a.nb, a.nb, a.hidden, 0.0f, lane);
    if (lane == 0 && a.permuted_probs) a.permuted_probs[row] = 0.0f;
    return;
  }

  const int64_t t = item;
  const int64_t* dest = a.dest_row + t * a.topk;
  if (a.permuted_probs) {
    for (int k = lane; k < a.topk; k += kWarpSize) {
      const int64_t r = dest[k];
      if (r >= 0) a.permuted_probs[r] = a.probs[t * a.topk + k];
    }
  }
  const int64_t row0 = lane < a.topk ? dest[lane] : -1;
  const unsigned routed0 = __ballot_sync(0xffffffffu, row0 >= 0);
  if (routed0 == 0 && a.topk <= kWarpSize) return;  // nothing to write (warp-uniform)

  const T* xrow = reinterpret_cast<const T*>(a.x + t * a.x_stride);
  // VEC: the next chunk's loads are issued before this chunk is quantized and
  // stored (two chunks in flight per warp).
  RawChunk<T> next;
  if constexpr (VEC) load_raw(xrow, int64_t{lane} * kPerLane, a.hidden, next);
  for (int64_t c0 = 0; c0 < a.hidden; c0 += kChunk) {
    const int64_t cl = c0 + int64_t{lane} * kPerLane;  // this lane's first column
    float v[kPerLane];
    // Columns past H read as 0: they leave the amax (a max of |finite| >= 0) as it is.
    if constexpr (VEC) {
      const RawChunk<T> cur = next;
      if (c0 + kChunk < a.hidden) load_raw(xrow, cl + kChunk, a.hidden, next);
      unpack_raw(cur, v);
    } else {
      load_chunk<T, VEC>(xrow, cl, a.hidden, v);
    }
    uint32_t w[kPerLane / 4];
    const float scale = quantize_chunk<E4M3>(v, a.pow2, w);
    const bool lead = cl < a.hidden && lane % kLanesPerBlock == 0;  // writes the block's scale
    const int64_t blk = cl / kBlock;

    for (int kg = 0; kg < a.topk; kg += kWarpSize) {
      int64_t row = row0;
      unsigned routed = routed0;
      if (kg > 0) {
        row = kg + lane < a.topk ? dest[kg + lane] : -1;
        routed = __ballot_sync(0xffffffffu, row >= 0);
      }
      for (unsigned mk = routed; mk != 0; mk &= mk - 1) {
        const int64_t r = __shfl_sync(0xffffffffu, row, __ffs(mk) - 1);
        store_codes<VEC>(a.y + r * a.y_stride, cl, a.hidden, w);
        if (lead) a.y_scales[r * a.nb + blk] = scale;
      }
    }
  }
}

// unpermute_backward_quantize: dout [T,H] -> dy rows (fp8) and their scales.
struct BwdArgs {
  const uint8_t* dout;
  int64_t dout_stride;  // bytes
  uint8_t* dy;
  int64_t dy_stride;  // bytes
  float* dy_scales;   // [capacity, nb], contiguous
  int64_t nb;
  int64_t hidden;
  const int64_t* dest_row;
  int64_t num_tokens;
  int topk;
  const float* probs;  // [T,K] or null
  bool pow2;
  PadRows pads;
  int64_t num_pad_items;
};

template <typename T, bool E4M3, bool VEC>
__global__ void __launch_bounds__(kThreads, 3) unpermute_bwd_quantize_kernel(BwdArgs a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t item = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarpSize;
  if (item >= a.num_tokens + a.num_pad_items) return;

  if (item >= a.num_tokens) {  // pad row: a zero row quantized (codes 0)
    const int64_t row = a.pads.row_of(item - a.num_tokens);
    if (row < 0) return;
    write_pad_row<VEC>(a.dy + row * a.dy_stride, a.dy_scales + row * a.nb, a.nb, a.hidden,
                       quant::scale_of(0.0f, E4M3, a.pow2), lane);
    return;
  }

  const int64_t t = item;
  const int64_t* dest = a.dest_row + t * a.topk;
  const int64_t row0 = lane < a.topk ? dest[lane] : -1;
  const float w0 = lane < a.topk && a.probs ? a.probs[t * a.topk + lane] : 1.0f;
  const unsigned routed0 = __ballot_sync(0xffffffffu, row0 >= 0);
  if (routed0 == 0 && a.topk <= kWarpSize) return;  // nothing to write (warp-uniform)

  const T* grow = reinterpret_cast<const T*>(a.dout + t * a.dout_stride);
  RawChunk<T> next;  // VEC: the next chunk's loads in flight, as in permute_quantize_kernel
  if constexpr (VEC) load_raw(grow, int64_t{lane} * kPerLane, a.hidden, next);
  for (int64_t c0 = 0; c0 < a.hidden; c0 += kChunk) {
    const int64_t cl = c0 + int64_t{lane} * kPerLane;
    float v[kPerLane];
    if constexpr (VEC) {
      const RawChunk<T> cur = next;
      if (c0 + kChunk < a.hidden) load_raw(grow, cl + kChunk, a.hidden, next);
      unpack_raw(cur, v);
    } else {
      load_chunk<T, VEC>(grow, cl, a.hidden, v);
    }
    const bool lead = cl < a.hidden && lane % kLanesPerBlock == 0;
    const int64_t blk = cl / kBlock;
    uint32_t w[kPerLane / 4];
    float scale = 0.0f;
    if (!a.probs) scale = quantize_chunk<E4M3>(v, a.pow2, w);  // the K rows are the same

    for (int kg = 0; kg < a.topk; kg += kWarpSize) {
      int64_t row = row0;
      float wt = w0;
      unsigned routed = routed0;
      if (kg > 0) {
        const int k = kg + lane;
        row = k < a.topk ? dest[k] : -1;
        wt = k < a.topk && a.probs ? a.probs[t * a.topk + k] : 1.0f;
        routed = __ballot_sync(0xffffffffu, row >= 0);
      }
      for (unsigned mk = routed; mk != 0; mk &= mk - 1) {
        const int src = __ffs(mk) - 1;
        const int64_t r = __shfl_sync(0xffffffffu, row, src);
        if (a.probs) {  // this slot's row: round(w * dout) in dout's dtype, then quantized
          const float wk = __shfl_sync(0xffffffffu, wt, src);
          float u[kPerLane];
#pragma unroll
          for (int j = 0; j < kPerLane; ++j)
            u[j] = cl + j < a.hidden ? to_float(from_float<T>(wk * v[j])) : 0.0f;
          scale = quantize_chunk<E4M3>(u, a.pow2, w);
        }
        store_codes<VEC>(a.dy + r * a.dy_stride, cl, a.hidden, w);
        if (lead) a.dy_scales[r * a.nb + blk] = scale;
      }
    }
  }
}

// The pad rows of a plan and how many pad items the kernels walk.
PadRows pads_of(const RoutingPlan& plan) {
  return PadRows{plan.tokens_per_expert.data_ptr<int32_t>(),
                 plan.padded_tokens_per_expert.data_ptr<int32_t>(),
                 plan.expert_row_offsets.data_ptr<int64_t>(), plan.config.align};
}
int64_t pad_items_of(const RoutingPlan& plan) {
  return (plan.config.align == 1 || plan.num_tokens == 0)
             ? 0
             : int64_t{plan.config.num_experts} * (plan.config.align - 1);
}

// Calls f(T{}, e4m3, vec) with T the float type of `dtype` and e4m3 / vec as
// std::bool_constant: the kernel instance of a launch.
template <typename F>
void with_fp8_instance(DType dtype, bool e4m3, bool vec, F&& f) {
  with_float_type(dtype, [&](auto t) {
    if (e4m3 && vec) return f(t, std::true_type{}, std::true_type{});
    if (e4m3) return f(t, std::true_type{}, std::false_type{});
    if (vec) return f(t, std::false_type{}, std::true_type{});
    f(t, std::false_type{}, std::false_type{});
  });
}

}  // namespace

void permute_quantize(TensorView x, const RoutingPlan& plan, TensorView y, TensorView y_scales,
                      const QuantizeConfig& config, const PermuteExtras& extras,
                      cudaStream_t stream) {
  Args a{};
  a.x = static_cast<const uint8_t*>(x.data);
  a.x_stride = x.strides[0] * static_cast<int64_t>(dtype_size(x.dtype));
  a.y = static_cast<uint8_t*>(y.data);
  a.y_stride = y.strides[0];  // fp8: one byte an element
  a.y_scales = static_cast<float*>(y_scales.data);
  a.nb = y_scales.shape[1];
  a.hidden = x.shape[1];
  a.dest_row = plan.dest_row.data_ptr<int64_t>();
  a.num_tokens = plan.num_tokens;
  a.topk = plan.topk;
  a.probs = extras.probs.defined() ? static_cast<const float*>(extras.probs.data) : nullptr;
  a.permuted_probs =
      extras.permuted_probs.defined() ? static_cast<float*>(extras.permuted_probs.data) : nullptr;
  a.pow2 = config.pow2_scales;
  a.pads = pads_of(plan);
  a.num_pad_items = pad_items_of(plan);
  const int64_t items = a.num_tokens + a.num_pad_items;
  if (items == 0) return;
  const bool vec = aligned_to(
      16, {a.hidden, a.x_stride, a.y_stride, static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.x)),
           static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.y))});
  const int64_t blocks = ceil_div(items, kWarps);
  with_fp8_instance(
      x.dtype, config.out == DType::kFloat8E4M3, vec, [&](auto t, auto e4m3, auto vec_c) {
        permute_quantize_kernel<decltype(t), decltype(e4m3)::value, decltype(vec_c)::value>
            <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
        MOEFLOW_CUDA_LAUNCH_CHECK();
      });
}

void unpermute_backward_quantize(TensorView dout, const RoutingPlan& plan, TensorView probs,
                                 TensorView dy, TensorView dy_scales, const QuantizeConfig& config,
                                 cudaStream_t stream) {
  BwdArgs a{};
  a.dout = static_cast<const uint8_t*>(dout.data);
  a.dout_stride = dout.strides[0] * static_cast<int64_t>(dtype_size(dout.dtype));
  a.dy = static_cast<uint8_t*>(dy.data);
  a.dy_stride = dy.strides[0];  // fp8: one byte an element
  a.dy_scales = static_cast<float*>(dy_scales.data);
  a.nb = dy_scales.shape[1];
  a.hidden = dout.shape[1];
  a.dest_row = plan.dest_row.data_ptr<int64_t>();
  a.num_tokens = plan.num_tokens;
  a.topk = plan.topk;
  a.probs = probs.defined() ? static_cast<const float*>(probs.data) : nullptr;
  a.pow2 = config.pow2_scales;
  a.pads = pads_of(plan);
  a.num_pad_items = pad_items_of(plan);
  const int64_t items = a.num_tokens + a.num_pad_items;
  if (items == 0) return;
  const bool vec = aligned_to(16, {a.hidden, a.dout_stride, a.dy_stride,
                                   static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.dout)),
                                   static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.dy))});
  const int64_t blocks = ceil_div(items, kWarps);
  with_fp8_instance(
      dout.dtype, config.out == DType::kFloat8E4M3, vec, [&](auto t, auto e4m3, auto vec_c) {
        unpermute_bwd_quantize_kernel<decltype(t), decltype(e4m3)::value, decltype(vec_c)::value>
            <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
        MOEFLOW_CUDA_LAUNCH_CHECK();
      });
}

}  // namespace moeflow::cuda
