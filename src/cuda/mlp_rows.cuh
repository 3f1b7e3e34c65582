// Shared by the grouped MLP's elementwise kernels and the FP8 recipes' row
// quantization: which rows of a grouped layout hold data (the device side
// of GroupLayout: offsets [E+1] int64, real_rows [E] int32 or null), and the
// runtime activation as a template argument.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/activations.h"

namespace moeflow::cuda {

struct RowMap {
  const int64_t* offsets;  // null: every row holds data (no groups)
  const int32_t* real;     // or null: every row of a segment holds data
  int E;
  // Expert of `row` (-1 past the groups) and whether the row holds data.
  __device__ int expert_of(int64_t row, bool& data) const {
    if (!offsets) {
      data = true;
      return 0;
    }
    data = false;
    if (row >= offsets[E] || row < offsets[0]) return -1;
    int lo = 0, hi = E - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= row)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int64_t seg = offsets[lo + 1] - offsets[lo];
    const int64_t n = real ? max(int64_t{0}, min(int64_t{real[lo]}, seg)) : seg;
    data = row - offsets[lo] < n;
    return lo;
  }
};

// Calls f(std::integral_constant<Activation, A>{}) for the runtime activation.
template <typename F>
void with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kSwiGLU:
      return f(std::integral_constant<Activation, Activation::kSwiGLU>{});
    case Activation::kGeGLU:
      return f(std::integral_constant<Activation, Activation::kGeGLU>{});
    case Activation::kClampedQuickGeGLU:
      return f(std::integral_constant<Activation, Activation::kClampedQuickGeGLU>{});
    case Activation::kGelu:
      return f(std::integral_constant<Activation, Activation::kGelu>{});
    case Activation::kRelu:
      return f(std::integral_constant<Activation, Activation::kRelu>{});
    default:
      return f(std::integral_constant<Activation, Activation::kSquaredRelu>{});
  }
}

}  // namespace moeflow::cuda
