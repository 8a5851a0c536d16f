#include "core/topology_writer.h"

#include <string>

#include <gtest/gtest.h>

#include "core/gpu.h"

namespace nnsim {
namespace {

// Every field load_topology fills, compared one by one (`file` aside: where it was read from).
void expect_same_cluster(const Topology& a, const Topology& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.description, b.description);
  EXPECT_EQ(a.gpu.name, b.gpu.name);
  EXPECT_EQ(a.gpu.dense_flops, b.gpu.dense_flops);
  EXPECT_EQ(a.gpu.hbm_bytes, b.gpu.hbm_bytes);
  EXPECT_EQ(a.gpu.hbm_bandwidth, b.gpu.hbm_bandwidth);
  EXPECT_EQ(a.gpu.nvlink_bandwidth, b.gpu.nvlink_bandwidth);
  EXPECT_EQ(a.gpu.sms, b.gpu.sms);
  EXPECT_EQ(a.gpu.base, b.gpu.base);  // whose measured behaviour it keeps
  EXPECT_EQ(a.nodes, b.nodes);
  EXPECT_EQ(a.gpus_per_node, b.gpus_per_node);
  EXPECT_EQ(a.intra.kind, b.intra.kind);
  EXPECT_EQ(a.intra.bandwidth, b.intra.bandwidth);
  EXPECT_EQ(a.intra.latency, b.intra.latency);
  ASSERT_EQ(a.intra.mesh.size(), b.intra.mesh.size());
  for (size_t i = 0; i < a.intra.mesh.size(); ++i) {
    EXPECT_EQ(a.intra.mesh[i].a, b.intra.mesh[i].a);
    EXPECT_EQ(a.intra.mesh[i].b, b.intra.mesh[i].b);
    EXPECT_EQ(a.intra.mesh[i].links, b.intra.mesh[i].links);
  }
  EXPECT_EQ(a.intra.has_pcie, b.intra.has_pcie);
  EXPECT_EQ(a.intra.pcie.gpu_link_bandwidth, b.intra.pcie.gpu_link_bandwidth);
  EXPECT_EQ(a.intra.pcie.switch_uplink_bandwidth, b.intra.pcie.switch_uplink_bandwidth);
  EXPECT_EQ(a.intra.pcie.latency, b.intra.pcie.latency);
  EXPECT_EQ(a.intra.pcie.switches, b.intra.pcie.switches);
  EXPECT_EQ(a.intra.pcie.nic_switch, b.intra.pcie.nic_switch);
  ASSERT_EQ(a.nics.size(), b.nics.size());
  for (size_t i = 0; i < a.nics.size(); ++i) {
    EXPECT_EQ(a.nics[i].bandwidth, b.nics[i].bandwidth);
    EXPECT_EQ(a.nics[i].latency, b.nics[i].latency);
    EXPECT_EQ(a.nics[i].gpus, b.nics[i].gpus);
  }
  EXPECT_EQ(a.has_host, b.has_host);
  EXPECT_EQ(a.host.memory, b.host.memory);
  EXPECT_EQ(a.host.memory_bandwidth, b.host.memory_bandwidth);
  EXPECT_EQ(a.host.link_bandwidth, b.host.link_bandwidth);
  EXPECT_EQ(a.fabric.kind, b.fabric.kind);
  EXPECT_EQ(a.fabric.nodes_per_group, b.fabric.nodes_per_group);
  EXPECT_EQ(a.fabric.oversubscription, b.fabric.oversubscription);
  EXPECT_EQ(a.fabric.switch_latency, b.fabric.switch_latency);
}

Topology read_back(const Topology& t) {
  Expected<std::string> text = topology_to_yaml(t);
  EXPECT_TRUE(text.ok()) << text.error().message();
  if (!text) return {};
  Expected<Topology> again = parse_topology(*text, "written.yaml");
  EXPECT_TRUE(again.ok()) << again.error().message() << "\n" << *text;
  return again ? *again : Topology{};
}

TEST(TopologyWriter, EveryPresetReadsBackTheSame) {
  for (const std::string& name : topology_preset_names()) {
    SCOPED_TRACE(name);
    Expected<Topology> t = load_topology(name);
    ASSERT_TRUE(t.ok()) << t.error().message();
    expect_same_cluster(*t, read_back(*t));
  }
}

// What nnsim validate builds: a preset resized, its GPU swapped, its NICs rebuilt (BLOOM's
// cluster: 4 x 100 Gb/s for 8 GPUs); and an NVLink-mesh node and a hypothetical GPU.
TEST(TopologyWriter, EditedClustersReadBackTheSame) {
  Expected<Topology> base = load_topology("dgx-h100-superpod");
  ASSERT_TRUE(base.ok()) << base.error().message();
  Topology t = *base;
  t.nodes = 48;
  t.gpu = *find_gpu("a100-sxm4-40gb");
  t.intra.bandwidth = t.gpu.nvlink_bandwidth;
  t.intra.has_pcie = false;  // laid out for the preset's 8 NICs
  t.intra.pcie = {};
  t.nics.assign(4, t.nics.front());
  for (int n = 0; n < 4; ++n) {
    t.nics[n].bandwidth = 12.5e9;
    t.nics[n].gpus = {2 * n, 2 * n + 1};
  }
  expect_same_cluster(t, read_back(t));

  Expected<Topology> mesh = parse_topology(R"(name: mesh
description: "four GPUs: a ring of NVLinks, with \"quotes\""
gpu: {base: h100-sxm5-80gb, name: h100-big, hbm_bytes: 192 GB, bf16_flops: 2000 TFLOP/s}
nodes: 1
node:
  gpus: 4
  intra: {kind: nvlink_mesh, bandwidth: 25 GB/s, latency: 1.3 us,
          links: [[0, 1, 4], [1, 2, 4], [2, 3, 4], [0, 3, 2], [0, 2], [1, 3]]}
  pcie: {gpu_link_bandwidth: 32 GB/s, switch_uplink_bandwidth: 24 GB/s, latency: 0.9 us,
         switches: [[0, 1], [2, 3]]}
  nics: {count: 2, bandwidth: 100 Gb/s, latency: 1.1 us}
fabric: {kind: fat_tree, nodes_per_group: 4, oversubscription: 2.5, switch_latency: 0.3 us}
)",
                                           "mesh.yaml");
  ASSERT_TRUE(mesh.ok()) << mesh.error().message();
  expect_same_cluster(*mesh, read_back(*mesh));

  // A hypothetical GPU named after itself keeps its own base, not another with its formats.
  Topology what_if = *mesh;
  what_if.gpu = *find_gpu("h200-sxm-141gb");
  what_if.gpu.name = "b200";
  what_if.gpu.dense_flops[Precision::kBf16] = 2250e12;
  expect_same_cluster(what_if, read_back(what_if));
}

TEST(TopologyWriter, WhatTheFormatCannotSayIsAnError) {
  Expected<Topology> t = load_topology("dgx-a100x4");
  ASSERT_TRUE(t.ok()) << t.error().message();
  Topology uneven = *t;
  uneven.nics[3].bandwidth /= 2;
  Expected<std::string> text = topology_to_yaml(uneven);
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.error().message().find("NICs differ"), std::string::npos)
      << text.error().message();

  Topology odd = *t;
  odd.gpu.name = "no-fp16";
  odd.gpu.dense_flops.erase(Precision::kFp16);
  text = topology_to_yaml(odd);
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.error().message().find("no catalog GPU has its precisions"), std::string::npos)
      << text.error().message();
}

}  // namespace
}  // namespace nnsim
