// Helpers of the GPU tests only (they include the CUDA runtime).
#pragma once

#include <cuda_runtime.h>

namespace moeflow::test {

// Whether device 0 is a Hopper GPU (the sm_90a kernels run there).
inline bool is_hopper() {
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  return major == 9;
}

}  // namespace moeflow::test
