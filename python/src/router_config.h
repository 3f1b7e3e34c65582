// The RouterConfig from the router's Python arguments, shared by the
// extensions (moeflow._C and moeflow._autograd). Plain C++: no binding
// library.
#pragma once

#include <string>

#include "moeflow/error.h"
#include "moeflow/router.h"

namespace moeflow::python {

inline ScoreFunction score_function_of(const std::string& s) {
  if (s == "softmax") return ScoreFunction::kSoftmax;
  if (s == "sigmoid") return ScoreFunction::kSigmoid;
  MOEFLOW_CHECK(false, "score_function: expected softmax or sigmoid, got '", s, "'");
  return ScoreFunction::kSoftmax;
}

inline RouterConfig router_config(int E, int K, const std::string& score_function, bool pre_softmax,
                                  int num_groups, int group_topk, float topk_scaling_factor,
                                  float aux_loss_coeff, float z_loss_coeff,
                                  float seq_aux_loss_coeff) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = K;
  c.score_function = score_function_of(score_function);
  c.pre_softmax = pre_softmax;
  c.num_groups = num_groups;
  c.group_topk = group_topk;
  c.topk_scaling_factor = topk_scaling_factor;
  c.aux_loss_coeff = aux_loss_coeff;
  c.z_loss_coeff = z_loss_coeff;
  c.seq_aux_loss_coeff = seq_aux_loss_coeff;
  return c;
}

}  // namespace moeflow::python
