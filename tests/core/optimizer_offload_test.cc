// Optimizer offloading's cost (docs/cost-model.md, "Optimizer offloading"): each part against
// its formula, and how the parts combine with and without overlap.
#include "core/optimizer_offload.h"

#include <gtest/gtest.h>

#include "core/topology.h"

namespace nnsim {
namespace {

Topology host_node() {
  auto t = load_topology("dgx-a100x4");
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  return *t;
}

OptimizerSpec offloading(double fraction, bool overlap) {
  OptimizerSpec o;
  o.grad_bytes = 4;
  o.state_bytes = 12;
  o.offload_fraction = fraction;
  o.offload_overlap = overlap;
  o.offload_param_bytes = 4;
  return o;
}

TEST(OptimizerOffload, EachPartFollowsItsFormula) {
  const Topology t = host_node();
  ASSERT_TRUE(t.has_host);
  const ComputeModel m = ComputeModel::defaults_for(t.gpu);
  const double params = 1e9;
  const OffloadedStep s = offloaded_optimizer_step(params, 1e7, offloading(1, false), t, m);
  // 16 GB/s per GPU at nvbandwidth's 55.06 / 64 and 55.43 / 64 of it.
  EXPECT_DOUBLE_EQ(s.to_host, 4e9 / (16e9 * 55.06 / 64));
  EXPECT_DOUBLE_EQ(s.to_device, 4e9 / (16e9 * 55.43 / 64));
  // 2 x 4 (gradient in, read) + 2 x 12 (state) + 4 (parameter out) bytes a parameter, at an
  // eighth of the node's 409.6 GB/s.
  EXPECT_DOUBLE_EQ(s.host, 36e9 / (409.6e9 / 8));
  EXPECT_DOUBLE_EQ(s.gpu, 0);
  EXPECT_DOUBLE_EQ(s.seconds, s.to_host + s.host + s.to_device);
}

TEST(OptimizerOffload, TheGpuPartRunsBesideTheHostsUpdate) {
  const Topology t = host_node();
  const ComputeModel m = ComputeModel::defaults_for(t.gpu);
  const double params = 1e9;
  const OffloadedStep half = offloaded_optimizer_step(params, 1e7, offloading(0.5, false), t, m);
  EXPECT_DOUBLE_EQ(half.gpu, optimizer_seconds(0.5e9, 4, 12, t.gpu, m));
  EXPECT_DOUBLE_EQ(half.seconds, half.to_host + std::max(half.host, half.gpu) + half.to_device);
  // Nothing offloaded: the GPU's step alone.
  const OffloadedStep none = offloaded_optimizer_step(params, 1e7, offloading(0, false), t, m);
  EXPECT_DOUBLE_EQ(none.seconds, optimizer_seconds(params, 4, 12, t.gpu, m));
}

TEST(OptimizerOffload, OverlapPipelinesTheCopiesAndTheUpdate) {
  const Topology t = host_node();
  const ComputeModel m = ComputeModel::defaults_for(t.gpu);
  const double params = 1e9, largest = 5e7;
  const OffloadedStep serial =
      offloaded_optimizer_step(params, largest, offloading(1, false), t, m);
  const OffloadedStep overlap =
      offloaded_optimizer_step(params, largest, offloading(1, true), t, m);
  const double slowest = std::max({overlap.to_host, overlap.host, overlap.to_device});
  // The slowest part, plus the largest tensor (a twentieth) through all three.
  EXPECT_DOUBLE_EQ(overlap.seconds,
                   slowest + (overlap.to_host + overlap.host + overlap.to_device) / 20);
  EXPECT_LT(overlap.seconds, serial.seconds);
  // One tensor: nothing to pipeline.
  const OffloadedStep one = offloaded_optimizer_step(params, params, offloading(1, true), t, m);
  EXPECT_DOUBLE_EQ(one.seconds, slowest + serial.seconds);
}

// The efficiencies are the compute model's, which a calibration file can replace.
TEST(OptimizerOffload, TheModelsEfficienciesApply) {
  const Topology t = host_node();
  ComputeModel m = ComputeModel::defaults_for(t.gpu);
  const OffloadedStep before = offloaded_optimizer_step(1e9, 1e7, offloading(1, false), t, m);
  m.host_memory_efficiency = 0.5;
  m.host_to_device_efficiency = 0.5;
  m.device_to_host_efficiency = 0.25;
  const OffloadedStep after = offloaded_optimizer_step(1e9, 1e7, offloading(1, false), t, m);
  EXPECT_DOUBLE_EQ(after.host, 2 * before.host);
  EXPECT_DOUBLE_EQ(after.to_device, 4e9 / (16e9 * 0.5));
  EXPECT_DOUBLE_EQ(after.to_host, 4e9 / (16e9 * 0.25));
}

TEST(OptimizerOffload, HostKeepsTheStateAndAGradientCopy) {
  EXPECT_DOUBLE_EQ(offloaded_host_bytes(1e9, offloading(0.25, false)), 0.25e9 * (12 + 4));
  EXPECT_DOUBLE_EQ(offloaded_host_bytes(1e9, offloading(0, false)), 0);
}

}  // namespace
}  // namespace nnsim
