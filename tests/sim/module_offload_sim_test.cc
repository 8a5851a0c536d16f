// Fine-grained activation offloading in simulation, on two pipeline stages of a
// communication-free node whose only other traffic is the copies to its host: over a fast link
// the copies hide; over a slow one the compute waits for them, and the estimator replays the
// same streams.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/host_copy.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "sim/simulator.h"
#include "tests/support/communication_free.h"
#include "tests/support/simulated_run.h"

namespace nnsim {
namespace {

Topology with_host(double link_bandwidth) {
  Topology t = testing::communication_free_node(2);
  t.has_host = true;
  t.host.memory = 1e13;
  t.host.memory_bandwidth = 1e12;
  t.host.link_bandwidth = link_bandwidth;
  return t;
}

// The uniform model's 16 layers over two 1F1B stages of 8, 8 micro-batches.
std::optional<Program> compile_offloading(const Topology& t, std::vector<std::string> modules) {
  MegatronOptions o;
  o.pp = 2;
  o.global_batch = 8;
  o.offload_modules = std::move(modules);
  return testing::compile_uniform(t, o);
}

double exposed_offload(const SimResult& r, size_t lane) {
  const auto& e = r.lanes[lane].breakdown.exposed_comm;
  const auto it = e.find("offload");
  return it == e.end() ? 0.0 : it->second;
}

TEST(ModuleOffloadSim, AFastLinkHidesTheCopies) {
  const Topology t = with_host(1e18);
  const std::optional<Program> none = compile_offloading(t, {});
  const std::optional<Program> offload = compile_offloading(t, {"core_attn", "mlp.fc1"});
  ASSERT_TRUE(none && offload);
  Expected<SimResult> a = simulate(*none);
  Expected<SimResult> b = simulate(*offload);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NEAR(b->iteration_time, a->iteration_time, 1e-9 * a->iteration_time);
  for (size_t l = 0; l < 2; ++l) {
    EXPECT_LT(exposed_offload(*b, l), 1e-9 * a->iteration_time);
    EXPECT_LT(b->lanes[l].peak_memory, a->lanes[l].peak_memory) << l;
  }
}

// Over a link a thousand times too slow the copies set the pace: each micro-batch's copies to the
// host finish before its backward can bring them back, one after another on the stream.
TEST(ModuleOffloadSim, ASlowLinkMakesTheComputeWait) {
  const Topology t = with_host(1e8);
  const std::optional<Program> none = compile_offloading(t, {});
  const std::optional<Program> offload = compile_offloading(t, {"core_attn"});
  ASSERT_TRUE(none && offload);
  SimOptions so;
  so.record_tasks = true;
  Expected<SimResult> a = simulate(*none);
  Expected<SimResult> b = simulate(*offload, so);
  ASSERT_TRUE(a.ok() && b.ok());
  // The first stage's copies out, every micro-batch's.
  double out = 0;
  for (const BlockInstance& bi : offload->lanes[0].blocks) {
    for (const Step& s : offload->templates[bi.template_index].steps) {
      if (s.kind == StepKind::kHostCopyLaunch && s.to_host) out += s.seconds;
    }
  }
  EXPECT_GT(out, 10 * a->iteration_time);  // the premise: the copies dominate
  EXPECT_GE(b->iteration_time, out);
  EXPECT_GT(exposed_offload(*b, 0), out - a->iteration_time);
  // The estimator replays the same streams.
  EXPECT_NEAR(estimate_program(*offload).iteration_time, b->iteration_time,
              1e-6 * b->iteration_time);
  // A copy back never starts before its group has reached the host: micro-batch m's j-th
  // reload brings back its (7 - j)-th copy out (the first stage offloads all its 8 layers).
  std::vector<const TaskRecord*> outs, backs;
  for (const TaskRecord& task : b->tasks) {
    if (task.kind != TaskKind::kHostCopy || task.lane != 0) continue;
    (task.stream == Stream::kOffload ? outs : backs).push_back(&task);
  }
  ASSERT_EQ(outs.size(), 8u * offload->micro_batches);
  ASSERT_EQ(backs.size(), outs.size());
  for (size_t i = 0; i < backs.size(); ++i) {
    const size_t m = i / 8, j = i % 8;
    EXPECT_GE(backs[i]->start, outs[8 * m + 7 - j]->end - 1e-12) << i;
    EXPECT_GT(backs[i]->end, outs[8 * m + 7 - j]->end) << i;
  }
}

}  // namespace
}  // namespace nnsim
