// CPU tests of the expert-parallel reference (W ranks in one process):
// hand-worked layout, W = 1 equal to plan + permute/unpermute bitwise, random
// routings for W = 2, 4, 8 with uneven tokens (0 and primes), all tokens to
// one rank, capacity overflow, dispatch+combine identity, backward adjoints,
// bad input.
#include <cstring>

#include "core/ep_backend.h"
#include "core/ep_layout.h"
#include "moeflow/ep_reference.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

using ep_reference::EpConfig;
using ep_reference::Handle;
using ep_reference::RankInput;

Tensor ids_of(const std::vector<std::vector<int32_t>>& rows, int K) {
  Tensor t = make_tensor({static_cast<int64_t>(rows.size()), K}, DType::kInt32);
  for (size_t i = 0; i < rows.size(); ++i)
    for (int k = 0; k < K; ++k) t.data_ptr<int32_t>()[i * K + k] = rows[i][k];
  return t;
}

RankInput rank_input(Tensor ids, int64_t H, DType dt, uint32_t seed) {
  const int64_t T = ids.size(0);
  RankInput r;
  r.ids = ids;
  r.x = make_tensor({T, H}, dt);
  fill_random(r.x, seed);
  r.probs = make_tensor({T, ids.size(1)}, DType::kFloat32);
  fill_random(r.probs, seed + 1, 0.0f, 1.0f);
  return r;
}

TEST(EpReference, HandWorkedLayout) {
  // W=2, E=4 (2 local experts each), K=2.
  EpConfig cfg{2, 4, 1, 3, -1};
  std::vector<RankInput> in = {rank_input(ids_of({{0, 2}, {3, 1}, {2, -1}}, 2), 8, DType::kFloat32, 1),
                               rank_input(ids_of({{1, 2}, {0, 3}}, 2), 8, DType::kFloat32, 3)};
  Handle h;
  auto recv = ep_reference::dispatch(in, cfg, h);
  // rank 0: expert 0 <- (r0,t0,k0), (r1,t1,k0); expert 1 <- (r0,t1,k1), (r1,t0,k0)
  EXPECT_EQ(to_vec<int32_t>(recv[0].tokens_per_expert), (std::vector<int32_t>{2, 2}));
  auto sr = to_vec<int32_t>(recv[0].src_rank), st = to_vec<int32_t>(recv[0].src_token), sk = to_vec<int32_t>(recv[0].src_k);
  EXPECT_EQ(std::vector<int32_t>(sr.begin(), sr.begin() + 4), (std::vector<int32_t>{0, 1, 0, 1}));
  EXPECT_EQ(std::vector<int32_t>(st.begin(), st.begin() + 4), (std::vector<int32_t>{0, 1, 1, 0}));
  EXPECT_EQ(std::vector<int32_t>(sk.begin(), sk.begin() + 4), (std::vector<int32_t>{0, 0, 1, 0}));
  // rank 1: expert 2 <- (r0,t0,k1), (r0,t2,k0), (r1,t0,k1); expert 3 <- (r0,t1,k0), (r1,t1,k1)
  EXPECT_EQ(to_vec<int32_t>(recv[1].tokens_per_expert), (std::vector<int32_t>{3, 2}));
  EXPECT_EQ(recv[1].total_rows, 5);
  sr = to_vec<int32_t>(recv[1].src_rank);
  st = to_vec<int32_t>(recv[1].src_token);
  EXPECT_EQ(std::vector<int32_t>(sr.begin(), sr.begin() + 5), (std::vector<int32_t>{0, 0, 1, 0, 1}));
  EXPECT_EQ(std::vector<int32_t>(st.begin(), st.begin() + 5), (std::vector<int32_t>{0, 2, 0, 1, 1}));
  // the rows hold their tokens
  EXPECT_EQ(0, std::memcmp(recv[1].x.data_ptr<float>() + 1 * 8, in[0].x.data_ptr<float>() + 2 * 8, 32));
  EXPECT_EQ(to_vec<int64_t>(h.dest_row[0]), (std::vector<int64_t>{0, 0, 3, 2, 1, -1}));
  EXPECT_EQ(to_vec<int32_t>(h.dest_rank[0]), (std::vector<int32_t>{0, 1, 1, 0, 1, -1}));
}

// W = 1 is exactly build_plan + permute, and combine is exactly unpermute.
TEST(EpReference, SingleRankEqualsPermuteAndUnpermute) {
  for (int align : {1, 16, 128}) {
    const int64_t T = 301, H = 24;
    const int K = 4, E = 16;
    Tensor ids = random_topk(T, K, E, 50 + align, 1.0, 0.05);
    RankInput in = rank_input(ids, H, DType::kBFloat16, 60);
    EpConfig cfg{1, E, align, T, -1};
    Handle h;
    auto recv = ep_reference::dispatch({in}, cfg, h);
    RoutingPlan plan = allocate_plan(T, K, PlanConfig{E, align, -1}, Device::cpu());
    ASSERT_EQ(plan.capacity_rows, h.config.capacity_rows);
    build_plan(ids, plan);
    Tensor y = make_tensor({plan.capacity_rows, H}, DType::kBFloat16);
    Tensor pp = make_tensor({plan.capacity_rows}, DType::kFloat32);
    permute(in.x, plan, y, PermuteExtras{in.probs, pp, {}, {}});
    const int64_t total = plan_status(plan).total_rows;
    EXPECT_EQ(recv[0].total_rows, total);
    EXPECT_EQ(to_vec<int64_t>(recv[0].expert_row_offsets), to_vec<int64_t>(plan.expert_row_offsets));
    EXPECT_EQ(to_vec<int64_t>(h.dest_row[0]), to_vec<int64_t>(plan.dest_row));
    EXPECT_EQ(0, std::memcmp(recv[0].x.data(), y.data(), total * H * 2));
    EXPECT_EQ(0, std::memcmp(recv[0].probs.data(), pp.data(), total * 4));
    Tensor want = make_tensor({T, H}, DType::kFloat32);
    unpermute(y, plan, want, in.probs);
    auto got = ep_reference::combine({recv[0].x}, h, {in.probs}, DType::kFloat32);
    EXPECT_TRUE(bytes_equal(got[0], want));
  }
}

struct EpSetup {
  std::vector<RankInput> in;
  EpConfig cfg;
};

// Uneven tokens per rank: one rank with 0 tokens, one with a prime count.
EpSetup random_setup(int W, int E, int K, int64_t H, int align, uint32_t seed, double skew = 0.5) {
  EpSetup s;
  std::mt19937 rng(seed);
  int64_t max_t = 0;
  for (int r = 0; r < W; ++r) {
    int64_t T = r == 0 ? 0 : (r == 1 ? 97 : std::uniform_int_distribution<int>(1, 200)(rng));
    max_t = std::max(max_t, T);
    s.in.push_back(rank_input(random_topk(T, K, E, seed + r, skew, 0.05), H, DType::kBFloat16, seed * 7 + r));
  }
  s.cfg = EpConfig{W, E, align, max_t, -1};
  return s;
}

TEST(EpReference, RandomRoutingsEverySlotArrivesOnce) {
  for (int W : {2, 4, 8}) {
    for (int align : {1, 16}) {
      SCOPED_TRACE(::testing::Message() << "W=" << W << " align=" << align);
      EpSetup s = random_setup(W, 32, 4, 40, align, 100 + W * 10 + align);
      Handle h;
      auto recv = ep_reference::dispatch(s.in, s.cfg, h);
      // every routed slot has exactly one (rank, row), and that row names it back
      int64_t routed = 0, arrived = 0;
      for (int r = 0; r < W; ++r)
        for (int64_t i = 0; i < h.dest_row[r].numel(); ++i) {
          const int64_t row = h.dest_row[r].data_ptr<int64_t>()[i];
          const int q = h.dest_rank[r].data_ptr<int32_t>()[i];
          if (q < 0) continue;
          ++routed;
          ASSERT_GE(row, 0) << "nothing may be dropped at worst-case capacity";
          ASSERT_EQ(recv[q].src_rank.data_ptr<int32_t>()[row], r);
          ASSERT_EQ(recv[q].src_token.data_ptr<int32_t>()[row], i / 4);
          ASSERT_EQ(recv[q].src_k.data_ptr<int32_t>()[row], i % 4);
          ASSERT_EQ(0, std::memcmp(recv[q].x.data_ptr<uint16_t>() + row * 40,
                                   s.in[r].x.data_ptr<uint16_t>() + (i / 4) * 40, 80));
        }
      for (int q = 0; q < W; ++q) {
        auto tpe = to_vec<int32_t>(recv[q].tokens_per_expert);
        for (int32_t v : tpe) arrived += v;
        EXPECT_EQ(recv[q].dropped, 0);
      }
      EXPECT_EQ(routed, arrived);
      // dispatch then combine with identity experts = x * sum of the kept probs
      std::vector<Tensor> y, w;
      for (int q = 0; q < W; ++q) y.push_back(recv[q].x);
      for (int r = 0; r < W; ++r) w.push_back(s.in[r].probs);
      auto out = ep_reference::combine(y, h, w, DType::kFloat32);
      for (int r = 0; r < W; ++r)
        for (int64_t t = 0; t < s.in[r].x.size(0); ++t) {
          double psum = 0;
          for (int k = 0; k < 4; ++k)
            if (h.dest_rank[r].data_ptr<int32_t>()[t * 4 + k] >= 0) psum += s.in[r].probs.data_ptr<float>()[t * 4 + k];
          for (int64_t j = 0; j < 40; ++j)
            ASSERT_NEAR(out[r].data_ptr<float>()[t * 40 + j], psum * at(s.in[r].x, t * 40 + j), 1e-5);
        }
      // deterministic: the same inputs give bitwise the same outputs
      auto again = ep_reference::combine(y, h, w, DType::kFloat32);
      for (int r = 0; r < W; ++r) EXPECT_TRUE(bytes_equal(again[r], out[r]));
    }
  }
}

// The bfloat16 combine wire: each peer's partial of several slots is rounded
// to bfloat16 once, so out differs from the float32 wire's by at most half a
// bfloat16 ulp (at most 2^-8 relative) of each such partial, and not at all for a
// token whose slots are all at home or single on their ranks.
TEST(EpReference, Bf16CombineWireRoundsPeerPartialsOnly) {
  const int W = 4, K = 4, H = 40;
  EpSetup s = random_setup(W, 32, K, H, 16, 555);
  Handle h;
  auto recv = ep_reference::dispatch(s.in, s.cfg, h);
  std::vector<Tensor> y, w;
  for (int q = 0; q < W; ++q) {
    y.push_back(Tensor::empty({recv[q].x.size(0), H}, DType::kFloat32));
    fill_random(y.back(), 900 + q);
  }
  for (int r = 0; r < W; ++r) w.push_back(s.in[r].probs);
  const auto f32 = ep_reference::combine(y, h, w, DType::kFloat32);
  const auto b16 = ep_reference::combine(y, h, w, DType::kFloat32, DType::kBFloat16);
  EXPECT_ANY_THROW(ep_reference::combine(y, h, w, DType::kFloat32, DType::kFloat16));
  int64_t rounded_tokens = 0;
  for (int r = 0; r < W; ++r)
    for (int64_t t = 0; t < s.in[r].x.size(0); ++t) {
      std::vector<int> on(W, 0);
      for (int k = 0; k < K; ++k) {
        const int q = h.dest_rank[r].data_ptr<int32_t>()[t * K + k];
        if (q >= 0 && h.dest_row[r].data_ptr<int64_t>()[t * K + k] >= 0) ++on[q];
      }
      bool rounded = false;
      for (int q = 0; q < W; ++q) rounded |= q != r && on[q] > 1;
      rounded_tokens += rounded;
      for (int64_t j = 0; j < H; ++j) {
        const float a = f32[r].data_ptr<float>()[t * H + j], b = b16[r].data_ptr<float>()[t * H + j];
        if (!rounded) {
          ASSERT_EQ(a, b) << "rank " << r << " token " << t;
          continue;
        }
        double bound = 1e-6;  // |partial| * 2^-8 per rounded partial, + float32 sums
        for (int k = 0; k < K; ++k) {
          const int q = h.dest_rank[r].data_ptr<int32_t>()[t * K + k];
          const int64_t row = h.dest_row[r].data_ptr<int64_t>()[t * K + k];
          if (q < 0 || row < 0) continue;
          bound += std::abs(s.in[r].probs.data_ptr<float>()[t * K + k] *
                            y[q].data_ptr<float>()[row * H + j]) *
                   (q != r && on[q] > 1 ? 0x1p-8 : 0x1p-22);
        }
        ASSERT_LE(std::abs(a - b), bound) << "rank " << r << " token " << t << " col " << j;
      }
    }
  EXPECT_GT(rounded_tokens, 0) << "the routing must give peers several slots of some token";
}

// Scales [T,S] travel with their token: every kept slot's row holds its
// token's scales, pad rows zeros; scales on some ranks only are refused.
TEST(EpReference, ScalesTravelWithTheirRows) {
  const int W = 4, S = 3;
  EpSetup s = random_setup(W, 32, 4, 40, 16, 321);
  for (int r = 0; r < W; ++r) {
    const int64_t T = s.in[r].x.size(0);
    s.in[r].scales = Tensor::empty({T, S}, DType::kFloat32);
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < S; ++j) s.in[r].scales.data_ptr<float>()[t * S + j] = 1000.0f * r + t + 0.25f * (j + 1);
  }
  Handle h;
  auto recv = ep_reference::dispatch(s.in, s.cfg, h);
  for (int q = 0; q < W; ++q) {
    ASSERT_TRUE(recv[q].scales.defined());
    ASSERT_EQ(recv[q].scales.sizes(), std::vector<int64_t>({recv[q].x.size(0), S}));
    auto off = to_vec<int64_t>(recv[q].expert_row_offsets);
    for (int64_t row = 0; row < off.back(); ++row) {
      const int32_t sr = recv[q].src_rank.data_ptr<int32_t>()[row], st = recv[q].src_token.data_ptr<int32_t>()[row];
      for (int j = 0; j < S; ++j) {
        const float got = recv[q].scales.data_ptr<float>()[row * S + j];
        if (sr < 0)
          ASSERT_EQ(got, 0.0f) << "pad row " << row;
        else
          ASSERT_EQ(got, 1000.0f * sr + st + 0.25f * (j + 1)) << "row " << row;
      }
    }
  }
  // without scales: none received
  EpSetup plain = random_setup(W, 32, 4, 40, 16, 321);
  EXPECT_FALSE(ep_reference::dispatch(plain.in, plain.cfg, h)[0].scales.defined());
  // scales on rank 0 only, or of another width on rank 1: clear errors
  plain.in[0].scales = s.in[0].scales;
  EXPECT_THROW(ep_reference::dispatch(plain.in, plain.cfg, h), Error);
  s.in[1].scales = Tensor::empty({s.in[1].x.size(0), S + 1}, DType::kFloat32);
  EXPECT_THROW(ep_reference::dispatch(s.in, s.cfg, h), Error);
}

// dispatch_quantize: each rank's 16-bit tokens quantized 1x128, then the
// FP8 dispatch of the codes with their scales: every received row holds its
// token's codes and scales (pad rows zero), and bad input is refused.
TEST(EpReference, DispatchQuantizeIsQuantizeThenDispatch) {
  const int W = 3;
  EpSetup s = random_setup(W, 24, 4, 40, 16, 77);
  std::vector<RankInput> in16(W);
  for (int r = 0; r < W; ++r) {
    const int64_t T = s.in[r].x.size(0), H = s.in[r].x.size(1);
    in16[r] = RankInput{make_tensor({T, H}, DType::kBFloat16), s.in[r].ids, s.in[r].probs, {}};
    fill_random(in16[r].x, 500 + r, -4.0f, 4.0f);
    add_special_rows(in16[r].x);
  }
  for (const bool pow2 : {false, true}) {
    const QuantizeConfig qc{DType::kFloat8E4M3, QuantScaling::kBlock1x128, pow2, false};
    Handle h;
    auto recv = ep_reference::dispatch_quantize(in16, s.cfg, qc, h);
    for (int q = 0; q < W; ++q) {
      ASSERT_EQ(recv[q].x.dtype(), DType::kFloat8E4M3);
      ASSERT_TRUE(recv[q].scales.defined());
      const int64_t H = recv[q].x.size(1), nb = recv[q].scales.size(1);
      ASSERT_EQ(nb, (H + 127) / 128);
      for (int64_t row = 0; row < recv[q].total_rows; ++row) {
        const int32_t sr = recv[q].src_rank.data_ptr<int32_t>()[row];
        const int32_t st = recv[q].src_token.data_ptr<int32_t>()[row];
        const uint8_t* got = static_cast<const uint8_t*>(recv[q].x.data()) + row * H;
        const float* got_s = recv[q].scales.data_ptr<float>() + row * nb;
        if (sr < 0) {
          for (int64_t j = 0; j < H; ++j) ASSERT_EQ(got[j], 0) << "pad row " << row;
          continue;
        }
        // the token's own quantization, made here
        Tensor tok = Tensor::empty({1, H}, DType::kBFloat16);
        std::memcpy(tok.data(), static_cast<const uint8_t*>(in16[sr].x.data()) + st * H * 2, H * 2);
        Tensor want = Tensor::empty({1, H}, DType::kFloat8E4M3);
        Tensor want_s = Tensor::empty({1, nb}, DType::kFloat32);
        quantize(tok, qc, want, want_s);
        ASSERT_EQ(std::memcmp(got, want.data(), H), 0) << "row " << row;
        ASSERT_EQ(std::memcmp(got_s, want_s.data(), nb * 4), 0) << "row " << row;
      }
    }
  }
  // x of another dtype, scales given, another scaling: clear errors
  Handle h;
  const QuantizeConfig qc{};
  std::vector<RankInput> f32 = in16;
  f32[2].x = Tensor::zeros(f32[2].x.sizes(), DType::kFloat32);
  EXPECT_THROW(ep_reference::dispatch_quantize(f32, s.cfg, qc, h), Error);
  std::vector<RankInput> with_scales = in16;
  with_scales[1].scales = Tensor::empty({with_scales[1].x.size(0), 1}, DType::kFloat32);
  EXPECT_THROW(ep_reference::dispatch_quantize(with_scales, s.cfg, qc, h), Error);
  QuantizeConfig tw = qc;
  tw.scaling = QuantScaling::kTensorwise;
  EXPECT_THROW(ep_reference::dispatch_quantize(in16, s.cfg, tw, h), Error);
}

// The layout the fused NVLink dispatch computes on the device from the
// exchanged count matrix (core/ep_layout.h) gives every slot the reference's
// row, and every rank the reference's plan, with and without drops.
TEST(EpLayout, CountMatrixGivesTheReferenceRows) {
  for (int W : {1, 2, 4, 8})
    for (int align : {1, 16})
      for (int64_t capacity : {int64_t{-1}, int64_t{96}}) {
        SCOPED_TRACE(::testing::Message() << "W=" << W << " align=" << align << " capacity=" << capacity);
        const int E = 32, K = 4;
        EpSetup s = random_setup(W, E, K, 8, align, 700 + W * 10 + align);
        s.cfg.capacity_rows = capacity;
        Handle h;
        auto recv = ep_reference::dispatch(s.in, s.cfg, h);
        const int64_t cap = h.config.capacity_rows;
        std::vector<int32_t> counts(static_cast<size_t>(W) * E, 0);
        for (int r = 0; r < W; ++r)
          for (int64_t i = 0; i < s.in[r].ids.numel(); ++i) {
            const int32_t g = s.in[r].ids.data_ptr<int32_t>()[i];
            if (g >= 0) ++counts[static_cast<size_t>(r) * E + g];
          }
        int64_t dropped_slots = 0;
        for (int r = 0; r < W; ++r) {
          std::vector<int64_t> rank_in_run(E, 0);  // the slot's rank among r's slots to g
          for (int64_t i = 0; i < s.in[r].ids.numel(); ++i) {
            const int32_t g = s.in[r].ids.data_ptr<int32_t>()[i];
            const int64_t want = h.dest_row[r].data_ptr<int64_t>()[i];
            if (g < 0) {
              ASSERT_EQ(want, -1);
              continue;
            }
            const EpSlotRange range = ep_slot_range(counts.data(), W, E, r, g, cap, align);
            const int64_t rk = rank_in_run[g]++;
            const int64_t got = rk < range.fit ? range.first_row + rk : -1;
            ASSERT_EQ(got, want) << "rank " << r << " slot " << i;
            dropped_slots += got < 0;
          }
        }
        int64_t dropped_recv = 0;
        for (int q = 0; q < W; ++q) {
          const int L = E / W;
          std::vector<int32_t> kept(L);
          std::vector<int64_t> offsets(L + 1);
          int64_t dropped = 0;
          ep_recv_layout(counts.data(), W, E, q, cap, align, kept.data(), offsets.data(), &dropped);
          EXPECT_EQ(kept, to_vec<int32_t>(recv[q].tokens_per_expert));
          EXPECT_EQ(offsets, to_vec<int64_t>(recv[q].expert_row_offsets));
          EXPECT_EQ(dropped, recv[q].dropped);
          dropped_recv += dropped;
        }
        EXPECT_EQ(dropped_slots, dropped_recv);
        if (capacity > 0 && W >= 2) EXPECT_GT(dropped_recv, 0) << "the tight capacity must drop";
      }
}

TEST(EpReference, AllTokensToOneRankAndOverflow) {
  const int W = 4, E = 16, K = 2;
  std::vector<RankInput> in;
  for (int r = 0; r < W; ++r) {
    Tensor ids = make_tensor({50, K}, DType::kInt32);
    for (int64_t i = 0; i < 100; ++i) ids.data_ptr<int32_t>()[i] = 8 + (i % 4);  // rank 2's experts
    in.push_back(rank_input(ids, 16, DType::kFloat32, 200 + r));
  }
  Handle h;
  auto recv = ep_reference::dispatch(in, EpConfig{W, E, 16, 50, -1}, h);
  EXPECT_EQ(recv[2].total_rows, 448);  // 4 experts x 100 rows, each padded to 112
  for (int q : {0, 1, 3}) EXPECT_EQ(recv[q].total_rows, 0);
  // a small capacity drops deterministically and counts it
  Handle h2;
  auto small = ep_reference::dispatch(in, EpConfig{W, E, 16, 50, 160}, h2);
  EXPECT_EQ(small[2].total_rows, 160);
  EXPECT_EQ(small[2].dropped, 252);  // expert 9 keeps 48 (room 160-112), 10 and 11 none
  EXPECT_EQ(to_vec<int32_t>(small[2].tokens_per_expert), (std::vector<int32_t>{100, 48, 0, 0}));
  int64_t minus = 0;
  for (int r = 0; r < W; ++r)
    for (int64_t v : to_vec<int64_t>(h2.dest_row[r])) minus += v < 0;
  EXPECT_EQ(minus, 252);
}

// <dispatch(x), g> = <x, dispatch_backward(g)>; <combine(y, w), d> = <y, grad_y>;
// dprobs by finite differences in w.
TEST(EpReference, BackwardAdjoints) {
  EpSetup s = random_setup(4, 16, 3, 12, 16, 300);
  for (auto& r : s.in) {  // float32 data for exact-ish identities
    Tensor xf = make_tensor(r.x.sizes(), DType::kFloat32);
    for (int64_t i = 0; i < r.x.numel(); ++i) xf.data_ptr<float>()[i] = at(r.x, i);
    r.x = xf;
  }
  Handle h;
  auto recv = ep_reference::dispatch(s.in, s.cfg, h);
  const int W = 4;
  std::vector<Tensor> g, y, w, d;
  for (int q = 0; q < W; ++q) {
    Tensor gq = Tensor::zeros({h.config.capacity_rows, 12}, DType::kFloat32);
    Tensor yq = Tensor::zeros({h.config.capacity_rows, 12}, DType::kFloat32);
    Tensor used = make_tensor({recv[q].total_rows, 12}, DType::kFloat32);
    fill_random(used, 400 + q);
    std::memcpy(gq.data(), used.data(), used.nbytes());
    fill_random(used, 500 + q);
    std::memcpy(yq.data(), used.data(), used.nbytes());
    g.push_back(gq);
    y.push_back(yq);
  }
  for (int r = 0; r < W; ++r) {
    w.push_back(s.in[r].probs);
    Tensor dr = make_tensor({s.in[r].x.size(0), 12}, DType::kFloat32);
    fill_random(dr, 600 + r);
    d.push_back(dr);
  }
  auto dot = [](const Tensor& a, const Tensor& b, int64_t n) {
    double v = 0;
    for (int64_t i = 0; i < n; ++i) v += double(at(a, i)) * at(b, i);
    return v;
  };
  // dispatch adjoint (only data rows of recv hold x)
  auto gx = ep_reference::dispatch_backward(g, h, DType::kFloat32);
  double lhs = 0, rhs = 0;
  for (int q = 0; q < W; ++q)
    for (int64_t row = 0; row < recv[q].total_rows; ++row)
      if (recv[q].src_rank.data_ptr<int32_t>()[row] >= 0)
        for (int64_t j = 0; j < 12; ++j) lhs += double(recv[q].x.data_ptr<float>()[row * 12 + j]) * g[q].data_ptr<float>()[row * 12 + j];
  for (int r = 0; r < W; ++r) rhs += dot(s.in[r].x, gx[r], s.in[r].x.numel());
  EXPECT_NEAR(lhs, rhs, 1e-4 * (1 + std::fabs(lhs)));
  // combine adjoint and dprobs
  std::vector<Tensor> gy, dprobs;
  ep_reference::combine_backward(d, h, y, w, gy, dprobs);
  auto loss = [&](const std::vector<Tensor>& ww) {
    auto o = ep_reference::combine(y, h, ww, DType::kFloat32);
    double l = 0;
    for (int r = 0; r < W; ++r) l += dot(o[r], d[r], o[r].numel());
    return l;
  };
  double lhs2 = 0;
  for (int q = 0; q < W; ++q)
    for (int64_t row = 0; row < recv[q].total_rows; ++row)
      if (recv[q].src_rank.data_ptr<int32_t>()[row] >= 0)
        for (int64_t j = 0; j < 12; ++j) lhs2 += double(y[q].data_ptr<float>()[row * 12 + j]) * gy[q].data_ptr<float>()[row * 12 + j];
      else if (row < recv[q].total_rows)
        for (int64_t j = 0; j < 12; ++j) ASSERT_EQ(gy[q].data_ptr<float>()[row * 12 + j], 0.0f) << "pad row";
  EXPECT_NEAR(lhs2, loss(w), 1e-4 * (1 + std::fabs(lhs2)));
  for (int r = 1; r < W; ++r)
    for (int64_t sidx = 0; sidx < std::min<int64_t>(6, dprobs[r].numel()); ++sidx) {
      std::vector<Tensor> wp, wm;
      for (int rr = 0; rr < W; ++rr) {
        wp.push_back(w[rr].to(Device::cpu()));
        wm.push_back(w[rr].to(Device::cpu()));
      }
      wp[r].data_ptr<float>()[sidx] += 0.25f;
      wm[r].data_ptr<float>()[sidx] -= 0.25f;
      const double fd = (loss(wp) - loss(wm)) / 0.5;
      EXPECT_NEAR(dprobs[r].data_ptr<float>()[sidx], fd, 1e-4 * (1 + std::fabs(fd)));
    }
}

TEST(EpReference, BadInputErrors) {
  std::vector<RankInput> in = {rank_input(ids_of({{0, 1}}, 2), 8, DType::kFloat32, 1)};
  Handle h;
  EXPECT_NE(message_of([&] { ep_reference::dispatch(in, EpConfig{3, 4, 1, 4, -1}, h); })
                .find("num_experts must be a positive multiple of world_size=3, got 4"),
            std::string::npos);
  EXPECT_NE(message_of([&] { ep_reference::dispatch(in, EpConfig{2, 4, 1, 4, -1}, h); })
                .find("dispatch: 2 rank inputs expected, got 1"),
            std::string::npos);
  std::vector<RankInput> bad = {rank_input(ids_of({{0, 7}}, 2), 8, DType::kFloat32, 1)};
  EXPECT_NE(message_of([&] { ep_reference::dispatch(bad, EpConfig{1, 4, 1, 4, -1}, h); })
                .find("rank 0: ids[0,1] = 7 is outside [-1, 4)"),
            std::string::npos);
  std::vector<RankInput> two = {rank_input(ids_of({{0, 1}}, 2), 8, DType::kFloat32, 1),
                                rank_input(ids_of({{0, 1}}, 2), 16, DType::kFloat32, 2)};
  EXPECT_NE(message_of([&] { ep_reference::dispatch(two, EpConfig{2, 4, 1, 4, -1}, h); })
                .find("rank 1: x must be float32 [T,8], got float32 [1,16]"),
            std::string::npos);
  EXPECT_NE(message_of([&] { ep_reference::dispatch(in, EpConfig{1, 4, 1, 0, -1}, h); })
                .find("exceed EpConfig.max_tokens_per_rank=0"),
            std::string::npos);
}

// The device backends' options (checked at group creation, before any GPU
// work): a value out of range names the field.
TEST(EpOptionsCheck, OutOfRangeNamesTheField) {
  EpOptions o;
  o.num_experts = 8;
  o.topk = 2;
  o.hidden = 128;
  o.max_tokens_per_rank = 16;
  EXPECT_EQ(message_of([&] { check_ep_options(o, 2); }), "no error");
  for (const int v : {-1, 0, 1}) {
    o.nvlink_quantize_in_dispatch = v;
    EXPECT_EQ(message_of([&] { check_ep_options(o, 2); }), "no error") << v;
  }
  o.nvlink_quantize_in_dispatch = 2;
  EXPECT_NE(message_of([&] {
              check_ep_options(o, 2);
            }).find("nvlink_quantize_in_dispatch must be -1 (auto), 0 or 1, got 2"),
            std::string::npos);
  o.nvlink_quantize_in_dispatch = -1;
  o.nvlink_recv_regions = 0;
  EXPECT_NE(message_of([&] { check_ep_options(o, 2); }).find("nvlink_recv_regions must be in"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
