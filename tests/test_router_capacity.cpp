// CPU tests of the router's expert capacity (router_capacity,
// router_apply_capacity): Megatron's get_capacity values, hand-worked drops
// under both policies with ties, the C >= T shortcut, in-place use, random
// cases against a naive per-expert sort, bad input.
#include "test_util.h"

namespace moeflow::test {
namespace {

Tensor int_tensor(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
  Tensor t = make_tensor(shape, DType::kInt32);
  std::copy(v.begin(), v.end(), t.data_ptr<int32_t>());
  return t;
}

Tensor float_tensor(const std::vector<float>& v, std::vector<int64_t> shape) {
  Tensor t = make_tensor(shape, DType::kFloat32);
  std::copy(v.begin(), v.end(), t.data_ptr<float>());
  return t;
}

RouterCapacityConfig cap_cfg(int E, double factor, DropPolicy policy) {
  RouterCapacityConfig c;
  c.num_experts = E;
  c.capacity_factor = factor;
  c.drop_policy = policy;
  return c;
}

struct Capped {
  std::vector<int32_t> kept;
  int32_t dropped;
};

Capped apply(const Tensor& ids, const Tensor& probs, const RouterCapacityConfig& c) {
  Tensor kept = make_tensor({ids.size(0), ids.size(1)}, DType::kInt32);
  Tensor dropped = make_tensor({1}, DType::kInt32);
  fill_bytes(kept, 0xFF);
  fill_bytes(dropped, 0xFF);
  router_apply_capacity(ids, probs.defined() ? TensorView(probs) : TensorView{}, c, kept, dropped);
  return {to_vec<int32_t>(kept), dropped.data_ptr<int32_t>()[0]};
}

// The naive reference: each expert's slots sorted by (prob descending,
// token, k) or (token, k); the first `capacity` kept, unless capacity >= T.
Capped naive_capacity(const Tensor& ids, const Tensor& probs, const RouterCapacityConfig& c) {
  const int64_t T = ids.size(0), K = ids.size(1);
  const int64_t cap =
      router_capacity(T, static_cast<int>(K), c.num_experts, c.capacity_factor, c.min_capacity);
  Capped r{to_vec<int32_t>(ids), 0};
  if (cap >= T) return r;
  for (int e = 0; e < c.num_experts; ++e) {
    std::vector<int64_t> slots;
    for (int64_t i = 0; i < T * K; ++i)
      if (r.kept[i] == e) slots.push_back(i);
    std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) {
      if (c.drop_policy == DropPolicy::kProbs) {
        const float pa = probs.data_ptr<float>()[a], pb = probs.data_ptr<float>()[b];
        if (pa != pb) return pa > pb;
      }
      return a < b;
    });
    for (size_t j = static_cast<size_t>(cap); j < slots.size(); ++j) {
      r.kept[slots[j]] = -1;
      ++r.dropped;
    }
  }
  return r;
}

TEST(RouterCapacity, MegatronGetCapacity) {
  EXPECT_EQ(router_capacity(4, 2, 2, 0.5), 2);  // ceil(8 / 2 * 0.5)
  EXPECT_EQ(router_capacity(10, 1, 1, 1.1), 11);
  EXPECT_EQ(router_capacity(25, 2, 1, 1.1), 56);  // Python: ceil(50.0 * 1.1 = 55.00000000000001)
  EXPECT_EQ(router_capacity(8, 1, 3, 1.5), 4);    // ceil(2.666... * 1.5 = 4.0)
  EXPECT_EQ(router_capacity(4096, 8, 64, 1.25), 640);
  EXPECT_EQ(router_capacity(4, 2, 2, 0.5, 3), 3);  // min_capacity
  EXPECT_EQ(router_capacity(0, 2, 4, 1.0), 0);
}

TEST(RouterCapacity, HandWorkedBothPolicies) {
  // T=4, K=2, E=2, factor 0.5: capacity 2 of the 4 slots of each expert.
  Tensor ids = int_tensor({0, 1, 0, 1, 1, 0, 0, 1}, {4, 2});
  Tensor probs = float_tensor({.6f, .4f, .4f, .6f, .4f, .6f, .7f, .3f}, {4, 2});
  // Expert 0: t0 .6, t1 .4, t2 .6, t3 .7 -> t3, t0 (ties: lower token first).
  // Expert 1: t0 .4, t1 .6, t2 .4, t3 .3 -> t1, t0.
  Capped p = apply(ids, probs, cap_cfg(2, 0.5, DropPolicy::kProbs));
  EXPECT_EQ(p.kept, (std::vector<int32_t>{0, 1, -1, 1, -1, -1, 0, -1}));
  EXPECT_EQ(p.dropped, 4);
  Capped q = apply(ids, {}, cap_cfg(2, 0.5, DropPolicy::kPosition));  // probs not needed
  EXPECT_EQ(q.kept, (std::vector<int32_t>{0, 1, 0, 1, -1, -1, -1, -1}));
  EXPECT_EQ(q.dropped, 4);
  // Unrouted slots stay -1 and are not dropped; min_capacity 3 keeps t3's slot of expert 0.
  Tensor ids2 = int_tensor({0, -1, 0, -1, -1, -1, 0, -1}, {4, 2});
  RouterCapacityConfig c = cap_cfg(2, 0.25, DropPolicy::kPosition);  // capacity 1
  Capped r = apply(ids2, probs, c);
  EXPECT_EQ(r.kept, (std::vector<int32_t>{0, -1, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(r.dropped, 2);
  c.min_capacity = 2;
  c.drop_policy = DropPolicy::kProbs;  // t3 .7, t0 .6 kept
  r = apply(ids2, probs, c);
  EXPECT_EQ(r.kept, (std::vector<int32_t>{0, -1, -1, -1, -1, -1, 0, -1}));
  EXPECT_EQ(r.dropped, 1);
}

TEST(RouterCapacity, NothingDroppedWhenCapacityReachesT) {
  // Every token to expert 0: capacity ceil(4 * 1 / 4 * 4) = 4 = T keeps all.
  Tensor ids = int_tensor({0, 0, 0, 0}, {4, 1});
  Tensor probs = float_tensor({.1f, .2f, .3f, .4f}, {4, 1});
  Capped r = apply(ids, probs, cap_cfg(4, 4.0, DropPolicy::kProbs));
  EXPECT_EQ(r.kept, (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ(r.dropped, 0);
  r = apply(ids, probs, cap_cfg(4, 2.0, DropPolicy::kProbs));  // capacity 2: the two largest
  EXPECT_EQ(r.kept, (std::vector<int32_t>{-1, -1, 0, 0}));
  EXPECT_EQ(r.dropped, 2);
}

TEST(RouterCapacity, InPlace) {
  Tensor ids = int_tensor({0, 1, 0, 1, 1, 0, 0, 1}, {4, 2});
  Tensor probs = float_tensor({.6f, .4f, .4f, .6f, .4f, .6f, .7f, .3f}, {4, 2});
  router_apply_capacity(ids, probs, cap_cfg(2, 0.5, DropPolicy::kProbs), ids);
  EXPECT_EQ(to_vec<int32_t>(ids), (std::vector<int32_t>{0, 1, -1, 1, -1, -1, 0, -1}));
}

TEST(RouterCapacity, RandomAgainstNaive) {
  uint32_t seed = 1;
  for (int64_t T : {1, 7, 50, 333}) {
    for (int E : {2, 8, 33}) {
      for (int K : {1, 2, 4}) {
        if (K > E) continue;
        Tensor ids = random_topk(T, K, E, ++seed, 1.0, 0.1);
        Tensor probs = make_tensor({T, K}, DType::kFloat32);
        fill_random(probs, ++seed, 0.0f, 1.0f);
        for (int64_t i = 0; i < T * K; ++i)  // few distinct values: ties
          probs.data_ptr<float>()[i] = std::round(probs.data_ptr<float>()[i] * 8.0f) / 8.0f;
        for (double f : {0.25, 0.5, 1.0, 1.3, 100.0}) {
          for (DropPolicy pol : {DropPolicy::kProbs, DropPolicy::kPosition}) {
            SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E) +
                         " K=" + std::to_string(K) + " factor=" + std::to_string(f) +
                         (pol == DropPolicy::kProbs ? " probs" : " position"));
            const RouterCapacityConfig c = cap_cfg(E, f, pol);
            const Capped got = apply(ids, probs, c), want = naive_capacity(ids, probs, c);
            EXPECT_EQ(got.kept, want.kept);
            EXPECT_EQ(got.dropped, want.dropped);
          }
        }
      }
    }
  }
}

TEST(RouterCapacity, BadInput) {
  Tensor ids = int_tensor({0, 1, 2, 3}, {2, 2}), probs = make_tensor({2, 2}, DType::kFloat32);
  Tensor kept = make_tensor({2, 2}, DType::kInt32);
  auto run = [&](RouterCapacityConfig c, TensorView i, TensorView p, TensorView k,
                 TensorView d = {}) {
    return message_of([&] { router_apply_capacity(i, p, c, k, d); });
  };
  auto has = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos ? ::testing::AssertionSuccess()
                                               : ::testing::AssertionFailure() << msg;
  };
  const RouterCapacityConfig c = cap_cfg(4, 1.0, DropPolicy::kProbs);
  EXPECT_EQ(run(c, ids, probs, kept), "no error");
  EXPECT_TRUE(has(run(cap_cfg(4, 0.0, DropPolicy::kProbs), ids, probs, kept),
                  "RouterCapacityConfig.capacity_factor must be finite and > 0, got 0"));
  EXPECT_TRUE(has(run(cap_cfg(4, -1.5, DropPolicy::kProbs), ids, probs, kept),
                  "capacity_factor must be finite and > 0, got -1.5"));
  EXPECT_TRUE(has(run(cap_cfg(4, NAN, DropPolicy::kProbs), ids, probs, kept),
                  "capacity_factor must be finite and > 0"));
  EXPECT_TRUE(has(run(cap_cfg(0, 1.0, DropPolicy::kProbs), ids, probs, kept),
                  "RouterCapacityConfig.num_experts must be >= 1, got 0"));
  EXPECT_TRUE(has(run(c, ids, {}, kept), "probs is required"));
  EXPECT_TRUE(
      has(run(c, ids, make_tensor({2, 3}, DType::kFloat32), kept), "probs must be float32 or float64 [2,2]"));
  EXPECT_TRUE(
      has(run(c, make_tensor({2, 2}, DType::kInt64), probs, kept), "topk_ids must be int32 [2,2]"));
  EXPECT_TRUE(
      has(run(c, ids, probs, make_tensor({4}, DType::kInt32)), "kept_ids must be int32 [2,2]"));
  EXPECT_TRUE(
      has(run(c, ids, probs, kept, make_tensor({2}, DType::kInt32)), "dropped must be int32 [1]"));
  EXPECT_TRUE(has(run(cap_cfg(3, 0.5, DropPolicy::kPosition), ids, {}, kept),
                  "topk_ids must be in [-1, num_experts=3), got 3 at slot 3"));
  EXPECT_TRUE(has(message_of([] { router_capacity(4, 2, 2, 0.0); }),
                  "capacity_factor must be finite and > 0, got 0"));
}

}  // namespace
}  // namespace moeflow::test
