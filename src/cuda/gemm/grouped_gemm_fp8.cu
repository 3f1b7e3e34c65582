// Host side of the blockwise FP8 grouped GEMMs (fp8/kernel.cuh: forward,
// fp8/wgrad.cuh: wgrad): the tile choice, the TMA tensor maps in the tile's
// boxes, the deepest pipeline the shared memory holds, the persistent grid.
#include <algorithm>
#include <type_traits>

#include "core/backends.h"
#include "cuda/common.cuh"
#include "cuda/gemm/fp8/kernel.cuh"
#include "cuda/gemm/fp8/wgrad.cuh"
#include "cuda/gemm/host.cuh"

namespace moeflow::cuda {

namespace {

using gemm::Params;
using namespace gemm::host;
namespace f = gemm::fp8;

// What the wgrad's tensor maps point at when there are no rows (no slice is
// ever loaded, but a map needs a 16-byte aligned address).
__device__ __align__(128) uint8_t g_no_rows[128];

// The groups' part of the kernels' Params: layout, raster, rows.
Params group_params(const GroupLayout& g, const GemmOptions& o, int64_t E, int64_t rows) {
  Params p{};
  if (const int rb = o.raster; rb > 0) p.raster = std::min(rb, 1 << 12);
  p.num_groups = static_cast<int>(E);
  p.offsets = g.offsets.data_ptr<int64_t>();
  p.real_rows = g.real_rows.defined() ? g.real_rows.data_ptr<int32_t>() : nullptr;
  p.error = g.error.defined() ? g.error.data_ptr<int32_t>() : nullptr;
  p.rows = rows;
  return p;
}

template <typename T, bool TW>
void launch_fp8(const Fp8GemmCall& c, const Params& p, const f::Fp8Params& q, cudaStream_t stream) {
  const int64_t rows = c.a.shape[0], K = c.a.shape[1], E = c.w.shape[0], N = c.w.shape[1];
  // A [rows, K] and W as [E*N, K], bytes, in 128 x TM and 128 x TN boxes.
  const CUtensorMap map_a =
      tensor_map<2>(c.a.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, {K, rows}, {K}, {f::kTileK, T::kM});
  const CUtensorMap map_w =
      tensor_map<2>(c.w.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, {K, E * N}, {K}, {f::kTileK, T::kN});
  const auto kernel = f::grouped_gemm_fp8_kernel<T, TW>;
  const size_t limit = max_dynamic_smem(kernel);
  int stages = f::kMaxStages;
  while (stages > 2 && f::Smem<T>::bytes(stages, p.num_groups) > limit) --stages;
  const size_t smem = f::Smem<T>::bytes(stages, p.num_groups);
  MOEFLOW_CHECK(smem <= limit, "grouped_gemm_fp8_forward: ", E,
                " groups leave no shared memory for the pipeline");
  MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  kernel<<<sm_count(), T::kThreads, smem, stream>>>(p, q, map_a, map_w, stages);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

template <typename T, typename TOut, bool TW>
void launch_fp8_wgrad(const Fp8WgradCall& c, const Params& p, const f::Fp8WgradParams& q,
                      cudaStream_t stream) {
  const int64_t N = c.dc_t.shape[0], rows = c.dc_t.shape[1], K = c.a_t.shape[0];
  // dC^T [N, rows] and A^T [K, rows], bytes, in 128 x TM and 128 x TN boxes.
  void* no_rows = nullptr;
  if (rows == 0) MOEFLOW_CUDA_CHECK(cudaGetSymbolAddress(&no_rows, g_no_rows));
  const CUtensorMap map_dc =
      rows == 0 ? tensor_map<2>(no_rows, CU_TENSOR_MAP_DATA_TYPE_UINT8, {128, 1}, {128},
                                {f::kTileK, 1})
                : tensor_map<2>(c.dc_t.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, {rows, N},
                                {c.dc_t.strides[0]}, {f::kTileK, T::kM});
  const CUtensorMap map_a =
      rows == 0 ? map_dc
                : tensor_map<2>(c.a_t.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, {rows, K},
                                {c.a_t.strides[0]}, {f::kTileK, T::kN});
  // dW stacked: [E, N, K] in 64-row x 128-byte boxes for the staged TMA epilogue.
  const CUtensorMap map_dw =
      q.tma_out ? tensor_map<3>(c.dw.stacked.data, tma_dtype<TOut>(), {K, N, p.num_groups},
                                {K * int64_t{sizeof(TOut)}, N * K * int64_t{sizeof(TOut)}},
                                {128 / static_cast<int>(sizeof(TOut)), 64, 1})
                : map_dc;
  const auto kernel = f::grouped_gemm_fp8_wgrad_kernel<T, TOut, TW>;
  const size_t limit = max_dynamic_smem(kernel);
  int stages = f::kMaxStages;
  while (stages > 2 && f::WgradSmem<T>::bytes(stages, p.num_groups) > limit) --stages;
  const size_t smem = f::WgradSmem<T>::bytes(stages, p.num_groups);
  MOEFLOW_CHECK(smem <= limit, "grouped_gemm_fp8_wgrad: ", p.num_groups,
                " groups leave no shared memory for the pipeline");
  MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  kernel<<<sm_count(), T::kThreads, smem, stream>>>(p, q, map_dc, map_a, map_dw, stages);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

template <typename T>
void launch_fp8_wgrad_out(const Fp8WgradCall& c, const Params& p, const f::Fp8WgradParams& q,
                          cudaStream_t stream) {
  const DType out = c.dw.stacked.defined() ? c.dw.stacked.dtype : c.dw.dtype;
  const bool tw = c.dc_t_scales.ndim == 1;  // tensorwise: one scale per operand
  if (out == DType::kFloat32)
    return tw ? launch_fp8_wgrad<T, float, true>(c, p, q, stream)
              : launch_fp8_wgrad<T, float, false>(c, p, q, stream);
  if (tw) return launch_fp8_wgrad<T, __nv_bfloat16, true>(c, p, q, stream);
  launch_fp8_wgrad<T, __nv_bfloat16, false>(c, p, q, stream);
}

}  // namespace

void grouped_gemm_fp8_forward(const Fp8GemmCall& c, cudaStream_t stream) {
  MOEFLOW_CHECK(use_sm90({}), "grouped_gemm_fp8_forward needs a Hopper GPU (sm_90a build)");
  const int64_t rows = c.a.shape[0], K = c.a.shape[1], E = c.w.shape[0], N = c.w.shape[1];
  MOEFLOW_CHECK(E <= 8192, "grouped_gemm_fp8_forward takes at most 8192 groups, got ", E);
  MOEFLOW_CHECK(rows < (int64_t{1} << 31) && E * N < (int64_t{1} << 31),
                "grouped_gemm_fp8_forward: rows and E*N must be below 2^31, got ", rows, " and ",
                E * N);
  if (rows == 0) return;
  Params p = group_params(c.groups, c.options, E, rows);
  p.a = c.a.data;
  p.lda = K;
  p.b = c.w.data;
  p.b_group_stride = N * K;
  p.ldb = K;
  p.c = c.c.data;
  p.ldc = c.c.strides[0];
  p.n_out = N;
  p.k_red = K;
  const bool tw = c.a_scales.ndim == 1;  // tensorwise: one scale per operand
  const int promote = c.options.fp8_promote < 0 ? 4 : c.options.fp8_promote;
  const f::Fp8Params q{c.a_scales.data_ptr<float>(), c.w_scales.data_ptr<float>(), K / f::kBlock,
                       N / f::kBlock, promote};
  ensure_current_context();
  // Auto: three consumer warpgroups (192 x 128) unless the groups average
  // under 384 rows, where 192-row tiles would compute more pad rows
  // (docs/tuning.md).
  Fp8Tile tile = c.options.fp8_tile;
  if (tile == Fp8Tile::kAuto) tile = rows >= 384 * E ? Fp8Tile::k192x128 : Fp8Tile::k128x128;
  const auto launch = [&](auto tw_tag) {
    constexpr bool TW = decltype(tw_tag)::value;
    switch (tile) {
      case Fp8Tile::k128x192:
        return launch_fp8<f::Tile128x192, TW>(c, p, q, stream);
      case Fp8Tile::k192x128:
        return launch_fp8<f::Tile192x128, TW>(c, p, q, stream);
      case Fp8Tile::k128x128:
      case Fp8Tile::kAuto:
        return launch_fp8<f::Tile128x128, TW>(c, p, q, stream);
    }
  };
  if (tw) return launch(std::true_type{});
  launch(std::false_type{});
}

void grouped_gemm_fp8_wgrad(const Fp8WgradCall& c, cudaStream_t stream) {
  MOEFLOW_CHECK(use_sm90({}), "grouped_gemm_fp8_wgrad needs a Hopper GPU (sm_90a build)");
  const int64_t N = c.dc_t.shape[0], rows = c.dc_t.shape[1], K = c.a_t.shape[0];
  const int64_t E = c.dw.num_groups();
  MOEFLOW_CHECK(E <= 8192, "grouped_gemm_fp8_wgrad takes at most 8192 groups, got ", E);
  MOEFLOW_CHECK(rows < (int64_t{1} << 31), "grouped_gemm_fp8_wgrad: rows must be below 2^31, got ",
                rows);
  Params p = group_params(c.groups, c.options, E, rows);
  p.reduce_grouped = true;
  if (c.dw.stacked.defined())
    p.c = c.dw.stacked.data;
  else
    p.c_ptrs = c.dw.pointers.data_ptr<int64_t>();
  p.c_group_stride = N * K;
  p.ldc = K;
  p.accumulate = c.accumulate;
  p.m_out = N;
  p.n_out = K;
  const bool tw = c.dc_t_scales.ndim == 1;
  const f::Fp8WgradParams q{c.dc_t_scales.data_ptr<float>(),
                            tw ? 0 : c.dc_t_scales.strides[0],
                            tw ? 0 : c.dc_t_scales.strides[1],
                            c.a_t_scales.data_ptr<float>(),
                            tw ? 0 : c.a_t_scales.strides[0],
                            tw ? 0 : c.a_t_scales.strides[1],
                            c.dw.stacked.defined(),
                            c.options.fp8_promote < 0 ? 4 : c.options.fp8_promote};
  ensure_current_context();
  // Auto: three consumer warpgroups (192 x 128), one promoting while the
  // others' wgmma run: 1.05-1.18x the 128 x 128 tile on every measured case
  // (docs/tuning.md).
  switch (c.options.fp8_tile) {
    case Fp8Tile::k128x192:
      return launch_fp8_wgrad_out<f::Tile128x192>(c, p, q, stream);
    case Fp8Tile::k128x128:
      return launch_fp8_wgrad_out<f::Tile128x128>(c, p, q, stream);
    case Fp8Tile::k192x128:
    case Fp8Tile::kAuto:
      return launch_fp8_wgrad_out<f::Tile192x128>(c, p, q, stream);
  }
}

}  // namespace moeflow::cuda
