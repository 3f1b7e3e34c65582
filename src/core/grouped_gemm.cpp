// Public grouped GEMM entry points: weight/layout helpers, argument checks,
// dispatch to the CPU reference or the CUDA kernels (with the caller's
// GemmOptions).
#include "moeflow/grouped_gemm.h"

#include <cstring>
#include <vector>

#include "core/backends.h"
#include "core/internal.h"

namespace moeflow {

using detail::Expect;

GroupedWeights GroupedWeights::from_stacked(TensorView w) {
  GroupedWeights g;
  g.stacked = w;
  if (w.defined() && w.ndim == 3) {
    g.dtype = w.dtype;
    g.n = w.shape[1];
    g.k = w.shape[2];
  }
  return g;
}

GroupedWeights GroupedWeights::from_pointers(TensorView pointers, DType dtype, int64_t n,
                                             int64_t k) {
  GroupedWeights g;
  g.pointers = pointers;
  g.dtype = dtype;
  g.n = n;
  g.k = k;
  return g;
}

int64_t GroupedWeights::num_groups() const {
  if (stacked.defined()) return stacked.ndim == 3 ? stacked.shape[0] : -1;
  return pointers.defined() && pointers.ndim == 1 ? pointers.shape[0] : -1;
}

Device GroupedWeights::device() const {
  return stacked.defined() ? stacked.device : pointers.device;
}

ExpertTable make_expert_table(const std::vector<TensorView>& experts) {
  MOEFLOW_CHECK(!experts.empty(), "experts: need at least one expert tensor");
  const TensorView& f = experts[0];
  MOEFLOW_CHECK(f.defined() && f.ndim == 2, "experts[0] must be [N,K], got ", f.str());
  Tensor host = Tensor::empty({static_cast<int64_t>(experts.size())}, DType::kInt64);
  for (size_t e = 0; e < experts.size(); ++e) {
    const TensorView& t = experts[e];
    MOEFLOW_CHECK(t.defined() && t.ndim == 2 && t.shape[0] == f.shape[0] &&
                      t.shape[1] == f.shape[1] && t.dtype == f.dtype && t.device == f.device,
                  "experts[", e, "] must be ", dtype_name(f.dtype), " ", f.shape_str(), " on ",
                  f.device.str(), " as experts[0], got ", t.str());
    MOEFLOW_CHECK(t.is_contiguous(), "experts[", e, "] must be contiguous");
    host.data_ptr<int64_t>()[e] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data));
  }
  ExpertTable out;
  out.table = f.device.is_cpu() ? host : host.to(f.device);
  out.weights = GroupedWeights::from_pointers(out.table, f.dtype, f.shape[0], f.shape[1]);
  return out;
}

GroupLayout GroupLayout::from_plan(const RoutingPlan& plan) {
  GroupLayout g;
  g.offsets = plan.expert_row_offsets;
  g.real_rows = plan.tokens_per_expert;
  return g;
}

namespace {

void check_weights(const GroupedWeights& w, const char* name, const std::vector<DType>& dtypes,
                   int64_t groups, int64_t n, int64_t k, Device dev) {
  MOEFLOW_CHECK(w.stacked.defined() != w.pointers.defined(), name,
                " must give exactly one of stacked [E,N,K] or pointers [E]");
  if (w.stacked.defined()) {
    detail::expect(w.stacked, name, Expect{dtypes, {groups, n, k}, dev});
  } else {
    detail::expect(w.pointers, name, Expect{{DType::kInt64}, {groups}, dev});
    bool ok = false;
    for (DType d : dtypes) ok = ok || d == w.dtype;
    MOEFLOW_CHECK(ok && w.n == n && w.k == k, name, " (pointers) must describe ",
                  dtype_name(dtypes[0]), " [", n, ",", k, "] tensors, got ", dtype_name(w.dtype),
                  " [", w.n, ",", w.k, "]");
  }
}

void check_layout(const GroupLayout& g, int64_t groups, Device dev) {
  detail::expect(g.offsets, "groups.offsets", Expect{{DType::kInt64}, {groups + 1}, dev});
  if (g.real_rows.defined())
    detail::expect(g.real_rows, "groups.real_rows", Expect{{DType::kInt32}, {groups}, dev});
  if (g.error.defined()) detail::expect(g.error, "groups.error", Expect{{DType::kInt32}, {1}, dev});
}

Expect rows_of(const std::vector<DType>& dtypes, int64_t rows, int64_t cols, Device dev) {
  Expect e{dtypes, {rows, cols}, dev};
  e.contiguous = false;
  e.inner_unit = true;
  return e;
}

const std::vector<DType> kInputs = {DType::kBFloat16, DType::kFloat16};
const std::vector<DType> kOutputs = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};

void check_alignment(int64_t n, int64_t k) {
  MOEFLOW_CHECK(n % 8 == 0 && k % 8 == 0,
                "grouped GEMM needs N and K to be multiples of 8 (16-byte rows), got N=", n,
                " K=", k);
}

GroupedGemmCall make_call(GroupedGemmCall::Op op, TensorView a, TensorView b, TensorView out,
                          const GroupedWeights& w, const GroupLayout& groups, int64_t rows,
                          int64_t groups_count, int64_t n, int64_t k, const GemmOptions& options) {
  GroupedGemmCall call;
  call.options = options;
  call.op = op;
  call.a = a;
  call.b = b;
  call.out = out;
  call.w = w;
  call.groups = groups;
  call.rows = rows;
  call.num_groups = groups_count;
  call.n = n;
  call.k = k;
  return call;
}

void run(const GroupedGemmCall& call, Device dev, cudaStream_t stream) {
  if (dev.is_cpu()) return cpu::grouped_gemm(call);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::grouped_gemm(call, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

// The forward's checks; a_rows (gathered rows) defined: rows come from it.
GroupedGemmCall forward_call(TensorView a, TensorView a_rows, const GroupedWeights& w,
                             const GroupLayout& groups, TensorView c, const GemmOptions& options) {
  detail::expect_defined(a, "a");
  MOEFLOW_CHECK(a.ndim == 2, "a must be [rows,K], got ", a.str());
  const int64_t E = w.num_groups();
  MOEFLOW_CHECK(E > 0, "w must hold >= 1 expert ([E,N,K] or [E] pointers)");
  const Device dev = a.device;
  const int64_t k = a.shape[1], n = w.stacked.defined() ? w.stacked.shape[1] : w.n;
  int64_t rows = a.shape[0];
  if (a_rows.defined()) {
    MOEFLOW_CHECK(a_rows.ndim == 1, "a_rows must be int32 [rows], got ", a_rows.str());
    rows = a_rows.shape[0];
    detail::expect(a_rows, "a_rows", Expect{{DType::kInt32}, {rows}, dev});
    detail::expect(a, "a", rows_of(kInputs, a.shape[0], k, dev));
  } else {
    detail::expect(a, "a", rows_of(kInputs, rows, k, dev));
  }
  check_weights(w, "w", {a.dtype}, E, n, k, dev);
  check_layout(groups, E, dev);
  detail::expect(c, "c",
                 rows_of(a_rows.defined() ? std::vector<DType>{a.dtype} : kOutputs, rows, n, dev));
  check_alignment(n, k);
  GroupedGemmCall call =
      make_call(GroupedGemmCall::kForward, a, {}, c, w, groups, rows, E, n, k, options);
  call.a_rows = a_rows;
  return call;
}

// The CPU reference of the gathered forward: the gathered rows copied into a
// temporary matrix (zero rows for -1 or out-of-range entries), then the forward.
void cpu_forward_gathered(GroupedGemmCall call) {
  const TensorView a = call.a;
  const int64_t src_rows = a.shape[0],
                row_bytes = a.shape[1] * static_cast<int64_t>(dtype_size(a.dtype));
  Tensor gathered = Tensor::zeros({call.rows, a.shape[1]}, a.dtype);
  const int32_t* map = call.a_rows.data_ptr<int32_t>();
  for (int64_t r = 0; r < call.rows; ++r) {
    if (map[r] < 0 || map[r] >= src_rows) continue;
    std::memcpy(static_cast<uint8_t*>(gathered.data()) + r * row_bytes,
                static_cast<const uint8_t*>(a.data) +
                    map[r] * a.strides[0] * static_cast<int64_t>(dtype_size(a.dtype)),
                static_cast<size_t>(row_bytes));
  }
  call.a = gathered;
  call.a_rows = TensorView();
  cpu::grouped_gemm(call);
}

}  // namespace

void grouped_gemm_forward(TensorView a, const GroupedWeights& w, const GroupLayout& groups,
                          TensorView c, cudaStream_t stream) {
  grouped_gemm_forward(a, w, groups, c, GemmOptions{}, stream);
}

void grouped_gemm_forward(TensorView a, const GroupedWeights& w, const GroupLayout& groups,
                          TensorView c, const GemmOptions& options, cudaStream_t stream) {
  run(forward_call(a, {}, w, groups, c, options), a.device, stream);
}

void grouped_gemm_forward_gathered(TensorView a, TensorView a_rows, const GroupedWeights& w,
                                   const GroupLayout& groups, TensorView c,
                                   const GemmOptions& options, cudaStream_t stream) {
  detail::expect_defined(a_rows, "a_rows");
  const GroupedGemmCall call = forward_call(a, a_rows, w, groups, c, options);
  if (a.device.is_cpu()) return cpu_forward_gathered(call);
  run(call, a.device, stream);
}

void grouped_gemm_dgrad(TensorView dc, const GroupedWeights& w, const GroupLayout& groups,
                        TensorView da, cudaStream_t stream) {
  grouped_gemm_dgrad(dc, w, groups, da, GemmOptions{}, stream);
}

void grouped_gemm_dgrad(TensorView dc, const GroupedWeights& w, const GroupLayout& groups,
                        TensorView da, const GemmOptions& options, cudaStream_t stream) {
  detail::expect_defined(dc, "dc");
  MOEFLOW_CHECK(dc.ndim == 2, "dc must be [rows,N], got ", dc.str());
  const int64_t E = w.num_groups();
  MOEFLOW_CHECK(E > 0, "w must hold >= 1 expert ([E,N,K] or [E] pointers)");
  const Device dev = dc.device;
  const int64_t rows = dc.shape[0], n = dc.shape[1],
                k = w.stacked.defined() ? w.stacked.shape[2] : w.k;
  detail::expect(dc, "dc", rows_of(kInputs, rows, n, dev));
  check_weights(w, "w", {dc.dtype}, E, n, k, dev);
  check_layout(groups, E, dev);
  detail::expect(da, "da", rows_of(kOutputs, rows, k, dev));
  check_alignment(n, k);
  run(make_call(GroupedGemmCall::kDgrad, dc, {}, da, w, groups, rows, E, n, k, options), dev,
      stream);
}

void grouped_gemm_wgrad(TensorView dc, TensorView a, const GroupLayout& groups,
                        const GroupedWeights& dw, bool accumulate, cudaStream_t stream) {
  grouped_gemm_wgrad(dc, a, groups, dw, accumulate, GemmOptions{}, stream);
}

void grouped_gemm_wgrad(TensorView dc, TensorView a, const GroupLayout& groups,
                        const GroupedWeights& dw, bool accumulate, const GemmOptions& options,
                        cudaStream_t stream) {
  detail::expect_defined(dc, "dc");
  detail::expect_defined(a, "a");
  MOEFLOW_CHECK(dc.ndim == 2 && a.ndim == 2, "dc must be [rows,N] and a [rows,K], got ", dc.str(),
                " and ", a.str());
  const int64_t E = dw.num_groups();
  MOEFLOW_CHECK(E > 0, "dw must hold >= 1 expert ([E,N,K] or [E] pointers)");
  const Device dev = dc.device;
  const int64_t rows = dc.shape[0], n = dc.shape[1], k = a.shape[1];
  detail::expect(dc, "dc", rows_of(kInputs, rows, n, dev));
  detail::expect(a, "a", rows_of({dc.dtype}, rows, k, dev));
  // dw: float32, or the inputs' dtype (float32 accumulation rounded once).
  const DType dw_dtype = dw.stacked.defined() ? dw.stacked.dtype : dw.dtype;
  MOEFLOW_CHECK(dw_dtype == DType::kFloat32 || dw_dtype == dc.dtype, "dw must be float32 or ",
                dtype_name(dc.dtype), " (the dtype of dc and a), got ", dtype_name(dw_dtype));
  check_weights(dw, "dw", {DType::kFloat32, dc.dtype}, E, n, k, dev);
  check_layout(groups, E, dev);
  check_alignment(n, k);
  GroupedGemmCall call =
      make_call(GroupedGemmCall::kWgrad, dc, a, {}, dw, groups, rows, E, n, k, options);
  call.accumulate = accumulate;
  run(call, dev, stream);
}

void grouped_gemm_fp8_forward(TensorView a, TensorView a_scales, TensorView w, TensorView w_scales,
                              const GroupLayout& groups, TensorView c, cudaStream_t stream) {
  grouped_gemm_fp8_forward(a, a_scales, w, w_scales, groups, c, GemmOptions{}, stream);
}

void grouped_gemm_fp8_forward(TensorView a, TensorView a_scales, TensorView w, TensorView w_scales,
                              const GroupLayout& groups, TensorView c, const GemmOptions& options,
                              cudaStream_t stream) {
  detail::expect_defined(a, "a");
  detail::expect_defined(w, "w");
  MOEFLOW_CHECK(a.ndim == 2, "a must be [rows,K], got ", a.str());
  MOEFLOW_CHECK(w.ndim == 3, "w must be [E,N,K], got ", w.str());
  const Device dev = a.device;
  const int64_t rows = a.shape[0], K = a.shape[1], E = w.shape[0], N = w.shape[1];
  MOEFLOW_CHECK(E > 0, "w must hold >= 1 expert, got ", w.str());
  MOEFLOW_CHECK(K > 0 && N > 0 && K % 128 == 0 && N % 128 == 0,
                "grouped_gemm_fp8_forward needs K and N to be positive multiples of 128, got K=", K,
                " N=", N);
  detail::expect(a, "a", Expect{{DType::kFloat8E4M3}, {rows, K}, dev});
  // Tensorwise: both scales [1]; blockwise: [rows, K/128] and [E, N/128, K/128].
  const bool tensorwise = a_scales.defined() && a_scales.ndim == 1;
  detail::expect(a_scales, "a_scales",
                 Expect{{DType::kFloat32},
                        tensorwise ? std::vector<int64_t>{1} : std::vector<int64_t>{rows, K / 128},
                        dev});
  detail::expect(w, "w", Expect{{DType::kFloat8E4M3}, {E, N, K}, dev});
  detail::expect(
      w_scales, "w_scales",
      Expect{{DType::kFloat32},
             tensorwise ? std::vector<int64_t>{1} : std::vector<int64_t>{E, N / 128, K / 128},
             dev});
  MOEFLOW_CHECK(options.fp8_promote >= -1, "options.fp8_promote must be >= -1, got ",
                options.fp8_promote);
  check_layout(groups, E, dev);
  Expect c_rows{{DType::kBFloat16}, {rows, N}, dev};
  c_rows.contiguous = false;
  c_rows.inner_unit = true;
  detail::expect(c, "c", c_rows);
  auto addr = [](const TensorView& v) { return reinterpret_cast<uintptr_t>(v.data); };
  MOEFLOW_CHECK(addr(a) % 16 == 0 && addr(w) % 16 == 0,
                "grouped_gemm_fp8_forward: a and w must be 16-byte aligned");
  MOEFLOW_CHECK(addr(c) % 4 == 0 && (rows <= 1 || (c.strides[0] % 2 == 0 && c.strides[0] >= N)),
                "grouped_gemm_fp8_forward: c must be 4-byte aligned with an even row stride >= N=",
                N, ", got stride ", c.strides[0]);
  Fp8GemmCall call{a, a_scales, w, w_scales, c, groups, options};
  if (dev.is_cpu()) return cpu::grouped_gemm_fp8_forward(call);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::grouped_gemm_fp8_forward(call, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

void grouped_gemm_fp8_wgrad(TensorView dc_t, TensorView dc_t_scales, TensorView a_t,
                            TensorView a_t_scales, const GroupLayout& groups,
                            const GroupedWeights& dw, bool accumulate, cudaStream_t stream) {
  grouped_gemm_fp8_wgrad(dc_t, dc_t_scales, a_t, a_t_scales, groups, dw, accumulate, GemmOptions{},
                         stream);
}

void grouped_gemm_fp8_wgrad(TensorView dc_t, TensorView dc_t_scales, TensorView a_t,
                            TensorView a_t_scales, const GroupLayout& groups,
                            const GroupedWeights& dw, bool accumulate, const GemmOptions& options,
                            cudaStream_t stream) {
  detail::expect_defined(dc_t, "dc_t");
  detail::expect_defined(a_t, "a_t");
  MOEFLOW_CHECK(dc_t.ndim == 2 && a_t.ndim == 2,
                "dc_t must be [N,rows] and a_t [K,rows] (the transposed operands), got ",
                dc_t.str(), " and ", a_t.str());
  const Device dev = dc_t.device;
  const int64_t N = dc_t.shape[0], rows = dc_t.shape[1], K = a_t.shape[0];
  const int64_t E = dw.num_groups();
  MOEFLOW_CHECK(E > 0, "dw must hold >= 1 expert ([E,N,K] or [E] pointers)");
  MOEFLOW_CHECK(K > 0 && N > 0 && K % 128 == 0 && N % 128 == 0,
                "grouped_gemm_fp8_wgrad needs N and K to be positive multiples of 128, got N=", N,
                " K=", K);
  const int64_t nb = (rows + 127) / 128;
  detail::expect(dc_t, "dc_t", rows_of({DType::kFloat8E4M3}, N, rows, dev));
  detail::expect(a_t, "a_t", rows_of({DType::kFloat8E4M3}, K, rows, dev));
  // Tensorwise: both scales [1]; blockwise: [N, rows/128] and [K, rows/128], any strides.
  const bool tensorwise = dc_t_scales.defined() && dc_t_scales.ndim == 1;
  Expect scales{{DType::kFloat32}, {N, nb}, dev};
  scales.contiguous = false;
  if (tensorwise) scales.shape = {1};
  detail::expect(dc_t_scales, "dc_t_scales", scales);
  if (!tensorwise) scales.shape = {K, nb};
  detail::expect(a_t_scales, "a_t_scales", scales);
  MOEFLOW_CHECK(options.fp8_promote >= -1, "options.fp8_promote must be >= -1, got ",
                options.fp8_promote);
  check_weights(dw, "dw", {DType::kFloat32, DType::kBFloat16}, E, N, K, dev);
  check_layout(groups, E, dev);
  auto addr = [](const TensorView& v) { return reinterpret_cast<uintptr_t>(v.data); };
  MOEFLOW_CHECK(addr(dc_t) % 16 == 0 && addr(a_t) % 16 == 0 &&
                    (rows == 0 || (dc_t.strides[0] % 16 == 0 && a_t.strides[0] % 16 == 0)),
                "grouped_gemm_fp8_wgrad: dc_t and a_t must be 16-byte aligned with row strides "
                "a multiple of 16, got strides ",
                dc_t.strides[0], " and ", a_t.strides[0]);
  MOEFLOW_CHECK(!dw.stacked.defined() || addr(dw.stacked) % 16 == 0,
                "grouped_gemm_fp8_wgrad: dw must be 16-byte aligned (stored by TMA)");
  Fp8WgradCall call{dc_t, dc_t_scales, a_t, a_t_scales, dw, groups, accumulate, options};
  if (dev.is_cpu()) return cpu::grouped_gemm_fp8_wgrad(call);
#ifdef MOEFLOW_WITH_CUDA
  const detail::DeviceGuard device_guard(dev);
  cuda::grouped_gemm_fp8_wgrad(call, stream);
#else
  (void)stream;
  MOEFLOW_CHECK(false, "this moeflow was built without CUDA");
#endif
}

}  // namespace moeflow
