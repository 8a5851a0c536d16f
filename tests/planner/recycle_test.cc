// Repeated forwards (training.recycle, AlphaFold's recycling): the generators' orders, the
// compiled program's transfers and memory, the schedule checker, and Tessel's search on a plan.
#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/schedule_gen.h"
#include "planner/schedules.h"
#include "tests/support/communication_free.h"

namespace nnsim {
namespace {

using testing::communication_free_node;

const std::string kData = NNSIM_TEST_DATA;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

Expected<Plan> recycled_plan(int stages, int micro_batches, int recycle, ScheduleKind kind) {
  Expected<ModelSpec> m = load_model(kData + "/uniform-model.yaml");
  if (!m) return m.error();
  MegatronOptions o;
  o.pp = stages;
  o.global_batch = micro_batches;
  o.schedule = kind;
  o.recycle = recycle;
  return build_megatron_plan(*m, communication_free_node(stages), o);
}

std::string compile_error(const Plan& plan) {
  Expected<Program> p =
      compile_plan(plan, communication_free_node(static_cast<int>(plan.schedule.size())));
  EXPECT_FALSE(p.ok());
  return p.ok() ? "" : p.error().message();
}

Expected<std::vector<Block>> blocks(const std::string& text) {
  std::vector<Block> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(' ', pos);
    if (end == std::string::npos) end = text.size();
    Expected<Block> b = parse_block(text.substr(pos, end - pos));
    if (!b) return b.error();
    out.push_back(*b);
    pos = end + 1;
  }
  return out;
}

// GPipe's and 1F1B's orders with three passes pass the checker (every pass once, in order, no
// deadlock) on 2, 4 and 8 stages, with fewer micro-batches than stages too.
TEST(Recycle, GpipeAndOneFOneBOrdersCompile) {
  for (ScheduleKind kind : {ScheduleKind::kGpipe, ScheduleKind::kOneFOneB}) {
    for (int p : {2, 4, 8}) {
      for (int m : {1, p, 2 * p + 1}) {
        Expected<Plan> plan = recycled_plan(p, m, 3, kind);
        ASSERT_TRUE(plan.ok()) << plan.error().message();
        EXPECT_EQ(plan->recycle, 3);
        for (const DeviceOrder& o : plan->schedule) {
          EXPECT_EQ(o.blocks.size(), static_cast<size_t>(4 * m));  // 3 forwards, 1 backward
        }
        Expected<Program> prog = compile_plan(*plan, communication_free_node(p));
        EXPECT_TRUE(prog.ok()) << to_string(kind) << " p " << p << " m " << m << ": "
                               << (prog.ok() ? "" : prog.error().message());
      }
    }
  }
  // GPipe runs pass by pass; 1F1B each micro-batch's passes back to back.
  Expected<Plan> g = recycled_plan(2, 2, 2, ScheduleKind::kGpipe);
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(contains(plan_to_json(*g), "F0@0 F1@0 F0@0#1 F1@0#1 B1@0 B0@0"));
  Expected<Plan> f = recycled_plan(2, 2, 2, ScheduleKind::kOneFOneB);
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(contains(plan_to_json(*f), "F0@1 F0@1#1 B0@1 F1@1 F1@1#1 B1@1"));
}

// Earlier passes keep no activations (they hold them only while running: the same peak as the
// last pass); the last stage sends each earlier pass's output back to the first stage, which
// receives it before its next pass.
TEST(Recycle, ProgramTransfersAndMemory) {
  Expected<Plan> plan = recycled_plan(4, 4, 3, ScheduleKind::kOneFOneB);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  Expected<Program> prog = compile_plan(*plan, communication_free_node(4));
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  auto recycled = [](const BlockTemplate& t, StepKind kind) {
    int n = 0;
    for (const Step& s : t.steps) n += s.kind == kind && s.recycle;
    return n;
  };
  for (size_t l = 0; l < prog->lanes.size(); ++l) {
    double last_peak = -1, last_kept = -1;
    for (const BlockInstance& b : prog->lanes[l].blocks) {
      if (b.block.kind != BlockKind::kForward || b.block.pass != 2) continue;
      last_peak = prog->templates[b.template_index].peak_bytes;
      last_kept = prog->templates[b.template_index].kept_bytes;
    }
    ASSERT_GT(last_kept, 0) << l;
    for (const BlockInstance& b : prog->lanes[l].blocks) {
      if (b.block.kind != BlockKind::kForward) continue;
      const BlockTemplate& t = prog->templates[b.template_index];
      const int pass = b.block.pass;
      EXPECT_DOUBLE_EQ(t.kept_bytes, pass < 2 ? 0.0 : last_kept) << to_string(b.block);
      EXPECT_DOUBLE_EQ(t.peak_bytes, last_peak) << to_string(b.block);
      EXPECT_EQ(recycled(t, StepKind::kRecv), l == 0 && pass > 0 ? 1 : 0) << to_string(b.block);
      EXPECT_EQ(recycled(t, StepKind::kSend), l == 3 && pass < 2 ? 1 : 0) << to_string(b.block);
      for (const Step& s : t.steps) {
        if (s.recycle) {
          EXPECT_EQ(s.peer_segment, l == 0 ? 3 : 0);
        }
      }
    }
  }
}

// The checker names the device and the block: a pass outside training.recycle, a missing pass,
// passes out of order, and orders that deadlock on the recycled output.
TEST(Recycle, ScheduleCheckNamesTheDeviceAndTheBlock) {
  Expected<Plan> plan = recycled_plan(2, 2, 3, ScheduleKind::kGpipe);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  auto with = [&](int order, const std::string& text) {
    Plan p = *plan;
    Expected<std::vector<Block>> b = blocks(text);
    EXPECT_TRUE(b.ok()) << b.error().message();
    p.schedule[order].blocks = *b;
    return compile_error(p);
  };
  std::string e = with(0, "F0@0 F1@0 F0@0#1 F1@0#1 F0@0#3 F1@0#2 B1@0 B0@0");
  EXPECT_TRUE(contains(e,
                       "schedule of pp=0 (GPU 0): block F0@0#3 names forward pass 3, but "
                       "training.recycle is 3 (passes 0-2"))
      << e;
  e = with(0, "F0@0 F1@0 F0@0#1 F1@0#1 F1@0#2 F1@0#2 B1@0 B0@0");
  EXPECT_TRUE(contains(e, "block F1@0#2 appears twice")) << e;
  e = with(0, "F0@0 F1@0 F0@0#1 F1@0#1 F1@0#2 B1@0 B0@0");
  EXPECT_TRUE(contains(e,
                       "schedule of pp=0 (GPU 0) never runs the forward F0@0#2 (pass 2 of "
                       "training.recycle = 3); add it"))
      << e;
  e = with(0, "F0@0 F1@0 F0@0#2 F1@0#1 F0@0#1 F1@0#2 B1@0 B0@0");
  EXPECT_TRUE(contains(e,
                       "schedule of pp=0 (GPU 0) runs F0@0#2 before F0@0#1; a pass reads the "
                       "one before it"))
      << e;
  // Stage 1 runs micro-batch 0's passes back to back, but stage 0 runs pass 1 of micro-batch 1
  // before pass 2 of micro-batch 0: each waits for the other.
  Plan p = *plan;
  p.schedule[0].blocks = *blocks("F0@0 F1@0 F0@0#1 F1@0#1 F0@0#2 F1@0#2 B1@0 B0@0");
  p.schedule[1].blocks = *blocks("F0@1 F0@1#1 F0@1#2 F1@1 F1@1#1 F1@1#2 B1@1 B0@1");
  e = compile_error(p);
  EXPECT_TRUE(contains(e, "the schedule deadlocks")) << e;
  EXPECT_TRUE(contains(e,
                       "pp=0 (GPU 0) waits in F1@0#1 for the recycled output of F1@1 from "
                       "pp=1 (GPU 1)"))
      << e;
  EXPECT_TRUE(contains(e, "pp=1 (GPU 1) waits in F0@1#2 for the activation of F0@0#2")) << e;
}

TEST(Recycle, GeneratorsThatCannotPlacePassesSayWhat) {
  Expected<Plan> plan = recycled_plan(4, 8, 3, ScheduleKind::kOneFOneB);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  Expected<Plan> zb = generate_schedule(*plan, communication_free_node(4), ScheduleKind::kZbH1);
  ASSERT_FALSE(zb.ok());
  EXPECT_TRUE(contains(zb.error().message(),
                       "the zb-h1 schedule does not place repeated forwards "
                       "(training.recycle = 3)"))
      << zb.error().message();
  Expected<Plan> g = generate_schedule(*plan, communication_free_node(4), ScheduleKind::kGpipe);
  ASSERT_TRUE(g.ok()) << g.error().message();
  EXPECT_TRUE(compile_plan(*g, communication_free_node(4)).ok());
  Expected<ModelSpec> m = load_model(kData + "/uniform-model.yaml");
  ASSERT_TRUE(m.ok());
  MegatronOptions o;
  o.pp = 2;
  o.vpp = 2;
  o.global_batch = 4;
  o.schedule = ScheduleKind::kInterleaved;
  o.recycle = 2;
  Expected<Plan> inter = build_megatron_plan(*m, communication_free_node(2), o);
  ASSERT_FALSE(inter.ok());
  EXPECT_TRUE(contains(inter.error().message(), "interleaved schedule does not place repeated"))
      << inter.error().message();
  o.vpp = 1;
  o.schedule = ScheduleKind::kOneFOneB;
  o.recycle = 0;
  Expected<Plan> zero = build_megatron_plan(*m, communication_free_node(2), o);
  ASSERT_FALSE(zero.ok());
  EXPECT_TRUE(contains(zero.error().message(), "--recycle must be at least 1"));
}

// With several segments per stage the builder's provisional order for Tessel runs one
// micro-batch at a time (every pass, then the backward); the search starts from it.
TEST(Recycle, TesselFromAnInterleavedPlacement) {
  Expected<ModelSpec> m = load_model(kData + "/uniform-model.yaml");
  ASSERT_TRUE(m.ok());
  MegatronOptions o;
  o.pp = 2;
  o.vpp = 2;
  o.global_batch = 4;
  o.schedule = ScheduleKind::kTessel;
  o.recycle = 2;
  Expected<Plan> plan = build_megatron_plan(*m, communication_free_node(2), o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_EQ(plan->schedule_name, "tessel");
  for (const DeviceOrder& d : plan->schedule) {
    // Two segments, four micro-batches, two passes each.
    EXPECT_EQ(std::count_if(d.blocks.begin(), d.blocks.end(),
                            [](const Block& b) { return b.kind == BlockKind::kForward; }),
              2 * 4 * 2);
  }
  Expected<Program> prog = compile_plan(*plan, communication_free_node(2));
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  // Faster than one micro-batch at a time.
  std::vector<std::vector<Block>> orders;
  for (const DeviceOrder& d : plan->schedule) orders.push_back(d.blocks);
  Expected<std::vector<std::vector<Block>>> base = pipeline_orders(ScheduleKind::kTessel, 2, 2, 4);
  ASSERT_TRUE(base.ok());
  ASSERT_TRUE(add_forward_passes(ScheduleKind::kTessel, 2, *base).ok());
  Plan sequential = *plan;
  for (size_t i = 0; i < sequential.schedule.size(); ++i)
    sequential.schedule[i].blocks = (*base)[i];
  Expected<Program> seq = compile_plan(sequential, communication_free_node(2));
  ASSERT_TRUE(seq.ok()) << seq.error().message();
  EXPECT_EQ((*base)[0].front(), (Block{BlockKind::kForward, 0, 0, 0}));
  EXPECT_EQ((*base)[0][1], (Block{BlockKind::kForward, 0, 2, 0}));
  EXPECT_EQ((*base)[0][2], (Block{BlockKind::kForward, 0, 0, 1}));
  EXPECT_LT(estimate_program(*prog).iteration_time, 0.9 * estimate_program(*seq).iteration_time);
}

// Tessel's search on a plan with three passes over four stages: valid orders (they compile),
// faster than 1F1B with each micro-batch's passes back to back, within its memory.
TEST(Recycle, SearchBeatsBackToBackPasses) {
  Expected<Plan> plan = recycled_plan(4, 8, 3, ScheduleKind::kOneFOneB);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  const Topology topo = communication_free_node(4);
  Expected<SearchedSchedule> s = search_schedule(*plan, topo);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_FALSE(s->kept_input);
  // Per device and micro-batch: three forwards (the earlier two keep nothing), then the backward.
  int forwards = 0;
  for (const TesselBlock& b : s->problem.blocks) {
    if (b.kind != BlockKind::kForward) continue;
    ++forwards;
    EXPECT_EQ(b.bytes == 0, b.pass < 2) << b.segment << "#" << b.pass;
  }
  EXPECT_EQ(forwards, 3 * 4);
  EXPECT_LT(s->tessel.makespan, 0.8 * s->input_makespan);
  Expected<Program> before = compile_plan(*plan, topo);
  Expected<Program> after = compile_plan(s->plan, topo);
  ASSERT_TRUE(before.ok() && after.ok()) << (after.ok() ? "" : after.error().message());
  const Estimate e0 = estimate_program(*before), e1 = estimate_program(*after);
  EXPECT_LT(e1.iteration_time, 0.8 * e0.iteration_time);
  // Within the input's memory, as its orders hold it with the backward split: the input half
  // keeps the weight gradients' inputs of the operators it has passed (0.5 % above here).
  EXPECT_LE(e1.peak_memory, e0.peak_memory * 1.01);
  // Deterministic.
  Expected<SearchedSchedule> again = search_schedule(*plan, topo);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(plan_to_json(again->plan), plan_to_json(s->plan));
}

}  // namespace
}  // namespace nnsim
