// Activation offloading in simulation, on a communication-free node whose only other traffic is
// the copies to its host: over a fast link they hide behind the compute; over a slow one the
// compute stream waits for them, and the wait is the breakdown's exposed "offload" and the
// trace's copy streams. Whole layers on one stage, and fine-grained offloading's modules on
// two.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
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

using testing::communication_free_node;

Topology with_host(double link_bandwidth, int gpus = 1) {
  Topology t = communication_free_node(gpus);
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

double exposed_offload(const SimResult& r, size_t lane = 0) {
  const auto& e = r.lanes[lane].breakdown.exposed_comm;
  const auto it = e.find("offload");
  return it == e.end() ? 0.0 : it->second;
}

// A plan without offloading and with it, simulated; the offloading run records its tasks.
struct Runs {
  SimResult without, with;
};
std::optional<Runs> simulate_both(const std::optional<Program>& none,
                                  const std::optional<Program>& offload) {
  EXPECT_TRUE(none && offload);
  if (!none || !offload) return std::nullopt;
  SimOptions so;
  so.record_tasks = true;
  Expected<SimResult> a = simulate(*none);
  Expected<SimResult> b = simulate(*offload, so);
  EXPECT_TRUE(a.ok() && b.ok());
  if (!a || !b) return std::nullopt;
  return Runs{std::move(*a), std::move(*b)};
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
  const std::optional<Runs> runs = simulate_both(none, offload);
  ASSERT_TRUE(runs);
  const SimResult& a = runs->without;
  const SimResult& b = runs->with;
  const double bytes = offload->lanes[0].offloaded_activations;
  ASSERT_GT(bytes, 0);
  const double copies =
      offload->micro_batches * (host_copy_seconds(bytes, true, t, offload->compute_model) +
                                host_copy_seconds(bytes, false, t, offload->compute_model));
  EXPECT_GT(copies, 10 * a.iteration_time);  // the premise: the copies dominate
  EXPECT_GE(b.iteration_time, copies);
  EXPECT_LE(b.iteration_time, copies + a.iteration_time);
  // Nothing else changed: the iteration grew by the exposed wait.
  EXPECT_NEAR(b.iteration_time - a.iteration_time, exposed_offload(b), 1e-9 * b.iteration_time);
  // The estimator replays the same streams.
  EXPECT_NEAR(estimate_program(*offload).iteration_time, b.iteration_time, 1e-6 * b.iteration_time);

  // The trace: each micro-batch's eight copies out on one stream and back on the other, each
  // as long as its bytes take.
  int out = 0, back = 0;
  for (const TaskRecord& task : b.tasks) {
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

// Fine-grained offloading (Plan::activation_offload_modules), on two pipeline stages.

// The uniform model's 16 layers over two 1F1B stages of 8, 8 micro-batches.
std::optional<Program> compile_offloading_modules(const Topology& t,
                                                  std::vector<std::string> modules) {
  MegatronOptions o;
  o.pp = 2;
  o.global_batch = 8;
  o.offload_modules = std::move(modules);
  return testing::compile_uniform(t, o);
}

TEST(ModuleOffloadSim, AFastLinkHidesTheCopies) {
  const Topology t = with_host(1e18, 2);
  const std::optional<Program> none = compile_offloading_modules(t, {});
  const std::optional<Program> offload = compile_offloading_modules(t, {"core_attn", "mlp.fc1"});
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
  const Topology t = with_host(1e8, 2);
  const std::optional<Program> none = compile_offloading_modules(t, {});
  const std::optional<Program> offload = compile_offloading_modules(t, {"core_attn"});
  const std::optional<Runs> runs = simulate_both(none, offload);
  ASSERT_TRUE(runs);
  const SimResult& a = runs->without;
  const SimResult& b = runs->with;
  // The first stage's copies out, every micro-batch's.
  double out = 0;
  for (const BlockInstance& bi : offload->lanes[0].blocks) {
    for (const Step& s : offload->templates[bi.template_index].steps) {
      if (s.kind == StepKind::kHostCopyLaunch && s.to_host) out += s.seconds;
    }
  }
  EXPECT_GT(out, 10 * a.iteration_time);  // the premise: the copies dominate
  EXPECT_GE(b.iteration_time, out);
  EXPECT_GT(exposed_offload(b, 0), out - a.iteration_time);
  // The estimator replays the same streams.
  EXPECT_NEAR(estimate_program(*offload).iteration_time, b.iteration_time, 1e-6 * b.iteration_time);
  // A copy back never starts before its group has reached the host: micro-batch m's j-th
  // reload brings back its (7 - j)-th copy out (the first stage offloads all its 8 layers).
  std::vector<const TaskRecord*> outs, backs;
  for (const TaskRecord& task : b.tasks) {
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
