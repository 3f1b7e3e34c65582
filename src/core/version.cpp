// build_info(): what this build contains, from compile definitions that
// CMakeLists.txt sets on this file (CUDA toolkit version, architecture list)
// and from nccl.h's version macros; nothing is queried at run time.
#include "moeflow/version.h"

#if defined(MOEFLOW_WITH_CUDA)
#include <nccl.h>
#endif

namespace moeflow {

#if defined(MOEFLOW_WITH_CUDA)
namespace {

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < s.size()) {
    const size_t end = s.find(',', start);
    const size_t stop = end == std::string::npos ? s.size() : end;
    if (stop > start) out.push_back(s.substr(start, stop - start));
    start = stop + 1;
  }
  return out;
}

}  // namespace
#endif

BuildInfo build_info() {
  BuildInfo info;
  info.version = MOEFLOW_VERSION_STRING;
#if defined(MOEFLOW_WITH_CUDA)
  info.cuda_backend = true;
#if defined(MOEFLOW_BUILD_CUDA_VERSION)
  info.cuda_version = MOEFLOW_BUILD_CUDA_VERSION;
#endif
#if defined(MOEFLOW_BUILD_CUDA_ARCHS)
  info.cuda_archs = split_commas(MOEFLOW_BUILD_CUDA_ARCHS);
#endif
  info.nccl_version = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
                      std::to_string(NCCL_PATCH);
#endif
  return info;
}

}  // namespace moeflow
