// CUDA sequence aux loss (seq_aux_loss) of the router forward: per-sequence
// column sums of the aux-loss scores and per-sequence expert counts, then
// each sequence's loss term.
//
// Sequences are contiguous token ranges of any length, so the tokens are cut
// into fixed chunks of kChunk tokens and each chunk writes one partial per
// sequence it touches ("segment"). Token t is in sequence
// seq(t) = #{i in [1,S): clamp(cu[i], 0, T) <= t}, non-decreasing in t for
// any cu_seqlens; the segment of chunk b and sequence s lives in slot b + s,
// which is unique (a chunk covers sequences first(b)..last(b) and
// first(b+1) >= last(b)), so there are at most chunks + S slots. Then one
// block per sequence sums its segments in chunk order. Fixed-order float32
// sums, integer atomics only (counts): bitwise run to run deterministic.
// The scores are computed as route_kernel computes them (same exact exp, same
// warp sum order), from a second read of the logits.
#include "core/router_math.h"
#include "cuda/router_common.cuh"

namespace moeflow::cuda::router_detail {
namespace {

namespace rm = router_math;

constexpr int kChunk = 64;     // tokens per chunk
constexpr int kThreads = 256;  // threads of both kernels
constexpr int kWarps = kThreads / kWarpSize;
constexpr size_t kAlign = 256;

size_t align_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

__host__ __device__ inline int64_t num_chunks(int64_t T) {
  return (T + kChunk - 1) / kChunk;
}

struct SeqWorkspace {
  float* seg_colsum;     // [chunks + S, E]
  int32_t* seg_count;    // [chunks + S, E]
  int32_t* seg_real;     // [chunks + S]: real tokens of the segment
  int32_t* chunk_first;  // [chunks]: first and last sequence of each chunk
  int32_t* chunk_last;   // [chunks]
  size_t bytes;
};

SeqWorkspace carve(void* base, int64_t T, int E, int64_t S) {
  auto* p = static_cast<uint8_t*>(base);
  const int64_t chunks = num_chunks(T), slots = chunks + S;
  SeqWorkspace w{};
  size_t off = 0;
  w.seg_colsum = reinterpret_cast<float*>(p + off);
  off = align_up(off + sizeof(float) * slots * E);
  w.seg_count = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * slots * E);
  w.seg_real = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * slots);
  w.chunk_first = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * chunks);
  w.chunk_last = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * chunks);
  w.bytes = off;
  return w;
}

struct ChunkParams {
  SeqAuxParams p;
  SeqWorkspace w;
};

// One block per chunk of kChunk tokens. Dynamic shared memory: int32 [E].
__global__ void __launch_bounds__(kThreads) chunk_kernel(ChunkParams cp) {
  const SeqAuxParams& p = cp.p;
  const SeqWorkspace& w = cp.w;
  extern __shared__ int32_t cnt[];
  __shared__ int32_t hist[kChunk];
  __shared__ int32_t seq_of[kChunk];
  __shared__ float row_max[kChunk];
  __shared__ float row_den[kChunk];
  __shared__ uint8_t real[kChunk];
  __shared__ int32_t base;
  const int E = p.num_experts, K = p.topk;
  const int64_t T = p.num_tokens, S = p.num_sequences;
  const int64_t b = blockIdx.x;
  const int64_t start = b * kChunk;
  const int n = static_cast<int>(T - start < kChunk ? T - start : kChunk);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

  // Step 1: the sequence of each token of the chunk (boundaries at or before
  // `start` count for every token; those inside count from their position).
  for (int j = threadIdx.x; j < kChunk; j += kThreads) hist[j] = 0;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int64_t i = 1 + threadIdx.x; i < S; i += kThreads) {
    const int64_t v = clamped_bound(p.cu, i, T);
    if (v <= start)
      atomicAdd(&base, 1);
    else if (v < start + n)
      atomicAdd(&hist[v - start], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = base;
    for (int j = 0; j < n; ++j) {
      if (j > 0) run += hist[j];
      seq_of[j] = run;
    }
    w.chunk_first[b] = seq_of[0];
    w.chunk_last[b] = seq_of[n - 1];
  }

  // Step 2: each real token's row max and score denominator, as route_kernel.
  for (int j = warp; j < n; j += kWarps) {
    const int64_t t = start + j;
    const bool is_real = !(p.mask && p.mask[t]);
    if (lane == 0) real[j] = is_real;
    if (!is_real) continue;
    const float* row = p.logits + t * E;
    float m = -INFINITY;
    for (int e = lane; e < E; e += kWarpSize) m = fmaxf(m, rm::sanitize(row[e]));
    m = warp_max(m);
    float part = 0.0f;
    for (int e = lane; e < E; e += kWarpSize) {
      const float x = rm::sanitize(row[e]);
      part = part + (p.softmax ? rm::exp_exact(x - m) : rm::sigmoid_exact(x));
    }
    const float s = warp_sum(part);
    if (lane == 0) {
      row_max[j] = m;
      row_den[j] = p.softmax ? s : s + rm::kRenormEps;
    }
  }
  __syncthreads();

  // Step 3: one segment per sequence first..last (empty ones included).
  const int32_t s_first = seq_of[0], s_last = seq_of[n - 1];
  int j0 = 0;
  for (int32_t s = s_first; s <= s_last; ++s) {
    int j1 = j0;
    while (j1 < n && seq_of[j1] == s) ++j1;
    const int64_t slot = b + s;
    for (int e = threadIdx.x; e < E; e += kThreads) {
      float acc = 0.0f;
      for (int j = j0; j < j1; ++j) {
        if (!real[j]) continue;
        const float x = rm::sanitize(p.logits[(start + j) * E + e]);
        const float v = p.softmax ? rm::exp_exact(x - row_max[j]) : rm::sigmoid_exact(x);
        acc += v / row_den[j];
      }
      w.seg_colsum[slot * E + e] = acc;
      cnt[e] = 0;
    }
    __syncthreads();
    for (int q = threadIdx.x; q < (j1 - j0) * K; q += kThreads) {
      const int j = j0 + q / K;
      if (!real[j]) continue;
      const int32_t id = p.ids[(start + j) * K + q % K];
      if (id >= 0 && id < E) atomicAdd(&cnt[id], 1);  // integer: order does not matter
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += kThreads) w.seg_count[slot * E + e] = cnt[e];
    if (threadIdx.x == 0) {
      int32_t r = 0;
      for (int j = j0; j < j1; ++j) r += real[j];
      w.seg_real[slot] = r;
    }
    __syncthreads();  // cnt is reset for the next segment
    j0 = j1;
  }
}

// One block per sequence: sums its segments (chunks in order), writes its
// counts and its loss term.
__global__ void __launch_bounds__(kThreads) reduce_kernel(ChunkParams cp) {
  const SeqAuxParams& p = cp.p;
  const SeqWorkspace& w = cp.w;
  __shared__ float red[kThreads];
  __shared__ int64_t range[2];
  const int E = p.num_experts;
  const int64_t s = blockIdx.x;
  const int64_t chunks = num_chunks(p.num_tokens);
  if (threadIdx.x == 0) {
    // Chunks b with chunk_first[b] <= s <= chunk_last[b]: [lo, hi) (both
    // arrays are non-decreasing in b).
    int64_t lo = 0, hi = chunks;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (w.chunk_last[mid] < s)
        lo = mid + 1;
      else
        hi = mid;
    }
    int64_t lo2 = lo;
    hi = chunks;
    while (lo2 < hi) {
      const int64_t mid = lo2 + (hi - lo2) / 2;
      if (w.chunk_first[mid] <= s)
        lo2 = mid + 1;
      else
        hi = mid;
    }
    range[0] = lo;
    range[1] = lo2;
  }
  __syncthreads();
  const int64_t b0 = range[0], b1 = range[1];
  float dot = 0.0f;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    float c = 0.0f;
    int32_t n = 0;
    for (int64_t b = b0; b < b1; ++b) {
      c = c + w.seg_colsum[(b + s) * E + e];
      n += w.seg_count[(b + s) * E + e];
    }
    p.seq_counts[s * E + e] = n;
    dot = dot + c * static_cast<float>(n);
  }
  red[threadIdx.x] = dot;
  __syncthreads();
  for (int half = kThreads / 2; half >= 1; half /= 2) {
    if (threadIdx.x < half) red[threadIdx.x] = red[threadIdx.x] + red[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    int64_t L = 0;
    for (int64_t b = b0; b < b1; ++b) L += w.seg_real[b + s];
    float term = 0.0f;
    if (L > 0 && p.coeff != 0.0f) {
      const double Ld = static_cast<double>(L);
      term = red[0] * static_cast<float>(static_cast<double>(E) * p.coeff /
                                         (p.topk * static_cast<double>(p.num_sequences) * Ld * Ld));
    }
    p.seq_loss[s] = term;
  }
}

}  // namespace

size_t seq_aux_workspace_bytes(int64_t num_tokens, int num_experts, int64_t num_sequences) {
  return carve(nullptr, num_tokens, num_experts, num_sequences).bytes;
}

void seq_aux_forward(const SeqAuxParams& p, cudaStream_t stream) {
  const int64_t chunks = num_chunks(p.num_tokens);
  ChunkParams cp{p, carve(p.workspace, p.num_tokens, p.num_experts, p.num_sequences)};
  MOEFLOW_CHECK(chunks <= 0x7FFFFFFF && p.num_sequences <= 0x7FFFFFFF,
                "router: too many tokens or sequences for seq_aux_loss (T=", p.num_tokens,
                ", S=", p.num_sequences, ")");
  if (chunks > 0) {
    const size_t shared = sizeof(int32_t) * p.num_experts;
    chunk_kernel<<<static_cast<unsigned>(chunks), kThreads, shared, stream>>>(cp);
    MOEFLOW_CUDA_LAUNCH_CHECK();
  }
  reduce_kernel<<<static_cast<unsigned>(p.num_sequences), kThreads, 0, stream>>>(cp);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda::router_detail
