#include "planner/schedules.h"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/program.h"
#include "core/schedule_check.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/schedule_gen.h"

namespace nnsim {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::vector<Block> order(ScheduleKind kind, int stage, int stages, int chunks, int m,
                         PipelineRuntime runtime = PipelineRuntime::kMegatron) {
  auto o = pipeline_orders(kind, stages, chunks, m, {}, runtime);
  EXPECT_TRUE(o.ok()) << (o.ok() ? "" : o.error().message());
  return o.ok() ? (*o)[stage] : std::vector<Block>{};
}

std::string text(const std::vector<Block>& blocks) {
  std::string s;
  for (const auto& b : blocks) s += (s.empty() ? "" : " ") + to_string(b);
  return s;
}

int leading_forwards(const std::vector<Block>& blocks) {
  int n = 0;
  while (n < static_cast<int>(blocks.size()) && blocks[n].kind == BlockKind::kForward) ++n;
  return n;
}

// Every forward and backward of every micro-batch through each of the stage's chunks, once.
void expect_complete(const std::vector<Block>& blocks, int stage, int stages, int chunks, int m) {
  std::map<std::tuple<int, int, int>, int> seen;
  for (const auto& b : blocks) ++seen[{static_cast<int>(b.kind), b.micro_batch, b.segment}];
  EXPECT_EQ(blocks.size(), static_cast<size_t>(2 * m * chunks));
  for (int c = 0; c < chunks; ++c) {
    for (int mb = 0; mb < m; ++mb) {
      for (BlockKind k : {BlockKind::kForward, BlockKind::kBackward}) {
        EXPECT_EQ((seen[{static_cast<int>(k), mb, segment_of(c, stage, stages)}]), 1)
            << to_string(k) << mb << "@" << segment_of(c, stage, stages) << " stage " << stage;
      }
    }
  }
}

// Runs the whole pipeline's orders through the schedule checker (completeness, dependencies,
// deadlock).
Status check_pipeline(ScheduleKind kind, int stages, int chunks, int m,
                      PipelineRuntime runtime = PipelineRuntime::kMegatron) {
  std::vector<OrderView> views;
  for (int p = 0; p < stages; ++p) {
    views.push_back({"pp=" + std::to_string(p), order(kind, p, stages, chunks, m, runtime)});
  }
  const int segments = stages * chunks;
  std::vector<int> next(segments), lane(segments);
  for (int s = 0; s < segments; ++s) {
    next[s] = s + 1 < segments ? s + 1 : -1;
    lane[s] = s % stages;
  }
  return check_schedule(views, segments, m, next, lane);
}

// The searched plan's estimated iteration is within `time_slack` of the input's, and its peak
// memory within 0.5 %: the search prices a split backward's held weight-gradient inputs and
// output gradients with each kind's largest block of the segment, not the running transient's
// exact walk (0.14 % above the 1F1B orders' peak on GPT-3 1.3B over 4 stages; the repeated
// forwards' search, tests/planner/recycle_test.cc, 0.5 %).
void expect_no_worse(const Plan& input, const Plan& searched, const Topology& topo,
                     double time_slack) {
  auto before = compile_plan(input, topo);
  auto after = compile_plan(searched, topo);
  ASSERT_TRUE(before.ok() && after.ok()) << (after.ok() ? "" : after.error().message());
  EXPECT_LE(estimate_program(*after).iteration_time,
            time_slack * estimate_program(*before).iteration_time);
  EXPECT_LE(estimate_program(*after).peak_memory, 1.005 * estimate_program(*before).peak_memory);
}

TEST(Schedules, OneFOneBWarmUp) {
  const int stages = 4, m = 8;
  for (int p = 0; p < stages; ++p) {
    auto o = order(ScheduleKind::kOneFOneB, p, stages, 1, m);
    // stages - p - 1 warm-up forwards, then the first forward of the steady state.
    EXPECT_EQ(leading_forwards(o), stages - p) << "stage " << p;
    expect_complete(o, p, stages, 1, m);
    // Steady state: one forward, one backward; micro-batches in order within each kind.
    int next_f = 0, next_b = 0;
    for (const auto& b : o) {
      if (b.kind == BlockKind::kForward) {
        EXPECT_EQ(b.micro_batch, next_f++);
      } else {
        EXPECT_EQ(b.micro_batch, next_b++);
      }
      EXPECT_EQ(b.segment, p);
    }
  }
  EXPECT_EQ(text(order(ScheduleKind::kOneFOneB, 0, 4, 1, 8)),
            "F0@0 F1@0 F2@0 F3@0 B0@0 F4@0 B1@0 F5@0 B2@0 F6@0 B3@0 F7@0 B4@0 B5@0 B6@0 B7@0");
  EXPECT_EQ(text(order(ScheduleKind::kOneFOneB, 3, 4, 1, 4)),
            "F0@3 B0@3 F1@3 B1@3 F2@3 B2@3 F3@3 B3@3");
  // Fewer micro-batches than stages: warm-up is capped.
  auto few = order(ScheduleKind::kOneFOneB, 0, 8, 1, 3);
  EXPECT_EQ(text(few), "F0@0 F1@0 F2@0 B0@0 B1@0 B2@0");
  EXPECT_TRUE(check_pipeline(ScheduleKind::kOneFOneB, 4, 1, 8).ok());
  EXPECT_TRUE(check_pipeline(ScheduleKind::kOneFOneB, 8, 1, 3).ok());
  EXPECT_TRUE(check_pipeline(ScheduleKind::kOneFOneB, 1, 1, 5).ok());
}

TEST(Schedules, GpipeOrder) {
  EXPECT_EQ(text(order(ScheduleKind::kGpipe, 1, 4, 1, 4)),
            "F0@1 F1@1 F2@1 F3@1 B3@1 B2@1 B1@1 B0@1");
  for (int p = 0; p < 4; ++p) {
    auto o = order(ScheduleKind::kGpipe, p, 4, 1, 6);
    EXPECT_EQ(leading_forwards(o), 6);
    expect_complete(o, p, 4, 1, 6);
  }
  EXPECT_TRUE(check_pipeline(ScheduleKind::kGpipe, 4, 1, 6).ok());
}

// Megatron's interleaved 1F1B for pp = 4, vpp = 2, m = 8.
TEST(Schedules, InterleavedOrder) {
  const int stages = 4, chunks = 2, m = 8;
  for (int p = 0; p < stages; ++p) {
    auto o = order(ScheduleKind::kInterleaved, p, stages, chunks, m);
    expect_complete(o, p, stages, chunks, m);
    // Warm-up: 2 (stages - p - 1) + (chunks - 1) stages, then the steady state's first forward.
    EXPECT_EQ(leading_forwards(o), 2 * (stages - p - 1) + (chunks - 1) * stages + 1)
        << "stage " << p;
  }
  // Forwards go through the chunks in groups of `stages` micro-batches; backwards start from the
  // last chunk.
  EXPECT_EQ(text(order(ScheduleKind::kInterleaved, 0, stages, chunks, m)),
            "F0@0 F1@0 F2@0 F3@0 F0@4 F1@4 F2@4 F3@4 F4@0 F5@0 "
            "F6@0 B0@4 F7@0 B1@4 F4@4 B2@4 F5@4 B3@4 F6@4 B0@0 F7@4 B1@0 "
            "B2@0 B3@0 B4@4 B5@4 B6@4 B7@4 B4@0 B5@0 B6@0 B7@0");
  EXPECT_TRUE(check_pipeline(ScheduleKind::kInterleaved, stages, chunks, m).ok());
  EXPECT_TRUE(check_pipeline(ScheduleKind::kInterleaved, 4, 2, 4).ok());  // m == stages
  EXPECT_TRUE(check_pipeline(ScheduleKind::kInterleaved, 4, 3, 12).ok());
  EXPECT_TRUE(check_pipeline(ScheduleKind::kInterleaved, 2, 4, 6).ok());
}

// With as many micro-batches as stages Megatron runs every forward first; PyTorch's
// ScheduleInterleaved1F1B (fsdp plans) keeps its warm-up, 2 (stages - p - 1) + (chunks - 1)
// stages capped at all of them.
TEST(Schedules, InterleavedWithOneRoundFollowsTheRuntime) {
  const int stages = 4, chunks = 2, m = 4;
  for (int p = 0; p < stages; ++p) {
    EXPECT_EQ(leading_forwards(order(ScheduleKind::kInterleaved, p, stages, chunks, m)), chunks * m)
        << "stage " << p;
    const auto torch =
        order(ScheduleKind::kInterleaved, p, stages, chunks, m, PipelineRuntime::kTorch);
    expect_complete(torch, p, stages, chunks, m);
    const int warmup = std::min(2 * (stages - p - 1) + (chunks - 1) * stages, chunks * m);
    EXPECT_EQ(leading_forwards(torch), std::min(warmup + 1, chunks * m)) << "stage " << p;
  }
  EXPECT_EQ(text(order(ScheduleKind::kInterleaved, 3, stages, chunks, m, PipelineRuntime::kTorch)),
            "F0@3 F1@3 F2@3 F3@3 F0@7 B0@7 F1@7 B1@7 F2@7 B2@7 F3@7 B3@7 B0@3 B1@3 B2@3 B3@3");
  EXPECT_TRUE(
      check_pipeline(ScheduleKind::kInterleaved, stages, chunks, m, PipelineRuntime::kTorch).ok());
  EXPECT_EQ(pipeline_runtime_of("fsdp"), PipelineRuntime::kTorch);
  EXPECT_EQ(pipeline_runtime_of("megatron"), PipelineRuntime::kMegatron);
}

TEST(Schedules, InterleavedPlanCompiles) {
  auto m = load_model("gpt3-1.3b");  // 24 layers: 8 segments of 3
  auto topo = load_topology("dgx-a100x4");
  ASSERT_TRUE(m.ok() && topo.ok());
  MegatronOptions o;
  o.tp = 8;
  o.pp = 4;
  o.vpp = 2;
  o.schedule = ScheduleKind::kInterleaved;
  o.global_batch = 8;  // dp 1: 8 micro-batches
  auto plan = build_megatron_plan(*m, *topo, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_EQ(plan->segments.size(), 8u);
  EXPECT_EQ(plan->segments[5].name, "stage1.chunk1");
  EXPECT_EQ(plan->segments[5].devices, (MeshSlice{{"pp", 1}}));
  auto prog = compile_plan(*plan, *topo);
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  EXPECT_EQ(prog->lanes.size(), 4u);
  EXPECT_EQ(prog->micro_batches, 8);
  for (const Lane& lane : prog->lanes) EXPECT_EQ(lane.blocks.size(), 32u);
}

// Tessel's search keeps Merak's explicit recomputation blocks (their cost and the activations
// they bring back) and does no worse than the Merak order it starts from.
TEST(Schedules, SearchKeepsExplicitRecomputation) {
  auto m = load_model("gpt3-1.3b");
  auto topo = load_topology("dgx-a100x4");
  ASSERT_TRUE(m.ok() && topo.ok());
  MegatronOptions o;
  o.tp = 8;
  o.pp = 4;
  o.schedule = ScheduleKind::kMerak;
  o.recompute = RecomputeMode::kFull;
  o.global_batch = 16;
  auto plan = build_megatron_plan(*m, *topo, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  Expected<SearchedSchedule> s = search_schedule(*plan, *topo);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_FALSE(s->split_backward);
  size_t recomputes = 0;
  for (const DeviceOrder& d : s->plan.schedule) {
    for (const Block& b : d.blocks) recomputes += b.kind == BlockKind::kRecompute;
  }
  EXPECT_GT(recomputes, 0u);
  expect_no_worse(*plan, s->plan, *topo, 1.01);
}

// Where the repetend's unrolled orders are slower than the plan's own (interleaved here, whose
// fill and drain are shorter), the search hands the plan back unchanged.
TEST(Schedules, SearchKeepsFasterInputOrders) {
  auto m = load_model("gpt3-1.3b");
  auto topo = load_topology("dgx-a100x4");
  ASSERT_TRUE(m.ok() && topo.ok());
  MegatronOptions o;
  o.tp = 8;
  o.pp = 4;
  o.vpp = 2;
  o.schedule = ScheduleKind::kInterleaved;
  o.global_batch = 16;
  auto plan = build_megatron_plan(*m, *topo, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  Expected<SearchedSchedule> s = search_schedule(*plan, *topo);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_GT(s->tessel.makespan, s->input_makespan);
  EXPECT_TRUE(s->kept_input);
  EXPECT_EQ(plan_to_json(s->plan), plan_to_json(*plan));
}

// The search's blocks carry the pipeline transfers between stages, priced by the plan's own
// cost model on its topology: nonzero between stages, zero between a segment's forward and its
// own backward, larger over PCIe than over NVSwitch, and in the reported makespan.
TEST(Schedules, SearchPricesTransfersBetweenStages) {
  auto m = load_model("gpt3-1.3b");
  auto dgx = load_topology("dgx-a100x4");
  auto pcie = load_topology("pcie-a100x8");
  ASSERT_TRUE(m.ok() && dgx.ok() && pcie.ok());
  auto node = resize_topology(*dgx, 1);
  ASSERT_TRUE(node.ok());
  MegatronOptions o;
  o.tp = 2;
  o.pp = 4;
  o.global_batch = 8;
  std::map<std::string, double> forward_transfer;
  for (const auto& [name, topo] : {std::pair<std::string, Topology>{"nvswitch", *node},
                                   std::pair<std::string, Topology>{"pcie", *pcie}}) {
    auto plan = build_megatron_plan(*m, topo, o);
    ASSERT_TRUE(plan.ok()) << plan.error().message();
    Expected<SearchedSchedule> s = search_schedule(*plan, topo);
    ASSERT_TRUE(s.ok()) << s.error().message();
    const TesselProblem& q = s->problem;
    // The transfers the estimator prices for the compiled plan's sends, by (segment, kind).
    auto prog = compile_plan(*plan, topo);
    ASSERT_TRUE(prog.ok());
    const std::vector<TemplateTime> times = template_times(*prog);
    std::map<std::pair<int, int>, double> sends;  // (from, to) -> slowest
    for (size_t t = 0; t < prog->templates.size(); ++t) {
      for (const auto& [to, seconds] : times[t].sends) {
        double& x = sends[{prog->templates[t].segment, to}];
        x = std::max(x, seconds);
      }
    }
    int forwards = 0, backwards = 0;
    for (const TesselBlock& b : q.blocks) {
      ASSERT_EQ(b.transfer.size(), b.after.size()) << to_string(Block{b.kind, 0, b.segment});
      for (size_t i = 0; i < b.after.size(); ++i) {
        const TesselBlock& a = q.blocks[b.after[i]];
        if (a.segment == b.segment) {
          EXPECT_EQ(b.transfer[i], 0.0);
          continue;
        }
        EXPECT_GT(b.transfer[i], 0.0) << name;
        EXPECT_EQ(b.transfer[i], (sends[{a.segment, b.segment}])) << name;
        if (b.kind == BlockKind::kForward) {
          ++forwards;
          forward_transfer[name] = b.transfer[i];
        } else {
          ++backwards;
        }
      }
    }
    EXPECT_EQ(forwards, 3) << name;
    EXPECT_EQ(backwards, 3) << name;
    // The reported makespan is the orders' with the transfers, longer than without.
    Expected<OrdersRun> with = run_orders(q, s->tessel.orders);
    ASSERT_TRUE(with.ok()) << with.error().message();
    EXPECT_EQ(with->makespan, s->tessel.makespan);
    TesselProblem without = q;
    for (TesselBlock& b : without.blocks) b.transfer.clear();
    Expected<OrdersRun> free = run_orders(without, s->tessel.orders);
    ASSERT_TRUE(free.ok());
    EXPECT_LT(free->makespan, with->makespan) << name;
  }
  // 32 GB/s PCIe against 300 GB/s NVSwitch, the same bytes.
  EXPECT_GT(forward_transfer["pcie"], 4 * forward_transfer["nvswitch"]);
}

// An ordinary pipeline across four nodes (InfiniBand transfers between stages): the search's
// orders, transfers included, finish no later than the 1F1B orders it starts from, within their
// memory, and the estimator agrees.
TEST(Schedules, SearchNoWorseThanOneFOneBAcrossNodes) {
  auto m = load_model("gpt3-1.3b");
  auto topo = load_topology("dgx-a100x4");
  ASSERT_TRUE(m.ok() && topo.ok());
  MegatronOptions o;
  o.tp = 8;
  o.pp = 4;
  o.global_batch = 16;
  auto plan = build_megatron_plan(*m, *topo, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  Expected<SearchedSchedule> s = search_schedule(*plan, *topo);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_LE(s->tessel.makespan, s->input_makespan);
  for (const TesselBlock& b : s->problem.blocks) {
    if (b.kind == BlockKind::kForward && !b.after.empty()) {
      EXPECT_GT(b.transfer.at(0), 0.0);
    }
  }
  expect_no_worse(*plan, s->plan, *topo, 1.001);
}

// GPT-3 13B on four DGX A100 (scripts/bench-schedules' case): at the 1F1B orders' own memory per
// stage the search's orders are the split 1F1B's; given room beyond it (14.5 GiB a GPU against
// 1F1B's 13.1: a deferred weight gradient holds its layers' inputs and output gradients), the
// repetend stays bubble-free and only the ends change: list-scheduled, they come within 2 % of
// ZB-H1's iteration, where the unrolled repetend alone stays at the 1F1B orders' makespan.
TEST(Schedules, SearchListSchedulesTheEndsGivenRoom) {
  auto m = load_model("gpt3-13b");
  auto topo = load_topology("dgx-a100x4");
  ASSERT_TRUE(m.ok() && topo.ok());
  MegatronOptions o;
  o.tp = 8;
  o.pp = 4;
  o.global_batch = 16;
  o.micro_batch = 1;
  auto plan = build_megatron_plan(*m, *topo, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  const double limit = 14.5 * (1ull << 30);
  Expected<SearchedSchedule> s = search_schedule(*plan, *topo, limit);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_TRUE(s->tessel.ends_list_scheduled);
  EXPECT_LE(s->tessel.period, 1.01 * s->tessel.lower_bound);
  EXPECT_LT(s->tessel.makespan, 0.97 * s->input_makespan);
  auto zb = generate_schedule(*plan, *topo, ScheduleKind::kZbH1);
  ASSERT_TRUE(zb.ok()) << zb.error().message();
  auto zb_prog = compile_plan(*zb, *topo);
  auto searched = compile_plan(s->plan, *topo);
  ASSERT_TRUE(zb_prog.ok() && searched.ok());
  const Estimate zb_estimate = estimate_program(*zb_prog);
  const Estimate estimate = estimate_program(*searched);
  EXPECT_LT(estimate.iteration_time, 1.02 * zb_estimate.iteration_time);
  EXPECT_LE(estimate.peak_memory, limit);
}

// The order's text with its pairs joined by '+', as a plan file writes it.
std::string paired_text(const std::vector<Block>& blocks) {
  std::string s;
  for (size_t i = 0; i < blocks.size(); ++i) {
    s += (i == 0 ? "" : blocks[i - 1].paired_with_next ? "+" : " ") + to_string(blocks[i]);
  }
  return s;
}

// DualPipeV on two ranks, four micro-batches, by the eight steps of deepseek-ai/DualPipe's
// dualpipev.py. Rank 0 holds segments 0 and 3: two forwards of phase 0; one of each phase; a
// split phase-1 backward, its weight gradients, a forward; the main step's two pairs; a phase-1
// backward and a pair; the middle of its last backwards split; the held weight gradients. The
// last rank runs its first main-step forward and backward apart.
TEST(Schedules, DualPipeVFollowsItsEightSteps) {
  EXPECT_EQ(paired_text(order(ScheduleKind::kDualPipeV, 0, 2, 2, 4)),
            "F0@0 F1@0 F2@0 F0@3 BI0@3 BW0@3 F1@3 F3@0+B1@3 F2@3+B0@0 B2@3 F3@3+B1@0 B3@3 "
            "BI2@0 BW2@0 BI3@0 BW3@0");
  EXPECT_EQ(paired_text(order(ScheduleKind::kDualPipeV, 1, 2, 2, 4)),
            "F0@1 F0@2 F1@1 F1@2 F2@1 B0@2 F2@2+B0@1 F3@1+B1@2 F3@2+B1@1 B2@2 B2@1 BI3@2 BI3@1 "
            "BW3@2 BW3@1");
}

// Over 1-8 ranks and 2p to 3p + 2 micro-batches every rank runs every block of its two
// segments once, the pipeline runs through with each pair started once both its blocks' inputs
// are there, and rank r runs 2 (M - 2p + r + 1) + (p - r - 1) pairs (the last rank one less).
TEST(Schedules, DualPipeVRunsThroughOnEveryShape) {
  for (int stages = 1; stages <= 8; ++stages) {
    for (int m : {2 * stages, 2 * stages + 1, 3 * stages + 2}) {
      auto orders = pipeline_orders(ScheduleKind::kDualPipeV, stages, 2, m);
      ASSERT_TRUE(orders.ok()) << orders.error().message();
      std::vector<OrderView> views;
      for (int r = 0; r < stages; ++r) {
        const std::vector<Block>& o = (*orders)[r];
        views.push_back({"pp=" + std::to_string(r), o});
        int pairs = 0;
        for (const Block& b : o) pairs += b.paired_with_next;
        EXPECT_EQ(pairs, 2 * (m - 2 * stages + r + 1) + (stages - r - 1) - (r == stages - 1))
            << stages << " ranks, " << m << " micro-batches, rank " << r;
      }
      const int segments = 2 * stages;
      std::vector<int> next(segments), lane(segments);
      for (int s = 0; s < segments; ++s) {
        next[s] = s + 1 < segments ? s + 1 : -1;
        lane[s] = rank_of_segment(ScheduleKind::kDualPipeV, s, stages);
      }
      Status s = check_schedule(views, segments, m, next, lane);
      EXPECT_TRUE(s.ok()) << stages << " ranks, " << m << " micro-batches: " << s.error().message();
    }
  }
  auto few = pipeline_orders(ScheduleKind::kDualPipeV, 4, 2, 7);
  ASSERT_FALSE(few.ok());
  EXPECT_TRUE(contains(few.error().message(),
                       "needs at least twice as many micro-batches as pipeline stages (2 x 4 = "
                       "8; got 7)"))
      << few.error().message();
  auto one_chunk = pipeline_orders(ScheduleKind::kDualPipeV, 4, 1, 8);
  ASSERT_FALSE(one_chunk.ok());
  EXPECT_TRUE(contains(one_chunk.error().message(), "dualpipev schedule runs two model chunks"))
      << one_chunk.error().message();
}

TEST(Schedules, Errors) {
  auto e = pipeline_orders(ScheduleKind::kOneFOneB, 4, 2, 8);
  ASSERT_FALSE(e.ok());
  EXPECT_TRUE(contains(e.error().message(), "use --schedule interleaved for --vpp 2"))
      << e.error().message();
  e = pipeline_orders(ScheduleKind::kGpipe, 4, 2, 8);
  ASSERT_FALSE(e.ok());
  e = pipeline_orders(ScheduleKind::kInterleaved, 4, 2, 6);
  ASSERT_FALSE(e.ok());
  EXPECT_TRUE(contains(e.error().message(),
                       "needs the micro-batch count (6) to be a multiple of the pipeline stages "
                       "(4)"))
      << e.error().message();
  e = pipeline_orders(ScheduleKind::kOneFOneB, 4, 1, 0);
  ASSERT_FALSE(e.ok());
  EXPECT_TRUE(contains(e.error().message(), "at least one micro-batch"));
}

TEST(Schedules, Names) {
  for (ScheduleKind k : {ScheduleKind::kGpipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
                         ScheduleKind::kDualPipeV}) {
    auto parsed = parse_schedule_kind(std::string(to_string(k)));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, k);
  }
  auto bad = parse_schedule_kind("1f1c");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(contains(bad.error().message(), "unknown schedule '1f1c' (did you mean '1f1b'?)"))
      << bad.error().message();
  EXPECT_EQ(segment_of(1, 2, 4), 6);
}

}  // namespace
}  // namespace nnsim
