#include "core/plan.h"

#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace nnsim {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A small two-stage plan; tests replace one piece of it to break it. One field per line where
// the tests need a line number.
const char* kPlan = R"({
  "format": "nnsim-plan",
  "version": 1,
  "name": "tiny",
  "model": {"name": "small", "layers": 4, "hidden": 64, "heads": 8, "ffn_hidden": 256,
            "mlp": "gelu", "vocab": 1000, "seq_len": 128},
  "training": {"global_batch": 8, "micro_batch": 2},
  "mesh": [["dp", 2], ["pp", 2], ["tp", 2]],
  "placement": {"factors": [["pp", 2], ["dp", 2], ["tp", 2]]},
  "segments": [
    {"name": "stage0", "layers": [0, 2], "embedding": true, "devices": {"pp": 0}},
    {"name": "stage1", "layers": [2, 4], "head": true, "devices": {"pp": 1}}
  ],
  "partition": [
    {"match": "attn.qkv", "split": {"heads": ["tp"]}}
  ],
  "recompute": [{"match": "attn.core"}],
  "optimizer": {"zero": 1},
  "schedule": {"name": "1f1b", "orders": [
    {"devices": {"pp": 0}, "blocks": "F0@0 F1@0 B0@0 B1@0"},
    {"devices": {"pp": 1}, "blocks": "F0@1 B0@1 F1@1 B1@1"}
  ]}
}
)";

std::string replace(std::string text, const std::string& from, const std::string& to) {
  auto pos = text.find(from);
  EXPECT_NE(pos, std::string::npos) << from;
  if (pos == std::string::npos) return text;
  return text.replace(pos, from.size(), to);
}

// 1-based line of the first occurrence of `needle`.
int line_of(const std::string& text, const std::string& needle) {
  auto pos = text.find(needle);
  EXPECT_NE(pos, std::string::npos) << needle;
  int line = 1;
  for (size_t i = 0; i < pos && i < text.size(); ++i) line += text[i] == '\n';
  return line;
}

std::string parse_error(const std::string& json) {
  auto p = parse_plan(json, "plan.json");
  EXPECT_FALSE(p.ok());
  return p.ok() ? "" : p.error().message();
}

// The error of `kPlan` with `from` replaced by `to`: names the file, the line of `to` and
// `field`, and says `what`.
void expect_error(const std::string& from, const std::string& to, const std::string& field,
                  const std::string& what) {
  std::string text = replace(kPlan, from, to);
  std::string e = parse_error(text);
  const std::string where = fmt::format("plan.json:{}: field '{}': ", line_of(text, to), field);
  EXPECT_TRUE(contains(e, where)) << "expected '" << where << "' in: " << e;
  EXPECT_TRUE(contains(e, what)) << "expected '" << what << "' in: " << e;
}

TEST(Plan, ParsesTheExample) {
  auto p = parse_plan(kPlan, "plan.json");
  ASSERT_TRUE(p.ok()) << p.error().message();
  EXPECT_EQ(p->name, "tiny");
  EXPECT_EQ(p->model.layers, 4);
  EXPECT_EQ(p->model.kv_heads, 8);  // defaults to heads
  EXPECT_EQ(p->global_batch, 8);
  EXPECT_EQ(p->micro_batch, 2);
  EXPECT_EQ(p->precision, Precision::kBf16);  // the model's
  ASSERT_EQ(p->mesh.axes.size(), 3u);
  EXPECT_EQ(p->mesh.num_ranks(), 8);
  EXPECT_EQ(p->data_parallel(), 2);
  EXPECT_EQ(p->num_micro_batches(), 2);  // 8 / (2 x 2)
  ASSERT_EQ(p->segments.size(), 2u);
  EXPECT_EQ(p->segments[1].first_layer, 2);
  EXPECT_EQ(p->segments[1].end_layer, 4);
  EXPECT_FALSE(p->segments[1].embedding);
  EXPECT_TRUE(p->segments[1].head);
  EXPECT_EQ(p->segments[1].devices, (MeshSlice{{"pp", 1}}));
  ASSERT_EQ(p->partition.size(), 1u);
  ASSERT_EQ(p->partition[0].splits.size(), 1u);
  EXPECT_EQ(p->partition[0].splits[0].dim, Dim::kHeads);
  EXPECT_EQ(p->partition[0].splits[0].axes, (std::vector<std::string>{"tp"}));
  ASSERT_EQ(p->recompute.size(), 1u);
  EXPECT_EQ(p->recompute[0].end_layer, -1);  // all layers
  EXPECT_EQ(p->optimizer.zero, 1);
  EXPECT_EQ(p->optimizer.grad_bytes, 2);
  EXPECT_EQ(p->optimizer.state_bytes, 12);
  EXPECT_EQ(p->schedule_name, "1f1b");
  ASSERT_EQ(p->schedule.size(), 2u);
  EXPECT_EQ(p->schedule[1].blocks, (std::vector<Block>{{BlockKind::kForward, 0, 1},
                                                       {BlockKind::kBackward, 0, 1},
                                                       {BlockKind::kForward, 1, 1},
                                                       {BlockKind::kBackward, 1, 1}}));
}

TEST(Plan, JsonRoundTrip) {
  auto p = parse_plan(kPlan, "plan.json");
  ASSERT_TRUE(p.ok()) << p.error().message();
  const std::string once = plan_to_json(*p);
  auto q = parse_plan(once, "once.json");
  ASSERT_TRUE(q.ok()) << q.error().message();
  EXPECT_EQ(plan_to_json(*q), once);
}

TEST(Plan, OptimizerOffloadingReadsAndRoundTrips) {
  const std::string text = replace(kPlan, "{\"zero\": 1}",
                                   "{\"zero\": 1, \"offload_fraction\": 0.5, "
                                   "\"offload_overlap\": true, \"offload_param_bytes\": 2}");
  auto p = parse_plan(text, "plan.json");
  ASSERT_TRUE(p.ok()) << p.error().message();
  EXPECT_EQ(p->optimizer.offload_fraction, 0.5);
  EXPECT_TRUE(p->optimizer.offload_overlap);
  EXPECT_EQ(p->optimizer.offload_param_bytes, 2);
  const std::string once = plan_to_json(*p);
  auto q = parse_plan(once, "once.json");
  ASSERT_TRUE(q.ok()) << q.error().message();
  EXPECT_EQ(q->optimizer.offload_fraction, 0.5);
  EXPECT_EQ(plan_to_json(*q), once);
  // Without offloading the plan writes none of the fields.
  EXPECT_EQ(plan_to_json(*parse_plan(kPlan, "plan.json")).find("offload"), std::string::npos);
}

TEST(Plan, OptimizerOffloadingChecks) {
  expect_error("{\"zero\": 1}", "{\"zero\": 1, \"offload_fraction\": 1.5}",
               "optimizer.offload_fraction", "must be from 0");
  expect_error("{\"zero\": 1}", "{\"zero\": 1, \"offload_fraction\": -0.1}",
               "optimizer.offload_fraction", "must be from 0");
  expect_error("{\"zero\": 1}", "{\"zero\": 1, \"offload_overlap\": true}",
               "optimizer.offload_overlap", "set \"offload_fraction\"");
  expect_error("{\"zero\": 1}",
               "{\"zero\": 1, \"offload_fraction\": 1, \"offload_param_bytes\": 16}",
               "optimizer.offload_param_bytes", "out of range");
}

// "F1@0+B0@0" in an order pairs the two blocks (the first one is marked); the plan writes it
// back the same. More than two blocks, or a pair beside the shared-expert overlap, are refused.
TEST(Plan, OrdersPairBlocksWithAPlus) {
  const std::string text =
      replace(kPlan, R"("blocks": "F0@0 F1@0 B0@0 B1@0")", R"("blocks": "F0@0 F1@0+B0@0 B1@0")");
  auto p = parse_plan(text, "plan.json");
  ASSERT_TRUE(p.ok()) << p.error().message();
  const std::vector<Block>& blocks = p->schedule[0].blocks;
  ASSERT_EQ(blocks.size(), 4u);
  EXPECT_FALSE(blocks[0].paired_with_next);
  EXPECT_TRUE(blocks[1].paired_with_next);
  EXPECT_FALSE(blocks[2].paired_with_next);
  EXPECT_TRUE(contains(plan_to_json(*p), R"("blocks": "F0@0 F1@0+B0@0 B1@0")"));
  expect_error(R"("blocks": "F0@0 F1@0 B0@0 B1@0")", R"("blocks": "F0@0 F1@0+B0@0+B1@0")",
               "schedule.orders[0].blocks", "'F1@0+B0@0+B1@0' pairs more than two blocks");
  expect_error(R"("blocks": "F0@0 F1@0 B0@0 B1@0")", R"("blocks": "F0@0 F1@0+ B0@0 B1@0")",
               "schedule.orders[0].blocks", "'' is not a block");
  std::string shared = replace(text, R"("optimizer": {"zero": 1},)",
                               R"("optimizer": {"zero": 1},
  "communication": {"moe_shared_expert_overlap": true},)");
  std::string e = parse_error(shared);
  EXPECT_TRUE(contains(e, "pair 'F1@0+B0@0' hides its expert all-to-alls")) << e;
}

TEST(Plan, HandBuiltPlanRoundTrips) {
  Plan p;
  p.name = "hand";
  p.model.name = "m";
  p.model.layers = 2;
  p.model.hidden = 64;
  p.model.heads = 4;
  p.model.kv_heads = 2;
  p.model.ffn_hidden = 128;
  p.model.mlp = MlpKind::kSwiglu;
  p.model.vocab = 500;
  p.model.seq_len = 64;
  p.global_batch = 16;
  p.micro_batch = 1;
  p.precision = Precision::kFp16;
  p.mesh.axes = {{"dp", 2}, {"cp", 2}, {"tp", 2}};
  p.placement.gpus = {7, 6, 5, 4, 3, 2, 1, 0};
  p.segments = {{"all", 0, 2, true, true, {}}};
  p.partition = {{"*", {{Dim::kSeq, {"cp"}}}}, {"mlp.fc1", {{Dim::kFfn, {"tp"}}, {Dim::kSeq, {}}}}};
  p.recompute = {{"mlp.*", 0, 1}};
  p.optimizer.zero = 3;
  p.optimizer.grad_bytes = 4;
  p.comm.dp_bucket_bytes = 2e6;
  p.comm.overlap_grad_reduce = false;
  p.comm.pp_scatter_gather = false;
  p.comm.algorithm = "ring";
  p.comm.save_gathered_inputs = true;
  p.comm.pp_buffers_per_micro_batch = true;
  p.comm.pp_blocking_sends = true;
  p.comm.zero3_persistence_threshold = 1e5;
  p.comm.zero3_reduce_bucket = 5e8;
  p.comm.zero3_per_tensor = true;
  p.comm.zero3_regather_for_recompute = true;
  p.comm.zero3_prefetch_elements = 5e7;
  p.topology_gpus = 8;
  p.topology_name = "h200x8";
  p.schedule_name = "custom";
  p.schedule = {{{},
                 {{BlockKind::kForward, 0, 0},
                  {BlockKind::kRecompute, 0, 0},
                  {BlockKind::kBackwardInput, 0, 0},
                  {BlockKind::kBackwardWeight, 0, 0}}}};
  const std::string once = plan_to_json(p);
  auto q = parse_plan(once, "hand.json");
  ASSERT_TRUE(q.ok()) << q.error().message();
  EXPECT_EQ(plan_to_json(*q), once);
  EXPECT_EQ(q->placement.gpus, p.placement.gpus);
  EXPECT_EQ(q->precision, Precision::kFp16);
  EXPECT_EQ(q->topology_gpus, 8);
  EXPECT_EQ(q->recompute[0].end_layer, 1);
  EXPECT_EQ(q->partition[1].splits.size(), 2u);
  EXPECT_TRUE(q->partition[1].splits[1].axes.empty());  // an explicit un-split survives
  EXPECT_EQ(q->comm.algorithm, "ring");
  EXPECT_FALSE(q->comm.overlap_grad_reduce);
  EXPECT_TRUE(q->comm.save_gathered_inputs);
  EXPECT_TRUE(q->comm.pp_buffers_per_micro_batch);
  EXPECT_TRUE(q->comm.pp_blocking_sends);
  EXPECT_EQ(q->comm.zero3_persistence_threshold, 1e5);
  EXPECT_EQ(q->comm.zero3_reduce_bucket, 5e8);
  EXPECT_EQ(q->comm.zero3_prefetch_elements, 5e7);
  EXPECT_EQ(q->schedule[0].blocks, p.schedule[0].blocks);
  EXPECT_EQ(q->model.mlp, MlpKind::kSwiglu);
  EXPECT_EQ(q->model.kv_heads, 2);
}

TEST(Plan, MalformedJsonNamesLineAndColumn) {
  // The comma after "tiny" is missing: the parser stops at the next key, "model" on line 5
  // (columns 3-9); the column is that of the token's last character.
  std::string e = parse_error(replace(kPlan, "\"tiny\",", "\"tiny\""));
  EXPECT_TRUE(contains(e, "plan.json:5:9: malformed JSON: syntax error")) << e;
  EXPECT_TRUE(contains(e, "unexpected string literal")) << e;
}

TEST(Plan, WrongFormatString) {
  expect_error("\"nnsim-plan\"", "\"nnsim-plane\"", "format",
               "expected \"nnsim-plan\" (is this a plan file?)");
}

TEST(Plan, UnsupportedVersion) {
  expect_error("\"version\": 1", "\"version\": 2", "version",
               "plan version 2 is not supported by this nnsim (it reads version 1)");
}

TEST(Plan, UnknownFieldSuggests) {
  expect_error("\"zero\": 1", "\"zer\": 1", "optimizer.zer",
               "unknown field 'zer' (did you mean 'zero'?)");
  expect_error("\"segments\"", "\"segmnts\"", "segmnts",
               "unknown field 'segmnts' (did you mean 'segments'?)");
}

// An explicit null would read as an absent field and take its default silently.
TEST(Plan, NullValueIsAnError) {
  expect_error("\"zero\": 1", "\"zero\": null", "optimizer.zero",
               "has no value; give it one, or remove the field to take its default");
}

TEST(Plan, MissingFieldIsNamed) {
  std::string e = parse_error(replace(kPlan, "\"micro_batch\": 2", "\"micro\": 2"));
  EXPECT_TRUE(contains(e, "plan.json:7: field 'training.micro")) << e;
  e = parse_error(
      replace(kPlan, "{\"global_batch\": 8, \"micro_batch\": 2}", "{\"global_batch\": 8}"));
  EXPECT_TRUE(contains(e, "missing required field 'training.micro_batch'")) << e;
}

TEST(Plan, BadBlockString) {
  expect_error("F0@0 F1@0 B0@0 B1@0", "F0@0 X3@1 B0@0 B1@0", "schedule.orders[0].blocks",
               "'X3@1' is not a block (expected KIND<micro-batch>@<segment>");
}

TEST(Plan, MeshCoordinateOutOfRange) {
  expect_error("\"head\": true, \"devices\": {\"pp\": 1}",
               "\"head\": true, \"devices\": {\"pp\": 2}", "segments[1].devices.pp",
               "coordinate 2 is outside axis 'pp' (size 2: 0-1)");
}

TEST(Plan, UnknownMeshAxisSuggests) {
  expect_error("\"embedding\": true, \"devices\": {\"pp\": 0}",
               "\"embedding\": true, \"devices\": {\"ppp\": 0}", "segments[0].devices.ppp",
               "no mesh axis 'ppp' (did you mean 'pp'?)");
  expect_error("{\"devices\": {\"pp\": 1}, \"blocks\"", "{\"devices\": {\"tq\": 1}, \"blocks\"",
               "schedule.orders[1].devices.tq", "no mesh axis 'tq' (did you mean 'tp'?)");
}

TEST(Plan, PlacementFactorsMustMultiplyToTheAxis) {
  expect_error("[[\"pp\", 2], [\"dp\", 2], [\"tp\", 2]]", "[[\"pp\", 2], [\"dp\", 2], [\"tp\", 1]]",
               "placement.factors",
               "the factors of axis 'tp' multiply to 1, but the axis has size 2");
  expect_error("[[\"pp\", 2], [\"dp\", 2], [\"tp\", 2]]", "[[\"pp\", 2], [\"dp\", 2], [\"xp\", 2]]",
               "placement.factors[2][0]", "no mesh axis 'xp'");
  expect_error("\"factors\": [[\"pp\", 2], [\"dp\", 2], [\"tp\", 2]]", "\"gpus\": [0, 1, 2]",
               "placement.gpus", "lists 3 GPUs but the mesh has 8 ranks");
}

TEST(Plan, SplittingOverDpIsRejected) {
  expect_error("\"heads\": [\"tp\"]", "\"heads\": [\"dp\"]", "partition[0].split.heads[0]",
               "the data-parallel axis 'dp' splits the batch implicitly; remove it here");
}

TEST(Plan, PartitionNamesDimensionsAndAxes) {
  expect_error("\"heads\": [\"tp\"]", "\"head\": [\"tp\"]", "partition[0].split.head",
               "unknown dimension 'head' (did you mean 'heads'?)");
  expect_error("\"heads\": [\"tp\"]", "\"heads\": [\"cp\"]", "partition[0].split.heads[0]",
               "no mesh axis 'cp'");
}

TEST(Plan, OtherFieldChecks) {
  expect_error("[[\"dp\", 2], [\"pp\", 2]", "[[\"dp\", 2], [\"dp\", 2]", "mesh[1][0]",
               "axis 'dp' appears twice");
  // Seventeen axes, sixteen of size 1: one too many.
  std::string many = "[[\"dp\", 2], [\"pp\", 2]";
  for (int a = 0; a < 15; ++a) many += fmt::format(", [\"x{}\", 1]", a);
  expect_error("[[\"dp\", 2], [\"pp\", 2]", many, "mesh[16]",
               "a mesh has at most 16 axes; merge axes that split the same way");
  expect_error("\"layers\": [2, 4]", "\"layers\": [4, 2]", "segments[1].layers",
               "expected [first, end) as two integers with first <= end");
  expect_error("{\"zero\": 1}", "{\"zero\": 4}", "optimizer.zero",
               "expected a ZeRO stage 0, 1, 2 or 3");
  expect_error("{\"zero\": 1}", "{\"kind\": \"adamw\"}", "optimizer.kind", "unknown value 'adamw'");
  expect_error("{\"zero\": 1}", "{\"zero\": 1, \"keep_gathered\": true}", "optimizer.keep_gathered",
               "it needs \"zero\": 3");
  expect_error("\"global_batch\": 8", "\"global_batch\": 0", "training.global_batch",
               "must be at least 1");
  expect_error("\"optimizer\": {\"zero\": 1},",
               "\"optimizer\": {\"zero\": 1}, \"communication\": {\"save_gathered_inputs\": 1},",
               "communication.save_gathered_inputs", "true or false");
  expect_error("\"optimizer\": {\"zero\": 1},",
               "\"recompute_early_stop\": \"maybe\", \"optimizer\": {\"zero\": 1},",
               "recompute_early_stop", "expected true or false, got 'maybe'");
}

// Numbers out of their field's range are errors, never wrapped, clamped or left to hang the
// simulation (a 0.5-byte gradient bucket, a 2^40 ZeRO stage that narrowed to 0).
TEST(Plan, NumbersOutOfRange) {
  expect_error("{\"zero\": 1}", "{\"zero\": 1099511627777}", "optimizer.zero", "out of range");
  expect_error("\"global_batch\": 8", "\"global_batch\": 4294967304", "training.global_batch",
               "out of range");
  expect_error("\"global_batch\": 8", "\"global_batch\": 1e300", "training.global_batch",
               "expected an integer");
  expect_error("{\"zero\": 1}", "{\"zero\": 1, \"grad_bytes\": -1}", "optimizer.grad_bytes",
               "out of range (1 to 8");
  expect_error("{\"zero\": 1}", "{\"zero\": 1, \"grad_bytes\": 1e300}", "optimizer.grad_bytes",
               "out of range");
  expect_error("{\"zero\": 1}", "{\"zero\": 1, \"state_bytes\": -4}", "optimizer.state_bytes",
               "out of range (0 to 64");
  expect_error("{\"zero\": 1}", "{\"zero\": 1, \"weight_shard_bytes\": 0}",
               "optimizer.weight_shard_bytes", "out of range");
  expect_error("\"optimizer\": {\"zero\": 1},",
               "\"optimizer\": {\"zero\": 1}, \"communication\": {\"dp_bucket_bytes\": 0.5},",
               "communication.dp_bucket_bytes", "below the 1 MiB minimum");
  expect_error("\"optimizer\": {\"zero\": 1},",
               "\"optimizer\": {\"zero\": 1}, \"communication\": {\"grad_reduce_bytes\": 3e9},",
               "communication.grad_reduce_bytes", "out of range (0 to 8");
  expect_error("\"optimizer\": {\"zero\": 1},",
               "\"optimizer\": {\"zero\": 1}, \"communication\": "
               "{\"zero3_persistence_threshold\": -1},",
               "communication.zero3_persistence_threshold", "0 or more");
  expect_error("\"optimizer\": {\"zero\": 1},",
               "\"optimizer\": {\"zero\": 1}, \"communication\": {\"zero3_reduce_bucket\": -5},",
               "communication.zero3_reduce_bucket", "0 or more");
  expect_error("\"optimizer\": {\"zero\": 1},",
               "\"optimizer\": {\"zero\": 1}, \"communication\": "
               "{\"zero3_per_tensor\": true, \"zero3_regather_for_recompute\": true, "
               "\"zero3_prefetch_elements\": -1},",
               "communication.zero3_prefetch_elements", "0 or more");
  // Tensor-grained prefetch is DeepSpeed's: per-tensor gathers, regathered for recomputation.
  expect_error("\"optimizer\": {\"zero\": 1},",
               "\"optimizer\": {\"zero\": 1}, \"communication\": "
               "{\"zero3_per_tensor\": true, \"zero3_prefetch_elements\": 5e7},",
               "communication.zero3_prefetch_elements",
               "needs \"zero3_per_tensor\": true and \"zero3_regather_for_recompute\": true");
  expect_error("\"optimizer\": {\"zero\": 1},",
               "\"optimizer\": {\"zero\": 1}, \"communication\": "
               "{\"zero3_regather_for_recompute\": true, \"zero3_prefetch_elements\": 5e7},",
               "communication.zero3_prefetch_elements", "needs \"zero3_per_tensor\"");
  expect_error("\"name\": \"tiny\",", "\"name\": \"tiny\", \"topology\": {\"gpus\": -1},",
               "topology.gpus", "must be at least 1");
  expect_error("[{\"match\": \"attn.core\"}]", "[{\"match\": \"*\", \"layers\": [0, 9]}]",
               "recompute[0].layers", "not a range of the model's layers [0, 4)");
  expect_error("[{\"match\": \"attn.core\"}]", "[{\"match\": \"*\", \"layers\": [2, 2]}]",
               "recompute[0].layers", "not a range of the model's layers");
}

// Repeated forwards: training.recycle, and forward blocks naming their pass ("F0@0#1").
TEST(Plan, RecycleFieldAndForwardPasses) {
  std::string text = replace(kPlan, "{\"global_batch\": 8, \"micro_batch\": 2}",
                             "{\"global_batch\": 8, \"micro_batch\": 2, \"recycle\": 2}");
  text = replace(text, "\"F0@0 F1@0 B0@0 B1@0\"", "\"F0@0 F0@0#1 F1@0 F1@0#1 B0@0 B1@0\"");
  auto p = parse_plan(text, "plan.json");
  ASSERT_TRUE(p.ok()) << p.error().message();
  EXPECT_EQ(p->recycle, 2);
  EXPECT_EQ(p->schedule[0].blocks[1], (Block{BlockKind::kForward, 0, 0, 1}));
  EXPECT_EQ(p->schedule[0].blocks[2], (Block{BlockKind::kForward, 1, 0, 0}));
  // Written back byte-stably, the pass included.
  const std::string once = plan_to_json(*p);
  EXPECT_TRUE(contains(once, "\"recycle\": 2")) << once;
  EXPECT_TRUE(contains(once, "F0@0 F0@0#1 F1@0 F1@0#1 B0@0 B1@0")) << once;
  auto q = parse_plan(once, "once.json");
  ASSERT_TRUE(q.ok()) << q.error().message();
  EXPECT_EQ(plan_to_json(*q), once);
  // Absent: one pass.
  auto plain = parse_plan(kPlan, "plan.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->recycle, 1);
}

TEST(Plan, BadRecycleAndPasses) {
  for (const char* bad : {"0", "-2"}) {
    expect_error("{\"global_batch\": 8, \"micro_batch\": 2}",
                 fmt::format("{{\"global_batch\": 8, \"micro_batch\": 2, \"recycle\": {}}}", bad),
                 "training.recycle", "must be at least 1 (forward passes per micro-batch");
  }
  expect_error("{\"global_batch\": 8, \"micro_batch\": 2}",
               "{\"global_batch\": 8, \"micro_batch\": 2, \"recycles\": 2}", "training.recycles",
               "unknown field 'recycles' (did you mean 'recycle'?)");
  expect_error("F0@0 F1@0 B0@0 B1@0", "F0@0 F1@0 B0@0#1 B1@0", "schedule.orders[0].blocks",
               "'B0@0#1': only forward blocks have a pass");
  expect_error("F0@0 F1@0 B0@0 B1@0", "F0@0#x F1@0 B0@0 B1@0", "schedule.orders[0].blocks",
               "'F0@0#x' is not a block");
}

TEST(Plan, LoadPlanNamesAMissingFile) {
  auto p = load_plan("/nonexistent/plan.json");
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(contains(p.error().message(), "/nonexistent/plan.json")) << p.error().message();
}

TEST(Plan, Blocks) {
  struct Case {
    const char* text;
    BlockKind kind;
    int mb, seg;
  };
  for (const Case& c :
       {Case{"F3@1", BlockKind::kForward, 3, 1}, Case{"B0@0", BlockKind::kBackward, 0, 0},
        Case{"BI12@3", BlockKind::kBackwardInput, 12, 3},
        Case{"BW2@0", BlockKind::kBackwardWeight, 2, 0},
        Case{"R5@7", BlockKind::kRecompute, 5, 7}}) {
    auto b = parse_block(c.text);
    ASSERT_TRUE(b.ok()) << c.text;
    EXPECT_EQ(*b, (Block{c.kind, c.mb, c.seg})) << c.text;
    EXPECT_EQ(to_string(*b), c.text);
  }
  auto pass = parse_block("F3@1#2");
  ASSERT_TRUE(pass.ok()) << pass.error().message();
  EXPECT_EQ(*pass, (Block{BlockKind::kForward, 3, 1, 2}));
  EXPECT_EQ(to_string(*pass), "F3@1#2");
  EXPECT_EQ(to_string(Block{BlockKind::kForward, 3, 1, 0}), "F3@1");
  for (const char* bad : {"X3@1", "F3", "F@1", "F3@", "F-1@0", "F3@1x", "f3@1", "", "@1", "F3@-1",
                          "FB3@1", "F3@1#", "F3@1#-1", "F3@#1", "F3@1#1#2"}) {
    auto b = parse_block(bad);
    EXPECT_FALSE(b.ok()) << bad;
    if (!b.ok()) {
      EXPECT_TRUE(contains(b.error().message(), "is not a block")) << b.error().message();
    }
  }
}

TEST(Plan, MatchPattern) {
  struct Case {
    const char* pattern;
    const char* name;
    bool match;
  };
  for (const Case& c : {
           Case{"*", "attn.qkv", true},
           Case{"*", "", true},
           Case{"attn.qkv", "attn.qkv", true},
           Case{"attn.qkv", "attn.qkv2", false},
           Case{"attn.qkv", "attn.qk", false},
           Case{"attn.*", "attn.core", true},
           Case{"attn.*", "mlp.fc1", false},
           Case{"*.norm", "attn.norm", true},
           Case{"*.norm", "head.norm", true},
           Case{"*.norm", "attn.normx", false},
           Case{"*.residual", "mlp.residual", true},
           Case{"mlp.fc*", "mlp.fc2", true},
           Case{"a*b*c", "aXbYc", true},
           Case{"a*b*c", "abc", true},
           Case{"a*b*c", "aXcYb", false},
           Case{"*a*", "banana", true},
           Case{"**", "x", true},
           Case{"", "", true},
           Case{"", "x", false},
           Case{"embed.*", "embed.word", true},
       }) {
    EXPECT_EQ(match_pattern(c.pattern, c.name), c.match) << c.pattern << " vs " << c.name;
  }
}

TEST(Plan, MeshCoordinates) {
  Mesh m;
  m.axes = {{"dp", 2}, {"pp", 3}, {"tp", 4}};
  EXPECT_EQ(m.num_ranks(), 24);
  EXPECT_EQ(m.axis_index("pp"), 1);
  EXPECT_EQ(m.axis_index("cp"), -1);
  EXPECT_EQ(m.axis_size("cp"), 1);
  EXPECT_EQ(m.coordinates(0), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(m.coordinates(23), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(m.coordinates(13), (std::vector<int>{1, 0, 1}));  // last axis innermost
  for (int r = 0; r < 24; ++r) EXPECT_EQ(m.rank_of(m.coordinates(r)), r);
  // Groups of collectives: rank 13 = (1, 0, 1).
  EXPECT_EQ(m.ranks_along(13, {"tp"}), (std::vector<int>{12, 13, 14, 15}));
  EXPECT_EQ(m.ranks_along(13, {"dp"}), (std::vector<int>{1, 13}));
  EXPECT_EQ(m.ranks_along(13, {"pp", "dp"}), (std::vector<int>{1, 5, 9, 13, 17, 21}));
  EXPECT_EQ(m.ranks_along(13, {}), (std::vector<int>{13}));
  EXPECT_EQ(m.ranks_along(13, {"cp"}), (std::vector<int>{13}));  // an absent axis
}

// Megatron's order: mesh [dp, pp, cp, tp], GPUs numbered pp-dp-cp-tp (tp fastest).
TEST(Plan, PlacementMegatronOrder) {
  const int DP = 2, PP = 3, CP = 2, TP = 4;
  Mesh m;
  m.axes = {{"dp", DP}, {"pp", PP}, {"cp", CP}, {"tp", TP}};
  Placement p;
  p.factors = {{"pp", PP}, {"dp", DP}, {"cp", CP}, {"tp", TP}};
  std::vector<int> gpus = p.gpu_of_rank(m);
  ASSERT_EQ(gpus.size(), 48u);
  std::vector<bool> used(48, false);
  for (int r = 0; r < 48; ++r) {
    auto c = m.coordinates(r);
    const int dp = c[0], pp = c[1], cp = c[2], tp = c[3];
    EXPECT_EQ(gpus[r], ((pp * DP + dp) * CP + cp) * TP + tp) << r;
    ASSERT_GE(gpus[r], 0);
    ASSERT_LT(gpus[r], 48);
    EXPECT_FALSE(used[gpus[r]]);
    used[gpus[r]] = true;
  }
}

// TP 8 over 2 nodes of 4 GPUs: the tp coordinate's high bit picks the node, then dp, then the
// low two bits.
TEST(Plan, PlacementSplitAxis) {
  Mesh m;
  m.axes = {{"dp", 2}, {"tp", 8}};
  Placement p;
  p.factors = {{"tp", 2}, {"dp", 2}, {"tp", 4}};
  std::vector<int> gpus = p.gpu_of_rank(m);
  ASSERT_EQ(gpus.size(), 16u);
  for (int r = 0; r < 16; ++r) {
    const int dp = r / 8, tp = r % 8;
    EXPECT_EQ(gpus[r], (tp / 4) * 8 + dp * 4 + tp % 4) << r;
  }
  EXPECT_EQ(gpus[m.rank_of({0, 4})], 8);  // tp 4 of replica 0: first GPU of the second half
  EXPECT_EQ(gpus[m.rank_of({1, 0})], 4);
  // Explicit GPUs win.
  p.gpus = {15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0};
  EXPECT_EQ(p.gpu_of_rank(m), p.gpus);
}

TEST(Plan, BlockKindNames) {
  EXPECT_EQ(to_string(BlockKind::kForward), "F");
  EXPECT_EQ(to_string(BlockKind::kBackward), "B");
  EXPECT_EQ(to_string(BlockKind::kBackwardInput), "BI");
  EXPECT_EQ(to_string(BlockKind::kBackwardWeight), "BW");
  EXPECT_EQ(to_string(BlockKind::kRecompute), "R");
}

}  // namespace
}  // namespace nnsim
