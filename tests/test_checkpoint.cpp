// Checkpoint tests (CPU, CI): safetensors round trips and parse errors;
// expert parameters across key layouts (per-expert / grouped), storages
// (stacked / per-expert tensors) and GLU row orders, bitwise; clear errors for
// missing, ambiguous, incomplete, extra and wrongly shaped keys.
#include <cstdio>

#include "moeflow/checkpoint.h"
#include "test_util.h"

namespace moeflow::test {
namespace {

std::vector<std::pair<std::string, TensorView>> views(const std::vector<std::pair<std::string, Tensor>>& t) {
  std::vector<std::pair<std::string, TensorView>> v;
  for (const auto& [k, x] : t) v.emplace_back(k, x.view());
  return v;
}

TEST(Safetensors, RoundTripBytesShapesDtypesMetadata) {
  Tensor a = make_tensor({3, 5}, DType::kBFloat16), b = make_tensor({7}, DType::kFloat32);
  Tensor c = make_tensor({2, 2, 3}, DType::kFloat8E4M3), d = make_tensor({0, 4}, DType::kInt64);
  fill_random(a, 1);
  fill_random(b, 2);
  fill_random(c, 3);
  const std::string path = ::testing::TempDir() + "/moeflow_rt.safetensors";
  write_safetensors(path, {{"a", a}, {"b", b}, {"c", c}, {"d", d}}, {{"format", "pt"}});
  SafetensorsFile f = SafetensorsFile::read(path);
  EXPECT_EQ(f.keys(), (std::vector<std::string>{"a", "b", "c", "d"}));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  for (const auto& [k, t] : std::vector<std::pair<std::string, Tensor>>{{"a", a}, {"b", b}, {"c", c}, {"d", d}}) {
    TensorView v = f.view(k);
    EXPECT_EQ(v.dtype, t.dtype()) << k;
    EXPECT_EQ(v.sizes(), t.sizes()) << k;
    EXPECT_EQ(0, t.nbytes() ? std::memcmp(v.data, t.data(), t.nbytes()) : 0) << k;
  }
  std::remove(path.c_str());
}

TEST(Safetensors, ParseErrors) {
  Tensor a = make_tensor({4}, DType::kFloat32);
  fill_random(a, 4);
  std::vector<uint8_t> good = serialize_safetensors({{"a", a}});
  EXPECT_NE(message_of([] { SafetensorsFile::parse({1, 2, 3}); }).find("not a safetensors file"), std::string::npos);
  std::vector<uint8_t> truncated(good.begin(), good.end() - 4);
  EXPECT_NE(message_of([&] { SafetensorsFile::parse(truncated); }).find("do not hold 16 bytes"), std::string::npos);
  std::vector<uint8_t> huge = good;
  huge[6] = 0x7F;  // header length far past the file
  EXPECT_NE(message_of([&] { SafetensorsFile::parse(huge); }).find("exceeds the file"), std::string::npos);
  std::vector<uint8_t> garbled = good;
  garbled[9] = '#';
  EXPECT_NE(message_of([&] { SafetensorsFile::parse(garbled); }).find("bad safetensors header"), std::string::npos);
  EXPECT_NE(message_of([&] { serialize_safetensors({{"a", a}, {"a", a}}); }).find("duplicate key 'a'"),
            std::string::npos);
  EXPECT_NE(message_of([&] { SafetensorsFile::parse(good).view("b"); }).find("no tensor 'b'"), std::string::npos);
}

ExpertParam fc1(int E, int64_t F, int64_t H, int interleave) {
  ExpertParam p;
  p.prefix = "decoder.layers.0.mlp.experts.linear_fc1.";
  p.num_experts = E;
  p.shape = {2 * F, H};
  p.glu_interleave = interleave;
  return p;
}

// Every (file key layout, file row order) -> canonical stacked and per-expert
// storages -> back to the same file entries, bitwise.
TEST(ExpertCheckpoint, AllLayoutsRoundTripBitwise) {
  const int E = 4;
  const int64_t F = 64, H = 24;
  Tensor canonical = make_tensor({E, 2 * F, H}, DType::kBFloat16);
  fill_random(canonical, 5);
  for (int interleave : {0, 32, 16}) {
    for (ExpertKeyLayout layout : {ExpertKeyLayout::kGrouped, ExpertKeyLayout::kPerExpert}) {
      SCOPED_TRACE(::testing::Message() << "interleave " << interleave << " layout " << int(layout));
      const ExpertParam p = fc1(E, F, H, interleave);
      auto entries = export_expert_param(p, canonical.view(), layout);
      SafetensorsFile f = SafetensorsFile::parse(serialize_safetensors(views(entries)));
      EXPECT_EQ(find_expert_layout(f, p), layout);
      // into a stacked tensor
      Tensor stacked = make_tensor({E, 2 * F, H}, DType::kBFloat16);
      load_expert_param(f, p, stacked.view());
      EXPECT_TRUE(bytes_equal(stacked, canonical));
      // into per-expert tensors
      std::vector<Tensor> parts;
      std::vector<TensorView> part_views;
      for (int e = 0; e < E; ++e) {
        parts.push_back(make_tensor({2 * F, H}, DType::kBFloat16));
        part_views.push_back(parts.back());
      }
      load_expert_param(f, p, part_views);
      for (int e = 0; e < E; ++e)
        ASSERT_EQ(0, std::memcmp(parts[e].data(), static_cast<uint8_t*>(canonical.data()) + e * 2 * F * H * 2,
                                 2 * F * H * 2));
      // and back from per-expert storage to the same file entries
      auto again = export_expert_param(p, part_views, layout);
      ASSERT_EQ(again.size(), entries.size());
      for (size_t i = 0; i < entries.size(); ++i) {
        EXPECT_EQ(again[i].first, entries[i].first);
        EXPECT_TRUE(bytes_equal(again[i].second, entries[i].second));
      }
    }
  }
}

// The user story of per-expert checkpoints: Megatron-style per-expert keys
// with interleaved GLU rows, loaded into E separate tensors (canonical halves
// rows), run through the grouped MLP by their address tables; the same as
// loading into stacked weights, bitwise (CPU backend).
TEST(ExpertCheckpoint, PerExpertTensorsRunTheMlpAsStacked) {
  const int E = 3;
  const int64_t F = 64, H = 32, rows = 40;
  const ExpertParam p1 = fc1(E, F, H, 32);
  ExpertParam p2;
  p2.prefix = "decoder.layers.0.mlp.experts.linear_fc2.";
  p2.num_experts = E;
  p2.shape = {H, F};
  Tensor w1 = make_tensor({E, 2 * F, H}, DType::kBFloat16), w2 = make_tensor({E, H, F}, DType::kBFloat16);
  fill_random(w1, 11, -0.3f, 0.3f);
  fill_random(w2, 12, -0.3f, 0.3f);
  auto entries = export_expert_param(p1, w1.view(), ExpertKeyLayout::kPerExpert);
  for (auto& e : export_expert_param(p2, w2.view(), ExpertKeyLayout::kPerExpert)) entries.push_back(e);
  SafetensorsFile f = SafetensorsFile::parse(serialize_safetensors(views(entries)));

  Tensor s1 = make_tensor({E, 2 * F, H}, DType::kBFloat16), s2 = make_tensor({E, H, F}, DType::kBFloat16);
  load_expert_param(f, p1, s1.view());
  load_expert_param(f, p2, s2.view());
  std::vector<Tensor> parts;
  std::vector<TensorView> v1, v2;
  for (int e = 0; e < E; ++e) {
    parts.push_back(make_tensor({2 * F, H}, DType::kBFloat16));
    v1.push_back(parts.back());
    parts.push_back(make_tensor({H, F}, DType::kBFloat16));
    v2.push_back(parts.back());
  }
  load_expert_param(f, p1, v1);
  load_expert_param(f, p2, v2);
  const ExpertTable t1 = make_expert_table(v1), t2 = make_expert_table(v2);

  Tensor x = make_tensor({rows, H}, DType::kBFloat16);
  fill_random(x, 13);
  Tensor offs = make_tensor({E + 1}, DType::kInt64);
  const int64_t o[] = {0, 16, 16, rows};
  for (int e = 0; e <= E; ++e) offs.data_ptr<int64_t>()[e] = o[e];
  GroupLayout g;
  g.offsets = offs;
  GroupedMlpConfig cfg;
  auto run = [&](const GroupedMlpWeights& w) {
    Tensor y = make_tensor({rows, H}, DType::kBFloat16), h = make_tensor({rows, 2 * F}, DType::kBFloat16),
           a = make_tensor({rows, F}, DType::kBFloat16);
    grouped_mlp_forward(x, w, g, {}, cfg, y, GroupedMlpSaved{h, a});
    return std::vector<Tensor>{y, h, a};
  };
  GroupedMlpWeights separate;
  separate.fc1_experts = t1.weights;
  separate.fc2_experts = t2.weights;
  const auto want = run(GroupedMlpWeights{s1, s2, {}, {}}), got = run(separate);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(bytes_equal(got[i], want[i])) << i;
}

// Interleaved file rows: blocks of g gate rows then g up rows.
TEST(ExpertCheckpoint, InterleaveMapsGateAndUpRows) {
  const int64_t F = 4, H = 1;
  ExpertParam p = fc1(1, F, H, 2);
  p.dtype = DType::kFloat32;
  Tensor canonical = make_tensor({1, 2 * F, H}, DType::kFloat32);
  for (int i = 0; i < 2 * F; ++i) canonical.data_ptr<float>()[i] = float(i);  // gate 0..3, up 4..7
  auto entries = export_expert_param(p, canonical.view(), ExpertKeyLayout::kGrouped);
  const float* file_rows = entries[0].second.data_ptr<float>();
  EXPECT_EQ(std::vector<float>(file_rows, file_rows + 8), (std::vector<float>{0, 1, 4, 5, 2, 3, 6, 7}));
}

TEST(ExpertCheckpoint, BiasesAndClearErrors) {
  const int E = 3;
  ExpertParam bias;
  bias.prefix = "experts.linear_fc2.";
  bias.stem = "bias";
  bias.num_experts = E;
  bias.shape = {8};
  bias.dtype = DType::kFloat32;
  Tensor b = make_tensor({E, 8}, DType::kFloat32);
  fill_random(b, 6);
  auto per = export_expert_param(bias, b.view(), ExpertKeyLayout::kPerExpert);
  EXPECT_EQ(per[2].first, "experts.linear_fc2.bias2");
  SafetensorsFile ok = SafetensorsFile::parse(serialize_safetensors(views(per)));
  Tensor back = make_tensor({E, 8}, DType::kFloat32);
  load_expert_param(ok, bias, back.view());
  EXPECT_TRUE(bytes_equal(back, b));

  // incomplete: bias1 missing
  auto missing = per;
  missing.erase(missing.begin() + 1);
  SafetensorsFile inc = SafetensorsFile::parse(serialize_safetensors(views(missing)));
  EXPECT_NE(message_of([&] { load_expert_param(inc, bias, back.view()); })
                .find("incomplete: 1 of 3 per-expert keys missing (experts.linear_fc2.bias1)"),
            std::string::npos);
  // ambiguous: grouped and per-expert keys both present
  auto both = per;
  auto grouped = export_expert_param(bias, b.view(), ExpertKeyLayout::kGrouped);
  both.push_back(grouped[0]);
  SafetensorsFile amb = SafetensorsFile::parse(serialize_safetensors(views(both)));
  EXPECT_NE(message_of([&] { find_expert_layout(amb, bias); }).find("ambiguous"), std::string::npos);
  // neither
  SafetensorsFile none = SafetensorsFile::parse(serialize_safetensors({{"other", b.view()}}));
  EXPECT_NE(message_of([&] { find_expert_layout(none, bias); })
                .find("neither 'experts.linear_fc2.bias' [E,...] nor 'experts.linear_fc2.bias0'..'experts.linear_fc2.bias2'"),
            std::string::npos);
  // more experts in the file than configured
  ExpertParam two = bias;
  two.num_experts = 2;
  EXPECT_NE(message_of([&] { find_expert_layout(ok, two); }).find("has 'experts.linear_fc2.bias2' but num_experts is 2"),
            std::string::npos);
  // wrong shape / dtype
  ExpertParam wide = bias;
  wide.shape = {16};
  Tensor wide_dst = make_tensor({E, 16}, DType::kFloat32);
  EXPECT_NE(message_of([&] { load_expert_param(ok, wide, wide_dst.view()); })
                .find("'experts.linear_fc2.bias0' must be float32 [16], got float32 [8] on cpu"),
            std::string::npos);
  SafetensorsFile g = SafetensorsFile::parse(serialize_safetensors(views(grouped)));
  ExpertParam half = bias;
  half.dtype = DType::kBFloat16;
  Tensor half_dst = make_tensor({E, 8}, DType::kBFloat16);
  EXPECT_NE(message_of([&] { load_expert_param(g, half, half_dst.view()); })
                .find("'experts.linear_fc2.bias' must be bfloat16 [3,8], got float32 [3,8]"),
            std::string::npos);
  // interleave that does not divide F; wrong destination
  ExpertParam bad = fc1(2, 6, 4, 4);
  EXPECT_NE(message_of([&] { find_expert_layout(ok, bad); }).find("cannot be interleaved in blocks of 4"),
            std::string::npos);
  Tensor wrong = make_tensor({E, 9}, DType::kFloat32);
  EXPECT_NE(message_of([&] { load_expert_param(ok, bias, wrong.view()); }).find("dst must be float32 [3,8]"),
            std::string::npos);
}

}  // namespace
}  // namespace moeflow::test
