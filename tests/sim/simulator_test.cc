// The simulator against closed forms: pipeline bubbles on a communication-free cluster, a lone
// ring all-reduce, link sharing, and determinism.
#include "sim/simulator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>

#include "core/collective.h"
#include "core/model.h"
#include "core/network.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/schedule_gen.h"
#include "sim/collective_runner.h"
#include "sim/report.h"
#include "tests/support/communication_free.h"

namespace nnsim {
namespace {

using testing::communication_free_node;
using testing::matmul_only;

const std::string kData = NNSIM_TEST_DATA;

Topology load(const std::string& name, int nodes = 0) {
  Expected<Topology> t = load_topology(name);
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  if (nodes > 0) {
    Expected<Topology> r = resize_topology(*t, nodes);
    EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
    return *r;
  }
  return *t;
}

ModelSpec model(const std::string& name) {
  Expected<ModelSpec> m = load_model(name);
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
  return *m;
}

Program compile(const ModelSpec& m, const Topology& t, const MegatronOptions& o,
                const CompileOptions& co = {}) {
  Expected<Plan> plan = build_megatron_plan(m, t, o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  Expected<Program> prog = compile_plan(*plan, t, co);
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  return *prog;
}

SimResult run(const Program& p, SimOptions o = {}) {
  Expected<SimResult> r = simulate(p, o);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
  return *r;
}

class BubbleTest : public ::testing::TestWithParam<std::tuple<ScheduleKind, int, int>> {};

TEST_P(BubbleTest, BubbleFractionIsClosedForm) {
  auto [kind, stages, micro_batches] = GetParam();
  MegatronOptions o;
  o.pp = stages;
  o.global_batch = micro_batches;
  o.schedule = kind;
  const Topology t = communication_free_node(stages);
  Program p = compile(model(kData + "/uniform-model.yaml"), t, o, matmul_only(t));
  SimResult r = run(p);
  const double expected = static_cast<double>(stages - 1) / (micro_batches + stages - 1);
  // Every stage idles (p-1) stage-times of its (m+p-1); the optimizer step follows the pipeline.
  for (const LaneReport& lane : r.lanes) {
    const double pipeline = r.iteration_time - lane.breakdown.optimizer;
    EXPECT_NEAR(lane.breakdown.bubble / pipeline, expected, 0.01 * expected) << lane.name;
    EXPECT_LT(lane.breakdown.total_exposed_comm(), 1e-6 * r.iteration_time) << lane.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, BubbleTest,
                         ::testing::Values(std::make_tuple(ScheduleKind::kOneFOneB, 4, 8),
                                           std::make_tuple(ScheduleKind::kOneFOneB, 4, 16),
                                           std::make_tuple(ScheduleKind::kOneFOneB, 8, 32),
                                           std::make_tuple(ScheduleKind::kGpipe, 4, 8),
                                           std::make_tuple(ScheduleKind::kGpipe, 2, 5)));

TEST(Simulator, InterleavedBubbleShrinksByTheChunkCount) {
  // Megatron's interleaved schedule: bubble (p-1)/(v m + p-1) of the pipeline time.
  const int p = 4, m = 8, v = 2;
  MegatronOptions o;
  o.pp = p;
  o.vpp = v;
  o.global_batch = m;
  o.schedule = ScheduleKind::kInterleaved;
  const Topology t = communication_free_node(p);
  Program prog = compile(model(kData + "/uniform-model.yaml"), t, o, matmul_only(t));
  SimResult r = run(prog);
  const double expected = static_cast<double>(p - 1) / (v * m + p - 1);
  for (const LaneReport& lane : r.lanes) {
    const double pipeline = r.iteration_time - lane.breakdown.optimizer;
    EXPECT_NEAR(lane.breakdown.bubble / pipeline, expected, 0.01 * expected) << lane.name;
  }
}

// The zero-bubble and Merak generators, simulated on the communication-free cluster against
// 1F1B: less bubble, and the memory each promises.
struct PipelineRun {
  double bubble = 0;          // worst lane's bubble over its pipeline time
  double bubble_seconds = 0;  // worst lane's bubble
  double peak = 0;            // worst lane's peak memory
  double iteration = 0;
  // The slowest lane's mean simulated compute time per block, by kind.
  std::map<BlockKind, double> block_seconds;
};

// Mean compute seconds of each kind of block per lane, from the recorded tasks; the slowest
// lane's.
std::map<BlockKind, double> block_seconds(const Program& p, const SimResult& r) {
  std::map<BlockKind, double> out;
  for (size_t l = 0; l < p.lanes.size(); ++l) {
    std::map<BlockKind, double> busy, count;
    for (const BlockInstance& b : p.lanes[l].blocks) ++count[b.block.kind];
    for (const TaskRecord& t : r.tasks) {
      if (t.lane != static_cast<int>(l) || t.block < 0) continue;
      if (t.kind != TaskKind::kCompute && t.kind != TaskKind::kRecompute) continue;
      busy[p.lanes[l].blocks[t.block].block.kind] += t.end - t.start;
    }
    for (const auto& [kind, seconds] : busy) {
      out[kind] = std::max(out[kind], seconds / count[kind]);
    }
  }
  return out;
}

// `memory_limit`: a list-scheduled generator's bytes per GPU instead of its own rule's.
PipelineRun run_pipeline(ScheduleKind kind, int vpp, RecomputeMode recompute = RecomputeMode::kNone,
                         const std::string& model_file = "uniform-model.yaml", int stages = 4,
                         std::optional<double> memory_limit = std::nullopt) {
  MegatronOptions o;
  o.pp = stages;
  o.vpp = vpp;
  o.global_batch = 16;
  o.schedule = kind;
  o.recompute = recompute;
  const Topology t = communication_free_node(stages);
  // The list-scheduled generators time blocks with the costs the simulation uses.
  o.costs = matmul_only(t);
  Expected<Plan> plan = build_megatron_plan(model(kData + "/" + model_file), t, o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  if (memory_limit) plan = generate_schedule(*plan, t, kind, memory_limit, o.costs);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  Expected<Program> compiled = compile_plan(*plan, t, matmul_only(t));
  EXPECT_TRUE(compiled.ok()) << (compiled.ok() ? "" : compiled.error().message());
  const Program& p = *compiled;
  SimOptions so;
  so.record_tasks = true;
  SimResult r = run(p, so);
  PipelineRun out;
  out.iteration = r.iteration_time;
  for (const LaneReport& lane : r.lanes) {
    out.bubble =
        std::max(out.bubble, lane.breakdown.bubble / (r.iteration_time - lane.breakdown.optimizer));
    out.bubble_seconds = std::max(out.bubble_seconds, lane.breakdown.bubble);
    out.peak = std::max(out.peak, lane.peak_memory);
  }
  out.block_seconds = block_seconds(p, r);
  return out;
}

// Qi et al.'s bubbles from the block times a run simulated: 1F1B (p - 1)(F + B), ZB-H1
// (p - 1)(F + BI - BW).
double one_f_one_b_bubble(const PipelineRun& r, int p) {
  std::map<BlockKind, double> t = r.block_seconds;
  return (p - 1) * (t[BlockKind::kForward] + t[BlockKind::kBackward]);
}
double zb_h1_bubble(const PipelineRun& r, int p) {
  std::map<BlockKind, double> t = r.block_seconds;
  return (p - 1) *
         (t[BlockKind::kForward] + t[BlockKind::kBackwardInput] - t[BlockKind::kBackwardWeight]);
}

TEST(Simulator, ZeroBubbleSchedulesShrinkTheBubbleWithinTheirMemory) {
  const PipelineRun base = run_pipeline(ScheduleKind::kOneFOneB, 1);
  EXPECT_NEAR(base.bubble, 3.0 / 19, 0.01 * 3 / 19);
  const PipelineRun h1 = run_pipeline(ScheduleKind::kZbH1, 1);
  const PipelineRun h2 = run_pipeline(ScheduleKind::kZbH2, 1);
  const PipelineRun v = run_pipeline(ScheduleKind::kZbV, 2);
  // ZB-H1: 1F1B's peak memory (within 1 %), less bubble, but not below Qi et al.'s (p - 1)(F +
  // BI - BW): a deferred weight gradient holds its layers' inputs and output gradients (M_W),
  // which here is most of what the micro-batch's forward kept, so within 1F1B's memory not
  // every stage defers as many as the bubbles would take. ZB-V: at most the V-shaped 1F1B's
  // activations (p + 1/2 stages' worth against 1F1B's p), half the bubble or less.
  EXPECT_LT(h1.bubble, 0.75 * base.bubble);
  EXPECT_GE(h1.bubble_seconds, 0.97 * zb_h1_bubble(h1, 4));
  EXPECT_LE(h1.peak, 1.01 * base.peak);
  EXPECT_LT(v.bubble, 0.5 * base.bubble);
  EXPECT_LE(v.peak, (4 + 0.5) / 4 * base.peak);
  // ZB-H2: more memory for less bubble than ZB-H1.
  EXPECT_LT(h2.bubble, h1.bubble);
  EXPECT_GT(h2.peak, base.peak);
  std::printf(
      "bubble: 1F1B %.1f %%, ZB-H1 %.1f %% (formula %.2f ms, simulated %.2f), ZB-H2 %.1f %% "
      "(peak %+.1f %%), ZB-V %.1f %% (peak %+.1f %%); blocks F %.2f, BI %.2f, BW %.2f ms\n",
      100 * base.bubble, 100 * h1.bubble, 1e3 * zb_h1_bubble(h1, 4), 1e3 * h1.bubble_seconds,
      100 * h2.bubble, 100 * (h2.peak / base.peak - 1), 100 * v.bubble,
      100 * (v.peak / base.peak - 1), 1e3 * h1.block_seconds.at(BlockKind::kForward),
      1e3 * h1.block_seconds.at(BlockKind::kBackwardInput),
      1e3 * h1.block_seconds.at(BlockKind::kBackwardWeight));
}

TEST(Simulator, ZeroBubbleH1HasAThirdOfOneFOneBsBubbleWhenBlocksAreEqual) {
  // Forward, input gradient and weight gradient within 4 % of each other here, so ZB-H1 with
  // the memory to defer its weight gradients (its p micro-batches in flight, 70 GB a GPU) idles
  // about a third of what 1F1B does: Qi et al.'s (p - 1)(F + BI - BW). Within 1F1B's memory it
  // idles less than 1F1B and more than that: here a deferred weight gradient (its layers'
  // inputs and output gradients) holds about what the micro-batch's forward kept.
  for (int p : {2, 4, 8}) {
    const PipelineRun base = run_pipeline(ScheduleKind::kOneFOneB, 1, RecomputeMode::kNone,
                                          "uniform-short-model.yaml", p);
    const PipelineRun h1 = run_pipeline(ScheduleKind::kZbH1, 1, RecomputeMode::kNone,
                                        "uniform-short-model.yaml", p, 70e9);
    const double one_f_one_b = one_f_one_b_bubble(base, p), zb_h1 = zb_h1_bubble(h1, p);
    EXPECT_NEAR(base.bubble_seconds, one_f_one_b, 0.01 * one_f_one_b) << p;
    // (At 8 stages the room lets the list scheduler defer a little more than the formula's
    // pattern: 3.2 % under it.)
    EXPECT_NEAR(h1.bubble_seconds, zb_h1, 0.05 * zb_h1) << p;
    EXPECT_NEAR(h1.bubble_seconds / base.bubble_seconds, 1.0 / 3, 0.03) << p;
    const PipelineRun tight =
        run_pipeline(ScheduleKind::kZbH1, 1, RecomputeMode::kNone, "uniform-short-model.yaml", p);
    EXPECT_LT(tight.bubble_seconds, base.bubble_seconds) << p;
    EXPECT_GE(tight.bubble_seconds, 0.97 * zb_h1) << p;
    EXPECT_LE(tight.peak, 1.01 * base.peak) << p;
    std::printf(
        "p %d: 1F1B %.2f ms (%.1f %%, formula %.2f); ZB-H1 with room %.2f ms (%.1f %%, formula "
        "%.2f, ratio %.3f, peak %+.1f %%); at 1F1B's memory %.2f ms (%.1f %%, ratio %.3f, peak "
        "%+.1f %%)\n",
        p, 1e3 * base.bubble_seconds, 100 * base.bubble, 1e3 * one_f_one_b, 1e3 * h1.bubble_seconds,
        100 * h1.bubble, 1e3 * zb_h1, h1.bubble_seconds / base.bubble_seconds,
        100 * (h1.peak / base.peak - 1), 1e3 * tight.bubble_seconds, 100 * tight.bubble,
        tight.bubble_seconds / base.bubble_seconds, 100 * (tight.peak / base.peak - 1));
  }
}

TEST(Simulator, MerakTakesRecomputationOffTheCriticalPath) {
  const PipelineRun full = run_pipeline(ScheduleKind::kOneFOneB, 1, RecomputeMode::kFull);
  const PipelineRun merak = run_pipeline(ScheduleKind::kMerak, 1, RecomputeMode::kFull);
  EXPECT_LT(merak.iteration, 0.97 * full.iteration);
}

TEST(Simulator, LoneRingAllReduceMatchesTheRingFormula) {
  const Topology t = load("dgx-a100x4");
  const double S = 1024.0 * 1024 * 1024;
  // One node: every ring edge crosses two NVSwitch ports of 300 GB/s.
  std::vector<int> node0 = {0, 1, 2, 3, 4, 5, 6, 7};
  CommRequest ar{CommRequest::Kind::kCollective, CollectiveKind::kAllReduce, Algorithm::kRing,
                 node0, S};
  Expected<std::vector<double>> r = simulate_communication(t, CommModel::ideal(), {ar});
  ASSERT_TRUE(r.ok()) << r.error().message();
  const double n = 8, B = t.intra.bandwidth, alpha = t.intra.latency;
  const double expected = 2 * (n - 1) / n * S / B + 2 * (n - 1) * alpha;
  EXPECT_NEAR((*r)[0], expected, 0.02 * expected);

  // Two nodes: eight rings, each leaving a node through a different NIC (25 GB/s each).
  std::vector<int> two_nodes;
  for (int g = 0; g < 16; ++g) two_nodes.push_back(g);
  ar.gpus = two_nodes;
  r = simulate_communication(t, CommModel::ideal(), {ar});
  ASSERT_TRUE(r.ok()) << r.error().message();
  const double m = 16;
  const double nic = t.nics[0].bandwidth;
  std::vector<int> route;
  const double inter_latency = Network(t).route(7, 8, route);
  const double expected2 = 2 * (m - 1) / m * S / (8 * nic) + 2 * (m - 1) * inter_latency;
  EXPECT_NEAR((*r)[0], expected2, 0.02 * expected2);
}

TEST(Simulator, NcclModelReproducesTheNcclTestsTablesItCameFrom) {
  // refs.yaml nccl-allreduce-dgx-a100-8gpu / -h100-8gpu: 8-GPU all-reduce times, microseconds.
  struct Point {
    double bytes, us;
  };
  const std::vector<std::pair<std::string, std::vector<Point>>> tables = {
      {"dgx-a100x4", {{16777216, 276.6}, {268435456, 2420.6}, {1073741824, 8203.9}}},
      {"h200x8", {{16777216, 123.8}, {268435456, 1112.5}, {1073741824, 4029.4}}}};
  for (const auto& [preset, points] : tables) {
    const Topology t = load(preset);
    for (const Point& p : points) {
      CommRequest ar{CommRequest::Kind::kCollective,
                     CollectiveKind::kAllReduce,
                     Algorithm::kRing,
                     {0, 1, 2, 3, 4, 5, 6, 7},
                     p.bytes};
      auto r = simulate_communication(t, CommModel::defaults_for(t.gpu), {ar});
      ASSERT_TRUE(r.ok()) << r.error().message();
      EXPECT_NEAR((*r)[0] * 1e6, p.us, 0.02 * p.us) << preset << " " << p.bytes;
    }
  }
}

TEST(Simulator, LoneAllToAllTakesItsClosedForm) {
  // 64 GPUs, four on each of 16 nodes (an expert-parallel group beside tensor parallelism of
  // two): 4,032 flows. As one parallel task they all arrive when the busiest link has carried
  // its bytes; cut into tasks of 256 flows, the pieces' boundaries fall inside GPUs' flows,
  // the pieces finish apart, and the busiest link idled while the last one ran (19 % longer).
  const Topology t = load("dgx-h100-superpod", 16);
  std::vector<int> gpus;
  for (int node = 0; node < 16; ++node) {
    for (int local = 0; local < 8; local += 2) gpus.push_back(node * 8 + local);
  }
  const double bytes = 256e6;
  CommRequest a2a{CommRequest::Kind::kCollective, CollectiveKind::kAllToAll, Algorithm::kAuto, gpus,
                  bytes};
  Expected<std::vector<double>> r = simulate_communication(t, CommModel::ideal(), {a2a});
  ASSERT_TRUE(r.ok()) << r.error().message();
  const Network net(t);
  LinkLoadScratch scratch;
  const CollectiveFlows flows = decompose_collective(CollectiveKind::kAllToAll, gpus, bytes,
                                                     Algorithm::kAuto, net, CommModel::ideal());
  ASSERT_EQ(flows.flows.size(), 64u * 63u);
  const double closed_form = isolated_seconds(flows, net, scratch);
  EXPECT_NEAR((*r)[0], closed_form, 1e-9 * closed_form);
}

// The flows of one parallel task, as the fluid closed form (sim/collective_runner.h) takes them.
PreparedComm::Task fluid_task(const CollectiveFlows& c, const Network& net) {
  PreparedComm::Task task;
  std::map<int, double> load;
  for (const Flow& f : c.flows) {
    std::vector<int> route;
    task.latency = std::max(task.latency, net.route(f.src, f.dst, route));
    for (int l : route) load[l] += f.bytes;
  }
  task.link_load.assign(load.begin(), load.end());
  return task;
}

TEST(Simulator, AnAllToAllSharesItsLinksAsItsFlowsDo) {
  // SimGrid runs the all-to-all's flows split at their waypoints (summed per GPU and waypoint);
  // beside a transfer through one of its NICs and NVSwitch ports, the two must still end when
  // max-min sharing of the flows themselves says.
  const Topology t = load("dgx-h100-superpod", 4);
  std::vector<int> gpus;
  for (int node = 0; node < 4; ++node) {
    for (int local = 0; local < 8; local += 2) gpus.push_back(node * 8 + local);
  }
  CommRequest a2a{CommRequest::Kind::kCollective, CollectiveKind::kAllToAll, Algorithm::kAuto, gpus,
                  64e6};
  CommRequest transfer{
      CommRequest::Kind::kTransfer, CollectiveKind::kAllReduce, Algorithm::kRing, {0, 8 + 2}, 32e6};
  Expected<std::vector<double>> r = simulate_communication(t, CommModel::ideal(), {a2a, transfer});
  ASSERT_TRUE(r.ok()) << r.error().message();
  const Network net(t);
  const CommModel ideal = CommModel::ideal();
  const CollectiveFlows a =
      decompose_collective(CollectiveKind::kAllToAll, gpus, 64e6, Algorithm::kAuto, net, ideal);
  const CollectiveFlows b = decompose_transfer({0}, {8 + 2}, 32e6, net, ideal);
  const double both = fluid_seconds({fluid_task(a, net), fluid_task(b, net)}, net.links());
  LinkLoadScratch scratch;
  EXPECT_GT(both, isolated_seconds(a, net, scratch) * 1.01);  // they do contend
  EXPECT_NEAR(std::max((*r)[0], (*r)[1]), both, 1e-9 * both);
}

TEST(Simulator, TwoFlowsSharingALinkGetHalfEach) {
  const Topology t = load("dgx-a100x4");
  const double S = 1e9;
  const double B = t.intra.bandwidth;
  CommRequest a{
      CommRequest::Kind::kTransfer, CollectiveKind::kAllReduce, Algorithm::kRing, {0, 1}, S};
  CommRequest b = a;
  b.gpus = {2, 1};  // into the same GPU: both cross its NVSwitch port
  Expected<std::vector<double>> shared = simulate_communication(t, CommModel::ideal(), {a, b});
  ASSERT_TRUE(shared.ok()) << shared.error().message();
  b.gpus = {2, 3};  // disjoint ports
  Expected<std::vector<double>> apart = simulate_communication(t, CommModel::ideal(), {a, b});
  ASSERT_TRUE(apart.ok()) << apart.error().message();
  const double alone = S / B + t.intra.latency;
  EXPECT_NEAR((*apart)[0], alone, 1e-6 * alone);
  EXPECT_NEAR((*apart)[1], alone, 1e-6 * alone);
  EXPECT_NEAR((*shared)[0], 2 * S / B + t.intra.latency, 1e-6 * alone);
  EXPECT_NEAR((*shared)[1], 2 * S / B + t.intra.latency, 1e-6 * alone);
}

TEST(Simulator, RejectsRequestsForMissingGpus) {
  CommRequest a{
      CommRequest::Kind::kTransfer, CollectiveKind::kAllReduce, Algorithm::kRing, {0, 99}, 1e6};
  Expected<std::vector<double>> r =
      simulate_communication(load("dgx-a100x4"), CommModel::ideal(), {a});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("GPU 99 does not exist"), std::string::npos);
}

TEST(Simulator, SameInputGivesByteIdenticalReports) {
  MegatronOptions o;
  o.tp = 2;
  o.pp = 4;
  o.global_batch = 32;
  o.sequence_parallel = true;
  Program p = compile(model("gpt3-1.3b"), load("dgx-a100x4"), o);
  SimResult a = run(p);
  SimResult b = run(p);
  EXPECT_EQ(report_json(p, a), report_json(p, b));
}

TEST(Simulator, BreakdownAddsUpToTheIterationTime) {
  MegatronOptions o;
  o.tp = 4;
  o.pp = 2;
  o.global_batch = 64;
  o.zero = 1;
  o.recompute = RecomputeMode::kSelective;
  Program p = compile(model("gpt3-2.7b"), load("dgx-a100x4"), o);
  SimResult r = run(p);
  ASSERT_GT(r.iteration_time, 0);
  for (const LaneReport& l : r.lanes) {
    const Breakdown& b = l.breakdown;
    double sum = b.compute + b.recompute + b.optimizer + b.total_exposed_comm() + b.bubble;
    EXPECT_NEAR(sum, r.iteration_time, 1e-9 * r.iteration_time) << l.name;
    EXPECT_GT(b.exposed_comm.count("tp"), 0u) << l.name;
  }
}

TEST(Simulator, SymmetricReplicaMatchesFullSimulationWhenReplicasDoNotShareLinks) {
  MegatronOptions o;
  o.tp = 2;
  o.pp = 4;
  o.global_batch = 32;
  Program p = compile(model("gpt3-1.3b"), load("dgx-a100x4"), o);
  SimOptions full;
  full.fidelity = Fidelity::kFull;
  SimResult a = run(p);
  SimResult b = run(p, full);
  EXPECT_EQ(b.replicas_simulated, 4);
  EXPECT_NEAR(a.iteration_time, b.iteration_time, 1e-9 * a.iteration_time);
}

TEST(Simulator, FoldingExclusiveCollectivesChangesNothing) {
  // Tensor-parallel groups inside a node own their NVSwitch ports: folded, they must take
  // exactly what SimGrid gives them. With dp inside the node too, their ports are shared and
  // nothing may be folded.
  for (int tp : {8, 4}) {
    MegatronOptions o;
    o.tp = tp;
    o.pp = 2;
    o.global_batch = 32;
    o.sequence_parallel = true;
    o.zero = 1;
    // Compute slowed by concurrent communication is decided per stretch of compute, and folding
    // makes the stretches longer: compare with that effect off.
    const Topology t = load("dgx-a100x4");
    CompileOptions co;
    co.use_default_compute_model = false;
    co.compute_model = ComputeModel::defaults_for(t.gpu);
    co.compute_model.comm_interference = 0;
    Program p = compile(model("gpt3-2.7b"), t, o, co);
    SimOptions unfolded;
    unfolded.fold_exclusive_collectives = false;
    SimResult a = run(p);
    SimResult b = run(p, unfolded);
    EXPECT_NEAR(a.iteration_time, b.iteration_time, 1e-9 * b.iteration_time) << "tp " << tp;
    for (size_t l = 0; l < a.lanes.size(); ++l) {
      EXPECT_NEAR(a.lanes[l].breakdown.exposed_comm["tp"], b.lanes[l].breakdown.exposed_comm["tp"],
                  1e-9 * b.iteration_time);
    }
    if (tp == 8) {
      EXPECT_LT(a.activities, b.activities / 2);
    }
  }
}

// Tensor parallel 4 over pipeline 2 with the distributed optimizer's overlapped reduce-scatters:
// each rank's data-parallel ring leaves its node through its own NIC while the tensor-parallel
// collectives use the NVSwitch ports it crosses. The first rank's ring alone must give every
// figure the four rings give, in fewer SimGrid activities (it was run). Returns the run.
SimResult expect_mirroring_changes_nothing(const ModelSpec& m, const Topology& t,
                                           int global_batch) {
  MegatronOptions o;
  o.tp = 4;
  o.pp = 2;
  o.global_batch = global_batch;
  o.sequence_parallel = true;
  o.zero = 1;
  Program p = compile(m, t, o);
  SimOptions whole;
  whole.mirror_lane_ranks = false;
  SimResult a = run(p);
  SimResult b = run(p, whole);
  EXPECT_DOUBLE_EQ(a.iteration_time, b.iteration_time);
  EXPECT_EQ(a.lanes.size(), b.lanes.size());
  for (size_t l = 0; l < std::min(a.lanes.size(), b.lanes.size()); ++l) {
    for (const auto& [group, seconds] : b.lanes[l].breakdown.exposed_comm) {
      EXPECT_DOUBLE_EQ(a.lanes[l].breakdown.exposed_comm[group], seconds) << group;
    }
    EXPECT_DOUBLE_EQ(a.lanes[l].breakdown.compute, b.lanes[l].breakdown.compute);
  }
  EXPECT_GT(b.lanes.at(0).breakdown.exposed_comm["dp"], 0);
  EXPECT_LT(a.activities, b.activities);
  return a;
}

TEST(Simulator, MirroringALanesRanksChangesNothing) {
  expect_mirroring_changes_nothing(model("gpt3-2.7b"), load("dgx-a100x4"), 32);
}

TEST(Simulator, MirroringLanesWhoseRingsShareRailUplinks) {
  // Both pipeline stages sit in one scalable unit of the rail-optimized fabric: their ranks'
  // rings share the unit's rail uplinks rank for rank, so the two lanes mirror together.
  const SimResult r =
      expect_mirroring_changes_nothing(model("gpt3-1.3b"), load("dgx-h100-superpod", 32), 128);
  EXPECT_EQ(r.num_gpus, 256);
}

TEST(Simulator, FoldingMatchesSimGridForRingsCutIntoSeveralTasks) {
  // 520 GPUs in one data-parallel group: 8 channel rings of 520 flows, more GPUs than one
  // parallel task holds, run as 17 tasks that share every NVSwitch port and NIC. The fluid
  // closed form must agree with SimGrid.
  MegatronOptions o;
  o.zero = 3;
  o.global_batch = 520;
  Program p = compile(model("gpt3-1.3b"), load("dgx-a100x4", 65), o);
  SimOptions unfolded;
  unfolded.fold_exclusive_collectives = false;
  SimResult a = run(p);
  SimResult b = run(p, unfolded);
  EXPECT_NEAR(a.iteration_time, b.iteration_time, 1e-6 * b.iteration_time);
  EXPECT_LT(a.activities, b.activities);
}

TEST(Simulator, Zero3GathersOverlapCompute) {
  // FSDP-style: every layer's parameters are gathered before it runs, the next layer's while
  // the current one computes; only part of the data-parallel time stays exposed.
  MegatronOptions o;
  o.zero = 3;
  o.global_batch = 64;
  Program p = compile(model("gpt3-1.3b"), load("dgx-a100x4"), o);
  SimOptions opts;
  opts.record_tasks = true;
  SimResult r = run(p, opts);
  double dp_stream = 0;
  int gathers = 0;
  for (const TaskRecord& t : r.tasks) {
    if (t.stream != Stream::kDataParallel) continue;
    dp_stream += t.end - t.start;
    gathers += r.labels[t.label] == "param gather";
  }
  const double exposed = r.lanes[0].breakdown.exposed_comm.at("dp");
  // Forward and backward of 2 micro-batches, 24 layers plus embedding and head each.
  EXPECT_EQ(gathers, 2 * 2 * 26);
  EXPECT_GT(exposed, 0);
  EXPECT_LT(exposed, 0.5 * dp_stream);
}

// DeepEP's exchange across two nodes (a token crosses once per node it has experts on, from 2
// of 4 groups) waits less than NCCL's all-to-all, and the estimate agrees with the simulation.
TEST(Simulator, ExpertExchangeAcrossNodesWaitsLessThanTheAllToAll) {
  ModelSpec m = model("deepseek-v3");
  m.layers = 4;
  m.first_dense_layers = 1;
  m.experts = 64;
  m.router_groups = 4;
  m.router_group_topk = 2;
  const Topology two = load("dgx-h100-superpod", 2);
  MegatronOptions o;
  o.ep = 16;
  o.global_batch = 16;
  o.recompute = RecomputeMode::kFull;
  const SimResult a2a = run(compile(m, two, o));
  o.moe_deepep = true;
  const Program exchange_program = compile(m, two, o);
  const SimResult exchange = run(exchange_program);
  const double waited = a2a.lanes[0].breakdown.exposed_comm.at("ep");
  EXPECT_LT(exchange.lanes[0].breakdown.exposed_comm.at("ep"), 0.7 * waited);
  // The same work: compute differs only by its slowdown beside data-parallel communication,
  // which overlaps differently.
  EXPECT_NEAR(exchange.lanes[0].breakdown.compute, a2a.lanes[0].breakdown.compute,
              0.02 * a2a.lanes[0].breakdown.compute);
  EXPECT_LT(exchange.iteration_time, a2a.iteration_time);
  EXPECT_NEAR(estimate_program(exchange_program).iteration_time, exchange.iteration_time,
              0.1 * exchange.iteration_time);
}

// A blocking send (Megatron's non-interleaved schedule) holds the sender's compute stream for
// exactly the transfer's time; without it the sender computes on. Two stages on different
// nodes of GPT-3 1.3B, so every transfer crosses InfiniBand.
TEST(Simulator, BlockingSendsHoldTheSenderForTheTransfer) {
  MegatronOptions o;
  o.tp = 8;
  o.pp = 2;
  o.global_batch = 16;
  const Topology t = load("dgx-a100x4");
  Expected<Plan> plan = build_megatron_plan(model("gpt3-1.3b"), t, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  ASSERT_TRUE(plan->comm.pp_blocking_sends);
  SimOptions opts;
  opts.record_tasks = true;
  auto simulate_plan = [&](bool blocking, Program* program) {
    plan->comm.pp_blocking_sends = blocking;
    Expected<Program> p = compile_plan(*plan, t);
    EXPECT_TRUE(p.ok()) << (p.ok() ? "" : p.error().message());
    *program = *p;
    return run(*p, opts);
  };
  Program blocking_program, overlapped_program;
  const SimResult blocking = simulate_plan(true, &blocking_program);
  const SimResult overlapped = simulate_plan(false, &overlapped_program);
  for (const SimResult* r : {&blocking, &overlapped}) {
    std::map<int, double> send_wait, transfer;  // by lane
    for (const TaskRecord& task : r->tasks) {
      if (task.kind == TaskKind::kSendWait) send_wait[task.lane] += task.end - task.start;
      if (task.kind == TaskKind::kTransfer) transfer[task.lane] += task.end - task.start;
    }
    ASSERT_EQ(transfer.size(), 2u);  // both stages send
    for (const auto& [lane, seconds] : transfer) {
      EXPECT_GT(seconds, 0);
      const double waited = send_wait.count(lane) ? send_wait[lane] : 0;
      EXPECT_NEAR(waited, r == &blocking ? seconds : 0, 1e-9 * seconds) << lane;
    }
  }
  EXPECT_GT(blocking.iteration_time, overlapped.iteration_time);
  EXPECT_GT(blocking.lanes[0].breakdown.exposed_comm.at("pp"),
            overlapped.lanes[0].breakdown.exposed_comm.count("pp")
                ? overlapped.lanes[0].breakdown.exposed_comm.at("pp")
                : 0.0);
  // The estimate prices the wait as the simulation does.
  const double estimated = estimate_program(blocking_program).iteration_time;
  EXPECT_NEAR(estimated, blocking.iteration_time, 0.05 * blocking.iteration_time);
  EXPECT_GT(estimated, estimate_program(overlapped_program).iteration_time);
}

TEST(Simulator, RecordsTasksOnRequest) {
  MegatronOptions o;
  o.tp = 2;
  o.pp = 2;
  o.global_batch = 16;
  Program p = compile(model("gpt3-1.3b"), load("dgx-a100x4"), o);
  SimOptions opts;
  opts.record_tasks = true;
  SimResult r = run(p, opts);
  ASSERT_FALSE(r.tasks.empty());
  double last = 0;
  for (const TaskRecord& t : r.tasks) {
    EXPECT_LE(t.start, t.end);
    last = std::max(last, t.end);
  }
  EXPECT_NEAR(last, r.iteration_time, 1e-9 * r.iteration_time);
  EXPECT_TRUE(run(p).tasks.empty());
}

// A recompute rule without layers also drops the embedding's and the head's activations
// (recomputed_ops of those parts); the program recomputes them before their backward (inside
// the backward block, or in an explicit R block), as it does a layer's.
TEST(Program, RecomputeRulesWithoutLayersRecomputeTheEmbeddingAndTheHead) {
  for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kMerak}) {
    MegatronOptions o;
    o.tp = 2;
    o.pp = 2;
    o.global_batch = 4;
    o.micro_batch = 1;
    o.schedule = kind;
    o.recompute = RecomputeMode::kFull;
    const Topology t = load(kData + "/tiny-node2.yaml", 2);
    Expected<Plan> plan = build_megatron_plan(model(kData + "/tiny-gpt.yaml"), t, o);
    ASSERT_TRUE(plan.ok()) << plan.error().message();
    // Recomputed operators per label, over the backward (or R) blocks of every template.
    auto recomputed = [&](const Plan& pl) {
      Expected<Program> prog = compile_plan(pl, t, {});
      EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
      std::map<std::string, int> n;
      for (const BlockTemplate& bt : prog->templates) {
        for (const Step& st : bt.steps) {
          if (st.kind == StepKind::kCompute && st.compute_class == ComputeClass::kRecompute) {
            ++n[prog->labels[st.label]];
          }
        }
      }
      return n;
    };
    std::map<std::string, int> ranged = recomputed(*plan);
    EXPECT_GT(ranged["attn.qkv"], 0);
    EXPECT_EQ(ranged.count("head.proj"), 0u);
    EXPECT_EQ(ranged.count("embed.word"), 0u);
    Plan unranged = *plan;
    for (RecomputeRule& r : unranged.recompute) {
      r.first_layer = 0;
      r.end_layer = -1;
    }
    std::map<std::string, int> all = recomputed(unranged);
    for (const char* op : {"embed.word", "embed.position", "head.norm", "head.proj", "loss"}) {
      EXPECT_GT(all[op], 0) << op;
    }
    EXPECT_GT(all["attn.qkv"], 0);
  }
}

}  // namespace
}  // namespace nnsim
