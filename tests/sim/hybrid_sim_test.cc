// A hybrid model (Nemotron-H: Mamba-2, MLP and attention layers) replayed by the simulator:
// the estimator agrees with it, and each layer kind's operators run where its layers are.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "sim/simulator.h"

namespace nnsim {
namespace {

// Nemotron-H 8B over tp 2 (sequence parallel) and pp 2 on one DGX H100, 8 micro-batches a
// replica.
Program compile_nemotron_h() {
  Expected<ModelSpec> m = load_model("nemotron-h-8b");
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
  Expected<Topology> t = load_topology("dgx-h100-superpod");
  EXPECT_TRUE(t.ok());
  Expected<Topology> one = resize_topology(*t, 1);
  EXPECT_TRUE(one.ok());
  MegatronOptions o;
  o.tp = 2;
  o.pp = 2;
  o.sequence_parallel = true;
  o.global_batch = 16;
  o.zero = 1;
  Expected<Plan> plan = build_megatron_plan(*m, *one, o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  Expected<Program> prog = compile_plan(*plan, *one);
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  return *prog;
}

TEST(HybridSim, NemotronHRunsItsLayerKindsOnTheirStages) {
  const Program p = compile_nemotron_h();
  SimOptions options;
  options.record_tasks = true;
  Expected<SimResult> r = simulate(p, options);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_GT(r->iteration_time, 0);
  EXPECT_NEAR(estimate_program(p).iteration_time, r->iteration_time, 0.05 * r->iteration_time);
  // Layers 0-25 on the first stage, 26-51 on the second: 12 Mamba-2 layers each (and two
  // attention layers, 7 and 18, then 29 and 40).
  std::map<int, int> scans;  // lane -> scan steps
  for (const TaskRecord& t : r->tasks) {
    if (t.kind == TaskKind::kCompute && r->labels[t.label] == "ssm.scan") ++scans[t.lane];
  }
  ASSERT_EQ(scans.size(), 2u);
  // The forward and the backward of each, for 8 micro-batches.
  EXPECT_EQ(scans[0], 2 * 8 * 12);
  EXPECT_EQ(scans[1], 2 * 8 * 12);
}

}  // namespace
}  // namespace nnsim
