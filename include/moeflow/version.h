#pragma once
// The library version, and what this build of it contains.
#include <string>
#include <vector>

#define MOEFLOW_VERSION_MAJOR 0
#define MOEFLOW_VERSION_MINOR 1
#define MOEFLOW_VERSION_PATCH 0
#define MOEFLOW_VERSION_STRING "0.1.0"

namespace moeflow {

// What was compiled in, fixed at build time (no device query; see
// cuda_device_count() for the machine). The strings are empty and the list
// is empty when the CUDA backend is not built.
struct BuildInfo {
  std::string version;                  // MOEFLOW_VERSION_STRING
  bool cuda_backend = false;            // the CUDA backend is built (else CPU only)
  std::string cuda_version;             // CUDA toolkit compiled with, e.g. "13.0.88"
  std::string nccl_version;             // nccl.h compiled with, e.g. "2.28.9"
  std::vector<std::string> cuda_archs;  // CUDA architectures, e.g. {"90a"}
};

BuildInfo build_info();

}  // namespace moeflow
