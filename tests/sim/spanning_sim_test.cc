// Simulating a segment spanning every pipeline stage: Llama 3 8B, pp 4 on 4 H100s, the head
// sharded over the stages (vocabulary split along pp). Its collectives are joint collectives of
// the four lanes, attributed to the pp group; the last stage's memory and compute drop.
#include <gtest/gtest.h>

#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/schedule_gen.h"
#include "sim/simulator.h"

namespace nnsim {
namespace {

Topology one_node() {
  Expected<Topology> t = load_topology("dgx-h100-superpod");
  EXPECT_TRUE(t.ok());
  Expected<Topology> r = resize_topology(*t, 1);
  EXPECT_TRUE(r.ok());
  return *r;
}

Program compile(bool shard_head, int tp = 1) {
  Expected<ModelSpec> m = load_model("llama3-8b");
  EXPECT_TRUE(m.ok());
  MegatronOptions o;
  o.tp = tp;
  o.pp = 4;
  if (tp == 1) o.avoid_gpus = {4, 5, 6, 7};  // 4 of the node's 8 GPUs
  o.global_batch = 8;
  o.shard_head = shard_head;
  Expected<Plan> p = build_megatron_plan(*m, one_node(), o);
  EXPECT_TRUE(p.ok()) << (p.ok() ? "" : p.error().message());
  Expected<Program> prog = compile_plan(*p, one_node());
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  return *prog;
}

SimResult run(const Program& p) {
  SimOptions o;
  o.record_tasks = true;
  Expected<SimResult> r = simulate(p, o);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
  return *r;
}

TEST(SpanningSim, ShardedHeadOnFourStages) {
  const Program sharded_prog = compile(true);
  const Program plain_prog = compile(false);
  const SimResult sharded = run(sharded_prog);
  const SimResult plain = run(plain_prog);
  ASSERT_EQ(sharded.lanes.size(), 4u);
  ASSERT_GT(sharded.iteration_time, 0);
  // The last stage no longer holds the whole head: less memory and less compute.
  EXPECT_LT(sharded.lanes[3].peak_memory, plain.lanes[3].peak_memory - 4e9);
  EXPECT_LT(sharded.lanes[3].breakdown.compute, 0.9 * plain.lanes[3].breakdown.compute);
  // The head's loss statistics are all-reduced over pp by all four lanes together.
  const int pp_bit = 1 << sharded_prog.plan.mesh.axis_index("pp");
  int loss_label = -1;
  for (size_t i = 0; i < sharded.labels.size(); ++i) {
    if (sharded.labels[i] == "loss") loss_label = static_cast<int>(i);
  }
  std::vector<int> joint_per_lane(4, 0);
  for (const TaskRecord& t : sharded.tasks) {
    if (t.kind == TaskKind::kCollective && t.label == loss_label) {
      EXPECT_EQ(t.axes, static_cast<uint32_t>(pp_bit));
      ++joint_per_lane[t.lane];
    }
  }
  // Three all-reduces per micro-batch's forward on every lane.
  for (int n : joint_per_lane) EXPECT_EQ(n, 3 * sharded.micro_batches);
  for (const auto& lane : sharded.lanes) {
    EXPECT_GT(lane.breakdown.exposed_comm.count("pp"), 0u);
    // The parts still add up to the iteration time.
    const Breakdown& b = lane.breakdown;
    EXPECT_NEAR(b.compute + b.recompute + b.optimizer + b.total_exposed_comm() + b.bubble,
                sharded.iteration_time, 1e-9 * sharded.iteration_time);
  }
  // The estimator's rendezvous keeps it near the simulation.
  const Estimate e = estimate_program(sharded_prog);
  EXPECT_NEAR(e.iteration_time, sharded.iteration_time, 0.15 * sharded.iteration_time);
}

TEST(SpanningSim, TensorAndPipelineGroup) {
  const Program prog = compile(true, 2);
  const SimResult r = run(prog);
  const uint32_t both =
      (1u << prog.plan.mesh.axis_index("pp")) | (1u << prog.plan.mesh.axis_index("tp"));
  bool seen = false;
  for (const TaskRecord& t : r.tasks)
    seen = seen || (t.kind == TaskKind::kCollective && t.axes == both);
  EXPECT_TRUE(seen);
  EXPECT_EQ(prog.axes_name(both), "pp+tp");
  bool exposed = false;
  for (const auto& lane : r.lanes) exposed = exposed || lane.breakdown.exposed_comm.count("pp+tp");
  EXPECT_TRUE(exposed);
}

TEST(SpanningSim, Deterministic) {
  const Program prog = compile(true);
  const SimResult a = run(prog);
  const SimResult b = run(prog);
  EXPECT_EQ(a.iteration_time, b.iteration_time);
  EXPECT_EQ(a.tasks.size(), b.tasks.size());
}

// Tessel's search on the sharded head's placement: the joint head blocks no longer wait for the
// first stage's backward, so the iteration is much shorter than 1F1B's on the same placement,
// within the memory the 1F1B orders use.
TEST(SpanningSim, TesselSearchBeatsOneFOneBOnTheShardedHead) {
  const Program one_f_one_b = compile(true);
  Expected<SearchedSchedule> searched = search_schedule(one_f_one_b.plan, one_node());
  ASSERT_TRUE(searched.ok()) << searched.error().message();
  EXPECT_EQ(searched->plan.schedule_name, "tessel");
  EXPECT_LE(searched->tessel.period, searched->tessel.lower_bound * 1.02);
  Expected<Program> tessel = compile_plan(searched->plan, one_node());
  ASSERT_TRUE(tessel.ok()) << tessel.error().message();
  const SimResult before = run(one_f_one_b);
  const SimResult after = run(*tessel);
  EXPECT_LT(after.iteration_time, 0.7 * before.iteration_time);
  // The solver's own account of the blocks and the transfers between them is close to the
  // simulation.
  EXPECT_NEAR(searched->tessel.makespan, after.iteration_time, 0.03 * after.iteration_time);
  ASSERT_EQ(after.lanes.size(), before.lanes.size());
  for (size_t l = 0; l < after.lanes.size(); ++l) {
    EXPECT_LE(after.lanes[l].peak_memory, before.lanes[l].peak_memory * 1.001) << l;
  }
}

// Tessel's M shape: the embedding and the head both sharded over the four stages, scheduled by
// the search. The embedding's vocabulary-split lookup leaves partial sums that the four lanes
// all-reduce together; every stage holds a quarter of both tables; the iteration beats 1F1B
// with the whole embedding and head on the end stages.
TEST(SpanningSim, ShardedEmbeddingAndHeadUnderTheSearch) {
  Expected<ModelSpec> m = load_model("llama3-8b");
  ASSERT_TRUE(m.ok());
  MegatronOptions o;
  o.pp = 4;
  o.avoid_gpus = {4, 5, 6, 7};
  o.global_batch = 8;
  o.shard_head = true;
  o.shard_embedding = true;
  o.schedule = ScheduleKind::kOneFOneB;
  Expected<Plan> refused = build_megatron_plan(*m, one_node(), o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("--schedule tessel"), std::string::npos);
  o.schedule = ScheduleKind::kTessel;
  Expected<Plan> p = build_megatron_plan(*m, one_node(), o);
  ASSERT_TRUE(p.ok()) << p.error().message();
  Expected<Program> prog = compile_plan(*p, one_node());
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  const SimResult r = run(*prog);
  const SimResult plain = run(compile(false));
  EXPECT_LT(r.iteration_time, 0.9 * plain.iteration_time);
  // The partial sums of every micro-batch's lookup, all-reduced over pp on every lane.
  int label = -1;
  for (size_t i = 0; i < r.labels.size(); ++i) {
    if (r.labels[i] == "embed.partial-sums") label = static_cast<int>(i);
  }
  ASSERT_GE(label, 0);
  std::vector<int> per_lane(4, 0);
  for (const TaskRecord& t : r.tasks) {
    if (t.kind == TaskKind::kCollective && t.label == label) {
      EXPECT_EQ(t.axes, 1u << prog->plan.mesh.axis_index("pp"));
      ++per_lane[t.lane];
    }
  }
  for (int n : per_lane) EXPECT_EQ(n, r.micro_batches);
  // Every stage holds the same quarter of the embedding and of the head.
  for (size_t l = 1; l < prog->lanes.size(); ++l) {
    EXPECT_NEAR(prog->lanes[l].parameters, prog->lanes[0].parameters,
                1e-9 * prog->lanes[0].parameters);
  }
}

// The embedding sharded over the stages under sequence parallelism with rotary positions: the
// first stage's layer 0 all-gathers its input gradient (the embedding needs the whole sequence),
// so the gradient it hands the embedding's other lane is whole too: a 1/tp slice of it sent
// (scatter-gather) and all-gathered over tp on arrival, as for any replicated transfer. It used
// to be priced as the layers' sequence slice, with no gather before the embedding's backward.
TEST(SpanningSim, ShardedEmbeddingGetsTheWholeGradientUnderSequenceParallelism) {
  Expected<ModelSpec> m = load_model("llama3-8b");
  ASSERT_TRUE(m.ok());
  MegatronOptions o;
  o.tp = 2;
  o.pp = 2;
  o.avoid_gpus = {4, 5, 6, 7};
  o.global_batch = 4;
  o.sequence_parallel = true;
  o.shard_head = true;
  o.shard_embedding = true;
  o.schedule = ScheduleKind::kTessel;
  Expected<Plan> p = build_megatron_plan(*m, one_node(), o);
  ASSERT_TRUE(p.ok()) << p.error().message();
  Expected<Program> prog = compile_plan(*p, one_node());
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  int embedding = -1;
  for (size_t s = 0; s < p->segments.size(); ++s) {
    if (p->segments[s].embedding) embedding = static_cast<int>(s);
  }
  ASSERT_GE(embedding, 0);
  ASSERT_EQ(p->segments[embedding].end_layer, 0);                        // a segment of its own
  const double whole = prog->graph.blocks[0].ops.back().output.bytes();  // [b, s, h]
  const uint32_t tp = 1u << p->mesh.axis_index("tp");
  int checked = 0;
  for (const BlockTemplate& t : prog->templates) {
    if (t.segment != embedding || t.kind == BlockKind::kForward ||
        t.kind == BlockKind::kBackwardWeight) {
      continue;
    }
    bool received = false, gathered = false;
    for (const Step& st : t.steps) {
      if (st.kind == StepKind::kRecv && st.gradient) {
        received = true;
        EXPECT_DOUBLE_EQ(st.bytes, whole / 2);
      }
      if (received && st.kind == StepKind::kCollective &&
          st.collective == CollectiveKind::kAllGather && st.axes == tp &&
          prog->labels[st.label] == "gradient") {
        gathered = true;
        EXPECT_DOUBLE_EQ(st.bytes, whole);
      }
    }
    // The lane that runs the first stage has the gradient in memory; the other receives it.
    EXPECT_EQ(received, t.lane != 0) << "lane " << t.lane;
    EXPECT_EQ(gathered, t.lane != 0) << "lane " << t.lane;
    ++checked;
  }
  EXPECT_EQ(checked, 2);
}

}  // namespace
}  // namespace nnsim
