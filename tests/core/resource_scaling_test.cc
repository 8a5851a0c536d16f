// What each resource of a sensitivity study scales (core/resource_scaling.h), and that nothing
// else moves: latencies, capacities and the GPU's identity stay.
#include "core/resource_scaling.h"

#include <gtest/gtest.h>

#include <string>

namespace nnsim {
namespace {

Topology preset(const std::string& name) {
  Expected<Topology> t = load_topology(name);
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  return t.ok() ? *t : Topology{};
}

TEST(ResourceScaling, ComputeScalesEveryPrecisionsPeakAndNothingElse) {
  const Topology t = preset("dgx-h100-superpod");
  const Topology s = scale_resource(t, Resource::kCompute, 2);
  ASSERT_FALSE(t.gpu.dense_flops.empty());
  for (const auto& [precision, flops] : t.gpu.dense_flops) {
    EXPECT_DOUBLE_EQ(s.gpu.dense_flops.at(precision), 2 * flops);
  }
  EXPECT_EQ(s.gpu.hbm_bandwidth, t.gpu.hbm_bandwidth);
  EXPECT_EQ(s.gpu.hbm_bytes, t.gpu.hbm_bytes);
  EXPECT_EQ(s.gpu.name, t.gpu.name);
  EXPECT_EQ(s.intra.bandwidth, t.intra.bandwidth);
  EXPECT_EQ(s.nics.front().bandwidth, t.nics.front().bandwidth);
}

TEST(ResourceScaling, MemoryBandwidthScalesTheHbmOnly) {
  const Topology t = preset("dgx-h100-superpod");
  const Topology s = scale_resource(t, Resource::kMemoryBandwidth, 0.5);
  EXPECT_DOUBLE_EQ(s.gpu.hbm_bandwidth, 0.5 * t.gpu.hbm_bandwidth);
  EXPECT_EQ(s.gpu.hbm_bytes, t.gpu.hbm_bytes);
  EXPECT_EQ(s.gpu.dense_flops, t.gpu.dense_flops);
  EXPECT_EQ(s.intra.bandwidth, t.intra.bandwidth);
}

TEST(ResourceScaling, IntraNodeScalesNvlinkAndPcieButNotTheirLatency) {
  const Topology nvswitch = preset("dgx-a100x4");
  const Topology s = scale_resource(nvswitch, Resource::kIntraNode, 2);
  EXPECT_DOUBLE_EQ(s.intra.bandwidth, 2 * nvswitch.intra.bandwidth);
  EXPECT_DOUBLE_EQ(s.gpu.nvlink_bandwidth, 2 * nvswitch.gpu.nvlink_bandwidth);
  EXPECT_EQ(s.intra.latency, nvswitch.intra.latency);
  EXPECT_EQ(s.nics.front().bandwidth, nvswitch.nics.front().bandwidth);

  const Topology pcie = preset("pcie-a100x8");
  ASSERT_TRUE(pcie.intra.has_pcie);
  const Topology p = scale_resource(pcie, Resource::kIntraNode, 2);
  EXPECT_DOUBLE_EQ(p.intra.pcie.gpu_link_bandwidth, 2 * pcie.intra.pcie.gpu_link_bandwidth);
  EXPECT_DOUBLE_EQ(p.intra.pcie.switch_uplink_bandwidth,
                   2 * pcie.intra.pcie.switch_uplink_bandwidth);
  EXPECT_EQ(p.intra.pcie.latency, pcie.intra.pcie.latency);
}

TEST(ResourceScaling, NetworkScalesEveryNicAndKeepsTheFabricsShape) {
  const Topology t = preset("dgx-h100-superpod");
  const Topology s = scale_resource(t, Resource::kNetwork, 2);
  ASSERT_EQ(s.nics.size(), t.nics.size());
  for (size_t i = 0; i < t.nics.size(); ++i) {
    EXPECT_DOUBLE_EQ(s.nics[i].bandwidth, 2 * t.nics[i].bandwidth) << i;
    EXPECT_EQ(s.nics[i].latency, t.nics[i].latency) << i;
    EXPECT_EQ(s.nics[i].gpus, t.nics[i].gpus) << i;
  }
  EXPECT_EQ(s.fabric.oversubscription, t.fabric.oversubscription);
  EXPECT_EQ(s.intra.bandwidth, t.intra.bandwidth);
  EXPECT_TRUE(validate_topology(s).ok());
}

TEST(ResourceScaling, LatencyDividesEveryLatencyAndNcclsStepTimeAndNoBandwidth) {
  const Topology t = preset("dgx-h100-superpod");
  const Topology s = scale_resource(t, Resource::kLatency, 2);
  EXPECT_DOUBLE_EQ(s.intra.latency, t.intra.latency / 2);
  EXPECT_DOUBLE_EQ(s.fabric.switch_latency, t.fabric.switch_latency / 2);
  for (size_t i = 0; i < t.nics.size(); ++i) {
    EXPECT_DOUBLE_EQ(s.nics[i].latency, t.nics[i].latency / 2) << i;
    EXPECT_EQ(s.nics[i].bandwidth, t.nics[i].bandwidth) << i;
  }
  EXPECT_EQ(s.intra.bandwidth, t.intra.bandwidth);
  EXPECT_EQ(s.gpu.dense_flops, t.gpu.dense_flops);
  const Topology pcie = preset("pcie-a100x8");
  EXPECT_DOUBLE_EQ(scale_resource(pcie, Resource::kLatency, 4).intra.pcie.latency,
                   pcie.intra.pcie.latency / 4);

  const CommModel comm = CommModel::defaults_for(t.gpu);
  ASSERT_GT(comm.network.step_latency, 0);
  const CommModel fast = scale_resource(comm, Resource::kLatency, 2);
  EXPECT_DOUBLE_EQ(fast.network.step_latency, comm.network.step_latency / 2);
  EXPECT_DOUBLE_EQ(fast.nvlink.step_latency, comm.nvlink.step_latency / 2);
  EXPECT_EQ(fast.network.curve.size(), comm.network.curve.size());
  // Bandwidth resources leave the communication model's latency alone.
  for (Resource r :
       {Resource::kCompute, Resource::kMemoryBandwidth, Resource::kIntraNode, Resource::kNetwork}) {
    EXPECT_EQ(scale_resource(comm, r, 2).network.step_latency, comm.network.step_latency)
        << resource_name(r);
  }
}

TEST(ResourceScaling, NamesAreDistinct) {
  for (Resource a : kResources) {
    EXPECT_FALSE(resource_name(a).empty());
    EXPECT_FALSE(resource_description(a).empty());
    for (Resource b : kResources) {
      if (a != b) EXPECT_NE(resource_name(a), resource_name(b));
    }
  }
}

}  // namespace
}  // namespace nnsim
