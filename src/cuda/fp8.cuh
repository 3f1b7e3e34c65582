// The float -> fp8 code conversion of the quantization policy
// (moeflow/quantize.h), shared by the CUDA kernels that write fp8: round to
// nearest even with saturation (+-inf too), NaN -> quant::kFp8NaN.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "core/quantize_backend.h"

namespace moeflow::cuda {

template <bool E4M3>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  if (v != v) return quant::kFp8NaN;
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, E4M3 ? __NV_E4M3 : __NV_E5M2));
}

}  // namespace moeflow::cuda
