// CUDA expert capacity (router_apply_capacity): a stable radix sort of the
// slots by 64-bit key (expert << 32 | ~ordered prob bits), or by expert alone
// for the position policy, with the slot index as value; stability orders
// equal keys by slot index (token, then k). Then each expert's start in the
// sorted order (binary search), the dropped count, and a scatter: the
// sorted slot at position i of expert e is kept when i - start[e] < capacity.
// Integer work only, no atomics on values: deterministic. No host sync; the
// sizes come from shapes (CUB's sort launches kernels and memsets only).
#include <cub/device/device_radix_sort.cuh>

#include "core/backends.h"
#include "core/router_backend.h"
#include "core/router_math.h"
#include "cuda/common.cuh"

namespace moeflow::cuda {
namespace {

namespace rm = router_math;

constexpr int kThreads = 256;
constexpr size_t kAlign = 256;

size_t align_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

// Bits of the expert field (values 0..E, E = invalid).
int expert_bits(int E) {
  int b = 1;
  while ((int64_t{1} << b) <= E) ++b;
  return b;
}

struct CapWorkspace {
  uint64_t* keys[2];
  int32_t* vals[2];
  int32_t* starts;  // [E+1]
  void* temp;
  size_t temp_bytes;
  size_t bytes;
};

size_t sort_temp_bytes(int64_t n, int begin_bit, int end_bit) {
  size_t bytes = 0;
  cub::DoubleBuffer<uint64_t> k(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> v(nullptr, nullptr);
  MOEFLOW_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, k, v, static_cast<int>(n),
                                                     begin_bit, end_bit));
  return bytes;
}

// Bit ranges of the two policies' keys.
void key_bits(int E, DropPolicy policy, int* begin, int* end) {
  *begin = policy == DropPolicy::kProbs ? 0 : 32;
  *end = 32 + expert_bits(E);
}

CapWorkspace carve(void* base, int64_t n, int E) {
  auto* p = static_cast<uint8_t*>(base);
  CapWorkspace w{};
  size_t off = 0;
  for (int i = 0; i < 2; ++i) {
    w.keys[i] = reinterpret_cast<uint64_t*>(p + off);
    off = align_up(off + sizeof(uint64_t) * n);
  }
  for (int i = 0; i < 2; ++i) {
    w.vals[i] = reinterpret_cast<int32_t*>(p + off);
    off = align_up(off + sizeof(int32_t) * n);
  }
  w.starts = reinterpret_cast<int32_t*>(p + off);
  off = align_up(off + sizeof(int32_t) * (E + 1));
  w.temp = p + off;
  w.temp_bytes = 0;
  for (DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
    int b, e;
    key_bits(E, policy, &b, &e);
    const size_t t = n > 0 ? sort_temp_bytes(n, b, e) : 0;
    w.temp_bytes = t > w.temp_bytes ? t : w.temp_bytes;
  }
  off = align_up(off + w.temp_bytes);
  w.bytes = off;
  return w;
}

// Capacity >= T: every valid id is kept (Megatron's shortcut).
__global__ void keep_all_kernel(const int32_t* ids, int32_t* kept, int64_t n, int E,
                                int32_t* dropped) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t id = ids[i];
    kept[i] = id >= 0 && id < E ? id : -1;
  }
  if (dropped && blockIdx.x == 0 && threadIdx.x == 0) *dropped = 0;
}

// Sort keys: (expert << 32) | ~(prob rank bits) (kProbs) or expert << 32;
// invalid slots get expert E (sorted last) and kept -1.
__global__ void keys_kernel(const int32_t* ids, const float* probs, int64_t n, int E,
                            uint64_t* keys, int32_t* vals, int32_t* kept) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t id = ids[i];
    const bool valid = id >= 0 && id < E;
    uint32_t lo = 0;
    if (probs) lo = ~static_cast<uint32_t>(rm::rank_key(probs[i], 0) >> 32);
    keys[i] = valid ? (static_cast<uint64_t>(id) << 32) | lo : static_cast<uint64_t>(E) << 32;
    vals[i] = static_cast<int32_t>(i);
    if (!valid) kept[i] = -1;  // after the read: kept may alias ids
  }
}

// One block: start[e] = first sorted position of expert e (e in [0, E]),
// then dropped = sum_e max(0, count_e - capacity).
__global__ void __launch_bounds__(kThreads)
    starts_kernel(const uint64_t* keys, int64_t n, int E, int64_t capacity, int32_t* starts,
                  int32_t* dropped) {
  __shared__ long long red[kThreads];
  for (int e = threadIdx.x; e <= E; e += kThreads) {
    const uint64_t want = static_cast<uint64_t>(e) << 32;
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (keys[mid] < want)
        lo = mid + 1;
      else
        hi = mid;
    }
    starts[e] = static_cast<int32_t>(lo);
  }
  __syncthreads();
  long long d = 0;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    const int64_t over = int64_t{starts[e + 1]} - starts[e] - capacity;
    d += over > 0 ? over : 0;
  }
  red[threadIdx.x] = d;
  __syncthreads();
  for (int half = kThreads / 2; half >= 1; half /= 2) {
    if (threadIdx.x < half) red[threadIdx.x] += red[threadIdx.x + half];
    __syncthreads();
  }
  if (dropped && threadIdx.x == 0) *dropped = static_cast<int32_t>(red[0]);
}

__global__ void scatter_kernel(const uint64_t* keys, const int32_t* vals, const int32_t* starts,
                               int64_t n, int E, int64_t capacity, int32_t* kept) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = static_cast<int64_t>(keys[i] >> 32);
    if (e >= E) continue;  // invalid slots are sorted last
    kept[vals[i]] = i - starts[e] < capacity ? static_cast<int32_t>(e) : -1;
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = ceil_div(n, kThreads);
  const int64_t cap = int64_t{sm_count()} * 8;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

}  // namespace

size_t router_capacity_workspace_bytes(int64_t num_tokens, int topk, int num_experts) {
  return carve(nullptr, num_tokens * topk, num_experts).bytes;
}

void router_apply_capacity(const RouterCapacityArgs& a, cudaStream_t stream) {
  const int64_t T = a.topk_ids.shape[0];
  const int64_t n = T * a.topk_ids.shape[1];
  const int E = a.config.num_experts;
  const int32_t* ids = a.topk_ids.data_ptr<int32_t>();
  int32_t* kept = a.kept_ids.data_ptr<int32_t>();
  int32_t* dropped = a.dropped.defined() ? a.dropped.data_ptr<int32_t>() : nullptr;
  if (a.capacity >= T) {
    if (n == 0 && !dropped) return;
    keep_all_kernel<<<grid_for(n), kThreads, 0, stream>>>(ids, kept, n, E, dropped);
    MOEFLOW_CUDA_LAUNCH_CHECK();
    return;
  }
  // capacity < T, so n >= T > 0.
  const CapWorkspace w = carve(a.workspace.data, n, E);
  const float* probs =
      a.config.drop_policy == DropPolicy::kProbs ? a.probs.data_ptr<float>() : nullptr;
  keys_kernel<<<grid_for(n), kThreads, 0, stream>>>(ids, probs, n, E, w.keys[0], w.vals[0], kept);
  MOEFLOW_CUDA_LAUNCH_CHECK();
  int begin_bit, end_bit;
  key_bits(E, a.config.drop_policy, &begin_bit, &end_bit);
  cub::DoubleBuffer<uint64_t> keys(w.keys[0], w.keys[1]);
  cub::DoubleBuffer<int32_t> vals(w.vals[0], w.vals[1]);
  size_t temp_bytes = w.temp_bytes;
  MOEFLOW_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      w.temp, temp_bytes, keys, vals, static_cast<int>(n), begin_bit, end_bit, stream));
  starts_kernel<<<1, kThreads, 0, stream>>>(keys.Current(), n, E, a.capacity, w.starts, dropped);
  MOEFLOW_CUDA_LAUNCH_CHECK();
  scatter_kernel<<<grid_for(n), kThreads, 0, stream>>>(keys.Current(), vals.Current(), w.starts, n,
                                                       E, a.capacity, kept);
  MOEFLOW_CUDA_LAUNCH_CHECK();
}

}  // namespace moeflow::cuda
