// Parameter offloading (FSDP's CPUOffload) in simulation: every gather's shard comes from the
// host and every reduction's goes back, on the data-parallel stream beside the collective.
#include <optional>

#include <gtest/gtest.h>

#include "core/program.h"
#include "core/topology.h"
#include "planner/megatron.h"
#include "sim/simulator.h"
#include "tests/support/communication_free.h"
#include "tests/support/simulated_run.h"

namespace nnsim {
namespace {

using testing::communication_free_node;
using testing::matmul_only;

TEST(ParamOffloadSim, TheDataParallelStreamCopiesEachShard) {
  Topology t = communication_free_node(2);
  t.has_host = true;
  t.host.memory = 1e13;
  t.host.memory_bandwidth = 1e12;
  t.host.link_bandwidth = 1e9;
  MegatronOptions o;
  o.framework = "fsdp";
  o.zero = 3;
  o.global_batch = 4;
  o.optimizer_offload = 1;
  o.costs = matmul_only(t);
  const std::optional<Plan> plan = testing::uniform_plan(t, o);
  ASSERT_TRUE(plan);
  ASSERT_TRUE(plan->optimizer.offload_params);
  Expected<Program> prog = compile_plan(*plan, t, matmul_only(t));
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  // What the lane's data-parallel stream is given to copy over the iteration.
  const Lane& lane = prog->lanes[0];
  int expected = 0;
  double seconds = 0;
  auto count = [&](const std::vector<Step>& steps) {
    for (const Step& s : steps) {
      if (s.kind == StepKind::kDpLaunch && s.host_seconds > 0) {
        ++expected;
        seconds += s.host_seconds;
      }
    }
  };
  count(lane.prologue);
  for (const BlockInstance& b : lane.blocks) count(prog->templates[b.template_index].steps);
  count(lane.epilogue);
  ASSERT_GT(expected, 0);
  SimOptions so;
  so.record_tasks = true;
  Expected<SimResult> r = simulate(*prog, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  int copies = 0;
  double copied = 0;
  for (const TaskRecord& task : r->tasks) {
    if (task.kind != TaskKind::kHostCopy || task.lane != 0) continue;
    EXPECT_EQ(task.stream, Stream::kDataParallel);
    ++copies;
    copied += task.end - task.start;
  }
  EXPECT_EQ(copies, expected);
  EXPECT_NEAR(copied, seconds, 1e-9 * seconds);
  // At 1 GB/s the copies outlast the compute: the iteration is at least their time.
  EXPECT_GE(r->iteration_time, seconds);
}

}  // namespace
}  // namespace nnsim
