// The links of a topology and the route between any two GPUs. The SimGrid platform and every
// analytical estimate use these same links and routes, so both price a transfer identically.
#pragma once

#include <string>
#include <vector>

#include "core/topology.h"

namespace nnsim {

// kHost: a GPU's share of the way on from its PCIe link to host memory (node.host.link_bandwidth).
enum class LinkKind { kNvLink, kPcie, kNic, kFabric, kHost };

// One direction of a physical link (every physical link is full duplex: two NetLinks).
struct NetLink {
  std::string name;  // e.g. "n3.g5.nvl.up"
  LinkKind kind = LinkKind::kNvLink;
  double bandwidth = 0;  // bytes/s
  double latency = 0;    // seconds
};

class Network {
 public:
  // `host_copies`: the traffic will include copies to host memory (offloading). Without them,
  // behind an NVSwitch, a GPU's PCIe link carries its NIC's traffic alone, a part of what the
  // NIC carries; when it is at least as fast as the NIC and adds no latency it can never set a
  // pace, and routes to the NIC leave it out (every link of a route costs SimGrid's solver
  // time: 3.6 s instead of 2.1 s to simulate Llama 3 70B on 64 H100s, docs/PERFORMANCE.md).
  explicit Network(const Topology& topo, bool host_copies = false);

  const Topology& topology() const { return topo_; }
  const std::vector<NetLink>& links() const { return links_; }

  // Appends the links a transfer from `src` to `dst` (global GPU indices) crosses, in order, and
  // returns the route latency (sum of the link latencies). src == dst gives an empty route.
  double route(int src, int dst, std::vector<int>& out) const;
  // A point where a route splits into a part that depends on its source alone and a part that
  // depends on its destination alone: the NVSwitch, a PCIe switch or the PCIe root, the
  // fabric's leaf or its spine. A direct NVLink of a mesh has none. The simulator sums the
  // flows of one parallel task per (source, waypoint) and (waypoint, destination): every link
  // carries the same bytes in fewer route lookups (sim/collective_runner.h).
  // kHostMemory is no GPU-to-GPU route's: it is where copies between a GPU and its node's
  // memory end (offloading), reached over the GPU's PCIe link when node.pcie describes one
  // (which its NIC traffic crosses too) and then its host link.
  enum class Waypoint {
    kNone = -1,
    kNvSwitch,
    kPcieSwitch,
    kPcieRoot,
    kFabricLeaf,
    kFabricSpine,
    kHostMemory
  };
  static constexpr int kWaypoints = 6;
  Waypoint waypoint(int src, int dst) const;
  // The links from `gpu` to waypoint `w` and from `w` to `gpu`: route(src, dst) is exactly
  // route_to(src, waypoint(src, dst)) followed by route_from(waypoint(src, dst), dst).
  void route_to(int gpu, Waypoint w, std::vector<int>& out) const;
  void route_from(Waypoint w, int gpu, std::vector<int>& out) const;
  // The links a copy between `gpu` and its node's memory crosses (the topology must describe
  // node.host), appended in order; returns their latency.
  double host_route(int gpu, bool to_host, std::vector<int>& out) const;
  // True when both GPUs are in the same node.
  bool same_node(int a, int b) const { return topo_.node_of(a) == topo_.node_of(b); }

 private:
  int add_duplex(const std::string& name, LinkKind kind, double bandwidth, double latency);
  void gpu_to_nic(int node, int local, int nic, bool outbound, std::vector<int>& out) const;
  size_t uplink_index(int node, int nic) const;  // into fabric_uplink_

  Topology topo_;
  std::vector<NetLink> links_;  // a duplex link is two consecutive entries: up (out), down (in)
  // Index of the first (up) entry of each duplex link, per node and per local element.
  std::vector<int> nvswitch_port_;  // [node * gpus_per_node + local]
  std::vector<int> mesh_link_;      // [node * g * g + a * g + b] -> duplex id or -1
  std::vector<int> pcie_gpu_;       // [node * gpus_per_node + local]
  std::vector<int> pcie_uplink_;    // [node * switches + s]
  std::vector<int> nic_;            // [node * nics + n]
  std::vector<int> fabric_uplink_;  // [group * rails + rail] (rails = 1 for a fat tree)
  std::vector<int> host_link_;      // [node * gpus_per_node + local], when node.host is described
  std::vector<int> local_switch_;   // local GPU -> PCIe switch
  std::vector<int> local_nic_;      // local GPU -> the NIC serving it (Topology::nic_of)
  std::vector<bool> pcie_to_nic_;   // local GPU -> whether its way to its NIC lists its PCIe link
};

}  // namespace nnsim
