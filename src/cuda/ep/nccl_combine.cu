// Expert-parallel combine and its backward, backend "nccl" (see nccl.cu for
// dispatch, docs/ep.md).
//
// combine: on the rank holding the slots, the holder kernel sums each
// received token's slots (k ascending, weighted by the received probs) into
// one float32 partial, piece by piece, each piece sent back as soon as it is
// summed (the dispatch's row ranges reversed); a token with one slot there
// goes back as that slot's row of y (half the bytes for 16-bit y) and is
// weighted at home with the same bits. The rank's own partials stay in
// place; one kernel adds each home token's partials in ascending rank order.
// With EpOptions::combine_wire_dtype bfloat16 the holder rounds the peers'
// partials to bfloat16 (half the bytes on the wire); its own stay float32,
// after the single rows.
// combine backward: dout rows go along the dispatch's routes, the expert rank
// computes the gradient of its unpermute, and the dot products go home.
// dispatch backward is a combine without weights.
#include <nccl.h>

#include "core/backends.h"
#include "core/ep_backend.h"
#include "cuda/ep/group.h"
#include "moeflow/permute.h"

namespace moeflow {
namespace {

using namespace ep_nccl;

// Grouped send/recv of piece c of the per-peer row ranges, peers only (no
// self transfer): rows [off[q] + pc[q*(P+1) + c], off[q] + pc[q*(P+1) + c + 1]).
void exchange_piece(EpGroup::Impl& g, int P, int c, const uint8_t* send, int64_t send_row_bytes,
                    const std::vector<int64_t>& s_off, const std::vector<int64_t>& s_pc,
                    uint8_t* recv, int64_t recv_row_bytes, const std::vector<int64_t>& r_off,
                    const std::vector<int64_t>& r_pc, cudaStream_t stream) {
  MOEFLOW_NCCL_CHECK(ncclGroupStart());
  for (int q = 0; q < g.world; ++q) {
    if (q == g.rank) continue;
    const int64_t sb = s_pc[q * (P + 1) + c], se = s_pc[q * (P + 1) + c + 1];
    const int64_t rb = r_pc[q * (P + 1) + c], re = r_pc[q * (P + 1) + c + 1];
    if (se > sb)
      MOEFLOW_NCCL_CHECK(ncclSend(send + (s_off[q] + sb) * send_row_bytes,
                                  (se - sb) * send_row_bytes, ncclUint8, q, g.comm, stream));
    if (re > rb)
      MOEFLOW_NCCL_CHECK(ncclRecv(recv + (r_off[q] + rb) * recv_row_bytes,
                                  (re - rb) * recv_row_bytes, ncclUint8, q, g.comm, stream));
  }
  MOEFLOW_NCCL_CHECK(ncclGroupEnd());
}

}  // namespace

namespace cuda {

// Piece c of every peer's rows is summed, then sent back while the next is
// summed; this rank's own partials are summed last and stay in place; the
// home tokens of piece c are added up as soon as their partials are all back.
// A row with one slot here goes back as that slot's row of y (ysize bytes
// per element instead of 4), after the float32 partials of the buffer.
void ep_nccl_combine(EpGroup& group, const EpHandle& handle, TensorView y, bool weighted,
                     TensorView out, cudaStream_t stream) {
  EpGroup::Impl& g = group.impl();
  EpHandle::State& h = handle.state();
  const LastDispatch& l = h.last;
  MOEFLOW_CHECK(!g.aborted, "the expert-parallel group was aborted by an earlier timeout");
  const int W = g.world, me = g.rank, C = l.pieces, K = g.opt.topk;
  const int64_t H = g.opt.hidden;
  const float* weights = weighted ? h.recv_probs.data_ptr<float>() : nullptr;
  cudaStream_t cs = g.streams.nccl;
  const bool bf16 = g.opt.combine_wire_dtype == DType::kBFloat16;
  const int64_t ysize = static_cast<int64_t>(dtype_size(y.dtype)), yb = H * ysize;
  const int64_t pb = H * (bf16 ? 2 : 4);  // a partial row on the wire
  uint8_t* partial_b = static_cast<uint8_t*>(g.buf.held_partials.data());
  uint8_t* back_b = static_cast<uint8_t*>(g.buf.home_partials.data());
  // bfloat16 wire: the peers' partials packed without the own ones (the
  // rows of the peers after this rank move down by own_n), then the single
  // rows, then the own float32 partials (16-byte aligned: hidden % 8 == 0).
  const int64_t own_first = l.held_partial_offset[me];
  const int64_t own_n = bf16 ? l.held_partial_piece[me * (C + 1) + C] : 0;
  std::vector<int64_t> held_off = l.held_partial_offset;
  for (int q = me + 1; q < W; ++q) held_off[q] -= own_n;
  uint8_t* partial_s = partial_b + (l.held_partial_rows - own_n) * pb;  // single rows sent
  uint8_t* own_b = bf16 ? partial_s + (l.received_rows - l.held_partial_rows) * yb : partial_b;
  uint8_t* back_s = back_b + l.back_partial_rows * pb;  // single rows received
  // The holder's sums of received rows [r0, r0 + n), from rank q.
  auto holder = [&](int q, int64_t r0, int64_t n, int max_blocks) {
    if (n <= 0) return;
    HolderParams p;
    p.y = y.data;
    p.y_stride = y.strides[0];
    p.hidden = H;
    p.dest_row = h.plan.dest_row.data_ptr<int64_t>();
    p.recv_ids = h.recv_ids.data_ptr<int32_t>();
    p.weights = weights;
    p.topk = K;
    p.r0 = r0;
    p.n = n;
    p.recv_single = h.recv_single.data_ptr<int32_t>();
    p.recv_single_pos = h.recv_single_pos.data_ptr<int32_t>();
    const bool own = q == me;
    p.partial = own ? own_b : partial_b;
    p.partial_bf16 = bf16 && !own;
    p.partial_shift = !bf16 ? 0 : own ? own_first : q > me ? own_n : 0;
    p.single_rows = partial_s;
    launch_holder(p, y.dtype, max_blocks > 0 ? max_blocks : 4 * g.sm_count, stream);
  };
  g.mark("start", stream);
  for (int c = 0; c < C; ++c) {
    for (int q = 0; q < W; ++q) {
      if (q == me) continue;
      const int64_t b = l.recv_piece[q * (C + 1) + c], e = l.recv_piece[q * (C + 1) + c + 1];
      holder(q, l.recv_offset[q] + b, e - b, c > 0 ? g.opt.overlap_blocks : 0);
    }
    g.mark("unperm" + std::to_string(c), stream);
    EpGroup::Impl::order(g.streams.ev_piece[c], stream, cs);
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    exchange_piece(g, C, c, partial_b, pb, held_off, l.held_partial_piece, back_b, pb,
                   l.back_partial_offset, l.back_partial_piece, cs);
    exchange_piece(g, C, c, partial_s, yb, l.held_single_offset, l.held_single_piece, back_s, yb,
                   l.back_single_offset, l.back_single_piece, cs);
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_back[c], cs));
    g.mark("back" + std::to_string(c), cs);
  }
  holder(me, l.recv_offset[me], l.recv_rows[me], g.opt.overlap_blocks);
  g.mark("self", stream);
  const int64_t T = l.num_tokens;
  CombineSumParams p;
  p.back = back_b;
  p.back_bf16 = bf16;
  p.back_single = back_s;
  p.partial = reinterpret_cast<const float*>(own_b);
  p.rank = me;
  // own rows: partial index = recv row - single rows received before them
  // (bfloat16 wire: counted from the first own partial)
  p.self_shift = l.recv_offset[me] - l.send_offset[me] - l.held_single_offset[me] -
                 (bf16 ? own_first : 0);
  p.hidden = H;
  p.num_tokens = T;
  p.world = W;
  p.topk = K;
  p.flags = h.token_flags.data_ptr<int32_t>();
  p.rows = h.token_rows.data_ptr<int32_t>();
  p.single = h.single(W, T);
  p.single_pos_raw = h.single_pos_raw(W, T);
  p.single_base = h.single_pos_base(W, T);
  p.send_ids = h.send_ids.data_ptr<int32_t>();
  p.send_probs = h.send_probs.data_ptr<float>();
  p.weighted = weighted;
  p.out = out.data;
  p.out_stride = out.strides[0];
  const bool vec4 =
      H % 4 == 0 && addr(out.data) % (4 * dtype_size(out.dtype)) == 0 && out.strides[0] % 4 == 0;
  for (int c = 0; c < C; ++c) {
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(stream, g.streams.ev_back[c], 0));
    const int split = g.tuning.first_piece_permille;
    const int64_t t0 = piece_start(T, c, C, split), t1 = piece_start(T, c + 1, C, split);
    if (t1 == t0) continue;
    p.t0 = t0;
    launch_combine_sum(p, y.dtype, out.dtype, vec4, t1 - t0, stream);
    g.mark("sum" + std::to_string(c), stream);
  }
  g.trace.print("combine", g.rank);
}

// A dispatch of dout along the last dispatch's routes, the gradient of the
// holder's unpermute on the expert rank, and the dot products sent home.
void ep_nccl_combine_backward(EpGroup& group, const EpHandle& handle, TensorView dout,
                              TensorView y, bool weighted, TensorView grad_y, TensorView dprobs,
                              cudaStream_t stream) {
  EpGroup::Impl& g = group.impl();
  EpHandle::State& h = handle.state();
  const LastDispatch& l = h.last;
  MOEFLOW_CHECK(!g.aborted, "the expert-parallel group was aborted by an earlier timeout");
  const Device dev = Device::cuda(g.device);
  const int K = g.opt.topk, W = g.world;
  const int64_t T = l.num_tokens, H = g.opt.hidden;
  const int64_t grad_row_bytes = g.size.grad_row_bytes;
  const int32_t* flags = h.token_flags.data_ptr<int32_t>();
  const int32_t* pos = h.token_rows.data_ptr<int32_t>();
  if (T > 0) {  // dout rows along the dispatch routes
    PackRowsParams p;
    p.x = static_cast<const uint8_t*>(dout.data);
    p.x_stride_bytes = dout.strides[0] * static_cast<int64_t>(dtype_size(dout.dtype));
    p.row_bytes = grad_row_bytes;
    p.vec = addr(dout.data) % 16 == 0 && p.x_stride_bytes % 16 == 0 && grad_row_bytes % 16 == 0;
    p.num_tokens = T;
    p.t0 = 0;
    p.t1 = T;
    p.world = W;
    p.skip = -1;
    p.flags = flags;
    p.rows = pos;
    p.send_x = static_cast<uint8_t*>(g.buf.send_x.data());
    p.lo = EagerRows{};
    p.hi = EagerRows{};
    p.eager = nullptr;
    p.eager_off = EagerRows{};
    launch_pack_rows(p, stream);
  }
  MOEFLOW_NCCL_CHECK(ncclGroupStart());
  exchange(g, static_cast<const uint8_t*>(g.buf.send_x.data()), grad_row_bytes, l.send_offset,
           l.send_rows, static_cast<uint8_t*>(g.buf.recv_x.data()), grad_row_bytes, l.recv_offset,
           l.recv_rows, stream);
  MOEFLOW_NCCL_CHECK(ncclGroupEnd());
  // On the expert rank: the gradient of its unpermute (rows past the received
  // ones have no slots and are never read).
  const TensorView recv_d = TensorView::strided(g.buf.recv_x.data(), g.size.grad_dtype, dev,
                                                {g.size.max_recv_rows, H}, {H, 1});
  moeflow::unpermute_backward(
      recv_d, h.plan, y, weighted ? TensorView(h.recv_probs) : TensorView{}, grad_y,
      dprobs.defined() ? TensorView(g.buf.recv_dprobs) : TensorView{}, stream);
  if (!dprobs.defined()) return;
  const int64_t pb = int64_t{K} * 4;
  MOEFLOW_NCCL_CHECK(ncclGroupStart());
  exchange(g, static_cast<const uint8_t*>(g.buf.recv_dprobs.data()), pb, l.recv_offset, l.recv_rows,
           static_cast<uint8_t*>(g.buf.back_dprobs.data()), pb, l.send_offset, l.send_rows, stream);
  MOEFLOW_NCCL_CHECK(ncclGroupEnd());
  if (T == 0) return;
  const DprobsParams p{g.buf.back_dprobs.data_ptr<float>(),
                       h.send_ids.data_ptr<int32_t>(),
                       T,
                       K,
                       W,
                       flags,
                       pos,
                       dprobs.data_ptr<float>()};
  launch_dprobs(p, stream);
}

}  // namespace cuda
}  // namespace moeflow
