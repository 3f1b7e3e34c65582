// Expert-parallel dispatch / combine, backend "nccl" (see moeflow/ep.h).
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
// combine: unpermute of the expert outputs into one float32 partial per
// received token (slots ascending, weighted by the received probs), piece by
// piece, each piece sent back as soon as it is summed (same row ranges
// reversed); the rank's own partials stay in place; one kernel adds each
// token's partials in ascending rank order.
//
// Streams: NCCL runs on the group's internal stream, the kernels on the
// caller's; events order the two both ways, and every function ends with the
// caller's stream waiting for the internal one.
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cub/device/device_scan.cuh>
#include <exception>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <type_traits>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/backends.h"
#include "core/internal.h"
#include "cuda/common.cuh"
#include "moeflow/dispatch.h"
#include "moeflow/ep.h"
#include "moeflow/permute.h"

#define MOEFLOW_NCCL_CHECK(expr)                                                             \
  do {                                                                                       \
    const ncclResult_t r_ = (expr);                                                          \
    MOEFLOW_CHECK(r_ == ncclSuccess, "NCCL error in ", #expr, ": ", ncclGetErrorString(r_)); \
  } while (0)

namespace moeflow {

using detail::Expect;

namespace {

constexpr int kMaxWorld = 64;  // ranks per group (combine keeps one pointer per rank)
constexpr int kMaxChunks = 16;

// flags[q*T + t] = 1 when token t has a valid slot on rank q; invalid ids
// (outside [-1, E)) are counted and ignored. single[q*T + t] = 1 when that
// is exactly one slot and q is a peer: combine brings it home as its row of
// y instead of a float32 partial. Both arrays end in a zero pad entry
// [W*T], and single starts right after flags' pad, so that one exclusive scan
// of the two gives both prefixes (single's offset by the flags' total).
// route: this rank's routing message to every peer, fixed size
// (max_tokens_per_rank): [T | pad] then per token its K global ids (-1 where
// unrouted, -2 where invalid: outside [-1, E)) and K probs (float bits, 0
// without probs). ep_route_counts_kernel counts the invalid ones.
constexpr int kRouteHead = 4;  // words before the tokens
__host__ __device__ inline int64_t route_words(int64_t tmax, int K) {
  return kRouteHead + tmax * 2 * K;
}
template <typename IdT>
__global__ void ep_flags_kernel(const IdT* ids, const float* probs, int64_t T, int K, int E,
                                int epr, int W, int self, int32_t* flags, int32_t* single,
                                int32_t* route) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t == 0) {
    flags[W * T] = single[W * T] = 0;
    route[0] = static_cast<int32_t>(T);
  }
  if (t >= T) return;
  for (int q = 0; q < W; ++q) flags[q * T + t] = single[q * T + t] = 0;
  int32_t* rt = route + kRouteHead + t * 2 * K;
  for (int k = 0; k < K; ++k) {
    const int64_t id = static_cast<int64_t>(ids[t * K + k]);
    const bool ok = id >= 0 && id < E;
    if (ok) {
      flags[(id / epr) * T + t] = 1;
      ++single[(id / epr) * T + t];  // this thread's entries only: slots per rank
    }
    rt[k] = ok ? static_cast<int32_t>(id) : id == -1 ? -1 : -2;
    rt[K + k] = __float_as_int(probs ? probs[t * K + k] : 0.0f);
  }
  for (int q = 0; q < W; ++q) single[q * T + t] = q != self && single[q * T + t] == 1;
}

// Receiver side (nccl backend), from the routing messages of every rank
// (route + q * words; this rank's own among them): the same two flags over
// (source q, token t < T_q) for this rank, rfl[q*tmax + t] and
// rsg = rfl + N + 1 (N = W*tmax, zero pads at N), so that one exclusive scan
// gives every received row its index (source-major, tokens ascending: the
// order the rows arrive in) and its single rows' prefix.
__global__ void ep_route_flags_kernel(const int32_t* route, int64_t words, int64_t tmax, int W,
                                      int K, int epr, int me, int32_t* rfl) {
  const int64_t N = W * tmax;
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i > N) return;
  int32_t* rsg = rfl + N + 1;
  if (i == N) {
    rfl[N] = rsg[N] = 0;
    return;
  }
  const int q = static_cast<int>(i / tmax);
  const int64_t t = i % tmax;
  const int32_t* msg = route + q * words;
  int n = 0;
  if (t < msg[0]) {
    const int32_t* rt = msg + kRouteHead + t * 2 * K;
    for (int k = 0; k < K; ++k) n += rt[k] >= 0 && rt[k] / epr == me;
  }
  rfl[i] = n > 0;
  rsg[i] = q != me && n == 1;
}

// Every received row's K local ids (-1: a slot elsewhere) and probs (what the
// sender's pack_meta writes for this rank), rsingle / rspos (the row has one
// slot here and comes from a peer; the single rows before it), from the scan
// rps of ep_route_flags_kernel's flags.
__global__ void ep_route_unpack_kernel(const int32_t* route, int64_t words, int64_t tmax, int W,
                                       int K, int epr, int me, const int32_t* rfl,
                                       const int32_t* rps, int32_t* recv_ids, float* recv_probs,
                                       int32_t* rsingle, int32_t* rspos) {
  const int64_t N = W * tmax;
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i > N) return;
  const int32_t base = rps[N];  // rows received
  if (i == N) {
    rsingle[base] = 0;
    rspos[base] = rps[N + 1 + N] - base;
    return;
  }
  if (!rfl[i]) return;
  const int q = static_cast<int>(i / tmax);
  const int64_t t = i % tmax, row = rps[i];
  const int32_t* rt = route + q * words + kRouteHead + t * 2 * K;
  for (int k = 0; k < K; ++k) {
    const int32_t id = rt[k];
    const bool here = id >= 0 && id / epr == me;
    recv_ids[row * K + k] = here ? id - me * epr : -1;
    recv_probs[row * K + k] = here ? __int_as_float(rt[K + k]) : 0.0f;
  }
  rsingle[row] = rfl[N + 1 + i];
  rspos[row] = rps[N + 1 + i] - base;
}

// First home token of piece c of C (c = C: T). With two pieces, `split`
// (per mille of T, 0: halves) sets where the second starts.
__host__ __device__ inline int64_t piece_start(int64_t T, int c, int C, int split) {
  if (C == 2 && c == 1 && split > 0) return T * split / 1000;
  return T * c / C;
}

// Both sides' counts straight from the routing messages, added up into
// zeroed counts by blocks (x = segment, y = a share of its tokens): segment
// (d, q, c), d = 0: rows this rank sends to rank q for its tokens of piece c
// (tokens [piece_start(c), piece_start(c+1)) with a slot on q) and how many
// of them are single rows (exactly one slot there, q a peer), into
// counts[q*2C + c] and counts[q*2C + C + c]; d = 1: the same received from
// rank q (q's tokens with a slot here), at counts[2WC + ...]. The last
// segment counts this rank's invalid routing entries into counts[4WC].
__global__ void ep_route_counts_kernel(const int32_t* route, int64_t words, int W, int K, int epr,
                                       int me, int C, int split, int32_t* counts) {
  const int seg = blockIdx.x;
  __shared__ int rows_s, single_s;
  if (threadIdx.x == 0) rows_s = single_s = 0;
  __syncthreads();
  int rows = 0, singles = 0;
  const int d = seg / (W * C), q = (seg / C) % W, c = seg % C;
  const int src = seg == 2 * W * C || d == 0 ? me : q;  // whose tokens
  const int dst = d == 0 ? q : me;                        // whose experts
  const int32_t* msg = route + src * words;
  const int64_t T = msg[0];
  int64_t t0 = 0, t1 = T;
  if (seg < 2 * W * C) t0 = piece_start(T, c, C, split), t1 = piece_start(T, c + 1, C, split);
  const int64_t share = (t1 - t0 + gridDim.y - 1) / gridDim.y;
  const int64_t b0 = t0 + share * blockIdx.y, b1 = b0 + share < t1 ? b0 + share : t1;
  for (int64_t t = b0 + threadIdx.x; t < b1; t += blockDim.x) {
    const int32_t* rt = msg + kRouteHead + t * 2 * K;
    int n = 0, bad = 0;
    for (int k = 0; k < K; ++k) {
      const int32_t id = rt[k];
      n += id >= 0 && id / epr == dst;
      bad += id == -2;
    }
    if (seg == 2 * W * C) {
      rows += bad;
    } else {
      rows += n > 0;
      singles += q != me && n == 1;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    rows += __shfl_xor_sync(0xffffffffu, rows, o);
    singles += __shfl_xor_sync(0xffffffffu, singles, o);
  }
  if (threadIdx.x % 32 == 0 && (rows | singles)) {
    atomicAdd(&rows_s, rows);
    atomicAdd(&single_s, singles);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (seg == 2 * W * C) {
    if (rows_s) atomicAdd(counts + 4 * W * C, rows_s);
    return;
  }
  int32_t* out = counts + d * 2 * W * C + q * 2 * C;
  if (rows_s) atomicAdd(out + c, rows_s);
  if (single_s) atomicAdd(out + C + c, single_s);
}

// Combine, on the rank holding the slots: for received rows [r0, r0 + n),
// one warp per row. A single row (rsingle) sends its slot's row of y as is
// (zeros when the slot was dropped) to single_rows[rspos[r]]; any other row
// its float32 partial, the kept slots in ascending k, acc = fmaf(w, y, acc)
// from 0 (unpermute's sum, bit for bit), to partial[r - rspos[r]].
template <typename TY, int N>
__global__ void ep_holder_kernel(const TY* y, int64_t y_stride, int64_t H, const int64_t* dest_row,
                                 const int32_t* recv_ids, const float* weights, int K, int64_t r0,
                                 int64_t n, const int32_t* rsingle, const int32_t* rspos,
                                 float* partial, TY* single_rows) {
  constexpr int kU = 4;
  using P = cuda::Pack<TY, N>;
  using F = cuda::Pack<float, N>;
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int64_t warps = int64_t{gridDim.x} * blockDim.x / cuda::kWarpSize;
  const int64_t packs = H / N;
  for (int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / cuda::kWarpSize; i < n;
       i += warps) {
    const int64_t r = r0 + i;
    if (rsingle[r]) {
      int64_t row = -1;
      for (int k = 0; k < K; ++k)
        if (recv_ids[r * K + k] >= 0) row = dest_row[r * K + k];
      P* dst = reinterpret_cast<P*>(single_rows + int64_t{rspos[r]} * H);
      const P* src = reinterpret_cast<const P*>(y + (row >= 0 ? row : 0) * y_stride);
      for (int64_t p = lane; p < packs; p += cuda::kWarpSize) {
        P v;
        if (row >= 0) {
          v = src[p];
        } else {
#pragma unroll
          for (int j = 0; j < N; ++j) v.v[j] = cuda::from_float<TY>(0.0f);
        }
        dst[p] = v;
      }
      continue;
    }
    F* dst = reinterpret_cast<F*>(partial + (r - rspos[r]) * H);
    for (int64_t p0 = 0; p0 < packs; p0 += kU * cuda::kWarpSize) {
      float acc[kU][N];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) acc[u][j] = 0.0f;
      for (int k = 0; k < K; ++k) {  // ascending k
        const int64_t row = dest_row[r * K + k];
        if (row < 0) continue;
        const float w = weights ? weights[r * K + k] : 1.0f;
        const P* src = reinterpret_cast<const P*>(y + row * y_stride);
        P v[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t p = p0 + u * cuda::kWarpSize + lane;
          if (p < packs) v[u] = src[p];
        }
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
          for (int j = 0; j < N; ++j) acc[u][j] = fmaf(w, cuda::to_float(v[u].v[j]), acc[u][j]);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t p = p0 + u * cuda::kWarpSize + lane;
        if (p >= packs) continue;
        F o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.v[j] = acc[u][j];
        dst[p] = o;
      }
    }
  }
}

// One thread per (q, t) with a flag: the K local ids and probs of the row;
// for q == self also self_src[j] = t, t being this rank's j-th own row.
template <typename IdT>
__global__ void ep_pack_meta_kernel(const IdT* ids, const float* probs, int64_t T, int K, int E,
                                    int epr, int W, int self, const int32_t* flags,
                                    const int32_t* pos, int32_t* send_ids, float* send_probs,
                                    int32_t* self_src) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= W * T || !flags[i]) return;
  const int q = static_cast<int>(i / T);
  const int64_t t = i % T, row = pos[i];
  if (q == self) self_src[row - pos[int64_t{self} * T]] = static_cast<int32_t>(t);
  for (int k = 0; k < K; ++k) {
    const int64_t id = static_cast<int64_t>(ids[t * K + k]);
    const bool here = id >= 0 && id < E && id / epr == q;
    send_ids[row * K + k] = here ? static_cast<int32_t>(id - int64_t{q} * epr) : -1;
    send_probs[row * K + k] = here && probs ? probs[t * K + k] : 0.0f;
  }
}

// Rows per peer of the eager piece (EpOptions::eager_share), by rank.
struct EagerRows {
  int32_t n[kMaxWorld];
};

// Token rows of tokens [t0, t1) along the routes (one warp per (q, t) with a
// flag), except those for rank `skip` (-1: none). The row's index j among
// the rows for q decides where it goes: with `eager` null, rows j >= hi[q] to
// the send buffer (row pos[q*T + t]); otherwise rows lo[q] <= j < hi[q] to
// row eager_off[q] + j of the eager buffer.
__global__ void ep_pack_rows_kernel(const uint8_t* x, int64_t x_stride_bytes, int64_t row_bytes,
                                    bool vec, int64_t T, int64_t t0, int64_t t1, int W, int skip,
                                    const int32_t* flags, const int32_t* pos, uint8_t* send_x,
                                    EagerRows lo, EagerRows hi, uint8_t* eager,
                                    EagerRows eager_off) {
  const int64_t n = t1 - t0;
  const int64_t warp = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / cuda::kWarpSize;
  const int lane = threadIdx.x % cuda::kWarpSize;
  if (warp >= W * n) return;
  const int q = static_cast<int>(warp / n);
  const int64_t t = t0 + warp % n;
  if (q == skip || !flags[q * T + t]) return;
  const int64_t p = pos[q * T + t], j = p - pos[q * T];
  uint8_t* dst;
  if (eager) {
    if (j < lo.n[q] || j >= hi.n[q]) return;
    dst = eager + (eager_off.n[q] + j) * row_bytes;
  } else {
    if (j < hi.n[q]) return;
    dst = send_x + p * row_bytes;
  }
  const uint8_t* src = x + t * x_stride_bytes;
  if (vec) {  // 16-byte aligned rows
    for (int64_t i = lane * 16; i < row_bytes; i += cuda::kWarpSize * 16)
      *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
  } else {
    for (int64_t i = lane; i < row_bytes; i += cuda::kWarpSize) dst[i] = src[i];
  }
}

// dprobs[t,k] from the rank that holds slot (t,k) (0 when none kept it).
__global__ void ep_dprobs_kernel(const float* back, const int32_t* send_ids, int64_t T, int K,
                                 int W, const int32_t* flags, const int32_t* pos, float* dprobs) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= T * K) return;
  const int64_t t = i / K;
  const int k = static_cast<int>(i % K);
  float v = 0.0f;
  for (int q = 0; q < W; ++q) {
    if (!flags[q * T + t]) continue;
    const int64_t row = pos[q * T + t];
    if (send_ids[row * K + k] >= 0) v = back[row * K + k];
  }
  dprobs[i] = v;
}

// Per-token scales rows into the send buffer: (q, t) with a slot on q goes
// to row pos[q*T + t] (the token rows' layout). One thread per (q, t).
__global__ void ep_pack_scales_kernel(const uint8_t* scales, int64_t sb, int64_t T, int W,
                                      const int32_t* flags, const int32_t* pos, uint8_t* send) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= int64_t{W} * T || !flags[i]) return;
  const uint8_t* src = scales + (i % T) * sb;
  uint8_t* dst = send + int64_t{pos[i]} * sb;
  if (sb % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0 &&
      reinterpret_cast<uintptr_t>(dst) % 4 == 0)
    for (int64_t j = 0; j < sb / 4; ++j)
      reinterpret_cast<uint32_t*>(dst)[j] = reinterpret_cast<const uint32_t*>(src)[j];
  else
    for (int64_t j = 0; j < sb; ++j) dst[j] = src[j];
}

// out[t] = partials of t added in ascending rank order (first taken as is).
// spos[q,t] = spos_raw[q*T + t] - *sbase (the scan shared with the flags).
// The partial of peer q sits in back[pos[q,t] - spos[q,t]], or, when t has
// one slot on q (single), q sent that slot's row of y: back_single[spos[q,t]],
// weighted here as the holder would have (fmaf(w, y, 0)); this rank's own
// partial is in partial[pos[self,t] + self_shift]. N elements per access.
template <typename TY, typename TOut, int N>
__global__ void ep_combine_kernel(const float* back, const TY* back_single, const float* partial,
                                  int self, int64_t self_shift, int64_t H, int64_t T, int64_t t0,
                                  int W, int K, const int32_t* flags, const int32_t* pos,
                                  const int32_t* single, const int32_t* spos_raw,
                                  const int32_t* sbase, const int32_t* send_ids,
                                  const float* send_probs, bool weighted, TOut* out,
                                  int64_t out_stride) {
  const int64_t t = t0 + blockIdx.x;
  __shared__ const void* src[kMaxWorld];
  __shared__ float wsrc[kMaxWorld];  // weight of a single row
  __shared__ bool one[kMaxWorld];    // a single row (else a float32 partial)
  __shared__ int count;
  if (threadIdx.x == 0) {
    int n = 0;
    const int32_t base = *sbase;
    for (int q = 0; q < W; ++q) {
      if (!flags[q * T + t]) continue;
      const int64_t row = pos[q * T + t];
      one[n] = false;
      if (q == self) {
        src[n] = partial + (row + self_shift) * H;
      } else if (single[q * T + t]) {
        float w = 1.0f;
        for (int k = 0; k < K; ++k)
          if (send_ids[row * K + k] >= 0 && weighted) w = send_probs[row * K + k];
        src[n] = back_single + int64_t{spos_raw[q * T + t] - base} * H;
        wsrc[n] = w;
        one[n] = true;
      } else {
        src[n] = back + (row - (spos_raw[q * T + t] - base)) * H;
      }
      ++n;
    }
    count = n;
  }
  __syncthreads();
  const int n = count;
  using In = cuda::Pack<float, N>;
  using InY = cuda::Pack<TY, N>;
  using Out = cuda::Pack<TOut, N>;
  for (int64_t v = threadIdx.x; v < H / N; v += blockDim.x) {
    In acc;
#pragma unroll
    for (int j = 0; j < N; ++j) acc.v[j] = 0.0f;
    for (int i = 0; i < n; ++i) {
      In p;
      if (one[i]) {
        const float w = wsrc[i];
        const InY yv = reinterpret_cast<const InY*>(src[i])[v];
#pragma unroll
        for (int j = 0; j < N; ++j) p.v[j] = fmaf(w, cuda::to_float(yv.v[j]), 0.0f);
      } else {
        p = reinterpret_cast<const In*>(src[i])[v];
      }
#pragma unroll
      for (int j = 0; j < N; ++j) acc.v[j] = i == 0 ? p.v[j] : acc.v[j] + p.v[j];
    }
    Out o;
#pragma unroll
    for (int j = 0; j < N; ++j) o.v[j] = cuda::from_float<TOut>(acc.v[j]);
    reinterpret_cast<Out*>(out + t * out_stride)[v] = o;
  }
}

int64_t addr(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

// Simulated ranks (EpGroup::create_simulated) take their streams from one
// process-wide pool per GPU, made once and never destroyed: the ranks'
// kernels wait on each other, so each stream needs a hardware queue of its
// own, and streams made later in a process (after others were made and
// destroyed) were seen to share one (a rank's kernel then never started).
constexpr int kSimPool = 8;
struct SimStreams {
  cudaStream_t rank[kSimPool] = {}, side[kSimPool] = {};
};
SimStreams& sim_streams(int device) {
  static std::mutex mu;
  static std::map<int, SimStreams> pool;
  std::lock_guard<std::mutex> lock(mu);
  auto it = pool.find(device);
  if (it != pool.end()) return it->second;
  SimStreams s;
  for (int i = 0; i < kSimPool; ++i) {
    MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&s.rank[i], cudaStreamNonBlocking));
    MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&s.side[i], cudaStreamNonBlocking));
  }
  return pool.emplace(device, s).first->second;
}

}  // namespace

}  // namespace moeflow
#include "cuda/ep_nvlink.cuh"
namespace moeflow {

struct EpGroup::Impl {
  ncclComm_t comm = nullptr;
  bool owns_comm = false;
  int rank = 0, world = 1, device = 0, epr = 0;
  EpOptions opt;
  int64_t tmax = 0, rows_max = 0, send_max = 0, capacity = 0, row_bytes = 0;
  // The gradient rows of combine_backward (the token dtype unless FP8).
  DType bwd_dtype = DType::kBFloat16;
  int64_t bwd_row_bytes = 0;
  // MOEFLOW_EP_DEBUG_RANGES (registered arena): print the arena's layout and
  // the ranges of every exchange() (diagnostics for compute-sanitizer reports).
  bool debug_ranges = false;
  // The wider of the two: sizes the buffers both kinds of rows go through.
  DType wide_dtype() const { return bwd_row_bytes > row_bytes ? bwd_dtype : opt.dtype; }

  // flags holds [flags | single] of the last dispatch, each W*T + 1 entries
  // (ep_flags_kernel), pos their one exclusive scan: pos, then spos offset by
  // the flags' total (pos[W*T]). single[q*T + t]: token t has one slot on
  // peer q (combine sends that row of y home instead of a float32 partial).
  Tensor flags, pos, scan_tmp, counts, self_src;  // device
  int32_t* single() { return flags.data_ptr<int32_t>() + world * T + 1; }
  int32_t* spos_raw() { return pos.data_ptr<int32_t>() + world * T + 1; }
  int32_t* spos_base() { return pos.data_ptr<int32_t>() + world * T; }
  // rsingle / rspos: the same flag and its scan over the received rows.
  Tensor rsingle, rspos;
  // pinned: per peer q, [rows per piece (C) | single rows per piece (C)]
  // sent, then the same received ([W][2C] x 2), then invalid
  int32_t* host = nullptr;
  Tensor send_x, send_ids, send_probs, recv_x, recv_ids, recv_probs;
  // nccl backend: every rank's routing message ([W][route_words], this
  // rank's own in its slot, sent from there), the receiver's flags over
  // them, their scan and its workspace (ep_route_flags_kernel).
  Tensor route, rfl, rps, rscan_tmp;
  // nccl backend, eager piece: the most rows per peer, the send buffer
  // (eager_share x the most rows a rank sends to its peers: max_tokens x
  // min(K, W - 1)), this dispatch's rows per rank (from the previous
  // dispatch's counts) sent and received, and where each peer's start in
  // the send buffer (their sum is within its size since the counts were).
  int64_t eager_max = 0, eager_total = 0;
  double eager_share = 0.0;
  Tensor send_eager;
  EagerRows eager_send{}, eager_recv{}, eager_off{};
  Tensor send_scales, recv_scales, out_scales;  // scale_cols > 0
  int64_t scale_bytes = 0;                      // per token: scale_cols x its dtype
  RoutingPlan plan;
  Tensor plan_ws, out_x, out_probs, partial, back;
  Tensor recv_dprobs, back_dprobs;  // combine backward
  // nccl_register_buffers: the buffers above that NCCL moves live in one
  // ncclMemAlloc arena registered with the communicator (handle).
  void* arena_reg = nullptr;

  // the last dispatch
  int64_t T = 0, received = 0;
  std::vector<int64_t> send_off, send_cnt, recv_off, recv_cnt;
  // Pieces: piece c holds the home tokens [piece_start(c), piece_start(c+1)) of each rank;
  // rows of piece c to / from rank q start at *_pc[q*(C+1) + c] inside q's range.
  int pieces = 1;
  std::vector<int64_t> send_pc, recv_pc;
  // combine's way back, split into float32 partials (m) and single rows (s):
  // offsets per rank and piece prefixes, like the above; the single rows sit
  // after the partial rows in `partial` (holder) and `back` (home).
  std::vector<int64_t> send_moff, send_mpc, send_soff, send_spc;  // home side (back)
  std::vector<int64_t> recv_moff, recv_mpc, recv_soff, recv_spc;  // holder side (partial)
  int64_t send_mrows = 0, recv_mrows = 0;

  // NCCL runs on `comm_stream`; events order it with the caller's stream.
  // `aux_stream` runs dispatch's receiver-side pass for combine beside the
  // permutes.
  cudaStream_t comm_stream = nullptr, aux_stream = nullptr;
  cudaEvent_t ev_start = nullptr, ev_host = nullptr, ev_meta = nullptr;
  cudaEvent_t ev_aux = nullptr, ev_scales = nullptr;
  // the eager piece's parts: packed (caller's stream), arrived (NCCL stream)
  static constexpr int kEagerParts = 4;  // at most
  int eager_parts = 1;  // MOEFLOW_EP_EAGER_PARTS (more were slower on 2 x H100)
  cudaEvent_t ev_epacked[kEagerParts] = {}, ev_eager[kEagerParts] = {};
  cudaEvent_t ev_piece[kMaxChunks] = {}, ev_back[kMaxChunks] = {}, ev_rows[kMaxChunks] = {};
  std::unique_ptr<NvlinkState> nvl;  // backend nvlink
  int sm_count = 0;

  ~Impl() {
    // Work of this group may still run (NCCL on comm_stream, kernels on the
    // callers' streams): let it finish before buffers are deregistered and
    // freed (cudaFree would have waited; ncclMemFree does not).
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cudaSetDevice(device) == cudaSuccess) {
      cudaDeviceSynchronize();
      cudaSetDevice(cur);
    }
    for (cudaEvent_t e : {ev_start, ev_host, ev_meta, ev_aux, ev_scales})
      if (e) cudaEventDestroy(e);
    for (auto& m : marks) cudaEventDestroy(m.second);
    for (cudaEvent_t* arr : {ev_piece, ev_back, ev_rows})
      for (int i = 0; i < kMaxChunks; ++i)
        if (arr[i]) cudaEventDestroy(arr[i]);
    for (int i = 0; i < kEagerParts; ++i)
      for (cudaEvent_t e : {ev_epacked[i], ev_eager[i]})
        if (e) cudaEventDestroy(e);
    if (comm_stream) cudaStreamDestroy(comm_stream);
    if (trace_stream) cudaStreamDestroy(trace_stream);
    if (aux_stream && !simulated) cudaStreamDestroy(aux_stream);  // (pooled when simulated)
    if (host) cudaFreeHost(host);
    // The window and the device communicator go with an owned communicator
    // (deregistering them one group after the other from one thread could
    // wait on the peers); on a caller's communicator they are released here.
    if (nvl && !owns_comm) nvl->release(comm);
    // An owned communicator drops its registrations when destroyed; the
    // arena itself goes (ncclMemFree) with the last tensor over it.
    if (arena_reg && !owns_comm) ncclCommDeregister(comm, arena_reg);
    if (owns_comm && comm) ncclCommDestroy(comm);
    if (nvl && nvl->base) {
      if (nvl->plain)
        cudaFree(nvl->base);
      else
        ncclMemFree(nvl->base);
    }
  }

  int chunks() const { return std::clamp(opt.pipeline_chunks, 1, kMaxChunks); }
  // Blocks of one nvlink kernel: every SM; simulated ranks share the GPU, and
  // all their kernels must be resident at once (they wait on each other).
  int max_nvlink_blocks() const { return simulated ? sm_count / world : sm_count; }

  // MOEFLOW_EP_TRACE=1: rank 0 prints when each step of a dispatch / combine
  // finished on the GPU (us after the step began), for tuning the pipeline.
  bool tracing = false;
  int split = 500;  // opt.pipeline_first_share per mille (piece_start)
  std::vector<std::pair<std::string, cudaEvent_t>> marks;
  size_t used_marks = 0;
  void mark(const std::string& what, cudaStream_t s) {
    if (!tracing) return;
    if (used_marks == marks.size()) {
      cudaEvent_t e;
      MOEFLOW_CUDA_CHECK(cudaEventCreate(&e));
      marks.push_back({"", e});
    }
    marks[used_marks].first = what;
    MOEFLOW_CUDA_CHECK(cudaEventRecord(marks[used_marks++].second, s));
  }
  // The host's progress in GPU time: an event recorded on an idle stream
  // completes as soon as the GPU sees it.
  cudaStream_t trace_stream = nullptr;
  void host_mark(const std::string& what) {
    if (!tracing) return;
    if (trace_stream == nullptr)
      MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&trace_stream, cudaStreamNonBlocking));
    mark(what, trace_stream);
  }
  void print_marks(const char* op) {
    if (!tracing || used_marks == 0) return;
    for (size_t i = 0; i < used_marks; ++i) MOEFLOW_CUDA_CHECK(cudaEventSynchronize(marks[i].second));
    std::string line = std::string(op) + " trace (rank " + std::to_string(rank) + "):";
    for (size_t i = 1; i < used_marks; ++i) {
      float ms = 0;
      MOEFLOW_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[0].second, marks[i].second));
      line += " " + marks[i].first + " " + std::to_string(static_cast<int>(ms * 1000));
    }
    std::fprintf(stderr, "%s\n", line.c_str());
    used_marks = 0;
  }
  // `waiter` waits for the work issued so far on `from`.
  static void order(cudaEvent_t ev, cudaStream_t from, cudaStream_t waiter) {
    MOEFLOW_CUDA_CHECK(cudaEventRecord(ev, from));
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(waiter, ev, 0));
  }

  void init(ncclComm_t c, bool owns, const EpOptions& o) {
    comm = c;
    owns_comm = owns;
    MOEFLOW_NCCL_CHECK(ncclCommUserRank(comm, &rank));
    MOEFLOW_NCCL_CHECK(ncclCommCount(comm, &world));
    init_common(o);
  }
  // Rank r of `w` simulated ranks on the current GPU (create_simulated): no
  // communicator; the nvlink backend's windows are plain device memory.
  void init_simulated(int r, int w, const EpOptions& o) {
    simulated = true;
    rank = r;
    world = w;
    init_common(o);
  }
  bool simulated = false;

  void init_common(const EpOptions& o) {
    opt = o;
    MOEFLOW_CUDA_CHECK(cudaGetDevice(&device));
    MOEFLOW_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
    MOEFLOW_CHECK(o.num_experts > 0 && o.num_experts % world == 0,
                  "num_experts must be a positive multiple of the world size ", world, ", got ",
                  o.num_experts);
    MOEFLOW_CHECK(o.topk >= 1 && o.topk <= 32, "topk must be in [1, 32], got ", o.topk);
    MOEFLOW_CHECK(o.hidden > 0, "hidden must be > 0, got ", o.hidden);
    MOEFLOW_CHECK(world <= kMaxWorld, "at most ", kMaxWorld, " ranks per group, got ", world);
    MOEFLOW_CHECK(o.pipeline_chunks >= 1 && o.pipeline_chunks <= kMaxChunks,
                  "pipeline_chunks must be in [1, ", kMaxChunks, "], got ", o.pipeline_chunks);
    MOEFLOW_CHECK(o.overlap_blocks >= 0, "overlap_blocks must be >= 0, got ", o.overlap_blocks);
    MOEFLOW_CHECK(o.pipeline_first_share > 0.0 && o.pipeline_first_share < 1.0,
                  "pipeline_first_share must be in (0, 1), got ", o.pipeline_first_share);
    MOEFLOW_CHECK(o.nvlink_blocks >= 2, "nvlink_blocks must be >= 2, got ", o.nvlink_blocks);
    MOEFLOW_CHECK(o.max_tokens_per_rank >= 0, "max_tokens_per_rank must be >= 0, got ",
                  o.max_tokens_per_rank);
    MOEFLOW_CHECK(dtype_is_arith_float(o.dtype) || o.dtype == DType::kFloat8E4M3 ||
                      o.dtype == DType::kFloat8E5M2,
                  "dtype must be float32, float16, bfloat16, float8_e4m3 or float8_e5m2, got ",
                  dtype_name(o.dtype));
    bwd_dtype = dtype_is_arith_float(o.dtype) ? o.dtype : o.backward_dtype;
    MOEFLOW_CHECK(dtype_is_arith_float(bwd_dtype),
                  "backward_dtype must be float32, float16 or bfloat16 (FP8 tokens), got ",
                  dtype_name(bwd_dtype));
    MOEFLOW_CHECK(o.scale_cols >= 0, "scale_cols must be >= 0, got ", o.scale_cols);
    scale_bytes = o.scale_cols * static_cast<int64_t>(dtype_size(o.scale_dtype));
    epr = o.num_experts / world;
    tmax = std::max<int64_t>(o.max_tokens_per_rank, 1);
    rows_max = tmax * world;
    send_max = tmax * std::min(o.topk, world);
    ep_reference::EpConfig rc{world, o.num_experts, o.align, o.max_tokens_per_rank,
                              o.capacity_rows};
    capacity = ep_reference::recv_capacity_rows(rc, o.topk);
    row_bytes = o.hidden * static_cast<int64_t>(dtype_size(o.dtype));
    bwd_row_bytes = o.hidden * static_cast<int64_t>(dtype_size(bwd_dtype));
    const Device dev = Device::cuda(device);
    flags = Tensor::empty({2 * (rows_max + 1)}, DType::kInt32, dev);
    pos = Tensor::empty({2 * (rows_max + 1)}, DType::kInt32, dev);
    rsingle = Tensor::empty({rows_max + 1}, DType::kInt32, dev);
    rspos = Tensor::empty({rows_max + 1}, DType::kInt32, dev);
    size_t scan_bytes = 0;
    MOEFLOW_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, flags.data_ptr<int32_t>(),
                                                     pos.data_ptr<int32_t>(), 2 * (rows_max + 1)));
    scan_tmp = Tensor::empty({static_cast<int64_t>(scan_bytes) + 16}, DType::kUInt8, dev);
    counts = Tensor::empty({4 * world * kMaxChunks + 1}, DType::kInt32, dev);
    self_src = Tensor::empty({tmax}, DType::kInt32, dev);
    MOEFLOW_CUDA_CHECK(cudaMallocHost(&host, sizeof(int32_t) * (4 * world * kMaxChunks + 1)));
    MOEFLOW_CHECK(o.eager_share >= 0.0 && o.eager_share < 1.0,
                  "eager_share must be in [0, 1), got ", o.eager_share);
    eager_share = o.eager_share;
    if (const char* v = std::getenv("MOEFLOW_EP_EAGER")) eager_share = std::atof(v);
    eager_share = std::clamp(eager_share, 0.0, 0.99);
    if (const char* v = std::getenv("MOEFLOW_EP_EAGER_PARTS"))
      eager_parts = std::clamp(std::atoi(v), 1, kEagerParts);
    eager_max = world > 1 ? static_cast<int64_t>(std::ceil(eager_share * tmax)) : 0;
    eager_total = world > 1 ? static_cast<int64_t>(std::ceil(
                                  eager_share * tmax * std::min(o.topk, world - 1)))
                            : 0;
    if (o.backend == EpBackend::kNccl) allocate_nccl_buffers(dev);
    // The highest priority: NCCL's blocks get the SMs first when the permute
    // kernels that run beside the transfers free them.
    // (The nvlink backend uses no NCCL stream.)
    int lo = 0, hi = 0;
    MOEFLOW_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    if (o.backend == EpBackend::kNccl)
      MOEFLOW_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream, cudaStreamNonBlocking, hi));
    if (simulated)
      aux_stream = sim_streams(device).side[rank];
    else
      MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&aux_stream, cudaStreamNonBlocking));
    const char* tr = std::getenv("MOEFLOW_EP_TRACE");
    tracing = tr != nullptr && tr[0] == '1' && rank == 0;
    split = std::clamp(static_cast<int>(std::lround(opt.pipeline_first_share * 1000)), 1, 999);
    for (int i = 0; i < kEagerParts; ++i)
      for (cudaEvent_t* e : {&ev_epacked[i], &ev_eager[i]})
        MOEFLOW_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    for (cudaEvent_t* e : {&ev_start, &ev_host, &ev_meta, &ev_aux, &ev_scales})
      MOEFLOW_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    for (cudaEvent_t* arr : {ev_piece, ev_back, ev_rows})
      for (int i = 0; i < kMaxChunks; ++i)
        MOEFLOW_CUDA_CHECK(cudaEventCreateWithFlags(&arr[i], cudaEventDisableTiming));
  }

  // The staging buffers and the receive plan of the nccl backend.
  void allocate_nccl_buffers(const Device& dev) {
    const int64_t K = opt.topk, H = opt.hidden;
    // What NCCL sends and receives: registered (one arena) or plain.
    struct Buf {
      Tensor* t;
      std::vector<int64_t> shape;
      DType dtype;
    };
    const Buf bufs[] = {{&send_x, {send_max, H}, wide_dtype()},
                        {&send_ids, {send_max, K}, DType::kInt32},
                        {&send_probs, {send_max, K}, DType::kFloat32},
                        {&recv_x, {rows_max, H}, wide_dtype()},
                        {&recv_ids, {rows_max, K}, DType::kInt32},
                        {&recv_probs, {rows_max, K}, DType::kFloat32},
                        {&partial, {rows_max, H}, DType::kFloat32},
                        {&back, {send_max, H}, DType::kFloat32},
                        {&recv_dprobs, {rows_max, K}, DType::kFloat32},
                        {&back_dprobs, {send_max, K}, DType::kFloat32},
                        {&send_scales, {send_max, opt.scale_cols}, opt.scale_dtype},
                        {&recv_scales, {rows_max, opt.scale_cols}, opt.scale_dtype},
                        {&route, {world, route_words(tmax, opt.topk)}, DType::kInt32},
                        {&send_eager, {eager_total, H}, opt.dtype}};
    bool reg = opt.nccl_register_buffers;
    if (const char* v = std::getenv("MOEFLOW_EP_REGISTER")) reg = std::atoi(v) != 0;
    if (reg && world > 1) {
      std::vector<size_t> off;
      size_t at = 0;
      for (const Buf& b : bufs) {
        off.push_back(at);
        at += (TensorView(nullptr, b.dtype, dev, b.shape).nbytes() + 255) / 256 * 256;
      }
      void* base = nullptr;
      if (ncclMemAlloc(&base, at) == ncclSuccess && base != nullptr) {
        std::shared_ptr<void> owner(base, [](void* p) { ncclMemFree(p); });
        MOEFLOW_NCCL_CHECK(ncclCommRegister(comm, base, at, &arena_reg));
        debug_ranges = std::getenv("MOEFLOW_EP_DEBUG_RANGES") != nullptr;
        if (debug_ranges) {  // diagnostics: where each buffer of the arena lies
          std::fprintf(stderr, "[ep rank %d] arena %p, %zu bytes:", rank, base, at);
          for (size_t i = 0; i < std::size(bufs); ++i)
            std::fprintf(stderr, " %zu@+%zu",
                         TensorView(nullptr, bufs[i].dtype, dev, bufs[i].shape).nbytes(), off[i]);
          std::fprintf(stderr, "\n");
        }
        for (size_t i = 0; i < std::size(bufs); ++i)
          *bufs[i].t = Tensor::adopt(
              TensorView(static_cast<uint8_t*>(base) + off[i], bufs[i].dtype, dev, bufs[i].shape),
              owner);
      } else {
        // No cuMem allocations here: plain buffers, NCCL's own FIFOs.
        cudaGetLastError();
        reg = false;
      }
    }
    if (!reg || world <= 1) {
      for (const Buf& b : bufs) *b.t = Tensor::empty(b.shape, b.dtype, dev);
    }
    rfl = Tensor::empty({2 * (rows_max + 1)}, DType::kInt32, dev);
    rps = Tensor::empty({2 * (rows_max + 1)}, DType::kInt32, dev);
    rscan_tmp = Tensor::empty({scan_tmp.numel()}, DType::kUInt8, dev);
    PlanConfig pc;
    pc.num_experts = epr;
    pc.align = opt.align;
    pc.capacity_rows = capacity;
    plan = allocate_plan(rows_max, opt.topk, pc, dev);
    plan_ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(rows_max, opt.topk, pc)) + 16},
                            DType::kUInt8, dev);
    out_x = Tensor::empty({capacity, H}, opt.dtype, dev);
    out_probs = Tensor::empty({capacity}, DType::kFloat32, dev);
    out_scales = Tensor::empty({capacity, opt.scale_cols}, opt.scale_dtype, dev);
  }


  // Backend nvlink: the symmetric window and the buffers of the device-side
  // layout (collective: every rank calls it together).
  void init_nvlink() {
    nvl = std::make_unique<NvlinkState>();
    NvlinkState& s = *nvl;
    const int64_t H = opt.hidden, K = opt.topk, E = opt.num_experts;
    const size_t esz = dtype_size(opt.dtype);
    MOEFLOW_CHECK(row_bytes % 16 == 0, "the nvlink backend needs 16-byte token rows, got hidden=", H,
                  " x ", esz, " bytes");
    MOEFLOW_CHECK(E <= 2048, "the nvlink backend takes at most 2048 experts, got ", E);
    MOEFLOW_CHECK(K <= 32, "the nvlink backend takes topk <= 32, got ", K);
    MOEFLOW_CHECK(world <= 8, "the nvlink backend takes at most 8 ranks, got ", world);
    MOEFLOW_CHECK(opt.nvlink_blocks >= 2 && opt.nvlink_blocks <= max_nvlink_blocks(),
                  "nvlink_blocks must be in [2, ", max_nvlink_blocks(),
                  "] (the SMs", simulated ? " / the simulated ranks" : "",
                  ": its roles wait on each other across ranks), got ", opt.nvlink_blocks);
    MOEFLOW_CHECK(capacity < INT32_MAX && int64_t(world) * tmax < INT32_MAX,
                  "the nvlink backend indexes rows with int32: capacity ", capacity,
                  " and world x max_tokens_per_rank ", int64_t(world) * tmax, " must be < 2^31");
    nvl::Offsets& o = s.off;
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t here = at;
      at += nvl::round_up(bytes);
      return here;
    };
    o.x = take(size_t(capacity) * row_bytes);
    o.probs = take(size_t(capacity) * 4);
    o.row_src = take(size_t(capacity) * 4);
    o.row_k = take(size_t(capacity) * 4);
    o.counts = take(size_t(world) * E * 4);
    o.ntok = take(size_t(world) * 4);
    o.inv = take(size_t(world) * tmax * K * 4);
    o.stage = take(size_t(world) * tmax * std::max(row_bytes, bwd_row_bytes));
    o.partial = take(size_t(world) * tmax * H * 4);
    o.dp = take(size_t(tmax) * K * 4);
    o.flag = take(size_t(world) * tmax * 4);
    o.epoch = take(4);
    o.scales = take(size_t(capacity) * scale_bytes);
    s.bytes = at;
    if (world == 1 || simulated) {
      // NCCL gives a one-rank communicator no symmetric memory: the window is
      // plain device memory and the barriers are block-local. Simulated
      // ranks: plain device memory too, joined by create_simulated.
      s.plain = true;
      MOEFLOW_CUDA_CHECK(cudaMalloc(&s.base, s.bytes));
    } else {
      // The device API is inline code compiled against nccl_device.h: it must
      // come from the NCCL that runs (its structures change between releases).
      int version = 0;
      MOEFLOW_NCCL_CHECK(ncclGetVersion(&version));
      MOEFLOW_CHECK(version == NCCL_VERSION_CODE,
                    "the nvlink backend was compiled against NCCL ", NCCL_VERSION_CODE,
                    " (nccl_device.h) but libnccl ", version,
                    " is loaded; build moeflow against the NCCL it runs with (MOEFLOW_NCCL_ROOT)");
      MOEFLOW_NCCL_CHECK(ncclMemAlloc(&s.base, s.bytes));
      const ncclResult_t wr =
          ncclCommWindowRegister(comm, s.base, s.bytes, &s.win, NCCL_WIN_COLL_SYMMETRIC);
      MOEFLOW_CHECK(wr == ncclSuccess, "the nvlink backend needs NCCL symmetric memory ",
                    "(all ranks CUDA peers over NVLink, cuMem enabled): ncclCommWindowRegister ",
                    "returned '", ncclGetErrorString(wr), "'; use backend nccl");
      s.have_win = true;
      ncclDevCommRequirements req{};
      req.lsaBarrierCount = 1;  // no multimem resources (NVLS stays off)
      const ncclResult_t dr = ncclDevCommCreate(comm, &req, &s.dc);
      MOEFLOW_CHECK(dr == ncclSuccess, "the nvlink backend needs the NCCL device API over ",
                    "symmetric memory: ncclDevCommCreate returned '", ncclGetErrorString(dr),
                    "' (NCCL_DEBUG=WARN says why); use backend nccl");
      s.have_dc = true;
      MOEFLOW_CHECK(s.dc.lsaSize == world && s.dc.lsaRank == rank,
                    "the nvlink backend needs all ranks in one NVLink domain: NCCL reports ",
                    s.dc.lsaSize, " of ", world, " ranks reachable (lsa rank ", s.dc.lsaRank,
                    ", rank ", rank, ")");
    }
    MOEFLOW_CUDA_CHECK(cudaMemset(s.base, 0, s.bytes));
    s.batch = row_bytes >= 12288 ? 1 : 4;  // long rows: announce each at once
    // Combine's home share: the holders' work per token grows with the slots a
    // rank holds of it (K / W expected), and a token with one slot there costs
    // them only a row copy. Two H200s, 32 SMs: K/W = 1 (mixtral) best at 70 %
    // (674 us vs 863 at 50), K/W = 4 (dsv3) at 50 % (1217 us vs 1259 at 60);
    // two H100s: K/W = 4 best at 55 % (1214 us vs 1271 at 50, 1281 at 60).
    s.combine_home_percent =
        world == 1 ? 99  // no peers: no holder work
                   : std::clamp(80 - 10 * static_cast<int>((opt.topk + world - 1) / world), 55, 70);
    // tuning knobs (benchmarks): tokens per announcement, the home role's share of the blocks
    if (const char* v = std::getenv("MOEFLOW_NVL_BATCH")) s.batch = std::clamp(std::atoi(v), 1, 32);
    if (const char* v = std::getenv("MOEFLOW_NVL_HOME")) s.home_percent = std::clamp(std::atoi(v), 1, 99);
    s.tma = opt.nvlink_bulk_copies;
    if (const char* v = std::getenv("MOEFLOW_NVL_TMA")) s.tma = std::atoi(v) != 0;
    MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(nvl::dispatch_kernel<nvl::TmaMover, nvl::kTmaWarps>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(nvl::kTmaSmem)));
    if (const char* v = std::getenv("MOEFLOW_NVL_CHOME"))
      s.combine_home_percent = std::clamp(std::atoi(v), 1, 99);
    const Device dev = Device::cuda(device);
    s.local_ids = Tensor::empty({tmax, K}, DType::kInt32, dev);
    PlanConfig lc;
    lc.num_experts = static_cast<int>(E);
    lc.align = 1;
    lc.capacity_rows = tmax * K;
    s.local = allocate_plan(tmax, static_cast<int>(K), lc, dev);
    s.local_ws = Tensor::empty(
        {static_cast<int64_t>(plan_workspace_bytes(tmax, static_cast<int>(K), lc)) + 16},
        DType::kUInt8, dev);
    s.first_row = Tensor::empty({E}, DType::kInt64, dev);
    s.fit = Tensor::empty({E}, DType::kInt64, dev);
    s.dest_rank = Tensor::empty({tmax, K}, DType::kInt32, dev);
    s.dest_row = Tensor::empty({tmax, K}, DType::kInt64, dev);
    s.probs = Tensor::empty({tmax, K}, DType::kFloat32, dev);
    PlanConfig rc;
    rc.num_experts = epr;
    rc.align = opt.align;
    rc.capacity_rows = capacity;
    s.recv = allocate_plan(1, static_cast<int>(K), rc, dev);
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Grouped send/recv of per-peer row ranges of two buffers (bytes per row).
  void exchange(const uint8_t* send, int64_t send_row_bytes, const std::vector<int64_t>& s_off,
                const std::vector<int64_t>& s_cnt, uint8_t* recv, int64_t recv_row_bytes,
                const std::vector<int64_t>& r_off, const std::vector<int64_t>& r_cnt,
                cudaStream_t stream) {
    if (debug_ranges)
      for (int q = 0; q < world; ++q)
        std::fprintf(stderr, "[ep rank %d] peer %d: send %p + %lld, recv %p + %lld\n", rank, q,
                     static_cast<const void*>(send + s_off[q] * send_row_bytes),
                     static_cast<long long>(s_cnt[q] * send_row_bytes),
                     static_cast<void*>(recv + r_off[q] * recv_row_bytes),
                     static_cast<long long>(r_cnt[q] * recv_row_bytes));
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < world; ++q) {
      if (s_cnt[q] > 0)
        MOEFLOW_NCCL_CHECK(ncclSend(send + s_off[q] * send_row_bytes, s_cnt[q] * send_row_bytes,
                                    ncclUint8, q, comm, stream));
      if (r_cnt[q] > 0)
        MOEFLOW_NCCL_CHECK(ncclRecv(recv + r_off[q] * recv_row_bytes, r_cnt[q] * recv_row_bytes,
                                    ncclUint8, q, comm, stream));
    }
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
  }

  // The same without this rank's own range (no self transfer).
  void exchange_peers(const uint8_t* send, int64_t send_row_bytes, const std::vector<int64_t>& s_off,
                      const std::vector<int64_t>& s_cnt, uint8_t* recv, int64_t recv_row_bytes,
                      const std::vector<int64_t>& r_off, const std::vector<int64_t>& r_cnt,
                      cudaStream_t stream) {
    std::vector<int64_t> sc = s_cnt, rc = r_cnt;
    sc[rank] = rc[rank] = 0;
    exchange(send, send_row_bytes, s_off, sc, recv, recv_row_bytes, r_off, rc, stream);
  }

  // Grouped send/recv of piece c of the per-peer row ranges, peers only (no
  // self transfer): rows [off[q] + pc[q*(P+1) + c], off[q] + pc[q*(P+1) + c + 1]).
  void exchange_piece(int c, const uint8_t* send, int64_t send_row_bytes,
                      const std::vector<int64_t>& s_off, const std::vector<int64_t>& s_pc,
                      uint8_t* recv, int64_t recv_row_bytes, const std::vector<int64_t>& r_off,
                      const std::vector<int64_t>& r_pc, cudaStream_t stream) {
    const int P = pieces;
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < world; ++q) {
      if (q == rank) continue;
      const int64_t sb = s_pc[q * (P + 1) + c], se = s_pc[q * (P + 1) + c + 1];
      const int64_t rb = r_pc[q * (P + 1) + c], re = r_pc[q * (P + 1) + c + 1];
      if (se > sb)
        MOEFLOW_NCCL_CHECK(ncclSend(send + (s_off[q] + sb) * send_row_bytes,
                                    (se - sb) * send_row_bytes, ncclUint8, q, comm, stream));
      if (re > rb)
        MOEFLOW_NCCL_CHECK(ncclRecv(recv + (r_off[q] + rb) * recv_row_bytes,
                                    (re - rb) * recv_row_bytes, ncclUint8, q, comm, stream));
    }
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
  }
};

EpGroup::EpGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EpGroup::~EpGroup() = default;
int EpGroup::rank() const {
  return impl_->rank;
}
int EpGroup::world_size() const {
  return impl_->world;
}
bool EpGroup::nccl_buffers_registered() const {
  return impl_->arena_reg != nullptr;
}
int EpGroup::local_experts() const {
  return impl_->epr;
}
Device EpGroup::device() const {
  return Device::cuda(impl_->device);
}
int64_t EpGroup::capacity_rows() const {
  return impl_->capacity;
}
const EpOptions& EpGroup::options() const {
  return impl_->opt;
}
void EpGroup::set_nvlink_blocks(int blocks) {
  MOEFLOW_CHECK(blocks >= 2 && blocks <= impl_->max_nvlink_blocks(),
                "nvlink_blocks must be in [2, ", impl_->max_nvlink_blocks(),
                "] (the SMs: its roles wait on each other across ranks), got ", blocks);
  impl_->opt.nvlink_blocks = blocks;
}
void EpGroup::set_overlap_blocks(int blocks) {
  MOEFLOW_CHECK(blocks >= 0, "overlap_blocks must be >= 0, got ", blocks);
  impl_->opt.overlap_blocks = blocks;
}
void EpGroup::set_pipeline_chunks(int chunks) {
  MOEFLOW_CHECK(chunks >= 1 && chunks <= kMaxChunks, "pipeline_chunks must be in [1, ", kMaxChunks,
                "], got ", chunks);
  impl_->opt.pipeline_chunks = chunks;
}
cudaStream_t EpGroup::simulated_stream() const {
  return impl_->simulated ? sim_streams(impl_->device).rank[impl_->rank] : nullptr;
}

ncclComm* EpGroup::nccl_comm() const {
  return impl_->comm;
}
const std::vector<int64_t>& EpGroup::last_send_rows() const {
  return impl_->send_cnt;
}
const std::vector<int64_t>& EpGroup::last_recv_rows() const {
  return impl_->recv_cnt;
}

std::unique_ptr<EpGroup> EpGroup::from_comm(ncclComm* comm, const EpOptions& options) {
  MOEFLOW_CHECK(comm != nullptr, "comm must be an NCCL communicator, got null");
  auto impl = std::make_unique<Impl>();
  impl->init(comm, false, options);
  if (options.backend == EpBackend::kNvlink) impl->init_nvlink();
  return std::unique_ptr<EpGroup>(new EpGroup(std::move(impl)));
}

std::array<char, 128> EpGroup::new_unique_id() {
  ncclUniqueId id;
  MOEFLOW_NCCL_CHECK(ncclGetUniqueId(&id));
  std::array<char, 128> out{};
  static_assert(sizeof(id.internal) == 128, "NCCL unique ids are 128 bytes");
  std::memcpy(out.data(), id.internal, 128);
  return out;
}

std::unique_ptr<EpGroup> EpGroup::from_unique_id(const std::array<char, 128>& id, int rank,
                                                 int world_size, const EpOptions& options) {
  MOEFLOW_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
                "rank must be in [0, world_size=", world_size, "), got ", rank);
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), 128);
  ncclComm_t comm = nullptr;
  MOEFLOW_NCCL_CHECK(ncclCommInitRank(&comm, world_size, uid, rank));
  auto impl = std::make_unique<Impl>();
  try {
    impl->init(comm, true, options);
    if (options.backend == EpBackend::kNvlink) impl->init_nvlink();
  } catch (...) {
    const bool owned = impl->owns_comm;  // then ~Impl destroys the communicator
    impl.reset();
    if (!owned) ncclCommDestroy(comm);
    throw;
  }
  return std::unique_ptr<EpGroup>(new EpGroup(std::move(impl)));
}

std::vector<std::unique_ptr<EpGroup>> EpGroup::create_local(const std::vector<int>& devices,
                                                            const EpOptions& options) {
  const int n = static_cast<int>(devices.size());
  MOEFLOW_CHECK(n >= 1 && n <= cuda_device_count(), "create_local needs 1..", cuda_device_count(),
                " devices, got ", n);
  std::vector<ncclComm_t> comms(n);
  MOEFLOW_NCCL_CHECK(ncclCommInitAll(comms.data(), n, devices.data()));
  std::vector<std::unique_ptr<EpGroup>> groups;
  for (int i = 0; i < n; ++i) {
    MOEFLOW_CUDA_CHECK(cudaSetDevice(devices[i]));
    auto impl = std::make_unique<Impl>();
    impl->init(comms[i], true, options);
    groups.push_back(std::unique_ptr<EpGroup>(new EpGroup(std::move(impl))));
  }
  if (options.backend == EpBackend::kNvlink)  // collective: one thread per rank
    run_local(groups, [&](int r) { groups[r]->impl().init_nvlink(); });
  return groups;
}

std::vector<std::unique_ptr<EpGroup>> EpGroup::create_simulated(int world_size, int device,
                                                                const EpOptions& options) {
  MOEFLOW_CHECK(options.backend == EpBackend::kNvlink,
                "create_simulated simulates the nvlink backend only (NCCL puts no two ranks on "
                "one GPU), got backend nccl");
  MOEFLOW_CHECK(world_size >= 2 && world_size <= nvl::kMaxSimRanks, "world_size must be in [2, ",
                nvl::kMaxSimRanks, "], got ", world_size);
  MOEFLOW_CHECK(device >= 0 && device < cuda_device_count(), "device must be in [0, ",
                cuda_device_count(), "), got ", device);
  // With lazy module loading, launching a kernel for the first time may wait
  // for the whole GPU, where another rank's kernel spins until this one runs.
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  MOEFLOW_CHECK(loading && std::string(loading) == "EAGER",
                "create_simulated needs CUDA_MODULE_LOADING=EAGER in the environment before CUDA "
                "starts (a kernel loaded lazily while another rank's kernel waits for it can "
                "deadlock the GPU), got ", loading ? loading : "(unset: lazy)");
  // Every rank's streams (its caller's, the group's side stream) on their own hardware
  // queue: a kernel queued behind another rank's waiting kernel would never run.
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int need = 2 * kSimPool + 1;
  MOEFLOW_CHECK(conn && std::atoi(conn) >= need,
                "create_simulated needs CUDA_DEVICE_MAX_CONNECTIONS >= ", need,
                " (its pool of 2 streams per rank + the default stream, each on its own hardware "
                "queue; the "
                "maximum is 32) in the environment before CUDA starts, got ",
                conn ? conn : "(unset: 8)");
  MOEFLOW_CUDA_CHECK(cudaSetDevice(device));
  sim_streams(device);  // the pool first, before anything else makes streams
  void* bar = nullptr;
  MOEFLOW_CUDA_CHECK(cudaMalloc(&bar, 2 * sizeof(unsigned)));
  std::shared_ptr<void> shared_bar(bar, [](void* p) { cudaFree(p); });
  MOEFLOW_CUDA_CHECK(cudaMemset(bar, 0, 2 * sizeof(unsigned)));
  std::vector<std::unique_ptr<EpGroup>> groups;
  std::vector<uint8_t*> bases;
  for (int r = 0; r < world_size; ++r) {
    auto impl = std::make_unique<Impl>();
    impl->init_simulated(r, world_size, options);
    impl->init_nvlink();
    bases.push_back(static_cast<uint8_t*>(impl->nvl->base));
    groups.push_back(std::unique_ptr<EpGroup>(new EpGroup(std::move(impl))));
  }
  for (auto& g : groups) {
    g->impl().nvl->sim_bar = shared_bar;
    g->impl().nvl->sim_bases = bases;
  }
  return groups;
}

void EpGroup::run_local(const std::vector<std::unique_ptr<EpGroup>>& groups,
                        const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(groups.size());
  for (size_t i = 0; i < groups.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        MOEFLOW_CUDA_CHECK(cudaSetDevice(groups[i]->device().index));
        fn(static_cast<int>(i));
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

namespace {

// Backend nvlink (see cuda/ep_nvlink.cuh): arguments validated by the caller.

// An LSA barrier over the group's ranks, in stream order.
void nvlink_barrier(NvlinkState& s, cudaStream_t stream) {
  nvl::barrier_kernel<<<1, 128, 0, stream>>>(s.view());
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

// Blocks of the home role of a fused kernel (the rest: the holder role).
int nvlink_home_blocks(const EpGroup::Impl& g, int percent) {
  const int P = g.opt.nvlink_blocks * percent / 100;
  return std::clamp(P, 1, g.opt.nvlink_blocks - 1);
}
unsigned nvlink_grid(const EpGroup::Impl& g) {
  return static_cast<unsigned>(g.opt.nvlink_blocks);
}

// Pad rows of this rank's receive layout (its plan of the last dispatch) in
// `rows` (stride in bytes) zeroed.
void nvlink_zero_pads(EpGroup::Impl& g, uint8_t* rows, int64_t stride_bytes, int64_t row_bytes,
                      float* probs, int32_t* row_src, cudaStream_t stream,
                      uint8_t* scales = nullptr) {
  NvlinkState& s = *g.nvl;
  const nvl::Pads pads{g.epr, s.recv.tokens_per_expert.data_ptr<int32_t>(),
                       s.recv.padded_tokens_per_expert.data_ptr<int32_t>(),
                       s.recv.expert_row_offsets.data_ptr<int64_t>()};
  nvl::pads_kernel<<<static_cast<unsigned>(std::max(g.epr, 1)), 256, 0, stream>>>(
      rows, stride_bytes, probs, row_src, row_bytes, pads, scales, g.scale_bytes);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

EpDispatchResult nvlink_dispatch(EpGroup::Impl& g, TensorView x, TensorView ids, TensorView probs,
                                 TensorView scales, cudaStream_t stream) {
  NvlinkState& s = *g.nvl;
  const nvl::Offsets& o = s.off;
  const int K = g.opt.topk, W = g.world, E = g.opt.num_experts, L = g.epr;
  const int64_t T = x.shape[0], H = g.opt.hidden;
  const Device dev = Device::cuda(g.device);
  MOEFLOW_CHECK(addr(x.data) % 16 == 0 && (x.strides[0] * int64_t(dtype_size(x.dtype))) % 16 == 0,
                "the nvlink backend needs 16-byte aligned rows of x");
  s.T = T;
  g.mark("start", stream);
  // 1. the rank's slots ranked per global expert, over the caller's int32 ids
  // as they are (ids outside [-1, E) are unrouted there and counted), int64
  // ids narrowed first. The probs are copied by the dispatch kernel (combine
  // weights with them).
  const int32_t* ids32 = ids.dtype == DType::kInt32 ? ids.data_ptr<int32_t>() : nullptr;
  if (!ids32) {
    const int64_t n = T * K;
    if (n > 0) {
      nvl::copy_ids_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
          ids.data_ptr<int64_t>(), T, K, T, s.local_ids.data_ptr<int32_t>());
      MOEFLOW_CUDA_LAUNCH_CHECK();
    }
    ids32 = s.local_ids.data_ptr<int32_t>();
  }
  {
    RoutingInput in;
    in.kind = RoutingInput::kIds32;
    in.data = ids32;
    in.num_tokens = T;
    in.topk = K;
    cuda::build_plan(in, s.local, s.local_ws, stream);
  }
  g.mark("plan", stream);
  uint8_t* base = static_cast<uint8_t*>(s.base);
  // 2. counts exchanged, slot ranges, this rank's receive plan, its pad rows
  nvl::counts_kernel<<<1, 256, 0, stream>>>(
      s.view(), o.counts, o.ntok, s.local.tokens_per_expert.data_ptr<int32_t>(),
      static_cast<int32_t>(T), E, W, g.rank, g.capacity, g.opt.align,
      s.first_row.data_ptr<int64_t>(), s.fit.data_ptr<int64_t>(),
      s.recv.tokens_per_expert.data_ptr<int32_t>(),
      s.recv.padded_tokens_per_expert.data_ptr<int32_t>(),
      s.recv.expert_row_offsets.data_ptr<int64_t>(), s.recv.total_rows.data_ptr<int64_t>(),
      s.recv.overflow.data_ptr<int32_t>(), reinterpret_cast<int32_t*>(base + o.epoch),
      s.local.invalid_ids.data_ptr<int32_t>(), s.recv.invalid_ids.data_ptr<int32_t>());
  MOEFLOW_CUDA_LAUNCH_CHECK();
  g.mark("counts", stream);
  // The pad rows (nothing else writes them) on the side stream, on the SMs
  // the fused kernel leaves free; the caller's stream waits at the end.
  MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_meta, stream));
  MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(g.aux_stream, g.ev_meta, 0));
  nvlink_zero_pads(g, base + o.x, g.row_bytes, g.row_bytes, reinterpret_cast<float*>(base + o.probs),
                   reinterpret_cast<int32_t*>(base + o.row_src), g.aux_stream,
                   scales.defined() ? base + o.scales : nullptr);
  MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_aux, g.aux_stream));
  // 3. the rows: own slots in place, a peer's only slot of a token straight
  // into its row there, several through the peer's stage
  // the same roles with bulk copies (MOEFLOW_NVL_TMA) or with 16-byte stores
  auto* kernel = s.tma ? nvl::dispatch_kernel<nvl::TmaMover, nvl::kTmaWarps>
                       : nvl::dispatch_kernel<nvl::LsuMover, nvl::kWarps>;
  const nvl::HomeArgs home{ids32, probs.defined() ? probs.data_ptr<float>() : nullptr,
                           s.probs.data_ptr<float>(), K, E, L, W,
                           g.rank, g.tmax, g.row_bytes, s.local.dest_row.data_ptr<int64_t>(),
                           s.local.expert_row_offsets.data_ptr<int64_t>(),
                           s.first_row.data_ptr<int64_t>(), s.fit.data_ptr<int64_t>(),
                           s.dest_rank.data_ptr<int32_t>(), s.dest_row.data_ptr<int64_t>(),
                           scales.defined() ? static_cast<const uint8_t*>(scales.data) : nullptr,
                           g.scale_bytes};
  kernel<<<nvlink_grid(g), (s.tma ? nvl::kTmaWarps : nvl::kWarps) * 32, s.tma ? nvl::kTmaSmem : 0,
           stream>>>(s.view(), o, nvlink_home_blocks(g, s.home_percent), s.batch,
                     static_cast<const uint8_t*>(x.data), x.strides[0] * int64_t(dtype_size(x.dtype)),
                     T, home);
  MOEFLOW_CUDA_LAUNCH_CHECK();
  MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(stream, g.ev_aux, 0));
  g.mark("rows", stream);
  g.print_marks("nvlink dispatch");
  const TensorView rx = TensorView::strided(base + o.x, g.opt.dtype, dev, {g.capacity, H}, {H, 1});
  const TensorView rp = TensorView::strided(base + o.probs, DType::kFloat32, dev, {g.capacity}, {1});
  const TensorView rs =
      scales.defined() ? TensorView::strided(base + o.scales, g.opt.scale_dtype, dev,
                                             {g.capacity, g.opt.scale_cols}, {g.opt.scale_cols, 1})
                       : TensorView{};
  return EpDispatchResult{rx, rp, rs, &s.recv, -1};
}

// 16-byte accesses of every operand's rows (addresses and strides in bytes).
bool nvlink_vec(int64_t H, int n, std::initializer_list<std::pair<const void*, int64_t>> rows) {
  if (H % n != 0) return false;
  for (const auto& r : rows)
    if (addr(r.first) % 16 != 0 || r.second % 16 != 0) return false;
  return true;
}

void nvlink_combine(EpGroup::Impl& g, TensorView y, bool weighted, TensorView out,
                    cudaStream_t stream) {
  NvlinkState& s = *g.nvl;
  const nvl::Offsets& o = s.off;
  const int64_t H = g.opt.hidden;
  const int K = g.opt.topk, W = g.world, me = g.rank;
  MOEFLOW_CHECK(y.strides[1] == 1, "y rows must be contiguous (stride(1) == 1)");
  uint8_t* base = static_cast<uint8_t*>(s.base);
  g.mark("start", stream);
  nvl::op_start_kernel<<<1, 128, 0, stream>>>(s.view(), reinterpret_cast<int32_t*>(base + o.epoch));
  MOEFLOW_CUDA_LAUNCH_CHECK();
  g.mark("barrier", stream);
  const float* w = weighted ? s.probs.data_ptr<float>() : nullptr;
  auto launch = [&](auto* yt, auto* ot) {
    using TY = std::remove_const_t<std::remove_pointer_t<decltype(yt)>>;
    using TO = std::remove_pointer_t<decltype(ot)>;
    constexpr int N = 16 / sizeof(TY);
    const int64_t ys = y.strides[0], os = out.strides[0];
    const bool vec = nvlink_vec(H, N, {{y.data, ys * int64_t(sizeof(TY))}}) &&
                     addr(out.data) % (N * sizeof(TO)) == 0 && (os * sizeof(TO)) % (N * sizeof(TO)) == 0;
    const TY* yp = static_cast<const TY*>(y.data);
    const int Pc = nvlink_home_blocks(g, s.combine_home_percent);
    if (vec)
      nvl::combine_kernel<TY, TO, N><<<nvlink_grid(g), nvl::kSumWarps * 32, 0, stream>>>(
          s.view(), o, Pc, s.batch, yp, ys, H, s.T, K, W, me, g.tmax,
          s.dest_rank.data_ptr<int32_t>(), s.dest_row.data_ptr<int64_t>(), w, weighted, ot, os);
    else
      nvl::combine_kernel<TY, TO, 1><<<nvlink_grid(g), nvl::kSumWarps * 32, 0, stream>>>(
          s.view(), o, Pc, s.batch, yp, ys, H, s.T, K, W, me, g.tmax,
          s.dest_rank.data_ptr<int32_t>(), s.dest_row.data_ptr<int64_t>(), w, weighted, ot, os);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  };
  auto with_out = [&](auto* yt) {
    switch (out.dtype) {
      case DType::kFloat32:
        return launch(yt, out.data_ptr<float>());
      case DType::kFloat16:
        return launch(yt, out.data_ptr<__half>());
      default:
        return launch(yt, out.data_ptr<__nv_bfloat16>());
    }
  };
  switch (y.dtype) {
    case DType::kFloat32:
      with_out(static_cast<const float*>(nullptr));
      break;
    case DType::kFloat16:
      with_out(static_cast<const __half*>(nullptr));
      break;
    default:
      with_out(static_cast<const __nv_bfloat16*>(nullptr));
  }
  g.mark("sum", stream);
  g.print_marks("nvlink combine");
}

void nvlink_combine_backward(EpGroup::Impl& g, TensorView dout, TensorView y, bool weighted,
                             TensorView grad_y, TensorView dprobs, cudaStream_t stream) {
  NvlinkState& s = *g.nvl;
  const nvl::Offsets& o = s.off;
  const int64_t H = g.opt.hidden;
  const int K = g.opt.topk, W = g.world, me = g.rank;
  MOEFLOW_CHECK(y.dtype == g.bwd_dtype, "the nvlink backend needs y of the gradient dtype ",
                dtype_name(g.bwd_dtype), " (the token dtype, or backward_dtype with FP8 tokens), got ",
                y.str());
  const int64_t esz = int64_t(dtype_size(y.dtype));
  MOEFLOW_CHECK(y.strides[1] == 1 && grad_y.strides[1] == 1 &&
                    nvlink_vec(H, static_cast<int>(16 / esz),
                               {{dout.data, dout.strides[0] * esz},
                                {y.data, y.strides[0] * esz},
                                {grad_y.data, grad_y.strides[0] * esz}}),
                "the nvlink backend needs 16-byte aligned rows of dout, y and grad_y");
  uint8_t* base = static_cast<uint8_t*>(s.base);
  nvl::op_start_kernel<<<1, 128, 0, stream>>>(s.view(), reinterpret_cast<int32_t*>(base + o.epoch));
  MOEFLOW_CUDA_LAUNCH_CHECK();
  nvlink_zero_pads(g, static_cast<uint8_t*>(grad_y.data), grad_y.strides[0] * esz, H * esz,
                   nullptr, nullptr, stream);
  const float* w = weighted ? s.probs.data_ptr<float>() : nullptr;
  auto rows = [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    nvl::combine_bwd_kernel<T><<<nvlink_grid(g), nvl::kBwdWarps * 32, 0, stream>>>(
        s.view(), o, nvlink_home_blocks(g, s.home_percent), s.batch, static_cast<const T*>(dout.data), dout.strides[0],
        static_cast<const T*>(y.data), y.strides[0], static_cast<T*>(grad_y.data),
        grad_y.strides[0], H, s.T, K, W, me, g.tmax, s.dest_rank.data_ptr<int32_t>(),
        s.dest_row.data_ptr<int64_t>(), w);
  };
  switch (y.dtype) {
    case DType::kFloat32:
      rows(static_cast<float*>(nullptr));
      break;
    case DType::kFloat16:
      rows(static_cast<__half*>(nullptr));
      break;
    default:
      rows(static_cast<__nv_bfloat16*>(nullptr));
  }
  MOEFLOW_CUDA_LAUNCH_CHECK();
  nvlink_barrier(s, stream);  // every dot product has landed at home
  if (dprobs.defined() && s.T > 0) {
    const int64_t n = s.T * K;
    nvl::dprobs_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
        reinterpret_cast<const float*>(base + o.dp), s.dest_rank.data_ptr<int32_t>(), n,
        dprobs.data_ptr<float>());
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace

EpDispatchResult ep_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                             TensorView scales, cudaStream_t stream) {
  EpGroup::Impl& g = group.impl();
  const Device dev = Device::cuda(g.device);
  const int K = g.opt.topk, W = g.world;
  MOEFLOW_CHECK(x.defined() && x.ndim == 2, "x must be [T,H], got ", x.str());
  const int64_t T = x.shape[0];
  detail::expect(x, "x", Expect{{g.opt.dtype}, {T, g.opt.hidden}, dev});
  MOEFLOW_CHECK(x.strides[1] == 1, "x rows must be contiguous (stride(1) == 1), got ", x.stride(1));
  MOEFLOW_CHECK(T <= g.opt.max_tokens_per_rank, "x has ", T,
                " tokens, more than max_tokens_per_rank=", g.opt.max_tokens_per_rank);
  detail::expect(ids, "ids", Expect{{DType::kInt32, DType::kInt64}, {T, K}, dev});
  MOEFLOW_CHECK(ids.is_contiguous(), "ids must be contiguous");
  if (probs.defined()) {
    detail::expect(probs, "probs", Expect{{DType::kFloat32}, {T, K}, dev});
    MOEFLOW_CHECK(probs.is_contiguous(), "probs must be contiguous");
  }
  // Every rank passes scales or none (their transfers pair up across ranks):
  // a group made with scale_cols > 0 takes them on every dispatch.
  MOEFLOW_CHECK(scales.defined() == (g.opt.scale_cols > 0),
                scales.defined()
                    ? "scales given but the group was made with EpOptions::scale_cols = 0"
                    : "the group was made with EpOptions::scale_cols > 0: every dispatch takes "
                      "scales");
  if (scales.defined()) {
    detail::expect(scales, "scales", Expect{{g.opt.scale_dtype}, {T, g.opt.scale_cols}, dev});
    MOEFLOW_CHECK(scales.is_contiguous(), "scales must be contiguous");
  }
  g.T = T;
  if (g.nvl) return nvlink_dispatch(g, x, ids, probs, scales, stream);
  g.mark("start", stream);
  int32_t* flags = g.flags.data_ptr<int32_t>();
  int32_t* pos = g.pos.data_ptr<int32_t>();
  int32_t* single = g.single();
  const int E = g.opt.num_experts;
  const int me = g.rank;
  const int64_t words = route_words(g.tmax, K);
  int32_t* route = g.route.data_ptr<int32_t>();
  const int C = g.chunks();
  g.pieces = C;
  // The eager piece's rows per peer, from the previous dispatch's counts
  // (the same number on both sides of a pair).
  bool eager = false;
  for (int q = 0; q < W; ++q) {
    auto rows = [&](const std::vector<int64_t>& cnt) {
      if (q == me || static_cast<int>(cnt.size()) != W) return int32_t{0};
      return static_cast<int32_t>(std::min<int64_t>(
          g.eager_max, static_cast<int64_t>(std::floor(g.eager_share * cnt[q]))));
    };
    g.eager_send.n[q] = rows(g.send_cnt);
    g.eager_recv.n[q] = rows(g.recv_cnt);
    g.eager_off.n[q] = q == 0 ? 0 : g.eager_off.n[q - 1] + g.eager_send.n[q - 1];
    eager = eager || g.eager_send.n[q] > 0 || g.eager_recv.n[q] > 0;
  }
  // (a token goes to at most min(K, W - 1) peers, so the previous counts
  // add up to at most max_tokens x that)
  MOEFLOW_CHECK(g.eager_off.n[W - 1] + g.eager_send.n[W - 1] <= g.eager_total,
                "internal: eager rows exceed their buffer");
  {  // also for T == 0: the pad entries and the message's T
    const int threads = 256;
    const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, (T + threads - 1) / threads));
    const float* pr = probs.defined() ? probs.data_ptr<float>() : nullptr;
    int32_t* own = route + me * words;
    if (ids.dtype == DType::kInt32)
      ep_flags_kernel<<<blocks, threads, 0, stream>>>(ids.data_ptr<int32_t>(), pr, T, K, E, g.epr,
                                                      W, me, flags, single, own);
    else
      ep_flags_kernel<<<blocks, threads, 0, stream>>>(ids.data_ptr<int64_t>(), pr, T, K, E, g.epr,
                                                      W, me, flags, single, own);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
  // The routing messages to every peer, on the NCCL stream, enqueued first
  // (their kernel then gets the SMs before the packs take them). Both sides'
  // counts follow from them; the host waits for those (its one
  // synchronisation) while the sender side ranks and packs on the caller's
  // stream and the eager piece travels. The receiver side (rows, ids, probs,
  // plan) is derived from the same messages on the device after the pieces
  // are enqueued.
  cudaStream_t cs = g.comm_stream;
  EpGroup::Impl::order(g.ev_start, stream, cs);
  if (W > 1) {
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < W; ++q) {
      if (q == me) continue;
      MOEFLOW_NCCL_CHECK(ncclSend(route + me * words, words, ncclInt32, q, g.comm, cs));
      MOEFLOW_NCCL_CHECK(ncclRecv(route + q * words, words, ncclInt32, q, g.comm, cs));
    }
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
  }
  MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_meta, cs));  // the messages are in
  g.mark("routes", cs);
  // The sender side's ranking: each (q, t)'s row in the send buffer
  // (destination-major, tokens ascending).
  size_t scan_bytes = static_cast<size_t>(g.scan_tmp.numel());
  MOEFLOW_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(g.scan_tmp.data(), scan_bytes, flags, pos,
                                                   2 * (W * T + 1), stream));
  g.mark("ranked", stream);
  const int64_t xs = x.strides[0] * static_cast<int64_t>(dtype_size(x.dtype));
  const bool vec = addr(x.data) % 16 == 0 && xs % 16 == 0 && g.row_bytes % 16 == 0;
  uint8_t* recv_x = static_cast<uint8_t*>(g.recv_x.data());
  // Received rows sit in per-source slots of max_tokens_per_rank rows: row j
  // of source q at q * tmax + j, so that the eager piece's address is known
  // before the counts.
  auto slot_row = [&](int q, int64_t j) { return recv_x + (q * g.tmax + j) * g.row_bytes; };
  // The eager piece in parts (a small first part leaves sooner): part k holds
  // rows [bound(k), bound(k+1)) of each pair, bound(P) = the eager rows.
  const int P = g.eager_parts;
  auto part_rows = [&](const EagerRows& B, int k) {
    EagerRows r{};
    for (int q = 0; q < W; ++q) r.n[q] = static_cast<int32_t>(int64_t{B.n[q]} * k / P);
    return r;
  };
  for (int k = 0; eager && k < P; ++k) {  // pack the parts
    const EagerRows slo = part_rows(g.eager_send, k), shi = part_rows(g.eager_send, k + 1);
    if (T > 0) {
      const unsigned blocks = static_cast<unsigned>((W * T * cuda::kWarpSize + 255) / 256);
      ep_pack_rows_kernel<<<blocks, 256, 0, stream>>>(
          static_cast<const uint8_t*>(x.data), xs, g.row_bytes, vec, T, 0, T, W, me, flags, pos,
          nullptr, slo, shi, static_cast<uint8_t*>(g.send_eager.data()), g.eager_off);
      MOEFLOW_CUDA_LAUNCH_CHECK();
    }
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_epacked[k], stream));
    g.mark("peager" + std::to_string(k), stream);
  }
  int32_t* counts = g.counts.data_ptr<int32_t>();
  // counts: [sent W x (rows C | single rows C) | received, the same | invalid]
  MOEFLOW_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(int32_t) * (4 * W * C + 1), cs));
  {  // about 512 tokens a block
    const dim3 grid(2 * W * C + 1, static_cast<unsigned>((g.tmax + 511) / 512));
    ep_route_counts_kernel<<<grid, 256, 0, cs>>>(route, words, W, K, g.epr, me, C, g.split,
                                                 counts);
  }
  MOEFLOW_CUDA_LAUNCH_CHECK();
  MOEFLOW_CUDA_CHECK(cudaMemcpyAsync(g.host, counts, sizeof(int32_t) * (4 * W * C + 1),
                                     cudaMemcpyDeviceToHost, cs));
  MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_host, cs));
  g.mark("counts", cs);
  for (int k = 0; eager && k < P; ++k) {  // and off they go, each once packed
    const EagerRows slo = part_rows(g.eager_send, k), shi = part_rows(g.eager_send, k + 1);
    const EagerRows rlo = part_rows(g.eager_recv, k), rhi = part_rows(g.eager_recv, k + 1);
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(cs, g.ev_epacked[k], 0));
    const uint8_t* se = static_cast<const uint8_t*>(g.send_eager.data());
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < W; ++q) {
      if (q == me) continue;
      const int64_t sb = slo.n[q], ns = shi.n[q] - sb, rb = rlo.n[q], nr = rhi.n[q] - rb;
      if (ns > 0)
        MOEFLOW_NCCL_CHECK(ncclSend(se + (int64_t{g.eager_off.n[q]} + sb) * g.row_bytes,
                                    ns * g.row_bytes, ncclUint8, q, g.comm, cs));
      if (nr > 0)
        MOEFLOW_NCCL_CHECK(ncclRecv(slot_row(q, rb), nr * g.row_bytes, ncclUint8, q, g.comm, cs));
    }
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_eager[k], cs));
    g.mark("eager" + std::to_string(k), cs);
  }
  // The sender side: each (q, t)'s row in the send buffer (destination-major,
  // tokens ascending), ids / probs of every row (combine's weights and
  // dprobs), then the token rows for the peers piece by piece (this rank's
  // own rows are permuted straight from x: self_src maps them back to tokens).
  int32_t* self_src = g.self_src.data_ptr<int32_t>();
  if (T > 0) {
    const unsigned blocks = static_cast<unsigned>((W * T + 255) / 256);
    if (ids.dtype == DType::kInt32)
      ep_pack_meta_kernel<<<blocks, 256, 0, stream>>>(
          ids.data_ptr<int32_t>(), probs.defined() ? probs.data_ptr<float>() : nullptr, T, K, E,
          g.epr, W, me, flags, pos, g.send_ids.data_ptr<int32_t>(), g.send_probs.data_ptr<float>(),
          self_src);
    else
      ep_pack_meta_kernel<<<blocks, 256, 0, stream>>>(
          ids.data_ptr<int64_t>(), probs.defined() ? probs.data_ptr<float>() : nullptr, T, K, E,
          g.epr, W, me, flags, pos, g.send_ids.data_ptr<int32_t>(), g.send_probs.data_ptr<float>(),
          self_src);
    MOEFLOW_CUDA_LAUNCH_CHECK();
    if (scales.defined() && g.scale_bytes > 0) {
      ep_pack_scales_kernel<<<blocks, 256, 0, stream>>>(
          static_cast<const uint8_t*>(scales.data), g.scale_bytes, T, W, flags, pos,
          static_cast<uint8_t*>(g.send_scales.data()));
      MOEFLOW_CUDA_LAUNCH_CHECK();
    }
  }
  g.mark("pmeta", stream);
  for (int c = 0; c < C; ++c) {
    const int64_t t0 = piece_start(T, c, C, g.split), t1 = piece_start(T, c + 1, C, g.split);
    if (t1 > t0) {
      const int64_t warps = W * (t1 - t0);
      const unsigned blocks = static_cast<unsigned>((warps * cuda::kWarpSize + 255) / 256);
      ep_pack_rows_kernel<<<blocks, 256, 0, stream>>>(
          static_cast<const uint8_t*>(x.data), xs, g.row_bytes, vec, T, t0, t1, W, me, flags, pos,
          static_cast<uint8_t*>(g.send_x.data()), EagerRows{}, g.eager_send, nullptr, EagerRows{});
      MOEFLOW_CUDA_LAUNCH_CHECK();
    }
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_rows[c], stream));
    g.mark("pack" + std::to_string(c), stream);
  }
  g.host_mark("h_sync");
  MOEFLOW_CUDA_CHECK(cudaEventSynchronize(g.ev_host));
  g.host_mark("h_woke");
  g.send_off.assign(W, 0);
  g.send_cnt.assign(W, 0);
  g.recv_off.assign(W, 0);
  g.recv_cnt.assign(W, 0);
  g.send_pc.assign(W * (C + 1), 0);
  g.recv_pc.assign(W * (C + 1), 0);
  int64_t so = 0, ro = 0;
  for (int q = 0; q < W; ++q) {
    for (int c = 0; c < C; ++c) {
      g.send_pc[q * (C + 1) + c + 1] = g.send_pc[q * (C + 1) + c] + g.host[q * 2 * C + c];
      g.recv_pc[q * (C + 1) + c + 1] =
          g.recv_pc[q * (C + 1) + c] + g.host[(W + q) * 2 * C + c];
    }
    g.send_off[q] = so;
    g.send_cnt[q] = g.send_pc[q * (C + 1) + C];
    so += g.send_cnt[q];
    g.recv_off[q] = ro;
    g.recv_cnt[q] = g.recv_pc[q * (C + 1) + C];
    ro += g.recv_cnt[q];
  }
  g.received = ro;
  // combine's way back: single rows and float32 partials, per rank and piece
  for (auto* v : {&g.send_moff, &g.send_soff, &g.recv_moff, &g.recv_soff}) v->assign(W, 0);
  for (auto* v : {&g.send_mpc, &g.send_spc, &g.recv_mpc, &g.recv_spc}) v->assign(W * (C + 1), 0);
  int64_t sso = 0, rso = 0;
  for (int q = 0; q < W; ++q) {
    for (int c = 0; c < C; ++c) {
      const int i = q * (C + 1) + c;
      g.send_spc[i + 1] = g.send_spc[i] + g.host[q * 2 * C + C + c];
      g.recv_spc[i + 1] = g.recv_spc[i] + g.host[(W + q) * 2 * C + C + c];
      g.send_mpc[i + 1] = g.send_pc[i + 1] - g.send_spc[i + 1];
      g.recv_mpc[i + 1] = g.recv_pc[i + 1] - g.recv_spc[i + 1];
    }
    g.send_soff[q] = sso;
    g.recv_soff[q] = rso;
    g.send_moff[q] = g.send_off[q] - sso;
    g.recv_moff[q] = g.recv_off[q] - rso;
    sso += g.send_spc[q * (C + 1) + C];
    rso += g.recv_spc[q * (C + 1) + C];
  }
  g.send_mrows = so - sso;
  g.recv_mrows = ro - rso;
  // The scales of every peer's rows (FP8 dispatch), then the token rows
  // piece by piece (peers only): piece c holds rows [pc(c), pc(c+1)) of each
  // pair's range; after an eager piece, the rest of each range as one piece
  // (every NCCL group on the stream costs a gap on the link).
  if (scales.defined() && g.scale_bytes > 0) {
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(cs, g.ev_rows[0], 0));  // (packed before the rows)
    g.exchange_peers(static_cast<const uint8_t*>(g.send_scales.data()), g.scale_bytes, g.send_off,
                     g.send_cnt, static_cast<uint8_t*>(g.recv_scales.data()), g.scale_bytes,
                     g.recv_off, g.recv_cnt, cs);
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_scales, cs));
  }
  const int DP = eager ? 1 : C;  // the pieces of the rows
  // Rows [b, e) of the pair with q of piece c (of DP), past the eager ones.
  auto piece_rows = [&](const std::vector<int64_t>& pc, int32_t first, int q, int c) {
    const int64_t b = eager ? 0 : pc[q * (C + 1) + c];
    const int64_t e = pc[q * (C + 1) + (eager ? C : c + 1)];
    return std::pair<int64_t, int64_t>{std::max<int64_t>(b, first), std::max<int64_t>(e, first)};
  };
  const uint8_t* send_x = static_cast<const uint8_t*>(g.send_x.data());
  for (int c = 0; c < DP; ++c) {
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(cs, g.ev_rows[eager ? C - 1 : c], 0));
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < W; ++q) {
      if (q == me) continue;
      const auto [sb, se] = piece_rows(g.send_pc, g.eager_send.n[q], q, c);
      const auto [rb, re] = piece_rows(g.recv_pc, g.eager_recv.n[q], q, c);
      if (se > sb)
        MOEFLOW_NCCL_CHECK(ncclSend(send_x + (g.send_off[q] + sb) * g.row_bytes,
                                    (se - sb) * g.row_bytes, ncclUint8, q, g.comm, cs));
      if (re > rb)
        MOEFLOW_NCCL_CHECK(
            ncclRecv(slot_row(q, rb), (re - rb) * g.row_bytes, ncclUint8, q, g.comm, cs));
    }
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_piece[c], cs));
    g.mark("x" + std::to_string(c), cs);
  }
  g.host_mark("h_x");
  {  // The receiver side of the routes, on the side stream: every received
     // row's local ids, probs and single flag (rows past the received ones
     // stay unrouted, -1, for the plan).
    cudaStream_t as = g.aux_stream;
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(as, g.ev_meta, 0));
    const int64_t N = W * g.tmax;
    int32_t* rfl = g.rfl.data_ptr<int32_t>();
    int32_t* rps = g.rps.data_ptr<int32_t>();
    const unsigned blocks = static_cast<unsigned>((N + 1 + 255) / 256);
    ep_route_flags_kernel<<<blocks, 256, 0, as>>>(route, words, g.tmax, W, K, g.epr, me, rfl);
    MOEFLOW_CUDA_LAUNCH_CHECK();
    size_t rb = static_cast<size_t>(g.rscan_tmp.numel());
    MOEFLOW_CUDA_CHECK(
        cub::DeviceScan::ExclusiveSum(g.rscan_tmp.data(), rb, rfl, rps, 2 * (N + 1), as));
    MOEFLOW_CUDA_CHECK(cudaMemsetAsync(g.recv_ids.data(), 0xFF, g.recv_ids.nbytes(), as));
    ep_route_unpack_kernel<<<blocks, 256, 0, as>>>(
        route, words, g.tmax, W, K, g.epr, me, rfl, rps, g.recv_ids.data_ptr<int32_t>(),
        g.recv_probs.data_ptr<float>(), g.rsingle.data_ptr<int32_t>(),
        g.rspos.data_ptr<int32_t>());
    MOEFLOW_CUDA_LAUNCH_CHECK();
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_aux, as));
  }
  // Unpack + permute + pad: the received rows routed over the local experts.
  MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(stream, g.ev_aux, 0));
  build_plan(g.recv_ids, g.plan, g.plan_ws, stream);
  g.mark("plan", stream);
  PermuteExtras extras;
  extras.probs = g.recv_probs;
  extras.permuted_probs = g.out_probs;
  if (scales.defined()) {  // own rows: the caller's scales, by token (self_src)
    extras.scales = scales;
    extras.permuted_scales = g.out_scales;
  }
  const int64_t H = g.opt.hidden;
  // A peer's received rows [b, e): permuted from its slot into their rows.
  auto permute_peer = [&](int q, int64_t b, int64_t e, int blocks) {
    if (e <= b) return;
    const int64_t first = g.recv_off[q] + b;
    if (scales.defined())  // the rows' scales, row by row with them
      extras.scales = TensorView::strided(
          static_cast<uint8_t*>(g.recv_scales.data()) + first * g.scale_bytes, g.opt.scale_dtype,
          dev, {e - b, g.opt.scale_cols}, {g.opt.scale_cols, 1});
    const TensorView rows =
        TensorView::strided(slot_row(q, b), g.opt.dtype, dev, {e - b, H}, {H, 1});
    cuda::permute_tokens(rows, first, e - b, false, g.plan, g.out_x, extras, stream, nullptr,
                         blocks);
  };
  // own rows straight from x, with the pad rows
  const int ob = g.opt.overlap_blocks;
  cuda::permute_tokens(x, g.recv_off[me], g.recv_cnt[me], true, g.plan, g.out_x, extras, stream,
                       self_src, ob);
  g.mark("self", stream);
  for (int k = 0; eager && k < P; ++k) {  // the eager parts (with scales: all there by then)
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(
        stream, scales.defined() && g.scale_bytes > 0 ? g.ev_scales : g.ev_eager[k], 0));
    const EagerRows lo = part_rows(g.eager_recv, k), hi = part_rows(g.eager_recv, k + 1);
    for (int q = 0; q < W; ++q)
      if (q != me)
        permute_peer(q, std::min<int64_t>(lo.n[q], g.recv_cnt[q]),
                     std::min<int64_t>(hi.n[q], g.recv_cnt[q]), ob);
    g.mark("perm_e" + std::to_string(k), stream);
  }
  for (int c = 0; c < DP; ++c) {
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(stream, g.ev_piece[c], 0));
    for (int q = 0; q < W; ++q) {
      if (q == me) continue;
      const auto [b, e] = piece_rows(g.recv_pc, g.eager_recv.n[q], q, c);
      permute_peer(q, b, e, c + 1 < DP ? ob : 0);
    }
    g.mark("perm" + std::to_string(c), stream);
  }
  g.print_marks("dispatch");
  MOEFLOW_CHECK(g.host[4 * W * C] == 0, "ids: ", g.host[4 * W * C], " routing entries outside [-1, ", E,
                ") on rank ", g.rank, " (treated as unrouted; the dispatch completed)");
  return EpDispatchResult{g.out_x, g.out_probs, scales.defined() ? g.out_scales.view() : TensorView{},
                          &g.plan, g.received};
}

EpDispatchResult ep_dispatch(EpGroup& group, TensorView x, TensorView ids, TensorView probs,
                             cudaStream_t stream) {
  return ep_dispatch(group, x, ids, probs, TensorView{}, stream);
}

namespace {
void combine_impl(EpGroup::Impl& g, TensorView y, bool weighted, TensorView out,
                  cudaStream_t stream) {
  const Device dev = Device::cuda(g.device);
  detail::expect(
      y, "y",
      Expect{
          {DType::kFloat32, DType::kFloat16, DType::kBFloat16}, {g.capacity, g.opt.hidden}, dev});
  detail::expect(
      out, "out",
      Expect{{DType::kFloat32, DType::kFloat16, DType::kBFloat16}, {g.T, g.opt.hidden}, dev});
  MOEFLOW_CHECK(out.strides[1] == 1, "out rows must be contiguous (stride(1) == 1)");
  if (g.nvl) return nvlink_combine(g, y, weighted, out, stream);
  const int W = g.world, me = g.rank, C = g.pieces, K = g.opt.topk;
  const int64_t H = g.opt.hidden;
  const float* weights = weighted ? g.recv_probs.data_ptr<float>() : nullptr;
  cudaStream_t cs = g.comm_stream;
  // Piece c of every peer's rows is summed, then sent back while the next is
  // summed; this rank's own partials are summed last and stay in place; the
  // home tokens of piece c are added up as soon as their partials are all back.
  // A row with one slot here goes back as that slot's row of y (ysize bytes
  // per element instead of 4), after the float32 partials of the buffer.
  const int64_t pb = H * 4, ysize = static_cast<int64_t>(dtype_size(y.dtype)), yb = H * ysize;
  uint8_t* partial_b = static_cast<uint8_t*>(g.partial.data());
  uint8_t* back_b = static_cast<uint8_t*>(g.back.data());
  uint8_t* partial_s = partial_b + g.recv_mrows * pb;  // single rows sent
  uint8_t* back_s = back_b + g.send_mrows * pb;         // single rows received
  const int32_t* rsingle = g.rsingle.data_ptr<int32_t>();
  const int32_t* rspos = g.rspos.data_ptr<int32_t>();
  const int64_t* dest_row = g.plan.dest_row.data_ptr<int64_t>();
  const int32_t* recv_ids = g.recv_ids.data_ptr<int32_t>();
  auto holder = [&](int64_t r0, int64_t n, int max_blocks) {
    if (n <= 0) return;
    cuda::with_float_type(y.dtype, [&](auto ty) {
      using TY = decltype(ty);
      constexpr int N = 16 / sizeof(TY);
      const int64_t ys = y.strides[0];
      const bool vec = H % N == 0 && addr(y.data) % 16 == 0 && (ys * ysize) % 16 == 0;
      int64_t blocks = (n * cuda::kWarpSize + 255) / 256;
      blocks = std::min<int64_t>(blocks, max_blocks > 0 ? max_blocks : 4 * g.sm_count);
      const TY* yp = static_cast<const TY*>(y.data);
      float* pp = reinterpret_cast<float*>(partial_b);
      TY* sp = reinterpret_cast<TY*>(partial_s);
      if (vec)
        ep_holder_kernel<TY, N><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
            yp, ys, H, dest_row, recv_ids, weights, K, r0, n, rsingle, rspos, pp, sp);
      else
        ep_holder_kernel<TY, 1><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
            yp, ys, H, dest_row, recv_ids, weights, K, r0, n, rsingle, rspos, pp, sp);
      MOEFLOW_CUDA_LAUNCH_CHECK();
    });
  };
  g.mark("start", stream);
  for (int c = 0; c < C; ++c) {
    for (int q = 0; q < W; ++q) {
      if (q == me) continue;
      const int64_t b = g.recv_pc[q * (C + 1) + c], e = g.recv_pc[q * (C + 1) + c + 1];
      holder(g.recv_off[q] + b, e - b, c > 0 ? g.opt.overlap_blocks : 0);
    }
    g.mark("unperm" + std::to_string(c), stream);
    EpGroup::Impl::order(g.ev_piece[c], stream, cs);
    MOEFLOW_NCCL_CHECK(ncclGroupStart());
    g.exchange_piece(c, partial_b, pb, g.recv_moff, g.recv_mpc, back_b, pb, g.send_moff,
                     g.send_mpc, cs);
    g.exchange_piece(c, partial_s, yb, g.recv_soff, g.recv_spc, back_s, yb, g.send_soff,
                     g.send_spc, cs);
    MOEFLOW_NCCL_CHECK(ncclGroupEnd());
    MOEFLOW_CUDA_CHECK(cudaEventRecord(g.ev_back[c], cs));
    g.mark("back" + std::to_string(c), cs);
  }
  holder(g.recv_off[me], g.recv_cnt[me], g.opt.overlap_blocks);
  g.mark("self", stream);
  const float* back = g.back.data_ptr<float>();
  const float* partial = g.partial.data_ptr<float>();
  // own rows: partial index = recv row - single rows received before them
  const int64_t shift = g.recv_off[me] - g.send_off[me] - g.recv_soff[me];
  const bool vec4 = H % 4 == 0 && addr(out.data) % (4 * dtype_size(out.dtype)) == 0 &&
                    out.strides[0] % 4 == 0;
  const int64_t per = vec4 ? H / 4 : H;
  const int threads = static_cast<int>(std::min<int64_t>(256, (per + 31) / 32 * 32));
  const int32_t* fl = g.flags.data_ptr<int32_t>();
  const int32_t* ps = g.pos.data_ptr<int32_t>();
  const int32_t* sg = g.single();
  const int32_t* sps = g.spos_raw();
  const int32_t* sbase = g.spos_base();
  const int32_t* sids = g.send_ids.data_ptr<int32_t>();
  const float* sprobs = g.send_probs.data_ptr<float>();
  const int64_t T = g.T;
  for (int c = 0; c < C; ++c) {
    MOEFLOW_CUDA_CHECK(cudaStreamWaitEvent(stream, g.ev_back[c], 0));
    const int64_t t0 = piece_start(T, c, C, g.split), t1 = piece_start(T, c + 1, C, g.split);
    if (t1 == t0) continue;
    const unsigned blocks = static_cast<unsigned>(t1 - t0);
    auto launch = [&](auto* o) {
      using TOut = std::remove_pointer_t<decltype(o)>;
      cuda::with_float_type(y.dtype, [&](auto ty) {
        using TY = decltype(ty);
        const TY* bs = reinterpret_cast<const TY*>(back_s);
        if (vec4)
          ep_combine_kernel<TY, TOut, 4><<<blocks, threads, 0, stream>>>(
              back, bs, partial, me, shift, H, T, t0, W, K, fl, ps, sg, sps, sbase, sids, sprobs,
              weighted, o, out.strides[0]);
        else
          ep_combine_kernel<TY, TOut, 1><<<blocks, threads, 0, stream>>>(
              back, bs, partial, me, shift, H, T, t0, W, K, fl, ps, sg, sps, sbase, sids, sprobs,
              weighted, o, out.strides[0]);
      });
    };
    switch (out.dtype) {
      case DType::kFloat32:
        launch(out.data_ptr<float>());
        break;
      case DType::kFloat16:
        launch(out.data_ptr<__half>());
        break;
      default:
        launch(out.data_ptr<__nv_bfloat16>());
    }
    MOEFLOW_CUDA_LAUNCH_CHECK();
    g.mark("sum" + std::to_string(c), stream);
  }
  g.print_marks("combine");
}
}  // namespace

void ep_combine(EpGroup& group, TensorView y, bool weighted, TensorView out, cudaStream_t stream) {
  combine_impl(group.impl(), y, weighted, out, stream);
}

void ep_dispatch_backward(EpGroup& group, TensorView grad_recv, TensorView grad_x,
                          cudaStream_t stream) {
  combine_impl(group.impl(), grad_recv, false, grad_x, stream);
}

void ep_combine_backward(EpGroup& group, TensorView dout, TensorView y, bool weighted,
                         TensorView grad_y, TensorView dprobs, cudaStream_t stream) {
  EpGroup::Impl& g = group.impl();
  const Device dev = Device::cuda(g.device);
  const int K = g.opt.topk, W = g.world;
  const int64_t T = g.T, H = g.opt.hidden;
  detail::expect(dout, "dout", Expect{{g.bwd_dtype}, {T, H}, dev});
  MOEFLOW_CHECK(dout.strides[1] == 1, "dout rows must be contiguous (stride(1) == 1)");
  detail::expect(
      y, "y", Expect{{DType::kFloat32, DType::kFloat16, DType::kBFloat16}, {g.capacity, H}, dev});
  detail::expect(grad_y, "grad_y", Expect{{y.dtype}, {g.capacity, H}, dev});
  if (dprobs.defined()) {
    detail::expect(dprobs, "dprobs", Expect{{DType::kFloat32}, {T, K}, dev});
    MOEFLOW_CHECK(dprobs.is_contiguous(), "dprobs must be contiguous");
  }
  if (g.nvl) return nvlink_combine_backward(g, dout, y, weighted, grad_y, dprobs, stream);
  const int32_t* flags = g.flags.data_ptr<int32_t>();
  const int32_t* pos = g.pos.data_ptr<int32_t>();
  if (T > 0) {  // dout rows along the dispatch routes
    const int64_t xs = dout.strides[0] * static_cast<int64_t>(dtype_size(dout.dtype));
    const bool vec = addr(dout.data) % 16 == 0 && xs % 16 == 0 && g.bwd_row_bytes % 16 == 0;
    const unsigned blocks = static_cast<unsigned>((W * T * cuda::kWarpSize + 255) / 256);
    ep_pack_rows_kernel<<<blocks, 256, 0, stream>>>(
        static_cast<const uint8_t*>(dout.data), xs, g.bwd_row_bytes, vec, T, 0, T, W, -1, flags,
        pos, static_cast<uint8_t*>(g.send_x.data()), EagerRows{}, EagerRows{}, nullptr, EagerRows{});
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
  MOEFLOW_NCCL_CHECK(ncclGroupStart());
  g.exchange(static_cast<const uint8_t*>(g.send_x.data()), g.bwd_row_bytes, g.send_off, g.send_cnt,
             static_cast<uint8_t*>(g.recv_x.data()), g.bwd_row_bytes, g.recv_off, g.recv_cnt,
             stream);
  MOEFLOW_NCCL_CHECK(ncclGroupEnd());
  // On the expert rank: the gradient of its unpermute (rows past the received
  // ones have no slots and are never read).
  const TensorView recv_d =
      TensorView::strided(g.recv_x.data(), g.bwd_dtype, dev, {g.rows_max, H}, {H, 1});
  unpermute_backward(recv_d, g.plan, y, weighted ? TensorView(g.recv_probs) : TensorView{},
                     grad_y, dprobs.defined() ? TensorView(g.recv_dprobs) : TensorView{}, stream);
  if (!dprobs.defined()) return;
  const int64_t pb = int64_t{K} * 4;
  MOEFLOW_NCCL_CHECK(ncclGroupStart());
  g.exchange(static_cast<const uint8_t*>(g.recv_dprobs.data()), pb, g.recv_off, g.recv_cnt,
             static_cast<uint8_t*>(g.back_dprobs.data()), pb, g.send_off, g.send_cnt, stream);
  MOEFLOW_NCCL_CHECK(ncclGroupEnd());
  if (T == 0) return;
  const unsigned blocks = static_cast<unsigned>((T * K + 255) / 256);
  ep_dprobs_kernel<<<blocks, 256, 0, stream>>>(g.back_dprobs.data_ptr<float>(),
                                               g.send_ids.data_ptr<int32_t>(), T, K, W, flags, pos,
                                               dprobs.data_ptr<float>());
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow
