// Epilogue functors of the TMA grouped GEMM (tma/kernel.cuh): what each
// output element is (identity, the fused FC1, the fused dGLU).
//
// A consumer warpgroup holds a 64 x 256 float32 accumulator fragment: thread
// (warp, lane) owns rows warp*16 + lane/4 (+8 for half 1) and columns
// 8j + 2(lane%4) (+1), j = 0..31, in acc[4j + 2*half + {0,1}]. The epilogue
// turns it into kOutCols output columns per 256-column tile, 8 per fragment
// column j_out, two at a time:
//
//   float2 value(acc, j_out, half, out_col, tile) -> outputs (out_col, out_col+1)
//
// out_col is the global output column, `t` the tile state that load_tile()
// read when the tile started (e.g. the bias and the rows' probabilities). Rows
// past a group's data rows get zeros without calling the functor. With
// save_raw() the kernel also stores the tile's pre-activation values
// (raw_value(), 256 columns) to a second output at raw_col().
#pragma once

#include "core/activations.h"
#include "cuda/common.cuh"

namespace moeflow::cuda::gemm::sm90tma {

// An activation as a compile-time tag: dispatch_activation() branches once
// (per tile) and calls f(ActTag<A>{}), so each instantiation of f holds one
// activation's code. GATED: SwiGLU / GeGLU / clamped quick-GeGLU, else
// GELU / ReLU / squared ReLU.
template <Activation A>
struct ActTag {};
template <bool GATED, typename F>
__device__ __forceinline__ void dispatch_activation(Activation act, F&& f) {
  if constexpr (GATED) {
    switch (act) {
      case Activation::kGeGLU:
        return f(ActTag<Activation::kGeGLU>{});
      case Activation::kClampedQuickGeGLU:
        return f(ActTag<Activation::kClampedQuickGeGLU>{});
      default:
        return f(ActTag<Activation::kSwiGLU>{});
    }
  } else {
    switch (act) {
      case Activation::kRelu:
        return f(ActTag<Activation::kRelu>{});
      case Activation::kSquaredRelu:
        return f(ActTag<Activation::kSquaredRelu>{});
      default:
        return f(ActTag<Activation::kGelu>{});
    }
  }
}

// Router probabilities of a warpgroup's 64 rows for the helper warps
// (helper-mode epilogues): each consumer thread loads those of its two rows
// (rl, rl + 8) when the tile starts; after the main loop the threads of lane
// % 4 == 0 put them in shared memory, where the helpers read them. (Read from
// global memory inside the helpers' loop, the load latency of every 16-byte
// piece serialised their work and held the consumers up.)
__device__ __forceinline__ void load_row_probs(const float* probs, float (&pr)[2], int64_t wg_row0,
                                               int rl, int data_rows) {
  pr[0] = probs != nullptr && rl < data_rows ? probs[wg_row0 + rl] : 1.0f;
  pr[1] = probs != nullptr && rl + 8 < data_rows ? probs[wg_row0 + rl + 8] : 1.0f;
}
__device__ __forceinline__ void stage_row_probs(float* sm, const float (&pr)[2], int rl, int lane) {
  if (lane % 4 == 0) {
    sm[rl] = pr[0];
    sm[rl + 8] = pr[1];
  }
}
constexpr int kRowProbSmem = 64 * 4;  // bytes per warpgroup

// The router probabilities of the helper-mode epilogues (EpiMlpFc1,
// EpiMlpDglu): loaded per thread at tile start into Tile::prob, staged by the
// consumers, read by the helpers from shared memory (sm: the warpgroup's
// kRowProbSmem bytes of the bias area, which helper mode does not use for the
// bias).
struct RowProbs {
  const float* probs = nullptr;  // [rows] float32, or null
  template <typename Tile>
  __device__ __forceinline__ void stage_probs(float* sm, const Tile& t, int rl, int lane) const {
    if (probs != nullptr) stage_row_probs(sm, t.prob, rl, lane);
  }
  __device__ __forceinline__ float staged_prob(const float* sm, int r) const {
    return probs != nullptr ? sm[r] : 1.0f;
  }
};

// C = accumulator (the plain grouped GEMM).
struct EpiIdentity {
  static constexpr int kOutCols = 256;
  static constexpr bool kSplitB = false;  // B tile from one 256-row box
  // Helper mode: the consumer warpgroups stage the accumulators (as raw
  // values) and the producer warpgroup's spare warps apply the activation
  // and store (tma/epilogue.cuh).
  static constexpr bool kHelperAct = false;
  static constexpr bool kDglu = false;  // helper mode runs the dGLU (EpiMlpDglu)
  // Helper mode: the consumers add the bias to the accumulators
  static constexpr bool kConsumerBias = false;
  // What a tile's epilogue needs from global memory, loaded when the tile
  // starts so that the loads' latency hides behind its main loop.
  struct Tile {};
  static constexpr int kBiasSmem = 0;  // shared-memory bytes per warpgroup for the bias
  __device__ __forceinline__ Tile load_tile(int, int, int, int, int64_t, int, int) const {
    return {};
  }
  __device__ __forceinline__ bool has_bias() const { return false; }
  __device__ __forceinline__ void stage_bias(uint32_t*, const Tile&, int) const {}
  __device__ __forceinline__ void finish(float (&)[128], const uint32_t*, int) const {}
  struct Only {};
  template <typename F>
  __device__ __forceinline__ void dispatch(F&& f) const {
    f(Only{});
  }
  __device__ __forceinline__ float2 value(Only, const float (&acc)[128], int j, int half, int64_t,
                                          int, const Tile&) const {
    return make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
  }
  __device__ __forceinline__ bool save_raw() const { return false; }
  __device__ __forceinline__ float2 raw_value(const float (&acc)[128], int j, int half, int64_t,
                                              int) const {
    return value(Only{}, acc, j, half, 0, 0, Tile{});
  }
  __device__ __forceinline__ int raw_col(int, int) const { return 0; }
  __device__ __forceinline__ void* raw_ptr() const { return nullptr; }
};

// FC1 of the expert MLP: bias, activation (gated: GLU of a gate and an up
// column) and the router-probability scale, fused. The FC1 weight rows of
// expert e are [gate; up] halves (split_rows = F: the producer loads the gate
// and up rows of a tile as two 128-row boxes, so the tile holds gate columns
// 0..127 and their up columns 128..255) or interleaved blocks of `il` gate
// rows then `il` up rows (il in {8,16,32,64,128}; blocks stay inside a tile).
// Not gated: out = f(acc + bias) over the 256 columns.
// KIND: kPlain (not gated), kHalves (GLU, [gate; up] halves), kInterleaved (GLU).
enum Fc1Kind : int { kPlain = 0, kHalves = 1, kInterleaved = 2 };

template <typename TOut, int KIND>
struct EpiMlpFc1 : RowProbs {
  static_assert(sizeof(TOut) == 2, "the fused FC1 writes 16-bit outputs");
  static constexpr bool GATED = KIND != kPlain;
  static constexpr bool halves = KIND == kHalves;
  static constexpr int kOutCols = GATED ? 128 : 256;
  static constexpr bool kSplitB = halves;  // gate and up rows loaded as two 128-row boxes
  // Halves and plain: activation chunk q is computed in place over the staged
  // pre-activation chunk q (with its up chunk q + 2), by the helper warps.
  static constexpr bool kHelperAct = KIND != kInterleaved;
  static constexpr bool kDglu = false;
  // Helper mode: the consumers add the bias to the accumulators before
  // staging (one rounding of the sum; cheaper than an in-place bias pass of
  // the helpers over the staged tile).
  static constexpr bool kConsumerBias = kHelperAct;
  Activation act = Activation::kSwiGLU;
  ActivationParams ap;
  int64_t f = 0;               // F: activation columns (the gated FC1 has 2F rows)
  int il8 = 16;                // gated: interleave block in fragment columns (il / 8); halves: 16
  const TOut* bias = nullptr;  // [E, N1] in weight-row order, or null
  TOut* raw = nullptr;         // [rows, N1] pre-activation (with bias) output, or null

  // Weight row (= FC1 output column) of the gate / up of activation column c.
  __device__ __forceinline__ int64_t gate_row(int64_t c) const {
    if (!GATED) return c;
    return halves ? c : (c / (il8 * 8)) * (il8 * 16) + c % (il8 * 8);
  }
  __device__ __forceinline__ int64_t up_row(int64_t c) const {
    return halves ? c + f : gate_row(c) + il8 * 8;
  }
  // FC1 output column of tile column tc (0..255) of tile t (halves: gate
  // columns 0..127, their up columns 128..255), and whether it exists.
  __device__ __forceinline__ int64_t n1_col(int t, int tc, bool& ok) const {
    if constexpr (halves) {
      const int64_t c = int64_t{t} * 128 + (tc & 127);
      ok = c < f;
      return tc < 128 ? c : c + f;
    } else {
      const int64_t c = int64_t{t} * 256 + tc;
      ok = c < (GATED ? 2 * f : f);
      return c;
    }
  }
  // Per tile and thread: the probabilities of its two rows and one column
  // pair of the tile's bias, loaded when the tile starts so that the loads'
  // latency hides behind the main loop. After the main loop the warpgroup
  // puts the 128 pairs into shared memory (stage_bias), laid out so that each
  // thread reads the 32 pairs it adds (columns 8j + 2(lane%4) + {0,1}) as
  // eight 16-byte loads: pair (q = lane%4, j) at word q*36 + j (the padding
  // keeps the four q rows on different banks). Read straight from global
  // memory, the 32 loads per thread ran one after another (the accumulators
  // leave no registers to batch them) and cost up to 14 % on small-K shapes.
  struct Tile {
    float prob[2];
    uint32_t bias_pair;
  };
  static constexpr int kBiasPairsSmem = 4 * 36 * 4;
  // helper mode (the consumers add the bias): the rows' probabilities, then
  // the bias pairs twice (tiles alternate, so one barrier per tile)
  static constexpr int kBiasSmem =
      kConsumerBias ? kRowProbSmem + 2 * kBiasPairsSmem : kBiasPairsSmem;
  __device__ __forceinline__ bool has_bias() const { return bias != nullptr; }
  __device__ __forceinline__ int64_t n1() const { return GATED ? 2 * f : f; }
  // wg_row0: the global row of the warpgroup's first row; rl: the thread's
  // first row in it; data_rows: rows of the warpgroup's 64 that hold data.
  // With an even row length (always when gated) a column pair is one aligned
  // 4-byte load (the host checks the bias's alignment), otherwise two 2-byte loads.
  __device__ __forceinline__ Tile load_tile(int group, int n0, int tid, int, int64_t wg_row0,
                                            int rl, int data_rows) const {
    Tile t;
    load_row_probs(probs, t.prob, wg_row0, rl, data_rows);
    t.bias_pair = 0;
    if (bias == nullptr) return t;
    const TOut* b = bias + int64_t{group} * n1();
    bool ok0, ok1;
    const int64_t c = n1_col(n0 / 256, 2 * tid, ok0);
    n1_col(n0 / 256, 2 * tid + 1, ok1);
    Pack<TOut, 2> p;
    if (ok1 && (GATED || f % 2 == 0)) {
      p = *reinterpret_cast<const Pack<TOut, 2>*>(b + c);
    } else {
      p.v[0] = ok0 ? b[c] : from_float<TOut>(0.0f);
      p.v[1] = ok1 ? b[c + 1] : from_float<TOut>(0.0f);
    }
    t.bias_pair = *reinterpret_cast<const uint32_t*>(&p);
    return t;
  }
  // Thread tid holds tile columns 2 tid, 2 tid + 1: pair (q = tid % 4, j = tid / 4).
  __device__ __forceinline__ void stage_bias(uint32_t* sb, const Tile& t, int tid) const {
    sb[(tid % 4) * 36 + tid / 4] = t.bias_pair;
  }
  // The bias is added to the accumulators once the tile's last wgmma has
  // completed (as a start value it would serialise the wgmma pipeline: ptxas
  // C7515), so raw = acc is the pre-activation FC1 output.
  __device__ __forceinline__ void finish(float (&acc)[128], const uint32_t* sb, int lane) const {
    if (bias == nullptr) return;
    const uint4* row = reinterpret_cast<const uint4*>(sb + (lane % 4) * 36);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint4 w = row[i];
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        Pack<TOut, 2> p;
        *reinterpret_cast<uint32_t*>(&p) = words[k];
        const int j = 4 * i + k;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = to_float(p.v[e]);
          acc[4 * j + e] += v;
          acc[4 * j + 2 + e] += v;
        }
      }
    }
  }
  // Tile fragment column of the gate of output fragment column j (0..15) for
  // interleave blocks of IL fragments: a constant once j is.
  template <int IL>
  __device__ __forceinline__ static constexpr int gate_frag(int j) {
    return (j / IL) * 2 * IL + j % IL;
  }
  // acc[4 * (gate fragment + d * il8) + o], d = 0 gate, 1 up. The interleave
  // is a runtime value, so every candidate index is kept a compile-time
  // constant (the accumulators must stay in registers) and a switch picks one.
  __device__ __forceinline__ float pick(const float (&acc)[128], int j, int o, int d) const {
    if constexpr (halves) {
      return acc[4 * (j + 16 * d) + o];
    } else {
      switch (il8) {
        case 1:
          return acc[4 * (gate_frag<1>(j) + d * 1) + o];
        case 2:
          return acc[4 * (gate_frag<2>(j) + d * 2) + o];
        case 4:
          return acc[4 * (gate_frag<4>(j) + d * 4) + o];
        case 8:
          return acc[4 * (gate_frag<8>(j) + d * 8) + o];
        default:
          return acc[4 * (gate_frag<16>(j) + d * 16) + o];
      }
    }
  }
  // The activation as a compile-time variant: dispatch() branches once per
  // tile and value() of that variant holds one activation's code.
  template <Activation A>
  using Act = ActTag<A>;
  template <typename F>
  __device__ __forceinline__ void dispatch(F&& f) const {
    dispatch_activation<GATED>(act, f);
  }
  template <Activation A>
  __device__ __forceinline__ float2 value(Act<A>, const float (&acc)[128], int j, int half,
                                          int64_t col, int group, const Tile& t) const {
    // from the pre-activation values rounded as they are stored (as the
    // helper warps, the backward and the CPU reference take them)
    auto rounded = [](float v) { return to_float(from_float<TOut>(v)); };
    float out[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if constexpr (GATED)
        out[e] = act_forward(A, rounded(pick(acc, j, 2 * half + e, 0)),
                             rounded(pick(acc, j, 2 * half + e, 1)), ap) *
                 t.prob[half];
      else
        out[e] = act_forward(A, rounded(acc[4 * j + 2 * half + e]), 0.0f, ap) * t.prob[half];
    }
    return make_float2(out[0], out[1]);
  }
  // Helper mode: one output from the staged (rounded) pre-activation values.
  template <Activation A>
  __device__ __forceinline__ float act_value(Act<A>, float g, float u, float prob) const {
    return act_forward(A, g, u, ap) * prob;
  }
  __device__ __forceinline__ bool save_raw() const {
    return raw != nullptr;
  }
  __device__ __forceinline__ void* raw_ptr() const {
    return raw;
  }
  // Pre-activation value (bias included) of tile fragment column j (0..31).
  __device__ __forceinline__ float2 raw_value(const float (&acc)[128], int j, int half, int64_t,
                                              int) const {
    return make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
  }
  // FC1 output column of the first column of 64-column chunk q (0..3) of tile t.
  __device__ __forceinline__ int raw_col(int t, int q) const {
    if (halves) return q < 2 ? t * 128 + q * 64 : static_cast<int>(f) + t * 128 + (q - 2) * 64;
    return t * 256 + q * 64;
  }
};

// FC2 dgrad of the expert MLP with the dGLU fused (helper mode only): the
// consumer warpgroups stage d(a) (the GEMM's output tile, 256 columns of F,
// rounded to the output type as the unfused path stores it) and the helper
// warps turn it into d(h) = (d gate, d up) with the saved pre-activation h,
// writing d_h [rows, N1] directly and, with probs, each row's partial
// <d(a), act(h)> over the tile's columns into part[row * part_ld + tile]
// (summed over the tiles in order afterwards: deterministic). Pad rows get
// zeros. Needs F % 16 == 0.
template <typename TOut, int KIND>
struct EpiMlpDglu : RowProbs {
  static_assert(sizeof(TOut) == 2, "the fused dGLU reads 16-bit values");
  static constexpr bool GATED = KIND != kPlain;
  static constexpr int kOutCols = 256;
  static constexpr bool kSplitB = false;
  static constexpr bool kHelperAct = true;
  static constexpr bool kDglu = true;
  static constexpr bool kConsumerBias = false;
  static constexpr int kBiasSmem = kRowProbSmem;  // no bias: the rows' probabilities
  Activation act = Activation::kSwiGLU;
  ActivationParams ap;
  int64_t f = 0;            // F
  int il = 0;               // interleave (gated; 0 = halves)
  const TOut* h = nullptr;  // [rows, N1] pre-activation (bias included)
  TOut* d_h = nullptr;      // [rows, N1] out
  float* part = nullptr;    // partial dprobs, or null
  int64_t part_ld = 0;

  struct Tile {
    float prob[2];
  };
  __device__ __forceinline__ Tile load_tile(int, int, int, int, int64_t wg_row0, int rl,
                                            int data_rows) const {
    Tile t;
    load_row_probs(probs, t.prob, wg_row0, rl, data_rows);
    return t;
  }
  __device__ __forceinline__ bool has_bias() const { return false; }
  __device__ __forceinline__ void stage_bias(uint32_t*, const Tile&, int) const {}
  __device__ __forceinline__ void finish(float (&)[128], const uint32_t*, int) const {}
  __device__ __forceinline__ int64_t n1() const { return GATED ? 2 * f : f; }
  __device__ __forceinline__ int64_t gate_col(int64_t j) const {
    return GATED ? glu_gate_col(j, il) : j;
  }
  __device__ __forceinline__ int64_t up_col(int64_t j) const { return glu_up_col(j, il, f); }
  __device__ __forceinline__ float2 raw_value(const float (&acc)[128], int j, int half, int64_t,
                                              int) const {
    return make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
  }
  __device__ __forceinline__ bool save_raw() const { return false; }
  __device__ __forceinline__ void* raw_ptr() const { return nullptr; }
  __device__ __forceinline__ int raw_col(int, int) const { return 0; }
  template <Activation A>
  using Act = ActTag<A>;
  template <typename F>
  __device__ __forceinline__ void dispatch(F&& f) const {
    dispatch_activation<GATED>(act, f);
  }
  // One 8-column piece of row `row`, d(a) columns j0..j0+7 from `da` (the
  // staged values): writes d(h) and returns the piece's <d(a), act(h)>.
  // data: the row holds data (else zeros are written).
  template <Activation A>
  __device__ __forceinline__ float dglu8(Act<A>, int64_t row, int64_t j0, const Pack<TOut, 8>& da,
                                         bool data, float prob) const {
    using V = Pack<TOut, 8>;
    const int64_t base = row * n1();
    V g{}, u{};
    if (data) {  // read-only path: h is never written by this kernel
      const uint4 gw = __ldg(reinterpret_cast<const uint4*>(h + base + gate_col(j0)));
      g = *reinterpret_cast<const V*>(&gw);
      if constexpr (GATED) {
        const uint4 uw = __ldg(reinterpret_cast<const uint4*>(h + base + up_col(j0)));
        u = *reinterpret_cast<const V*>(&uw);
      }
    }
    float dp = 0.0f;
    V dg, du;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float dgv = 0.0f, duv = 0.0f;
      if (data) {
        const float gv = to_float(g.v[i]), uv = GATED ? to_float(u.v[i]) : 0.0f;
        const float dav = to_float(da.v[i]);
        dp += dav * act_forward(A, gv, uv, ap);
        act_backward(A, gv, uv, dav * prob, ap, &dgv, &duv);
      }
      dg.v[i] = from_float<TOut>(dgv);
      du.v[i] = from_float<TOut>(duv);
    }
    *reinterpret_cast<V*>(d_h + base + gate_col(j0)) = dg;
    if constexpr (GATED) *reinterpret_cast<V*>(d_h + base + up_col(j0)) = du;
    return dp;
  }
};

}  // namespace moeflow::cuda::gemm::sm90tma
