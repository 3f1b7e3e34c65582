// Activations of the grouped expert MLP.
#pragma once

namespace moeflow {

enum class Activation {
  kSwiGLU,             // silu(g) * u
  kGeGLU,              // gelu(g) * u (erf form)
  kClampedQuickGeGLU,  // GPT-OSS: g' = min(g, L), u' = clamp(u, -L, L); g' sigmoid(a g') (u' + o)
  kGelu,               // gelu(g) (erf form), not gated
  kRelu,               // max(g, 0), not gated
  kSquaredRelu,        // max(g, 0)^2, not gated
};

struct ActivationParams {
  float alpha = 1.702f;  // clamped quick-GeGLU: sigmoid slope
  float limit = 7.0f;    // clamp limit
  float offset = 1.0f;   // linear offset added to the up projection
};

}  // namespace moeflow
