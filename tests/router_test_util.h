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

// The configurations the finite-difference tests share (each with the given
// loss coefficients): softmax k2, pre_softmax k3 scaled, sigmoid k1, and
// sigmoid k4 group-limited, scaled, with an expert bias.
inline std::vector<FdCase> common_fd_cases(int E, float aux, float z, float seq) {
  std::vector<FdCase> cases;
  auto add = [&](const char* name, RouterConfig c, bool bias = false) {
    c.aux_loss_coeff = aux;
    c.z_loss_coeff = z;
    c.seq_aux_loss_coeff = seq;
    cases.push_back({name, c, bias});
  };
  add("softmax k2", softmax_cfg(E, 2));
  RouterConfig pre = softmax_cfg(E, 3);
  pre.pre_softmax = true;
  pre.topk_scaling_factor = 1.5f;
  add("pre_softmax k3 scaled", pre);
  add("sigmoid k1", sigmoid_cfg(E, 1));
  RouterConfig sg = sigmoid_cfg(E, 4);
  sg.num_groups = 4;
  sg.group_topk = 2;
  sg.topk_scaling_factor = 2.5f;
  add("sigmoid k4 grouped scaled bias", sg, true);
  return cases;
}

}  // namespace moeflow::test
