// Activation offloading in simulation, on a communication-free GPU whose only other traffic is
// the copies to its host: over a fast link they hide behind the compute; over a slow one the
// compute stream waits for them, and the wait is the breakdown's exposed "offload" and the
// trace's copy streams.
#include <algorithm>
#include <optional>

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

using testing::communication_free_node;

Topology with_host(double link_bandwidth) {
  Topology t = communication_free_node(1);
  t.has_host = true;
  t.host.memory = 1e13;
  t.host.memory_bandwidth = 1e12;
  t.host.link_bandwidth = link_bandwidth;
  return t;
}

// The uniform model's 16 layers on one GPU, 4 micro-batches.
std::optional<Program> compile_offloading(const Topology& t, int offloaded) {
  MegatronOptions o;
  o.global_batch = 4;
  o.activation_offload = offloaded;
  return testing::compile_uniform(t, o);
}

double exposed_offload(const SimResult& r) {
  const auto& e = r.lanes.front().breakdown.exposed_comm;
  const auto it = e.find("offload");
  return it == e.end() ? 0.0 : it->second;
}

TEST(ActivationOffloadSim, AFastLinkHidesTheCopies) {
  const Topology t = with_host(1e18);
  const std::optional<Program> none = compile_offloading(t, 0);
  const std::optional<Program> offload = compile_offloading(t, 15);
  ASSERT_TRUE(none && offload);
  Expected<SimResult> a = simulate(*none);
  Expected<SimResult> b = simulate(*offload);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NEAR(b->iteration_time, a->iteration_time, 1e-9 * a->iteration_time);
  EXPECT_LT(exposed_offload(*b), 1e-9 * a->iteration_time);
  // The activations left on the GPU are the last layer's and what is in flight.
  EXPECT_LT(b->lanes.front().peak_memory, a->lanes.front().peak_memory);
}

// Over a link a hundred times too slow the copies set the pace: every micro-batch's copies go
// out one after another and come back one after another, with compute under part of them.
TEST(ActivationOffloadSim, ASlowLinkMakesTheComputeWait) {
  const Topology t = with_host(1e8);
  const std::optional<Program> none = compile_offloading(t, 0);
  const std::optional<Program> offload = compile_offloading(t, 8);
  ASSERT_TRUE(none && offload);
  SimOptions so;
  so.record_tasks = true;
  Expected<SimResult> a = simulate(*none);
  Expected<SimResult> b = simulate(*offload, so);
  ASSERT_TRUE(a.ok() && b.ok());
  const double bytes = offload->lanes[0].offloaded_activations;
  ASSERT_GT(bytes, 0);
  const double copies =
      offload->micro_batches * (host_copy_seconds(bytes, true, t, offload->compute_model) +
                                host_copy_seconds(bytes, false, t, offload->compute_model));
  EXPECT_GT(copies, 10 * a->iteration_time);  // the premise: the copies dominate
  EXPECT_GE(b->iteration_time, copies);
  EXPECT_LE(b->iteration_time, copies + a->iteration_time);
  // Nothing else changed: the iteration grew by the exposed wait.
  EXPECT_NEAR(b->iteration_time - a->iteration_time, exposed_offload(*b), 1e-9 * b->iteration_time);
  // The estimator replays the same streams.
  EXPECT_NEAR(estimate_program(*offload).iteration_time, b->iteration_time,
              1e-6 * b->iteration_time);

  // The trace: each micro-batch's eight copies out on one stream and back on the other, each
  // as long as its bytes take.
  int out = 0, back = 0;
  for (const TaskRecord& task : b->tasks) {
    if (task.kind != TaskKind::kHostCopy) continue;
    EXPECT_NEAR(
        task.end - task.start,
        host_copy_seconds(task.bytes, task.stream == Stream::kOffload, t, offload->compute_model),
        1e-9);
    (task.stream == Stream::kOffload ? out : back) += 1;
  }
  EXPECT_EQ(out, 8 * offload->micro_batches);
  EXPECT_EQ(back, 8 * offload->micro_batches);
}

}  // namespace
}  // namespace nnsim
