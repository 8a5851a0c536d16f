// Compiling and simulating a plan on the communication-free cluster (communication_free.h),
// every failure reported as a test failure.
#pragma once

#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <utility>

#include "core/model.h"
#include "core/program.h"
#include "planner/megatron.h"
#include "sim/simulator.h"
#include "tests/support/communication_free.h"

namespace nnsim::testing {

struct SimulatedRun {
  Program program;
  SimResult result;
};

inline std::optional<SimulatedRun> compile_and_simulate(const Plan& plan, const Topology& t) {
  Expected<Program> prog = compile_plan(plan, t, matmul_only(t));
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  if (!prog) return std::nullopt;
  Expected<SimResult> r = simulate(*prog, {});
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
  if (!r) return std::nullopt;
  return SimulatedRun{std::move(*prog), std::move(*r)};
}

// tests/data/uniform-model.yaml: layers that cost the same, an embedding and a head that cost
// next to nothing, so that pipeline stages balance.
inline std::optional<ModelSpec> uniform_model() {
  Expected<ModelSpec> m = load_model(std::string(NNSIM_TEST_DATA) + "/uniform-model.yaml");
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
  if (!m) return std::nullopt;
  return *m;
}

// The uniform model's plan as `nnsim plan` builds it with `o`, compiled with matmul_only's costs
// (o.costs is set to them).
std::optional<Program> compile_uniform(const Topology& t, MegatronOptions o);

// The uniform model's plan as `nnsim plan` builds it with `o`.
inline std::optional<Plan> uniform_plan(const Topology& t, const MegatronOptions& o) {
  const std::optional<ModelSpec> m = uniform_model();
  if (!m) return std::nullopt;
  Expected<Plan> plan = build_megatron_plan(*m, t, o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  if (!plan) return std::nullopt;
  return *plan;
}

inline std::optional<Program> compile_uniform(const Topology& t, MegatronOptions o) {
  o.costs = matmul_only(t);
  const std::optional<Plan> plan = uniform_plan(t, o);
  if (!plan) return std::nullopt;
  Expected<Program> p = compile_plan(*plan, t, matmul_only(t));
  EXPECT_TRUE(p.ok()) << (p.ok() ? "" : p.error().message());
  if (!p) return std::nullopt;
  return std::move(*p);
}

}  // namespace nnsim::testing
