// GPU FP8 quantize/dequantize tests (label gpu): the CUDA backend against the
// CPU reference, bitwise (q bytes, scale bits, dequantized values), on shapes
// with partial edge blocks, strided rows of x, q and out, every scaling, both
// fp8 formats, pow2 on/off, rowwise/columnwise, special values (NaN, inf,
// zeros, tiny blocks with subnormal scales). Outputs are poisoned with 0xFF
// first and the gaps of strided outputs must stay untouched. Also: graph
// capture + replay of the two-kernel tensorwise path, device errors;
// transpose_codes against the CPU reference; quantize_rowwise_columnwise;
// dequantize over the rows a device count names;
// quotients on and next to the fp8 rounding boundaries; quantize_group_rows.
#include <cuda_runtime.h>

#include "moeflow/grouped_mlp_fp8.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

const Device kGpu = Device::cuda(0);

class GpuQuantize : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device"; }
};

// [M, ld] storage with values in the first K columns: random magnitudes per
// row (2^-20 .. 2^20), NaN/inf sprinkled, an all-zero row, a row of tiny
// values (subnormal scales), gap columns holding 30000 (must never be read).
Tensor make_input(int64_t M, int64_t K, int64_t ld, DType dt, uint32_t seed) {
  Tensor x = make_tensor({M, ld}, dt);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 999);
  for (int64_t m = 0; m < M; ++m) {
    const int e = m % 5 == 3 ? -135 : static_cast<int>(rng() % 41) - 20;
    for (int64_t k = 0; k < ld; ++k) {
      float v = std::ldexp(uni(rng), e);
      if (dt != DType::kFloat32 && e < -24) v = std::ldexp(uni(rng), -10);  // keep in range
      const int p = pick(rng);
      if (p == 0) v = NAN;
      if (p == 1) v = INFINITY;
      if (p == 2) v = -INFINITY;
      if (p == 3) v = -0.0f;
      if (p >= 4 && p < 40)
        v = std::ldexp(v, -24);  // tiny against the block: +-0 or subnormal codes
      if (m % 7 == 2) v = 0.0f;
      if (k >= K) v = 30000.0f;  // a large finite value: reading it would change an amax
      detail::store_float(x.data(), dt, m * ld + k, v);
    }
  }
  return x;
}

TensorView rows_view(const Tensor& t, int64_t rows, int64_t cols) {
  return TensorView::strided(t.data(), t.dtype(), t.device(), {rows, cols}, {t.size(1), 1});
}

::testing::AssertionResult same_rows(const Tensor& got_big, const Tensor& want_big, int64_t rows,
                                     int64_t cols) {
  const int64_t es = static_cast<int64_t>(dtype_size(got_big.dtype()));
  const int64_t lg = got_big.size(1), lw = want_big.size(1);
  const auto* g = static_cast<const uint8_t*>(got_big.data());
  const auto* w = static_cast<const uint8_t*>(want_big.data());
  for (int64_t r = 0; r < rows; ++r) {
    if (std::memcmp(g + r * lg * es, w + r * lw * es, cols * es) != 0)
      return ::testing::AssertionFailure() << "row " << r << " differs";
    for (int64_t b = cols * es; b < lg * es; ++b)
      if (g[r * lg * es + b] != 0xFF)
        return ::testing::AssertionFailure() << "gap of row " << r << " written";
  }
  return ::testing::AssertionSuccess();
}

struct Shape {
  int64_t M, K, x_pad, q_pad;
};

TEST_F(GpuQuantize, MatchesCpuBitwise) {
  const std::vector<Shape> shapes = {{1, 1, 0, 0},
                                     {3, 130, 5, 3},
                                     {129, 257, 0, 16},
                                     {256, 384, 8, 0},
                                     {300, 1000, 24, 1},
                                     {1000, 129, 0, 7},
                                     {0, 5, 0, 0},
                                     {7, 0, 0, 0},
                                     {2, 4096, 0, 0},
                                     // the vector kernels (16-byte rows) with partial blocks
                                     {200, 272, 8, 16},
                                     {130, 1024, 0, 0},
                                     {150, 136, 0, 8},
                                     // the columnwise tile kernel (16-bit x, K % 8 == 0,
                                     // 16-byte rows of x and q) with partial tiles
                                     {144, 264, 8, 0},
                                     {384, 256, 0, 16},
                                     {16, 8, 0, 0}};
  uint32_t seed = 1;
  for (const Shape& sh : shapes)
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const int64_t M = sh.M, K = sh.K, ldx = K + sh.x_pad;
      Tensor x_host = make_input(M, K, ldx, dt, seed++);
      Tensor x_dev = x_host.to(kGpu);
      for (QuantScaling sc :
           {QuantScaling::kTensorwise, QuantScaling::kBlock1x128, QuantScaling::kBlock128x128})
        for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2})
          for (bool pow2 : {false, true})
            for (bool colw : {false, true}) {
              SCOPED_TRACE(std::to_string(M) + "x" + std::to_string(K) + " " + dtype_name(dt) +
                           " scaling " + std::to_string(int(sc)) + " " + dtype_name(out) +
                           " pow2 " + std::to_string(pow2) + " col " + std::to_string(colw));
              const QuantizeConfig cfg{out, sc, pow2, colw};
              const int64_t R = colw ? K : M, C = colw ? M : K, ldq = C + sh.q_pad;
              Tensor q_cpu = poisoned({R, ldq}, out, Device::cpu());
              Tensor s_cpu = poisoned(scales_shape(R, C, sc), DType::kFloat32, Device::cpu());
              quantize(rows_view(x_host, M, K), cfg, rows_view(q_cpu, R, C), s_cpu);
              Tensor q_dev = poisoned({R, ldq}, out, kGpu);
              Tensor s_dev = poisoned(scales_shape(R, C, sc), DType::kFloat32, kGpu);
              Tensor ws = poisoned({static_cast<int64_t>(quantize_workspace_bytes(M, K, cfg)) + 1},
                                   DType::kUInt8, kGpu);
              quantize(rows_view(x_dev, M, K), cfg, rows_view(q_dev, R, C), s_dev, ws);
              MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
              ASSERT_TRUE(bytes_equal(s_dev.to(Device::cpu()), s_cpu));
              ASSERT_TRUE(same_rows(q_dev.to(Device::cpu()), q_cpu, R, C));

              for (DType od : {dt, DType::kFloat32}) {
                Tensor o_cpu = poisoned({M, ldx}, od, Device::cpu());
                Tensor o_dev = poisoned({M, ldx}, od, kGpu);
                dequantize(rows_view(q_cpu, R, C), s_cpu, cfg, rows_view(o_cpu, M, K));
                dequantize(rows_view(q_dev, R, C), s_dev, cfg, rows_view(o_dev, M, K));
                MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
                ASSERT_TRUE(same_rows(o_dev.to(Device::cpu()), o_cpu, M, K))
                    << "dequantize to " << dtype_name(od);
              }
            }
    }
}

// quantize_rowwise_columnwise against the CPU reference, bitwise: the tile
// kernel (16-bit x, 16-byte rows, partial tiles in M and K) and the
// fallback (float32 x, odd shapes), with and without the rowwise output,
// scales_t contiguous and as the transpose of a [nb(M), K] buffer (the
// wgrad's layout). Outputs poisoned; the gaps of strided rows stay as they are.
TEST_F(GpuQuantize, RowwiseColumnwiseMatchesCpuBitwise) {
  const std::vector<Shape> shapes = {{256, 384, 8, 0}, {144, 264, 0, 16}, {300, 136, 8, 4},
                                     {16, 8, 0, 0},    {1, 128, 0, 0},    {129, 130, 3, 1},
                                     {512, 1024, 0, 0}};
  uint32_t seed = 300;
  for (const Shape& sh : shapes)
    for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      const int64_t M = sh.M, K = sh.K, ldx = K + sh.x_pad, nbm = (M + 127) / 128;
      Tensor x_host = make_input(M, K, ldx, dt, seed++);
      Tensor x_dev = x_host.to(kGpu);
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2})
        for (bool pow2 : {false, true})
          for (bool rowwise : {true, false})
            for (bool slice_major : {false, true}) {
              SCOPED_TRACE(std::to_string(M) + "x" + std::to_string(K) + " " + dtype_name(dt) +
                           " " + dtype_name(out) + " pow2 " + std::to_string(pow2) + " rowwise " +
                           std::to_string(rowwise) + " slice-major " + std::to_string(slice_major));
              const QuantizeConfig cfg{out, QuantScaling::kBlock1x128, pow2, false};
              const int64_t ldq = K + sh.q_pad, ldt = M + sh.q_pad;
              // the references: quantize, rowwise and columnwise
              Tensor q_c = poisoned({M, ldq}, out, Device::cpu());
              Tensor s_c = poisoned({M, (K + 127) / 128}, DType::kFloat32, Device::cpu());
              quantize(rows_view(x_host, M, K), cfg, rows_view(q_c, M, K), s_c);
              QuantizeConfig col = cfg;
              col.columnwise = true;
              Tensor qt_c = poisoned({K, ldt}, out, Device::cpu());
              Tensor st_c = poisoned({K, nbm}, DType::kFloat32, Device::cpu());
              quantize(rows_view(x_host, M, K), col, rows_view(qt_c, K, M), st_c);

              for (const Device dev : {Device::cpu(), kGpu}) {
                SCOPED_TRACE(dev.is_cpu() ? "cpu" : "cuda");
                const Tensor& xs = dev.is_cpu() ? x_host : x_dev;
                Tensor q = poisoned({M, ldq}, out, dev);
                Tensor s = poisoned({M, (K + 127) / 128}, DType::kFloat32, dev);
                Tensor qt = poisoned({K, ldt}, out, dev);
                Tensor st_buf = slice_major ? poisoned({nbm, K}, DType::kFloat32, dev)
                                            : poisoned({K, nbm}, DType::kFloat32, dev);
                TensorView st = slice_major ? TensorView::strided(st_buf.data(), DType::kFloat32,
                                                                  dev, {K, nbm}, {1, K})
                                            : TensorView(st_buf);
                quantize_rowwise_columnwise(
                    rows_view(xs, M, K), cfg, rowwise ? rows_view(q, M, K) : TensorView{},
                    rowwise ? TensorView(s) : TensorView{}, rows_view(qt, K, M), st);
                MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
                if (rowwise) {
                  ASSERT_TRUE(bytes_equal(s.to(Device::cpu()), s_c));
                  ASSERT_TRUE(same_rows(q.to(Device::cpu()), q_c, M, K));
                } else {
                  ASSERT_TRUE(
                      bytes_equal(q.to(Device::cpu()), poisoned({M, ldq}, out, Device::cpu())));
                }
                ASSERT_TRUE(same_rows(qt.to(Device::cpu()), qt_c, K, M));
                Tensor st_host = st_buf.to(Device::cpu());
                for (int64_t c = 0; c < K; ++c)
                  for (int64_t b = 0; b < nbm; ++b) {
                    const float got = at(st_host, slice_major ? b * K + c : c * nbm + b);
                    const float want = at(st_c, c * nbm + b);
                    ASSERT_EQ(std::memcmp(&got, &want, 4), 0)
                        << "scales_t[" << c << "," << b << "]";
                  }
              }
            }
    }
}

// Values whose quotients x / scale sit on or a few float32 ulps from the
// rounding boundaries of the fp8 grids (ties and near-ties of e4m3 and e5m2,
// for the scale each block gets with or without pow2), with the block's amax
// in its first column, amaxes from 2^-20 to 2^20 and around 448 * 2^-80 (the
// smallest scale of the kernels' reciprocal division), zeros, -0 and tiny
// values. Every kernel must still give __fdiv_rn's quotient's code.
Tensor make_boundary_input(int64_t M, int64_t K, DType dt, uint32_t seed) {
  Tensor x = make_tensor({M, K}, dt);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> grid(0, 15), step(-3, 3), pick(0, 99);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b * 128 < K; ++b) {
      const bool e4m3 = (m + b) % 2 == 0, pow2 = (m / 2 + b) % 2 == 0;
      int e = dt == DType::kFloat16 ? static_cast<int>(rng() % 21) - 10
                                    : static_cast<int>(rng() % 41) - 20;
      if (dt != DType::kFloat16 && (m + 3 * b) % 5 == 0) e = -80 + static_cast<int>(rng() % 5) - 2;
      const float amax = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f, e);
      float s = amax / (e4m3 ? 448.0f : 57344.0f);
      if (pow2) {
        int ex;
        const float f = std::frexp(s, &ex);
        s = f == 0.5f ? s : std::ldexp(1.0f, ex);
      }
      for (int64_t k = b * 128; k < std::min(K, b * 128 + 128); ++k) {
        // a value of the grid or a midpoint, at most 248 (e4m3) or 30720 (e5m2): below the amax
        const int mbits = e4m3 ? 3 : 2;
        const int n = (1 << mbits) + grid(rng) % (1 << mbits);
        const int ex = e4m3 ? static_cast<int>(rng() % 17) - 9 : static_cast<int>(rng() % 32) - 16;
        const double q = std::ldexp(n + (pick(rng) < 60 ? 0.5 : 0.0), ex - mbits);
        double v = q * s * (1.0 + step(rng) * 0x1p-23);
        const int p = pick(rng);
        if (p == 0) v = 0.0;
        if (p == 1) v = -0.0;
        if (p == 2) v *= 0x1p-30;
        if (rng() % 2) v = -v;
        if (k == b * 128) v = (rng() % 2) ? amax : -amax;
        detail::store_float(x.data(), dt, m * K + k, static_cast<float>(v));
      }
    }
  return x;
}

TEST_F(GpuQuantize, QuotientsAtRoundingBoundariesMatchCpu) {
  uint32_t seed = 900;
  for (const auto& [M, K] : std::vector<std::pair<int64_t, int64_t>>{{256, 1024}, {384, 640}})
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      Tensor x_host = make_boundary_input(M, K, dt, seed++);
      Tensor x_dev = x_host.to(kGpu);
      for (QuantScaling sc : {QuantScaling::kBlock1x128, QuantScaling::kBlock128x128})
        for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2})
          for (bool pow2 : {false, true})
            for (bool colw : {false, true}) {
              SCOPED_TRACE(std::to_string(M) + "x" + std::to_string(K) + " " + dtype_name(dt) +
                           " scaling " + std::to_string(int(sc)) + " " + dtype_name(out) +
                           " pow2 " + std::to_string(pow2) + " col " + std::to_string(colw));
              const QuantizeConfig cfg{out, sc, pow2, colw};
              const int64_t R = colw ? K : M, C = colw ? M : K;
              Tensor q_cpu = poisoned({R, C}, out, Device::cpu());
              Tensor s_cpu = poisoned(scales_shape(R, C, sc), DType::kFloat32, Device::cpu());
              quantize(x_host, cfg, q_cpu, s_cpu);
              Tensor q_dev = poisoned({R, C}, out, kGpu);
              Tensor s_dev = poisoned(scales_shape(R, C, sc), DType::kFloat32, kGpu);
              quantize(x_dev, cfg, q_dev, s_dev);
              MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
              ASSERT_TRUE(bytes_equal(s_dev.to(Device::cpu()), s_cpu));
              ASSERT_TRUE(bytes_equal(q_dev.to(Device::cpu()), q_cpu));
              if (sc != QuantScaling::kBlock1x128 || colw || dt == DType::kFloat32) continue;
              // both orientations from one read (the tile kernel)
              QuantizeConfig col = cfg;
              col.columnwise = true;
              Tensor qt_cpu = poisoned({K, M}, out, Device::cpu());
              Tensor st_cpu = poisoned(scales_shape(K, M, sc), DType::kFloat32, Device::cpu());
              quantize(x_host, col, qt_cpu, st_cpu);
              Tensor q2 = poisoned({M, K}, out, kGpu), qt2 = poisoned({K, M}, out, kGpu);
              Tensor s2 = poisoned(scales_shape(M, K, sc), DType::kFloat32, kGpu);
              Tensor st2 = poisoned(scales_shape(K, M, sc), DType::kFloat32, kGpu);
              quantize_rowwise_columnwise(x_dev, cfg, q2, s2, qt2, st2);
              MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
              ASSERT_TRUE(bytes_equal(q2.to(Device::cpu()), q_cpu));
              ASSERT_TRUE(bytes_equal(s2.to(Device::cpu()), s_cpu));
              ASSERT_TRUE(bytes_equal(qt2.to(Device::cpu()), qt_cpu));
              ASSERT_TRUE(bytes_equal(st2.to(Device::cpu()), st_cpu));
            }
    }
}

TEST_F(GpuQuantize, RowwiseColumnwiseBadInput) {
  Tensor x = Tensor::empty({256, 256}, DType::kBFloat16, kGpu);
  Tensor q = Tensor::empty({256, 256}, DType::kFloat8E4M3, kGpu);
  Tensor s = Tensor::empty({256, 2}, DType::kFloat32, kGpu);
  Tensor qt = Tensor::empty({256, 256}, DType::kFloat8E4M3, kGpu);
  Tensor st = Tensor::empty({256, 2}, DType::kFloat32, kGpu);
  const QuantizeConfig cfg{};
  QuantizeConfig bad = cfg;
  bad.scaling = QuantScaling::kTensorwise;
  EXPECT_NE(message_of([&] {
              quantize_rowwise_columnwise(x, bad, q, s, qt, st);
            }).find("config.scaling must be kBlock1x128 or kBlock128x128"),
            std::string::npos);
  bad = cfg;
  bad.columnwise = true;
  EXPECT_NE(message_of([&] {
              quantize_rowwise_columnwise(x, bad, q, s, qt, st);
            }).find("config.columnwise must be false"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              quantize_rowwise_columnwise(x, cfg, q, TensorView{}, qt, st);
            }).find("give both q and scales"),
            std::string::npos);
  Tensor st_bad = Tensor::empty({2, 256}, DType::kFloat32, kGpu);
  EXPECT_NE(message_of([&] {
              quantize_rowwise_columnwise(x, cfg, q, s, qt, st_bad);
            }).find("scales_t ([K, ceil(M/128)]) must be float32 [256,2]"),
            std::string::npos);
}

// quantize (1x128 rowwise, both kernels: 16-byte rows and a strided x) with
// rows_used on the device: the CPU's codes and scales, the rest untouched.
TEST_F(GpuQuantize, QuantizeRowsUsedMatchesCpu) {
  const int64_t M = 517, K = 384, nb = 3;
  for (int64_t ldx : {K, K + 3}) {  // vector kernel; the simple kernel
    Tensor x_host = make_input(M, K, ldx, DType::kBFloat16, 91);
    const Tensor x_dev = x_host.to(kGpu);
    const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kBlock1x128, false, false};
    for (DType cd : {DType::kInt32, DType::kInt64})
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{300}, M, M + 100, int64_t{-1}}) {
        SCOPED_TRACE("ld " + std::to_string(ldx) + " " + dtype_name(cd) + " n " +
                     std::to_string(n));
        const Tensor count = count_tensor(n, cd);
        Tensor q_cpu = poisoned({M, K}, cfg.out, Device::cpu());
        Tensor s_cpu = poisoned({M, nb}, DType::kFloat32, Device::cpu());
        quantize(rows_view(x_host, M, K), cfg, q_cpu, s_cpu, {}, count);
        Tensor q_dev = poisoned({M, K}, cfg.out, kGpu);
        Tensor s_dev = poisoned({M, nb}, DType::kFloat32, kGpu);
        const Tensor count_dev = count.to(kGpu);  // alive until the kernel ran
        quantize(rows_view(x_dev, M, K), cfg, q_dev, s_dev, {}, count_dev);
        MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
        ASSERT_TRUE(bytes_equal(q_dev.to(Device::cpu()), q_cpu));
        ASSERT_TRUE(bytes_equal(s_dev.to(Device::cpu()), s_cpu));
      }
  }
}

// dequantize with rows_used on the device: the CPU's rows, the rest of the
// poisoned output untouched; counts past M and below 0 clamped.
TEST_F(GpuQuantize, DequantizeRowsUsedMatchesCpu) {
  const int64_t M = 517, K = 384;
  Tensor x = make_input(M, K, K, DType::kBFloat16, 77);
  for (QuantScaling sc : {QuantScaling::kBlock1x128, QuantScaling::kBlock128x128})
    for (DType cd : {DType::kInt32, DType::kInt64}) {
      const QuantizeConfig cfg{DType::kFloat8E4M3, sc, false, false};
      Tensor q = make_tensor({M, K}, cfg.out);
      Tensor s = make_tensor(scales_shape(M, K, sc), DType::kFloat32);
      quantize(x, cfg, q, s);
      const Tensor q_dev = q.to(kGpu), s_dev = s.to(kGpu);
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{300}, M, M + 100, int64_t{-1}}) {
        SCOPED_TRACE("scaling " + std::to_string(int(sc)) + " " + dtype_name(cd) + " n " +
                     std::to_string(n));
        const Tensor count = count_tensor(n, cd);
        Tensor want = poisoned({M, K}, DType::kBFloat16, Device::cpu());
        dequantize(q, s, cfg, want, count);
        Tensor got = poisoned({M, K}, DType::kBFloat16, kGpu);
        const Tensor count_dev = count.to(kGpu);  // alive until the kernel ran
        dequantize(q_dev, s_dev, cfg, got, count_dev);
        MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
        ASSERT_TRUE(bytes_equal(got.to(Device::cpu()), want));
      }
    }
}

// transpose_codes against the CPU reference: stacked and single matrices,
// 16-byte rows and odd sizes (partial tiles), q_t poisoned first.
TEST_F(GpuQuantize, TransposeCodesMatchesCpu) {
  const std::vector<std::vector<int64_t>> shapes = {
      {1, 1, 1}, {3, 130, 70}, {2, 128, 256}, {1, 64, 48}, {5, 17, 200}, {2, 256, 7168 / 16},
      {2, 40, 64}, {2, 64, 40}};  // 16-byte rows on one side only
  uint32_t seed = 5;
  for (const auto& sh : shapes)
    for (bool stacked : {true, false}) {
      if (!stacked && sh[0] != 1) continue;
      SCOPED_TRACE(std::to_string(sh[0]) + "x" + std::to_string(sh[1]) + "x" +
                   std::to_string(sh[2]));
      const std::vector<int64_t> shape = stacked ? sh : std::vector<int64_t>{sh[1], sh[2]};
      std::vector<int64_t> shape_t = shape;
      std::swap(shape_t[shape.size() - 2], shape_t[shape.size() - 1]);
      for (DType dt : {DType::kFloat8E4M3, DType::kFloat32}) {  // codes, scale grids
        Tensor q = make_tensor(shape, dt);
        std::mt19937 rng(seed++);
        auto* qb = static_cast<uint8_t*>(q.data());
        for (size_t i = 0; i < q.nbytes(); ++i) qb[i] = rng() & 0xFF;
        Tensor want = poisoned(shape_t, dt, Device::cpu());
        transpose_codes(q, want);
        Tensor got = poisoned(shape_t, dt, kGpu);
        transpose_codes(q.to(kGpu), got);
        MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
        ASSERT_TRUE(bytes_equal(got.to(Device::cpu()), want)) << dtype_name(dt);
      }
    }
}

TEST_F(GpuQuantize, Deterministic) {
  const int64_t M = 777, K = 1500;
  Tensor x = make_input(M, K, K, DType::kBFloat16, 42).to(kGpu);
  for (QuantScaling sc :
       {QuantScaling::kTensorwise, QuantScaling::kBlock1x128, QuantScaling::kBlock128x128}) {
    const QuantizeConfig cfg{DType::kFloat8E4M3, sc, false, false};
    Tensor ws = Tensor::empty({static_cast<int64_t>(quantize_workspace_bytes(M, K, cfg)) + 1},
                              DType::kUInt8, kGpu);
    Tensor q1 = poisoned({M, K}, cfg.out, kGpu), q2 = poisoned({M, K}, cfg.out, kGpu);
    Tensor s1 = poisoned(scales_shape(M, K, sc), DType::kFloat32, kGpu);
    Tensor s2 = poisoned(scales_shape(M, K, sc), DType::kFloat32, kGpu);
    quantize(x, cfg, q1, s1, ws);
    quantize(x, cfg, q2, s2, ws);
    MOEFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(bytes_equal(q1.to(Device::cpu()), q2.to(Device::cpu())));
    EXPECT_TRUE(bytes_equal(s1.to(Device::cpu()), s2.to(Device::cpu())));
  }
}

TEST_F(GpuQuantize, TensorwiseGraphCaptureReplay) {
  const int64_t M = 512, K = 1000;
  cudaStream_t stream;
  MOEFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (bool colw : {false, true}) {
    const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kTensorwise, true, colw};
    const int64_t R = colw ? K : M, C = colw ? M : K;
    Tensor x_g = Tensor::empty({M, K}, DType::kBFloat16, kGpu);
    Tensor q_g = Tensor::empty({R, C}, cfg.out, kGpu);
    Tensor s_g = Tensor::empty({1}, DType::kFloat32, kGpu);
    Tensor ws = Tensor::empty({static_cast<int64_t>(quantize_workspace_bytes(M, K, cfg))},
                              DType::kUInt8, kGpu);
    copy(make_input(M, K, K, DType::kBFloat16, 5), x_g, stream);
    quantize(x_g, cfg, q_g, s_g, ws, {}, stream);  // warm-up (module load outside the capture)
    MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));

    cudaGraph_t graph;
    MOEFLOW_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    quantize(x_g, cfg, q_g, s_g, ws, {}, stream);
    MOEFLOW_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    MOEFLOW_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      SCOPED_TRACE(replay);
      Tensor x = make_input(M, K, K, DType::kBFloat16, 100 + replay);
      // a different global amax every replay
      for (int64_t i = 0; i < M * K; ++i)
        detail::store_float(x.data(), x.dtype(), i, at(x, i) * std::ldexp(1.0f, 3 * replay));
      copy(x, x_g, stream);
      fill_bytes(q_g, 0xFF, stream);
      fill_bytes(s_g, 0xFF, stream);
      fill_bytes(ws, 0xFF, stream);
      MOEFLOW_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      MOEFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
      Tensor q_c = make_tensor({R, C}, cfg.out), s_c = make_tensor({1}, DType::kFloat32);
      quantize(x, cfg, q_c, s_c);
      EXPECT_TRUE(bytes_equal(s_g.to(Device::cpu()), s_c));
      EXPECT_TRUE(bytes_equal(q_g.to(Device::cpu()), q_c));
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

TEST_F(GpuQuantize, BadInput) {
  Tensor x = Tensor::empty({4, 200}, DType::kFloat32, kGpu);
  Tensor q = Tensor::empty({4, 200}, DType::kFloat8E4M3, kGpu);
  Tensor s = Tensor::empty({4, 2}, DType::kFloat32, kGpu);
  const QuantizeConfig cfg{};
  EXPECT_NE(message_of([&] {
              quantize(x, cfg, make_tensor({4, 200}, DType::kFloat8E4M3), s);
            }).find("q must be float8_e4m3 [4,200] on cuda:0, got float8_e4m3 [4,200] on cpu"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              quantize(x, cfg, q, make_tensor({4, 2}, DType::kFloat32));
            }).find("scales must be float32 [4,2] on cuda:0"),
            std::string::npos);
  // CUDA tensorwise needs the workspace
  const QuantizeConfig tw{DType::kFloat8E4M3, QuantScaling::kTensorwise};
  Tensor s1 = Tensor::empty({1}, DType::kFloat32, kGpu);
  EXPECT_NE(message_of([&] { quantize(x, tw, q, s1); }).find("workspace"), std::string::npos);
  Tensor small = Tensor::empty({static_cast<int64_t>(quantize_workspace_bytes(4, 200, tw)) - 1},
                               DType::kUInt8, kGpu);
  EXPECT_NE(message_of([&] { quantize(x, tw, q, s1, small); }).find("quantize_workspace_bytes"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              dequantize(q, s, cfg, make_tensor({4, 200}, DType::kFloat32));
            }).find("q must be float8_e4m3 [4,200] on cpu"),
            std::string::npos);
}

// fill_uniform (moeflow/tensor.h): the CUDA fill is bitwise the CPU's.
// quantize_group_rows (the tensorwise recipe's operands) against the CPU
// reference, bitwise (codes and scale): groups with pad rows, an empty
// group, rows past the groups; without groups; strided rows and odd widths
// (the scalar path); every input dtype, both formats, pow2; the gap
// columns (30000) and the non-data rows must not enter the amax. With q_t:
// the transposed codes too (M = 272: whole 16-byte q_t stores, five row
// tiles; M = 107: partial ones; strided or odd-width rows: the kernel's
// scalar form), and the CPU's q_t is its q transposed; a large case (8192 x
// 4096: more tiles than the grid has blocks, so each block loops). Also a
// captured call replayed on new values.
TEST_F(GpuQuantize, GroupRowsMatchCpuBitwise) {
  const std::vector<int64_t> offs = {0, 37, 37, 100};
  const std::vector<int32_t> real = {30, 0, 50};
  Tensor o = make_tensor({4}, DType::kInt64), r = make_tensor({3}, DType::kInt32);
  std::copy(offs.begin(), offs.end(), o.data_ptr<int64_t>());
  std::copy(real.begin(), real.end(), r.data_ptr<int32_t>());
  Tensor og = o.to(kGpu), rg = r.to(kGpu);
  uint32_t seed = 500;
  for (const DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
    for (const auto& [K, ld] : {std::pair<int64_t, int64_t>{256, 256}, {512, 520}, {100, 104}})
      for (const bool groups : {true, false})
        for (const DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2})
          for (const int64_t M : {int64_t{107}, int64_t{272}}) {
            Tensor x = make_input(M, K, ld, dt, seed++);
            // Non-data rows hold the largest values: reading them changes the scale.
            for (int64_t m = 0; m < M; ++m) {
              const bool data = (m < 30) || (m >= 37 && m < 87);
              if (groups && !data)
                for (int64_t k = 0; k < K; ++k) detail::store_float(x.data(), dt, m * ld + k, 9e3f);
            }
            const QuantizeConfig cfg{out, QuantScaling::kTensorwise, out == DType::kFloat8E5M2,
                                     false};
            SCOPED_TRACE(std::string(dtype_name(dt)) + " K=" + std::to_string(K) +
                         " M=" + std::to_string(M) + (groups ? " groups " : " no groups ") +
                         dtype_name(out));
            GroupLayout gc, gg;
            if (groups) gc.offsets = o, gc.real_rows = r, gg.offsets = og, gg.real_rows = rg;
            Tensor qc = poisoned({M, ld}, out), sc = poisoned({1}, DType::kFloat32);
            quantize_group_rows(rows_view(x, M, K), gc, cfg, rows_view(qc, M, K), sc);
            Tensor xg = x.to(kGpu);
            Tensor qg = poisoned({M, ld}, out, kGpu), sg = poisoned({1}, DType::kFloat32, kGpu);
            quantize_group_rows(rows_view(xg, M, K), gg, cfg, rows_view(qg, M, K), sg);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            EXPECT_TRUE(bytes_equal(sg.to(Device::cpu()), sc)) << at(sc, 0);
            EXPECT_TRUE(bytes_equal(qg.to(Device::cpu()), qc));
            // With the transposed codes.
            Tensor qc2 = poisoned({M, ld}, out), sc2 = poisoned({1}, DType::kFloat32),
                   qtc = poisoned({K, M}, out);
            quantize_group_rows(rows_view(x, M, K), gc, cfg, rows_view(qc2, M, K), sc2, qtc);
            EXPECT_TRUE(bytes_equal(qc2, qc));
            bool transposed = true;
            for (int64_t m = 0; m < M; ++m)
              for (int64_t k = 0; k < K; ++k)
                transposed &=
                    qtc.data_ptr<uint8_t>()[k * M + m] == qc.data_ptr<uint8_t>()[m * ld + k];
            EXPECT_TRUE(transposed);
            Tensor qg2 = poisoned({M, ld}, out, kGpu), sg2 = poisoned({1}, DType::kFloat32, kGpu),
                   qtg = poisoned({K, M}, out, kGpu);
            quantize_group_rows(rows_view(xg, M, K), gg, cfg, rows_view(qg2, M, K), sg2, qtg);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            EXPECT_TRUE(bytes_equal(sg2.to(Device::cpu()), sc));
            EXPECT_TRUE(bytes_equal(qg2.to(Device::cpu()), qc));
            EXPECT_TRUE(bytes_equal(qtg.to(Device::cpu()), qtc));
            // The amax given (twice the real one: its own scale), both forms.
            Tensor ac = make_tensor({1}, DType::kFloat32);
            ac.data_ptr<float>()[0] =
                2.0f * at(sc, 0) * (out == DType::kFloat8E5M2 ? 57344.0f : 448.0f);
            Tensor ag = ac.to(kGpu);
            for (const bool t : {false, true}) {
              Tensor q3 = poisoned({M, ld}, out), s3 = poisoned({1}, DType::kFloat32),
                     qt3 = poisoned({K, M}, out);
              quantize_group_rows_with_amax(rows_view(x, M, K), gc, cfg, ac, rows_view(q3, M, K),
                                            s3, t ? TensorView(qt3) : TensorView{});
              Tensor q4 = poisoned({M, ld}, out, kGpu), s4 = poisoned({1}, DType::kFloat32, kGpu),
                     qt4 = poisoned({K, M}, out, kGpu);
              quantize_group_rows_with_amax(rows_view(xg, M, K), gg, cfg, ag, rows_view(q4, M, K),
                                            s4, t ? TensorView(qt4) : TensorView{});
              ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
              EXPECT_TRUE(bytes_equal(s4.to(Device::cpu()), s3)) << "amax given";
              EXPECT_TRUE(bytes_equal(q4.to(Device::cpu()), q3)) << "amax given";
              if (t) EXPECT_TRUE(bytes_equal(qt4.to(Device::cpu()), qt3)) << "amax given";
            }
          }
  {
    // More 64 x 128 tiles than the grid has blocks: every block loops.
    const int64_t M = 8192, K = 4096;
    Tensor x = make_input(M, K, K, DType::kBFloat16, 79);
    GroupLayout none;
    const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kTensorwise, false, false};
    Tensor qc = poisoned({M, K}, DType::kFloat8E4M3), sc = poisoned({1}, DType::kFloat32),
           qtc = poisoned({K, M}, DType::kFloat8E4M3);
    quantize_group_rows(x, none, cfg, qc, sc, qtc);
    Tensor xg = x.to(kGpu), qg = poisoned({M, K}, DType::kFloat8E4M3, kGpu),
           sg = poisoned({1}, DType::kFloat32, kGpu),
           qtg = poisoned({K, M}, DType::kFloat8E4M3, kGpu);
    quantize_group_rows(xg, none, cfg, qg, sg, qtg);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(bytes_equal(qg.to(Device::cpu()), qc)) << "8192 x 4096";
    EXPECT_TRUE(bytes_equal(qtg.to(Device::cpu()), qtc)) << "8192 x 4096, transposed";
  }
  // Graph capture: one captured call replayed after the input changed.
  const int64_t M = 100, K = 256;
  Tensor x = make_input(M, K, K, DType::kBFloat16, 77),
         x2 = make_input(M, K, K, DType::kBFloat16, 78);
  Tensor xg = x.to(kGpu), q = poisoned({M, K}, DType::kFloat8E4M3, kGpu),
         sc = poisoned({1}, DType::kFloat32, kGpu), qt = poisoned({K, M}, DType::kFloat8E4M3, kGpu);
  GroupLayout gg;
  gg.offsets = og, gg.real_rows = rg;
  const QuantizeConfig cfg{DType::kFloat8E4M3, QuantScaling::kTensorwise, false, false};
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  quantize_group_rows(xg, gg, cfg, q, sc, qt, s);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  copy(x2, xg, s);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  GroupLayout gc;
  gc.offsets = o, gc.real_rows = r;
  Tensor qc = poisoned({M, K}, DType::kFloat8E4M3), scc = poisoned({1}, DType::kFloat32),
         qtc = poisoned({K, M}, DType::kFloat8E4M3);
  quantize_group_rows(x2, gc, cfg, qc, scc, qtc);
  EXPECT_TRUE(bytes_equal(q.to(Device::cpu()), qc));
  EXPECT_TRUE(bytes_equal(qt.to(Device::cpu()), qtc));
  EXPECT_TRUE(bytes_equal(sc.to(Device::cpu()), scc));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST(GpuFillUniform, MatchesCpuBitwise) {
  ASSERT_GT(cuda_device_count(), 0) << "GPU tests need a CUDA device";
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    Tensor want = Tensor::empty({1000, 77}, dt, Device::cpu());
    fill_uniform(want, 123, -2.0f, 3.0f);
    Tensor got = Tensor::empty({1000, 77}, dt, kGpu);
    fill_bytes(got, 0xFF);
    fill_uniform(got, 123, -2.0f, 3.0f);
    EXPECT_TRUE(bytes_equal(got.to(Device::cpu()), want)) << dtype_name(dt);
  }
}

}  // namespace
}  // namespace moeflow::test
