// Repeated forwards (training.recycle) in simulation, on a communication-free cluster where an
// iteration is compute and pipeline bubbles only: GPipe's passes add their compute and no
// bubble, and Tessel's search beats 1F1B with each micro-batch's passes back to back.
#include <algorithm>
#include <cstdio>
#include <optional>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/megatron.h"
#include "planner/schedule_gen.h"
#include "sim/simulator.h"

namespace nnsim {
namespace {

const std::string kData = NNSIM_TEST_DATA;

Topology ideal(int gpus) {
  Expected<Topology> t = load_topology(kData + "/ideal.yaml");
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  t->gpus_per_node = gpus;
  t->nics.resize(1);
  t->nics[0].gpus.clear();
  for (int g = 0; g < gpus; ++g) t->nics[0].gpus.push_back(g);
  return *t;
}

// Only matmuls cost time (the embedding and the tiny head next to nothing): balanced stages.
CompileOptions matmul_only(const Topology& t) {
  CompileOptions co;
  co.use_default_compute_model = false;
  co.compute_model = ComputeModel::defaults_for(t.gpu);
  co.compute_model.kernel_overhead = 0;
  co.compute_model.memory_efficiency = 1e12;
  co.compute_model.comm_interference = 0;
  co.compute_model.tiles = {{1, 1, 1.0}};
  co.compute_model.gemm_k_half = 0;
  co.use_default_comm_model = false;
  co.comm_model = CommModel::ideal();
  return co;
}

struct SimRun {
  double iteration = 0;
  double compute = 0;  // the first stage's
  double peak = 0;     // the worst stage's
};

SimRun simulate_plan(const Plan& plan, const Topology& t) {
  Expected<Program> prog = compile_plan(plan, t, matmul_only(t));
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  if (!prog) return {};
  Expected<SimResult> r = simulate(*prog, {});
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
  if (!r) return {};
  SimRun out;
  out.iteration = r->iteration_time;
  out.compute = r->lanes.front().breakdown.compute;
  for (const LaneReport& l : r->lanes) out.peak = std::max(out.peak, l.peak_memory);
  return out;
}

Plan build(ScheduleKind kind, int recycle, const Topology& t, int stages = 4, int m = 16) {
  Expected<ModelSpec> model = load_model(kData + "/uniform-model.yaml");
  EXPECT_TRUE(model.ok());
  MegatronOptions o;
  o.pp = stages;
  o.global_batch = m;
  o.schedule = kind;
  o.recycle = recycle;
  o.costs = matmul_only(t);
  Expected<Plan> plan = build_megatron_plan(*model, t, o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  return *plan;
}

// GPipe runs pass i + 1 of a micro-batch once pass i has left the last stage, while the first
// stage still runs pass i of later micro-batches: with m >= p the passes add only their compute
// (2 m F per stage), no bubble; earlier passes keep nothing, so the peak is unchanged.
TEST(RecycleSim, GpipePassesAddOnlyTheirCompute) {
  const Topology t = ideal(4);
  const SimRun one = simulate_plan(build(ScheduleKind::kGpipe, 1, t), t);
  const SimRun three = simulate_plan(build(ScheduleKind::kGpipe, 3, t), t);
  ASSERT_GT(one.iteration, 0);
  const double extra = three.compute - one.compute;
  EXPECT_GT(extra, 0.5 * one.compute);  // two more forwards per micro-batch (B = 2F: 2/3 more)
  EXPECT_NEAR(three.iteration - one.iteration, extra, 0.01 * extra);
  EXPECT_NEAR(three.peak, one.peak, 1e-6 * one.peak);
}

// `nnsim schedule --search` on three passes over four stages: the orders pass the schedule
// check (they compile), and the simulated iteration beats 1F1B with each micro-batch's passes
// back to back (the first stage idles while each pass circles the pipeline), within its memory.
TEST(RecycleSim, TesselSearchBeatsBackToBackPasses) {
  const Topology t = ideal(4);
  const Plan naive = build(ScheduleKind::kOneFOneB, 3, t);
  Expected<SearchedSchedule> s = search_schedule(naive, t, std::nullopt, matmul_only(t));
  ASSERT_TRUE(s.ok()) << s.error().message();
  ASSERT_FALSE(s->kept_input);
  const SimRun before = simulate_plan(naive, t);
  const SimRun after = simulate_plan(s->plan, t);
  const SimRun gpipe = simulate_plan(build(ScheduleKind::kGpipe, 3, t), t);
  std::printf(
      "recycle 3, pp 4, 16 micro-batches: 1f1b back to back %.4f s (peak %.2f GiB), "
      "tessel %.4f s (%.2f GiB; search's makespan %.4f s), gpipe %.4f s (%.2f GiB)\n",
      before.iteration, before.peak / (1 << 30), after.iteration, after.peak / (1 << 30),
      s->tessel.makespan, gpipe.iteration, gpipe.peak / (1 << 30));
  EXPECT_LT(after.iteration, 0.8 * before.iteration);
  EXPECT_LE(after.peak, before.peak * 1.001);
  // As fast as GPipe's pass-by-pass order (which has no bubble but the fill and drain) at half
  // its memory.
  EXPECT_LE(after.iteration, 1.01 * gpipe.iteration);
  EXPECT_LT(after.peak, 0.6 * gpipe.peak);
  // The search's own makespan (its block costs, no communication here) is what simulates.
  EXPECT_NEAR(after.iteration, s->tessel.makespan, 0.03 * after.iteration);
}

}  // namespace
}  // namespace nnsim
