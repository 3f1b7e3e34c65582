// CPU RoutingPlan tests: hand-worked maps, random routings against a naive
// builder, edge shapes, every align, both routing forms, capacity overflow,
// bad input.
#include "test_util.h"

namespace moeflow::test {
namespace {

RoutingPlan cpu_plan(const Tensor& ids, int E, int align, int64_t capacity = -1) {
  PlanConfig cfg{E, align, capacity};
  RoutingPlan plan = allocate_plan(ids.size(0), static_cast<int>(ids.size(1)), cfg, Device::cpu());
  build_plan(ids, plan);
  return plan;
}

Tensor ids_from(const std::vector<std::vector<int32_t>>& rows) {
  Tensor t = make_tensor({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())},
                         DType::kInt32);
  for (size_t i = 0; i < rows.size(); ++i)
    for (size_t k = 0; k < rows[i].size(); ++k)
      t.data_ptr<int32_t>()[i * rows[0].size() + k] = rows[i][k];
  return t;
}

TEST(Plan, HandWorkedAlign1) {
  // 4 tokens, top-2, 3 experts.
  Tensor ids = ids_from({{0, 2}, {2, 1}, {0, -1}, {1, 2}});
  RoutingPlan plan = cpu_plan(ids, 3, 1);
  EXPECT_EQ(to_vec<int32_t>(plan.tokens_per_expert), (std::vector<int32_t>{2, 2, 3}));
  EXPECT_EQ(to_vec<int64_t>(plan.expert_row_offsets), (std::vector<int64_t>{0, 2, 4, 7}));
  // expert 0: t0, t2 -> rows 0,1; expert 1: t1, t3 -> rows 2,3; expert 2: t0,t1,t3 -> 4,5,6
  EXPECT_EQ(to_vec<int64_t>(plan.dest_row), (std::vector<int64_t>{0, 4, 5, 2, 1, -1, 3, 6}));
  auto row_token = to_vec<int32_t>(plan.row_token);  // capacity 8, 7 rows used
  auto row_k = to_vec<int32_t>(plan.row_k);
  EXPECT_EQ(std::vector<int32_t>(row_token.begin(), row_token.begin() + 7),
            (std::vector<int32_t>{0, 2, 1, 3, 0, 1, 3}));
  EXPECT_EQ(std::vector<int32_t>(row_k.begin(), row_k.begin() + 7),
            (std::vector<int32_t>{0, 0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(plan_status(plan).total_rows, 7);
  EXPECT_EQ(plan_status(plan).overflow, 0);
}

TEST(Plan, CapacityIsWorstCaseRoundedToAlign) {
  PlanConfig cfg{4, 16, -1};
  EXPECT_EQ(plan_capacity_rows(3, 2, cfg), 80);  // 6 + 60 = 66 -> 80
  EXPECT_EQ(plan_capacity_rows(0, 8, cfg), 64);  // 0 + 60 -> 64
  EXPECT_EQ(plan_capacity_rows(10, 2, PlanConfig{8, 1, -1}), 20);
  EXPECT_EQ(plan_capacity_rows(10, 2, PlanConfig{8, 1, 7}), 7);
}

TEST(Plan, HandWorkedPadding) {
  Tensor ids = ids_from({{3, 0}, {0, 3}, {3, 1}});  // expert 2 empty
  RoutingPlan plan = cpu_plan(ids, 4, 16);
  EXPECT_EQ(to_vec<int32_t>(plan.tokens_per_expert), (std::vector<int32_t>{2, 1, 0, 3}));
  EXPECT_EQ(to_vec<int32_t>(plan.padded_tokens_per_expert), (std::vector<int32_t>{16, 16, 0, 16}));
  EXPECT_EQ(to_vec<int64_t>(plan.expert_row_offsets), (std::vector<int64_t>{0, 16, 32, 32, 48}));
  EXPECT_EQ(to_vec<int64_t>(plan.dest_row), (std::vector<int64_t>{32, 0, 1, 33, 34, 16}));
  auto rt = to_vec<int32_t>(plan.row_token);
  EXPECT_EQ(rt[0], 0);
  EXPECT_EQ(rt[1], 1);
  for (int r = 2; r < 16; ++r) EXPECT_EQ(rt[r], -1) << r;
  EXPECT_EQ(rt[16], 2);
  for (int r = 17; r < 32; ++r) EXPECT_EQ(rt[r], -1) << r;
  EXPECT_EQ(rt[32], 0);
  EXPECT_EQ(rt[33], 1);
  EXPECT_EQ(rt[34], 2);
  EXPECT_EQ(plan_status(plan).total_rows, 48);
}

TEST(Plan, RandomRoutingsMatchNaiveEveryAlign) {
  uint32_t seed = 1;
  for (int align : {1, 16, 32, 64, 128, 256}) {
    for (auto [T, K, E] : std::vector<std::tuple<int64_t, int, int>>{
             {0, 2, 4}, {1, 1, 1}, {1, 8, 16}, {13, 2, 8}, {97, 8, 64}, {331, 4, 7}, {1024, 8, 256}}) {
      for (double skew : {0.0, 2.0}) {
        Tensor ids = random_topk(T, K, E, seed++, skew, 0.1, seed % 2 ? DType::kInt32 : DType::kInt64);
        RoutingPlan plan = cpu_plan(ids, E, align);
        NaivePlan want = naive_plan(slot_experts_of_ids(ids), T, K, E, align, plan.capacity_rows);
        SCOPED_TRACE(::testing::Message() << "T=" << T << " K=" << K << " E=" << E << " align=" << align);
        expect_plan_equals(plan, want);
      }
    }
  }
}

TEST(Plan, AllTokensOnOneExpert) {
  Tensor ids = make_tensor({37, 1}, DType::kInt32);
  for (int i = 0; i < 37; ++i) ids.data_ptr<int32_t>()[i] = 5;
  RoutingPlan plan = cpu_plan(ids, 8, 32);
  NaivePlan want = naive_plan(slot_experts_of_ids(ids), 37, 1, 8, 32, plan.capacity_rows);
  expect_plan_equals(plan, want);
  EXPECT_EQ(to_vec<int32_t>(plan.padded_tokens_per_expert)[5], 64);
}

TEST(Plan, MaskFormMatchesEquivalentIds) {
  for (int align : {1, 16, 128}) {
    Tensor mask = random_mask(211, 16, 3, 77 + align);
    PlanConfig cfg{16, align, -1};
    RoutingPlan plan = allocate_plan(211, 16, cfg, Device::cpu());
    build_plan_from_mask(mask, plan);
    NaivePlan want = naive_plan(slot_experts_of_mask(mask), 211, 16, 16, align, plan.capacity_rows);
    expect_plan_equals(plan, want);
  }
}

TEST(Plan, CapacityOverflowDropsDeterministically) {
  Tensor ids = random_topk(200, 4, 8, 3);
  for (int64_t cap : {0, 16, 256, 512, 800}) {
    RoutingPlan plan = cpu_plan(ids, 8, 16, cap);
    NaivePlan want = naive_plan(slot_experts_of_ids(ids), 200, 4, 8, 16, cap);
    SCOPED_TRACE(cap);
    expect_plan_equals(plan, want);
    PlanStatus s = plan_status(plan);
    EXPECT_LE(s.total_rows, cap);
    EXPECT_EQ(s.overflow, want.dropped);
    EXPECT_GT(s.overflow, 0);
  }
  RoutingPlan full = cpu_plan(ids, 8, 16);  // worst-case capacity: nothing dropped
  EXPECT_EQ(plan_status(full).overflow, 0);
}

TEST(Plan, BadInputErrors) {
  PlanConfig cfg{4, 16, -1};
  RoutingPlan plan = allocate_plan(2, 2, cfg, Device::cpu());
  // expert id out of range
  Tensor ids = ids_from({{0, 4}, {1, 2}});
  EXPECT_NE(message_of([&] { build_plan(ids, plan); }).find("topk_ids[0,1] = 4 is outside [-1, 4)"),
            std::string::npos);
  Tensor neg = ids_from({{0, 1}, {-2, 2}});
  EXPECT_NE(message_of([&] { build_plan(neg, plan); }).find("topk_ids[1,0] = -2"), std::string::npos);
  // wrong dtype
  Tensor fids = make_tensor({2, 2}, DType::kFloat32);
  EXPECT_NE(message_of([&] { build_plan(fids, plan); }).find("topk_ids must be int32 or int64 [2,2] on cpu, got float32"),
            std::string::npos);
  // shape mismatch with the plan
  Tensor big = ids_from({{0, 1}, {1, 2}, {2, 3}});
  EXPECT_NE(message_of([&] { build_plan(big, plan); }).find("plan was allocated for [T,K]=[2,2]"),
            std::string::npos);
  // config errors
  EXPECT_NE(message_of([&] { allocate_plan(2, 2, PlanConfig{4, 8, -1}, Device::cpu()); })
                .find("PlanConfig.align must be one of 1, 16, 32, 64, 128, 256, got 8"),
            std::string::npos);
  EXPECT_NE(message_of([&] { allocate_plan(2, 2, PlanConfig{0, 1, -1}, Device::cpu()); })
                .find("num_experts must be > 0"),
            std::string::npos);
  EXPECT_NE(message_of([&] { allocate_plan(2, 2, PlanConfig{4, 16, 40}, Device::cpu()); })
                .find("capacity_rows must be a multiple of align=16, got 40"),
            std::string::npos);
  // mask of the wrong width
  Tensor mask = Tensor::zeros({2, 3}, DType::kUInt8);
  RoutingPlan mplan = allocate_plan(2, 4, cfg, Device::cpu());
  EXPECT_NE(message_of([&] { build_plan_from_mask(mask, mplan); }).find("routing_mask must be [T,E] with E=4"),
            std::string::npos);
  // non-contiguous ids
  int32_t buf[8] = {0, 0, 1, 1, 2, 2, 3, 3};
  auto strided = TensorView::strided(buf, DType::kInt32, Device::cpu(), {2, 2}, {4, 2});
  EXPECT_NE(message_of([&] { build_plan(strided, plan); }).find("topk_ids must be contiguous"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
