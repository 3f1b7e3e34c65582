// The nccl backend's kernels and their launchers (declared in api.cuh).
//
// Sender side: one thread per token flags the ranks it has slots on (and
// whether it is exactly one slot there: a "single" row, which combine brings
// home as its row of y) and writes the rank's routing message; after a scan
// of the flags each (rank, token) has its row in the send buffer, where the
// pack kernels put its ids, probs, scales and token row. Receiver side: the
// same flags over every rank's routing message give the received rows
// without a metadata round. Combine: the holder kernel sums each received
// token's slots into one float32 partial (or copies a single row), and the
// combine-sum kernel adds each home token's partials in ascending rank order.
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/ep/api.cuh"

namespace moeflow {
namespace ep_nccl {
namespace {

// flags[q*T + t] = 1 when token t has a valid slot on rank q; invalid ids
// (outside [-1, E)) are counted and ignored. single[q*T + t] = 1 when that
// is exactly one slot and q is a peer: combine brings it home as its row of
// y instead of a float32 partial. Both arrays end in a zero pad entry
// [W*T], and single starts right after flags' pad, so that one exclusive scan
// of the two gives both prefixes (single's offset by the flags' total).
template <typename IdT>
__global__ void ep_flags_kernel(const SendFlagsParams params) {
  const TokenRouting& routing = params.routing;
  const IdT* ids = static_cast<const IdT*>(routing.ids);
  const float* probs = routing.probs;
  const int64_t T = routing.num_tokens;
  const int K = routing.topk, E = routing.num_experts, epr = routing.experts_per_rank,
            W = routing.world, self = routing.rank;
  int32_t *flags = params.flags, *single = params.single, *route = params.route;
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
__global__ void ep_route_flags_kernel(const RecvFlagsParams params) {
  const int32_t* route = params.route.routes;
  const int64_t words = params.route.words, tmax = params.route.max_tokens;
  const int W = params.route.world, K = params.route.topk, epr = params.route.experts_per_rank,
            me = params.route.rank;
  int32_t* rfl = params.recv_flags;
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
__global__ void ep_route_unpack_kernel(const RecvUnpackParams params) {
  const int32_t* route = params.route.routes;
  const int64_t words = params.route.words, tmax = params.route.max_tokens;
  const int W = params.route.world, K = params.route.topk, epr = params.route.experts_per_rank,
            me = params.route.rank;
  const int32_t *rfl = params.recv_flags, *rps = params.recv_flag_scan;
  int32_t *recv_ids = params.recv_ids, *rsingle = params.recv_single,
          *rspos = params.recv_single_pos;
  float* recv_probs = params.recv_probs;
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

// Both sides' counts straight from the routing messages, added up into
// zeroed counts by blocks (x = segment, y = a share of its tokens): segment
// (d, q, c), d = 0: rows this rank sends to rank q for its tokens of piece c
// (tokens [piece_start(c), piece_start(c+1)) with a slot on q) and how many
// of them are single rows (exactly one slot there, q a peer), into
// counts[q*2C + c] and counts[q*2C + C + c]; d = 1: the same received from
// rank q (q's tokens with a slot here), at counts[2WC + ...]. The last
// segment counts this rank's invalid routing entries into counts[4WC].
__global__ void ep_route_counts_kernel(const RouteCountsParams params) {
  const int32_t* route = params.route.routes;
  const int64_t words = params.route.words;
  const int W = params.route.world, K = params.route.topk, epr = params.route.experts_per_rank,
            me = params.route.rank;
  const int C = params.pieces, split = params.split;
  int32_t* counts = params.counts;
  const int seg = blockIdx.x;
  __shared__ int rows_s, single_s;
  if (threadIdx.x == 0) rows_s = single_s = 0;
  __syncthreads();
  int rows = 0, singles = 0;
  const int d = seg / (W * C), q = (seg / C) % W, c = seg % C;
  const int src = seg == 2 * W * C || d == 0 ? me : q;  // whose tokens
  const int dst = d == 0 ? q : me;                      // whose experts
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
// from 0 (unpermute's sum, bit for bit), to partial[r - rspos[r] - shift]
// (rounded to bfloat16 with partial_bf16).
template <typename TY, int N>
__global__ void ep_holder_kernel(const HolderParams params) {
  const TY* y = static_cast<const TY*>(params.y);
  const int64_t y_stride = params.y_stride, H = params.hidden, r0 = params.r0, n = params.n;
  const int64_t* dest_row = params.dest_row;
  const int32_t *recv_ids = params.recv_ids, *rsingle = params.recv_single,
                *rspos = params.recv_single_pos;
  const float* weights = params.weights;
  const int K = params.topk;
  float* partial = static_cast<float*>(params.partial);
  __nv_bfloat16* partial16 = static_cast<__nv_bfloat16*>(params.partial);
  const bool bf16 = params.partial_bf16;
  const int64_t shift = params.partial_shift;
  TY* single_rows = static_cast<TY*>(params.single_rows);
  constexpr int kU = 4;
  using P = cuda::Pack<TY, N>;
  using F = cuda::Pack<float, N>;
  using B = cuda::Pack<__nv_bfloat16, N>;
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
    const int64_t pi = r - rspos[r] - shift;
    F* dst = reinterpret_cast<F*>(partial + pi * H);
    B* dst16 = reinterpret_cast<B*>(partial16 + pi * H);
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
        if (bf16) {
          B o;
#pragma unroll
          for (int j = 0; j < N; ++j) o.v[j] = __float2bfloat16_rn(acc[u][j]);
          dst16[p] = o;
        } else {
          F o;
#pragma unroll
          for (int j = 0; j < N; ++j) o.v[j] = acc[u][j];
          dst[p] = o;
        }
      }
    }
  }
}

// One thread per (q, t) with a flag: the K local ids and probs of the row;
// for q == self also self_src[j] = t, t being this rank's j-th own row.
template <typename IdT>
__global__ void ep_pack_meta_kernel(const PackMetaParams params) {
  const TokenRouting& routing = params.routing;
  const IdT* ids = static_cast<const IdT*>(routing.ids);
  const float* probs = routing.probs;
  const int64_t T = routing.num_tokens;
  const int K = routing.topk, E = routing.num_experts, epr = routing.experts_per_rank,
            W = routing.world, self = routing.rank;
  const int32_t *flags = params.flags, *pos = params.rows;
  int32_t *send_ids = params.send_ids, *self_src = params.own_row_token;
  float* send_probs = params.send_probs;
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

// Token rows of tokens [t0, t1) along the routes (one warp per (q, t) with a
// flag), except those for rank `skip` (-1: none). The row's index j among
// the rows for q decides where it goes: with `eager` null, rows j >= hi[q] to
// the send buffer (row pos[q*T + t]); otherwise rows lo[q] <= j < hi[q] to
// row eager_off[q] + j of the eager buffer.
__global__ void ep_pack_rows_kernel(const PackRowsParams params) {
  const uint8_t* x = params.x;
  const int64_t x_stride_bytes = params.x_stride_bytes, row_bytes = params.row_bytes;
  const bool vec = params.vec;
  const int64_t T = params.num_tokens, t0 = params.t0, t1 = params.t1;
  const int W = params.world, skip = params.skip;
  const int32_t *flags = params.flags, *pos = params.rows;
  uint8_t *send_x = params.send_x, *eager = params.eager;
  const EagerRows &lo = params.lo, &hi = params.hi, &eager_off = params.eager_off;
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
__global__ void ep_dprobs_kernel(const DprobsParams params) {
  const float* back = params.back;
  const int32_t *send_ids = params.send_ids, *flags = params.flags, *pos = params.rows;
  const int64_t T = params.num_tokens;
  const int K = params.topk, W = params.world;
  float* dprobs = params.dprobs;
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
__global__ void ep_pack_scales_kernel(const PackScalesParams params) {
  const uint8_t* scales = params.scales;
  const int64_t sb = params.scale_bytes, T = params.num_tokens;
  const int W = params.world;
  const int32_t *flags = params.flags, *pos = params.rows;
  uint8_t* send = params.send_scales;
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
// partial is in partial[pos[self,t] + self_shift]. A peer's partial is
// float32, or bfloat16 with back_bf16 (EpOptions::combine_wire_dtype); the
// own one is always float32. N elements per access.
constexpr int kSingle = 1, kHalf = 2;  // the kinds of a source row (0: float32 partial)
template <typename TY, typename TOut, int N>
__global__ void ep_combine_kernel(const CombineSumParams params) {
  const float *partial = params.partial, *send_probs = params.send_probs;
  const bool back16 = params.back_bf16;
  const TY* back_single = static_cast<const TY*>(params.back_single);
  const int self = params.rank, W = params.world, K = params.topk;
  const int64_t self_shift = params.self_shift, H = params.hidden, T = params.num_tokens,
                t0 = params.t0;
  const int32_t *flags = params.flags, *pos = params.rows, *single = params.single,
                *spos_raw = params.single_pos_raw, *sbase = params.single_base,
                *send_ids = params.send_ids;
  const bool weighted = params.weighted;
  TOut* out = static_cast<TOut*>(params.out);
  const int64_t out_stride = params.out_stride;
  const int64_t t = t0 + blockIdx.x;
  __shared__ const void* src[kMaxWorld];
  __shared__ float wsrc[kMaxWorld];  // weight of a single row
  __shared__ int kind[kMaxWorld];    // kSingle: a single row, kHalf: a bf16 partial, else float32
  __shared__ int count;
  if (threadIdx.x == 0) {
    int n = 0;
    const int32_t base = *sbase;
    for (int q = 0; q < W; ++q) {
      if (!flags[q * T + t]) continue;
      const int64_t row = pos[q * T + t];
      kind[n] = 0;
      if (q == self) {
        src[n] = partial + (row + self_shift) * H;
      } else if (single[q * T + t]) {
        float w = 1.0f;
        for (int k = 0; k < K; ++k)
          if (send_ids[row * K + k] >= 0 && weighted) w = send_probs[row * K + k];
        src[n] = back_single + int64_t{spos_raw[q * T + t] - base} * H;
        wsrc[n] = w;
        kind[n] = kSingle;
      } else {
        const int64_t i = (row - (spos_raw[q * T + t] - base)) * H;
        if (back16) {
          src[n] = static_cast<const __nv_bfloat16*>(params.back) + i;
          kind[n] = kHalf;
        } else {
          src[n] = static_cast<const float*>(params.back) + i;
        }
      }
      ++n;
    }
    count = n;
  }
  __syncthreads();
  const int n = count;
  using In = cuda::Pack<float, N>;
  using InY = cuda::Pack<TY, N>;
  using InB = cuda::Pack<__nv_bfloat16, N>;
  using Out = cuda::Pack<TOut, N>;
  for (int64_t v = threadIdx.x; v < H / N; v += blockDim.x) {
    In acc;
#pragma unroll
    for (int j = 0; j < N; ++j) acc.v[j] = 0.0f;
    for (int i = 0; i < n; ++i) {
      In p;
      if (kind[i] == kSingle) {
        const float w = wsrc[i];
        const InY yv = reinterpret_cast<const InY*>(src[i])[v];
#pragma unroll
        for (int j = 0; j < N; ++j) p.v[j] = fmaf(w, cuda::to_float(yv.v[j]), 0.0f);
      } else if (kind[i] == kHalf) {
        const InB bv = reinterpret_cast<const InB*>(src[i])[v];
#pragma unroll
        for (int j = 0; j < N; ++j) p.v[j] = __bfloat162float(bv.v[j]);
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

}  // namespace

// --- Launchers ----------------------------------------------------------------

void launch_send_flags(const SendFlagsParams& p, cudaStream_t stream) {
  // also for T == 0: the pad entries and the message's T
  const int threads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, (p.routing.num_tokens + threads - 1) / threads));
  if (!p.routing.ids_int64)
    ep_flags_kernel<int32_t><<<blocks, threads, 0, stream>>>(p);
  else
    ep_flags_kernel<int64_t><<<blocks, threads, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

// One thread per (source, token) entry of the receiver's flags, and the pad.
static unsigned recv_flag_blocks(const RouteView& r) {
  const int64_t N = r.world * r.max_tokens;
  return static_cast<unsigned>((N + 1 + 255) / 256);
}

void launch_recv_flags(const RecvFlagsParams& p, cudaStream_t stream) {
  ep_route_flags_kernel<<<recv_flag_blocks(p.route), 256, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_recv_unpack(const RecvUnpackParams& p, cudaStream_t stream) {
  ep_route_unpack_kernel<<<recv_flag_blocks(p.route), 256, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_route_counts(const RouteCountsParams& p, cudaStream_t stream) {
  // about 512 tokens a block
  const dim3 grid(2 * p.route.world * p.pieces + 1,
                  static_cast<unsigned>((p.route.max_tokens + 511) / 512));
  ep_route_counts_kernel<<<grid, 256, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_pack_meta(const PackMetaParams& p, cudaStream_t stream) {
  const unsigned blocks =
      static_cast<unsigned>((p.routing.world * p.routing.num_tokens + 255) / 256);
  if (!p.routing.ids_int64)
    ep_pack_meta_kernel<int32_t><<<blocks, 256, 0, stream>>>(p);
  else
    ep_pack_meta_kernel<int64_t><<<blocks, 256, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_pack_rows(const PackRowsParams& p, cudaStream_t stream) {
  const int64_t warps = p.world * (p.t1 - p.t0);
  const unsigned blocks = static_cast<unsigned>((warps * cuda::kWarpSize + 255) / 256);
  ep_pack_rows_kernel<<<blocks, 256, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_pack_scales(const PackScalesParams& p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.world * p.num_tokens + 255) / 256);
  ep_pack_scales_kernel<<<blocks, 256, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_holder(const HolderParams& p, DType y_dtype, int64_t grid_cap, cudaStream_t stream) {
  const int64_t H = p.hidden, ysize = static_cast<int64_t>(dtype_size(y_dtype));
  cuda::with_float_type(y_dtype, [&](auto ty) {
    using TY = decltype(ty);
    constexpr int N = 16 / sizeof(TY);
    const bool vec = H % N == 0 && addr(p.y) % 16 == 0 && (p.y_stride * ysize) % 16 == 0;
    int64_t blocks = (p.n * cuda::kWarpSize + 255) / 256;
    blocks = std::min<int64_t>(blocks, grid_cap);
    if (vec)
      ep_holder_kernel<TY, N><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
    else
      ep_holder_kernel<TY, 1><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  });
}

void launch_combine_sum(const CombineSumParams& p, DType y_dtype, DType out_dtype, bool vec4,
                        int64_t count, cudaStream_t stream) {
  const int64_t per = vec4 ? p.hidden / 4 : p.hidden;
  const int threads = static_cast<int>(std::min<int64_t>(256, (per + 31) / 32 * 32));
  const unsigned blocks = static_cast<unsigned>(count);
  auto launch = [&](auto out_type) {
    using TOut = decltype(out_type);
    cuda::with_float_type(y_dtype, [&](auto ty) {
      using TY = decltype(ty);
      if (vec4)
        ep_combine_kernel<TY, TOut, 4><<<blocks, threads, 0, stream>>>(p);
      else
        ep_combine_kernel<TY, TOut, 1><<<blocks, threads, 0, stream>>>(p);
    });
  };
  switch (out_dtype) {
    case DType::kFloat32:
      launch(float{});
      break;
    case DType::kFloat16:
      launch(__half{});
      break;
    default:
      launch(__nv_bfloat16{});
  }
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_dprobs(const DprobsParams& p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.num_tokens * p.topk + 255) / 256);
  ep_dprobs_kernel<<<blocks, 256, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace ep_nccl
}  // namespace moeflow
