// GPU grouped GEMM tests (label gpu): forward, dgrad and wgrad against the
// CPU reference (float64 accumulation) and against a per-expert cuBLAS loop,
// by relative norm error; outputs poisoned first; pad rows zero; rows past
// the groups untouched; bf16 / fp16 weight gradients bitwise the float32 ones
// rounded; offsets changed between CUDA-graph replays; bad offsets flagged
// without out-of-bounds access.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "gpu_util.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);

#define CUBLAS_OK(x) ASSERT_EQ((x), CUBLAS_STATUS_SUCCESS)

// Every test runs on each kernel path: the default (the TMA kernel on Hopper),
// the TMA kernel with its consumer warpgroups staggered by 3 K slices and its
// blocks desynchronised, the
// cp.async wgmma kernels, the masked-store epilogue and the portable mma.sync.
struct PathCase {
  GemmKernel kernel;
  int stagger;  // -1: the default
  int desync;   // -1: the default
  const char* name;
};
class GpuGemm : public ::testing::TestWithParam<PathCase> {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device"; }
  // The options of this case, passed to every GPU call.
  GemmOptions opts() const {
    GemmOptions o;
    o.kernel = GetParam().kernel;
    o.stagger = GetParam().stagger;
    o.desync = GetParam().desync;
    return o;
  }
};

double rel_error(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = at(got, i), w = at(want, i);
    if (std::isnan(g)) return INFINITY;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

struct Problem {
  std::vector<int64_t> seg;   // rows of each group's (padded) segment
  std::vector<int32_t> real;  // real rows of each group
  int64_t k, n;
  int64_t tail = 5;  // rows past offsets[E]
};

std::string name_of(const Problem& p) {
  std::string s = "E=" + std::to_string(p.seg.size()) + " K=" + std::to_string(p.k) +
                  " N=" + std::to_string(p.n) + " seg=";
  for (size_t i = 0; i < std::min<size_t>(p.seg.size(), 6); ++i)
    s += std::to_string(p.seg[i]) + ",";
  return s;
}

struct Data {
  int64_t rows = 0;
  Tensor offsets, real;  // CPU
  Tensor offsets_g, real_g;
  GroupLayout cpu_layout() const {
    GroupLayout g;
    g.offsets = offsets;
    g.real_rows = real;
    return g;
  }
  GroupLayout gpu_layout() const {
    GroupLayout g;
    g.offsets = offsets_g;
    g.real_rows = real_g;
    return g;
  }
};

Data make_data(const Problem& p) {
  Data d;
  const int64_t E = p.seg.size();
  d.offsets = make_tensor({E + 1}, DType::kInt64);
  d.real = make_tensor({E}, DType::kInt32);
  int64_t o = 0;
  for (int64_t e = 0; e < E; ++e) {
    d.offsets.data_ptr<int64_t>()[e] = o;
    d.real.data_ptr<int32_t>()[e] = p.real[e];
    o += p.seg[e];
  }
  d.offsets.data_ptr<int64_t>()[E] = o;
  d.rows = o + p.tail;
  d.offsets_g = d.offsets.to(kGpu);
  d.real_g = d.real.to(kGpu);
  return d;
}

// Random problem: E groups, rows per group in [0, max_rows], some padding.
Problem random_problem(int E, int max_rows, int64_t k, int64_t n, uint32_t seed, int align = 16) {
  std::mt19937 rng(seed);
  Problem p;
  p.k = k;
  p.n = n;
  for (int e = 0; e < E; ++e) {
    int r = std::uniform_int_distribution<int>(0, max_rows)(rng);
    if (e % 5 == 1) r = 0;
    if (e % 7 == 2) r = 1;
    p.real.push_back(r);
    p.seg.push_back((r + align - 1) / align * align);
  }
  return p;
}

Tensor poisoned_gpu(const std::vector<int64_t>& shape, DType dt) {
  return poisoned(shape, dt, kGpu);
}

// Zeroes the pad rows and the tail of a CPU [rows, cols] input.
void zero_non_data_rows(Tensor& t, const Problem& p, const Data& d) {
  const int64_t cols = t.size(1);
  std::vector<bool> data(d.rows, false);
  for (size_t e = 0; e < p.seg.size(); ++e)
    for (int64_t r = 0; r < p.real[e]; ++r) data[d.offsets.data_ptr<int64_t>()[e] + r] = true;
  for (int64_t r = 0; r < d.rows; ++r)
    if (!data[r])
      for (int64_t j = 0; j < cols; ++j)
        detail::store_float(t.data(), t.dtype(), r * cols + j, 0.0f);
}

const std::vector<Problem> kProblems = {
    {{16, 0, 32, 16}, {1, 0, 17, 16}, 8, 8},  // K, N at the minimum
    {{128, 256}, {127, 129}, 64, 136},        // rows around the tile
    random_problem(8, 300, 200, 96, 1),       // K not a multiple of the tile
    random_problem(16, 300, 256, 192, 2, 64),
    random_problem(5, 1000, 512, 264, 3, 128),
    random_problem(33, 40, 128, 256, 4, 1),
    // a pad-only tile after one with data, odd tile counts, a group whose
    // rows are all padding
    {{384, 512, 128, 256}, {100, 300, 0, 256}, 64, 520},
};

TEST_P(GpuGemm, ForwardDgradWgradMatchCpu) {
  uint32_t seed = 10;
  for (const Problem& p : kProblems) {
    for (DType in : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(name_of(p) + " " + dtype_name(in));
      const int64_t E = p.seg.size(), K = p.k, N = p.n;
      Data d = make_data(p);
      Tensor a = make_tensor({d.rows, K}, in), dc = make_tensor({d.rows, N}, in);
      Tensor w = make_tensor({E, N, K}, in);
      fill_random(a, seed++);
      fill_random(dc, seed++);
      fill_random(w, seed++);
      Tensor a_g = a.to(kGpu), dc_g = dc.to(kGpu), w_g = w.to(kGpu);
      for (DType out : {DType::kBFloat16, DType::kFloat32}) {
        SCOPED_TRACE(dtype_name(out));
        // forward
        Tensor c_ref = make_tensor({d.rows, N}, out);
        fill_bytes(c_ref, 0xFF);
        grouped_gemm_forward(a, GroupedWeights::from_stacked(w), d.cpu_layout(), c_ref);
        Tensor c_g = poisoned_gpu({d.rows, N}, out);
        grouped_gemm_forward(a_g, GroupedWeights::from_stacked(w_g), d.gpu_layout(), c_g, opts());
        Tensor c = c_g.to(Device::cpu());
        const int64_t used = d.rows - p.tail;
        Tensor c_used = make_tensor({used, N}, out), c_ref_used = make_tensor({used, N}, out);
        std::memcpy(c_used.data(), c.data(), c_used.nbytes());
        std::memcpy(c_ref_used.data(), c_ref.data(), c_ref_used.nbytes());
        EXPECT_LE(rel_error(c_used, c_ref_used), gemm_tolerance(out));
        // pad rows exactly zero; the tail keeps its poison
        for (int64_t e = 0; e < E; ++e)
          for (int64_t r = d.offsets.data_ptr<int64_t>()[e] + p.real[e];
               r < d.offsets.data_ptr<int64_t>()[e + 1]; ++r)
            ASSERT_EQ(at(c, r * N), 0.0f) << "pad row " << r;
        for (int64_t i = used * N * dtype_size(out); i < int64_t(c.nbytes()); ++i)
          ASSERT_EQ(static_cast<uint8_t*>(c.data())[i], 0xFF) << "tail written";
        // dgrad
        Tensor da_ref = make_tensor({d.rows, K}, out);
        fill_bytes(da_ref, 0xFF);
        grouped_gemm_dgrad(dc, GroupedWeights::from_stacked(w), d.cpu_layout(), da_ref);
        Tensor da_g = poisoned_gpu({d.rows, K}, out);
        grouped_gemm_dgrad(dc_g, GroupedWeights::from_stacked(w_g), d.gpu_layout(), da_g, opts());
        Tensor da = da_g.to(Device::cpu());
        Tensor da_used = make_tensor({used, K}, out), da_ref_used = make_tensor({used, K}, out);
        std::memcpy(da_used.data(), da.data(), da_used.nbytes());
        std::memcpy(da_ref_used.data(), da_ref.data(), da_ref_used.nbytes());
        EXPECT_LE(rel_error(da_used, da_ref_used), gemm_tolerance(out));
      }
      // wgrad, both beta = 0 and beta = 1, pointer-array output
      Tensor dw_ref = make_tensor({E, N, K}, DType::kFloat32);
      fill_random(dw_ref, seed++);
      Tensor dw_init = dw_ref.to(Device::cpu());
      grouped_gemm_wgrad(dc, a, d.cpu_layout(), GroupedWeights::from_stacked(dw_ref), true);
      Tensor dw_g = dw_init.to(kGpu);
      Tensor ptrs = make_tensor({E}, DType::kInt64);
      for (int64_t e = 0; e < E; ++e)
        ptrs.data_ptr<int64_t>()[e] = reinterpret_cast<int64_t>(dw_g.data_ptr<float>() + e * N * K);
      Tensor ptrs_g = ptrs.to(kGpu);
      grouped_gemm_wgrad(dc_g, a_g, d.gpu_layout(),
                         GroupedWeights::from_pointers(ptrs_g, DType::kFloat32, N, K), true,
                         opts());
      EXPECT_LE(rel_error(dw_g.to(Device::cpu()), dw_ref), gemm_tolerance(DType::kFloat32));
      // beta = 1 into stacked dW (the TMA reduce-add epilogue on Hopper)
      Tensor dws_g = dw_init.to(kGpu);
      grouped_gemm_wgrad(dc_g, a_g, d.gpu_layout(), GroupedWeights::from_stacked(dws_g), true,
                         opts());
      EXPECT_LE(rel_error(dws_g.to(Device::cpu()), dw_ref), gemm_tolerance(DType::kFloat32));
      Tensor dw0_ref = make_tensor({E, N, K}, DType::kFloat32);
      grouped_gemm_wgrad(dc, a, d.cpu_layout(), GroupedWeights::from_stacked(dw0_ref), false);
      Tensor dw0_g = poisoned_gpu({E, N, K}, DType::kFloat32);
      grouped_gemm_wgrad(dc_g, a_g, d.gpu_layout(), GroupedWeights::from_stacked(dw0_g), false,
                         opts());
      EXPECT_LE(rel_error(dw0_g.to(Device::cpu()), dw0_ref), gemm_tolerance(DType::kFloat32));
      // beta = 0 into pointer-array dW (masked stores)
      fill_bytes(dw_g, 0xFF);
      grouped_gemm_wgrad(dc_g, a_g, d.gpu_layout(),
                         GroupedWeights::from_pointers(ptrs_g, DType::kFloat32, N, K), false,
                         opts());
      EXPECT_LE(rel_error(dw_g.to(Device::cpu()), dw0_ref), gemm_tolerance(DType::kFloat32));
    }
  }
}

// The host rounding of a float32 tensor to dt (round to nearest even, as the kernels).
Tensor rounded_to(const Tensor& f32, DType dt) {
  Tensor r = make_tensor(f32.sizes(), dt);
  for (int64_t i = 0; i < f32.numel(); ++i)
    detail::store_float(r.data(), dt, i, f32.data_ptr<float>()[i]);
  return r;
}

// E separate device tensors [N,K] of dtype dt (poisoned) and their pointer table.
struct SeparateDw {
  std::vector<Tensor> parts;
  Tensor ptrs_g;
  GroupedWeights weights(DType dt, int64_t n, int64_t k) const {
    return GroupedWeights::from_pointers(ptrs_g, dt, n, k);
  }
  // Sets every part from a host [E,N,K] tensor.
  void set(const Tensor& host) {
    const size_t bytes = parts[0].nbytes();
    for (size_t e = 0; e < parts.size(); ++e)
      MOEFLOW_CUDA_CHECK(cudaMemcpy(parts[e].data(),
                                    static_cast<const uint8_t*>(host.data()) + e * bytes, bytes,
                                    cudaMemcpyHostToDevice));
  }
  // The parts, back into one host [E,N,K] tensor.
  Tensor gather(DType dt) const {
    const int64_t E = parts.size(), n = parts[0].size(0), k = parts[0].size(1);
    Tensor out = make_tensor({E, n, k}, dt);
    const size_t bytes = parts[0].nbytes();
    for (int64_t e = 0; e < E; ++e)
      MOEFLOW_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(out.data()) + e * bytes, parts[e].data(),
                                    bytes, cudaMemcpyDeviceToHost));
    return out;
  }
};
SeparateDw separate_dw(int64_t E, int64_t n, int64_t k, DType dt) {
  SeparateDw s;
  Tensor ptrs = make_tensor({E}, DType::kInt64);
  for (int64_t e = 0; e < E; ++e) {
    s.parts.push_back(poisoned_gpu({n, k}, dt));
    ptrs.data_ptr<int64_t>()[e] = reinterpret_cast<int64_t>(s.parts.back().data());
  }
  s.ptrs_g = ptrs.to(kGpu);
  return s;
}

// wgrad into a bf16 / fp16 dW (the inputs' dtype) equals, bitwise, the same
// kernel's float32 dW rounded once (the same accumulation; one rounding in
// the epilogue): stacked and pointer dW, beta = 0 into poisoned outputs (an
// unwritten tile stays NaN) and beta = 1 (dW + that rounded result, rounded
// again: the TMA reduce-add, autograd's grad += g; the stacked dW's reduce
// is done by the L2, the pointer dW's add by the SMs); empty groups, pad
// rows (with garbage in them) and rows past the groups.
TEST_P(GpuGemm, WgradHalfPrecisionDwIsFloat32Rounded) {
  uint32_t seed = 500;
  for (const Problem& p : kProblems) {
    for (DType in : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(name_of(p) + " " + dtype_name(in));
      const int64_t E = p.seg.size(), K = p.k, N = p.n;
      Data d = make_data(p);
      Tensor a = make_tensor({d.rows, K}, in), dc = make_tensor({d.rows, N}, in);
      fill_random(a, seed++);
      fill_random(dc, seed++);
      Tensor a_g = a.to(kGpu), dc_g = dc.to(kGpu);
      const GroupLayout layout = d.gpu_layout();
      // beta = 0
      Tensor dw32_g = poisoned_gpu({E, N, K}, DType::kFloat32);
      grouped_gemm_wgrad(dc_g, a_g, layout, GroupedWeights::from_stacked(dw32_g), false, opts());
      const Tensor dw32 = dw32_g.to(Device::cpu());
      for (int64_t i = 0; i < dw32.numel(); ++i)
        ASSERT_FALSE(std::isnan(dw32.data_ptr<float>()[i])) << "float32 dW element " << i;
      const Tensor want = rounded_to(dw32, in);
      Tensor dwh_g = poisoned_gpu({E, N, K}, in);
      grouped_gemm_wgrad(dc_g, a_g, layout, GroupedWeights::from_stacked(dwh_g), false, opts());
      const Tensor dwh = dwh_g.to(Device::cpu());
      EXPECT_TRUE(bytes_equal(dwh, want)) << "stacked, beta = 0";
      for (int64_t e = 0; e < E; ++e)  // groups without data rows: zeros
        if (p.real[e] == 0)
          for (int64_t i = e * N * K; i < (e + 1) * N * K; ++i)
            ASSERT_EQ(reinterpret_cast<const uint16_t*>(dwh.data())[i], 0) << "expert " << e;
      SeparateDw sep = separate_dw(E, N, K, in);
      grouped_gemm_wgrad(dc_g, a_g, layout, sep.weights(in, N, K), false, opts());
      EXPECT_TRUE(bytes_equal(sep.gather(in), want)) << "pointers, beta = 0";
      // beta = 1
      Tensor init = make_tensor({E, N, K}, in);
      fill_random(init, seed++);
      Tensor init32 = make_tensor({E, N, K}, DType::kFloat32);
      for (int64_t i = 0; i < init.numel(); ++i) init32.data_ptr<float>()[i] = at(init, i);
      for (int64_t i = 0; i < init.numel(); ++i)
        init32.data_ptr<float>()[i] += at(want, i);  // float32, then rounded to dW's dtype
      const Tensor want_acc = rounded_to(init32, in);
      Tensor acch_g = init.to(kGpu);
      grouped_gemm_wgrad(dc_g, a_g, layout, GroupedWeights::from_stacked(acch_g), true, opts());
      EXPECT_TRUE(bytes_equal(acch_g.to(Device::cpu()), want_acc)) << "stacked, beta = 1";
      sep.set(init);
      grouped_gemm_wgrad(dc_g, a_g, layout, sep.weights(in, N, K), true, opts());
      EXPECT_TRUE(bytes_equal(sep.gather(in), want_acc)) << "pointers, beta = 1";
    }
  }
}

// The same three ops against a per-expert cuBLAS loop (bf16 in, fp32 compute).
TEST_P(GpuGemm, MatchesPerExpertCublas) {
  cublasHandle_t h;
  CUBLAS_OK(cublasCreate(&h));
  Problem p = random_problem(12, 1500, 768, 1024, 77, 16);  // cuBLAS only: no CPU reference
  const int64_t E = p.seg.size(), K = p.k, N = p.n;
  Data d = make_data(p);
  Tensor a = make_tensor({d.rows, K}, DType::kBFloat16),
         dc = make_tensor({d.rows, N}, DType::kBFloat16);
  Tensor w = make_tensor({E, N, K}, DType::kBFloat16);
  fill_random(a, 1);
  fill_random(dc, 2);
  fill_random(w, 3);
  zero_non_data_rows(a, p, d);
  zero_non_data_rows(dc, p, d);
  Tensor a_g = a.to(kGpu), dc_g = dc.to(kGpu), w_g = w.to(kGpu);
  Tensor c_ours = poisoned_gpu({d.rows, N}, DType::kBFloat16),
         c_ref = Tensor::zeros({d.rows, N}, DType::kBFloat16, kGpu);
  Tensor da_ours = poisoned_gpu({d.rows, K}, DType::kBFloat16),
         da_ref = Tensor::zeros({d.rows, K}, DType::kBFloat16, kGpu);
  Tensor dw_ours = poisoned_gpu({E, N, K}, DType::kFloat32),
         dw_ref = Tensor::zeros({E, N, K}, DType::kFloat32, kGpu);
  grouped_gemm_forward(a_g, GroupedWeights::from_stacked(w_g), d.gpu_layout(), c_ours, opts());
  grouped_gemm_dgrad(dc_g, GroupedWeights::from_stacked(w_g), d.gpu_layout(), da_ours, opts());
  grouped_gemm_wgrad(dc_g, a_g, d.gpu_layout(), GroupedWeights::from_stacked(dw_ours), false,
                     opts());
  const float one = 1.0f, zero = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = d.offsets.data_ptr<int64_t>()[e];
    const int rows_e = p.real[e];
    const auto* we = w_g.data_ptr<__nv_bfloat16>() + e * N * K;
    if (rows_e > 0) {
      CUBLAS_OK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, rows_e, K, &one, we, CUDA_R_16BF, K,
                             a_g.data_ptr<__nv_bfloat16>() + r0 * K, CUDA_R_16BF, K, &zero,
                             c_ref.data_ptr<__nv_bfloat16>() + r0 * N, CUDA_R_16BF, N,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      CUBLAS_OK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, K, rows_e, N, &one, we, CUDA_R_16BF, K,
                             dc_g.data_ptr<__nv_bfloat16>() + r0 * N, CUDA_R_16BF, N, &zero,
                             da_ref.data_ptr<__nv_bfloat16>() + r0 * K, CUDA_R_16BF, K,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    CUBLAS_OK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, K, N, rows_e, &one,
                           a_g.data_ptr<__nv_bfloat16>() + r0 * K, CUDA_R_16BF, K,
                           dc_g.data_ptr<__nv_bfloat16>() + r0 * N, CUDA_R_16BF, N, &zero,
                           dw_ref.data_ptr<float>() + e * N * K, CUDA_R_32F, K, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT));
  }
  MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  const int64_t used = d.rows - p.tail;
  auto head = [&](const Tensor& t, int64_t cols) {
    Tensor h = make_tensor({used, cols}, t.dtype());
    MOEFLOW_CUDA_CHECK(cudaMemcpy(h.data(), t.data(), h.nbytes(), cudaMemcpyDeviceToHost));
    return h;
  };
  EXPECT_LE(rel_error(head(c_ours, N), head(c_ref, N)), gemm_tolerance(DType::kBFloat16));
  EXPECT_LE(rel_error(head(da_ours, K), head(da_ref, K)), gemm_tolerance(DType::kBFloat16));
  EXPECT_LE(rel_error(dw_ours.to(Device::cpu()), dw_ref.to(Device::cpu())),
            gemm_tolerance(DType::kFloat32));
  cublasDestroy(h);
}

// Weights given as E separate tensors (device pointer array): forward and
// dgrad against the CPU reference (these take the non-TMA kernels).
TEST_P(GpuGemm, PointerArrayWeights) {
  Problem p = random_problem(6, 400, 256, 320, 91, 16);
  const int64_t E = p.seg.size(), K = p.k, N = p.n;
  Data d = make_data(p);
  Tensor a = make_tensor({d.rows, K}, DType::kBFloat16),
         dc = make_tensor({d.rows, N}, DType::kBFloat16);
  Tensor w = make_tensor({E, N, K}, DType::kBFloat16);
  fill_random(a, 11);
  fill_random(dc, 12);
  fill_random(w, 13);
  std::vector<Tensor> parts;
  Tensor ptrs = make_tensor({E}, DType::kInt64);
  for (int64_t e = 0; e < E; ++e) {
    Tensor part = make_tensor({N, K}, DType::kBFloat16);
    std::memcpy(part.data(), static_cast<uint8_t*>(w.data()) + e * N * K * 2, N * K * 2);
    parts.push_back(part.to(kGpu));
    ptrs.data_ptr<int64_t>()[e] = reinterpret_cast<int64_t>(parts.back().data());
  }
  Tensor ptrs_g = ptrs.to(kGpu);
  const auto wp = GroupedWeights::from_pointers(ptrs_g, DType::kBFloat16, N, K);
  Tensor c_ref = make_tensor({d.rows, N}, DType::kFloat32),
         da_ref = make_tensor({d.rows, K}, DType::kFloat32);
  grouped_gemm_forward(a, GroupedWeights::from_stacked(w), d.cpu_layout(), c_ref);
  grouped_gemm_dgrad(dc, GroupedWeights::from_stacked(w), d.cpu_layout(), da_ref);
  Tensor a_g = a.to(kGpu), dc_g = dc.to(kGpu);
  Tensor c_g = poisoned_gpu({d.rows, N}, DType::kFloat32),
         da_g = poisoned_gpu({d.rows, K}, DType::kFloat32);
  grouped_gemm_forward(a_g, wp, d.gpu_layout(), c_g, opts());
  grouped_gemm_dgrad(dc_g, wp, d.gpu_layout(), da_g, opts());
  const int64_t used = d.rows - p.tail;
  auto head = [&](const Tensor& t, int64_t cols) {
    Tensor h = make_tensor({used, cols}, t.dtype());
    MOEFLOW_CUDA_CHECK(cudaMemcpy(h.data(), t.data(), h.nbytes(), cudaMemcpyDefault));
    return h;
  };
  EXPECT_LE(rel_error(head(c_g, N), head(c_ref, N)), gemm_tolerance(DType::kFloat32));
  EXPECT_LE(rel_error(head(da_g, K), head(da_ref, K)), gemm_tolerance(DType::kFloat32));
}

// Forward captured once in a CUDA graph; replays with new offsets (same
// buffers) must equal eager runs.
TEST_P(GpuGemm, GraphReplayWithNewOffsets) {
  const int64_t E = 8, K = 256, N = 384, rows = 4096;
  Tensor a = make_tensor({rows, K}, DType::kBFloat16), w = make_tensor({E, N, K}, DType::kBFloat16);
  fill_random(a, 5);
  fill_random(w, 6);
  Tensor a_g = a.to(kGpu), w_g = w.to(kGpu);
  Tensor offs_g = Tensor::empty({E + 1}, DType::kInt64, kGpu),
         real_g = Tensor::empty({E}, DType::kInt32, kGpu);
  GroupLayout layout;
  layout.offsets = offs_g;
  layout.real_rows = real_g;
  Tensor c_g = Tensor::empty({rows, N}, DType::kBFloat16, kGpu);
  cudaStream_t s;
  MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Problem p0 = random_problem(E, 400, K, N, 1);
  Data d0 = make_data(p0);
  copy(d0.offsets, offs_g, s);
  copy(d0.real, real_g, s);
  grouped_gemm_forward(a_g, GroupedWeights::from_stacked(w_g), layout, c_g, opts(), s);  // warm-up
  MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  grouped_gemm_forward(a_g, GroupedWeights::from_stacked(w_g), layout, c_g, opts(), s);
  MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    Problem p = random_problem(E, 500, K, N, 100 + replay, replay == 2 ? 128 : 16);
    Data d = make_data(p);
    ASSERT_LE(d.rows, rows);
    copy(d.offsets, offs_g, s);
    copy(d.real, real_g, s);
    fill_bytes(c_g, 0xFF, s);
    MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(s));
    Tensor eager = poisoned_gpu({rows, N}, DType::kBFloat16);
    grouped_gemm_forward(a_g, GroupedWeights::from_stacked(w_g), d.gpu_layout(), eager, opts());
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(bytes_equal(c_g.to(Device::cpu()), eager.to(Device::cpu()))) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// Bad offsets: flagged in groups.error, bad groups skipped, nothing out of
// bounds (run under compute-sanitizer memcheck), good groups still right.
TEST_P(GpuGemm, BadOffsetsAreFlaggedAndClamped) {
  const int64_t E = 3, K = 64, N = 64, rows = 300;
  Tensor a = make_tensor({rows, K}, DType::kBFloat16), w = make_tensor({E, N, K}, DType::kBFloat16);
  fill_random(a, 7);
  fill_random(w, 8);
  Tensor offs = make_tensor({E + 1}, DType::kInt64);
  int64_t vals[] = {0, 100, 90, 5000};  // group 1 not monotone, group 2 past the rows
  std::copy(vals, vals + 4, offs.data_ptr<int64_t>());
  GroupLayout layout;
  Tensor offs_g = offs.to(kGpu);  // NOTE: views do not own: keep the tensor alive
  layout.offsets = offs_g;
  Tensor err = Tensor::zeros({1}, DType::kInt32, kGpu);
  layout.error = err;
  Tensor c_g = poisoned_gpu({rows, N}, DType::kFloat32);
  Tensor a_g = a.to(kGpu), w_g = w.to(kGpu);
  grouped_gemm_forward(a_g, GroupedWeights::from_stacked(w_g), layout, c_g, opts());
  EXPECT_EQ(to_vec<int32_t>(err)[0], 1);
  // group 0 (rows 0..99) is still right
  Tensor ok_offs = make_tensor({2}, DType::kInt64);
  ok_offs.data_ptr<int64_t>()[0] = 0;
  ok_offs.data_ptr<int64_t>()[1] = 100;
  GroupLayout ok;
  ok.offsets = ok_offs;
  Tensor a100 = make_tensor({100, K}, DType::kBFloat16);
  std::memcpy(a100.data(), a.data(), a100.nbytes());
  Tensor w0 = make_tensor({1, N, K}, DType::kBFloat16);
  std::memcpy(w0.data(), w.data(), w0.nbytes());
  Tensor ref = make_tensor({100, N}, DType::kFloat32);
  grouped_gemm_forward(a100, GroupedWeights::from_stacked(w0), ok, ref);
  Tensor got = make_tensor({100, N}, DType::kFloat32);
  MOEFLOW_CUDA_CHECK(cudaMemcpy(got.data(), c_g.data(), got.nbytes(), cudaMemcpyDeviceToHost));
  EXPECT_LE(rel_error(got, ref), gemm_tolerance(DType::kFloat32));
}

// Gathered A rows (grouped_gemm_forward_gathered): the forward over a row map into a
// smaller source matrix equals, bitwise, the forward over the gathered
// matrix (the same kernel and accumulation order); -1 rows are zeros; the
// tail past the groups keeps its poison.
TEST(GpuGemmGather, GatheredRowsEqualContiguous) {
  ASSERT_GT(cuda_device_count(), 0);
  if (!is_hopper()) GTEST_SKIP() << "gathered A rows run on Hopper only";
  uint32_t seed = 70;
  for (const Problem& pr : kProblems) {
    if (pr.k % 8 != 0) continue;
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(name_of(pr) + " " + dtype_name(dt));
      const Data d = make_data(pr);
      const int64_t E = pr.seg.size(), K = pr.k, N = pr.n;
      const int64_t src_rows = std::max<int64_t>(1, d.rows / 3 + 7);
      Tensor src = make_tensor({src_rows, K}, dt), w = make_tensor({E, N, K}, dt);
      fill_random(src, seed++);
      fill_random(w, seed++);
      std::mt19937 rng(seed++);
      Tensor map = make_tensor({d.rows}, DType::kInt32);
      Tensor a = make_tensor({d.rows, K}, dt);
      for (int64_t r = 0; r < d.rows; ++r) {
        int32_t m =
            std::uniform_int_distribution<int32_t>(-1, static_cast<int32_t>(src_rows) - 1)(rng);
        if (r % 11 == 3) m = -1;
        // entries past the source rows read as zero rows
        if (r % 13 == 5) m = static_cast<int32_t>(src_rows + r % 3);
        map.data_ptr<int32_t>()[r] = m;
        const bool zero = m < 0 || m >= src_rows;
        for (int64_t j = 0; j < K; ++j)
          detail::store_float(a.data(), dt, r * K + j,
                              zero ? 0.0f : detail::load_float(src.data(), dt, m * K + j));
      }
      Tensor src_g = src.to(kGpu), a_g = a.to(kGpu), w_g = w.to(kGpu), map_g = map.to(kGpu);
      Tensor want = poisoned_gpu({d.rows, N}, dt), got = poisoned_gpu({d.rows, N}, dt);
      const GroupedWeights wg = GroupedWeights::from_stacked(w_g);
      grouped_gemm_forward(a_g, wg, d.gpu_layout(), want);
      grouped_gemm_forward_gathered(src_g, map_g, wg, d.gpu_layout(), got);
      MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
      Tensor want_h = want.to(Device::cpu()), got_h = got.to(Device::cpu());
      ASSERT_EQ(std::memcmp(want_h.data(), got_h.data(), want_h.nbytes()), 0)
          << "gathered forward differs from the contiguous forward";
    }
  }
  // bad input: a row map of the wrong length
  const Problem& pr = kProblems[1];
  const Data d = make_data(pr);
  Tensor w_g = Tensor::empty({2, pr.n, pr.k}, DType::kBFloat16, kGpu);
  Tensor a_g = Tensor::empty({8, pr.k}, DType::kBFloat16, kGpu);
  Tensor out_g = Tensor::empty({d.rows, pr.n}, DType::kBFloat16, kGpu);
  Tensor map_g = Tensor::empty({d.rows - 1}, DType::kInt32, kGpu);
  EXPECT_THROW(grouped_gemm_forward_gathered(a_g, map_g, GroupedWeights::from_stacked(w_g),
                                             d.gpu_layout(), out_g),
               Error);
}

INSTANTIATE_TEST_SUITE_P(
    Paths, GpuGemm,
    ::testing::Values(PathCase{GemmKernel::kAuto, -1, -1, "Auto"},
                      PathCase{GemmKernel::kAuto, 3, 2, "TmaStaggered"},
                      PathCase{GemmKernel::kSm90CpAsync, -1, -1, "Sm90CpAsync"},
                      PathCase{GemmKernel::kSm90Narrow, -1, -1, "Sm90Narrow"},
                      PathCase{GemmKernel::kPortable, -1, -1, "Portable"},
                      PathCase{GemmKernel::kTmaDirectStore, -1, -1, "TmaDirectStore"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace moeflow::test
