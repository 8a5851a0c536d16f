// Segments spanning several pipeline stages: Llama 3 8B's head sharded over the 4 stages of a
// pipeline (vocabulary split along pp). The compiler's lanes, shards and transfers, the schedule
// check's errors for a spanning block missing from an order and for spanning blocks in different
// orders, the 1F1B / GPipe placement for several depths, and the plan's JSON round trip.
#include <gtest/gtest.h>

#include <algorithm>

#include <fmt/format.h>

#include "core/model.h"
#include "core/program.h"
#include "core/schedule_check.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/schedules.h"

namespace nnsim {
namespace {

Topology one_node() {
  Expected<Topology> t = load_topology("dgx-h100-superpod");
  EXPECT_TRUE(t.ok());
  Expected<Topology> r = resize_topology(*t, 1);
  EXPECT_TRUE(r.ok());
  return *r;
}

// pp 4 on GPUs 0-3 of one node (the others idle), 1F1B.
Plan llama_plan(bool shard_head, ScheduleKind schedule = ScheduleKind::kOneFOneB) {
  Expected<ModelSpec> m = load_model("llama3-8b");
  EXPECT_TRUE(m.ok());
  MegatronOptions o;
  o.pp = 4;
  o.avoid_gpus = {4, 5, 6, 7};
  o.global_batch = 8;
  o.schedule = schedule;
  o.shard_head = shard_head;
  Expected<Plan> p = build_megatron_plan(*m, one_node(), o);
  EXPECT_TRUE(p.ok()) << (p.ok() ? "" : p.error().message());
  return *p;
}

Program compile(const Plan& p) {
  Expected<Program> prog = compile_plan(p, one_node());
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  return *prog;
}

TEST(Spanning, ShardedHeadSpansEveryStage) {
  const Plan plan = llama_plan(true);
  ASSERT_EQ(plan.segments.size(), 5u);
  const Segment& head = plan.segments[4];
  EXPECT_TRUE(head.head);
  EXPECT_TRUE(head.devices.empty());
  EXPECT_EQ(plan.model.vocab % (128 * 4), 0);  // padded so that every pp shard is equal
  const Program prog = compile(plan);
  EXPECT_EQ(prog.lanes_of_segment[4], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(prog.lanes_of_segment[3], (std::vector<int>{3}));
  // Every order runs the head's F and B of every micro-batch.
  for (const Lane& lane : prog.lanes) {
    int head_blocks = 0;
    for (const auto& b : lane.blocks) head_blocks += b.block.segment == 4;
    EXPECT_EQ(head_blocks, 2 * prog.micro_batches);
  }
}

TEST(Spanning, EveryDeviceHoldsAQuarterOfTheHead) {
  const Program sharded = compile(llama_plan(true));
  const Program plain = compile(llama_plan(false));
  double norm = 0, proj = 0;
  for (const Op& op : sharded.graph.head.ops)
    (op.name == "head.proj" ? proj : norm) += op.parameters();
  const double h = sharded.plan.model.hidden;
  const double vocab_padding = h * (sharded.plan.model.vocab - plain.plan.model.vocab);
  ASSERT_GT(proj, 0);
  EXPECT_EQ(proj, h * sharded.plan.model.vocab);
  // Stages 0-2 gain a quarter of the projection and the (replicated) final norm; stage 0's
  // embedding grows by the vocabulary padding; the last stage keeps a quarter instead of all.
  const double quarter = norm + proj / 4;
  EXPECT_DOUBLE_EQ(sharded.lanes[0].parameters - plain.lanes[0].parameters,
                   quarter + vocab_padding);
  EXPECT_DOUBLE_EQ(sharded.lanes[1].parameters - plain.lanes[1].parameters, quarter);
  EXPECT_DOUBLE_EQ(sharded.lanes[2].parameters - plain.lanes[2].parameters, quarter);
  double plain_head = 0;
  for (const Op& op : plain.graph.head.ops) plain_head += op.parameters();
  EXPECT_DOUBLE_EQ(sharded.lanes[3].parameters - plain.lanes[3].parameters, quarter - plain_head);
  // The last stage's static memory drops by three quarters of the head's weights, gradients and
  // optimizer state (18 bytes per parameter for bf16 Adam).
  EXPECT_LT(sharded.lanes[3].memory.total(), plain.lanes[3].memory.total() - 0.7 * proj * 18);
}

TEST(Spanning, TransfersAndJointCollectives) {
  const Program prog = compile(llama_plan(true));
  const int pp_bit = 1 << prog.plan.mesh.axis_index("pp");
  for (size_t l = 0; l < prog.lanes.size(); ++l) {
    for (const auto& b : prog.lanes[l].blocks) {
      const BlockTemplate& t = prog.templates[b.template_index];
      EXPECT_EQ(t.lane, static_cast<int>(l));
      if (b.block.segment != 4) continue;
      int recvs = 0, sends = 0, joint = 0;
      for (const Step& s : t.steps) {
        recvs += s.kind == StepKind::kRecv;
        sends += s.kind == StepKind::kSend;
        joint += s.kind == StepKind::kCollective && (s.axes & pp_bit);
        if (s.kind == StepKind::kRecv) {
          EXPECT_EQ(s.peer_lane, 3);
        }
      }
      // The head's forward receives the last layer's output from stage 3 (local on stage 3);
      // its input gradient is all-reduced over pp, so stage 3 has it without a transfer.
      EXPECT_EQ(sends, 0);
      if (b.block.kind == BlockKind::kForward) {
        EXPECT_EQ(recvs, l == 3 ? 0 : 1);
        EXPECT_EQ(joint, 3);  // the loss's statistics (max, sum, target logit)
      } else {
        EXPECT_EQ(recvs, 0);
        EXPECT_GE(joint, 1);  // the projection's input gradient (partial sums over pp)
      }
    }
  }
  // Stage 3's last-layer forward sends to the three other stages; its backward receives nothing.
  for (const auto& b : prog.lanes[3].blocks) {
    if (b.block.segment != 3) continue;
    int sends = 0, recvs = 0;
    for (const Step& s : prog.templates[b.template_index].steps) {
      sends += s.kind == StepKind::kSend;
      recvs += s.kind == StepKind::kRecv && s.gradient;
    }
    EXPECT_EQ(sends, b.block.kind == BlockKind::kForward ? 3 : 1);  // backward: to stage 2
    EXPECT_EQ(recvs, 0);
  }
}

TEST(Spanning, LastStageComputeDrops) {
  const Program sharded = compile(llama_plan(true));
  const Program plain = compile(llama_plan(false));
  auto compute = [](const Program& p, int lane) {
    double s = 0;
    for (const auto& b : p.lanes[lane].blocks) {
      for (const Step& st : p.templates[b.template_index].steps) {
        if (st.kind == StepKind::kCompute) s += st.seconds;
      }
    }
    return s;
  };
  EXPECT_LT(compute(sharded, 3), 0.9 * compute(plain, 3));
  EXPECT_GT(compute(sharded, 0), compute(plain, 0));
}

TEST(Spanning, MissingSpanningBlockIsNamed) {
  Plan plan = llama_plan(true);
  auto& blocks = plan.schedule[1].blocks;
  blocks.erase(std::find(blocks.begin(), blocks.end(), Block{BlockKind::kForward, 1, 4}));
  Expected<Program> prog = compile_plan(plan, one_node());
  ASSERT_FALSE(prog.ok());
  EXPECT_NE(prog.error().message().find("pp=1 (GPU 1) never runs the forward F1@4"),
            std::string::npos)
      << prog.error().message();
}

TEST(Spanning, SpanningBlocksInDifferentOrdersDeadlock) {
  Plan plan = llama_plan(true);
  // Stage 0 runs micro-batch 1's head before micro-batch 0's; the others the other way round.
  auto& b = plan.schedule[0].blocks;
  auto at = [&](BlockKind k, int mb) {
    return std::find(b.begin(), b.end(), Block{k, mb, 4}) - b.begin();
  };
  std::swap(b[at(BlockKind::kForward, 0)], b[at(BlockKind::kForward, 1)]);
  std::swap(b[at(BlockKind::kBackward, 0)], b[at(BlockKind::kBackward, 1)]);
  Expected<Program> prog = compile_plan(plan, one_node());
  ASSERT_FALSE(prog.ok());
  const std::string msg = prog.error().message();
  EXPECT_NE(msg.find("the schedule deadlocks"), std::string::npos) << msg;
  EXPECT_NE(msg.find("pp=0 (GPU 0) waits in F1@4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("pp=1 (GPU 1) waits in F0@4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("joint block"), std::string::npos) << msg;
}

TEST(Spanning, OneFOneBAndGpipePlacementNeverDeadlocks) {
  for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kGpipe}) {
    for (int p : {2, 4, 8}) {
      for (int m : {1, 2, 3, p - 1, p, p + 1, 2 * p, 16}) {
        if (m < 1) continue;
        Expected<std::vector<std::vector<Block>>> orders = pipeline_orders(kind, p, 1, m);
        ASSERT_TRUE(orders.ok());
        ASSERT_TRUE(add_spanning_blocks(kind, p, *orders).ok());
        std::vector<OrderView> views;
        for (int d = 0; d < p; ++d) views.push_back({fmt::format("pp={}", d), (*orders)[d]});
        std::vector<int> next;
        std::vector<std::vector<int>> lanes;
        for (int s = 0; s <= p; ++s) next.push_back(s < p ? s + 1 : -1);
        for (int s = 0; s < p; ++s) lanes.push_back({s});
        std::vector<int> all(p);
        for (int d = 0; d < p; ++d) all[d] = d;
        lanes.push_back(all);
        Status st = check_schedule(views, p + 1, m, next, lanes);
        EXPECT_TRUE(st.ok()) << to_string(kind) << " p=" << p << " m=" << m << ": "
                             << (st.ok() ? "" : st.error().message());
      }
    }
  }
}

TEST(Spanning, OtherSchedulesAreRefused) {
  Expected<ModelSpec> m = load_model("llama3-8b");
  MegatronOptions o;
  o.pp = 4;
  o.avoid_gpus = {4, 5, 6, 7};
  o.global_batch = 8;
  o.shard_head = true;
  for (ScheduleKind k : {ScheduleKind::kZbH1, ScheduleKind::kMerak, ScheduleKind::kInterleaved}) {
    o.schedule = k;
    o.vpp = k == ScheduleKind::kInterleaved ? 2 : 1;
    Expected<Plan> p = build_megatron_plan(*m, one_node(), o);
    ASSERT_FALSE(p.ok());
    EXPECT_NE(p.error().message().find("--shard-head"), std::string::npos);
  }
  std::vector<std::vector<Block>> orders(2);
  EXPECT_FALSE(add_spanning_blocks(ScheduleKind::kZbV, 4, orders).ok());
}

TEST(Spanning, TiedEmbeddingsAreRefusedByName) {
  Expected<ModelSpec> m = load_model("gpt3-1.3b");  // ties its embedding and output weights
  ASSERT_TRUE(m.ok());
  MegatronOptions o;
  o.pp = 4;
  o.avoid_gpus = {4, 5, 6, 7};
  o.global_batch = 8;
  o.shard_head = true;
  Expected<Plan> p = build_megatron_plan(*m, one_node(), o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message().find("--shard-head: model 'gpt3-1.3b' uses its embedding "
                                     "matrix in the head (tied_embeddings: true"),
            std::string::npos)
      << p.error().message();
  o.shard_head = false;
  o.shard_embedding = true;
  o.schedule = ScheduleKind::kTessel;
  p = build_megatron_plan(*m, one_node(), o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message().find("--shard-embedding"), std::string::npos)
      << p.error().message();
  // Multi-token prediction's lookup uses the embedding matrix on the head's devices too.
  Expected<ModelSpec> mtp = load_model("llama3-8b");
  ASSERT_TRUE(mtp.ok());
  mtp->mtp_layers = 1;
  o.shard_embedding = false;
  o.shard_head = true;
  o.schedule = ScheduleKind::kOneFOneB;
  p = build_megatron_plan(*mtp, one_node(), o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message().find("multi-token prediction's lookup, mtp_layers"),
            std::string::npos)
      << p.error().message();
}

TEST(Spanning, SplitAlongPpNeedsASpanningSegment) {
  Plan plan = llama_plan(false);
  plan.partition.push_back({"head.proj", {{Dim::kVocab, {"pp"}}}});
  Expected<Program> prog = compile_plan(plan, one_node());
  ASSERT_FALSE(prog.ok());
  EXPECT_NE(prog.error().message().find("operator 'head.proj' of segment 'stage3' is split along "
                                        "mesh axis 'pp'"),
            std::string::npos)
      << prog.error().message();
}

TEST(Spanning, GpipeCompiles) {
  const Program prog = compile(llama_plan(true, ScheduleKind::kGpipe));
  EXPECT_EQ(prog.lanes_of_segment[4].size(), 4u);
}

TEST(Spanning, JsonRoundTrip) {
  const Plan plan = llama_plan(true);
  const std::string json = plan_to_json(plan);
  Expected<Plan> back = parse_plan(json, "sharded.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(plan_to_json(*back), json);
  EXPECT_TRUE(back->segments[4].devices.empty());
  EXPECT_EQ(compile(*back).lanes_of_segment[4].size(), 4u);
}

TEST(Spanning, EstimatorWaitsForEveryLane) {
  const Program prog = compile(llama_plan(true));
  const Estimate e = estimate_program(prog);
  EXPECT_GT(e.iteration_time, 0);
  // Ordinary plans are unaffected by the rendezvous.
  const Estimate plain = estimate_program(compile(llama_plan(false)));
  EXPECT_GT(plain.iteration_time, 0);
}

}  // namespace
}  // namespace nnsim
