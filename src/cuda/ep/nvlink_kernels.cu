// The nvlink backend's kernels and their launchers (declared in api.cuh).
//
// Each fused kernel has two roles: blocks [0, P) are the home role (this
// rank's own tokens), the others the holder role (the peers' tokens that have
// slots here). A token is announced to a peer by a flag flag[s][t] = epoch
// (stores made visible first, then st.release.sys; the waiter spins with
// ld.acquire.sys and loads through L2); epoch is the operation's number, so
// flags never need resetting and CUDA graph replays stay correct. In each
// kernel one role never waits and the other waits only for that role on the
// other ranks, so no spin can deadlock.
//   dispatch: home stores x[t] once into each own kept slot's row and once
//     into every peer holding a kept slot (its row when it holds one, else its
//     stage); holder expands staged rows into the slots' rows.
//   combine: holder sums a peer token's slots (k ascending) into the home
//     rank's partial (one slot: its row of y as is); home adds its own slots
//     and the peers' partials in ascending rank order.
//   combine backward: home stages dout[t] on the holders; both compute
//     grad_y = w * dout and <dout, y> per slot (holders into the home's dp).
#include <algorithm>

#include "cuda/ep/nvlink_device.cuh"

namespace moeflow {
namespace nvl {
namespace {

// A standalone LSA barrier (one block).
__global__ void barrier_kernel(Window w) {
  w.barrier();
}

// ids [T,K] (int32/int64) -> local [tmax,K] int32, rows past T unrouted.
template <typename IdT>
__global__ void copy_ids_kernel(const IdT* ids, int64_t T, int K, int64_t tmax, int32_t* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= tmax * K) return;
  if (i >= T * K) {
    out[i] = -1;
    return;
  }
  const int64_t v = static_cast<int64_t>(ids[i]);
  out[i] = v >= -1 && v <= INT32_MAX ? static_cast<int32_t>(v) : -2;  // -2: invalid, counted
}

// Step 2 (one block): counts exchanged, slot ranges and the receive plan.
__global__ void counts_kernel(const CountsParams params) {
  const Window& win = params.win;
  const size_t off_counts = params.off_counts, off_ntok = params.off_ntok;
  const int32_t* my_counts = params.my_counts;
  const int32_t my_T = params.my_T;
  const int E = params.E, W = params.W, me = params.me, align = params.align;
  const int64_t capacity = params.capacity;
  int64_t *first_row = params.first_row, *fit = params.fit, *offsets = params.offsets,
          *total_rows = params.total_rows;
  int32_t *kept = params.kept, *padded = params.padded, *overflow = params.overflow,
          *epoch = params.epoch;
  const int32_t* invalid_src = params.invalid_src;
  int32_t* invalid_dst = params.invalid_dst;
  win.barrier();                                      // the peers are done with the last round
  if (threadIdx.x == 0) *invalid_dst = *invalid_src;  // the plan's count of invalid ids
  if (threadIdx.x == 0) ++*epoch;  // this dispatch's number, which its flags carry
  for (int i = threadIdx.x; i < W * E; i += blockDim.x) {
    const int p = i / E, g = i % E;
    int32_t* dst =
        static_cast<int32_t*>(win.at(off_counts + (size_t(me) * E + g) * sizeof(int32_t), p));
    *dst = my_counts[g];
  }
  for (int p = threadIdx.x; p < W; p += blockDim.x) {
    *static_cast<int32_t*>(win.at(off_ntok + size_t(me) * sizeof(int32_t), p)) = my_T;
    *static_cast<int32_t*>(win.at(params.off_xregion + size_t(me) * sizeof(int32_t), p)) =
        params.my_xregion;
  }
  win.barrier();  // every row of the matrix is in
  // The layout of every expert from the matrix (core/ep_layout.h), the
  // prefix sums per rank in shared memory.
  __shared__ int32_t routed[kMaxExperts];
  __shared__ int64_t prefix[kMaxExperts];
  __shared__ int64_t dropped;
  const int32_t* C = static_cast<const int32_t*>(win.at(off_counts, me));
  const int L = E / W;
  if (threadIdx.x == 0) dropped = 0;
  for (int g = threadIdx.x; g < E; g += blockDim.x)
    routed[g] = static_cast<int32_t>(ep_routed(C, W, E, g));
  __syncthreads();
  if (threadIdx.x < W) {
    int64_t pre = 0;
    for (int g = threadIdx.x * L; g < (threadIdx.x + 1) * L; ++g) {
      prefix[g] = pre;
      pre += (routed[g] + align - 1) / align * align;
    }
  }
  __syncthreads();
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    int64_t before = 0;
    for (int s = 0; s < me; ++s) before += C[s * E + g];
    const EpSlotRange r =
        ep_slot_range_at(routed[g], prefix[g], before, C[me * E + g], capacity, align);
    first_row[g] = r.first_row;
    fit[g] = r.fit;
    if (g / L == me) {  // this rank's receive plan
      const int e = g % L;
      const ExpertLayout l = layout_expert(routed[g], prefix[g], capacity, align);
      kept[e] = l.kept;
      padded[e] = l.padded;
      offsets[e] = l.offset;
      if (e == L - 1) offsets[L] = l.offset + l.padded;
      atomicAdd(reinterpret_cast<unsigned long long*>(&dropped),
                static_cast<unsigned long long>(routed[g] - l.kept));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (L == 0) offsets[0] = 0;
    *total_rows = offsets[L];
    *overflow = static_cast<int32_t>(dropped);
  }
}

// Pad rows of this rank's layout: rows zeroed; probs 0 and row_src -1 when
// given. A block per expert.
__global__ void pads_kernel(const PadsParams params) {
  uint8_t* rows = params.rows;
  const int64_t stride_bytes = params.stride_bytes, row_bytes = params.row_bytes,
                scale_bytes = params.scale_bytes;
  float* recv_probs = params.recv_probs;
  int32_t* row_src = params.row_src;
  const Pads& pads = params.pads;
  uint8_t* scales = params.scales;
  const int e = blockIdx.x;
  if (e >= pads.L) return;
  for (int64_t r = pads.offsets[e] + pads.kept[e]; r < pads.offsets[e] + pads.padded[e]; ++r) {
    uint4* dst = reinterpret_cast<uint4*>(rows + r * stride_bytes);
    for (int64_t v = threadIdx.x; v < row_bytes / 16; v += blockDim.x)
      dst[v] = make_uint4(0, 0, 0, 0);
    if (scales)
      for (int64_t b = threadIdx.x; b < scale_bytes; b += blockDim.x)
        scales[r * scale_bytes + b] = 0;
    if (threadIdx.x == 0 && recv_probs) {
      recv_probs[r] = 0.0f;
      row_src[r] = -1;
    }
  }
}

// The dispatch after the count exchange (one kernel, two roles). Home
// (place_token): x[t] read once and stored into each own kept slot's row and
// once into every peer holding a kept slot of t (its row, or its stage); every
// rank learns (inv) where t's slots are on it, the holders get the slots'
// probs / row_src / row_k; then t is announced to every peer. Holder: once
// (s, t) is announced, a staged row is copied into the rows of t's slots here
// (tokens with one slot here: nothing to do; the flag still orders them
// before the kernel's end).
// Quant (QuantizeRows): x holds 16-bit tokens, each quantized once into the
// codes its rows get, and its scales computed on the way.
template <class Mover, int NW, class Quant = NoQuantize>
__global__ void __launch_bounds__(NW * 32) dispatch_kernel(const DispatchParams params) {
  const Window& win = params.win;
  const Offsets& o = params.o;
  const HomeArgs& a = params.a;
  const int P = params.P, batch = params.batch;
  const uint8_t* x = params.x;
  const int64_t x_stride_bytes = params.x_stride_bytes, T = params.T;
  extern __shared__ __align__(128) uint8_t dyn_smem[];
  __shared__ uint8_t* dests[NW][kMaxDest];
  __shared__ float qscales[NW][Quant::kScaleCols];  // Quant: the token's 1x128 scales
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  uint8_t** my = dests[wib];
  Mover mover;
  mover.init(dyn_smem, wib, lane);
  const Roles<NW> ro(P);
  const int K = a.K, W = a.W, me = a.me;
  const int64_t tmax = a.tmax, row_bytes = a.row_bytes;
  const int32_t epoch = *reinterpret_cast<const int32_t*>(win.local + o.epoch);
  // Where each rank receives this dispatch's rows (its region of x).
  __shared__ size_t x_at[kMaxRanks];
  if (threadIdx.x < W)
    x_at[threadIdx.x] =
        o.x + size_t(reinterpret_cast<const int32_t*>(win.local + o.xregion)[threadIdx.x]) *
                  o.x_region;
  __syncthreads();
  if (ro.home) {
    Pending pend;
    const unsigned peers = ((1u << W) - 1u) & ~(1u << me);
    for (int64_t t = ro.warp; t < T; t += ro.warps) {
      int q;
      int64_t row;
      const int nd = place_token(win, o, x_at, a, t, lane, my, q, row);
      __syncwarp();
      if constexpr (Quant::kOn) {
        float* sc = qscales[wib];
        Quant::row(reinterpret_cast<const typename Quant::Elem*>(x + t * x_stride_bytes), my, nd,
                   params.quant.hidden, params.quant.pow2, sc, lane);
        __syncwarp();
        place_scales(win, o, a, reinterpret_cast<const uint8_t*>(sc), q, row, lane);
      } else {
        mover.template copy<false>(x + t * x_stride_bytes, my, nd, row_bytes, lane);
      }
      __syncwarp();  // the list is rewritten for the next token
      pend.add(size_t(me) * tmax + t, peers, lane);
      if (pend.n == batch) {
        mover.drain(lane);
        pend.flush(win, o.flag, epoch, lane);
      }
    }
    mover.drain(lane);
    pend.flush(win, o.flag, epoch, lane);
    return;
  }
  const int32_t* ntok = reinterpret_cast<const int32_t*>(win.local + o.ntok);
  const int32_t* inv = reinterpret_cast<const int32_t*>(win.local + o.inv);
  const int32_t* flag = reinterpret_cast<const int32_t*>(win.local + o.flag);
  const uint8_t* stage = win.local + o.stage;
  for_tokens(ro, ntok, W, me, false, [&](int s, int64_t t) {
    const size_t st = size_t(s) * tmax + t;
    warp_wait_flag(win, flag + st, epoch, s, lane);
    const int64_t row = lane < K ? __ldcg(inv + st * K + lane) : -1;
    const int n = list_rows(my, row, win.local + x_at[me], row_bytes, lane);
    if (n <= 1) return;  // an only slot here was stored by the home rank
    mover.template copy<true>(stage + st * row_bytes, my, n, row_bytes, lane);
    __syncwarp();
  });
  mover.drain(lane);
}

// The combine (one kernel, two roles). Holder: for each peer token with kept
// slots here, the float32 sum of its slots (k ascending, weighted by the
// received probs when `weighted`) stored into the home rank's partial[me][t]
// (rounded to bfloat16 with `wire_bf16`; a token with one slot here: that
// slot's row of y as is), then announced. Home: for each own
// token, ranks ascending: the own slots summed here (k ascending), the peers' partials once
// announced: the reference's order. Rows are prefetched into L2 kAhead steps ahead.
template <typename T, typename TOut, int N>
__global__ void __launch_bounds__(kSumWarps * 32) combine_kernel(const CombineParams params) {
  const FusedArgs& f = params.f;
  const Window& win = f.win;
  const Offsets& o = f.o;
  const int P = f.P, batch = f.batch, K = f.K, W = f.W, me = f.me;
  const int64_t H = f.H, Tn = f.Tn, tmax = f.tmax;
  const int32_t* dest_rank = f.dest_rank;
  const int64_t* dest_row = f.dest_row;
  const float* weights = f.weights;
  const T* y = static_cast<const T*>(params.y);
  TOut* out = static_cast<TOut*>(params.out);
  const int64_t y_stride = params.y_stride, out_stride = params.out_stride;
  const bool weighted = params.weighted, wire16 = params.wire_bf16;
  constexpr int U = sum_u<N>();
  using PO = cuda::Pack<TOut, N>;
  using PY = cuda::Pack<T, N>;
  using PB = cuda::Pack<__nv_bfloat16, N>;
  __shared__ SlotList lists[kSumWarps];
  const int lane = threadIdx.x % 32;
  SlotList& l = lists[threadIdx.x / 32];
  const int64_t packs = H / N;
  const Roles<kSumWarps> ro(P);
  const int32_t epoch = *reinterpret_cast<const int32_t*>(win.local + o.epoch);
  const int32_t* flag = reinterpret_cast<const int32_t*>(win.local + o.flag);
  if (ro.home) {
    const float* partial = reinterpret_cast<const float*>(win.local + o.partial);
    for (int64_t t = ro.warp; t < Tn; t += ro.warps) {
      int q = -1;
      int64_t row = -1;
      float w = 0.0f;
      if (lane < K) {
        q = dest_rank[t * K + lane];
        row = dest_row[t * K + lane];
        w = weights ? weights[t * K + lane] : 1.0f;
      }
      const unsigned ranks = __reduce_or_sync(kFull, q >= 0 ? 1u << q : 0u);
      // A peer holding one kept slot of t sent that slot's row as is (single
      // bit); its weight (lane r: rank r's) is applied here as the holder's
      // sum would: fmaf(w, y, 0).
      unsigned single = 0;
      float wsingle = 0.0f;
      for (int r = 0; r < W; ++r) {
        const unsigned m = __ballot_sync(kFull, q == r);
        if (r == me || __popc(m) != 1) continue;
        single |= 1u << r;
        const float wr = __shfl_sync(kFull, w, __ffs(m) - 1);
        if (lane == r) wsingle = wr;
      }
      const int n = collect_slots(l, __ballot_sync(kFull, q >= 0 && q == me), row, w, lane);
      for (int st = 0; st < kAhead; ++st)
        prefetch_slots<T, N>(y, y_stride, l, n, st, 32 * U, packs, lane);
      // lane p < W: the bytes per element of rank p's partial
      const int64_t eb = ((single >> lane) & 1u) ? int64_t{sizeof(T)} : wire16 ? 2 : 4;
      if (lane < W && lane != me && ((ranks >> lane) & 1u)) {  // lane p waits for rank p
        win.wait_flag(flag + size_t(lane) * tmax + t, epoch, lane);
        prefetch_span(partial + (size_t(lane) * tmax + t) * H, 0, kAhead * 32 * U * N * eb, H * eb);
      }
      __syncwarp();
      for (int64_t p0 = 0, st = 0; p0 < packs; p0 += 32 * U, ++st) {
        prefetch_slots<T, N>(y, y_stride, l, n, st + kAhead, 32 * U, packs, lane);
        if (lane < W && lane != me && ((ranks >> lane) & 1u))
          prefetch_span(partial + (size_t(lane) * tmax + t) * H, (st + kAhead) * 32 * U * N * eb,
                        (st + kAhead + 1) * 32 * U * N * eb, H * eb);
        float acc[U][N];
        bool first = true;
        for (int r = 0; r < W; ++r) {
          if (!((ranks >> r) & 1u)) continue;
          float part[U][N];
          if (r == me) {
            slot_sum<T, N, U>(y, y_stride, l, n, p0, packs, lane, part);
          } else if ((single >> r) & 1u) {
            const float ws = __shfl_sync(kFull, wsingle, r);
            const PY* prow = reinterpret_cast<const PY*>(partial + (size_t(r) * tmax + t) * H);
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int64_t p = p0 + u * 32 + lane;
              if (p >= packs) continue;
              const PY v = load_pack_cg<T, N>(prow + p);
#pragma unroll
              for (int j = 0; j < N; ++j) part[u][j] = fmaf(ws, cuda::to_float(v.v[j]), 0.0f);
            }
          } else if (wire16) {  // the peer's sum, rounded to bfloat16
            const PB* prow = reinterpret_cast<const PB*>(partial + (size_t(r) * tmax + t) * H);
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int64_t p = p0 + u * 32 + lane;
              if (p >= packs) continue;
              const PB v = load_pack_cg<__nv_bfloat16, N>(prow + p);
#pragma unroll
              for (int j = 0; j < N; ++j) part[u][j] = __bfloat162float(v.v[j]);
            }
          } else {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int64_t p = p0 + u * 32 + lane;
              if (p < packs)
                load_floats_cg<N>(partial + (size_t(r) * tmax + t) * H + p * N, part[u]);
            }
          }
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < N; ++j) acc[u][j] = first ? part[u][j] : acc[u][j] + part[u][j];
          first = false;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t p = p0 + u * 32 + lane;
          if (p >= packs) continue;
          PO v;
#pragma unroll
          for (int j = 0; j < N; ++j) v.v[j] = cuda::from_float<TOut>(first ? 0.0f : acc[u][j]);
          *reinterpret_cast<PO*>(out + t * out_stride + p * N) = v;
        }
      }
      __syncwarp();  // the list is rewritten for the next token
    }
    return;
  }
  const int32_t* ntok = f.ntok;  // (the dispatch's, from its handle)
  const int32_t* inv = f.inv;
  const float* rprobs = f.rprobs;
  Pending pend;
  for_tokens(ro, ntok, W, me, false, [&](int s, int64_t t) {
    const size_t st = size_t(s) * tmax + t;
    int64_t row = -1;
    float w = 0.0f;
    if (lane < K) {
      row = inv[st * K + lane];
      if (row >= 0) w = weighted ? rprobs[row] : 1.0f;
    }
    const int n = collect_slots(l, __ballot_sync(kFull, row >= 0), row, w, lane);
    if (n == 0) return;
    constexpr int UH = hold_u<N>();
    for (int k = 0; k < kAhead; ++k)
      prefetch_slots<T, N>(y, y_stride, l, n, k, 32 * UH, packs, lane);
    float* dst = static_cast<float*>(win.at(o.partial + (size_t(me) * tmax + t) * H * 4, s));
    for (int64_t p0 = 0, k = 0; p0 < packs; p0 += 32 * UH, ++k) {
      prefetch_slots<T, N>(y, y_stride, l, n, k + kAhead, 32 * UH, packs, lane);
      if (n == 1) {  // one slot here: its row goes home as is, the home weights it
        const PY* src = reinterpret_cast<const PY*>(y + l.row[0] * y_stride);
        PY v[UH];
#pragma unroll
        for (int u = 0; u < UH; ++u) {
          const int64_t p = p0 + u * 32 + lane;
          if (p < packs) v[u] = src[p];
        }
#pragma unroll
        for (int u = 0; u < UH; ++u) {
          const int64_t p = p0 + u * 32 + lane;
          if (p < packs) reinterpret_cast<PY*>(dst)[p] = v[u];
        }
        continue;
      }
      float part[UH][N];
      slot_sum<T, N, UH>(y, y_stride, l, n, p0, packs, lane, part);
      if (wire16) {  // EpOptions::combine_wire_dtype bfloat16: half the bytes
#pragma unroll
        for (int u = 0; u < UH; ++u) {
          const int64_t p = p0 + u * 32 + lane;
          if (p >= packs) continue;
          PB v;
#pragma unroll
          for (int j = 0; j < N; ++j) v.v[j] = __float2bfloat16_rn(part[u][j]);
          reinterpret_cast<PB*>(dst)[p] = v;
        }
        continue;
      }
#pragma unroll
      for (int u = 0; u < UH; ++u) {
        const int64_t p = p0 + u * 32 + lane;
        if (p < packs) store_floats<N>(dst + p * N, part[u]);
      }
    }
    __syncwarp();  // the list is rewritten for the next token
    pend.add(size_t(me) * tmax + t, 1u << s, lane);
    if (pend.n == batch) pend.flush(win, o.flag, epoch, lane);
  });
  pend.flush(win, o.flag, epoch, lane);
}

// The combine backward (one kernel, two roles). Home: dout[t] stored once into
// the stage of every peer holding a kept slot of t and announced; the own
// slots' grad_y rows and dot products done here. Holder: once (s, t) is
// announced, grad_y of each of t's rows here from the staged dout, and the dot
// products stored into the home rank's dp[t, k]. Pad rows: pads_kernel.
template <typename T>
__global__ void __launch_bounds__(kBwdWarps * 32)
    combine_bwd_kernel(const CombineBwdParams params) {
  const FusedArgs& f = params.f;
  const Window& win = f.win;
  const Offsets& o = f.o;
  const int P = f.P, batch = f.batch, K = f.K, W = f.W, me = f.me;
  const int64_t H = f.H, Tn = f.Tn, tmax = f.tmax;
  const int32_t* dest_rank = f.dest_rank;
  const int64_t* dest_row = f.dest_row;
  const float* weights = f.weights;
  const T* dout = static_cast<const T*>(params.dout);
  const T* y = static_cast<const T*>(params.y);
  T* grad_y = static_cast<T*>(params.grad_y);
  const int64_t dout_stride = params.dout_stride, y_stride = params.y_stride,
                g_stride = params.g_stride;
  __shared__ uint8_t* dests[kBwdWarps][kMaxDest];
  __shared__ SlotList lists[kBwdWarps];
  const int lane = threadIdx.x % 32;
  uint8_t** my = dests[threadIdx.x / 32];
  SlotList& l = lists[threadIdx.x / 32];
  const Roles<kBwdWarps> ro(P);
  const int32_t epoch = *reinterpret_cast<const int32_t*>(win.local + o.epoch);
  const int64_t row_bytes = H * int64_t(sizeof(T));
  float* dp_local = reinterpret_cast<float*>(win.local + o.dp);
  if (ro.home) {
    Pending pend;
    for (int64_t t = ro.warp; t < Tn; t += ro.warps) {
      const int q = lane < K ? dest_rank[t * K + lane] : -1;
      const int64_t row = lane < K ? dest_row[t * K + lane] : -1;
      const float w = lane < K && weights ? weights[t * K + lane] : 1.0f;
      int nd = 0;
      unsigned peers = 0;
      for (int p = 0; p < W; ++p) {
        if (p == me || !__ballot_sync(kFull, q == p)) continue;
        if (lane == 0)
          my[nd] = static_cast<uint8_t*>(win.at(o.stage + (size_t(me) * tmax + t) * row_bytes, p));
        ++nd;
        peers |= 1u << p;
      }
      const T* d = dout + t * dout_stride;
      if (nd) {
        __syncwarp();
        warp_copy_row<false>(reinterpret_cast<const uint4*>(d), my, nd, row_bytes / 16, lane);
        __syncwarp();
        pend.add(size_t(me) * tmax + t, peers, lane);
        if (pend.n == batch) pend.flush(win, o.flag, epoch, lane);
      }
      const int n = collect_slots(l, __ballot_sync(kFull, q >= 0 && q == me), row, w, lane);
      for (int i = 0; i < n; ++i) {
        const int64_t r = l.row[i];
        const float dot =
            grad_row<T, false>(d, y + r * y_stride, grad_y + r * g_stride, l.w[i], H, lane);
        if (lane == 0) dp_local[t * K + l.k[i]] = dot;
      }
      __syncwarp();
    }
    pend.flush(win, o.flag, epoch, lane);
    return;
  }
  const int32_t* ntok = f.ntok;  // (the dispatch's, from its handle)
  const int32_t* inv = f.inv;
  const int32_t* flag = reinterpret_cast<const int32_t*>(win.local + o.flag);
  const float* rprobs = f.rprobs;
  const T* stage = reinterpret_cast<const T*>(win.local + o.stage);
  for_tokens(ro, ntok, W, me, false, [&](int s, int64_t t) {
    const size_t st = size_t(s) * tmax + t;
    const int64_t row = lane < K ? inv[st * K + lane] : -1;
    const float w = row >= 0 && weights ? rprobs[row] : 1.0f;
    const int n = collect_slots(l, __ballot_sync(kFull, row >= 0), row, w, lane);
    if (n == 0) return;
    warp_wait_flag(win, flag + st, epoch, s, lane);
    for (int i = 0; i < n; ++i) {
      const int64_t r = l.row[i];
      const float dot = grad_row<T, true>(stage + st * H, y + r * y_stride, grad_y + r * g_stride,
                                          l.w[i], H, lane);
      if (lane == 0) *static_cast<float*>(win.at(o.dp + (size_t(t) * K + l.k[i]) * 4, s)) = dot;
    }
    __syncwarp();
  });
}

// dprobs[t,k] = dp[t,k] for kept slots, 0 for unrouted or dropped ones.
__global__ void dprobs_kernel(const float* dp, const int32_t* dest_rank, int64_t n, float* dprobs) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) dprobs[i] = dest_rank[i] >= 0 ? dp[i] : 0.0f;
}

// The start of a combine or combine backward: an LSA barrier (the peers are
// done reading what this operation overwrites in their windows), then the
// operation's number, which its flags carry.
__global__ void op_start_kernel(Window w, int32_t* epoch) {
  w.barrier();
  if (threadIdx.x == 0) ++*epoch;
}

}  // namespace

// --- Launchers ----------------------------------------------------------------

void launch_barrier(const Window& win, cudaStream_t stream) {
  barrier_kernel<<<1, 128, 0, stream>>>(win);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_op_start(const Window& win, int32_t* epoch, cudaStream_t stream) {
  op_start_kernel<<<1, 128, 0, stream>>>(win, epoch);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

// Rows [0, *total_rows) from src to dst, 16-byte words when rows allow.
template <class Word>
__global__ void copy_rows_kernel(const Word* __restrict__ src, Word* __restrict__ dst,
                                 int64_t row_words, const int64_t* total_rows, int64_t max_rows) {
  const int64_t n = min(*total_rows, max_rows) * row_words;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

void launch_copy_rows(const uint8_t* src, uint8_t* dst, int64_t row_bytes,
                      const int64_t* total_rows, int64_t max_rows, cudaStream_t stream) {
  if (row_bytes <= 0 || max_rows <= 0) return;
  int dev = 0, sms = 0;
  MOEFLOW_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFLOW_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const unsigned grid = static_cast<unsigned>(4 * sms);
  if (wide)
    copy_rows_kernel<uint4><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint4*>(src),
                                                      reinterpret_cast<uint4*>(dst),
                                                      row_bytes / 16, total_rows, max_rows);
  else
    copy_rows_kernel<uint8_t><<<grid, 256, 0, stream>>>(src, dst, row_bytes, total_rows, max_rows);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_copy_ids(const int64_t* ids, int64_t T, int K, int64_t tmax, int32_t* out,
                     cudaStream_t stream) {
  const int64_t n = T * K;
  copy_ids_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(ids, T, K, tmax, out);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_counts(const CountsParams& p, cudaStream_t stream) {
  counts_kernel<<<1, 256, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_pads(const PadsParams& p, cudaStream_t stream) {
  pads_kernel<<<static_cast<unsigned>(std::max(p.pads.L, 1)), 256, 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void prepare_dispatch_kernel() {
  MOEFLOW_CUDA_CHECK(cudaFuncSetAttribute(dispatch_kernel<TmaMover, kTmaWarps>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kTmaSmem)));
}

void launch_dispatch(const DispatchParams& p, bool bulk, unsigned grid, cudaStream_t stream) {
  if (p.quant.on) {  // 16-bit tokens quantized by the home role (16-byte stores)
    auto launch = [&](auto tag, auto e4m3) {
      using T = decltype(tag);
      dispatch_kernel<LsuMover, kWarps, QuantizeRows<T, decltype(e4m3)::value>>
          <<<grid, kWarps * 32, 0, stream>>>(p);
    };
    const bool half = p.quant.in == DType::kFloat16;
    if (p.quant.e4m3)
      half ? launch(__half{}, std::true_type{}) : launch(__nv_bfloat16{}, std::true_type{});
    else
      half ? launch(__half{}, std::false_type{}) : launch(__nv_bfloat16{}, std::false_type{});
    MOEFLOW_CUDA_LAUNCH_CHECK();
    return;
  }
  // the same roles with bulk copies (MOEFLOW_NVL_TMA) or with 16-byte stores
  auto* kernel = bulk ? dispatch_kernel<TmaMover, kTmaWarps> : dispatch_kernel<LsuMover, kWarps>;
  kernel<<<grid, (bulk ? kTmaWarps : kWarps) * 32, bulk ? kTmaSmem : 0, stream>>>(p);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

namespace {
// fn(T{}) with T the element type of a float dtype (bfloat16 for any other).
template <typename Fn>
void with_type(DType dtype, Fn fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(float{});
    case DType::kFloat16:
      return fn(__half{});
    default:
      return fn(__nv_bfloat16{});
  }
}
}  // namespace

void launch_combine(const CombineParams& p, DType y_dtype, DType out_dtype, unsigned grid,
                    cudaStream_t stream) {
  auto addr = [](const void* q) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(q)); };
  with_type(y_dtype, [&](auto ty) {
    with_type(out_dtype, [&](auto to) {
      using TY = decltype(ty);
      using TO = decltype(to);
      constexpr int N = 16 / sizeof(TY);
      // 16-byte accesses of y's rows, N-element ones of out's
      const int64_t ys = p.y_stride, os = p.out_stride;
      const bool vec =
          p.f.H % N == 0 && addr(p.y) % 16 == 0 && (ys * int64_t(sizeof(TY))) % 16 == 0 &&
          addr(p.out) % (N * sizeof(TO)) == 0 && (os * sizeof(TO)) % (N * sizeof(TO)) == 0;
      if (vec)
        combine_kernel<TY, TO, N><<<grid, kSumWarps * 32, 0, stream>>>(p);
      else
        combine_kernel<TY, TO, 1><<<grid, kSumWarps * 32, 0, stream>>>(p);
      MOEFLOW_CUDA_LAUNCH_CHECK();
    });
  });
}

void launch_combine_bwd(const CombineBwdParams& p, DType dtype, unsigned grid,
                        cudaStream_t stream) {
  with_type(dtype, [&](auto tv) {
    using T = decltype(tv);
    combine_bwd_kernel<T><<<grid, kBwdWarps * 32, 0, stream>>>(p);
  });
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

void launch_dprobs(const float* dp, const int32_t* dest_rank, int64_t n, float* dprobs,
                   cudaStream_t stream) {
  dprobs_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(dp, dest_rank, n,
                                                                            dprobs);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace nvl
}  // namespace moeflow
