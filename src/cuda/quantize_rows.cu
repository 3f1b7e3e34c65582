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
//      stores where aligned; the other rows written as code 0 (with q_t:
//      the codes and their transpose from one pass over 64 x 128 tiles,
//      rows_codes_t_kernel);
//   4. the word rewritten as the scale (one thread).
// The tensorwise permute_quantize / unpermute_backward_quantize
// (permute_quantize_tensorwise) run the same steps on a plan's rows gathered
// from the tokens (GatherSource): the amax over the tokens instead of the
// rows (tokens_amax_kernel: each token read once, not once per slot), and
// for permute the rows' probs (row_probs_kernel).
// No workspace, no host sync; graph-capturable.
#include <algorithm>
#include <type_traits>

#include "core/activations.h"
#include "core/mlp_call.h"
#include "core/permute_quantize_backend.h"
#include "cuda/act_source.cuh"
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
  static constexpr bool kRaw = true;  // row(): its 16-bit values, as stored
  const T* x;
  int64_t ld;
  __device__ __forceinline__ const T* row(int64_t r) const { return x + r * ld; }
  __device__ __forceinline__ void weigh(int64_t, float (&)[kFp8PerLane]) const {}
  __device__ __forceinline__ void load(int64_t r, int64_t cl, int64_t cols,
                                       float (&v)[kFp8PerLane]) const {
    load_chunk<T, VEC>(row(r), cl, cols, v);
  }
};

// The rows of a routing plan gathered from the tokens x [T, ld]: data row r
// is token row_token[r], times its slot's weight rounded to T where weights
// [T, K] are given (unpermute_backward's w * dout).
template <typename T, bool VEC>
struct GatherSource {
  static constexpr bool kRaw = true;
  const T* x;
  int64_t ld;
  const int32_t* row_token;
  const int32_t* row_k;
  const float* weights;  // or null
  int k;
  __device__ __forceinline__ const T* row(int64_t r) const {
    return x + int64_t{row_token[r]} * ld;
  }
  __device__ __forceinline__ void weigh(int64_t r, float (&v)[kFp8PerLane]) const {
    if (!weights) return;
    const float w = weights[int64_t{row_token[r]} * k + row_k[r]];
#pragma unroll
    for (int j = 0; j < kFp8PerLane; ++j) v[j] = to_float(from_float<T>(w * v[j]));
  }
  __device__ __forceinline__ void load(int64_t r, int64_t cl, int64_t cols,
                                       float (&v)[kFp8PerLane]) const {
    load_chunk<T, VEC>(row(r), cl, cols, v);
    weigh(r, v);
  }
};

// The block's largest amax bits (each thread's mb) joined into the word:
// one atomicMax per block (order-free, so deterministic).
__device__ __forceinline__ void join_block_amax(uint32_t mb, uint32_t* amax) {
  __shared__ uint32_t red[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
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

template <typename S>
__global__ void __launch_bounds__(kThreads)
    rows_amax_kernel(RowMap m, S src, int64_t rows, int64_t cols, uint32_t* amax) {
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
  join_block_amax(mb, amax);
}

// The amax of a plan's gathered rows from the tokens' side (GatherSource):
// one warp per token, each token read once, its values joining when one of
// its K slots is kept (dest_row >= 0), or with weights each kept slot's
// rounded w * value. Joins the word as rows_amax_kernel does.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    tokens_amax_kernel(const T* x, int64_t ld, const int64_t* dest_row, const float* weights,
                       int k_slots, int64_t tokens, int64_t cols, uint32_t* amax) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t mb = 0;
  auto join = [&](float v) {
    const uint32_t b = abs_bits(v);
    mb = max(mb, b < kFp8NonFinite ? b : 0u);  // inf and NaN left out
  };
  for (int64_t t = int64_t{blockIdx.x} * kWarps + warp; t < tokens;
       t += int64_t{gridDim.x} * kWarps) {
    const int64_t* dest = dest_row + t * k_slots;
    bool kept = false;
    for (int k0 = 0; k0 < k_slots; k0 += 32)
      kept |= __any_sync(0xffffffffu, k0 + lane < k_slots && dest[k0 + lane] >= 0);
    if (!kept) continue;  // warp-uniform
    for (int64_t c0 = 0; c0 < cols; c0 += int64_t{kFp8PerLane} * 32) {
      float v[kFp8PerLane];
      load_chunk<T, VEC>(x + t * ld, c0 + int64_t{lane} * kFp8PerLane, cols, v);
      if (!weights) {
#pragma unroll
        for (int j = 0; j < kFp8PerLane; ++j) join(v[j]);
        continue;
      }
      for (int kk = 0; kk < k_slots; ++kk) {
        if (dest[kk] < 0) continue;
        const float w = weights[t * k_slots + kk];
#pragma unroll
        for (int j = 0; j < kFp8PerLane; ++j) join(to_float(from_float<T>(w * v[j])));
      }
    }
  }
  join_block_amax(mb, amax);
}

// permute's permuted_probs for the gathered rows: the slot's prob on data
// rows, 0 on pad rows, rows past the groups untouched.
__global__ void row_probs_kernel(RowMap m, const int32_t* row_token, const int32_t* row_k,
                                 const float* probs, int k_slots, int64_t rows, float* pp) {
  for (int64_t r = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; r < rows;
       r += int64_t{gridDim.x} * blockDim.x) {
    bool data;
    if (m.expert_of(r, data) < 0) continue;
    pp[r] = data ? probs[int64_t{row_token[r]} * k_slots + row_k[r]] : 0.0f;
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

// The codes of x's rows and their transpose in one pass: a 64-row x
// 128-column tile per step, 128 threads. Thread t quantizes 16 values
// (columns 16 (t % 8) ..) of rows t / 8 + 16 i (i < 4; VEC: the four rows'
// 16-byte loads issued first), stores them to q and into the shared tile;
// then thread (a = lane % 4, b = 8 warp + lane / 4) reads the 4 x 4 byte
// blocks of rows 16 a .. 16 a + 15 and columns 4 b .. 4 b + 3, transposes
// them in registers, and writes those four columns' 16 bytes as q_t's rows
// (a warp's store: eight q_t rows of 64 contiguous bytes; 16-byte stores
// when vec_t: q_t 16-byte aligned, rows % 16 == 0). Tile word w of row r
// sits at r * 32 + (w ^ 8 (r / 16 % 4)): both phases free of bank conflicts.
// Rows that hold no data: code 0 in both.
constexpr int kTqRows = 64, kTqCols = 128, kTqThreads = 128;

__device__ __forceinline__ int tq_word(int r, int w) {
  return r * (kTqCols / 4) + (w ^ (8 * ((r >> 4) & 3)));
}

template <typename T, bool E4M3, bool VEC, typename S>
__global__ void __launch_bounds__(kTqThreads)
    rows_codes_t_kernel(RowMap m, S src, int64_t rows, int64_t cols, uint8_t* q, int64_t q_stride,
                        uint8_t* q_t, bool vec_t, const uint32_t* amax, bool pow2) {
  constexpr int kRowsPerThread = kTqRows / (kTqThreads / 8);
  static_assert(kTqCols == 8 * kFp8PerLane && kTqRows == 64 && kTqThreads == 128,
                "8 threads per tile row; phase 2: 4 row blocks x 32 column quads");
  __shared__ __align__(16) uint32_t tile[kTqRows * kTqCols / 4];
  const float scale = quant::scale_of(__uint_as_float(*amax), E4M3, pow2);
  const Fp8Divider fast(scale, true), exact(scale, false);
  const int s = threadIdx.x % 8, r_in = threadIdx.x / 8;
  const int lane = threadIdx.x % 32, a = lane % 4, b = (threadIdx.x / 32) * 8 + lane / 4;
  const int64_t tr = (rows + kTqRows - 1) / kTqRows, tc = (cols + kTqCols - 1) / kTqCols;
  for (int64_t item = blockIdx.x; item < tr * tc; item += gridDim.x) {
    const int64_t r0 = item / tc * kTqRows, c0 = item % tc * kTqCols, cl = c0 + s * kFp8PerLane;
    constexpr bool kPrefetch = VEC && S::kRaw;  // the rows' loads issued first
    RawChunk<T> raw[kPrefetch ? kRowsPerThread : 1];
    bool data[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t row = r0 + r_in + 16 * i;
      data[i] = false;
      if (row < rows) m.expert_of(row, data[i]);
      if constexpr (kPrefetch)  // (no data: zeros, nothing read)
        load_raw(data[i] ? src.row(row) : nullptr, data[i] ? cl : cols, cols, raw[i]);
    }
    __syncthreads();  // the previous tile is read out
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t row = r0 + r_in + 16 * i;
      uint32_t w[kFp8PerLane / 4] = {0u, 0u, 0u, 0u};
      if (data[i]) {
        float v[kFp8PerLane];
        if constexpr (kPrefetch) {
          unpack_raw(raw[i], v);
          src.weigh(row, v);
        } else {
          src.load(row, cl, cols, v);
        }
        uint32_t mb = 0;
#pragma unroll
        for (int j = 0; j < kFp8PerLane; ++j) mb = max(mb, abs_bits(v[j]));
        fp8_codes<E4M3>(v, mb < kFp8NonFinite ? fast : exact, w);
      }
      if (row < rows) store_codes<VEC>(q + row * q_stride, cl, cols, w);
      *reinterpret_cast<uint4*>(&tile[tq_word(r_in + 16 * i, 4 * s)]) =
          make_uint4(w[0], w[1], w[2], w[3]);
    }
    __syncthreads();
    const int64_t c = c0 + 4 * b, r = r0 + 16 * a;
    if (c >= cols || r >= rows) continue;
    uint32_t o[4][4];  // o[i][g]: column c + i, rows r + 4 g .. + 3 (one byte each)
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      uint32_t wd[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) wd[k] = tile[tq_word(16 * a + 4 * g + k, b)];
      const uint32_t lo01 = __byte_perm(wd[0], wd[1], 0x5140),
                     lo23 = __byte_perm(wd[2], wd[3], 0x5140);
      const uint32_t hi01 = __byte_perm(wd[0], wd[1], 0x7362),
                     hi23 = __byte_perm(wd[2], wd[3], 0x7362);
      o[0][g] = __byte_perm(lo01, lo23, 0x5410);
      o[1][g] = __byte_perm(lo01, lo23, 0x7632);
      o[2][g] = __byte_perm(hi01, hi23, 0x5410);
      o[3][g] = __byte_perm(hi01, hi23, 0x7632);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (c + i >= cols) break;
      uint8_t* out = q_t + (c + i) * rows + r;
      if (vec_t && r + 16 <= rows) {
        *reinterpret_cast<uint4*>(out) = make_uint4(o[i][0], o[i][1], o[i][2], o[i][3]);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j)
          if (r + j < rows) out[j] = static_cast<uint8_t>(o[i][j / 4] >> (8 * (j % 4)));
      }
    }
  }
}

template <bool E4M3>
__global__ void scale_from_amax_kernel(float* scale, const float* amax, bool pow2) {
  *scale = quant::scale_of(*amax, E4M3, pow2);  // (in place: the word holds the amax's bits)
}

// The four launches for any source; vec: 16-byte rows of the source and of
// q. codes_t: where given, launches the codes pass in its place (with the
// amax word and the grid). given: the amax, already on the device (then
// two launches: the codes, the scale).
template <typename S, typename SV, typename CodesT = std::nullptr_t>
void run_tensorwise(const RowMap& m, const S& src, const SV& src_vec, bool vec, int64_t rows,
                    int64_t cols, TensorView q, TensorView scale, bool e4m3, bool pow2,
                    cudaStream_t stream, CodesT codes_t = nullptr, const float* given = nullptr) {
  auto* own = static_cast<uint32_t*>(scale.data);
  const auto* word = given ? reinterpret_cast<const uint32_t*>(given) : own;
  const int64_t cap = int64_t{sm_count()} * 8;
  const unsigned grid =
      static_cast<unsigned>(std::max<int64_t>(1, std::min(cap, (rows + kWarps - 1) / kWarps)));
  auto* qd = static_cast<uint8_t*>(q.data);
  const int64_t qs = q.strides[0];
  if (!given) {
    MOEFLOW_CUDA_CHECK(cudaMemsetAsync(own, 0, sizeof(uint32_t), stream));
    if (vec)
      rows_amax_kernel<<<grid, kThreads, 0, stream>>>(m, src_vec, rows, cols, own);
    else
      rows_amax_kernel<<<grid, kThreads, 0, stream>>>(m, src, rows, cols, own);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
  const auto codes = [&](auto e4) {
    constexpr bool E4 = decltype(e4)::value;
    if constexpr (!std::is_same_v<CodesT, std::nullptr_t>)
      codes_t(e4, word, grid);
    else if (vec)
      rows_codes_kernel<SV, E4, true>
          <<<grid, kThreads, 0, stream>>>(m, src_vec, rows, cols, qd, qs, word, pow2);
    else
      rows_codes_kernel<S, E4, false>
          <<<grid, kThreads, 0, stream>>>(m, src, rows, cols, qd, qs, word, pow2);
    MOEFLOW_CUDA_LAUNCH_CHECK();
    scale_from_amax_kernel<E4><<<1, 1, 0, stream>>>(static_cast<float*>(scale.data),
                                                    reinterpret_cast<const float*>(word), pow2);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  };
  if (e4m3)
    codes(std::true_type{});
  else
    codes(std::false_type{});
}

RowMap row_map_of(const GroupLayout& g, int64_t num_groups) {
  if (!g.offsets.defined()) return RowMap{nullptr, nullptr, 0};
  return RowMap{g.offsets.data_ptr<int64_t>(),
                g.real_rows.defined() ? g.real_rows.data_ptr<int32_t>() : nullptr,
                static_cast<int>(num_groups)};
}

}  // namespace

namespace {

// quantize_group_rows, from the amax `given` on the device when not null.
void group_rows(const GroupLayout& groups, int64_t num_groups, TensorView x,
                const QuantizeConfig& config, TensorView q, TensorView scale, TensorView q_t,
                const float* given, cudaStream_t stream) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  const RowMap m = row_map_of(groups, num_groups);
  const bool e4m3 = config.out == DType::kFloat8E4M3;
  with_float_type(x.dtype, [&](auto t) {
    using T = decltype(t);
    const int64_t ld = x.strides[0];
    const bool vec = cols % 16 == 0 && aligned16(x.data) && (ld * int64_t{sizeof(T)}) % 16 == 0 &&
                     aligned16(q.data) && q.strides[0] % 16 == 0;
    const auto* xd = static_cast<const T*>(x.data);
    const RowsSource<T, false> src{xd, ld};
    const RowsSource<T, true> src_vec{xd, ld};
    if (!q_t.defined()) {
      run_tensorwise(m, src, src_vec, vec, rows, cols, q, scale, e4m3, config.pow2_scales, stream,
                     nullptr, given);
      return;
    }
    auto* qt = static_cast<uint8_t*>(q_t.data);
    const bool vec_t = aligned16(qt) && rows % 16 == 0;
    const auto codes_t = [&](auto e4, const uint32_t* word, unsigned) {
      constexpr bool E4 = decltype(e4)::value;
      const int64_t tiles = ((rows + kTqRows - 1) / kTqRows) * ((cols + kTqCols - 1) / kTqCols);
      const auto g = static_cast<unsigned>(
          std::max<int64_t>(1, std::min<int64_t>(int64_t{sm_count()} * 16, tiles)));
      auto* qd = static_cast<uint8_t*>(q.data);
      if (vec)
        rows_codes_t_kernel<T, E4, true><<<g, kTqThreads, 0, stream>>>(
            m, src_vec, rows, cols, qd, q.strides[0], qt, vec_t, word, config.pow2_scales);
      else
        rows_codes_t_kernel<T, E4, false><<<g, kTqThreads, 0, stream>>>(
            m, src, rows, cols, qd, q.strides[0], qt, vec_t, word, config.pow2_scales);
      MOEFLOW_CUDA_LAUNCH_CHECK();
    };
    run_tensorwise(m, src, src_vec, vec, rows, cols, q, scale, e4m3, config.pow2_scales, stream,
                   codes_t, given);
  });
}

}  // namespace

void quantize_group_rows(const GroupLayout& groups, int64_t num_groups, TensorView x,
                         const QuantizeConfig& config, TensorView q, TensorView scale,
                         TensorView q_t, cudaStream_t stream) {
  group_rows(groups, num_groups, x, config, q, scale, q_t, nullptr, stream);
}

void quantize_group_rows_with_amax(const GroupLayout& groups, int64_t num_groups, TensorView x,
                                   const QuantizeConfig& config, TensorView amax, TensorView q,
                                   TensorView scale, TensorView q_t, cudaStream_t stream) {
  group_rows(groups, num_groups, x, config, q, scale, q_t, amax.data_ptr<float>(), stream);
}

void mlp_activation_quantize_tensorwise(const MlpRows& r, TensorView h, TensorView probs,
                                        Activation act, const ActivationParams& ap, int il,
                                        bool e4m3, bool pow2, TensorView a_q, TensorView a_scale,
                                        TensorView a_q_t, cudaStream_t stream) {
  const RowMap m = row_map_of(r.groups, r.num_groups);
  const int64_t f = a_q.shape[1];
  const bool vec = f % 16 == 0 && aligned16(a_q.data) && a_q.strides[0] % 16 == 0 &&
                   aligned16(h.data) &&
                   (h.shape[1] * static_cast<int64_t>(dtype_size(h.dtype))) % 16 == 0 &&
                   (il == 0 || il % 16 == 0);
  const float* pp = probs.defined() ? probs.data_ptr<float>() : nullptr;
  with_activation(act, [&](auto A) {
    constexpr Activation kA = decltype(A)::value;
    const auto go = [&](auto tag) {
      using T = decltype(tag);
      const ActSource<T, kA> src{h.data_ptr<T>(), h.shape[1], pp, ap, il};
      const ActSource<T, kA, true> src_vec{h.data_ptr<T>(), h.shape[1], pp, ap, il};
      if (!a_q_t.defined()) {
        run_tensorwise(m, src, src_vec, vec, r.rows, f, a_q, a_scale, e4m3, pow2, stream);
        return;
      }
      const int64_t rows = r.rows;
      auto* qd = static_cast<uint8_t*>(a_q.data);
      auto* qt = static_cast<uint8_t*>(a_q_t.data);
      const bool vec_t = aligned16(qt) && rows % 16 == 0;
      const auto codes_t = [&](auto e4, const uint32_t* word, unsigned) {
        constexpr bool E4 = decltype(e4)::value;
        const int64_t tiles = ((rows + kTqRows - 1) / kTqRows) * ((f + kTqCols - 1) / kTqCols);
        const auto g = static_cast<unsigned>(
            std::max<int64_t>(1, std::min<int64_t>(int64_t{sm_count()} * 16, tiles)));
        if (vec)
          rows_codes_t_kernel<T, E4, true><<<g, kTqThreads, 0, stream>>>(
              m, src_vec, rows, f, qd, a_q.strides[0], qt, vec_t, word, pow2);
        else
          rows_codes_t_kernel<T, E4, false><<<g, kTqThreads, 0, stream>>>(
              m, src, rows, f, qd, a_q.strides[0], qt, vec_t, word, pow2);
        MOEFLOW_CUDA_LAUNCH_CHECK();
      };
      run_tensorwise(m, src, src_vec, vec, rows, f, a_q, a_scale, e4m3, pow2, stream, codes_t);
    };
    if (h.dtype == DType::kBFloat16)
      go(__nv_bfloat16{});
    else
      go(__half{});
  });
}

void permute_quantize_tensorwise(TensorView x, const RoutingPlan& plan, TensorView weights,
                                 TensorView y, TensorView scale, TensorView y_t,
                                 const QuantizeConfig& config, TensorView probs,
                                 TensorView permuted_probs, cudaStream_t stream) {
  const int64_t rows = plan.capacity_rows, tokens = x.shape[0], cols = x.shape[1];
  const int k_slots = plan.topk;
  const RowMap m = row_map_of(GroupLayout::from_plan(plan), plan.num_experts());
  const auto* row_token = plan.row_token.data_ptr<int32_t>();
  const auto* row_k = plan.row_k.data_ptr<int32_t>();
  if (permuted_probs.defined() && rows > 0) {
    const auto g = static_cast<unsigned>(
        std::max<int64_t>(1, std::min<int64_t>(int64_t{sm_count()} * 4, (rows + 255) / 256)));
    row_probs_kernel<<<g, 256, 0, stream>>>(m, row_token, row_k, probs.data_ptr<float>(), k_slots,
                                            rows, permuted_probs.data_ptr<float>());
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
  const float* w = weights.defined() ? weights.data_ptr<float>() : nullptr;
  const bool e4m3 = config.out == DType::kFloat8E4M3, pow2 = config.pow2_scales;
  auto* word = static_cast<uint32_t*>(scale.data);
  auto* yd = static_cast<uint8_t*>(y.data);
  const int64_t ys = y.strides[0];
  with_float_type(x.dtype, [&](auto t) {
    using T = decltype(t);
    const int64_t ld = x.strides[0];
    const auto* xd = static_cast<const T*>(x.data);
    const bool vec = cols % 16 == 0 && aligned16(x.data) && (ld * int64_t{sizeof(T)}) % 16 == 0 &&
                     aligned16(y.data) && ys % 16 == 0;
    MOEFLOW_CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(uint32_t), stream));
    const int64_t cap = int64_t{sm_count()} * 8;
    const auto grid_of = [&](int64_t n) {
      return static_cast<unsigned>(std::max<int64_t>(1, std::min(cap, (n + kWarps - 1) / kWarps)));
    };
    const int64_t* dest = plan.dest_row.data_ptr<int64_t>();
    if (vec)
      tokens_amax_kernel<T, true>
          <<<grid_of(tokens), kThreads, 0, stream>>>(xd, ld, dest, w, k_slots, tokens, cols, word);
    else
      tokens_amax_kernel<T, false>
          <<<grid_of(tokens), kThreads, 0, stream>>>(xd, ld, dest, w, k_slots, tokens, cols, word);
    MOEFLOW_CUDA_LAUNCH_CHECK();
    const GatherSource<T, false> src{xd, ld, row_token, row_k, w, k_slots};
    const GatherSource<T, true> src_vec{xd, ld, row_token, row_k, w, k_slots};
    const auto codes = [&](auto e4) {
      constexpr bool E4 = decltype(e4)::value;
      if (y_t.defined()) {
        auto* qt = static_cast<uint8_t*>(y_t.data);
        const bool vec_t = aligned16(qt) && rows % 16 == 0;
        const int64_t tiles = ((rows + kTqRows - 1) / kTqRows) * ((cols + kTqCols - 1) / kTqCols);
        const auto g = static_cast<unsigned>(
            std::max<int64_t>(1, std::min<int64_t>(int64_t{sm_count()} * 16, tiles)));
        if (vec)
          rows_codes_t_kernel<T, E4, true>
              <<<g, kTqThreads, 0, stream>>>(m, src_vec, rows, cols, yd, ys, qt, vec_t, word, pow2);
        else
          rows_codes_t_kernel<T, E4, false>
              <<<g, kTqThreads, 0, stream>>>(m, src, rows, cols, yd, ys, qt, vec_t, word, pow2);
      } else if (vec) {
        rows_codes_kernel<GatherSource<T, true>, E4, true>
            <<<grid_of(rows), kThreads, 0, stream>>>(m, src_vec, rows, cols, yd, ys, word, pow2);
      } else {
        rows_codes_kernel<GatherSource<T, false>, E4, false>
            <<<grid_of(rows), kThreads, 0, stream>>>(m, src, rows, cols, yd, ys, word, pow2);
      }
      MOEFLOW_CUDA_LAUNCH_CHECK();
      scale_from_amax_kernel<E4><<<1, 1, 0, stream>>>(static_cast<float*>(scale.data),
                                                      static_cast<const float*>(scale.data), pow2);
      MOEFLOW_CUDA_LAUNCH_CHECK();
    };
    if (e4m3)
      codes(std::true_type{});
    else
      codes(std::false_type{});
  });
}

}  // namespace moeflow::cuda
