#include "planner/megatron.h"

#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/plan.h"
#include "core/program.h"
#include "core/topology.h"

namespace nnsim {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

ModelSpec preset(const std::string& name) {
  auto m = load_model(name);
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
  return *m;
}

Topology topology(const std::string& name) {
  auto t = load_topology(name);
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  return *t;
}

MegatronOptions opts(int tp, int pp, int global_batch) {
  MegatronOptions o;
  o.tp = tp;
  o.pp = pp;
  o.global_batch = global_batch;
  return o;
}

std::string build_error(const ModelSpec& m, const MegatronOptions& o,
                        const std::string& topo = "dgx-a100x4") {
  auto p = build_megatron_plan(m, topology(topo), o);
  EXPECT_FALSE(p.ok());
  return p.ok() ? "" : p.error().message();
}

Plan build(const ModelSpec& m, const MegatronOptions& o, const std::string& topo = "dgx-a100x4") {
  auto p = build_megatron_plan(m, topology(topo), o);
  EXPECT_TRUE(p.ok()) << (p.ok() ? "" : p.error().message());
  return p.ok() ? *p : Plan{};
}

std::string compile_error(const Plan& plan, const std::string& topo = "dgx-a100x4") {
  auto p = compile_plan(plan, topology(topo));
  EXPECT_FALSE(p.ok());
  return p.ok() ? "" : p.error().message();
}

TEST(Megatron, SplitLayers) {
  EXPECT_EQ(split_layers(126, 8), (std::vector<int>{15, 16, 16, 16, 16, 16, 16, 15}));
  EXPECT_EQ(split_layers(96, 8), (std::vector<int>(8, 12)));
  EXPECT_EQ(split_layers(24, 1), (std::vector<int>{24}));
  EXPECT_EQ(split_layers(11, 4), (std::vector<int>{2, 3, 3, 3}));
  EXPECT_EQ(split_layers(10, 4), (std::vector<int>{2, 3, 3, 2}));
  EXPECT_EQ(split_layers(9, 4), (std::vector<int>{2, 2, 3, 2}));
  for (int layers : {5, 17, 32, 80, 126}) {
    for (int segments : {1, 2, 3, 4, 5}) {
      auto v = split_layers(layers, segments);
      int sum = 0, lo = layers, hi = 0;
      for (int x : v) {
        sum += x;
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      EXPECT_EQ(sum, layers) << layers << "/" << segments;
      EXPECT_LE(hi - lo, 1) << layers << "/" << segments;
    }
  }
}

TEST(Megatron, PlanStructure) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = opts(4, 2, 64);
  o.sequence_parallel = true;
  o.recompute = RecomputeMode::kSelective;
  o.micro_batch = 2;
  o.zero = 1;
  Plan p = build(m, o);
  // Mesh dp-pp-cp-tp, placed tp fastest, then cp, dp, pp.
  ASSERT_EQ(p.mesh.axes.size(), 4u);
  EXPECT_EQ(p.mesh.axes[0].name, "dp");
  EXPECT_EQ(p.mesh.axes[0].size, 4);
  EXPECT_EQ(p.mesh.axes[1].name, "pp");
  EXPECT_EQ(p.mesh.axes[3].name, "tp");
  ASSERT_EQ(p.placement.factors.size(), 4u);
  EXPECT_EQ(p.placement.factors[0].axis, "pp");
  EXPECT_EQ(p.placement.factors[3].axis, "tp");
  EXPECT_EQ(p.num_micro_batches(), 8);  // 64 / (4 x 2)
  ASSERT_EQ(p.segments.size(), 2u);
  EXPECT_TRUE(p.segments[0].embedding);
  EXPECT_FALSE(p.segments[0].head);
  EXPECT_TRUE(p.segments[1].head);
  EXPECT_EQ(p.segments[0].end_layer, 12);
  EXPECT_EQ(p.segments[1].devices, (MeshSlice{{"pp", 1}}));
  // Recompute only the attention core in every layer.
  ASSERT_EQ(p.recompute.size(), 1u);
  EXPECT_EQ(p.recompute[0].match, "attn.core");
  // bf16: fp32 gradients, 12 bytes of Adam state; bucket max(40M, 1M x dp) parameters.
  EXPECT_EQ(p.optimizer.grad_bytes, 4);
  EXPECT_EQ(p.optimizer.state_bytes, 12);
  EXPECT_EQ(p.optimizer.zero, 1);
  EXPECT_EQ(p.comm.dp_bucket_bytes, 40e6 * 4);
  ASSERT_EQ(p.schedule.size(), 2u);
  EXPECT_EQ(p.schedule_name, "1f1b");
  // Every operator's split over tp: column-parallel, row-parallel, vocab-parallel, sequence.
  auto split_of = [&](const std::string& op) {
    std::string s;
    for (const auto& r : p.partition) {
      if (!match_pattern(r.match, op)) continue;
      for (const auto& d : r.splits) s += std::string(to_string(d.dim)) + " ";
    }
    return s;
  };
  EXPECT_EQ(split_of("attn.qkv"), "heads ");
  EXPECT_EQ(split_of("attn.core"), "heads ");
  EXPECT_EQ(split_of("mlp.fc2"), "ffn ");
  EXPECT_EQ(split_of("loss"), "vocab ");
  EXPECT_EQ(split_of("attn.norm"), "seq ");
  EXPECT_EQ(split_of("mlp.residual"), "seq ");
  EXPECT_EQ(split_of("embed.dropout"), "seq ");
  EXPECT_TRUE(compile_plan(p, topology("dgx-a100x4")).ok());
}

TEST(Megatron, PlanRoundTripsThroughJson) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = opts(8, 4, 32);
  o.vpp = 2;
  o.schedule = ScheduleKind::kInterleaved;
  o.recompute = RecomputeMode::kFull;
  Plan p = build(m, o);
  const std::string once = plan_to_json(p);
  auto q = parse_plan(once, "plan.json");
  ASSERT_TRUE(q.ok()) << q.error().message();
  EXPECT_EQ(plan_to_json(*q), once);
  EXPECT_EQ(q->schedule[2].blocks, p.schedule[2].blocks);
  EXPECT_EQ(q->segments.size(), 8u);
  // The re-read plan compiles the same.
  auto a = compile_plan(p, topology("dgx-a100x4"));
  auto b = compile_plan(*q, topology("dgx-a100x4"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->layer_activation_bytes, b->layer_activation_bytes);
  EXPECT_EQ(a->templates.size(), b->templates.size());
}

TEST(Megatron, FloatingPointPrecisionsSetOptimizerBytes) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = opts(8, 1, 32);
  o.precision = Precision::kFp16;
  EXPECT_EQ(build(m, o).optimizer.grad_bytes, 2);
  o.precision = Precision::kFp32;
  Plan p = build(m, o);
  EXPECT_EQ(p.optimizer.grad_bytes, 4);
  EXPECT_EQ(p.optimizer.state_bytes, 8);
}

// Megatron-Core's schedule without interleaving (and DeepSpeed's pipeline engine) waits on each
// pipeline send; its interleaved one overlaps them (overlap_p2p_comm), and so does PyTorch's.
TEST(Megatron, OnlyNonInterleavedMegatronAndDeepSpeedPipelinesBlockOnSends) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = opts(8, 2, 32);
  EXPECT_TRUE(build(m, o).comm.pp_blocking_sends);
  o.framework = "deepspeed";
  EXPECT_TRUE(build(m, o).comm.pp_blocking_sends);
  o.framework = "fsdp";
  EXPECT_FALSE(build(m, o).comm.pp_blocking_sends);
  o.framework = "megatron";
  o.schedule = ScheduleKind::kInterleaved;
  o.vpp = 2;
  EXPECT_FALSE(build(m, o).comm.pp_blocking_sends);
  EXPECT_FALSE(build(m, opts(8, 1, 32)).comm.pp_blocking_sends);  // nothing to send
}

TEST(Megatron, DegreesMustDivideTheGpus) {
  const ModelSpec m = preset("gpt3-1.3b");
  std::string e = build_error(m, opts(3, 1, 32));
  EXPECT_TRUE(contains(e,
                       "tp x pp x cp = 3 x 1 x 1 = 3 does not divide the 32 GPUs of topology "
                       "'dgx-a100x4'"))
      << e;
  MegatronOptions o = opts(8, 1, 32);
  o.dp = 2;
  e = build_error(m, o);
  EXPECT_TRUE(contains(e,
                       "tp x pp x cp x dp = 8 x 1 x 1 x 2 = 16 ranks, but topology "
                       "'dgx-a100x4' has 32 GPUs"))
      << e;
  e = build_error(m, opts(0, 1, 32));
  EXPECT_TRUE(contains(e, "--tp must be at least 1 (got 0)")) << e;
}

TEST(Megatron, AvoidedGpusStayIdleAndHealthyNodesComeFirst) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = opts(8, 1, 48);
  o.avoid_gpus = {3};  // node 0 has a bad GPU: three healthy nodes remain
  Plan p = build(m, o);
  EXPECT_EQ(p.data_parallel(), 3);  // 31 usable GPUs hold 3 TP-8 groups
  Expected<Program> prog = compile_plan(p, topology("dgx-a100x4"));
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  ASSERT_EQ(prog->gpu_of_rank.size(), 24u);
  for (size_t r = 0; r < 24; ++r) {
    EXPECT_GE(prog->gpu_of_rank[r], 8) << r;  // nodes 1-3, whole TP groups inside each
    EXPECT_EQ(prog->gpu_of_rank[r] / 8, prog->gpu_of_rank[r / 8 * 8] / 8) << r;
  }
  // More ranks than usable GPUs, or a GPU that does not exist, are errors.
  o.dp = 4;
  EXPECT_TRUE(contains(build_error(m, o), "only 31 GPUs of topology 'dgx-a100x4' are not avoided"));
  o.dp = 0;
  o.avoid_gpus = {32};
  EXPECT_TRUE(contains(build_error(m, o),
                       "GPU 32 to avoid does not exist: topology 'dgx-a100x4' has GPUs 0-31"));
}

TEST(Megatron, PlacementOrdersMaySplitAnAxis) {
  const ModelSpec m = preset("gpt3-13b");
  MegatronOptions o = opts(8, 2, 64);
  o.placement = {"tp:2", "pp", "dp", "cp", "tp"};  // TP 8 as 2 nodes x 4 GPUs
  Plan p = build(m, o);
  ASSERT_EQ(p.placement.factors.size(), 5u);
  EXPECT_EQ(p.placement.factors.front().axis, "tp");
  EXPECT_EQ(p.placement.factors.front().size, 2);
  EXPECT_EQ(p.placement.factors.back().size, 4);
  Expected<Program> prog = compile_plan(p, topology("dgx-a100x4"));
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  // Rank 0's tensor-parallel group: GPUs 0-3 and 16-19.
  const int tp_axis = p.mesh.axis_index("tp");
  std::vector<int> gpus;
  for (int r : prog->group_of(0, 1u << tp_axis)) gpus.push_back(prog->gpu_of_rank[r]);
  EXPECT_EQ(gpus, (std::vector<int>{0, 1, 2, 3, 16, 17, 18, 19}));
  o.placement = {"tp:3", "pp", "dp", "cp", "tp"};
  EXPECT_TRUE(contains(build_error(m, o), "tp has size 8"));
  o.placement = {"pp", "dp", "cp"};
  EXPECT_TRUE(contains(build_error(m, o), "placement must cover each of dp, pp, cp, tp once"));
  o.placement = {"pp", "dp", "cp", "tq"};
  EXPECT_TRUE(contains(build_error(m, o), "did you mean 'tp'"));
}

// With expert parallelism an order that leaves "ep" out (or places only part of it) gets it
// just outside "cp", where Megatron-Core puts it; an order that places all of it keeps its own.
TEST(Megatron, ExpertAxisJoinsAnOrderThatLeavesItOut) {
  using Order = std::vector<std::string>;
  EXPECT_EQ(with_expert_axis({"pp", "dp", "cp", "tp"}, 1), (Order{"pp", "dp", "cp", "tp"}));
  EXPECT_EQ(with_expert_axis({"pp", "dp", "cp", "tp"}, 8), (Order{"pp", "dp", "ep", "cp", "tp"}));
  EXPECT_EQ(with_expert_axis({"ep:2", "pp", "dp", "cp", "tp"}, 8),
            (Order{"ep:2", "pp", "dp", "ep", "cp", "tp"}));
  EXPECT_EQ(with_expert_axis({"tp", "ep", "pp", "dp", "cp"}, 8),
            (Order{"tp", "ep", "pp", "dp", "cp"}));
  EXPECT_EQ(with_expert_axis({"ep:2", "pp", "ep:4", "dp", "cp", "tp"}, 8),
            (Order{"ep:2", "pp", "ep:4", "dp", "cp", "tp"}));
  MegatronOptions o;
  o.tp = 2;
  o.pp = 4;
  o.cp = 1;
  o.ep = 4;
  std::vector<std::string> names;
  for (const MeshAxis& a : megatron_mesh(o, 8).axes) {
    names.push_back(a.name + std::to_string(a.size));
  }
  EXPECT_EQ(names, (Order{"dp2", "pp4", "ep4", "cp1", "tp2"}));
}

TEST(Megatron, HeadsMustDivideByTp) {
  ModelSpec m = preset("gpt3-1.3b");  // 16 heads
  std::string e = build_error(m, opts(32, 1, 32));
  EXPECT_TRUE(contains(e, "--tp 32 does not divide the model's 16 attention heads")) << e;
  m = preset("llama3-8b");  // 8 key/value heads
  e = build_error(m, opts(16, 1, 32));
  EXPECT_TRUE(contains(e, "--tp 16 does not divide the model's 8 key/value heads")) << e;
}

TEST(Megatron, BatchMustDivide) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = opts(8, 1, 30);  // dp 4
  o.micro_batch = 2;
  std::string e = build_error(m, o);
  EXPECT_TRUE(contains(e, "global batch 30 is not divisible by dp x micro-batch = 4 x 2 = 8")) << e;
  e = build_error(m, opts(8, 1, 0));
  EXPECT_TRUE(contains(e, "--global-batch is required")) << e;
}

TEST(Megatron, InterleavedNeedsMicroBatchesMultipleOfStages) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = opts(8, 4, 6);  // dp 1: 6 micro-batches
  o.vpp = 2;
  o.schedule = ScheduleKind::kInterleaved;
  std::string e = build_error(m, o);
  EXPECT_TRUE(contains(e, "micro-batch count (6) to be a multiple of the pipeline stages (4)"))
      << e;
}

TEST(Megatron, VppNeedsInterleaved) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = opts(8, 4, 8);
  o.vpp = 2;
  std::string e = build_error(m, o);
  EXPECT_TRUE(contains(e, "--vpp > 1 needs --schedule interleaved")) << e;
}

TEST(Megatron, OtherBuilderErrors) {
  const ModelSpec m = preset("gpt3-1.3b");  // 24 layers, seq 2048
  MegatronOptions o = opts(1, 32, 32);
  o.vpp = 2;
  o.schedule = ScheduleKind::kInterleaved;
  EXPECT_TRUE(contains(build_error(m, o), "pp x vpp = 64 segments, but the model has only 24"));
  o = opts(8, 2, 32);
  o.stage_layers = {10, 10};
  EXPECT_TRUE(contains(build_error(m, o), "--stage-layers adds up to 20 layers; the model has 24"));
  o.stage_layers = {24};
  EXPECT_TRUE(contains(build_error(m, o), "--stage-layers lists 1 segments; pp x vpp = 2"));
  o = opts(8, 1, 32);
  o.zero = 4;
  EXPECT_TRUE(contains(build_error(m, o), "--zero must be 0, 1, 2 or 3"));
  ModelSpec odd = m;
  odd.seq_len = 2052;  // not divisible by 8
  o = opts(8, 1, 32);
  o.sequence_parallel = true;
  EXPECT_TRUE(contains(build_error(odd, o),
                       "sequence length 2052 is not divisible by the "
                       "sequence split (8)"));
}

// A two-stage plan whose orders wait on each other: stage 0 runs B0@0 (waiting for stage 1's
// backward of micro-batch 0) before F1@0; stage 1 starts with F1@1 (waiting for F1@0).
TEST(Megatron, CompileRejectsADeadlockingSchedule) {
  const ModelSpec m = preset("gpt3-1.3b");
  Plan p = build(m, opts(8, 2, 4));  // dp 2: 2 micro-batches
  ASSERT_EQ(p.num_micro_batches(), 2);
  using K = BlockKind;
  p.schedule[0].blocks = {
      {K::kForward, 0, 0}, {K::kBackward, 0, 0}, {K::kForward, 1, 0}, {K::kBackward, 1, 0}};
  p.schedule[1].blocks = {
      {K::kForward, 1, 1}, {K::kForward, 0, 1}, {K::kBackward, 0, 1}, {K::kBackward, 1, 1}};
  std::string e = compile_error(p);
  EXPECT_TRUE(contains(e, "the schedule deadlocks:")) << e;
  EXPECT_TRUE(contains(e,
                       "pp=0 (GPUs 0-7) waits in B0@0 for the gradient of the backward of "
                       "micro-batch 0 through segment 1 from pp=1 (GPUs 16-23)"))
      << e;
  EXPECT_TRUE(contains(e,
                       "pp=1 (GPUs 16-23) waits in F1@1 for the activation of F1@0 from pp=0 "
                       "(GPUs 0-7)"))
      << e;
}

// A pair starts once both its blocks' inputs are there. Stage 0 pairs F1@0 with B0@0 (waiting
// for B0@1), which stage 1 runs only after F1@1, which waits for F1@0: the blocks apart would
// run through, the pair deadlocks, and the message names it. A pair that is not a forward and a
// whole backward of another micro-batch is refused.
TEST(Megatron, CompileChecksTheOrdersPairs) {
  const ModelSpec m = preset("gpt3-1.3b");
  Plan p = build(m, opts(8, 2, 4));  // dp 2: 2 micro-batches
  using K = BlockKind;
  Block f1{K::kForward, 1, 0};
  f1.paired_with_next = true;
  p.schedule[0].blocks = {{K::kForward, 0, 0}, f1, {K::kBackward, 0, 0}, {K::kBackward, 1, 0}};
  p.schedule[1].blocks = {
      {K::kForward, 0, 1}, {K::kForward, 1, 1}, {K::kBackward, 0, 1}, {K::kBackward, 1, 1}};
  std::string e = compile_error(p);
  EXPECT_TRUE(contains(e,
                       "pp=0 (GPUs 0-7) waits in F1@0+B0@0 for the gradient of the backward "
                       "of micro-batch 0 through segment 1"))
      << e;
  // Stage 1 runs 1F1B: the pair runs through (a dense model: nothing to hide, the blocks run
  // one after the other in one block).
  p.schedule[1].blocks = {
      {K::kForward, 0, 1}, {K::kBackward, 0, 1}, {K::kForward, 1, 1}, {K::kBackward, 1, 1}};
  auto prog = compile_plan(p, topology("dgx-a100x4"));
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  EXPECT_EQ(to_string(prog->lanes[0].blocks[1]), "F1@0+B0@0");
  EXPECT_TRUE(prog->has_pairs());
  Plan split = p;
  split.schedule[0].blocks[2].kind = K::kBackwardInput;
  split.schedule[0].blocks.push_back({K::kBackwardWeight, 0, 0});
  e = compile_error(split);
  EXPECT_TRUE(contains(e,
                       "pair F1@0+BI0@0 must be a forward (F) and a whole backward (B) of "
                       "another micro-batch"))
      << e;
  Plan same = p;
  same.schedule[0].blocks = {{K::kForward, 0, 0}, f1, {K::kBackward, 1, 0}, {K::kBackward, 0, 0}};
  e = compile_error(same);
  EXPECT_TRUE(contains(e,
                       "pair F1@0+B1@0 must be a forward (F) and a whole backward (B) of "
                       "another micro-batch"))
      << e;
}

// A split backward's weight half (BW) frees what it needs, which the input half (BI) left: each
// linear layer's input and the gradient of its output (dW = x^T dy). GPT-3 1.3B at tp 1, one
// sequence of 2,048 tokens: per layer qkv (in h, out 3h), proj (h, h), fc1 (h, 4h), fc2 (4h, h),
// 16 T h bf16 elements. The forward keeps, BI and BW free, the three summing to nothing.
TEST(Megatron, SplitBackwardsWeightHalfHoldsInputsAndOutputGradients) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = opts(1, 4, 32);
  o.schedule = ScheduleKind::kZbH1;
  const Plan p = build(m, o);
  auto prog = compile_plan(p, topology("dgx-a100x4"));
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  const Segment& middle = p.segments[1];  // layers only
  ASSERT_FALSE(middle.embedding || middle.head);
  const double layers = middle.end_layer - middle.first_layer;
  const double tokens = m.seq_len, h = m.hidden;
  std::map<BlockKind, double> kept;
  for (const BlockTemplate& t : prog->templates) {
    if (t.segment == 1) kept[t.kind] = t.kept_bytes;
  }
  ASSERT_EQ(kept.size(), 3u);
  EXPECT_NEAR(-kept[BlockKind::kBackwardWeight], layers * 16 * tokens * h * 2,
              1e-9 * layers * tokens * h);
  EXPECT_NEAR(kept[BlockKind::kForward] + kept[BlockKind::kBackwardInput] +
                  kept[BlockKind::kBackwardWeight],
              0, 1e-6 * kept[BlockKind::kForward]);
}

TEST(Megatron, CompileRejectsIncompleteSchedules) {
  const ModelSpec m = preset("gpt3-1.3b");
  Plan p = build(m, opts(8, 2, 4));
  Plan missing = p;
  missing.schedule[1].blocks.pop_back();  // B1@1
  std::string e = compile_error(missing);
  EXPECT_TRUE(contains(e,
                       "schedule of pp=1 (GPUs 16-23) never runs the backward of micro-batch 1 "
                       "through segment 1: add B1@1"))
      << e;
  Plan no_forward = p;
  no_forward.schedule[0].blocks.erase(no_forward.schedule[0].blocks.begin());  // F0@0
  e = compile_error(no_forward);
  EXPECT_TRUE(contains(e, "never runs the forward F0@0")) << e;
  Plan twice = p;
  twice.schedule[0].blocks.push_back({BlockKind::kForward, 0, 0});
  e = compile_error(twice);
  EXPECT_TRUE(contains(e, "block F0@0 appears twice")) << e;
  Plan out_of_range = p;
  out_of_range.schedule[0].blocks.back().micro_batch = 5;
  e = compile_error(out_of_range);
  EXPECT_TRUE(contains(e, "names micro-batch 5, but an iteration has 2 micro-batches")) << e;
  Plan wrong_lane = p;
  wrong_lane.schedule[0].blocks[0].segment = 1;
  e = compile_error(wrong_lane);
  EXPECT_TRUE(contains(e, "whose devices are not this order's devices")) << e;
  Plan backward_first = p;
  std::swap(backward_first.schedule[1].blocks[0], backward_first.schedule[1].blocks[1]);
  e = compile_error(backward_first);
  EXPECT_TRUE(contains(e,
                       "runs the backward of micro-batch 0 through segment 1 before its "
                       "forward F0@1"))
      << e;
}

TEST(Megatron, CompileRejectsAMeshThatDoesNotFitTheTopology) {
  const ModelSpec m = preset("gpt3-1.3b");
  Plan p = build(m, opts(8, 1, 32));  // 32 ranks
  std::string e = compile_error(p, "h200x8");
  EXPECT_TRUE(contains(e,
                       "the plan's mesh has 32 ranks but topology 'h200x8' has 8 GPUs (1 "
                       "nodes x 8)"))
      << e;
}

TEST(Megatron, CompileChecksPlanConsistency) {
  const ModelSpec m = preset("gpt3-1.3b");
  Plan p = build(m, opts(8, 2, 4));
  Plan batch = p;
  batch.global_batch = 3;
  EXPECT_TRUE(contains(compile_error(batch),
                       "global batch 3 is not divisible by data-parallel "
                       "degree x micro-batch = 2 x 1 = 2"));
  Plan gap = p;
  gap.segments[1].first_layer = 13;
  EXPECT_TRUE(contains(compile_error(gap), "layer 12 is in no segment"));
  Plan bad_split = p;
  bad_split.partition.push_back({"attn.norm", {{Dim::kHidden, {"tp"}}}});
  EXPECT_TRUE(contains(compile_error(bad_split), "which cannot be split"));
  Plan clash = p;
  clash.placement.factors.clear();
  clash.placement.gpus.assign(32, 0);
  EXPECT_TRUE(contains(compile_error(clash), "placement puts ranks 0 and 1 on the same GPU 0"));
  Plan no_dp = p;
  no_dp.mesh.axes[0].name = "data";
  EXPECT_TRUE(contains(compile_error(no_dp), "the plan's mesh has no 'dp' axis"));
}

}  // namespace
}  // namespace nnsim
