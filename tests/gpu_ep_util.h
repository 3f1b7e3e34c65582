// Helpers shared by the GPU tests of expert parallelism (test_gpu_ep*.cpp).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <mutex>

namespace moeflow::test {

inline bool same_bytes(const void* a, const void* b, size_t n) {
  return std::memcmp(a, b, n) == 0;
}

// Host threads meet here (simulated ranks: no rank launches its next
// operation before every rank is ready to launch it, see create_simulated).
class HostBarrier {
 public:
  explicit HostBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(m_);
    const int gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, arrived_ = 0, gen_ = 0;
};

}  // namespace moeflow::test
