// CPU tests of quantize_rowwise_columnwise with 128x128 blocks (the expert
// weights both ways): each matrix of [G,M,K] quantized on its own block grid
// (quantize of the [M,K] matrix), W^T's codes equal to transpose_codes of
// W's and its scale grid to W's transposed, on partial edge blocks (M, K not
// multiples of 128), special values, strided rows; without the rowwise
// output; bad input named.
#include <cmath>
#include <cstring>

#include "test_util.h"

namespace moeflow::test {
namespace {

constexpr DType kE4 = DType::kFloat8E4M3;
constexpr DType kE5 = DType::kFloat8E5M2;

TensorView matrix(const Tensor& t, int64_t g, int64_t rows, int64_t cols) {
  const int64_t ld = t.size(2);
  return TensorView::strided(
      static_cast<uint8_t*>(t.data()) + g * rows * ld * dtype_size(t.dtype()), t.dtype(),
      t.device(), {rows, cols}, {ld, 1});
}

TensorView rows3(const Tensor& t, int64_t G, int64_t rows, int64_t cols) {
  return TensorView::strided(t.data(), t.dtype(), t.device(), {G, rows, cols},
                             {rows * t.size(2), t.size(2), 1});
}

TEST(QuantizeWeights, BothWaysIsPerMatrixQuantizeAndItsTranspose) {
  struct Case {
    int64_t G, M, K, x_pad, q_pad;
  };
  for (const Case& c : {Case{3, 256, 384, 0, 0}, Case{2, 130, 200, 8, 4}, Case{1, 1, 1, 0, 0},
                        Case{2, 64, 129, 3, 16}})
    for (DType dt : {DType::kBFloat16, DType::kFloat32})
      for (DType out : {kE4, kE5})
        for (bool pow2 : {false, true}) {
          SCOPED_TRACE(std::to_string(c.G) + "x" + std::to_string(c.M) + "x" + std::to_string(c.K) +
                       " " + dtype_name(dt) + " " + dtype_name(out));
          const int64_t G = c.G, M = c.M, K = c.K, nbm = blocks128(M), nbk = blocks128(K);
          Tensor x = fp8_weights(G, M, K, K + c.x_pad, dt, static_cast<uint32_t>(M * K));
          const QuantizeConfig cfg{out, QuantScaling::kBlock128x128, pow2, false};
          Tensor q = poisoned({G, M, K + c.q_pad}, out),
                 s = poisoned({G, nbm, nbk}, DType::kFloat32);
          Tensor qt = poisoned({G, K, M + c.q_pad}, out);
          Tensor st = poisoned({G, nbk, nbm}, DType::kFloat32);
          quantize_rowwise_columnwise(rows3(x, G, M, K), cfg, rows3(q, G, M, K), s,
                                      rows3(qt, G, K, M), st);
          for (int64_t g = 0; g < G; ++g) {
            // W's codes: the matrix quantized on its own
            Tensor wq = poisoned({M, K}, out), ws = poisoned({nbm, nbk}, DType::kFloat32);
            quantize(matrix(x, g, M, K), cfg, wq, ws);
            for (int64_t m = 0; m < M; ++m) {
              ASSERT_EQ(std::memcmp(static_cast<uint8_t*>(matrix(q, g, M, K).data) + m * q.size(2),
                                    wq.data_ptr<uint8_t>() + m * K, K),
                        0)
                  << "q row " << m;
              for (int64_t k = K; k < q.size(2); ++k)  // the gaps stay as they were
                ASSERT_EQ(static_cast<uint8_t*>(matrix(q, g, M, K).data)[m * q.size(2) + k], 0xFF);
            }
            ASSERT_EQ(std::memcmp(s.data_ptr<float>() + g * nbm * nbk, ws.data(), nbm * nbk * 4),
                      0);
            // W^T's: W's codes and scale grid transposed
            Tensor tq = poisoned({K, M}, out), ts = poisoned({nbk, nbm}, DType::kFloat32);
            transpose_codes(wq, tq);
            transpose_codes(ws, ts);
            for (int64_t k = 0; k < K; ++k)
              ASSERT_EQ(
                  std::memcmp(static_cast<uint8_t*>(matrix(qt, g, K, M).data) + k * qt.size(2),
                              tq.data_ptr<uint8_t>() + k * M, M),
                  0)
                  << "q_t row " << k;
            ASSERT_EQ(std::memcmp(st.data_ptr<float>() + g * nbm * nbk, ts.data(), nbm * nbk * 4),
                      0);
          }
          // W^T's codes alone: the same bytes.
          Tensor qt2 = poisoned({G, K, M + c.q_pad}, out);
          Tensor st2 = poisoned({G, nbk, nbm}, DType::kFloat32);
          quantize_rowwise_columnwise(rows3(x, G, M, K), cfg, {}, {}, rows3(qt2, G, K, M), st2);
          ASSERT_TRUE(bytes_equal(qt2, qt));
          ASSERT_TRUE(bytes_equal(st2, st));
        }
}

// A matrix [M,K] is one group: the same as [1,M,K].
TEST(QuantizeWeights, MatrixIsOneGroup) {
  const int64_t M = 200, K = 136;
  Tensor x = fp8_weights(1, M, K, K, DType::kBFloat16, 7);
  const QuantizeConfig cfg{kE4, QuantScaling::kBlock128x128, false, false};
  Tensor q = poisoned({M, K}, kE4), s = poisoned({2, 2}, DType::kFloat32);
  Tensor qt = poisoned({K, M}, kE4), st = poisoned({2, 2}, DType::kFloat32);
  quantize_rowwise_columnwise(TensorView(x.data(), x.dtype(), x.device(), {M, K}), cfg, q, s, qt,
                              st);
  Tensor q3 = poisoned({1, M, K}, kE4), s3 = poisoned({1, 2, 2}, DType::kFloat32);
  Tensor qt3 = poisoned({1, K, M}, kE4), st3 = poisoned({1, 2, 2}, DType::kFloat32);
  quantize_rowwise_columnwise(x, cfg, q3, s3, qt3, st3);
  EXPECT_EQ(std::memcmp(q.data(), q3.data(), M * K), 0);
  EXPECT_EQ(std::memcmp(qt.data(), qt3.data(), M * K), 0);
  EXPECT_EQ(std::memcmp(s.data(), s3.data(), 16), 0);
  EXPECT_EQ(std::memcmp(st.data(), st3.data(), 16), 0);
}

TEST(QuantizeWeights, BadInputIsNamed) {
  const int64_t G = 2, M = 256, K = 128;
  Tensor x = fp8_weights(G, M, K, K, DType::kBFloat16, 3);
  const QuantizeConfig cfg{kE4, QuantScaling::kBlock128x128, false, false};
  Tensor q = make_tensor({G, M, K}, kE4), s = make_tensor({G, 2, 1}, DType::kFloat32);
  Tensor qt = make_tensor({G, K, M}, kE4), st = make_tensor({G, 1, 2}, DType::kFloat32);
  const auto msg = [&](auto fn) { return message_of(fn); };
  EXPECT_NE(msg([&] {
              quantize_rowwise_columnwise(x, cfg, q, s, make_tensor({G, M, K}, kE4), st);
            }).find("q_t ([G,K,M]) must be float8_e4m3 [2,128,256]"),
            std::string::npos);
  EXPECT_NE(
      msg([&] {
        quantize_rowwise_columnwise(x, cfg, q, s, qt, make_tensor({G, 2, 1}, DType::kFloat32));
      }).find("scales_t ([G, ceil(K/128), ceil(M/128)]) must be float32 [2,1,2]"),
      std::string::npos);
  EXPECT_NE(
      msg([&] {
        quantize_rowwise_columnwise(x, cfg, q, make_tensor({G, 1, 2}, DType::kFloat32), qt, st);
      }).find("scales must be float32 [2,2,1]"),
      std::string::npos);
  EXPECT_NE(
      msg([&] {
        quantize_rowwise_columnwise(make_tensor({2, G, M, K}, DType::kBFloat16), cfg, q, s, qt, st);
      }).find("x must be [M,K] or [G,M,K] (kBlock128x128)"),
      std::string::npos);
  EXPECT_NE(msg([&] {
              quantize_rowwise_columnwise(x, cfg, q, {}, qt, st);
            }).find("give both q and scales, or neither"),
            std::string::npos);
  QuantizeConfig tw = cfg;
  tw.scaling = QuantScaling::kTensorwise;
  EXPECT_NE(msg([&] {
              quantize_rowwise_columnwise(x, tw, q, s, qt, st);
            }).find("config.scaling must be kBlock1x128 or kBlock128x128"),
            std::string::npos);
  // A 1x128 quantize still takes only [M,K].
  QuantizeConfig rows = cfg;
  rows.scaling = QuantScaling::kBlock1x128;
  EXPECT_NE(msg([&] {
              quantize_rowwise_columnwise(x, rows, {}, {}, qt, st);
            }).find("x must be [M,K], got"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
