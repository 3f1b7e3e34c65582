// moeflow::Error construction and the CUDA error check behind MOEFLOW_CUDA_CHECK.
#include "moeflow/error.h"

#include "core/internal.h"

namespace moeflow::detail {

void throw_error(const char* file, int line, const std::string& msg) {
  (void)file;
  (void)line;
  throw Error("moeflow: " + msg);
}

void check_cuda(int code, const char* expr, const char* file, int line) {
  if (code == 0) return;
  throw Error(str_cat("moeflow: CUDA error ", code, " (", cuda_error_string(code), ") in ", expr,
                      " at ", file, ":", line));
}

}  // namespace moeflow::detail
