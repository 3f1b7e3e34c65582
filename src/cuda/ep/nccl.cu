// Expert-parallel dispatch / combine, backend "nccl" (see moeflow/ep.h and
// docs/ep.md).
//
// dispatch, on every rank:
//   1. flags[q][t] = token t has a slot on rank q (one kernel, which also
//      writes the rank's routing message: T and every token's K ids and
//      probs, fixed size), an exclusive scan over the W*T flags (CUB) gives
//      each (q, t) its row j among the rows for q (send buffer:
//      destination-major, tokens ascending);
//   2. the routing messages go to every peer (one grouped ncclSend/ncclRecv
//      on the internal stream); one kernel counts both sides' rows per peer
//      and piece from them, copied to the host (the one host
//      synchronisation); later, on a side stream, each rank derives from
//      them the rows it receives (source rank ascending, then token), their
//      local ids, probs and single flags: no metadata round;
//   3. the eager piece (EpOptions::eager_share): rows j < B of each pair, B
//      from the previous dispatch's counts (known to both sides), packed
//      into slots of fixed address and sent as blocks of B rows before the
//      host has this dispatch's counts; the receiver's rows live in
//      per-source slots (row j of source q at q * tmax + j) so that the
//      addresses are known in advance;
//   4. after the synchronisation the rest of each pair's rows (one piece
//      after an eager piece, else `pipeline_chunks` pieces), exact row
//      ranges, FP8 scales before them;
//   5. build_plan over the received ids runs while the rows travel; the
//      rank's own rows are permuted straight from x (they never go through
//      NCCL), each peer's piece as soon as it has arrived: the expert-major
//      padded layout, in (source rank, token, k) order.
// combine and the backward functions: nccl_combine.cu.
//
// Streams: NCCL runs on the group's internal stream, the kernels on the
// caller's; events order the two both ways, and every function ends with the
// caller's stream waiting for the internal one.
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cub/device/device_scan.cuh>
#include <string>
#include <thread>

#include "core/backends.h"
#include "core/ep_backend.h"
#include "cuda/ep/group.h"
#include "moeflow/permute.h"
#include "moeflow/quantize.h"

namespace moeflow {
namespace ep_nccl {

// Grouped send/recv of per-peer row ranges of two buffers (bytes per row).
void exchange(EpGroup::Impl& g, const uint8_t* send, int64_t send_row_bytes,
              const std::vector<int64_t>& s_off, const std::vector<int64_t>& s_cnt, uint8_t* recv,
              int64_t recv_row_bytes, const std::vector<int64_t>& r_off,
              const std::vector<int64_t>& r_cnt, cudaStream_t stream) {
  if (g.tuning.debug_ranges && g.buf.arena_handle)
    for (int q = 0; q < g.world; ++q)
      std::fprintf(stderr, "[ep rank %d] peer %d: send %p + %lld, recv %p + %lld\n", g.rank, q,
                   static_cast<const void*>(send + s_off[q] * send_row_bytes),
                   static_cast<long long>(s_cnt[q] * send_row_bytes),
                   static_cast<void*>(recv + r_off[q] * recv_row_bytes),
                   static_cast<long long>(r_cnt[q] * recv_row_bytes));
  MOEFLOW_NCCL_CHECK(ncclGroupStart());
  for (int q = 0; q < g.world; ++q) {
    if (s_cnt[q] > 0)
      MOEFLOW_NCCL_CHECK(ncclSend(send + s_off[q] * send_row_bytes, s_cnt[q] * send_row_bytes,
                                  ncclUint8, q, g.comm, stream));
    if (r_cnt[q] > 0)
      MOEFLOW_NCCL_CHECK(ncclRecv(recv + r_off[q] * recv_row_bytes, r_cnt[q] * recv_row_bytes,
                                  ncclUint8, q, g.comm, stream));
  }
  MOEFLOW_NCCL_CHECK(ncclGroupEnd());
}

// The same without this rank's own range (no self transfer).
void exchange_peers(EpGroup::Impl& g, const uint8_t* send, int64_t send_row_bytes,
                    const std::vector<int64_t>& s_off, const std::vector<int64_t>& s_cnt,
                    uint8_t* recv, int64_t recv_row_bytes, const std::vector<int64_t>& r_off,
                    const std::vector<int64_t>& r_cnt, cudaStream_t stream) {
  std::vector<int64_t> sc = s_cnt, rc = r_cnt;
  sc[g.rank] = rc[g.rank] = 0;
  exchange(g, send, send_row_bytes, s_off, sc, recv, recv_row_bytes, r_off, rc, stream);
}

}  // namespace ep_nccl

namespace {

using namespace ep_nccl;

// --- Dispatch, step by step ----------------------------------------------------

// One dispatch's arguments and the values its steps share.
struct Dispatch {
  EpGroup::Impl& g;
  EpHandle::State& h;  // this dispatch's state (the handle's)
  TensorView x, ids, probs, scales;
  cudaStream_t stream;  // the caller's
  cudaStream_t cs;      // NCCL's
  int64_t T;
  int K, W, E, me, C;
  int64_t words;  // of a routing message
  bool eager = false;
  int64_t x_stride_bytes = 0;
  bool vec = false;  // 16-byte aligned token rows

  bool with_scales() const { return scales.defined() && g.size.scale_bytes > 0; }
  int32_t* own_route() const { return g.buf.routes.data_ptr<int32_t>() + me * words; }
  // Received rows sit in per-source slots of max_tokens_per_rank rows: row j
  // of source q at q * tmax + j, so that the eager piece's address is known
  // before the counts.
  uint8_t* slot_row(int q, int64_t j) const {
    return static_cast<uint8_t*>(g.buf.recv_x.data()) +
           (q * g.size.max_tokens + j) * g.size.row_bytes;
  }
  // The eager piece in parts (a small first part leaves sooner): part k holds
  // rows [bound(k), bound(k+1)) of each pair, bound(P) = the eager rows.
  EagerRows part_rows(const EagerRows& B, int k) const {
    const int P = g.tuning.eager_parts;
    EagerRows r{};
    for (int q = 0; q < W; ++q) r.n[q] = static_cast<int32_t>(int64_t{B.n[q]} * k / P);
    return r;
  }
  // The pieces of the rows after the counts: one after an eager piece.
  int data_pieces() const { return eager ? 1 : C; }
  // Rows [b, e) of the pair with q of piece c (of data_pieces()), past the
  // eager ones.
  std::pair<int64_t, int64_t> piece_rows(const std::vector<int64_t>& pc, int32_t first, int q,
                                         int c) const {
    const int64_t b = eager ? 0 : pc[q * (C + 1) + c];
    const int64_t e = pc[q * (C + 1) + (eager ? C : c + 1)];
    return {std::max<int64_t>(b, first), std::max<int64_t>(e, first)};
  }
  TokenRouting routing() const {
    return TokenRouting{ids.data,
                        ids.dtype != DType::kInt32,
                        probs.defined() ? probs.data_ptr<float>() : nullptr,
                        T,
                        K,
                        E,
                        g.size.experts_per_rank,
                        W,
                        me};
  }
  const int32_t* flags() const { return h.token_flags.data_ptr<int32_t>(); }
  const int32_t* rows() const { return h.token_rows.data_ptr<int32_t>(); }
  // Token rows of tokens [t0, t1) for the peers (where to: set by the caller).
  PackRowsParams pack_rows(int64_t t0, int64_t t1) const {
    PackRowsParams p{};
    p.x = static_cast<const uint8_t*>(x.data);
    p.x_stride_bytes = x_stride_bytes;
    p.row_bytes = g.size.row_bytes;
    p.vec = vec;
    p.num_tokens = T;
    p.t0 = t0;
    p.t1 = t1;
    p.world = W;
    p.skip = me;
    p.flags = flags();
    p.rows = rows();
    return p;
  }
};

// The eager piece's rows per peer, from the previous dispatch's counts
// (the same number on both sides of a pair).
void plan_eager_rows(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  LastDispatch& last = d.h.last;
  for (int q = 0; q < d.W; ++q) {
    auto rows = [&](const std::vector<int64_t>& cnt) {
      if (q == d.me || static_cast<int>(cnt.size()) != d.W) return int32_t{0};
      return static_cast<int32_t>(std::min<int64_t>(
          g.size.eager_max_rows, static_cast<int64_t>(std::floor(g.tuning.eager_share * cnt[q]))));
    };
    last.eager_send.n[q] = rows(g.prev_send_rows);
    last.eager_recv.n[q] = rows(g.prev_recv_rows);
    last.eager_offset.n[q] = q == 0 ? 0 : last.eager_offset.n[q - 1] + last.eager_send.n[q - 1];
    d.eager = d.eager || last.eager_send.n[q] > 0 || last.eager_recv.n[q] > 0;
  }
  // (a token goes to at most min(K, W - 1) peers, so the previous counts
  // add up to at most max_tokens x that)
  MOEFLOW_CHECK(
      last.eager_offset.n[d.W - 1] + last.eager_send.n[d.W - 1] <= g.size.eager_total_rows,
      "internal: eager rows exceed their buffer");
}

// Step 1: the sender's flags and this rank's routing message (also for
// T == 0: the pad entries and the message's T).
void flag_tokens(Dispatch& d) {
  SendFlagsParams p;
  p.routing = d.routing();
  p.flags = d.h.token_flags.data_ptr<int32_t>();
  p.single = d.h.single(d.W, d.T);
  p.route = d.own_route();
  launch_send_flags(p, d.stream);
}

// Step 2: the routing messages to every peer, on the NCCL stream, enqueued
// first (their kernel then gets the SMs before the packs take them). Both
// sides' counts follow from them; the host waits for those (its one
// synchronisation) while the sender side ranks and packs on the caller's
// stream and the eager piece travels. The receiver side (rows, ids, probs,
// plan) is derived from the same messages on the device after the pieces
// are enqueued.
void send_routes(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  int32_t* route = g.buf.routes.data_ptr<int32_t>();
  EpGroup::Impl::order(g.streams.ev_start, d.stream, d.cs);
  if (d.W > 1) {
    // each peer's head (its T) poisoned: a timeout names those still so
    for (int q = 0; q < d.W; ++q)
      if (q != d.me)
        MOEFLOW_CUDA_CHECK(cudaMemsetAsync(route + q * d.words, 0xFF, sizeof(int32_t), d.cs));
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < d.W; ++q) {
      if (q == d.me) continue;
      MOEFLOW_NCCL_CHECK(ncclSend(route + d.me * d.words, d.words, ncclInt32, q, g.comm, d.cs));
      MOEFLOW_NCCL_CHECK(ncclRecv(route + q * d.words, d.words, ncclInt32, q, g.comm, d.cs));
    }
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
  }
  MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_fork, d.cs));  // the messages are in
  g.mark("routes", d.cs);
}

// The sender side's ranking: each (q, t)'s row in the send buffer
// (destination-major, tokens ascending).
void rank_send_rows(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  size_t scan_bytes = static_cast<size_t>(g.buf.scan_workspace.numel());
  MOEFLOW_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(
      g.buf.scan_workspace.data(), scan_bytes, d.h.token_flags.data_ptr<int32_t>(),
      d.h.token_rows.data_ptr<int32_t>(), 2 * (d.W * d.T + 1), d.stream));
  g.mark("ranked", d.stream);
}

// Step 3a: pack the eager parts.
void pack_eager_parts(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  for (int k = 0; d.eager && k < g.tuning.eager_parts; ++k) {
    if (d.T > 0) {
      PackRowsParams p = d.pack_rows(0, d.T);
      p.lo = d.part_rows(d.h.last.eager_send, k);
      p.hi = d.part_rows(d.h.last.eager_send, k + 1);
      p.eager = static_cast<uint8_t*>(g.buf.eager_x.data());
      p.eager_off = d.h.last.eager_offset;
      launch_pack_rows(p, d.stream);
    }
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_eager_packed[k], d.stream));
    g.mark("peager" + std::to_string(k), d.stream);
  }
}

// Step 2b: both sides' row counts from the routing messages, to the host.
// counts: [sent W x (rows C | single rows C) | received, the same | invalid]
void count_rows(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  int32_t* counts = g.buf.route_counts.data_ptr<int32_t>();
  const size_t bytes = sizeof(int32_t) * (4 * d.W * d.C + 1);
  MOEFLOW_CUDA_CHECK(cudaMemsetAsync(counts, 0, bytes, d.cs));
  RouteCountsParams p;
  p.route = RouteView{g.buf.routes.data_ptr<int32_t>(), d.words, g.size.max_tokens, d.W, d.K,
                      g.size.experts_per_rank,          d.me};
  p.pieces = d.C;
  p.split = g.tuning.first_piece_permille;
  p.counts = counts;
  launch_route_counts(p, d.cs);
  MOEFLOW_CUDA_CHECK(
      cudaMemcpyAsync(g.buf.host_counts, counts, bytes, cudaMemcpyDeviceToHost, d.cs));
  MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_counts, d.cs));
  g.mark("counts", d.cs);
}

// Step 3b: the eager parts leave, each once packed.
void send_eager_parts(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  const int64_t row_bytes = g.size.row_bytes;
  for (int k = 0; d.eager && k < g.tuning.eager_parts; ++k) {
    const EagerRows slo = d.part_rows(d.h.last.eager_send, k),
                    shi = d.part_rows(d.h.last.eager_send, k + 1);
    const EagerRows rlo = d.part_rows(d.h.last.eager_recv, k),
                    rhi = d.part_rows(d.h.last.eager_recv, k + 1);
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(d.cs, g.streams.ev_eager_packed[k], 0));
    const uint8_t* se = static_cast<const uint8_t*>(g.buf.eager_x.data());
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < d.W; ++q) {
      if (q == d.me) continue;
      const int64_t sb = slo.n[q], ns = shi.n[q] - sb, rb = rlo.n[q], nr = rhi.n[q] - rb;
      if (ns > 0)
        MOEFLOW_NCCL_CHECK(ncclSend(se + (int64_t{d.h.last.eager_offset.n[q]} + sb) * row_bytes,
                                    ns * row_bytes, ncclUint8, q, g.comm, d.cs));
      if (nr > 0)
        MOEFLOW_NCCL_CHECK(ncclRecv(d.slot_row(q, rb), nr * row_bytes, ncclUint8, q, g.comm, d.cs));
    }
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_eager_sent[k], d.cs));
    g.mark("eager" + std::to_string(k), d.cs);
  }
}

// Step 1b: the sender side: ids / probs of every row (combine's weights and
// dprobs) and the scales, then the token rows for the peers piece by piece
// (this rank's own rows are permuted straight from x: own_row_token maps
// them back to tokens).
void pack_sender_side(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  if (d.T > 0) {
    PackMetaParams p;
    p.routing = d.routing();
    p.flags = d.flags();
    p.rows = d.rows();
    p.send_ids = d.h.send_ids.data_ptr<int32_t>();
    p.send_probs = d.h.send_probs.data_ptr<float>();
    p.own_row_token = g.buf.own_row_token.data_ptr<int32_t>();
    launch_pack_meta(p, d.stream);
    if (d.with_scales()) {
      const PackScalesParams ps{static_cast<const uint8_t*>(d.scales.data),
                                g.size.scale_bytes,
                                d.T,
                                d.W,
                                d.flags(),
                                d.rows(),
                                static_cast<uint8_t*>(g.buf.send_scales.data())};
      launch_pack_scales(ps, d.stream);
    }
  }
  g.mark("pmeta", d.stream);
  for (int c = 0; c < d.C; ++c) {
    const int split = g.tuning.first_piece_permille;
    const int64_t t0 = piece_start(d.T, c, d.C, split), t1 = piece_start(d.T, c + 1, d.C, split);
    if (t1 > t0) {
      PackRowsParams p = d.pack_rows(t0, t1);
      p.send_x = static_cast<uint8_t*>(g.buf.send_x.data());
      p.hi = d.h.last.eager_send;  // rows past the eager ones
      launch_pack_rows(p, d.stream);
    }
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_packed[c], d.stream));
    g.mark("pack" + std::to_string(c), d.stream);
  }
}

// The host's wait for the routing messages (dispatch's one synchronisation),
// bounded by EpOptions::timeout_s: past it, the ranks whose message has not
// arrived (their slot's head still poisoned by send_routes) are named.
void wait_for_counts(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  MOEFLOW_CHECK(!g.aborted, "the expert-parallel group was aborted by an earlier timeout");
  const double limit = g.tuning.timeout_s;
  const auto start = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    const cudaError_t e = cudaEventQuery(g.streams.ev_counts);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) MOEFLOW_CUDA_CHECK(e);
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (limit > 0 && waited > limit) break;
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  // Timed out: read the message heads on a stream of its own.
  std::vector<int32_t> heads(d.W, 0);
  cudaStream_t probe = nullptr;
  if (cudaStreamCreateWithFlags(&probe, cudaStreamNonBlocking) == cudaSuccess) {
    for (int q = 0; q < d.W; ++q)
      cudaMemcpyAsync(&heads[q], g.buf.routes.data_ptr<int32_t>() + q * d.words, sizeof(int32_t),
                      cudaMemcpyDeviceToHost, probe);
    cudaStreamSynchronize(probe);
    cudaStreamDestroy(probe);
  }
  std::string missing;
  for (int q = 0; q < d.W; ++q)
    if (q != d.me && heads[q] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
  g.aborted = true;
  if (g.owns_comm && g.comm) ncclCommAbort(g.comm), g.comm = nullptr;
  MOEFLOW_CHECK(false, "ep dispatch on rank ", g.rank, ": timed out after ", limit,
                " s waiting for the routing messages of rank(s) ",
                missing.empty() ? std::string("(unknown)") : missing,
                " (EpOptions::timeout_s); the group is aborted");
}

// Step 4a: the host waits for the counts (the one synchronisation), then
// lays out every pair's row ranges, per piece, and combine's way back.
void read_counts(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  LastDispatch& l = d.h.last;
  const int W = d.W, C = d.C;
  const int32_t* host = g.buf.host_counts;
  g.trace.host_mark("h_sync");
  wait_for_counts(d);
  g.trace.host_mark("h_woke");
  l.send_offset.assign(W, 0);
  l.send_rows.assign(W, 0);
  l.recv_offset.assign(W, 0);
  l.recv_rows.assign(W, 0);
  l.send_piece.assign(W * (C + 1), 0);
  l.recv_piece.assign(W * (C + 1), 0);
  int64_t so = 0, ro = 0;
  for (int q = 0; q < W; ++q) {
    for (int c = 0; c < C; ++c) {
      l.send_piece[q * (C + 1) + c + 1] = l.send_piece[q * (C + 1) + c] + host[q * 2 * C + c];
      l.recv_piece[q * (C + 1) + c + 1] = l.recv_piece[q * (C + 1) + c] + host[(W + q) * 2 * C + c];
    }
    l.send_offset[q] = so;
    l.send_rows[q] = l.send_piece[q * (C + 1) + C];
    so += l.send_rows[q];
    l.recv_offset[q] = ro;
    l.recv_rows[q] = l.recv_piece[q * (C + 1) + C];
    ro += l.recv_rows[q];
  }
  l.received_rows = ro;
  // combine's way back: single rows and float32 partials, per rank and piece
  for (auto* v : {&l.back_partial_offset, &l.back_single_offset, &l.held_partial_offset,
                  &l.held_single_offset})
    v->assign(W, 0);
  for (auto* v :
       {&l.back_partial_piece, &l.back_single_piece, &l.held_partial_piece, &l.held_single_piece})
    v->assign(W * (C + 1), 0);
  int64_t sso = 0, rso = 0;
  for (int q = 0; q < W; ++q) {
    for (int c = 0; c < C; ++c) {
      const int i = q * (C + 1) + c;
      l.back_single_piece[i + 1] = l.back_single_piece[i] + host[q * 2 * C + C + c];
      l.held_single_piece[i + 1] = l.held_single_piece[i] + host[(W + q) * 2 * C + C + c];
      l.back_partial_piece[i + 1] = l.send_piece[i + 1] - l.back_single_piece[i + 1];
      l.held_partial_piece[i + 1] = l.recv_piece[i + 1] - l.held_single_piece[i + 1];
    }
    l.back_single_offset[q] = sso;
    l.held_single_offset[q] = rso;
    l.back_partial_offset[q] = l.send_offset[q] - sso;
    l.held_partial_offset[q] = l.recv_offset[q] - rso;
    sso += l.back_single_piece[q * (C + 1) + C];
    rso += l.held_single_piece[q * (C + 1) + C];
  }
  l.back_partial_rows = so - sso;
  l.held_partial_rows = ro - rso;
  g.prev_send_rows = l.send_rows;  // the next dispatch's eager piece
  g.prev_recv_rows = l.recv_rows;
}

// Step 4b: the scales of every peer's rows (FP8 dispatch), then the token
// rows piece by piece (peers only): piece c holds rows [pc(c), pc(c+1)) of
// each pair's range; after an eager piece, the rest of each range as one
// piece (every NCCL group on the stream costs a gap on the link).
void send_rows(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  const LastDispatch& l = d.h.last;
  const int64_t row_bytes = g.size.row_bytes;
  if (d.with_scales()) {
    MOEFLOW_CUDA_CHECK(
        cudaStreamWaitEvent(d.cs, g.streams.ev_packed[0], 0));  // (packed before the rows)
    exchange_peers(g, static_cast<const uint8_t*>(g.buf.send_scales.data()), g.size.scale_bytes,
                   l.send_offset, l.send_rows, static_cast<uint8_t*>(g.buf.recv_scales.data()),
                   g.size.scale_bytes, l.recv_offset, l.recv_rows, d.cs);
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_scales, d.cs));
  }
  const uint8_t* send_x = static_cast<const uint8_t*>(g.buf.send_x.data());
  for (int c = 0; c < d.data_pieces(); ++c) {
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(d.cs, g.streams.ev_packed[d.eager ? d.C - 1 : c], 0));
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < d.W; ++q) {
      if (q == d.me) continue;
      const auto [sb, se] = d.piece_rows(l.send_piece, l.eager_send.n[q], q, c);
      const auto [rb, re] = d.piece_rows(l.recv_piece, l.eager_recv.n[q], q, c);
      if (se > sb)
        MOEFLOW_NCCL_CHECK(ncclSend(send_x + (l.send_offset[q] + sb) * row_bytes,
                                    (se - sb) * row_bytes, ncclUint8, q, g.comm, d.cs));
      if (re > rb)
        MOEFLOW_NCCL_CHECK(
            ncclRecv(d.slot_row(q, rb), (re - rb) * row_bytes, ncclUint8, q, g.comm, d.cs));
    }
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_piece[c], d.cs));
    g.mark("x" + std::to_string(c), d.cs);
  }
  g.trace.host_mark("h_x");
}

// Step 2c: the receiver side of the routes, on the side stream: every
// received row's local ids, probs and single flag (rows past the received
// ones stay unrouted, -1, for the plan).
void unpack_routes(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  cudaStream_t as = g.streams.side;
  MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(as, g.streams.ev_fork, 0));
  const int64_t N = d.W * g.size.max_tokens;
  int32_t* rfl = g.buf.recv_flags.data_ptr<int32_t>();
  int32_t* rps = g.buf.recv_flag_scan.data_ptr<int32_t>();
  const RouteView route{g.buf.routes.data_ptr<int32_t>(), d.words, g.size.max_tokens, d.W, d.K,
                        g.size.experts_per_rank,          d.me};
  launch_recv_flags(RecvFlagsParams{route, rfl}, as);
  size_t rb = static_cast<size_t>(g.buf.recv_scan_workspace.numel());
  MOEFLOW_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(g.buf.recv_scan_workspace.data(), rb, rfl, rps,
                                                   2 * (N + 1), as));
  MOEFLOW_CUDA_CHECK(cudaMemsetAsync(d.h.recv_ids.data(), 0xFF, d.h.recv_ids.nbytes(), as));
  const RecvUnpackParams p{route,
                           rfl,
                           rps,
                           d.h.recv_ids.data_ptr<int32_t>(),
                           d.h.recv_probs.data_ptr<float>(),
                           d.h.recv_single.data_ptr<int32_t>(),
                           d.h.recv_single_pos.data_ptr<int32_t>()};
  launch_recv_unpack(p, as);
  MOEFLOW_CUDA_CHECK(cudaEventRecord(g.streams.ev_join, as));
}

// Step 5: unpack + permute + pad: the received rows routed over the local
// experts, the own rows first, then every peer's piece once it arrived.
void permute_received(Dispatch& d) {
  EpGroup::Impl& g = d.g;
  const LastDispatch& l = d.h.last;
  const Device dev = Device::cuda(g.device);
  MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(d.stream, g.streams.ev_join, 0));
  moeflow::build_plan(d.h.recv_ids, d.h.plan, g.buf.plan_workspace, d.stream);
  g.mark("plan", d.stream);
  PermuteExtras extras;
  extras.probs = d.h.recv_probs;
  extras.permuted_probs = d.h.out_probs;
  if (d.scales.defined()) {  // own rows: the caller's scales, by token (own_row_token)
    extras.scales = d.scales;
    extras.permuted_scales = d.h.out_scales;
  }
  const int64_t H = g.opt.hidden;
  // A peer's received rows [b, e): permuted from its slot into their rows.
  auto permute_peer = [&](int q, int64_t b, int64_t e, int blocks) {
    if (e <= b) return;
    const int64_t first = l.recv_offset[q] + b;
    if (d.scales.defined())  // the rows' scales, row by row with them
      extras.scales = TensorView::strided(
          static_cast<uint8_t*>(g.buf.recv_scales.data()) + first * g.size.scale_bytes,
          g.opt.scale_dtype, dev, {e - b, g.opt.scale_cols}, {g.opt.scale_cols, 1});
    const TensorView rows =
        TensorView::strided(d.slot_row(q, b), g.opt.dtype, dev, {e - b, H}, {H, 1});
    cuda::permute_tokens(rows, first, e - b, false, d.h.plan, d.h.out_x, extras, d.stream,
                         nullptr, blocks);
  };
  // own rows straight from x, with the pad rows
  const int ob = g.opt.overlap_blocks;
  cuda::permute_tokens(d.x, l.recv_offset[d.me], l.recv_rows[d.me], true, d.h.plan, d.h.out_x,
                       extras, d.stream, g.buf.own_row_token.data_ptr<int32_t>(), ob);
  g.mark("self", d.stream);
  for (int k = 0; d.eager && k < g.tuning.eager_parts;
       ++k) {  // the eager parts (with scales: all there by then)
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(
        d.stream, d.with_scales() ? g.streams.ev_scales : g.streams.ev_eager_sent[k], 0));
    const EagerRows lo = d.part_rows(l.eager_recv, k), hi = d.part_rows(l.eager_recv, k + 1);
    for (int q = 0; q < d.W; ++q)
      if (q != d.me)
        permute_peer(q, std::min<int64_t>(lo.n[q], l.recv_rows[q]),
                     std::min<int64_t>(hi.n[q], l.recv_rows[q]), ob);
    g.mark("perm_e" + std::to_string(k), d.stream);
  }
  const int DP = d.data_pieces();
  for (int c = 0; c < DP; ++c) {
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(d.stream, g.streams.ev_piece[c], 0));
    for (int q = 0; q < d.W; ++q) {
      if (q == d.me) continue;
      const auto [b, e] = d.piece_rows(l.recv_piece, l.eager_recv.n[q], q, c);
      permute_peer(q, b, e, c + 1 < DP ? ob : 0);
    }
    g.mark("perm" + std::to_string(c), d.stream);
  }
}

}  // namespace

namespace cuda {

EpDispatchResult ep_nccl_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                                  TensorView scales, cudaStream_t stream) {
  EpGroup::Impl& g = group.impl();
  const int64_t T = x.shape[0];
  MOEFLOW_CHECK(!g.aborted, "the expert-parallel group was aborted by an earlier timeout");
  EpHandle handle = g.new_handle(T, group);
  EpHandle::State& h = handle.state();
  h.last = LastDispatch{};
  h.last.num_tokens = T;
  g.mark("start", stream);
  Dispatch d{g,
             h,
             x,
             ids,
             probs,
             scales,
             stream,
             g.streams.nccl,
             T,
             g.opt.topk,
             g.world,
             g.opt.num_experts,
             g.rank,
             g.chunks(),
             route_words(g.size.max_tokens, g.opt.topk)};
  h.last.pieces = d.C;
  plan_eager_rows(d);
  flag_tokens(d);
  send_routes(d);
  rank_send_rows(d);
  d.x_stride_bytes = x.strides[0] * static_cast<int64_t>(dtype_size(x.dtype));
  d.vec = addr(x.data) % 16 == 0 && d.x_stride_bytes % 16 == 0 && g.size.row_bytes % 16 == 0;
  pack_eager_parts(d);
  count_rows(d);
  send_eager_parts(d);
  pack_sender_side(d);
  read_counts(d);
  send_rows(d);
  unpack_routes(d);
  permute_received(d);
  g.trace.print("dispatch", g.rank);
  const int32_t invalid = g.buf.host_counts[4 * d.W * d.C];
  MOEFLOW_CHECK(invalid == 0, "ids: ", invalid, " routing entries outside [-1, ", d.E, ") on rank ",
                g.rank, " (treated as unrouted; the dispatch completed)");
  return EpDispatchResult{h.out_x,
                          h.out_probs,
                          scales.defined() ? h.out_scales.view() : TensorView{},
                          &h.plan,
                          h.last.received_rows,
                          std::move(handle)};
}

EpDispatchResult ep_nccl_dispatch_quantize(EpGroup& group, TensorView x, TensorView ids,
                                           TensorView probs, const QuantizeConfig& quant,
                                           cudaStream_t stream) {
  return ep_dispatch_quantize_staged(group, x, ids, probs, quant, stream);
}

EpDispatchResult ep_dispatch_quantize_staged(EpGroup& group, TensorView x, TensorView ids,
                                             TensorView probs, const QuantizeConfig& quant,
                                             cudaStream_t stream) {
  EpGroup::Impl& g = group.impl();
  const int64_t T = x.shape[0], H = g.opt.hidden, tmax = std::max<int64_t>(1, g.size.max_tokens);
  if (!g.quant_x.defined()) {
    const Device dev = Device::cuda(g.device);
    g.quant_x = Tensor::empty({tmax, H}, g.opt.dtype, dev);
    g.quant_scales = Tensor::empty({tmax, g.opt.scale_cols}, DType::kFloat32, dev);
  }
  const TensorView q(g.quant_x.data(), g.opt.dtype, g.quant_x.device(), {T, H});
  const TensorView s(g.quant_scales.data(), DType::kFloat32, g.quant_x.device(),
                     {T, g.opt.scale_cols});
  moeflow::quantize(x, quant, q, s, TensorView{}, TensorView{}, stream);
  if (g.opt.backend == EpBackend::kNvlink)
    return ep_nvlink_dispatch(group, q, ids, probs, s, nullptr, stream);
  return ep_nccl_dispatch(group, q, ids, probs, s, stream);
}

}  // namespace cuda
}  // namespace moeflow
