// CPU reference of expert-parallel dispatch / combine: all W ranks simulated
// in one process, plain loops. The oracle for the device backends.
//
// dispatch: for each destination rank, collect the routed slots in (source
// rank, token, k) order, count them per local expert, lay the padded segments
// out with layout_expert (the same rule as the RoutingPlan), then copy rows.
// combine: per token, per destination rank ascending, an fma chain over k
// ascending; the per-rank partials are added in rank order.
#include "moeflow/ep_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/backends.h"
#include "core/internal.h"
#include "moeflow/plan.h"
#include "moeflow/quantize.h"

namespace moeflow::ep_reference {

using detail::load_float;
using detail::store_float;

namespace {

void check_config(const EpConfig& c) {
  MOEFLOW_CHECK(c.world_size > 0, "EpConfig.world_size must be > 0, got ", c.world_size);
  MOEFLOW_CHECK(c.num_experts > 0 && c.num_experts % c.world_size == 0,
                "EpConfig.num_experts must be a positive multiple of world_size=", c.world_size,
                ", got ", c.num_experts);
  MOEFLOW_CHECK(is_valid_align(c.align), "EpConfig.align must be one of 1, 16, 32, 64, 128, 256, got ",
                c.align);
  MOEFLOW_CHECK(c.max_tokens_per_rank >= 0, "EpConfig.max_tokens_per_rank must be >= 0, got ",
                c.max_tokens_per_rank);
  MOEFLOW_CHECK(c.capacity_rows < 0 || c.capacity_rows % c.align == 0,
                "EpConfig.capacity_rows must be a multiple of align=", c.align, ", got ", c.capacity_rows);
}

int64_t expert_of(const Tensor& ids, int64_t i) {
  return ids.dtype() == DType::kInt32 ? ids.data_ptr<int32_t>()[i] : ids.data_ptr<int64_t>()[i];
}

uint8_t* row_bytes(const Tensor& t, int64_t row) {
  const int64_t cols = t.ndim() > 1 ? t.size(1) : 1;
  return static_cast<uint8_t*>(t.data()) + row * cols * static_cast<int64_t>(dtype_size(t.dtype()));
}

}  // namespace

int64_t recv_capacity_rows(const EpConfig& c, int topk) {
  check_config(c);
  MOEFLOW_CHECK(topk >= 0, "topk must be >= 0, got ", topk);
  if (c.capacity_rows >= 0) return c.capacity_rows;
  const int64_t local = c.num_experts / c.world_size, a = c.align;
  const int64_t per_token = std::min<int64_t>(topk, local);
  const int64_t worst = c.max_tokens_per_rank * c.world_size * per_token + local * (a - 1);
  return (worst + a - 1) / a * a;
}

std::vector<RankReceive> dispatch(const std::vector<RankInput>& in, const EpConfig& c,
                                  Handle& handle) {
  check_config(c);
  const int W = c.world_size;
  MOEFLOW_CHECK(static_cast<int>(in.size()) == W, "dispatch: ", W, " rank inputs expected, got ",
                in.size());
  const int64_t H = in[0].x.defined() && in[0].x.ndim() == 2 ? in[0].x.size(1) : -1;
  const int K = in[0].ids.defined() && in[0].ids.ndim() == 2 ? static_cast<int>(in[0].ids.size(1)) : -1;
  MOEFLOW_CHECK(H >= 0 && K >= 0, "dispatch: rank 0 needs x [T,H] and ids [T,K]");
  const DType dt = in[0].x.dtype();
  const bool with_scales = in[0].scales.defined();
  const int64_t S = with_scales && in[0].scales.ndim() == 2 ? in[0].scales.size(1) : 0;
  const DType sdt = with_scales ? in[0].scales.dtype() : DType::kFloat32;
  for (int r = 0; r < W; ++r) {
    const RankInput& ri = in[r];
    MOEFLOW_CHECK(ri.x.defined() && ri.x.ndim() == 2 && ri.x.size(1) == H && ri.x.dtype() == dt,
                  "rank ", r, ": x must be ", dtype_name(dt), " [T,", H, "], got ", ri.x.view().str());
    const int64_t T = ri.x.size(0);
    MOEFLOW_CHECK(T <= c.max_tokens_per_rank, "rank ", r, ": ", T,
                  " tokens exceed EpConfig.max_tokens_per_rank=", c.max_tokens_per_rank);
    MOEFLOW_CHECK(ri.ids.defined() && ri.ids.sizes() == std::vector<int64_t>({T, K}) &&
                      (ri.ids.dtype() == DType::kInt32 || ri.ids.dtype() == DType::kInt64),
                  "rank ", r, ": ids must be int32 or int64 [", T, ",", K, "], got ", ri.ids.view().str());
    MOEFLOW_CHECK(ri.probs.defined() && ri.probs.sizes() == std::vector<int64_t>({T, K}) &&
                      ri.probs.dtype() == DType::kFloat32,
                  "rank ", r, ": probs must be float32 [", T, ",", K, "], got ", ri.probs.view().str());
    MOEFLOW_CHECK(ri.scales.defined() == with_scales &&
                      (!with_scales || (ri.scales.sizes() == std::vector<int64_t>({T, S}) &&
                                        ri.scales.dtype() == sdt)),
                  "rank ", r, ": scales must be ",
                  with_scales ? std::string(dtype_name(sdt)) + " [" + std::to_string(T) + "," +
                                    std::to_string(S) + "] (as rank 0's)"
                              : std::string("omitted (as on rank 0)"),
                  ", got ", ri.scales.view().str());
    for (int64_t i = 0; i < T * K; ++i) {
      const int64_t e = expert_of(ri.ids, i);
      MOEFLOW_CHECK(e >= -1 && e < c.num_experts, "rank ", r, ": ids[", i / K, ",", i % K, "] = ", e,
                    " is outside [-1, ", c.num_experts, ")");
    }
  }
  const int local = c.num_experts / W;
  const int64_t cap = recv_capacity_rows(c, K);
  handle.config = c;
  handle.config.capacity_rows = cap;
  handle.topk = K;
  handle.dest_rank.clear();
  handle.dest_row.clear();
  handle.recv_tokens_per_expert.clear();
  handle.recv_expert_row_offsets.clear();
  for (int r = 0; r < W; ++r) {
    const int64_t T = in[r].x.size(0);
    handle.dest_rank.push_back(Tensor::empty({T, K}, DType::kInt32));
    handle.dest_row.push_back(Tensor::empty({T, K}, DType::kInt64));
    for (int64_t i = 0; i < T * K; ++i) {
      const int64_t e = expert_of(in[r].ids, i);
      handle.dest_rank[r].data_ptr<int32_t>()[i] = e < 0 ? -1 : static_cast<int32_t>(e / local);
      handle.dest_row[r].data_ptr<int64_t>()[i] = -1;
    }
  }

  std::vector<RankReceive> out(W);
  const int64_t row_size = H * static_cast<int64_t>(dtype_size(dt));
  for (int q = 0; q < W; ++q) {
    RankReceive& rq = out[q];
    // Step 1: routed slots per local expert, in (rank, token, k) order.
    std::vector<int64_t> routed(local, 0);
    for (int r = 0; r < W; ++r)
      for (int64_t i = 0; i < in[r].ids.numel(); ++i) {
        const int64_t e = expert_of(in[r].ids, i);
        if (e >= 0 && e / local == q) ++routed[e % local];
      }
    // Step 2: padded segments (same rule as the RoutingPlan).
    rq.tokens_per_expert = Tensor::empty({local}, DType::kInt32);
    rq.expert_row_offsets = Tensor::empty({local + 1}, DType::kInt64);
    std::vector<ExpertLayout> lay(local);
    int64_t prefix = 0;
    for (int e = 0; e < local; ++e) {
      lay[e] = layout_expert(routed[e], prefix, cap, c.align);
      prefix += (routed[e] + c.align - 1) / c.align * c.align;
      rq.tokens_per_expert.data_ptr<int32_t>()[e] = lay[e].kept;
      rq.expert_row_offsets.data_ptr<int64_t>()[e] = lay[e].offset;
      rq.dropped += routed[e] - lay[e].kept;
    }
    rq.total_rows = local > 0 ? lay[local - 1].offset + lay[local - 1].padded : 0;
    rq.expert_row_offsets.data_ptr<int64_t>()[local] = rq.total_rows;
    // Step 3: rows. Rows past total_rows keep a 0xFF poison (never data).
    rq.x = Tensor::empty({cap, H}, dt);
    rq.probs = Tensor::empty({cap}, DType::kFloat32);
    rq.src_rank = Tensor::empty({cap}, DType::kInt32);
    rq.src_token = Tensor::empty({cap}, DType::kInt32);
    rq.src_k = Tensor::empty({cap}, DType::kInt32);
    for (Tensor* t : {&rq.x, &rq.probs, &rq.src_rank, &rq.src_token, &rq.src_k}) fill_bytes(*t, 0xFF);
    const int64_t scale_size = S * static_cast<int64_t>(dtype_size(sdt));
    if (with_scales) {
      rq.scales = Tensor::empty({cap, S}, sdt);
      fill_bytes(rq.scales, 0xFF);
    }
    for (int e = 0; e < local; ++e)  // pad rows
      for (int64_t row = lay[e].offset + lay[e].kept; row < lay[e].offset + lay[e].padded; ++row) {
        std::memset(row_bytes(rq.x, row), 0, row_size);
        if (with_scales && scale_size > 0) std::memset(row_bytes(rq.scales, row), 0, scale_size);
        rq.probs.data_ptr<float>()[row] = 0.0f;
        rq.src_rank.data_ptr<int32_t>()[row] = rq.src_token.data_ptr<int32_t>()[row] =
            rq.src_k.data_ptr<int32_t>()[row] = -1;
      }
    std::vector<int64_t> next(local, 0);
    for (int r = 0; r < W; ++r)
      for (int64_t i = 0; i < in[r].ids.numel(); ++i) {
        const int64_t e = expert_of(in[r].ids, i);
        if (e < 0 || e / local != q) continue;
        const int le = static_cast<int>(e % local);
        const int64_t rank = next[le]++;
        if (rank >= lay[le].kept) continue;  // dropped: over capacity
        const int64_t row = lay[le].offset + rank, t = i / K;
        std::memcpy(row_bytes(rq.x, row), row_bytes(in[r].x, t), row_size);
        if (with_scales && scale_size > 0)
          std::memcpy(row_bytes(rq.scales, row), row_bytes(in[r].scales, t), scale_size);
        rq.probs.data_ptr<float>()[row] = in[r].probs.data_ptr<float>()[i];
        rq.src_rank.data_ptr<int32_t>()[row] = r;
        rq.src_token.data_ptr<int32_t>()[row] = static_cast<int32_t>(t);
        rq.src_k.data_ptr<int32_t>()[row] = static_cast<int32_t>(i % K);
        handle.dest_row[r].data_ptr<int64_t>()[i] = row;
      }
    handle.recv_tokens_per_expert.push_back(rq.tokens_per_expert);
    handle.recv_expert_row_offsets.push_back(rq.expert_row_offsets);
  }
  return out;
}

std::vector<RankReceive> dispatch_quantize(const std::vector<RankInput>& in, const EpConfig& c,
                                           const QuantizeConfig& q, Handle& handle) {
  MOEFLOW_CHECK(q.scaling == QuantScaling::kBlock1x128 && !q.columnwise,
                "dispatch_quantize quantizes 1x128 blocks rowwise (QuantScaling::kBlock1x128, "
                "columnwise = false)");
  std::vector<RankInput> codes(in.size());
  for (size_t r = 0; r < in.size(); ++r) {
    const RankInput& ri = in[r];
    MOEFLOW_CHECK(ri.x.defined() && ri.x.ndim() == 2 &&
                      (ri.x.dtype() == DType::kBFloat16 || ri.x.dtype() == DType::kFloat16),
                  "rank ", r, ": dispatch_quantize takes x bfloat16 or float16 [T,H], got ",
                  ri.x.defined() ? ri.x.view().str() : std::string("none"));
    MOEFLOW_CHECK(!ri.scales.defined(), "rank ", r,
                  ": dispatch_quantize makes the scales; none may be given");
    const int64_t T = ri.x.size(0), H = ri.x.size(1);
    codes[r] = RankInput{Tensor::empty({T, H}, q.out), ri.ids, ri.probs,
                         Tensor::empty({T, (H + 127) / 128}, DType::kFloat32)};
    quantize(ri.x, q, codes[r].x, codes[r].scales);
  }
  return dispatch(codes, c, handle);
}

std::vector<Tensor> combine(const std::vector<Tensor>& y, const Handle& h,
                            const std::vector<Tensor>& weights, DType out_dtype,
                            DType wire_dtype) {
  const int W = h.config.world_size, K = h.topk;
  MOEFLOW_CHECK(wire_dtype == DType::kFloat32 || wire_dtype == DType::kBFloat16,
                "combine: wire_dtype must be float32 or bfloat16, got ", dtype_name(wire_dtype));
  MOEFLOW_CHECK(static_cast<int>(y.size()) == W, "combine: ", W, " expert outputs expected, got ", y.size());
  MOEFLOW_CHECK(weights.empty() || static_cast<int>(weights.size()) == W,
                "combine: weights must be empty or one [T,K] tensor per rank");
  const int64_t H = y[0].size(1);
  for (int q = 0; q < W; ++q)
    MOEFLOW_CHECK(y[q].ndim() == 2 && y[q].size(0) == h.config.capacity_rows && y[q].size(1) == H &&
                      dtype_is_arith_float(y[q].dtype()),
                  "combine: y[", q, "] must be float [", h.config.capacity_rows, ",", H, "], got ",
                  y[q].view().str());
  std::vector<Tensor> out;
  std::vector<float> total(H), partial(H);
  for (int r = 0; r < W; ++r) {
    const int64_t T = h.dest_rank[r].size(0);
    out.push_back(Tensor::empty({T, H}, out_dtype));
    const bool weighted = !weights.empty() && weights[r].defined();
    for (int64_t t = 0; t < T; ++t) {
      bool have = false;
      for (int q = 0; q < W; ++q) {
        int slots = 0;
        std::fill(partial.begin(), partial.end(), 0.0f);
        for (int k = 0; k < K; ++k) {
          const int64_t s = t * K + k;
          const int64_t row = h.dest_row[r].data_ptr<int64_t>()[s];
          if (h.dest_rank[r].data_ptr<int32_t>()[s] != q || row < 0) continue;
          const float w = weighted ? weights[r].data_ptr<float>()[s] : 1.0f;
          const void* src = row_bytes(y[q], row);
          for (int64_t j = 0; j < H; ++j) partial[j] = std::fma(w, load_float(src, y[q].dtype(), j), partial[j]);
          ++slots;
        }
        if (slots == 0) continue;
        if (wire_dtype == DType::kBFloat16 && q != r && slots > 1)  // crossed as bfloat16
          for (int64_t j = 0; j < H; ++j) partial[j] = detail::bf16_to_float(detail::float_to_bf16(partial[j]));
        for (int64_t j = 0; j < H; ++j) total[j] = have ? total[j] + partial[j] : partial[j];
        have = true;
      }
      for (int64_t j = 0; j < H; ++j) store_float(row_bytes(out[r], t), out_dtype, j, have ? total[j] : 0.0f);
    }
  }
  return out;
}

std::vector<Tensor> dispatch_backward(const std::vector<Tensor>& grad_recv, const Handle& h,
                                      DType out_dtype, DType wire_dtype) {
  return combine(grad_recv, h, {}, out_dtype, wire_dtype);
}

void combine_backward(const std::vector<Tensor>& dout, const Handle& h, const std::vector<Tensor>& y,
                      const std::vector<Tensor>& weights, std::vector<Tensor>& grad_y,
                      std::vector<Tensor>& dprobs) {
  const int W = h.config.world_size, K = h.topk;
  MOEFLOW_CHECK(static_cast<int>(dout.size()) == W && static_cast<int>(y.size()) == W,
                "combine_backward: one dout and one y per rank expected");
  const int64_t H = y[0].size(1), cap = h.config.capacity_rows;
  grad_y.clear();
  dprobs.clear();
  for (int q = 0; q < W; ++q) {
    grad_y.push_back(Tensor::empty({cap, H}, y[q].dtype()));
    fill_bytes(grad_y.back(), 0xFF);
  }
  // Pad rows of every segment are zero (rows past the used rows keep the poison).
  const int local = h.config.num_experts / W, a = h.config.align;
  for (int q = 0; q < W; ++q)
    for (int e = 0; e < local; ++e) {
      const int64_t off = h.recv_expert_row_offsets[q].data_ptr<int64_t>()[e];
      const int64_t kept = h.recv_tokens_per_expert[q].data_ptr<int32_t>()[e];
      for (int64_t row = off + kept; row < off + (kept + a - 1) / a * a; ++row)
        std::memset(row_bytes(grad_y[q], row), 0, H * dtype_size(grad_y[q].dtype()));
    }
  for (int r = 0; r < W; ++r) {
    const int64_t T = h.dest_rank[r].size(0);
    dprobs.push_back(Tensor::zeros({T, K}, DType::kFloat32));
    const bool weighted = !weights.empty() && weights[r].defined();
    for (int64_t s = 0; s < T * K; ++s) {
      const int64_t row = h.dest_row[r].data_ptr<int64_t>()[s];
      if (row < 0) continue;
      const int q = h.dest_rank[r].data_ptr<int32_t>()[s];
      const float w = weighted ? weights[r].data_ptr<float>()[s] : 1.0f;
      const void* g = row_bytes(dout[r], s / K);
      double dot = 0.0;
      for (int64_t j = 0; j < H; ++j) {
        const float gj = load_float(g, dout[r].dtype(), j);
        store_float(row_bytes(grad_y[q], row), grad_y[q].dtype(), j, w * gj);
        dot += static_cast<double>(gj) * load_float(row_bytes(y[q], row), y[q].dtype(), j);
      }
      dprobs[r].data_ptr<float>()[s] = static_cast<float>(dot);
    }
  }
}

}  // namespace moeflow::ep_reference
