// Host copies share their GPU's PCIe link with its NIC's traffic (GPUDirect RDMA): two GPUs in
// two nodes, data parallel across them, offloading activations. Where node.pcie describes the
// link, the backward's reloads and the gradients' all-reduce arriving over the NIC slow each
// other; where it does not (or where the link is fast enough for both), the copies take their
// closed-form time.
#include <optional>

#include <gtest/gtest.h>

#include "core/host_copy.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/megatron.h"
#include "sim/simulator.h"
#include "tests/support/communication_free.h"
#include "tests/support/simulated_run.h"

namespace nnsim {
namespace {

using testing::communication_free_node;

constexpr double kLink = 2e9;  // bytes/s: the NIC, the host link and (when described) PCIe

// Two nodes of `gpus` GPUs; `pcie` is each GPU's PCIe link (0: node.pcie not described).
Topology two_nodes(double pcie, int gpus = 1) {
  Topology t = communication_free_node(gpus);
  t.nodes = 2;
  // A NIC per GPU, so that each tensor-parallel rank's ring has links of its own.
  const NicSpec nic = t.nics[0];
  t.nics.assign(gpus, nic);
  for (int g = 0; g < gpus; ++g) {
    t.nics[g].bandwidth = kLink;
    t.nics[g].gpus = {g};
  }
  t.has_host = true;
  t.host.memory = 1e13;
  t.host.memory_bandwidth = 1e12;
  t.host.link_bandwidth = kLink;
  if (pcie > 0) {
    t.intra.has_pcie = true;
    t.intra.pcie.gpu_link_bandwidth = pcie;
    t.intra.pcie.switch_uplink_bandwidth = pcie;
    t.intra.pcie.latency = 0;
    t.intra.pcie.switches.assign(1, {});
    for (int g = 0; g < gpus; ++g) t.intra.pcie.switches[0].push_back(g);
    t.intra.pcie.nic_switch.assign(gpus, 0);
  }
  EXPECT_TRUE(validate_topology(t).ok());
  return t;
}

struct CopyRun {
  Program program;
  SimResult result;
};

std::optional<CopyRun> run(const Topology& t, int offloaded, int tp = 1,
                           bool mirror_lane_ranks = true) {
  MegatronOptions o;
  o.global_batch = 8;
  o.tp = tp;
  o.dp = 2;
  o.activation_offload = offloaded;
  std::optional<Program> p = testing::compile_uniform(t, o);
  if (!p) return std::nullopt;
  SimOptions so;
  so.record_tasks = true;
  so.mirror_lane_ranks = mirror_lane_ranks;
  Expected<SimResult> r = simulate(*p, so);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
  if (!r) return std::nullopt;
  return CopyRun{std::move(*p), std::move(*r)};
}

// The longest a copy took over its time alone, as a fraction of that time.
double worst_copy_stretch(const CopyRun& r, const Topology& t) {
  double worst = 0;
  int copies = 0;
  for (const TaskRecord& task : r.result.tasks) {
    if (task.kind != TaskKind::kHostCopy) continue;
    ++copies;
    const double alone =
        host_copy_seconds(task.bytes, task.stream == Stream::kOffload, t, r.program.compute_model);
    EXPECT_GE(task.end - task.start, alone * (1 - 1e-9));
    worst = std::max(worst, (task.end - task.start) / alone - 1);
  }
  EXPECT_GT(copies, 0);
  return worst;
}

TEST(HostCopyContention, TheReloadsAndTheGradientsShareThePcieLink) {
  const Topology shared = two_nodes(kLink);  // one link's worth for the NIC and the copies
  const Topology roomy = two_nodes(1e18);    // PCIe fast enough for both
  const Topology bare = two_nodes(0);        // no PCIe described
  // Without offloading PCIe changes nothing: the NIC is the gradients' bottleneck either way.
  const std::optional<CopyRun> plain_shared = run(shared, 0);
  const std::optional<CopyRun> plain_bare = run(bare, 0);
  ASSERT_TRUE(plain_shared && plain_bare);
  EXPECT_NEAR(plain_shared->result.iteration_time, plain_bare->result.iteration_time,
              1e-9 * plain_bare->result.iteration_time);

  const std::optional<CopyRun> a = run(shared, 8);
  const std::optional<CopyRun> b = run(roomy, 8);
  const std::optional<CopyRun> c = run(bare, 8);
  ASSERT_TRUE(a && b && c);
  // The premise: the copies and the gradients' traffic are each a sizeable share of the step.
  EXPECT_GT(a->program.lanes[0].offloaded_activations / kLink, 0.05 * a->result.iteration_time);
  EXPECT_GT(a->result.lanes[0].breakdown.total_exposed_comm(), 0.05 * a->result.iteration_time);
  // Sharing the link stretches copies and slows the step.
  EXPECT_GT(worst_copy_stretch(*a, shared), 0.1);
  EXPECT_GT(a->result.iteration_time, 1.01 * b->result.iteration_time);
  // A PCIe link with room for both, or none described, leaves every copy its time alone.
  EXPECT_LT(worst_copy_stretch(*b, roomy), 1e-9);
  EXPECT_LT(worst_copy_stretch(*c, bare), 1e-9);
  EXPECT_NEAR(b->result.iteration_time, c->result.iteration_time, 1e-9 * c->result.iteration_time);
}

// Two tensor-parallel ranks a lane, each with its own data-parallel ring across the nodes over
// its own PCIe link and NIC: the simulator runs the first rank's ring only (sim/lane_mirror.h),
// while the lane's copy runs on both GPUs. Mirrored or not, the step is the same.
TEST(HostCopyContention, MirroredRanksShareTheirLinksAsEveryRankDoes) {
  const Topology shared = two_nodes(kLink, 2);
  const std::optional<CopyRun> mirrored = run(shared, 8, 2, true);
  const std::optional<CopyRun> whole = run(shared, 8, 2, false);
  const std::optional<CopyRun> roomy = run(two_nodes(1e18, 2), 8, 2, true);
  ASSERT_TRUE(mirrored && whole && roomy);
  EXPECT_LT(mirrored->result.activities, whole->result.activities);  // it did mirror
  EXPECT_GT(worst_copy_stretch(*mirrored, shared), 0.1);
  EXPECT_GT(mirrored->result.iteration_time, 1.01 * roomy->result.iteration_time);
  EXPECT_NEAR(mirrored->result.iteration_time, whole->result.iteration_time,
              1e-9 * whole->result.iteration_time);
}

}  // namespace
}  // namespace nnsim
