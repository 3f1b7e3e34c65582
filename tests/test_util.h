// Test helpers: random routings, tensor fill and comparison, and a naive plan
// builder independent of src/cpu (stable sort of the slots by expert).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/internal.h"
#include "moeflow/moeflow.h"
#include "tolerance.h"

namespace moeflow::test {

// One permute test shape: T tokens, top-K of E experts, hidden H, align.
struct Case {
  int64_t T;
  int K;
  int E;
  int64_t H;
  int align;
};

inline std::string name_of(const Case& c) {
  return "T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) + " E=" + std::to_string(c.E) +
         " H=" + std::to_string(c.H) + " align=" + std::to_string(c.align);
}

inline Tensor make_tensor(const std::vector<int64_t>& shape, DType dtype) {
  return Tensor::empty(shape, dtype, Device::cpu());
}

// A tensor whose every byte is 0xFF (NaN for floats): an output a kernel
// must overwrite, or must leave alone where the check says so.
inline Tensor poisoned(const std::vector<int64_t>& shape, DType dtype,
                       Device device = Device::cpu()) {
  Tensor t = Tensor::empty(shape, dtype, device);
  fill_bytes(t, 0xFF);
  return t;
}

// FP8 blocks: how many 128-wide blocks cover n, and the scales' shape of a
// quantized [R,C] matrix (moeflow/quantize.h).
// A [1] int32 / int64 tensor on the host holding n (a device count's value).
inline Tensor count_tensor(int64_t n, DType dtype) {
  Tensor t = make_tensor({1}, dtype);
  if (dtype == DType::kInt64)
    *t.data_ptr<int64_t>() = n;
  else
    *t.data_ptr<int32_t>() = static_cast<int32_t>(n);
  return t;
}

inline int64_t blocks128(int64_t n) { return (n + 127) / 128; }

// Expert weights for FP8 tests, [G, M, ld]: magnitudes 2^-30 .. 2^12 by matrix and 64-row band, NaN
// / inf / -0 sprinkled, one all-zero block row, gap columns 30000 (never read).
inline Tensor fp8_weights(int64_t G, int64_t M, int64_t K, int64_t ld, DType dt, uint32_t seed) {
  Tensor x = make_tensor({G, M, ld}, dt);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < ld; ++k) {
        const int e = dt == DType::kFloat32 ? static_cast<int>((g * 7 + m / 64) % 43) - 30
                                            : static_cast<int>((g * 7 + m / 64) % 20) - 10;
        float v = std::ldexp(uni(rng), e);
        const uint32_t p = rng() % 2000;
        if (p == 0) v = NAN;
        if (p == 1) v = INFINITY;
        if (p == 2) v = -INFINITY;
        if (p == 3) v = -0.0f;
        if (m >= 128 && m < 256) v = 0.0f;
        if (k >= K) v = 30000.0f;
        detail::store_float(x.data(), dt, (g * M + m) * ld + k, v);
      }
  return x;
}
inline std::vector<int64_t> scales_shape(int64_t R, int64_t C, QuantScaling s) {
  if (s == QuantScaling::kTensorwise) return {1};
  if (s == QuantScaling::kBlock1x128) return {R, blocks128(C)};
  return {blocks128(R), blocks128(C)};
}

// Whether every byte of row `row` of the host tensor t is `byte`.
inline bool row_is(const Tensor& t, int64_t row, uint8_t byte) {
  const int64_t rb = t.numel() / std::max<int64_t>(t.size(0), 1) * dtype_size(t.dtype());
  const auto* p = static_cast<const uint8_t*>(t.data()) + row * rb;
  for (int64_t i = 0; i < rb; ++i)
    if (p[i] != byte) return false;
  return true;
}

// Top-k ids [T,K] with distinct experts per token; `skew` > 0 favours low ids
// (probability ~ 1/(e+1)^skew); `unrouted` is the chance of a -1 slot.
inline Tensor random_topk(int64_t T, int K, int E, uint32_t seed, double skew = 0.0,
                          double unrouted = 0.0, DType dtype = DType::kInt32) {
  std::mt19937 rng(seed);
  Tensor ids = make_tensor({T, K}, dtype);
  std::vector<double> weight(E);
  for (int e = 0; e < E; ++e) weight[e] = std::pow(1.0 / (e + 1), skew);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> w = weight;
    for (int k = 0; k < K; ++k) {
      int64_t e = -1;
      if (k < E && uni(rng) >= unrouted) {
        std::discrete_distribution<int> pick(w.begin(), w.end());
        e = pick(rng);
        w[e] = 0.0;  // distinct within the token
      }
      if (dtype == DType::kInt32)
        ids.data_ptr<int32_t>()[t * K + k] = static_cast<int32_t>(e);
      else
        ids.data_ptr<int64_t>()[t * K + k] = e;
    }
  }
  return ids;
}

inline int64_t id_at(const Tensor& ids, int64_t i) {
  return ids.dtype() == DType::kInt32 ? ids.data_ptr<int32_t>()[i] : ids.data_ptr<int64_t>()[i];
}

// Random mask [T,E] (uint8) with about `per_token` experts a token.
inline Tensor random_mask(int64_t T, int E, int per_token, uint32_t seed) {
  Tensor ids = random_topk(T, per_token, E, seed);
  Tensor mask = Tensor::zeros({T, E}, DType::kUInt8);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < per_token; ++k) {
      int64_t e = id_at(ids, t * per_token + k);
      if (e >= 0) mask.data_ptr<uint8_t>()[t * E + e] = 1;
    }
  return mask;
}

// Special rows for the quantization tests (x [T,H] host tensor, T >= 4 and
// H >= 3): row 0 zeros, row 1 a NaN and a -inf, row 2 large magnitudes, row
// 3 tiny ones.
inline void add_special_rows(Tensor& x) {
  const int64_t T = x.size(0), H = x.size(1);
  if (T < 4 || H < 3) return;
  for (int64_t h = 0; h < H; ++h) detail::store_float(x.data(), x.dtype(), 0 * H + h, 0.0f);
  detail::store_float(x.data(), x.dtype(), 1 * H + 0, std::numeric_limits<float>::quiet_NaN());
  detail::store_float(x.data(), x.dtype(), 1 * H + 2, -std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < H; ++h) {
    detail::store_float(x.data(), x.dtype(), 2 * H + h, 3.0e4f * (h % 3 == 0 ? -1.0f : 0.5f));
    detail::store_float(x.data(), x.dtype(), 3 * H + h, 1.0e-6f * static_cast<float>(h % 7));
  }
}

// Fills a float tensor (any arithmetic dtype) with uniform values in [-1, 1).
inline void fill_random(Tensor& x, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(lo, hi);
  if (dtype_is_arith_float(x.dtype())) {
    for (int64_t i = 0; i < x.numel(); ++i) detail::store_float(x.data(), x.dtype(), i, uni(rng));
  } else {
    auto* b = static_cast<uint8_t*>(x.data());
    for (size_t i = 0; i < x.nbytes(); ++i) b[i] = static_cast<uint8_t>(rng());
  }
}

// The message of the moeflow::Error that fn() throws ("no error" if none).
template <typename Fn>
std::string message_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

inline float at(const Tensor& x, int64_t i) { return detail::load_float(x.data(), x.dtype(), i); }

// The bytes a 16-bit dW holds after a wgrad: the float32 result `fresh`
// rounded to dt; with `init` (accumulate) init + that, in float32, rounded
// again (the TMA reduce-add's arithmetic, autograd's grad += g).
inline Tensor wgrad_16bit(const Tensor& fresh, DType dt, const Tensor* init = nullptr) {
  Tensor r = make_tensor(fresh.sizes(), dt);
  for (int64_t i = 0; i < fresh.numel(); ++i) {
    float v = fresh.data_ptr<float>()[i];
    if (init != nullptr) {
      detail::store_float(r.data(), dt, i, v);
      v = at(*init, i) + at(r, i);
    }
    detail::store_float(r.data(), dt, i, v);
  }
  return r;
}

// Bitwise equality of two tensors' bytes.
inline ::testing::AssertionResult bytes_equal(const Tensor& got, const Tensor& want) {
  if (got.nbytes() != want.nbytes())
    return ::testing::AssertionFailure() << "sizes differ: " << got.nbytes() << " vs " << want.nbytes();
  if (got.nbytes() == 0 || std::memcmp(got.data(), want.data(), got.nbytes()) == 0)
    return ::testing::AssertionSuccess();
  const auto* a = static_cast<const uint8_t*>(got.data());
  const auto* b = static_cast<const uint8_t*>(want.data());
  size_t i = 0;
  while (a[i] == b[i]) ++i;
  return ::testing::AssertionFailure() << "first differing byte " << i << ": " << int(a[i])
                                       << " vs " << int(b[i]);
}

// Element-wise closeness under the tolerance table for `dtype` (NaN never passes).
inline ::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, Tolerance tol) {
  if (got.numel() != want.numel())
    return ::testing::AssertionFailure() << "numel differs: " << got.numel() << " vs " << want.numel();
  for (int64_t i = 0; i < got.numel(); ++i) {
    double g = at(got, i), w = at(want, i);
    if (!(std::fabs(g - w) <= tol.atol + tol.rtol * std::fabs(w)))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g << ", want " << w;
  }
  return ::testing::AssertionSuccess();
}

// A naive plan, independent of src/cpu: stable-sort the routed slots by
// expert, then lay out padded segments, dropping past the capacity.
struct NaivePlan {
  std::vector<int32_t> kept, padded;
  std::vector<int64_t> offsets, dest;
  std::vector<int32_t> row_token, row_k;
  int64_t total = 0;
  int64_t dropped = 0;
};

inline NaivePlan naive_plan(const std::vector<int64_t>& slot_expert, int64_t T, int K, int E,
                            int align, int64_t capacity) {
  NaivePlan p;
  std::vector<int64_t> slots;
  for (int64_t i = 0; i < T * K; ++i)
    if (slot_expert[i] >= 0) slots.push_back(i);
  std::stable_sort(slots.begin(), slots.end(),
                   [&](int64_t a, int64_t b) { return slot_expert[a] < slot_expert[b]; });
  p.kept.assign(E, 0);
  p.padded.assign(E, 0);
  p.offsets.assign(E + 1, 0);
  p.dest.assign(T * K, -1);
  p.row_token.assign(capacity, -2);  // -2: not written
  p.row_k.assign(capacity, -2);
  std::vector<std::vector<int64_t>> per(E);
  for (int64_t s : slots) per[slot_expert[s]].push_back(s);
  int64_t row = 0;
  for (int e = 0; e < E; ++e) {
    p.offsets[e] = row;
    for (int64_t s : per[e]) {
      if (row < capacity) {
        p.dest[s] = row;
        p.row_token[row] = static_cast<int32_t>(s / K);
        p.row_k[row] = static_cast<int32_t>(s % K);
        ++row;
        ++p.kept[e];
      } else {
        ++p.dropped;
      }
    }
    while ((row - p.offsets[e]) % align != 0) {
      p.row_token[row] = -1;
      p.row_k[row] = -1;
      ++row;
    }
    p.padded[e] = static_cast<int32_t>(row - p.offsets[e]);
  }
  p.offsets[E] = row;
  p.total = row;
  return p;
}

inline std::vector<int64_t> slot_experts_of_ids(const Tensor& ids) {
  std::vector<int64_t> v(ids.numel());
  for (int64_t i = 0; i < ids.numel(); ++i) v[i] = id_at(ids, i);
  return v;
}

inline std::vector<int64_t> slot_experts_of_mask(const Tensor& mask) {
  const int64_t E = mask.size(1);
  std::vector<int64_t> v(mask.numel());
  for (int64_t i = 0; i < mask.numel(); ++i) v[i] = mask.data_ptr<uint8_t>()[i] ? i % E : -1;
  return v;
}

template <typename T>
std::vector<T> to_vec(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu());
  return std::vector<T>(h.data_ptr<T>(), h.data_ptr<T>() + h.numel());
}

// Expects a built plan (any device) to equal the naive plan exactly.
inline void expect_plan_equals(const RoutingPlan& plan, const NaivePlan& want) {
  EXPECT_EQ(to_vec<int32_t>(plan.tokens_per_expert), want.kept);
  EXPECT_EQ(to_vec<int32_t>(plan.padded_tokens_per_expert), want.padded);
  EXPECT_EQ(to_vec<int64_t>(plan.expert_row_offsets), want.offsets);
  EXPECT_EQ(to_vec<int64_t>(plan.dest_row), want.dest);
  EXPECT_EQ(to_vec<int64_t>(plan.total_rows)[0], want.total);
  EXPECT_EQ(to_vec<int32_t>(plan.overflow)[0], want.dropped);
  auto row_token = to_vec<int32_t>(plan.row_token);
  auto row_k = to_vec<int32_t>(plan.row_k);
  for (int64_t r = 0; r < want.total; ++r) {
    ASSERT_EQ(row_token[r], want.row_token[r]) << "row " << r;
    ASSERT_EQ(row_k[r], want.row_k[r]) << "row " << r;
  }
}

}  // namespace moeflow::test
