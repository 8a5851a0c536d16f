#include "core/layout.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/opgraph.h"
#include "core/plan.h"

namespace nnsim {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

Mesh mesh_of(std::vector<MeshAxis> axes) {
  Mesh m;
  m.axes = std::move(axes);
  return m;
}

// A [b, s, h] bf16 tensor of 2 x 1024 x 512 elements (2 MiB).
TensorSpec bsh_tensor() {
  TensorSpec t;
  t.elements = 2.0 * 1024 * 512;
  t.dims = {Dim::kBatch, Dim::kSeq, Dim::kHidden};
  t.bytes_per_element = 2;
  return t;
}

constexpr AxisLayout R{AxisLayoutKind::kReplicated, Dim::kBatch};
constexpr AxisLayout P{AxisLayoutKind::kPartial, Dim::kBatch};
constexpr AxisLayout S(Dim d) {
  return AxisLayout{AxisLayoutKind::kSplit, d};
}

// One axis "tp" of size 4: the R/V/D conversion table of core/layout.h.
TEST(Layout, ConversionTable) {
  const Mesh mesh = mesh_of({{"tp", 4}});
  const TensorSpec t = bsh_tensor();
  const double full = t.bytes();
  struct Case {
    const char* name;
    AxisLayout have, want;
    bool any;
    CollectiveKind kind;
    double bytes;  // nccl-tests convention, per device
  };
  const Case cases[] = {
      {"P->R", P, R, true, CollectiveKind::kAllReduce, full},                 // the buffer
      {"P->S", P, S(Dim::kSeq), true, CollectiveKind::kReduceScatter, full},  // the input
      {"S->R", S(Dim::kSeq), R, true, CollectiveKind::kAllGather, full},      // the output
      {"S->S'", S(Dim::kSeq), S(Dim::kHidden), true, CollectiveKind::kAllToAll, full / 4},
      {"R->S", R, S(Dim::kSeq), false, CollectiveKind::kAllReduce, 0},  // a local slice
      {"R->R", R, R, false, CollectiveKind::kAllReduce, 0},
      {"S->S", S(Dim::kSeq), S(Dim::kSeq), false, CollectiveKind::kAllReduce, 0},
  };
  for (const Case& c : cases) {
    auto conv = conversions(t, {c.have}, {c.want}, mesh);
    if (!c.any) {
      EXPECT_TRUE(conv.empty()) << c.name;
      continue;
    }
    ASSERT_EQ(conv.size(), 1u) << c.name;
    EXPECT_EQ(conv[0].axis, 0) << c.name;
    EXPECT_EQ(conv[0].kind, c.kind) << c.name << ": " << to_string(conv[0].kind);
    EXPECT_EQ(conv[0].bytes, c.bytes) << c.name;
  }
}

TEST(Layout, AxesOfSizeOneNeedNothing) {
  const Mesh mesh = mesh_of({{"dp", 1}, {"tp", 1}});
  const TensorSpec t = bsh_tensor();
  EXPECT_TRUE(conversions(t, {P, S(Dim::kSeq)}, {R, R}, mesh).empty());
}

// Conversions go axis by axis in mesh order, each sized by what the other axes leave.
TEST(Layout, TwoAxesConvertInMeshOrder) {
  const Mesh mesh = mesh_of({{"cp", 2}, {"tp", 4}});
  const TensorSpec t = bsh_tensor();
  const double full = t.bytes();
  // cp: P -> R all-reduce while tp still splits the sequence (full / 4); then tp: S -> R
  // all-gather of the whole tensor.
  auto conv = conversions(t, {P, S(Dim::kSeq)}, {R, R}, mesh);
  ASSERT_EQ(conv.size(), 2u);
  EXPECT_EQ(conv[0].axis, 0);
  EXPECT_EQ(conv[0].kind, CollectiveKind::kAllReduce);
  EXPECT_EQ(conv[0].bytes, full / 4);
  EXPECT_EQ(conv[1].axis, 1);
  EXPECT_EQ(conv[1].kind, CollectiveKind::kAllGather);
  EXPECT_EQ(conv[1].bytes, full);
  // cp: S(seq) -> R all-gather with tp splitting hidden: output full / 4.
  conv = conversions(t, {S(Dim::kSeq), S(Dim::kHidden)}, {R, S(Dim::kHidden)}, mesh);
  ASSERT_EQ(conv.size(), 1u);
  EXPECT_EQ(conv[0].kind, CollectiveKind::kAllGather);
  EXPECT_EQ(conv[0].bytes, full / 4);
}

TEST(Layout, PieceBytes) {
  const Mesh mesh = mesh_of({{"cp", 2}, {"tp", 4}});
  const TensorSpec t = bsh_tensor();
  EXPECT_EQ(piece_bytes(t, {R, R}, mesh), t.bytes());
  EXPECT_EQ(piece_bytes(t, {P, R}, mesh), t.bytes());  // partial sums are full-sized
  EXPECT_EQ(piece_bytes(t, {S(Dim::kSeq), S(Dim::kHidden)}, mesh), t.bytes() / 8);
  // A split along a dimension the tensor does not span does not shrink it.
  EXPECT_EQ(piece_bytes(t, {R, S(Dim::kFfn)}, mesh), t.bytes());
}

ModelSpec small_model() {
  ModelSpec m;
  m.name = "small";
  m.layers = 2;
  m.hidden = 64;
  m.heads = 8;
  m.kv_heads = 2;
  m.ffn_hidden = 256;
  m.vocab = 1000;
  m.seq_len = 128;
  return m;
}

Plan plan_with(std::vector<MeshAxis> axes, std::vector<PartitionRule> rules) {
  Plan p;
  p.mesh = mesh_of(std::move(axes));
  p.partition = std::move(rules);
  return p;
}

const Op& op_named(const GraphPart& part, const std::string& name, int* index) {
  for (size_t i = 0; i < part.ops.size(); ++i) {
    if (part.ops[i].name == name) {
      *index = static_cast<int>(i);
      return part.ops[i];
    }
  }
  ADD_FAILURE() << name;
  return part.ops[0];
}

// Megatron's column- and row-parallel linears: the output layouts and the layouts of the
// gradients they produce.
TEST(Layout, MegatronTensorParallelLayouts) {
  OpGraph g = lower_model(small_model(), 1);
  Plan plan = plan_with({{"dp", 1}, {"tp", 2}}, {{"attn.qkv", {{Dim::kHeads, {"tp"}}}},
                                                 {"attn.core", {{Dim::kHeads, {"tp"}}}},
                                                 {"attn.proj", {{Dim::kHeads, {"tp"}}}},
                                                 {"*.norm", {{Dim::kSeq, {"tp"}}}},
                                                 {"*.residual", {{Dim::kSeq, {"tp"}}}}});
  auto parts = resolve_partitions(g.blocks[0], plan);
  ASSERT_TRUE(parts.ok()) << parts.error().message();
  int qkv = 0, proj = 0, norm = 0;
  const Op& q = op_named(g.blocks[0], "attn.qkv", &qkv);
  const Op& o = op_named(g.blocks[0], "attn.proj", &proj);
  const Op& n = op_named(g.blocks[0], "attn.norm", &norm);
  EXPECT_EQ((*parts)[qkv].factor(Dim::kHeads, plan.mesh), 2);
  EXPECT_EQ((*parts)[norm].factor(Dim::kSeq, plan.mesh), 2);
  EXPECT_EQ((*parts)[norm].factor(Dim::kHeads, plan.mesh), 1);
  // Column-parallel: output split along heads; its input is needed whole, and the input's
  // gradient comes out as partial sums.
  EXPECT_EQ(output_layout(q, (*parts)[qkv]), (TensorLayout{R, S(Dim::kHeads)}));
  const DimSet bsh{Dim::kBatch, Dim::kSeq, Dim::kHidden};
  EXPECT_EQ(input_layout(q, (*parts)[qkv], bsh), (TensorLayout{R, R}));
  EXPECT_EQ(input_grad_layout(q, (*parts)[qkv], bsh), (TensorLayout{R, P}));
  // Row-parallel: sums over the split heads, so partial sums; its producer needs the whole
  // gradient.
  EXPECT_EQ(output_layout(o, (*parts)[proj]), (TensorLayout{R, P}));
  EXPECT_EQ(output_grad_layout(o, (*parts)[proj]), (TensorLayout{R, R}));
  // Sequence-parallel norm: split along the sequence on both sides.
  EXPECT_EQ(output_layout(n, (*parts)[norm]), (TensorLayout{R, S(Dim::kSeq)}));
  EXPECT_EQ(input_grad_layout(n, (*parts)[norm], bsh), (TensorLayout{R, S(Dim::kSeq)}));
}

TEST(Layout, LaterRulesReplaceEarlierOnes) {
  OpGraph g = lower_model(small_model(), 1);
  Plan plan = plan_with({{"dp", 1}, {"cp", 2}, {"tp", 2}},
                        {{"*", {{Dim::kSeq, {"cp"}}}}, {"mlp.fc1", {{Dim::kSeq, {}}}}});
  auto parts = resolve_partitions(g.blocks[0], plan);
  ASSERT_TRUE(parts.ok()) << parts.error().message();
  int fc1 = 0, fc2 = 0;
  op_named(g.blocks[0], "mlp.fc1", &fc1);
  op_named(g.blocks[0], "mlp.fc2", &fc2);
  EXPECT_EQ((*parts)[fc1].factor(Dim::kSeq, plan.mesh), 1);
  EXPECT_EQ((*parts)[fc2].factor(Dim::kSeq, plan.mesh), 2);
  // A dimension split over two axes: the product.
  plan = plan_with({{"dp", 1}, {"cp", 2}, {"tp", 2}}, {{"*.norm", {{Dim::kSeq, {"cp", "tp"}}}}});
  parts = resolve_partitions(g.blocks[0], plan);
  ASSERT_TRUE(parts.ok()) << parts.error().message();
  int norm = 0;
  op_named(g.blocks[0], "mlp.norm", &norm);
  EXPECT_EQ((*parts)[norm].factor(Dim::kSeq, plan.mesh), 4);
  EXPECT_EQ((*parts)[norm].factor(DimSet{Dim::kSeq, Dim::kHidden}, plan.mesh), 4);
}

std::string resolve_error(const Plan& plan) {
  OpGraph g = lower_model(small_model(), 1);
  auto parts = resolve_partitions(g.blocks[0], plan);
  EXPECT_FALSE(parts.ok());
  return parts.ok() ? "" : parts.error().message();
}

TEST(Layout, SplittingAMissingDimensionFails) {
  std::string e =
      resolve_error(plan_with({{"dp", 1}, {"tp", 2}}, {{"*", {{Dim::kHeads, {"tp"}}}}}));
  EXPECT_TRUE(contains(e, "partition rule '*' splits dimension 'heads' of operator 'attn.norm'"))
      << e;
  EXPECT_TRUE(contains(e, "has no such dimension")) << e;
}

TEST(Layout, SplittingAnUnsplittableDimensionFails) {
  std::string e =
      resolve_error(plan_with({{"dp", 1}, {"tp", 2}}, {{"mlp.norm", {{Dim::kHidden, {"tp"}}}}}));
  EXPECT_TRUE(
      contains(e, "dimension 'hidden' of operator 'mlp.norm' (norm), which cannot be split"))
      << e;
}

// A later rule that takes the split back ("hidden": []) leaves the norm whole: the check is on
// what every matching rule gives together.
TEST(Layout, ALaterRuleMayTakeBackAnUnsplittableSplit) {
  const Plan plan = plan_with({{"dp", 1}, {"tp", 2}}, {{"*.norm", {{Dim::kHidden, {"tp"}}}},
                                                       {"mlp.norm", {{Dim::kHidden, {}}}}});
  OpGraph g = lower_model(small_model(), 1);
  auto parts = resolve_partitions(g.blocks[0], plan);
  ASSERT_FALSE(parts.ok());  // attn.norm is still split
  EXPECT_TRUE(contains(parts.error().message(), "'attn.norm'")) << parts.error().message();
  const Plan both = plan_with({{"dp", 1}, {"tp", 2}}, {{"*.norm", {{Dim::kHidden, {"tp"}}}},
                                                       {"*.norm", {{Dim::kHidden, {}}}}});
  auto whole = resolve_partitions(g.blocks[0], both);
  ASSERT_TRUE(whole.ok()) << whole.error().message();
}

TEST(Layout, FactorMustDivideKeyValueGroups) {
  // 8 query heads in 2 key/value groups: a 4-way head split does not divide the groups.
  std::string e =
      resolve_error(plan_with({{"dp", 1}, {"tp", 4}}, {{"attn.qkv", {{Dim::kHeads, {"tp"}}}}}));
  EXPECT_TRUE(contains(e,
                       "operator 'attn.qkv' splits 'heads' 4 ways, which does not divide its 2 "
                       "key/value head groups"))
      << e;
  EXPECT_TRUE(contains(e, "kv_heads must be divisible by the split")) << e;
  // The same for other dimensions: a 3-way sequence split of 128 tokens.
  e = resolve_error(plan_with({{"dp", 1}, {"cp", 3}}, {{"*", {{Dim::kSeq, {"cp"}}}}}));
  EXPECT_TRUE(contains(e, "splits 'seq' 3 ways, which does not divide its 128 elements")) << e;
}

TEST(Layout, OneAxisCannotSplitTwoDimensions) {
  std::string e = resolve_error(plan_with(
      {{"dp", 1}, {"tp", 2}}, {{"mlp.fc1", {{Dim::kHidden, {"tp"}}, {Dim::kFfn, {"tp"}}}}}));
  EXPECT_TRUE(contains(e,
                       "operator 'mlp.fc1' would be split along mesh axis 'tp' twice "
                       "('hidden' and 'ffn')"))
      << e;
  // Also across rules.
  e = resolve_error(plan_with({{"dp", 1}, {"tp", 2}}, {{"mlp.*", {{Dim::kSeq, {"tp"}}}},
                                                       {"mlp.fc2", {{Dim::kFfn, {"tp"}}}}}));
  EXPECT_TRUE(contains(e, "'mlp.fc2' would be split along mesh axis 'tp' twice")) << e;
}

TEST(Layout, CollectiveNames) {
  EXPECT_EQ(to_string(CollectiveKind::kAllReduce), "all-reduce");
  EXPECT_EQ(to_string(CollectiveKind::kAllGather), "all-gather");
  EXPECT_EQ(to_string(CollectiveKind::kReduceScatter), "reduce-scatter");
  EXPECT_EQ(to_string(CollectiveKind::kAllToAll), "all-to-all");
}

}  // namespace
}  // namespace nnsim
