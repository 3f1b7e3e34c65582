// moeflow errors: one exception type and the checking macros used at every
// API boundary. Messages name the argument, what was expected and what came.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moeflow {

// The one exception type moeflow throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (void)(os << ... << args);
  return os.str();
}

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);
// `code` is a cudaError_t; taken as int so this header needs no CUDA headers.
void check_cuda(int code, const char* expr, const char* file, int line);

}  // namespace detail
}  // namespace moeflow

// MOEFLOW_CHECK(cond, "message parts", ...): throws moeflow::Error with the
// concatenated message parts when cond is false.
#define MOEFLOW_CHECK(cond, ...)                                                  \
  do {                                                                            \
    if (!(cond)) {                                                                \
      ::moeflow::detail::throw_error(__FILE__, __LINE__,                          \
                                     ::moeflow::detail::str_cat(__VA_ARGS__));   \
    }                                                                             \
  } while (0)

// MOEFLOW_CUDA_CHECK(cudaCall(...)): throws moeflow::Error naming the call and
// the CUDA error string when the call did not return cudaSuccess.
#define MOEFLOW_CUDA_CHECK(expr) \
  ::moeflow::detail::check_cuda(static_cast<int>(expr), #expr, __FILE__, __LINE__)
