// The sensitivity study (sim/sensitivity.h): the plan simulated again with one resource scaled.
// Closed forms on the communication-free node, where only matmuls cost time, and the bundled
// example on four DGX A100 nodes, where every resource moves the step a little.
#include "sim/sensitivity.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "core/plan.h"
#include "core/topology.h"
#include "tests/support/communication_free.h"
#include "tests/support/simulated_run.h"

namespace nnsim {
namespace {

using testing::communication_free_node;
using testing::matmul_only;

double time_of(const Sensitivity& s, Resource r) {
  for (const ResourceSensitivity& x : s.resources) {
    if (x.resource == r) return x.iteration_time;
  }
  ADD_FAILURE() << "no row for " << resource_name(r);
  return 0;
}

// The uniform model on one GPU of the communication-free node: its step is its matmuls.
struct ComputeOnly {
  Plan plan;
  Topology topo;
  CompileOptions compile;
  double baseline = 0;
};

std::optional<ComputeOnly> compute_only() {
  ComputeOnly c;
  c.topo = communication_free_node(1);
  c.compile = matmul_only(c.topo);
  MegatronOptions o;
  o.global_batch = 2;
  o.costs = c.compile;
  std::optional<Plan> plan = testing::uniform_plan(c.topo, o);
  if (!plan) return std::nullopt;
  c.plan = *plan;
  const std::optional<testing::SimulatedRun> run = testing::compile_and_simulate(c.plan, c.topo);
  if (!run) return std::nullopt;
  c.baseline = run->result.iteration_time;
  return c;
}

TEST(Sensitivity, TwiceTheComputeHalvesAStepOfMatmulsAndNothingElseMovesIt) {
  const std::optional<ComputeOnly> c = compute_only();
  ASSERT_TRUE(c);
  ASSERT_GT(c->baseline, 0);
  Expected<Sensitivity> s = sensitivity(c->plan, c->topo, c->compile, {}, 2, c->baseline);
  ASSERT_TRUE(s.ok()) << s.error().message();
  ASSERT_EQ(s->resources.size(), kResources.size());
  EXPECT_EQ(s->factor, 2);
  EXPECT_EQ(s->baseline, c->baseline);
  EXPECT_NEAR(time_of(*s, Resource::kCompute), c->baseline / 2, 1e-9 * c->baseline);
  // Memory-bound operators cost next to nothing (1e-14 s a step) and there is nothing to
  // communicate.
  EXPECT_NEAR(time_of(*s, Resource::kMemoryBandwidth), c->baseline, 1e-9 * c->baseline);
  EXPECT_DOUBLE_EQ(time_of(*s, Resource::kIntraNode), c->baseline);
  EXPECT_DOUBLE_EQ(time_of(*s, Resource::kNetwork), c->baseline);
  EXPECT_DOUBLE_EQ(time_of(*s, Resource::kLatency), c->baseline);
}

TEST(Sensitivity, HalfTheComputeDoublesIt) {
  const std::optional<ComputeOnly> c = compute_only();
  ASSERT_TRUE(c);
  Expected<Sensitivity> s = sensitivity(c->plan, c->topo, c->compile, {}, 0.5, c->baseline);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_NEAR(time_of(*s, Resource::kCompute), 2 * c->baseline, 1e-9 * c->baseline);
}

// The bundled example: GPT-3 13B, TP 8, PP 2, DP 2 on four DGX A100 nodes.
struct Example {
  Plan plan;
  Topology topo;
  double baseline = 0;
};

std::optional<Example> example() {
  Expected<Plan> plan =
      load_plan(std::string(NNSIM_TEST_DATA) + "/../../examples/gpt3-13b-dgx-a100x4.json");
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  Expected<Topology> topo = load_topology("dgx-a100x4");
  EXPECT_TRUE(topo.ok()) << (topo.ok() ? "" : topo.error().message());
  if (!plan || !topo) return std::nullopt;
  Expected<Program> prog = compile_plan(*plan, *topo, {});
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  if (!prog) return std::nullopt;
  Expected<SimResult> r = simulate(*prog);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
  if (!r) return std::nullopt;
  return Example{*plan, *topo, r->iteration_time};
}

TEST(Sensitivity, EveryResourceOfTheExampleMovesItsStepTheWayItIsScaled) {
  const std::optional<Example> e = example();
  ASSERT_TRUE(e);
  Expected<Sensitivity> faster = sensitivity(e->plan, e->topo, {}, {}, 2, e->baseline);
  ASSERT_TRUE(faster.ok()) << faster.error().message();
  Expected<Sensitivity> slower = sensitivity(e->plan, e->topo, {}, {}, 0.5, e->baseline);
  ASSERT_TRUE(slower.ok()) << slower.error().message();
  for (Resource r : kResources) {
    // Tensor-parallel collectives inside the nodes, pipeline transfers and data-parallel
    // reductions over InfiniBand, matmuls and memory-bound operators: each resource carries
    // part of the step, none all of it.
    EXPECT_LT(time_of(*faster, r), e->baseline) << resource_name(r);
    EXPECT_GT(time_of(*faster, r), e->baseline / 2) << resource_name(r);
    EXPECT_GT(time_of(*slower, r), e->baseline) << resource_name(r);
    EXPECT_LT(time_of(*slower, r), 2 * e->baseline) << resource_name(r);
  }
}

TEST(Sensitivity, FactorOneChangesNothing) {
  const std::optional<Example> e = example();
  ASSERT_TRUE(e);
  Expected<Sensitivity> s = sensitivity(e->plan, e->topo, {}, {}, 1, e->baseline);
  ASSERT_TRUE(s.ok()) << s.error().message();
  for (const ResourceSensitivity& x : s->resources) {
    EXPECT_EQ(x.iteration_time, e->baseline) << resource_name(x.resource);
  }
}

TEST(Sensitivity, RefusesAFactorOutsideItsRange) {
  const std::optional<ComputeOnly> c = compute_only();
  ASSERT_TRUE(c);
  for (double factor : {0.0, -2.0, 0.001, 1000.0}) {
    Expected<Sensitivity> s = sensitivity(c->plan, c->topo, c->compile, {}, factor, c->baseline);
    ASSERT_FALSE(s.ok()) << factor;
    EXPECT_NE(s.error().message().find("the factor must be from 0.01 to 100"), std::string::npos)
        << s.error().message();
  }
}

}  // namespace
}  // namespace nnsim
