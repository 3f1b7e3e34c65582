// CUDA permute / unpermute and their backward ops.
//
// Each kernel's warps walk work items: first the T tokens, then (for ops that
// write the padded buffer) the pad items (expert, r); one item per warp, or a
// persistent grid (grid_blocks()). A token is handled by one warp: a
// lane holds the destination row of one slot (k = lane within a group of 32
// slots) and the warp walks the routed slots with a ballot mask, lowest k
// first.
//   permute:            load a slice of the token's row (U 16-byte vectors per
//                       lane), store it to every destination row; x is read
//                       once, each copy written once.
//   unpermute:          per slice, fma the routed rows into float32
//                       accumulators in ascending k, convert, store once.
//   unpermute_backward: per slice, load dout once, store w*dout to every
//                       destination row and fold <dout, y_fwd[row]> into a
//                       per-slot float32 dot (fixed-order warp tree).
// Pad items zero the pad rows of every expert segment (and only those).
// No host sync; sizes come from shapes.
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "core/backends.h"
#include "cuda/common.cuh"

namespace moeflow::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kUnroll = 4;  // vectors in flight per lane
// permute (1 read : K writes) defaults, picked with dev/permute_variants.cu
constexpr int kPermuteUnroll = 8;
constexpr bool kStreamingStores = true;

// The pad rows of all experts, (expert, r) flattened into pad items; item i
// is a row when row_of(i) >= 0. Pad blocks walk the items warp by warp.
struct PadRows {
  const int32_t* kept;
  const int32_t* padded;
  const int64_t* offsets;
  int num_experts;
  int align;

  __device__ int64_t row_of(int64_t i) const {
    const int e = static_cast<int>(i / (align - 1));
    const int64_t r = i % (align - 1);
    return r < padded[e] - kept[e] ? offsets[e] + kept[e] + r : -1;
  }
};

// Byte rows: `n` vectors of V per row.
template <typename V>
__device__ __forceinline__ void zero_row(uint8_t* row, int64_t n, int lane) {
  V* dst = reinterpret_cast<V*>(row);
  const V zero{};
  for (int64_t v = lane; v < n; v += kWarpSize) dst[v] = zero;
}

// Small side rows (scales): 4-byte words when aligned, bytes otherwise.
__device__ __forceinline__ void copy_small_row(const uint8_t* src, uint8_t* dst, int64_t bytes,
                                               bool words, int lane) {
  if (words) {
    for (int64_t v = lane; v < bytes / 4; v += kWarpSize)
      reinterpret_cast<uint32_t*>(dst)[v] = reinterpret_cast<const uint32_t*>(src)[v];
  } else {
    for (int64_t v = lane; v < bytes; v += kWarpSize) dst[v] = src[v];
  }
}

__device__ __forceinline__ void zero_small_row(uint8_t* dst, int64_t bytes, int lane) {
  for (int64_t v = lane; v < bytes; v += kWarpSize) dst[v] = 0;
}

struct PermuteArgs {
  const uint8_t* x;
  int64_t x_stride;  // bytes
  uint8_t* y;
  int64_t y_stride;  // bytes
  int64_t row_vecs;  // vectors per row
  const int64_t* dest_row;
  int64_t num_tokens;       // tokens of this launch: plan tokens first_token ..
  int64_t first_token;      // x row i is plan token first_token + i (dest_row, probs: whole plan)
  const int32_t* src_rows;  // or null: plan token first_token + i reads x row src_rows[i]
  int topk;
  const float* probs;     // [T,K] or null
  float* permuted_probs;  // [capacity] or null
  const uint8_t* scales;  // [T,S] or null
  uint8_t* permuted_scales;
  int64_t scale_bytes;  // bytes per scales row
  bool scale_words;     // scale rows 4-byte aligned
  PadRows pads;
  int64_t num_pad_items;
};

template <typename V>
__device__ __forceinline__ void store_vec(V* p, const V& v, bool streaming) {
  if constexpr (std::is_same_v<V, uint4>) {
    if (streaming) {
      __stcs(p, v);
      return;
    }
  }
  *p = v;
}

// UNROLL: vectors in flight per lane; STREAM: evict-first stores for y
// (dev/permute_variants.cu measures the choices).
template <typename V, int UNROLL = kPermuteUnroll, bool STREAM = kStreamingStores>
__global__ void __launch_bounds__(kThreads) permute_kernel(PermuteArgs a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_warps = int64_t{gridDim.x} * kWarps;
  const int64_t num_items = a.num_tokens + a.num_pad_items;
  for (int64_t item = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarpSize; item < num_items;
       item += num_warps) {
    if (item >= a.num_tokens) {
      // Pad row: zeros in y, probs and scales.
      const int64_t row = a.pads.row_of(item - a.num_tokens);
      if (row < 0) continue;
      zero_row<V>(a.y + row * a.y_stride, a.row_vecs, lane);
      if (a.permuted_probs && lane == 0) a.permuted_probs[row] = 0.0f;
      if (a.permuted_scales)
        zero_small_row(a.permuted_scales + row * a.scale_bytes, a.scale_bytes, lane);
      continue;
    }
    const int64_t tl = a.src_rows ? a.src_rows[item] : item;  // row of x
    const int64_t t = a.first_token + item;                   // token of the plan
    const V* src = reinterpret_cast<const V*>(a.x + tl * a.x_stride);
    for (int kg = 0; kg < a.topk; kg += kWarpSize) {
      // Step 1: this group's destinations (lane = k - kg), probs.
      const int k = kg + lane;
      const int64_t slot = t * a.topk + k;
      const int64_t row = k < a.topk ? a.dest_row[slot] : -1;
      if (row >= 0 && a.permuted_probs) a.permuted_probs[row] = a.probs[slot];
      const unsigned routed = __ballot_sync(0xffffffffu, row >= 0);
      if (routed == 0) continue;

      // Step 2: the row, slice by slice, to every destination.
      for (int64_t v0 = 0; v0 < a.row_vecs; v0 += UNROLL * kWarpSize) {
        V vals[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int64_t v = v0 + u * kWarpSize + lane;
          if (v < a.row_vecs) vals[u] = src[v];
        }
        for (unsigned m = routed; m != 0; m &= m - 1) {
          const int64_t r = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
          V* dst = reinterpret_cast<V*>(a.y + r * a.y_stride);
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            const int64_t v = v0 + u * kWarpSize + lane;
            if (v < a.row_vecs) store_vec(dst + v, vals[u], STREAM);
          }
        }
      }

      // Step 3: the scales row travels with the token.
      if (a.scales) {
        for (unsigned m = routed; m != 0; m &= m - 1) {
          const int64_t r = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
          copy_small_row(a.scales + tl * a.scale_bytes, a.permuted_scales + r * a.scale_bytes,
                         a.scale_bytes, a.scale_words, lane);
        }
      }
    }
  }
}

// Pad items of ops that write the padded buffer (none when align is 1).
int64_t num_pad_items(const RoutingPlan& plan) {
  if (plan.config.align == 1 || plan.num_tokens == 0) return 0;
  return int64_t{plan.config.num_experts} * (plan.config.align - 1);
}

// Blocks for `items` warp-sized work items: one item per warp, or (persistent)
// as many blocks as are resident at once on this GPU, fewer when there is less
// work. dev/permute_variants.cu measured both: permute and
// unpermute_backward are faster with one item per warp (the hardware block
// scheduler balances better than a fixed walk), unpermute with a persistent grid.
template <typename Kernel>
int64_t grid_blocks(Kernel kernel, int64_t items, bool persistent) {
  const int64_t needed = ceil_div(items, kWarps);
  if (!persistent) return needed;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> resident;  // (kernel, device) -> blocks/SM
  int device = 0;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&device));
  int per_sm = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
    auto it = resident.find(key);
    if (it == resident.end()) {
      MOEFLOW_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
      resident[key] = per_sm;
    } else {
      per_sm = it->second;
    }
  }
  const int64_t full = int64_t{per_sm > 0 ? per_sm : 1} * sm_count();
  return needed < full ? needed : full;
}

PadRows pad_rows_of(const RoutingPlan& plan) {
  return PadRows{
      plan.tokens_per_expert.data_ptr<int32_t>(), plan.padded_tokens_per_expert.data_ptr<int32_t>(),
      plan.expert_row_offsets.data_ptr<int64_t>(), plan.config.num_experts, plan.config.align};
}

int64_t row_stride_bytes(const TensorView& v) {
  return v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
}

// Calls fn(V{}) with the widest vector type that divides all the byte counts
// and addresses given.
template <typename Fn>
void with_vector(std::initializer_list<int64_t> values, Fn fn) {
  if (aligned_to(16, values)) return fn(uint4{});
  if (aligned_to(8, values)) return fn(uint2{});
  if (aligned_to(4, values)) return fn(uint32_t{});
  if (aligned_to(2, values)) return fn(uint16_t{});
  return fn(uint8_t{});
}

// --- unpermute ------------------------------------------------------------

struct UnpermuteArgs {
  const void* y;
  int64_t y_stride;  // elements
  void* out;
  int64_t out_stride;  // elements
  int64_t hidden;
  const int64_t* dest_row;
  int64_t num_tokens;  // tokens first_token .. first_token + num_tokens - 1
  int64_t first_token;
  int topk;
  const float* weights;   // [T,K] or null
  const float* row_vals;  // [capacity] or null
  float* slot_vals;       // [T,K] or null
};

template <typename TIn, typename TOut, int N>
__device__ __forceinline__ void unpermute_token(const UnpermuteArgs& a, int64_t t, int lane) {
  using InPack = Pack<TIn, N>;
  using OutPack = Pack<TOut, N>;
  const int64_t packs = a.hidden / N;
  const TIn* y = static_cast<const TIn*>(a.y);

  // Slots of the first group stay in registers (the whole token when K <= 32).
  int64_t row0 = lane < a.topk ? a.dest_row[t * a.topk + lane] : -1;
  float w0 = (lane < a.topk && a.weights) ? a.weights[t * a.topk + lane] : 1.0f;

  if (a.row_vals) {  // permute_backward: gather the permuted-probs gradient
    for (int kg = 0; kg < a.topk; kg += kWarpSize) {
      const int k = kg + lane;
      if (k < a.topk) {
        const int64_t r = a.dest_row[t * a.topk + k];
        a.slot_vals[t * a.topk + k] = r >= 0 ? a.row_vals[r] : 0.0f;
      }
    }
  }

  for (int64_t p0 = 0; p0 < packs; p0 += kUnroll * kWarpSize) {
    float acc[kUnroll][N];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < N; ++j) acc[u][j] = 0.0f;

    for (int kg = 0; kg < a.topk; kg += kWarpSize) {
      int64_t row = row0;
      float w = w0;
      if (kg > 0) {
        const int k = kg + lane;
        row = k < a.topk ? a.dest_row[t * a.topk + k] : -1;
        w = (k < a.topk && a.weights) ? a.weights[t * a.topk + k] : 1.0f;
      }
      // NOTE: ascending k (lowest set bit first) fixes the summation order.
      for (unsigned m = __ballot_sync(0xffffffffu, row >= 0); m != 0; m &= m - 1) {
        const int src = __ffs(m) - 1;
        const int64_t r = __shfl_sync(0xffffffffu, row, src);
        const float wk = __shfl_sync(0xffffffffu, w, src);
        const InPack* in = reinterpret_cast<const InPack*>(y + r * a.y_stride);
        InPack vals[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t p = p0 + u * kWarpSize + lane;
          if (p < packs) vals[u] = in[p];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int j = 0; j < N; ++j) acc[u][j] = fmaf(wk, to_float(vals[u].v[j]), acc[u][j]);
      }
    }

    OutPack* out = reinterpret_cast<OutPack*>(static_cast<TOut*>(a.out) + t * a.out_stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * kWarpSize + lane;
      if (p < packs) {
        OutPack o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.v[j] = from_float<TOut>(acc[u][j]);
        out[p] = o;
      }
    }
  }
}

template <typename TIn, typename TOut, int N>
__global__ void __launch_bounds__(kThreads) unpermute_kernel(UnpermuteArgs a) {
  const int64_t num_warps = int64_t{gridDim.x} * kWarps;
  for (int64_t i = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarpSize; i < a.num_tokens;
       i += num_warps)
    unpermute_token<TIn, TOut, N>(a, a.first_token + i, threadIdx.x % kWarpSize);
}

// --- unpermute_backward ---------------------------------------------------

struct UnpermuteBwdArgs {
  const void* dout;
  int64_t dout_stride;  // elements
  const void* y_fwd;    // or null
  int64_t y_stride;     // elements
  void* dy;
  int64_t dy_stride;  // elements
  int64_t dy_row_bytes;
  int64_t hidden;
  const int64_t* dest_row;
  int64_t num_tokens;
  int topk;
  const float* probs;  // or null
  float* dprobs;       // or null
  PadRows pads;
  int64_t num_pad_items;
};

template <typename TG, typename TY, int N>
__device__ __forceinline__ void unpermute_bwd_token(const UnpermuteBwdArgs& a, int64_t t,
                                                    int lane) {
  using GPack = Pack<TG, N>;
  using YPack = Pack<TY, N>;
  const int64_t packs = a.hidden / N;
  const GPack* g =
      reinterpret_cast<const GPack*>(static_cast<const TG*>(a.dout) + t * a.dout_stride);

  for (int kg = 0; kg < a.topk; kg += kWarpSize) {
    const int k = kg + lane;
    const int64_t slot = t * a.topk + k;
    const int64_t row = k < a.topk ? a.dest_row[slot] : -1;
    const float w = (k < a.topk && a.probs) ? a.probs[slot] : 1.0f;
    const unsigned routed = __ballot_sync(0xffffffffu, row >= 0);
    float dot = 0.0f;  // lane j: <dout, y_fwd[row of slot kg+j]>

    for (int64_t p0 = 0; p0 < packs; p0 += kUnroll * kWarpSize) {
      GPack gv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t p = p0 + u * kWarpSize + lane;
        if (p < packs) gv[u] = g[p];
      }
      for (unsigned m = routed; m != 0; m &= m - 1) {
        const int src = __ffs(m) - 1;
        const int64_t r = __shfl_sync(0xffffffffu, row, src);
        const float wk = __shfl_sync(0xffffffffu, w, src);
        YPack* dst = reinterpret_cast<YPack*>(static_cast<TY*>(a.dy) + r * a.dy_stride);
        const YPack* yf =
            a.y_fwd
                ? reinterpret_cast<const YPack*>(static_cast<const TY*>(a.y_fwd) + r * a.y_stride)
                : nullptr;
        float part = 0.0f;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t p = p0 + u * kWarpSize + lane;
          if (p < packs) {
            YPack o;
#pragma unroll
            for (int j = 0; j < N; ++j) o.v[j] = from_float<TY>(wk * to_float(gv[u].v[j]));
            dst[p] = o;
            if (a.dprobs) {
              const YPack yv = yf[p];
#pragma unroll
              for (int j = 0; j < N; ++j)
                part = fmaf(to_float(gv[u].v[j]), to_float(yv.v[j]), part);
            }
          }
        }
        if (a.dprobs) {
#pragma unroll
          for (int d = kWarpSize / 2; d > 0; d /= 2) part += __shfl_xor_sync(0xffffffffu, part, d);
          if (lane == src) dot += part;
        }
      }
    }
    if (a.dprobs && k < a.topk) a.dprobs[slot] = row >= 0 ? dot : 0.0f;
  }
}

// NOTE: 4 blocks (32 warps) per SM: at 70 registers only 3 fit, which is
// measurably slower (docs/performance.md).
template <typename TG, typename TY, int N>
__global__ void __launch_bounds__(kThreads, 4) unpermute_bwd_kernel(UnpermuteBwdArgs a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_warps = int64_t{gridDim.x} * kWarps;
  const int64_t num_items = a.num_tokens + a.num_pad_items;
  for (int64_t item = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarpSize; item < num_items;
       item += num_warps) {
    if (item < a.num_tokens) {
      unpermute_bwd_token<TG, TY, N>(a, item, lane);
      continue;
    }
    const int64_t row = a.pads.row_of(item - a.num_tokens);
    if (row < 0) continue;
    uint8_t* dst = static_cast<uint8_t*>(a.dy) + row * a.dy_stride * int64_t{sizeof(TY)};
    if (N > 1)  // NOTE: on the vector path rows are 16-byte multiples, 16-byte aligned
      zero_row<uint4>(dst, a.dy_row_bytes / 16, lane);
    else
      zero_row<uint8_t>(dst, a.dy_row_bytes, lane);
  }
}

int64_t addr(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

}  // namespace

// The kernel arguments and grid of one permute call (also used by
// dev/permute_variants.cu).
struct PermuteLaunch {
  PermuteArgs args;
  int64_t row_bytes;
  int64_t num_items;  // tokens + pad items
};

PermuteLaunch make_permute_launch(TensorView x, const RoutingPlan& plan, TensorView y,
                                  const PermuteExtras& ex) {
  PermuteArgs a{};
  a.x = static_cast<const uint8_t*>(x.data);
  a.x_stride = row_stride_bytes(x);
  a.y = static_cast<uint8_t*>(y.data);
  a.y_stride = row_stride_bytes(y);
  const int64_t row_bytes = x.shape[1] * static_cast<int64_t>(dtype_size(x.dtype));
  a.dest_row = plan.dest_row.data_ptr<int64_t>();
  a.num_tokens = plan.num_tokens;
  a.topk = plan.topk;
  if (ex.probs.defined()) {
    a.probs = ex.probs.data_ptr<float>();
    a.permuted_probs = ex.permuted_probs.data_ptr<float>();
  }
  if (ex.scales.defined()) {
    a.scale_bytes = ex.scales.shape[1] * static_cast<int64_t>(dtype_size(ex.scales.dtype));
    if (a.scale_bytes > 0) {
      a.scales = static_cast<const uint8_t*>(ex.scales.data);
      a.permuted_scales = static_cast<uint8_t*>(ex.permuted_scales.data);
      a.scale_words = aligned_to(4, {a.scale_bytes, addr(a.scales), addr(a.permuted_scales)});
    }
  }
  a.pads = pad_rows_of(plan);
  a.num_pad_items = num_pad_items(plan);
  return PermuteLaunch{a, row_bytes, plan.num_tokens + a.num_pad_items};
}

void permute(TensorView x, const RoutingPlan& plan, TensorView y, const PermuteExtras& ex,
             cudaStream_t stream) {
  permute_tokens(x, 0, plan.num_tokens, true, plan, y, ex, stream, nullptr, 0);
}

void permute_tokens(TensorView x_rows, int64_t first_token, int64_t count, bool pad_rows,
                    const RoutingPlan& plan, TensorView y, const PermuteExtras& ex,
                    cudaStream_t stream, const int32_t* src_rows, int max_blocks) {
  MOEFLOW_CHECK(first_token >= 0 && count >= 0 && first_token + count <= plan.num_tokens,
                "permute_tokens: tokens [", first_token, ", ", first_token + count,
                ") outside the plan's ", plan.num_tokens);
  PermuteLaunch l = make_permute_launch(x_rows, plan, y, ex);
  l.args.first_token = first_token;
  l.args.src_rows = src_rows;
  l.args.num_tokens = count;
  if (!pad_rows) l.args.num_pad_items = 0;
  l.num_items = count + l.args.num_pad_items;
  if (l.num_items == 0) return;
  PermuteArgs& a = l.args;
  with_vector({l.row_bytes, a.x_stride, a.y_stride, addr(a.x), addr(a.y)}, [&](auto v) {
    using V = decltype(v);
    a.row_vecs = l.row_bytes / static_cast<int64_t>(sizeof(V));
    const auto kernel = permute_kernel<V>;
    int64_t blocks = grid_blocks(kernel, l.num_items, false);
    if (max_blocks > 0) blocks = std::min<int64_t>(blocks, max_blocks);
    kernel<<<blocks, kThreads, 0, stream>>>(a);
  });
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void unpermute(TensorView y, const RoutingPlan& plan, TensorView out, TensorView weights,
               TensorView row_vals, TensorView slot_vals, cudaStream_t stream) {
  unpermute_tokens(y, plan, 0, plan.num_tokens, out, weights, row_vals, slot_vals, stream, 0);
}

void unpermute_tokens(TensorView y, const RoutingPlan& plan, int64_t first_token, int64_t count,
                      TensorView out, TensorView weights, TensorView row_vals, TensorView slot_vals,
                      cudaStream_t stream, int max_blocks) {
  MOEFLOW_CHECK(first_token >= 0 && count >= 0 && first_token + count <= plan.num_tokens,
                "unpermute_tokens: tokens [", first_token, ", ", first_token + count,
                ") outside the plan's ", plan.num_tokens);
  if (count == 0) return;
  UnpermuteArgs a{};
  a.first_token = first_token;
  a.y = y.data;
  a.y_stride = y.strides[0];
  a.out = out.data;
  a.out_stride = out.strides[0];
  a.hidden = y.shape[1];
  a.dest_row = plan.dest_row.data_ptr<int64_t>();
  a.num_tokens = count;
  a.topk = plan.topk;
  a.weights = weights.defined() ? weights.data_ptr<float>() : nullptr;
  a.row_vals = row_vals.defined() ? row_vals.data_ptr<float>() : nullptr;
  a.slot_vals = slot_vals.defined() ? slot_vals.data_ptr<float>() : nullptr;
  with_float_type(y.dtype, [&](auto tin) {
    with_float_type(out.dtype, [&](auto tout) {
      using TIn = decltype(tin);
      using TOut = decltype(tout);
      constexpr int kN = 16 / sizeof(TIn);
      const int64_t in_bytes = kN * sizeof(TIn), out_bytes = kN * sizeof(TOut);
      const bool vec = a.hidden % kN == 0 &&
                       aligned_to(in_bytes, {addr(a.y), a.y_stride * int64_t(sizeof(TIn))}) &&
                       aligned_to(out_bytes, {addr(a.out), a.out_stride * int64_t(sizeof(TOut))});
      const auto kernel = vec ? unpermute_kernel<TIn, TOut, kN> : unpermute_kernel<TIn, TOut, 1>;
      int64_t blocks = grid_blocks(kernel, a.num_tokens, true);
      if (max_blocks > 0) blocks = std::min<int64_t>(blocks, max_blocks);
      kernel<<<blocks, kThreads, 0, stream>>>(a);
    });
  });
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void unpermute_backward(TensorView dout, const RoutingPlan& plan, TensorView y_fwd,
                        TensorView probs, TensorView dy, TensorView dprobs, cudaStream_t stream) {
  if (plan.num_tokens == 0) return;
  UnpermuteBwdArgs a{};
  a.dout = dout.data;
  a.dout_stride = dout.strides[0];
  a.y_fwd = y_fwd.defined() ? y_fwd.data : nullptr;
  a.y_stride = y_fwd.defined() ? y_fwd.strides[0] : 0;
  a.dy = dy.data;
  a.dy_stride = dy.strides[0];
  a.hidden = dout.shape[1];
  a.dy_row_bytes = a.hidden * static_cast<int64_t>(dtype_size(dy.dtype));
  a.dest_row = plan.dest_row.data_ptr<int64_t>();
  a.num_tokens = plan.num_tokens;
  a.topk = plan.topk;
  a.probs = probs.defined() ? probs.data_ptr<float>() : nullptr;
  a.dprobs = dprobs.defined() ? dprobs.data_ptr<float>() : nullptr;
  a.pads = pad_rows_of(plan);
  a.num_pad_items = num_pad_items(plan);
  const int64_t num_items = a.num_tokens + a.num_pad_items;
  with_float_type(dout.dtype, [&](auto tg) {
    with_float_type(dy.dtype, [&](auto ty) {
      using TG = decltype(tg);
      using TY = decltype(ty);
      constexpr int kN = 8;  // 16 bytes of a 16-bit type
      const bool vec =
          a.hidden % kN == 0 &&
          aligned_to(kN * sizeof(TG), {addr(a.dout), a.dout_stride * int64_t(sizeof(TG))}) &&
          aligned_to(kN * sizeof(TY), {addr(a.dy), a.dy_stride * int64_t(sizeof(TY)), addr(a.y_fwd),
                                       a.y_stride * int64_t(sizeof(TY))});
      const auto kernel = vec ? unpermute_bwd_kernel<TG, TY, kN> : unpermute_bwd_kernel<TG, TY, 1>;
      kernel<<<grid_blocks(kernel, num_items, false), kThreads, 0, stream>>>(a);
    });
  });
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda
