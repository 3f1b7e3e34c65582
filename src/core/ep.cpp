// Public expert-parallel entry points (moeflow/ep.h): the group options and
// every argument are checked here, once, then the group's backend (nccl or
// nvlink, src/cuda/ep/) runs the operation. Without CUDA the backend entry
// points are stubs that throw (ep_nocuda.cpp).
#include "moeflow/ep.h"

#include <utility>

#include "core/ep_backend.h"
#include "core/internal.h"

namespace moeflow {

using detail::Expect;

namespace {

const std::vector<DType> kFloats = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

int64_t addr(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

// 16-byte accesses of every operand's rows (addresses and strides in bytes).
bool rows_16b(int64_t H, int n, std::initializer_list<std::pair<const void*, int64_t>> rows) {
  if (H % n != 0) return false;
  for (const auto& r : rows)
    if (addr(r.first) % 16 != 0 || r.second % 16 != 0) return false;
  return true;
}

bool is_nvlink(const EpGroup& group) {
  return group.options().backend == EpBackend::kNvlink;
}

// The dtype of combine_backward's rows: the token dtype, or backward_dtype
// with FP8 tokens.
DType grad_dtype(const EpOptions& o) {
  return dtype_is_arith_float(o.dtype) ? o.dtype : o.backward_dtype;
}

// The handle of a dispatch of this group.
void check_handle(const EpGroup& group, const EpHandle& handle) {
  MOEFLOW_CHECK(handle.defined(), "handle: expected the handle of a dispatch, got an empty one");
  MOEFLOW_CHECK(handle.group() == &group,
                "handle: it comes from a dispatch of another expert-parallel group");
}

// combine and dispatch backward: rows [capacity, H] -> out [T, H].
void check_combine(EpGroup& group, const EpHandle& handle, TensorView y, const char* y_name,
                   TensorView out, const char* out_name) {
  check_handle(group, handle);
  const Device dev = group.device();
  const int64_t H = group.options().hidden;
  detail::expect(y, y_name, Expect{kFloats, {group.capacity_rows(), H}, dev});
  detail::expect(out, out_name, Expect{kFloats, {handle.num_tokens(), H}, dev});
  MOEFLOW_CHECK(out.strides[1] == 1, out_name, " rows must be contiguous (stride(1) == 1)");
  if (is_nvlink(group))
    MOEFLOW_CHECK(y.strides[1] == 1, y_name, " rows must be contiguous (stride(1) == 1)");
}

void combine(EpGroup& group, const EpHandle& handle, TensorView y, bool weighted, TensorView out,
             cudaStream_t stream) {
  const detail::DeviceGuard device_guard(group.device());
  if (is_nvlink(group)) return cuda::ep_nvlink_combine(group, handle, y, weighted, out, stream);
  cuda::ep_nccl_combine(group, handle, y, weighted, out, stream);
}

}  // namespace

void check_ep_options(const EpOptions& o, int world) {
  MOEFLOW_CHECK(o.num_experts > 0 && o.num_experts % world == 0,
                "num_experts must be a positive multiple of the world size ", world, ", got ",
                o.num_experts);
  MOEFLOW_CHECK(o.topk >= 1 && o.topk <= 32, "topk must be in [1, 32], got ", o.topk);
  MOEFLOW_CHECK(o.hidden > 0, "hidden must be > 0, got ", o.hidden);
  MOEFLOW_CHECK(world <= kEpMaxWorld, "at most ", kEpMaxWorld, " ranks per group, got ", world);
  MOEFLOW_CHECK(o.pipeline_chunks >= 1 && o.pipeline_chunks <= kEpMaxChunks,
                "pipeline_chunks must be in [1, ", kEpMaxChunks, "], got ", o.pipeline_chunks);
  MOEFLOW_CHECK(o.overlap_blocks >= 0, "overlap_blocks must be >= 0, got ", o.overlap_blocks);
  MOEFLOW_CHECK(o.pipeline_first_share > 0.0 && o.pipeline_first_share < 1.0,
                "pipeline_first_share must be in (0, 1), got ", o.pipeline_first_share);
  MOEFLOW_CHECK(o.nvlink_blocks >= 2, "nvlink_blocks must be >= 2, got ", o.nvlink_blocks);
  MOEFLOW_CHECK(o.nvlink_recv_regions >= 1 && o.nvlink_recv_regions <= 16,
                "nvlink_recv_regions must be in [1, 16], got ", o.nvlink_recv_regions);
  MOEFLOW_CHECK(o.nvlink_quantize_in_dispatch >= -1 && o.nvlink_quantize_in_dispatch <= 1,
                "nvlink_quantize_in_dispatch must be -1 (auto), 0 or 1, got ",
                o.nvlink_quantize_in_dispatch);
  MOEFLOW_CHECK(o.max_tokens_per_rank >= 0, "max_tokens_per_rank must be >= 0, got ",
                o.max_tokens_per_rank);
  MOEFLOW_CHECK(dtype_is_arith_float(o.dtype) || o.dtype == DType::kFloat8E4M3 ||
                    o.dtype == DType::kFloat8E5M2,
                "dtype must be float32, float16, bfloat16, float8_e4m3 or float8_e5m2, got ",
                dtype_name(o.dtype));
  MOEFLOW_CHECK(dtype_is_arith_float(grad_dtype(o)),
                "backward_dtype must be float32, float16 or bfloat16 (FP8 tokens), got ",
                dtype_name(grad_dtype(o)));
  MOEFLOW_CHECK(o.scale_cols >= 0, "scale_cols must be >= 0, got ", o.scale_cols);
  MOEFLOW_CHECK(o.timeout_s >= 0.0, "timeout_s must be >= 0 (0: no timeout), got ", o.timeout_s);
  MOEFLOW_CHECK(o.eager_share >= 0.0 && o.eager_share < 1.0, "eager_share must be in [0, 1), got ",
                o.eager_share);
  check_combine_wire(o.combine_wire_dtype, o.hidden);
}

void check_combine_wire(DType wire, int64_t hidden) {
  MOEFLOW_CHECK(wire == DType::kFloat32 || wire == DType::kBFloat16,
                "combine_wire_dtype must be float32 or bfloat16, got ", dtype_name(wire));
  MOEFLOW_CHECK(wire == DType::kFloat32 || hidden % 8 == 0,
                "combine_wire_dtype bfloat16 needs hidden % 8 == 0 (16-byte rows), got hidden=",
                hidden);
}

namespace {

// ids, probs and x's shape against the group, x's dtype one of `x_dtypes`;
// returns T.
int64_t check_dispatch(const EpGroup& group, TensorView x, const std::vector<DType>& x_dtypes,
                       TensorView ids, TensorView probs) {
  const EpOptions& o = group.options();
  const Device dev = group.device();
  const int K = o.topk;
  MOEFLOW_CHECK(x.defined() && x.ndim == 2, "x must be [T,H], got ", x.str());
  const int64_t T = x.shape[0];
  detail::expect(x, "x", Expect{x_dtypes, {T, o.hidden}, dev});
  MOEFLOW_CHECK(x.strides[1] == 1, "x rows must be contiguous (stride(1) == 1), got ", x.stride(1));
  MOEFLOW_CHECK(T <= o.max_tokens_per_rank, "x has ", T,
                " tokens, more than max_tokens_per_rank=", o.max_tokens_per_rank);
  detail::expect(ids, "ids", Expect{{DType::kInt32, DType::kInt64}, {T, K}, dev});
  MOEFLOW_CHECK(ids.is_contiguous(), "ids must be contiguous");
  if (probs.defined()) {
    detail::expect(probs, "probs", Expect{{DType::kFloat32}, {T, K}, dev});
    MOEFLOW_CHECK(probs.is_contiguous(), "probs must be contiguous");
  }
  if (is_nvlink(group))
    MOEFLOW_CHECK(addr(x.data) % 16 == 0 && (x.strides[0] * int64_t(dtype_size(x.dtype))) % 16 == 0,
                  "the nvlink backend needs 16-byte aligned rows of x");
  return T;
}

}  // namespace

EpDispatchResult ep_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                             TensorView scales, cudaStream_t stream) {
  const EpOptions& o = group.options();
  const int64_t T = check_dispatch(group, x, {o.dtype}, ids, probs);
  // Every rank passes scales or none (their transfers pair up across ranks):
  // a group made with scale_cols > 0 takes them on every dispatch.
  MOEFLOW_CHECK(scales.defined() == (o.scale_cols > 0),
                scales.defined()
                    ? "scales given but the group was made with EpOptions::scale_cols = 0"
                    : "the group was made with EpOptions::scale_cols > 0: every dispatch takes "
                      "scales");
  if (scales.defined()) {
    detail::expect(scales, "scales", Expect{{o.scale_dtype}, {T, o.scale_cols}, group.device()});
    MOEFLOW_CHECK(scales.is_contiguous(), "scales must be contiguous");
  }
  const detail::DeviceGuard device_guard(group.device());
  if (is_nvlink(group))
    return cuda::ep_nvlink_dispatch(group, x, ids, probs, scales, nullptr, stream);
  return cuda::ep_nccl_dispatch(group, x, ids, probs, scales, stream);
}

EpDispatchResult ep_dispatch_quantize(EpGroup& group, TensorView x, TensorView ids,
                                      TensorView probs, const QuantizeConfig& quantize,
                                      cudaStream_t stream) {
  const EpOptions& o = group.options();
  const int64_t H = o.hidden, nb = (H + 127) / 128;
  MOEFLOW_CHECK(o.dtype == DType::kFloat8E4M3 || o.dtype == DType::kFloat8E5M2,
                "ep_dispatch_quantize needs a group of FP8 tokens (EpOptions::dtype float8_e4m3 "
                "or float8_e5m2), got ",
                dtype_name(o.dtype));
  MOEFLOW_CHECK(quantize.out == o.dtype, "quantize.out must be the group's dtype ",
                dtype_name(o.dtype), ", got ", dtype_name(quantize.out));
  MOEFLOW_CHECK(quantize.scaling == QuantScaling::kBlock1x128 && !quantize.columnwise,
                "ep_dispatch_quantize quantizes 1x128 blocks rowwise (QuantScaling::kBlock1x128, "
                "columnwise = false)");
  MOEFLOW_CHECK(o.scale_cols == nb && o.scale_dtype == DType::kFloat32,
                "ep_dispatch_quantize needs a group with scale_cols = ceil(hidden/128) = ", nb,
                " of float32 (the 1x128 scales), got scale_cols=", o.scale_cols, " of ",
                dtype_name(o.scale_dtype));
  check_dispatch(group, x, {DType::kBFloat16, DType::kFloat16}, ids, probs);
  const detail::DeviceGuard device_guard(group.device());
  if (is_nvlink(group)) {
    MOEFLOW_CHECK(H <= 16384,
                  "ep_dispatch_quantize on the nvlink backend needs hidden <= 16384, got ", H);
    return cuda::ep_nvlink_dispatch_quantize(group, x, ids, probs, quantize, stream);
  }
  return cuda::ep_nccl_dispatch_quantize(group, x, ids, probs, quantize, stream);
}

EpDispatchResult ep_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                             cudaStream_t stream) {
  return ep_dispatch(group, x, ids, probs, TensorView{}, stream);
}

void ep_combine(EpGroup& group, const EpHandle& handle, TensorView y, bool weighted,
                TensorView out, cudaStream_t stream) {
  check_combine(group, handle, y, "y", out, "out");
  combine(group, handle, y, weighted, out, stream);
}

void ep_dispatch_backward(EpGroup& group, const EpHandle& handle, TensorView grad_recv,
                          TensorView grad_x, cudaStream_t stream) {
  check_combine(group, handle, grad_recv, "grad_recv", grad_x, "grad_x");
  combine(group, handle, grad_recv, false, grad_x, stream);
}

void ep_combine_backward(EpGroup& group, const EpHandle& handle, TensorView dout, TensorView y,
                         bool weighted, TensorView grad_y, TensorView dprobs,
                         cudaStream_t stream) {
  check_handle(group, handle);
  const EpOptions& o = group.options();
  const Device dev = group.device();
  const int K = o.topk;
  const int64_t T = handle.num_tokens(), H = o.hidden;
  const int64_t capacity = group.capacity_rows();
  detail::expect(dout, "dout", Expect{{grad_dtype(o)}, {T, H}, dev});
  MOEFLOW_CHECK(dout.strides[1] == 1, "dout rows must be contiguous (stride(1) == 1)");
  detail::expect(y, "y", Expect{kFloats, {capacity, H}, dev});
  detail::expect(grad_y, "grad_y", Expect{{y.dtype}, {capacity, H}, dev});
  if (dprobs.defined()) {
    detail::expect(dprobs, "dprobs", Expect{{DType::kFloat32}, {T, K}, dev});
    MOEFLOW_CHECK(dprobs.is_contiguous(), "dprobs must be contiguous");
  }
  const detail::DeviceGuard device_guard(group.device());
  if (!is_nvlink(group))
    return cuda::ep_nccl_combine_backward(group, handle, dout, y, weighted, grad_y, dprobs,
                                          stream);
  MOEFLOW_CHECK(y.dtype == grad_dtype(o), "the nvlink backend needs y of the gradient dtype ",
                dtype_name(grad_dtype(o)),
                " (the token dtype, or backward_dtype with FP8 tokens), got ", y.str());
  const int64_t esz = int64_t(dtype_size(y.dtype));
  MOEFLOW_CHECK(y.strides[1] == 1 && grad_y.strides[1] == 1 &&
                    rows_16b(H, static_cast<int>(16 / esz),
                             {{dout.data, dout.strides[0] * esz},
                              {y.data, y.strides[0] * esz},
                              {grad_y.data, grad_y.strides[0] * esz}}),
                "the nvlink backend needs 16-byte aligned rows of dout, y and grad_y");
  cuda::ep_nvlink_combine_backward(group, handle, dout, y, weighted, grad_y, dprobs, stream);
}

}  // namespace moeflow
