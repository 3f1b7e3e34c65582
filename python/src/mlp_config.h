// The GroupedMlpConfig from the grouped MLP's Python arguments, shared by
// the extensions (moeflow._C and moeflow._autograd). Plain C++: no binding
// library.
#pragma once

#include <string>

#include "moeflow/error.h"
#include "moeflow/grouped_mlp.h"

namespace moeflow::python {

inline Activation activation_of(const std::string& s) {
  if (s == "swiglu") return Activation::kSwiGLU;
  if (s == "geglu") return Activation::kGeGLU;
  if (s == "clamped_quick_geglu") return Activation::kClampedQuickGeGLU;
  if (s == "gelu") return Activation::kGelu;
  if (s == "relu") return Activation::kRelu;
  if (s == "squared_relu") return Activation::kSquaredRelu;
  MOEFLOW_CHECK(false, "activation: expected swiglu, geglu, clamped_quick_geglu, gelu, relu or ",
                "squared_relu, got '", s, "'");
  return Activation::kSwiGLU;
}

inline GroupedMlpConfig mlp_config(const std::string& act, int glu_interleave, float alpha,
                                   float limit, float offset) {
  GroupedMlpConfig c;
  c.activation = activation_of(act);
  c.glu_interleave = glu_interleave;
  c.params.alpha = alpha;
  c.params.limit = limit;
  c.params.offset = offset;
  return c;
}

}  // namespace moeflow::python
