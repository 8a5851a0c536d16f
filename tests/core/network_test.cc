#include "core/network.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace nnsim {
namespace {

Topology preset(const std::string& name, int nodes = 0) {
  auto t = load_topology(name);
  EXPECT_TRUE(t.ok()) << t.error().message();
  if (nodes > 0) {
    auto r = resize_topology(*t, nodes);
    EXPECT_TRUE(r.ok()) << r.error().message();
    return *r;
  }
  return *t;
}

Topology parse(const std::string& yaml) {
  auto t = parse_topology(yaml, "test.yaml");
  EXPECT_TRUE(t.ok()) << t.error().message();
  return *t;
}

// The names of the links of the route from `src` to `dst`; `latency` receives its latency.
std::vector<std::string> route_names(const Network& net, int src, int dst,
                                     double* latency = nullptr) {
  std::vector<int> ids;
  double lat = net.route(src, dst, ids);
  if (latency) *latency = lat;
  std::vector<std::string> names;
  double sum = 0;
  for (int id : ids) {
    names.push_back(net.links()[id].name);
    sum += net.links()[id].latency;
  }
  EXPECT_DOUBLE_EQ(lat, sum);
  return names;
}

using Names = std::vector<std::string>;

TEST(Network, SameGpuIsAnEmptyRoute) {
  Network net(preset("dgx-a100x4"));
  std::vector<int> out = {42};
  EXPECT_EQ(net.route(3, 3, out), 0);
  EXPECT_EQ(out, std::vector<int>{42});  // appends, never clears
}

TEST(Network, NvSwitchRouteCrossesTwoPorts) {
  Network net(preset("dgx-a100x4"));
  std::vector<int> ids;
  double lat = net.route(0, 5, ids);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(net.links()[ids[0]].name, "n0.g0.nvl.up");
  EXPECT_EQ(net.links()[ids[1]].name, "n0.g5.nvl.down");
  for (int id : ids) {
    EXPECT_EQ(net.links()[id].kind, LinkKind::kNvLink);
    EXPECT_DOUBLE_EQ(net.links()[id].bandwidth, 300e9);
  }
  EXPECT_DOUBLE_EQ(lat, 0.7e-6);
  EXPECT_TRUE(net.same_node(0, 5));
  EXPECT_FALSE(net.same_node(7, 8));
}

TEST(Network, InterNodeRouteCrossesTheServingNics) {
  Network net(preset("dgx-a100x4"));
  double lat = 0;
  EXPECT_EQ(route_names(net, 3, 8 + 5, &lat), (Names{"n0.nic3.up", "n1.nic5.down"}));
  EXPECT_DOUBLE_EQ(lat, 2e-6);
  EXPECT_EQ(route_names(net, 31, 0), (Names{"n3.nic7.up", "n0.nic0.down"}));
}

TEST(Network, LinksComeInUpDownPairsWithUniqueNames) {
  for (const auto& name : topology_preset_names()) {
    Network net(preset(name, 2));
    const auto& links = net.links();
    ASSERT_EQ(links.size() % 2, 0u) << name;
    std::set<std::string> seen;
    for (size_t i = 0; i < links.size(); i += 2) {
      const std::string& up = links[i].name;
      const std::string& down = links[i + 1].name;
      ASSERT_GT(up.size(), 3u);
      EXPECT_EQ(up.substr(up.size() - 3), ".up") << up;
      EXPECT_EQ(down, up.substr(0, up.size() - 3) + ".down");
      EXPECT_EQ(links[i].bandwidth, links[i + 1].bandwidth);
      EXPECT_GT(links[i].bandwidth, 0) << up;
      EXPECT_TRUE(seen.insert(up).second) << up;
    }
  }
}

const std::string kFatTree = R"(gpu: h100-sxm5-80gb
nodes: 4
node:
  gpus: 8
  intra: {kind: nvswitch, latency: 0.7 us}
  nics: {count: 2, bandwidth: 400 Gb/s, latency: 1 us}
fabric: {kind: fat_tree, nodes_per_group: 2, oversubscription: 2, switch_latency: 0.13 us}
)";

TEST(Network, FatTreeCrossesLeafUplinksOnlyBetweenLeaves) {
  Network net(parse(kFatTree));
  // Nodes 0 and 1 share leaf 0; nodes 2 and 3 are under leaf 1.
  EXPECT_EQ(route_names(net, 0, 8 + 4), (Names{"n0.nic0.up", "n1.nic1.down"}));
  double lat = 0;
  EXPECT_EQ(route_names(net, 5, 2 * 8 + 1, &lat),
            (Names{"n0.nic1.up", "leaf0.up", "leaf1.down", "n2.nic0.down"}));
  EXPECT_NEAR(lat, 2e-6 + 2 * 0.13e-6, 1e-15);
  std::vector<int> ids;
  net.route(5, 2 * 8 + 1, ids);
  // 2 nodes x 2 NICs x 50 GB/s, halved by the 2:1 oversubscription.
  EXPECT_DOUBLE_EQ(net.links()[ids[1]].bandwidth, 100e9);
  EXPECT_EQ(net.links()[ids[1]].kind, LinkKind::kFabric);
  EXPECT_EQ(net.links()[ids[0]].kind, LinkKind::kNic);
  // 4 nodes x (8 ports + 2 NICs) + 2 leaves, two entries each.
  EXPECT_EQ(net.links().size(), 2u * (4 * 10 + 2));
}

TEST(Network, RailOptimizedSameRailSameUnitStaysOnTheLeaf) {
  Network net(preset("dgx-h100-superpod"));
  // GPU 3 of node 0 and GPU 3 of node 5: rail 3 of unit 0.
  EXPECT_EQ(route_names(net, 3, 5 * 8 + 3), (Names{"n0.nic3.up", "n5.nic3.down"}));
  // Another rail of the same unit goes through the spine.
  EXPECT_EQ(route_names(net, 3, 5 * 8 + 4),
            (Names{"n0.nic3.up", "su0.rail3.up", "su0.rail4.down", "n5.nic4.down"}));
  // Same rail, another unit (node 40 is in unit 1).
  double lat = 0;
  EXPECT_EQ(route_names(net, 3, 40 * 8 + 3, &lat),
            (Names{"n0.nic3.up", "su0.rail3.up", "su1.rail3.down", "n40.nic3.down"}));
  EXPECT_NEAR(lat, 2e-6 + 2 * 0.13e-6, 1e-15);
  std::vector<int> ids;
  net.route(3, 40 * 8 + 3, ids);
  EXPECT_DOUBLE_EQ(net.links()[ids[1]].bandwidth, 32 * 50e9);
}

TEST(Network, PcieRoutesCrossUplinksBetweenSwitches) {
  Network net(preset("pcie-a100x8"));
  double lat = 0;
  EXPECT_EQ(route_names(net, 0, 1, &lat), (Names{"n0.g0.pcie.up", "n0.g1.pcie.down"}));
  EXPECT_DOUBLE_EQ(lat, 2e-6);
  EXPECT_EQ(route_names(net, 0, 7, &lat),
            (Names{"n0.g0.pcie.up", "n0.psw0.up", "n0.psw3.down", "n0.g7.pcie.down"}));
  EXPECT_DOUBLE_EQ(lat, 4e-6);
  std::vector<int> ids;
  net.route(0, 7, ids);
  for (int id : ids) {
    EXPECT_EQ(net.links()[id].kind, LinkKind::kPcie);
    EXPECT_DOUBLE_EQ(net.links()[id].bandwidth, 32e9);
  }
}

TEST(Network, PcieNodesReachTheirNicOverPcie) {
  Network net(preset("pcie-a100x8", 2));
  // GPU 2 sits on switch 1, its NIC 0 on switch 0; GPU 6 of node 1 on switch 3, its NIC 1 on 2.
  EXPECT_EQ(route_names(net, 2, 8 + 6),
            (Names{"n0.g2.pcie.up", "n0.psw1.up", "n0.psw0.down", "n0.nic0.up", "n1.nic1.down",
                   "n1.psw2.up", "n1.psw3.down", "n1.g6.pcie.down"}));
  // GPUs 0 and 4 share a switch with their NICs.
  EXPECT_EQ(route_names(net, 0, 8 + 4),
            (Names{"n0.g0.pcie.up", "n0.nic0.up", "n1.nic1.down", "n1.g4.pcie.down"}));
}

// Four GPUs, NVLinks between some pairs only, PCIe for the rest.
const char* const kMesh = R"(gpu: a100-sxm4-80gb
nodes: 1
node:
  gpus: 4
  intra:
    kind: nvlink_mesh
    bandwidth: 25 GB/s
    latency: 1 us
    links: [[0, 1, 4], [2, 3, 4], [0, 2], [3, 1]]
  pcie: {gpu_link_bandwidth: 32 GB/s, switch_uplink_bandwidth: 32 GB/s, latency: 0.5 us,
         switches: [[0, 1], [2, 3]]}
)";

TEST(Network, NvLinkMeshUsesDirectLinksAndFallsBackToPcie) {
  Network net(parse(kMesh));
  double lat = 0;
  EXPECT_EQ(route_names(net, 0, 1, &lat), (Names{"n0.g0-g1.nvl.up"}));
  EXPECT_DOUBLE_EQ(lat, 1e-6);
  EXPECT_EQ(route_names(net, 1, 0), (Names{"n0.g0-g1.nvl.down"}));
  EXPECT_EQ(route_names(net, 1, 3), (Names{"n0.g1-g3.nvl.up"}));
  EXPECT_EQ(route_names(net, 3, 1), (Names{"n0.g1-g3.nvl.down"}));
  std::vector<int> ids;
  net.route(2, 3, ids);
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_DOUBLE_EQ(net.links()[ids[0]].bandwidth, 100e9);  // 4 links x 25 GB/s
  // GPUs 0 and 3 have no NVLink: PCIe through the CPU.
  EXPECT_EQ(route_names(net, 0, 3, &lat),
            (Names{"n0.g0.pcie.up", "n0.psw0.up", "n0.psw1.down", "n0.g3.pcie.down"}));
  EXPECT_DOUBLE_EQ(lat, 2e-6);
  EXPECT_EQ(route_names(net, 1, 2),
            (Names{"n0.g1.pcie.up", "n0.psw0.up", "n0.psw1.down", "n0.g2.pcie.down"}));
}

// The names of the links from `gpu` to waypoint `w` (to_waypoint) or from `w` to `gpu`.
Names half_names(const Network& net, int gpu, Network::Waypoint w, bool to_waypoint) {
  std::vector<int> ids;
  if (to_waypoint) {
    net.route_to(gpu, w, ids);
  } else {
    net.route_from(w, gpu, ids);
  }
  Names names;
  for (int id : ids) names.push_back(net.links()[id].name);
  return names;
}

TEST(Network, RoutesSplitWhereTheyStopDependingOnTheSource) {
  using W = Network::Waypoint;
  Network pod(preset("dgx-h100-superpod"));
  EXPECT_EQ(pod.waypoint(0, 5), W::kNvSwitch);
  EXPECT_EQ(half_names(pod, 0, W::kNvSwitch, true), (Names{"n0.g0.nvl.up"}));
  EXPECT_EQ(half_names(pod, 5, W::kNvSwitch, false), (Names{"n0.g5.nvl.down"}));
  EXPECT_EQ(pod.waypoint(3, 5 * 8 + 3), W::kFabricLeaf);    // same rail, same unit
  EXPECT_EQ(pod.waypoint(3, 5 * 8 + 4), W::kFabricSpine);   // another rail
  EXPECT_EQ(pod.waypoint(3, 40 * 8 + 3), W::kFabricSpine);  // another unit
  EXPECT_EQ(half_names(pod, 3, W::kFabricSpine, true), (Names{"n0.nic3.up", "su0.rail3.up"}));
  EXPECT_EQ(half_names(pod, 40 * 8 + 3, W::kFabricSpine, false),
            (Names{"su1.rail3.down", "n40.nic3.down"}));

  Network pcie(preset("pcie-a100x8", 2));
  EXPECT_EQ(pcie.waypoint(0, 1), W::kPcieSwitch);
  EXPECT_EQ(pcie.waypoint(0, 7), W::kPcieRoot);
  EXPECT_EQ(half_names(pcie, 7, W::kPcieRoot, false), (Names{"n0.psw3.down", "n0.g7.pcie.down"}));
  // Across nodes the NIC is reached over PCIe on both sides.
  EXPECT_EQ(half_names(pcie, 2, W::kFabricLeaf, true),
            (Names{"n0.g2.pcie.up", "n0.psw1.up", "n0.psw0.down", "n0.nic0.up"}));
  EXPECT_EQ(half_names(pcie, 8 + 6, W::kFabricLeaf, false),
            (Names{"n1.nic1.down", "n1.psw2.up", "n1.psw3.down", "n1.g6.pcie.down"}));
}

TEST(Network, ADirectNvLinkHasNoWaypoint) {
  Network net(parse(kMesh));
  EXPECT_EQ(net.waypoint(0, 1), Network::Waypoint::kNone);
  EXPECT_EQ(net.waypoint(0, 3), Network::Waypoint::kPcieRoot);  // no NVLink: PCIe
}

TEST(Network, SuperpodOf16kGpus) {
  Topology big = preset("dgx-h100-superpod", 2048);
  ASSERT_EQ(big.num_gpus(), 16384);
  Network net(big);
  // Per node 8 NVSwitch ports, 8 PCIe links and 8 PCIe switches, 8 NICs and 8 host links; 64
  // units x 8 rails of leaf uplinks; two entries each.
  EXPECT_EQ(net.links().size(), 2u * (2048 * 40 + 64 * 8));

  // A million routes: cheap enough not to matter (no timing assertion, just exercise it).
  std::vector<int> out;
  out.reserve(8);
  uint64_t state = 12345;
  auto next = [&state] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state >> 33) % 16384);
  };
  size_t longest = 0;
  double total = 0;
  for (int i = 0; i < 1000000; ++i) {
    out.clear();
    total += net.route(next(), next(), out);
    longest = std::max(longest, out.size());
  }
  EXPECT_EQ(longest, 4u);
  EXPECT_GT(total, 0);
}

// A copy to host memory crosses the GPU's PCIe link (which its NIC traffic crosses too) when
// node.pcie describes it, then the GPU's own host link; a copy back, the same links down.
TEST(Network, HostCopiesCrossTheGpusPcieLinkThenItsHostLink) {
  const Network dgx(preset("dgx-a100x4"), /*host_copies=*/true);
  std::vector<int> ids;
  EXPECT_EQ(dgx.host_route(11, true, ids), 0);  // the NIC's latency covers the PCIe hop
  std::vector<std::string> names;
  for (int id : ids) names.push_back(dgx.links()[id].name);
  EXPECT_EQ(names, (std::vector<std::string>{"n1.g3.pcie.up", "n1.g3.host.up"}));
  EXPECT_EQ(dgx.links()[ids[1]].kind, LinkKind::kHost);
  EXPECT_EQ(dgx.links()[ids[1]].bandwidth, 16e9);  // node.host.link_bandwidth
  ids.clear();
  dgx.host_route(11, false, ids);
  names.clear();
  for (int id : ids) names.push_back(dgx.links()[id].name);
  EXPECT_EQ(names, (std::vector<std::string>{"n1.g3.host.down", "n1.g3.pcie.down"}));
  // The same GPU's traffic to another node leaves by the same PCIe link...
  EXPECT_EQ(route_names(dgx, 11, 19),
            (Names{"n1.g3.pcie.up", "n1.nic3.up", "n2.nic3.down", "n2.g3.pcie.down"}));
  // ... which, without copies, carries only what the NIC carries, and is left out: it is
  // faster than the NIC and has no latency of its own (the preset's NIC latency includes it).
  const Network plain(preset("dgx-a100x4"));
  EXPECT_EQ(route_names(plain, 11, 19), (Names{"n1.nic3.up", "n2.nic3.down"}));
  // A PCIe link slower than its NIC, or with a latency, stays.
  Topology slow = preset("dgx-a100x4");
  slow.intra.pcie.gpu_link_bandwidth = 20e9;
  EXPECT_EQ(route_names(Network(slow), 11, 19).front(), "n1.g3.pcie.up");
  Topology far = preset("dgx-a100x4");
  far.intra.pcie.latency = 1e-7;
  EXPECT_EQ(route_names(Network(far), 11, 19).front(), "n1.g3.pcie.up");

  // NVLink-C2C (no node.pcie): the host link alone.
  const Network c2c(preset("gb200-nvl72-whatif", 1));
  ids.clear();
  c2c.host_route(5, true, ids);
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_EQ(c2c.links()[ids[0]].name, "n0.g5.host.up");
  // A topology without node.host has no host links.
  const Network none(preset("h200x8"));
  for (const NetLink& l : none.links()) EXPECT_NE(l.kind, LinkKind::kHost) << l.name;
}

}  // namespace
}  // namespace nnsim
