// Expert parallelism without a silent hang: a rank that never arrives makes
// the ranks that wait for it throw, naming it, once EpOptions::timeout_s has
// passed: the nccl backend's dispatch itself, the nvlink backend's next call
// (or EpGroup::check) after its kernels gave up (label multigpu: 2+ GPUs).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "moeflow/ep.h"
#include "test_util.h"

namespace moeflow {
namespace {

using namespace test;

TEST(MultiGpuEpNccl, MissingRankTimesOutNamingIt) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  const int W = 2, E = 8, K = 2;
  const int64_t H = 64, T = 32;
  EpOptions opt;
  opt.num_experts = E;
  opt.topk = K;
  opt.hidden = H;
  opt.max_tokens_per_rank = T;
  opt.timeout_s = 2.0;
  auto groups = EpGroup::create_local({0, 1}, opt);
  std::string message;
  double waited = 0;
  EpGroup::run_local(groups, [&](int r) {
    const Device dev = groups[r]->device();
    Tensor x = make_tensor({T, H}, DType::kBFloat16);
    fill_random(x, 7);
    Tensor ids = random_topk(T, K, E, 9);
    // NOTE: one dispatch together first: NCCL connects a pair of ranks (and
    // maps registered buffers) in the host call of their first exchange,
    // which would wait for the peer before this timeout can start.
    ep_dispatch(*groups[r], x.to(dev), ids.to(dev), TensorView{});
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    if (r == 1) return;  // then rank 1 skips a call
    const auto start = std::chrono::steady_clock::now();
    try {
      ep_dispatch(*groups[r], x.to(dev), ids.to(dev), TensorView{});
    } catch (const Error& e) {
      message = e.what();
    }
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // the group is aborted: later calls say so instead of waiting
    try {
      ep_dispatch(*groups[r], x.to(dev), ids.to(dev), TensorView{});
      message += " | second call returned";
    } catch (const Error& e) {
      if (std::string(e.what()).find("aborted") == std::string::npos) message += " | other error";
    }
  });
  // NOTE: the groups are left alive: after a timeout a rank's communicator
  // may wait for its aborted peer on destruction (a dead job exits instead).
  for (auto& g : groups) g.release();
  EXPECT_NE(message.find("timed out"), std::string::npos) << message;
  EXPECT_NE(message.find("rank(s) 1"), std::string::npos) << message;
  EXPECT_EQ(message.find(" | "), std::string::npos) << message;
  EXPECT_GE(waited, 2.0);
  EXPECT_LT(waited, 30.0);
}

TEST(MultiGpuEpNvlink, MissingRankTimesOutNamingIt) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2+ GPUs (label multigpu)";
  const int E = 8, K = 2;
  const int64_t H = 64, T = 32;
  EpOptions opt;
  opt.backend = EpBackend::kNvlink;
  opt.num_experts = E;
  opt.topk = K;
  opt.hidden = H;
  opt.max_tokens_per_rank = T;
  opt.timeout_s = 2.0;
  auto groups = EpGroup::create_local({0, 1}, opt);
  std::string message, later;
  double waited = 0;
  EpGroup::run_local(groups, [&](int r) {
    if (r == 1) return;  // rank 1 skips the call
    const Device dev = groups[r]->device();
    Tensor x = make_tensor({T, H}, DType::kBFloat16);
    fill_random(x, 7);
    Tensor ids = random_topk(T, K, E, 9);
    Tensor xd = x.to(dev), idd = ids.to(dev);
    const auto start = std::chrono::steady_clock::now();
    ep_dispatch(*groups[r], xd, idd, TensorView{});  // returns: the kernels wait
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());      // ends: they gave up
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    try {
      groups[r]->check();
    } catch (const Error& e) {
      message = e.what();
    }
    try {
      ep_dispatch(*groups[r], xd, idd, TensorView{});
    } catch (const Error& e) {
      later = e.what();
    }
  });
  for (auto& g : groups) g.release();  // (as above)
  EXPECT_NE(message.find("timed out"), std::string::npos) << message;
  EXPECT_NE(message.find("rank(s) 1"), std::string::npos) << message;
  EXPECT_NE(later.find("unusable"), std::string::npos) << later;
  EXPECT_GE(waited, 2.0);
  EXPECT_LT(waited, 30.0);
}

}  // namespace
}  // namespace moeflow
