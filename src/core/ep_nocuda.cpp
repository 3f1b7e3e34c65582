// Expert parallelism in a build without CUDA (MOEFLOW_WITH_CUDA=OFF): the
// EpGroup API and the backend entry points link, and every call that would
// make or use a group throws a clear error. Compiled in every build, empty
// in a CUDA build (src/cuda/ep/ defines all of it there).
#ifndef MOEFLOW_WITH_CUDA
#include "core/ep_backend.h"
#include "core/internal.h"

namespace moeflow {

namespace {
[[noreturn]] void no_cuda() {
  MOEFLOW_CHECK(false,
                "expert parallelism needs CUDA: this moeflow was built without CUDA "
                "(MOEFLOW_WITH_CUDA=OFF)");
}
}  // namespace

// Never made: every factory throws.
struct EpGroup::Impl {
  EpOptions options;
  std::vector<int64_t> rows;
};

EpGroup::EpGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EpGroup::~EpGroup() = default;
std::unique_ptr<EpGroup> EpGroup::from_comm(ncclComm*, const EpOptions&) {
  no_cuda();
}
std::unique_ptr<EpGroup> EpGroup::from_unique_id(const std::array<char, 128>&, int, int,
                                                 const EpOptions&, int) {
  no_cuda();
}
std::array<char, 128> EpGroup::new_unique_id() {
  no_cuda();
}
std::vector<std::unique_ptr<EpGroup>> EpGroup::create_local(const std::vector<int>&,
                                                            const EpOptions&) {
  no_cuda();
}
std::vector<std::unique_ptr<EpGroup>> EpGroup::create_simulated(int, int, const EpOptions&) {
  no_cuda();
}
void EpGroup::run_local(const std::vector<std::unique_ptr<EpGroup>>&,
                        const std::function<void(int)>&) {
  no_cuda();
}
int EpGroup::rank() const {
  return 0;
}
int EpGroup::world_size() const {
  return 1;
}
int EpGroup::local_experts() const {
  return 0;
}
Device EpGroup::device() const {
  return Device::cpu();
}
int64_t EpGroup::capacity_rows() const {
  return 0;
}
const EpOptions& EpGroup::options() const {
  return impl_->options;
}
void EpGroup::set_pipeline_chunks(int) {
  no_cuda();
}
void EpGroup::set_overlap_blocks(int) {
  no_cuda();
}
void EpGroup::set_nvlink_blocks(int) {
  no_cuda();
}
void EpGroup::set_combine_wire_dtype(DType) {
  no_cuda();
}
ncclComm* EpGroup::nccl_comm() const {
  return nullptr;
}
cudaStream_t EpGroup::simulated_stream() const {
  return nullptr;
}
bool EpGroup::nccl_buffers_registered() const {
  return false;
}
void EpGroup::check() {
  no_cuda();
}
const std::vector<int64_t>& EpGroup::last_send_rows() const {
  return impl_->rows;
}
const std::vector<int64_t>& EpGroup::last_recv_rows() const {
  return impl_->rows;
}

namespace cuda {
EpDispatchResult ep_nccl_dispatch(EpGroup&, TensorView, TensorView, TensorView, TensorView,
                                  cudaStream_t) {
  no_cuda();
}
EpDispatchResult ep_nccl_dispatch_quantize(EpGroup&, TensorView, TensorView, TensorView,
                                           const QuantizeConfig&, cudaStream_t) {
  no_cuda();
}
EpDispatchResult ep_dispatch_quantize_staged(EpGroup&, TensorView, TensorView, TensorView,
                                             const QuantizeConfig&, cudaStream_t) {
  no_cuda();
}
EpDispatchResult ep_nvlink_dispatch_quantize(EpGroup&, TensorView, TensorView, TensorView,
                                             const QuantizeConfig&, cudaStream_t) {
  no_cuda();
}
void ep_nccl_combine(EpGroup&, const EpHandle&, TensorView, bool, TensorView, cudaStream_t) {
  no_cuda();
}
void ep_nccl_combine_backward(EpGroup&, const EpHandle&, TensorView, TensorView, bool, TensorView, TensorView,
                              cudaStream_t) {
  no_cuda();
}
void ep_nvlink_check(EpGroup&) {
  no_cuda();
}
EpDispatchResult ep_nvlink_dispatch(EpGroup&, TensorView, TensorView, TensorView, TensorView,
                                    const QuantizeConfig*, cudaStream_t) {
  no_cuda();
}
void ep_nvlink_combine(EpGroup&, const EpHandle&, TensorView, bool, TensorView, cudaStream_t) {
  no_cuda();
}
void ep_nvlink_combine_backward(EpGroup&, const EpHandle&, TensorView, TensorView, bool, TensorView, TensorView,
                                cudaStream_t) {
  no_cuda();
}
}  // namespace cuda

}  // namespace moeflow
#endif  // MOEFLOW_WITH_CUDA
