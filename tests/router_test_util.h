// Helpers of the CPU router tests (test_router.cpp, test_router_tokens.cpp).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "test_util.h"

namespace moeflow::test {

struct Routed {
  Tensor ids, probs, counts, aux, z, nonfinite;
};

inline Tensor from(const std::vector<float>& v, std::vector<int64_t> shape) {
  Tensor t = make_tensor(shape, DType::kFloat32);
  std::copy(v.begin(), v.end(), t.data_ptr<float>());
  return t;
}

inline Routed route(const Tensor& logits, const RouterConfig& c, const Tensor& bias = {}) {
  const int64_t T = logits.size(0);
  Routed r;
  r.ids = make_tensor({T, c.topk}, DType::kInt32);
  r.probs = make_tensor({T, c.topk}, DType::kFloat32);
  r.counts = make_tensor({c.num_experts}, DType::kInt32);
  r.aux = make_tensor({1}, DType::kFloat32);
  r.z = make_tensor({1}, DType::kFloat32);
  r.nonfinite = make_tensor({1}, DType::kInt32);
  for (Tensor* t : {&r.ids, &r.probs, &r.counts, &r.aux, &r.z, &r.nonfinite}) fill_bytes(*t, 0xFF);
  router_forward(logits, c, RouterOutputs{r.ids, r.probs, r.counts, r.aux, r.z, r.nonfinite},
                 bias.defined() ? TensorView(bias) : TensorView{});
  return r;
}

inline std::vector<int32_t> ints(const Tensor& t) {
  return std::vector<int32_t>(t.data_ptr<int32_t>(), t.data_ptr<int32_t>() + t.numel());
}
inline std::vector<float> floats(const Tensor& t) {
  return std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
}

inline void expect_near_all(const Tensor& got, const std::vector<double>& want, double tol = 1e-6) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size()));
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got.data_ptr<float>()[i], want[i], tol) << "element " << i;
}

// Whether the message `msg` contains `part`.
inline ::testing::AssertionResult has(const std::string& msg, const std::string& part) {
  if (msg.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << part << "\"";
}

inline RouterConfig softmax_cfg(int E, int K) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = K;
  return c;
}

inline RouterConfig sigmoid_cfg(int E, int K) {
  RouterConfig c = softmax_cfg(E, K);
  c.score_function = ScoreFunction::kSigmoid;
  return c;
}

// A finite-difference case: a named configuration, with or without an
// expert bias.
struct FdCase {
  const char* name;
  RouterConfig config;
  bool bias;
};

}  // namespace moeflow::test
