// Hybrid models (Nemotron-H: Mamba-2, MLP and attention layers; Qwen3-Next: Gated DeltaNet,
// gated attention and experts) replayed by the simulator:
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

// `preset` planned by the Megatron builder with `o` on one DGX H100, and compiled.
Expected<Program> compile_on_one_node(const std::string& preset, const MegatronOptions& o) {
  Expected<ModelSpec> m = load_model(preset);
  if (!m) return m.error();
  Expected<Topology> t = load_topology("dgx-h100-superpod");
  if (!t) return t.error();
  Expected<Topology> one = resize_topology(*t, 1);
  if (!one) return one.error();
  Expected<Plan> plan = build_megatron_plan(*m, *one, o);
  if (!plan) return plan.error();
  return compile_plan(*plan, *one);
}

// Nemotron-H 8B over tp 2 (sequence parallel) and pp 2, 8 micro-batches a replica.
TEST(HybridSim, NemotronHRunsItsLayerKindsOnTheirStages) {
  MegatronOptions o;
  o.tp = 2;
  o.pp = 2;
  o.sequence_parallel = true;
  o.global_batch = 16;
  o.zero = 1;
  Expected<Program> compiled = compile_on_one_node("nemotron-h-8b", o);
  ASSERT_TRUE(compiled.ok()) << compiled.error().message();
  const Program& p = *compiled;
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

// Qwen3-Next over tp 2, cp 2 and pp 2 on one DGX H100: the all-to-alls around each Gated
// DeltaNet layer's delta rule run in the simulator as the estimator prices them.
TEST(HybridSim, QwenNextRunsItsDeltaRulesBetweenAllToAlls) {
  MegatronOptions o;
  o.tp = 2;
  o.cp = 2;
  o.pp = 2;
  o.sequence_parallel = true;
  o.global_batch = 4;
  Expected<Program> p = compile_on_one_node("qwen3-next-80b-a3b", o);
  ASSERT_TRUE(p.ok()) << p.error().message();
  SimOptions options;
  options.record_tasks = true;
  Expected<SimResult> r = simulate(*p, options);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_NEAR(estimate_program(*p).iteration_time, r->iteration_time, 0.05 * r->iteration_time);
  // 48 layers a stage, 18 of them Gated DeltaNet: a forward and a backward for 4 micro-batches.
  std::map<int, int> scans;
  for (const TaskRecord& task : r->tasks) {
    if (task.kind == TaskKind::kCompute && r->labels[task.label] == "gdn.scan") ++scans[task.lane];
  }
  ASSERT_EQ(scans.size(), 2u);
  EXPECT_EQ(scans[0], 2 * 4 * 18);
  EXPECT_EQ(scans[1], 2 * 4 * 18);
  EXPECT_GT(r->lanes[0].breakdown.exposed_comm.count("cp"), 0u);
}

}  // namespace
}  // namespace nnsim
