// Host side of the CUDA grouped GEMM: maps forward / dgrad / wgrad (and the
// grouped MLP's fused FC1 and dGLU) onto the kernels of portable.cuh,
// sm90_cpasync.cuh and tma/kernel.cuh (the FP8 GEMMs: grouped_gemm_fp8.cu), picks the kernel from the call's
// GemmOptions, builds the TMA tensor maps, sizes the persistent grid from the
// occupancy of the GPU and launches.
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstring>

#include "core/backends.h"
#include "core/mlp_call.h"
#include "cuda/gemm/host.cuh"
#include "cuda/gemm/portable.cuh"
#include "cuda/gemm/sm90_cpasync.cuh"
#include "cuda/gemm/tma/kernel.cuh"

namespace moeflow::cuda {

namespace {

using gemm::Params;
using namespace gemm::host;

// The tuned defaults of GemmOptions (moeflow/tuning.h; figures in
// docs/performance.md). K slices by which consumer warpgroup 1 of the TMA
// kernel trails consumer 0 (0 = lockstep).
constexpr int kDefaultStagger = 1;
// Thousands of cycles by which block b of the TMA kernel starts (b % 8) x
// this late (wgrad / forward).
constexpr int kDefaultDesyncWgrad = 4;
constexpr int kDefaultDesync = 0;
// Helper mode: K slices during which the pipeline ring skips the stage that
// holds the previous tile's staged chunks (three stages in flight), after
// which the producer waits for the helpers to release it and the ring has
// all four again; tiles of few slices skip it for fewer.
constexpr int kDefaultHold = 20;
constexpr int kDefaultHoldTail = 16;  // slices at a tile's end that always have every stage
int default_hold(int64_t k_red) {
  const int64_t slices = (k_red + 63) / 64;
  return static_cast<int>(
      std::min<int64_t>(kDefaultHold, std::max<int64_t>(0, slices - kDefaultHoldTail)));
}

// The TMA path (MODE as in tma/kernel.cuh): the B matrix one
// tensor (stacked weights; the activations for wgrad), indices within int32.
template <typename TIn, typename TOut, int MODE, typename Epi = gemm::sm90tma::EpiIdentity>
bool launch_tma(const Params& p, const GemmOptions& o, cudaStream_t stream, const Epi& epi = {}) {
  constexpr bool kFused = !std::is_same_v<Epi, gemm::sm90tma::EpiIdentity> && !Epi::kDglu;
  namespace t = gemm::sm90tma;
  if (MODE != 2 && (p.b_ptrs != nullptr || p.b == nullptr)) return false;
  const int64_t w_rows =
      MODE == 2 ? p.rows : int64_t{p.num_groups} * (MODE == 1 ? p.k_red : p.n_out);
  if (p.rows >= (int64_t{1} << 31) || w_rows >= (int64_t{1} << 31)) return false;
  if (p.rows == 0 || p.n_out == 0 || (MODE == 2 ? p.m_out : p.k_red) == 0)
    return false;  // maps need extents > 0
  ensure_current_context();
  CUtensorMap map_a, map_w, map_c, map_raw;
  std::memset(&map_raw, 0, sizeof(map_raw));
  if (MODE == 0) {  // A [rows,K] in 128 x 64 boxes; W as [E*N, K] in 256 x 64 boxes
    // (gathered rows: A is read by cp.async, this map is not used)
    map_a = tensor_map_2d(p.a, p.rows, p.k_red, p.lda, t::kTileM);
    // (fused GLU halves: two 128-row boxes per tile, gate rows then up rows)
    map_w = tensor_map_2d(p.b, w_rows, p.k_red, p.ldb, Epi::kSplitB ? t::kTileN / 2 : t::kTileN);
  } else if (MODE == 1) {  // dC [rows,N] in 128 x 64 boxes; W as [E*N, K] in 64 x 64 boxes
    map_a = tensor_map_2d(p.a, p.rows, p.k_red, p.lda, t::kTileM);
    map_w = tensor_map_2d(p.b, w_rows, p.n_out, p.ldb, 64);
  } else {  // dC [rows,N] and A [rows,K], both in 64 x 64 boxes
    map_a = tensor_map_2d(p.a, p.rows, p.m_out, p.lda, 64);
    map_w = tensor_map_2d(p.b, p.rows, p.n_out, p.ldb, 64);
  }
  // The output, in boxes of 64 rows x 128 bytes: C [rows, n_out] (forward,
  // dgrad) or the stacked dW [E, N, K] (wgrad; none for pointers).
  constexpr int kCw = 128 / static_cast<int>(sizeof(TOut));
  t::StoreKind kind = t::StoreKind::kDirect;
  std::memset(&map_c, 0, sizeof(map_c));
  const bool direct_only = o.kernel == GemmKernel::kTmaDirectStore;
  const bool c_aligned = addr_of(p.c) % 16 == 0 && (p.ldc * int64_t{sizeof(TOut)}) % 16 == 0;
  if (!direct_only && c_aligned) {
    if (MODE == 2 && p.c_ptrs == nullptr) {
      const int64_t plane = p.c_group_stride * int64_t{sizeof(TOut)};
      map_c = tensor_map<3>(p.c, tma_dtype<TOut>(), {p.n_out, p.m_out, int64_t{p.num_groups}},
                            {p.ldc * int64_t{sizeof(TOut)}, plane}, {kCw, 64, 1});
      kind = t::StoreKind::kTensor3d;
    } else if (MODE != 2 && !p.accumulate) {
      const int64_t out_cols = p.n_store > 0 ? p.n_store : p.n_out;
      map_c = tensor_map<2>(p.c, tma_dtype<TOut>(), {out_cols, p.rows},
                            {p.ldc * int64_t{sizeof(TOut)}}, {kCw, 64});
      kind = t::StoreKind::kTensor2d;
    }
  }
  if constexpr (kFused) {
    if (epi.raw != nullptr) {  // the pre-activation output [rows, n_out], contiguous
      MOEFLOW_CHECK(kind == t::StoreKind::kTensor2d || direct_only,
                    "fused FC1: outputs must be 16-byte aligned");
      if (kind == t::StoreKind::kTensor2d)
        map_raw = tensor_map<2>(epi.raw, tma_dtype<TOut>(), {p.n_out, p.rows},
                                {p.n_out * int64_t{sizeof(TOut)}}, {kCw, 64});
    }
  }
  auto kernel = t::grouped_gemm_tma_kernel<TIn, TOut, MODE, Epi, false>;
  if constexpr (MODE == 0 && std::is_same_v<Epi, t::EpiIdentity>) {
    if (p.a_rows != nullptr) kernel = t::grouped_gemm_tma_kernel<TIn, TOut, MODE, Epi, true>;
  } else {
    MOEFLOW_CHECK(p.a_rows == nullptr, "gathered A rows apply to the plain forward only");
  }
  const size_t limit = max_dynamic_smem(kernel);
  // Pipeline stages and staging buffers per warpgroup: the tuned default (4, 2)
  // unless the options ask otherwise; fewer stages when the group table
  // leaves no room.
  const int want_stages = o.stages, want_bufs = o.bufs;
  int stages = want_stages > 0 ? std::min(want_stages, t::kMaxStages) : t::kMaxStages;
  // Helper mode stages the four 64-column chunks of a warpgroup's tile in the
  // stage of the tile's last K slice plus 16 KB of its own (HelperChunks), so
  // four stages fit.
  const int bufs = Epi::kHelperAct ? 4 : want_bufs > 0 ? std::clamp(want_bufs, 2, t::kMaxBufs) : 2;
  const int chunks = t::staging_chunks<Epi>(bufs);
  while (stages > 2 && t::Smem::bytes(stages, chunks, p.num_groups, Epi::kBiasSmem) > limit)
    --stages;
  const size_t smem = t::Smem::bytes(stages, chunks, p.num_groups, Epi::kBiasSmem);
  if (smem > limit) return false;
  MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  // Consumer 1 lags consumer 0 by this many K slices (at most stages - 1).
  const int want_stagger = o.stagger;
  const int stagger = std::min(want_stagger >= 0 ? want_stagger : kDefaultStagger, stages - 1);
  const int want_desync = o.desync;
  const int desync =
      want_desync >= 0 ? want_desync : (MODE == 2 ? kDefaultDesyncWgrad : kDefaultDesync);
  // Helper mode: K slices during which the ring skips the stage the helpers
  // hold (StageRing).
  const int want_hold = o.hold;
  const int hold = want_hold >= 0 ? want_hold : default_hold(p.k_red);
  kernel<<<sm_count(), t::kThreads, smem, stream>>>(p, map_a, map_w, map_c, map_raw, stages, bufs,
                                                    stagger, desync, hold, kind, epi);
  MOEFLOW_CUDA_LAUNCH_CHECK();
  return true;
}

template <int TN, typename TIn, typename TOut>
void launch_sm90_tile(const Params& p, cudaStream_t stream) {
  using Cfg = gemm::sm90::Config<TN>;
  const auto kernel = gemm::sm90::grouped_gemm_sm90_kernel<TN, TIn, TOut, gemm::EpilogueIdentity>;
  const size_t smem = Cfg::bytes(p.num_groups);
  MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  int per_sm = 0;
  MOEFLOW_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, gemm::sm90::kThreads, smem));
  MOEFLOW_CHECK(per_sm > 0, "sm90 grouped GEMM does not fit (", smem, " bytes of shared memory)");
  kernel<<<per_sm * sm_count(), gemm::sm90::kThreads, smem, stream>>>(p, gemm::EpilogueIdentity{});
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

template <typename TIn, typename TOut>
void launch_sm90(const Params& p, const GemmOptions& o, cudaStream_t stream) {
  const GemmKernel path = o.kernel;
  if (path == GemmKernel::kSm90Narrow) return launch_sm90_tile<128, TIn, TOut>(p, stream);
  if ((path == GemmKernel::kAuto || path == GemmKernel::kTmaDirectStore) &&
      launch_tma<TIn, TOut, 0>(p, o, stream))
    return;
  launch_sm90_tile<256, TIn, TOut>(p, stream);
}

void check_rows16(const TensorView& v, const char* name) {
  MOEFLOW_CHECK(v.strides[0] % 8 == 0 && addr_of(v.data) % 16 == 0, name,
                " rows must be 16-byte aligned (row stride a multiple of 8 elements), got stride ",
                v.strides[0]);
}

// wgrad (A and B MN-major) writes a float32 dW or one of the inputs' dtype
// (the same float32 accumulation either way, rounded once in the epilogue);
// other pairs are not instantiated.
template <typename TIn, typename TOut, bool A_KMAJOR, bool B_KMAJOR>
void launch(const Params& p, const GemmOptions& o, cudaStream_t stream) {
  if constexpr (!A_KMAJOR && !std::is_same_v<TOut, float> && !std::is_same_v<TOut, TIn>) {
    (void)p;
    (void)o;
    (void)stream;
    MOEFLOW_CHECK(false, "grouped GEMM wgrad writes float32 or the inputs' dtype");
  } else {
    if constexpr (A_KMAJOR && B_KMAJOR) {  // forward: both operands K-major
      if (use_sm90(o)) return launch_sm90<TIn, TOut>(p, o, stream);
    }
    if constexpr (!B_KMAJOR) {  // dgrad / wgrad: MN-major operands, TMA path only
      const GemmKernel path = o.kernel;
      if (use_sm90(o) && (path == GemmKernel::kAuto || path == GemmKernel::kTmaDirectStore) &&
          launch_tma<TIn, TOut, (A_KMAJOR ? 1 : 2)>(p, o, stream))
        return;
    }
    const auto kernel =
        gemm::grouped_gemm_kernel<TIn, TOut, A_KMAJOR, B_KMAJOR, gemm::EpilogueIdentity>;
    const size_t smem = gemm::SmemLayout::bytes(p.num_groups);
    MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    int per_sm = 0;
    MOEFLOW_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, gemm::kThreads, smem));
    MOEFLOW_CHECK(per_sm > 0, "grouped GEMM kernel does not fit on this GPU (", smem,
                  " bytes of shared memory)");
    const int blocks = per_sm * sm_count();
    kernel<<<blocks, gemm::kThreads, smem, stream>>>(p, gemm::EpilogueIdentity{});
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
}

template <typename TIn, bool A_KMAJOR, bool B_KMAJOR>
void launch_out(DType out, const Params& p, const GemmOptions& o, cudaStream_t stream) {
  switch (out) {
    case DType::kBFloat16:
      return launch<TIn, __nv_bfloat16, A_KMAJOR, B_KMAJOR>(p, o, stream);
    case DType::kFloat16:
      return launch<TIn, __half, A_KMAJOR, B_KMAJOR>(p, o, stream);
    case DType::kFloat32:
      return launch<TIn, float, A_KMAJOR, B_KMAJOR>(p, o, stream);
    default:
      MOEFLOW_CHECK(false, "unsupported output dtype ", dtype_name(out));
  }
}

template <bool A_KMAJOR, bool B_KMAJOR>
void launch_in(DType in, DType out, const Params& p, const GemmOptions& o, cudaStream_t stream) {
  if (in == DType::kBFloat16)
    return launch_out<__nv_bfloat16, A_KMAJOR, B_KMAJOR>(out, p, o, stream);
  return launch_out<__half, A_KMAJOR, B_KMAJOR>(out, p, o, stream);
}

}  // namespace

namespace {
// The group layout and the A operand of a kernel call (A rows must be 16-byte aligned).
Params base_params(const GroupLayout& groups, int64_t num_groups, int64_t rows, const TensorView& a,
                   const char* a_name, const GemmOptions& o) {
  Params p{};
  // (bounded, so that the kernels' 32-bit band arithmetic cannot wrap)
  if (const int rb = o.raster; rb > 0) p.raster = std::min(rb, 1 << 12);
  p.num_groups = static_cast<int>(num_groups);
  p.offsets = groups.offsets.data_ptr<int64_t>();
  p.real_rows = groups.real_rows.defined() ? groups.real_rows.data_ptr<int32_t>() : nullptr;
  p.error = groups.error.defined() ? groups.error.data_ptr<int32_t>() : nullptr;
  p.rows = rows;
  p.a = a.data;
  p.lda = a.strides[0];
  check_rows16(a, a_name);
  return p;
}
}  // namespace

void grouped_gemm(const GroupedGemmCall& c, cudaStream_t stream) {
  MOEFLOW_CHECK(c.num_groups <= 8192, "grouped GEMM takes at most 8192 groups, got ", c.num_groups);
  const GemmOptions& o = c.options;
  Params p = base_params(c.groups, c.num_groups, c.rows, c.a,
                         c.op == GroupedGemmCall::kForward ? "a" : "dc", o);
  const GroupedWeights& w = c.w;
  const int64_t* ptrs = w.pointers.defined() ? w.pointers.data_ptr<int64_t>() : nullptr;
  const void* stacked = w.stacked.defined() ? w.stacked.data : nullptr;
  if (stacked) MOEFLOW_CHECK(addr_of(stacked) % 16 == 0, "weights must be 16-byte aligned");
  const DType in = c.a.dtype;
  switch (c.op) {
    case GroupedGemmCall::kForward:  // C[rows,N] = A[rows,K] . W_e[N,K]^T
    case GroupedGemmCall::kDgrad: {  // dA[rows,K] = dC[rows,N] . W_e[N,K]
      const bool fwd = c.op == GroupedGemmCall::kForward;
      p.reduce_grouped = false;
      p.b = stacked;
      p.b_ptrs = ptrs;
      p.b_group_stride = c.n * c.k;
      p.ldb = c.k;
      p.c = c.out.data;
      p.ldc = c.out.strides[0];
      check_rows16(c.out, fwd ? "c" : "da");
      p.n_out = fwd ? c.n : c.k;
      p.k_red = fwd ? c.k : c.n;
      if (c.a_rows.defined()) {
        MOEFLOW_CHECK(fwd, "a_rows (gathered A rows) applies to the forward only");
        MOEFLOW_CHECK(c.a_rows.dtype == DType::kInt32 && c.a_rows.ndim == 1 &&
                          c.a_rows.shape[0] == c.rows && c.a_rows.is_contiguous(),
                      "a_rows must be contiguous int32 [", c.rows, "], got ", c.a_rows.str());
        MOEFLOW_CHECK(use_sm90(o) && stacked != nullptr && c.k % 8 == 0,
                      "gathered A rows need a Hopper GPU, stacked weights and K % 8 == 0");
        MOEFLOW_CHECK(c.a.ndim == 2 && c.a.shape[0] >= 1 && c.a.shape[0] < (int64_t{1} << 31),
                      "gathered A rows: a must be [source rows, K] with 1 <= rows < 2^31, got ",
                      c.a.str());
        // (the kernel addresses source rows in 16-byte units held in 32 bits)
        const int64_t row_bytes = c.a.strides[0] * static_cast<int64_t>(dtype_size(in));
        MOEFLOW_CHECK(c.a.shape[0] * row_bytes <= (int64_t{1} << 36) && row_bytes % 16 == 0,
                      "gathered A rows: a must span at most 64 GiB with 16-byte aligned rows, got ",
                      c.a.str());
        p.a_rows = c.a_rows.data_ptr<int32_t>();
        p.a_src_rows = c.a.shape[0];
        const bool bf = in == DType::kBFloat16;
        MOEFLOW_CHECK(c.out.dtype == in, "gathered A rows: out must have a's dtype");
        const bool ok = bf ? launch_tma<__nv_bfloat16, __nv_bfloat16, 0>(p, o, stream)
                           : launch_tma<__half, __half, 0>(p, o, stream);
        MOEFLOW_CHECK(ok, "gathered A rows: the TMA grouped GEMM does not take this problem");
        return;
      }
      if (fwd)
        launch_in<true, true>(in, c.out.dtype, p, o, stream);
      else
        launch_in<true, false>(in, c.out.dtype, p, o, stream);
      return;
    }
    case GroupedGemmCall::kWgrad: {  // dW_e[N,K] (+)= dC_e[rows,N]^T . A_e[rows,K]
      p.reduce_grouped = true;
      p.b = c.b.data;
      p.ldb = c.b.strides[0];
      check_rows16(c.b, "a");
      p.c = const_cast<void*>(stacked);
      p.c_ptrs = ptrs;
      p.c_group_stride = c.n * c.k;
      p.ldc = c.k;
      p.accumulate = c.accumulate;
      p.m_out = c.n;
      p.n_out = c.k;
      const DType out = stacked ? w.stacked.dtype : w.dtype;
      MOEFLOW_CHECK(out == DType::kFloat32 || out == in, "dw must be float32 or ", dtype_name(in),
                    " (the inputs' dtype), got ", dtype_name(out));
      launch_in<false, false>(in, out, p, o, stream);
      return;
    }
  }
}

namespace {

template <typename T, int KIND>
void launch_fc1(const MlpFc1Call& c, const Params& p, cudaStream_t stream) {
  gemm::sm90tma::EpiMlpFc1<T, KIND> epi;
  epi.act = c.act;
  epi.ap = c.params;
  epi.f = c.ffn;
  epi.il8 = KIND == gemm::sm90tma::kInterleaved ? c.glu_interleave / 8 : 16;
  epi.bias = c.bias1.defined() ? static_cast<const T*>(c.bias1.data) : nullptr;
  epi.probs = c.probs.defined() ? c.probs.data_ptr<float>() : nullptr;
  epi.raw = c.raw.defined() ? static_cast<T*>(c.raw.data) : nullptr;
  MOEFLOW_CHECK((launch_tma<T, T, 0>(p, c.options, stream, epi)),
                "fused FC1: the TMA grouped GEMM does not take this problem (rows or weight rows "
                "past 2^31, or too many experts for shared memory)");
}

template <typename T>
void launch_fc1_kind(const MlpFc1Call& c, const Params& p, cudaStream_t stream) {
  if (!is_gated(c.act)) return launch_fc1<T, gemm::sm90tma::kPlain>(c, p, stream);
  if (c.glu_interleave == 0) return launch_fc1<T, gemm::sm90tma::kHalves>(c, p, stream);
  return launch_fc1<T, gemm::sm90tma::kInterleaved>(c, p, stream);
}

}  // namespace

bool mlp_fc1_fusable(const MlpFc1Call& c) {
  if (!use_sm90(c.options)) return false;
  const int64_t il = c.glu_interleave, n1 = is_gated(c.act) ? 2 * c.ffn : c.ffn;
  if (is_gated(c.act) && il == 0 && c.ffn % 64 != 0) return false;
  if (is_gated(c.act) && il != 0 && (il % 8 != 0 || 256 % (2 * il) != 0 || n1 % (2 * il) != 0))
    return false;
  if (c.bias1.defined() && addr_of(c.bias1.data) % 4 != 0) return false;
  return c.rows < (int64_t{1} << 31) && c.num_groups * n1 < (int64_t{1} << 31);
}

void mlp_fc1_forward(const MlpFc1Call& c, cudaStream_t stream) {
  MOEFLOW_CHECK(use_sm90(c.options),
                "the fused grouped-MLP FC1 needs a Hopper GPU (sm_90a build); "
                "other GPUs are not supported yet");
  const bool gated = is_gated(c.act);
  const int64_t n1 = gated ? 2 * c.ffn : c.ffn;
  if (gated && c.glu_interleave == 0)
    MOEFLOW_CHECK(c.ffn % 64 == 0,
                  "fused FC1 with [gate; up] halves needs F % 64 == 0, got F=", c.ffn,
                  " (use glu_interleave)");
  if (gated && c.glu_interleave != 0)
    MOEFLOW_CHECK(c.glu_interleave % 8 == 0 && 256 % (2 * c.glu_interleave) == 0 &&
                      n1 % (2 * c.glu_interleave) == 0,
                  "glu_interleave must be 8, 16, 32, 64 or 128 and divide F, got ",
                  c.glu_interleave);
  Params p = base_params(c.groups, c.num_groups, c.rows, c.x, "x", c.options);
  check_rows16(c.out, "out");
  MOEFLOW_CHECK(addr_of(c.w1.data) % 16 == 0, "w1 must be 16-byte aligned");
  MOEFLOW_CHECK(!c.bias1.defined() || addr_of(c.bias1.data) % 4 == 0,
                "fused FC1: bias1 must be 4-byte aligned");
  p.b = c.w1.data;
  p.b_group_stride = n1 * c.hidden;
  p.ldb = c.hidden;
  p.c = c.out.data;
  p.ldc = c.out.strides[0];
  p.n_out = n1;
  p.k_red = c.hidden;
  p.n_store = c.ffn;
  if (c.x.dtype == DType::kBFloat16) return launch_fc1_kind<__nv_bfloat16>(c, p, stream);
  return launch_fc1_kind<__half>(c, p, stream);
}

namespace {
template <typename T, int KIND>
void launch_dglu(const MlpDgluCall& c, const Params& p, cudaStream_t stream) {
  gemm::sm90tma::EpiMlpDglu<T, KIND> epi;
  epi.act = c.act;
  epi.ap = c.params;
  epi.f = c.ffn;
  epi.il = KIND == gemm::sm90tma::kInterleaved ? c.glu_interleave : 0;
  epi.h = static_cast<const T*>(c.h.data);
  epi.d_h = static_cast<T*>(c.d_h.data);
  epi.probs = c.probs.defined() ? c.probs.data_ptr<float>() : nullptr;
  epi.part = c.part;
  epi.part_ld = c.part_ld;
  MOEFLOW_CHECK((launch_tma<T, T, 1>(p, c.options, stream, epi)),
                "fused dGLU: the TMA grouped GEMM does not take this problem");
}
}  // namespace

bool mlp_dglu_fusable(const MlpDgluCall& c) {
  if (!use_sm90(c.options) || c.ffn % 16 != 0) return false;
  const bool gated = is_gated(c.act);
  if (gated && c.glu_interleave != 0 && c.glu_interleave % 8 != 0) return false;
  const int64_t n1 = gated ? 2 * c.ffn : c.ffn;
  const auto a16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (!a16(c.h.data) || !a16(c.d_h.data) || !a16(c.w2.data)) return false;
  if (!c.h.is_contiguous() || !c.d_h.is_contiguous()) return false;
  return c.rows < (int64_t{1} << 31) && c.num_groups * c.hidden < (int64_t{1} << 31) &&
         n1 * 2 % 16 == 0;
}

void mlp_fc2_dgrad_dglu(const MlpDgluCall& c, cudaStream_t stream) {
  MOEFLOW_CHECK(mlp_dglu_fusable(c), "fused dGLU: call not supported (see mlp_dglu_fusable)");
  Params p = base_params(c.groups, c.num_groups, c.rows, c.dy, "dy", c.options);
  p.reduce_grouped = false;
  p.b = c.w2.data;  // W2_e [H, F]: dA[rows, F] = dC[rows, H] . W2_e
  p.b_group_stride = c.hidden * c.ffn;
  p.ldb = c.ffn;
  p.c = c.d_h.data;  // (the helpers write d_h themselves; no output map is used)
  p.ldc = c.d_h.strides[0];
  p.n_out = c.ffn;
  p.k_red = c.hidden;
  const bool bf16 = c.dy.dtype == DType::kBFloat16;
  const bool gated = is_gated(c.act);
  auto go = [&](auto tag) {
    using T = decltype(tag);
    if (!gated) return launch_dglu<T, gemm::sm90tma::kPlain>(c, p, stream);
    if (c.glu_interleave == 0) return launch_dglu<T, gemm::sm90tma::kHalves>(c, p, stream);
    return launch_dglu<T, gemm::sm90tma::kInterleaved>(c, p, stream);
  };
  if (bf16)
    go(__nv_bfloat16{});
  else
    go(__half{});
}

}  // namespace moeflow::cuda
