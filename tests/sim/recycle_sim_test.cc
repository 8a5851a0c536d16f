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
#include "tests/support/communication_free.h"
#include "tests/support/simulated_run.h"

namespace nnsim {
namespace {

using testing::communication_free_node;
using testing::matmul_only;

struct SimRun {
  double iteration = 0;
  double compute = 0;  // the first stage's
  double peak = 0;     // the worst stage's
};

SimRun simulate_plan(const Plan& plan, const Topology& t) {
  const std::optional<testing::SimulatedRun> run = testing::compile_and_simulate(plan, t);
  if (!run) return {};
  const SimResult& r = run->result;
  SimRun out;
  out.iteration = r.iteration_time;
  out.compute = r.lanes.front().breakdown.compute;
  for (const LaneReport& l : r.lanes) out.peak = std::max(out.peak, l.peak_memory);
  return out;
}

Plan build(ScheduleKind kind, int recycle, const Topology& t, int stages = 4, int m = 16) {
  MegatronOptions o;
  o.pp = stages;
  o.global_batch = m;
  o.schedule = kind;
  o.recycle = recycle;
  o.costs = matmul_only(t);
  // A failure is reported here; the empty plan then fails to compile.
  const std::optional<Plan> plan = testing::uniform_plan(t, o);
  return plan ? *plan : Plan{};
}

// GPipe runs pass i + 1 of a micro-batch once pass i has left the last stage, while the first
// stage still runs pass i of later micro-batches: with m >= p the passes add only their compute
// (2 m F per stage), no bubble; earlier passes keep nothing, so the peak is unchanged.
TEST(RecycleSim, GpipePassesAddOnlyTheirCompute) {
  const Topology t = communication_free_node(4);
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
  const Topology t = communication_free_node(4);
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
  // The search's limit is the input orders' peak with the backward split, whose input half
  // keeps the weight gradients' inputs of the operators it has passed (0.4 % above here).
  EXPECT_LE(after.peak, before.peak * 1.01);
  // As fast as GPipe's pass-by-pass order (which has no bubble but the fill and drain) at half
  // its memory.
  EXPECT_LE(after.iteration, 1.01 * gpipe.iteration);
  EXPECT_LT(after.peak, 0.6 * gpipe.peak);
  // The search's own makespan (its block costs, no communication here) is what simulates.
  EXPECT_NEAR(after.iteration, s->tessel.makespan, 0.03 * after.iteration);
}

}  // namespace
}  // namespace nnsim
