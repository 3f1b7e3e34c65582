// CPU grouped GEMM tests: hand-worked values, the adjoint identities that tie
// forward, dgrad and wgrad together, pad rows, empty groups, pointer-array
// weights, accumulation, bf16 / fp16 weight gradients, bad input.
#include "test_util.h"

namespace moeflow::test {
namespace {

struct Groups {
  Tensor offsets, real;
  GroupLayout layout() const {
    GroupLayout g;
    g.offsets = offsets;
    if (real.defined()) g.real_rows = real;
    return g;
  }
};

Groups make_groups(const std::vector<int64_t>& seg_rows, const std::vector<int32_t>& real = {}) {
  Groups g;
  g.offsets = make_tensor({static_cast<int64_t>(seg_rows.size()) + 1}, DType::kInt64);
  int64_t o = 0;
  for (size_t e = 0; e <= seg_rows.size(); ++e) {
    g.offsets.data_ptr<int64_t>()[e] = o;
    if (e < seg_rows.size()) o += seg_rows[e];
  }
  if (!real.empty()) {
    g.real = make_tensor({static_cast<int64_t>(real.size())}, DType::kInt32);
    std::copy(real.begin(), real.end(), g.real.data_ptr<int32_t>());
  }
  return g;
}

double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += double(at(a, i)) * at(b, i);
  return s;
}

TEST(GroupedGemm, HandWorkedForward) {
  // 2 groups: rows 0..2 -> W0, rows 3..4 -> W1. K = N = 8.
  const int64_t K = 8, N = 8;
  Groups g = make_groups({3, 2});
  Tensor a = make_tensor({5, K}, DType::kBFloat16);
  Tensor w = make_tensor({2, N, K}, DType::kBFloat16);
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t k = 0; k < K; ++k)
      detail::store_float(a.data(), a.dtype(), r * K + k, float(r + 1));
  for (int64_t e = 0; e < 2; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        detail::store_float(w.data(), w.dtype(), (e * N + n) * K + k,
                            e == 0 ? float(n) : (k == n ? 1.0f : 0.0f));
  Tensor c = make_tensor({5, N}, DType::kFloat32);
  grouped_gemm_forward(a, GroupedWeights::from_stacked(w), g.layout(), c);
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t n = 0; n < N; ++n)
      EXPECT_EQ(c.data_ptr<float>()[r * N + n], float((r + 1) * n * K));
  for (int64_t r = 3; r < 5; ++r)  // W1 = identity
    for (int64_t n = 0; n < N; ++n) EXPECT_EQ(c.data_ptr<float>()[r * N + n], float(r + 1));
}

// <fwd(A), G> = <A, dgrad(G)> = sum_e <W_e, wgrad(G, A)_e>, with pad rows,
// empty groups and a tail of rows past offsets[E] that must stay untouched.
TEST(GroupedGemm, AdjointIdentitiesTieTheThreeOps) {
  const int64_t K = 24, N = 40, rows = 64;
  Groups g = make_groups({16, 0, 7, 32}, {13, 0, 7, 30});  // 55 rows used, 9 past the end
  Tensor a = make_tensor({rows, K}, DType::kBFloat16);
  fill_random(a, 1);
  Tensor gr = make_tensor({rows, N}, DType::kBFloat16);
  fill_random(gr, 2);
  Tensor w = make_tensor({4, N, K}, DType::kBFloat16);
  fill_random(w, 3);
  // zero the pad rows and the tail of the inputs so the identities hold exactly
  auto offs = to_vec<int64_t>(g.offsets);
  auto real = to_vec<int32_t>(g.real);
  auto zero_rows = [&](Tensor& t, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) {
      bool data = false;
      for (int e = 0; e < 4; ++e) data = data || (r >= offs[e] && r < offs[e] + real[e]);
      if (!data)
        for (int64_t j = 0; j < cols; ++j)
          detail::store_float(t.data(), t.dtype(), r * cols + j, 0.0f);
    }
  };
  zero_rows(a, K);
  zero_rows(gr, N);
  Tensor c = make_tensor({rows, N}, DType::kFloat32);
  fill_bytes(c, 0x7F);
  Tensor da = make_tensor({rows, K}, DType::kFloat32);
  fill_bytes(da, 0x7F);
  Tensor dw = make_tensor({4, N, K}, DType::kFloat32);
  fill_bytes(dw, 0x7F);
  const GroupLayout layout = g.layout();
  grouped_gemm_forward(a, GroupedWeights::from_stacked(w), layout, c);
  grouped_gemm_dgrad(gr, GroupedWeights::from_stacked(w), layout, da);
  grouped_gemm_wgrad(gr, a, layout, GroupedWeights::from_stacked(dw), false);
  // rows past offsets[E] untouched; pad rows zero
  for (int64_t r = 55; r < rows; ++r)
    EXPECT_EQ(reinterpret_cast<uint32_t*>(c.data())[r * N], 0x7F7F7F7Fu);
  for (int64_t r = 13; r < 16; ++r) EXPECT_EQ(c.data_ptr<float>()[r * N + 5], 0.0f);
  for (int64_t r = 53; r < 55; ++r) EXPECT_EQ(da.data_ptr<float>()[r * K + 3], 0.0f);
  Tensor c_used = make_tensor({55, N}, DType::kFloat32),
         gr_used = make_tensor({55, N}, DType::kFloat32);
  Tensor da_used = make_tensor({55, K}, DType::kFloat32),
         a_used = make_tensor({55, K}, DType::kFloat32);
  for (int64_t i = 0; i < 55 * N; ++i) {
    c_used.data_ptr<float>()[i] = c.data_ptr<float>()[i];
    gr_used.data_ptr<float>()[i] = at(gr, i);
  }
  for (int64_t i = 0; i < 55 * K; ++i) {
    da_used.data_ptr<float>()[i] = da.data_ptr<float>()[i];
    a_used.data_ptr<float>()[i] = at(a, i);
  }
  const double l1 = dot(c_used, gr_used), l2 = dot(a_used, da_used), l3 = dot(w, dw);
  EXPECT_NEAR(l1, l2, 1e-4 * (1 + std::fabs(l1)));
  EXPECT_NEAR(l1, l3, 1e-4 * (1 + std::fabs(l1)));
  // empty group: zero gradient
  for (int64_t i = N * K; i < 2 * N * K; ++i) ASSERT_EQ(dw.data_ptr<float>()[i], 0.0f);
}

// The forward over gathered rows equals, bitwise, the forward over the
// gathered matrix; -1 and out-of-range entries read zero rows.
TEST(GroupedGemm, GatheredRowsEqualContiguous) {
  const int64_t K = 24, N = 16, src_rows = 7;
  Groups g = make_groups({5, 0, 9}, {4, 0, 9});
  const int64_t rows = 14;
  Tensor src = make_tensor({src_rows, K}, DType::kBFloat16),
         w = make_tensor({3, N, K}, DType::kBFloat16);
  fill_random(src, 11);
  fill_random(w, 12);
  Tensor map = make_tensor({rows}, DType::kInt32), a = make_tensor({rows, K}, DType::kBFloat16);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t m = r % 5 == 3   ? -1
                      : r % 7 == 6 ? static_cast<int32_t>(src_rows + 2)
                                   : static_cast<int32_t>((r * 3) % src_rows);
    map.data_ptr<int32_t>()[r] = m;
    for (int64_t j = 0; j < K; ++j)
      detail::store_float(a.data(), DType::kBFloat16, r * K + j,
                          m < 0 || m >= src_rows
                              ? 0.0f
                              : detail::load_float(src.data(), DType::kBFloat16, m * K + j));
  }
  Tensor want = make_tensor({rows, N}, DType::kBFloat16),
         got = make_tensor({rows, N}, DType::kBFloat16);
  grouped_gemm_forward(a, GroupedWeights::from_stacked(w), g.layout(), want);
  grouped_gemm_forward_gathered(src, map, GroupedWeights::from_stacked(w), g.layout(), got);
  EXPECT_TRUE(bytes_equal(got, want));
  // the output must have a's dtype; the map one int32 entry per row
  Tensor got32 = make_tensor({rows, N}, DType::kFloat32);
  EXPECT_THROW(
      grouped_gemm_forward_gathered(src, map, GroupedWeights::from_stacked(w), g.layout(), got32),
      Error);
  Tensor short_map = make_tensor({rows - 1}, DType::kInt32);
  EXPECT_THROW(grouped_gemm_forward_gathered(src, short_map, GroupedWeights::from_stacked(w),
                                             g.layout(), got),
               Error);
}

TEST(GroupedGemm, WgradIgnoresPadRowsAndAccumulates) {
  const int64_t K = 16, N = 8, rows = 32;
  Groups g = make_groups({16, 16}, {10, 16});
  Tensor a = make_tensor({rows, K}, DType::kBFloat16),
         dc = make_tensor({rows, N}, DType::kBFloat16);
  fill_random(a, 4);
  fill_random(dc, 5);
  Tensor dw1 = Tensor::zeros({2, N, K}, DType::kFloat32);
  grouped_gemm_wgrad(dc, a, g.layout(), GroupedWeights::from_stacked(dw1), false);
  for (int64_t r = 10; r < 16; ++r)  // garbage in group 0's pad rows must not matter
    for (int64_t k = 0; k < K; ++k) detail::store_float(a.data(), a.dtype(), r * K + k, 1000.0f);
  Tensor dw2 = make_tensor({2, N, K}, DType::kFloat32);
  for (int64_t i = 0; i < dw2.numel(); ++i) dw2.data_ptr<float>()[i] = 0.5f;
  grouped_gemm_wgrad(dc, a, g.layout(), GroupedWeights::from_stacked(dw2), true);
  for (int64_t i = 0; i < dw2.numel(); ++i)
    ASSERT_FLOAT_EQ(dw2.data_ptr<float>()[i], dw1.data_ptr<float>()[i] + 0.5f);
}

// A bf16 / fp16 dW is the float32 dW rounded once, bitwise (stacked and
// pointer dW, pad rows, empty groups; accumulate: float(dW) + that rounded
// result, rounded again, as autograd's grad += g).
TEST(GroupedGemm, WgradHalfPrecisionDwIsFloat32Rounded) {
  const int64_t K = 24, N = 40, rows = 64;
  Groups g = make_groups({16, 0, 7, 32, 0}, {13, 0, 7, 30, 0});  // rows 55..63 past the end
  const int64_t E = 5;
  uint32_t seed = 30;
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor a = make_tensor({rows, K}, dt), dc = make_tensor({rows, N}, dt);
    fill_random(a, seed++);
    fill_random(dc, seed++);
    // float32 dW, rounded on the host: the expected bytes
    auto rounded = [&](const Tensor& f32) {
      Tensor r = make_tensor(f32.sizes(), dt);
      for (int64_t i = 0; i < f32.numel(); ++i)
        detail::store_float(r.data(), dt, i, f32.data_ptr<float>()[i]);
      return r;
    };
    Tensor dw32 = make_tensor({E, N, K}, DType::kFloat32);
    fill_bytes(dw32, 0xFF);
    grouped_gemm_wgrad(dc, a, g.layout(), GroupedWeights::from_stacked(dw32), false);
    Tensor dwh = make_tensor({E, N, K}, dt);
    fill_bytes(dwh, 0xFF);
    grouped_gemm_wgrad(dc, a, g.layout(), GroupedWeights::from_stacked(dwh), false);
    EXPECT_TRUE(bytes_equal(dwh, rounded(dw32))) << "stacked";
    for (int64_t e : {1, 4})  // experts with no rows: zeros
      for (int64_t i = e * N * K; i < (e + 1) * N * K; ++i)
        ASSERT_EQ(reinterpret_cast<const uint16_t*>(dwh.data())[i], 0) << "expert " << e;
    // pointer dW (E separate tensors)
    std::vector<Tensor> parts;
    Tensor ptrs = make_tensor({E}, DType::kInt64);
    for (int64_t e = 0; e < E; ++e) {
      parts.push_back(make_tensor({N, K}, dt));
      fill_bytes(parts.back(), 0xFF);
      ptrs.data_ptr<int64_t>()[e] = reinterpret_cast<int64_t>(parts.back().data());
    }
    grouped_gemm_wgrad(dc, a, g.layout(), GroupedWeights::from_pointers(ptrs, dt, N, K), false);
    for (int64_t e = 0; e < E; ++e)
      ASSERT_EQ(std::memcmp(parts[e].data(), static_cast<uint8_t*>(dwh.data()) + e * N * K * 2,
                            N * K * 2),
                0)
          << "pointer dW, expert " << e;
    // accumulate: float(dW) + the rounded result, rounded (experts with no
    // rows add zeros)
    Tensor init = make_tensor({E, N, K}, dt);
    fill_random(init, seed++);
    Tensor acc32 = make_tensor({E, N, K}, DType::kFloat32);
    for (int64_t i = 0; i < init.numel(); ++i)
      acc32.data_ptr<float>()[i] = at(init, i) + at(dwh, i);
    Tensor acch = make_tensor({E, N, K}, dt);
    std::memcpy(acch.data(), init.data(), init.nbytes());
    grouped_gemm_wgrad(dc, a, g.layout(), GroupedWeights::from_stacked(acch), true);
    EXPECT_TRUE(bytes_equal(acch, rounded(acc32))) << "accumulate";
    // experts with no rows keep their values
    EXPECT_EQ(std::memcmp(static_cast<uint8_t*>(acch.data()) + N * K * 2,
                          static_cast<uint8_t*>(init.data()) + N * K * 2, N * K * 2),
              0);
    for (int64_t e = 0; e < E; ++e)
      std::memcpy(parts[e].data(), static_cast<uint8_t*>(init.data()) + e * N * K * 2, N * K * 2);
    grouped_gemm_wgrad(dc, a, g.layout(), GroupedWeights::from_pointers(ptrs, dt, N, K), true);
    for (int64_t e = 0; e < E; ++e)
      ASSERT_EQ(std::memcmp(parts[e].data(), static_cast<uint8_t*>(acch.data()) + e * N * K * 2,
                            N * K * 2),
                0)
          << "pointer dW accumulate, expert " << e;
  }
}

TEST(GroupedGemm, PointerArrayWeightsEqualStacked) {
  const int64_t K = 32, N = 16, rows = 50;
  Groups g = make_groups({20, 0, 30});
  Tensor a = make_tensor({rows, K}, DType::kFloat16);
  fill_random(a, 6);
  Tensor w = make_tensor({3, N, K}, DType::kFloat16);
  fill_random(w, 7);
  std::vector<Tensor> parts;
  Tensor ptrs = make_tensor({3}, DType::kInt64);
  for (int e = 0; e < 3; ++e) {
    parts.push_back(make_tensor({N, K}, DType::kFloat16));
    std::memcpy(parts.back().data(), static_cast<uint8_t*>(w.data()) + e * N * K * 2, N * K * 2);
    ptrs.data_ptr<int64_t>()[e] = reinterpret_cast<int64_t>(parts.back().data());
  }
  Tensor c1 = make_tensor({rows, N}, DType::kFloat16), c2 = make_tensor({rows, N}, DType::kFloat16);
  grouped_gemm_forward(a, GroupedWeights::from_stacked(w), g.layout(), c1);
  grouped_gemm_forward(a, GroupedWeights::from_pointers(ptrs, DType::kFloat16, N, K), g.layout(),
                       c2);
  EXPECT_TRUE(bytes_equal(c1, c2));
  // the same table from make_expert_table
  const ExpertTable t = make_expert_table({parts[0], parts[1], parts[2]});
  ASSERT_EQ(t.weights.num_groups(), 3);
  EXPECT_TRUE(bytes_equal(t.table, ptrs));
  Tensor c3 = make_tensor({rows, N}, DType::kFloat16);
  grouped_gemm_forward(a, t.weights, g.layout(), c3);
  EXPECT_TRUE(bytes_equal(c1, c3));
  // tensors that do not match the first are named
  Tensor odd = make_tensor({N, K + 8}, DType::kFloat16);
  EXPECT_NE(message_of([&] {
              make_expert_table({parts[0], odd});
            }).find("experts[1] must be float16 [16,32] on cpu as experts[0]"),
            std::string::npos);
  EXPECT_NE(message_of([&] { make_expert_table({}); }).find("at least one"), std::string::npos);
}

TEST(GroupedGemm, BadInputErrors) {
  const int64_t K = 16, N = 8, rows = 20;
  Tensor a = make_tensor({rows, K}, DType::kBFloat16);
  fill_random(a, 8);
  Tensor w = make_tensor({2, N, K}, DType::kBFloat16);
  fill_random(w, 9);
  Tensor c = make_tensor({rows, N}, DType::kBFloat16);
  Groups bad = make_groups({10, 5});
  bad.offsets.data_ptr<int64_t>()[1] = 16;
  bad.offsets.data_ptr<int64_t>()[2] = 12;  // not monotone
  EXPECT_NE(message_of([&] {
              grouped_gemm_forward(a, GroupedWeights::from_stacked(w), bad.layout(), c);
            }).find("groups.offsets must be monotone"),
            std::string::npos);
  Groups beyond = make_groups({10, 15});  // 25 > 20 rows
  EXPECT_NE(message_of([&] {
              grouped_gemm_forward(a, GroupedWeights::from_stacked(w), beyond.layout(), c);
            }).find("within [0, rows=20]"),
            std::string::npos);
  Groups ok = make_groups({10, 10});
  Tensor a12 = make_tensor({rows, 12}, DType::kBFloat16),
         w12 = make_tensor({2, N, 12}, DType::kBFloat16);
  EXPECT_NE(message_of([&] {
              grouped_gemm_forward(a12, GroupedWeights::from_stacked(w12), ok.layout(), c);
            }).find("multiples of 8 (16-byte rows), got N=8 K=12"),
            std::string::npos);
  Tensor wf = make_tensor({2, N, K}, DType::kFloat16);
  EXPECT_NE(message_of([&] {
              grouped_gemm_forward(a, GroupedWeights::from_stacked(wf), ok.layout(), c);
            }).find("w must be bfloat16 [2,8,16] on cpu, got float16"),
            std::string::npos);
  // dw: float32 or the inputs' dtype, stacked or pointers
  Tensor dwh = make_tensor({2, N, K}, DType::kFloat16);
  Tensor dc = make_tensor({rows, N}, DType::kBFloat16);
  EXPECT_NE(message_of([&] {
              grouped_gemm_wgrad(dc, a, ok.layout(), GroupedWeights::from_stacked(dwh), true);
            }).find("dw must be float32 or bfloat16 (the dtype of dc and a), got float16"),
            std::string::npos);
  Tensor dwi = make_tensor({2, N, K}, DType::kInt32);
  EXPECT_NE(message_of([&] {
              grouped_gemm_wgrad(dc, a, ok.layout(), GroupedWeights::from_stacked(dwi), false);
            }).find("dw must be float32 or bfloat16 (the dtype of dc and a), got int32"),
            std::string::npos);
  Tensor dwp = make_tensor({2}, DType::kInt64);
  dwp.data_ptr<int64_t>()[0] = dwp.data_ptr<int64_t>()[1] = reinterpret_cast<int64_t>(dwh.data());
  EXPECT_NE(message_of([&] {
              grouped_gemm_wgrad(dc, a, ok.layout(),
                                 GroupedWeights::from_pointers(dwp, DType::kFloat16, N, K), false);
            }).find("dw must be float32 or bfloat16 (the dtype of dc and a), got float16"),
            std::string::npos);
  Tensor dwb_short = make_tensor({2, N, K - 8}, DType::kBFloat16);
  EXPECT_NE(message_of([&] {
              grouped_gemm_wgrad(dc, a, ok.layout(), GroupedWeights::from_stacked(dwb_short),
                                 false);
            }).find("dw must be"),
            std::string::npos);
  Tensor offs3 = make_tensor({3}, DType::kInt32);
  GroupLayout l32;
  l32.offsets = offs3;
  EXPECT_NE(message_of([&] {
              grouped_gemm_forward(a, GroupedWeights::from_stacked(w), l32, c);
            }).find("groups.offsets must be int64 [3]"),
            std::string::npos);
}

// The FP8 forward's reference on a hand-worked case: codes 1.0 (0x38) and
// 2.0 (0x40), scales 0.5 and 0.25: each of the 128 products is 0.25, so every
// output is 32; the second group's pad row is zero.
TEST(GroupedGemmFp8, ReferenceHandWorked) {
  const int64_t K = 128, N = 128;
  Tensor qa = make_tensor({3, K}, DType::kFloat8E4M3), sa = make_tensor({3, 1}, DType::kFloat32);
  Tensor qw = make_tensor({2, N, K}, DType::kFloat8E4M3),
         sw = make_tensor({2, 1, 1}, DType::kFloat32);
  std::memset(qa.data(), 0x38, qa.nbytes());
  std::memset(qw.data(), 0x40, qw.nbytes());
  for (int i = 0; i < 3; ++i) sa.data_ptr<float>()[i] = 0.5f;
  sw.data_ptr<float>()[0] = 0.25f;
  sw.data_ptr<float>()[1] = 0.5f;  // group 1: products 0.5, outputs 64
  Tensor offs = make_tensor({3}, DType::kInt64), real = make_tensor({2}, DType::kInt32);
  int64_t* o = offs.data_ptr<int64_t>();
  o[0] = 0, o[1] = 1, o[2] = 3;
  real.data_ptr<int32_t>()[0] = 1;
  real.data_ptr<int32_t>()[1] = 1;
  GroupLayout g;
  g.offsets = offs;
  g.real_rows = real;
  Tensor c = poisoned({3, N}, DType::kBFloat16);
  grouped_gemm_fp8_forward(qa, sa, qw, sw, g, c);
  for (int64_t j = 0; j < N; ++j) {
    EXPECT_EQ(at(c, j), 32.0f);
    EXPECT_EQ(at(c, N + j), 64.0f);
    EXPECT_EQ(at(c, 2 * N + j), 0.0f);
  }
  // Bad input names the argument.
  Tensor qa_bf = make_tensor({3, K}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { grouped_gemm_fp8_forward(qa_bf, sa, qw, sw, g, c); }).find("a must be"),
            std::string::npos);
  Tensor sa_bad = make_tensor({3, 2}, DType::kFloat32);
  EXPECT_NE(message_of([&] { grouped_gemm_fp8_forward(qa, sa_bad, qw, sw, g, c); })
                .find("a_scales must be"),
            std::string::npos);
  Tensor qa_k = make_tensor({3, 96}, DType::kFloat8E4M3);
  EXPECT_NE(message_of([&] { grouped_gemm_fp8_forward(qa_k, sa, qw, sw, g, c); })
                .find("multiples of 128"),
            std::string::npos);
}

// Tensorwise scales ([1] each): the same hand-worked codes with a_scales
// 0.5 and w_scales 0.25 give 64 (256 products of 0.25) in every data row (both groups share the
// weight scale); a blockwise w_scales beside a tensorwise a_scales names
// w_scales.
TEST(GroupedGemmFp8, TensorwiseReferenceHandWorked) {
  const int64_t K = 256, N = 128;
  Tensor qa = make_tensor({3, K}, DType::kFloat8E4M3), sa = make_tensor({1}, DType::kFloat32);
  Tensor qw = make_tensor({2, N, K}, DType::kFloat8E4M3), sw = make_tensor({1}, DType::kFloat32);
  std::memset(qa.data(), 0x38, qa.nbytes());
  std::memset(qw.data(), 0x40, qw.nbytes());
  sa.data_ptr<float>()[0] = 0.5f;
  sw.data_ptr<float>()[0] = 0.25f;
  Tensor offs = make_tensor({3}, DType::kInt64), real = make_tensor({2}, DType::kInt32);
  int64_t* o = offs.data_ptr<int64_t>();
  o[0] = 0, o[1] = 1, o[2] = 3;
  real.data_ptr<int32_t>()[0] = 1;
  real.data_ptr<int32_t>()[1] = 1;
  GroupLayout g;
  g.offsets = offs;
  g.real_rows = real;
  Tensor c = poisoned({3, N}, DType::kBFloat16);
  grouped_gemm_fp8_forward(qa, sa, qw, sw, g, c);
  for (int64_t j = 0; j < N; ++j) {
    EXPECT_EQ(at(c, j), 64.0f);
    EXPECT_EQ(at(c, N + j), 64.0f);
    EXPECT_EQ(at(c, 2 * N + j), 0.0f);
  }
  Tensor sw_blocks = make_tensor({2, 1, 2}, DType::kFloat32);
  EXPECT_NE(message_of([&] {
              grouped_gemm_fp8_forward(qa, sa, qw, sw_blocks, g, c);
            }).find("w_scales must be"),
            std::string::npos);
  GemmOptions bad;
  bad.fp8_promote = -2;
  EXPECT_NE(
      message_of([&] { grouped_gemm_fp8_forward(qa, sa, qw, sw, g, c, bad); }).find("fp8_promote"),
      std::string::npos);
}

// The FP8 wgrad's reference on a hand-worked case: dC^T codes 1.0 (0x38) with
// scale 0.5, A^T codes 2.0 (0x40) with scale 0.25: each real row adds 0.25,
// so group 0 (3 real rows) gives 0.75 everywhere, group 1 (none) zeros, and
// accumulate adds to what dW holds.
TEST(GroupedGemmFp8, WgradReferenceHandWorked) {
  const int64_t N = 128, K = 128, rows = 256;
  Tensor dct = make_tensor({N, rows}, DType::kFloat8E4M3), dcs = make_tensor({N, 2}, DType::kFloat32);
  Tensor at_ = make_tensor({K, rows}, DType::kFloat8E4M3), as = make_tensor({K, 2}, DType::kFloat32);
  std::memset(dct.data(), 0x38, dct.nbytes());
  std::memset(at_.data(), 0x40, at_.nbytes());
  for (int64_t i = 0; i < N * 2; ++i) dcs.data_ptr<float>()[i] = 0.5f;
  for (int64_t i = 0; i < K * 2; ++i) as.data_ptr<float>()[i] = 0.25f;
  Tensor offs = make_tensor({3}, DType::kInt64), real = make_tensor({2}, DType::kInt32);
  int64_t* o = offs.data_ptr<int64_t>();
  o[0] = 0, o[1] = 128, o[2] = 256;
  real.data_ptr<int32_t>()[0] = 3;
  real.data_ptr<int32_t>()[1] = 0;
  GroupLayout g;
  g.offsets = offs;
  g.real_rows = real;
  Tensor dw = poisoned({2, N, K}, DType::kFloat32);
  grouped_gemm_fp8_wgrad(dct, dcs, at_, as, g, GroupedWeights::from_stacked(dw), false);
  for (int64_t i = 0; i < N * K; ++i) {
    ASSERT_EQ(at(dw, i), 0.75f);
    ASSERT_EQ(at(dw, N * K + i), 0.0f);
  }
  grouped_gemm_fp8_wgrad(dct, dcs, at_, as, g, GroupedWeights::from_stacked(dw), true);
  EXPECT_EQ(at(dw, 0), 1.5f);
  EXPECT_EQ(at(dw, N * K), 0.0f);
  // Bad input names the argument; a group off a scale block names the group.
  Tensor bf = make_tensor({N, rows}, DType::kBFloat16);
  EXPECT_NE(message_of([&] {
              grouped_gemm_fp8_wgrad(bf, dcs, at_, as, g, GroupedWeights::from_stacked(dw), false);
            }).find("dc_t must be"),
            std::string::npos);
  Tensor as_bad = make_tensor({K, 1}, DType::kFloat32);
  EXPECT_NE(message_of([&] {
              grouped_gemm_fp8_wgrad(dct, dcs, at_, as_bad, g, GroupedWeights::from_stacked(dw),
                                     false);
            }).find("a_t_scales must be"),
            std::string::npos);
  Tensor dct96 = make_tensor({96, rows}, DType::kFloat8E4M3);
  EXPECT_NE(message_of([&] {
              grouped_gemm_fp8_wgrad(dct96, dcs, at_, as, g, GroupedWeights::from_stacked(dw),
                                     false);
            }).find("multiples of 128"),
            std::string::npos);
  o[1] = 64;
  real.data_ptr<int32_t>()[1] = 5;
  EXPECT_NE(message_of([&] {
              grouped_gemm_fp8_wgrad(dct, dcs, at_, as, g, GroupedWeights::from_stacked(dw), false);
            }).find("group 1 starts at row 64"),
            std::string::npos);
  // Tensorwise scales ([1] each): the same group starting at row 64 is
  // fine: 5 real rows of 0.25 each give 1.25 (group 0 keeps 0.75).
  Tensor s1 = make_tensor({1}, DType::kFloat32), s2 = make_tensor({1}, DType::kFloat32);
  s1.data_ptr<float>()[0] = 0.5f;
  s2.data_ptr<float>()[0] = 0.25f;
  grouped_gemm_fp8_wgrad(dct, s1, at_, s2, g, GroupedWeights::from_stacked(dw), false);
  for (int64_t i = 0; i < N * K; ++i) {
    ASSERT_EQ(at(dw, i), 0.75f);
    ASSERT_EQ(at(dw, N * K + i), 1.25f);
  }
  EXPECT_NE(message_of([&] {
              grouped_gemm_fp8_wgrad(dct, s1, at_, as, g, GroupedWeights::from_stacked(dw), false);
            }).find("a_t_scales must be"),
            std::string::npos);
  o[1] = 72;  // not a multiple of 16
  EXPECT_NE(message_of([&] {
              grouped_gemm_fp8_wgrad(dct, s1, at_, s2, g, GroupedWeights::from_stacked(dw), false);
            }).find("group 1 starts at row 72, not a multiple of 16"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
