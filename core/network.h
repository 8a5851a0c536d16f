// The links of a topology and the route between any two GPUs. The SimGrid platform and every
// analytical estimate use these same links and routes, so both price a transfer identically.
#pragma once

#include <string>
#include <vector>

#include "core/topology.h"

namespace nnsim {

enum class LinkKind { kNvLink, kPcie, kNic, kFabric };

// One direction of a physical link (every physical link is full duplex: two NetLinks).
struct NetLink {
  std::string name;  // e.g. "n3.g5.nvl.up"
  LinkKind kind = LinkKind::kNvLink;
  double bandwidth = 0;  // bytes/s
  double latency = 0;    // seconds
};

class Network {
 public:
  explicit Network(const Topology& topo);

  const Topology& topology() const { return topo_; }
  const std::vector<NetLink>& links() const { return links_; }

  // Appends the links a transfer from `src` to `dst` (global GPU indices) crosses, in order, and
  // returns the route latency (sum of the link latencies). src == dst gives an empty route.
  double route(int src, int dst, std::vector<int>& out) const;
  // True when both GPUs are in the same node.
  bool same_node(int a, int b) const { return topo_.node_of(a) == topo_.node_of(b); }

 private:
  int add_duplex(const std::string& name, LinkKind kind, double bandwidth, double latency);
  void intra_route(int node, int a, int b, std::vector<int>& out) const;
  void gpu_to_nic(int node, int local, int nic, bool outbound, std::vector<int>& out) const;

  Topology topo_;
  std::vector<NetLink> links_;  // a duplex link is two consecutive entries: up (out), down (in)
  // Index of the first (up) entry of each duplex link, per node and per local element.
  std::vector<int> nvswitch_port_;  // [node * gpus_per_node + local]
  std::vector<int> mesh_link_;      // [node * g * g + a * g + b] -> duplex id or -1
  std::vector<int> pcie_gpu_;       // [node * gpus_per_node + local]
  std::vector<int> pcie_uplink_;    // [node * switches + s]
  std::vector<int> nic_;            // [node * nics + n]
  std::vector<int> fabric_uplink_;  // [group * rails + rail] (rails = 1 for a fat tree)
  std::vector<int> local_switch_;   // local GPU -> PCIe switch
  std::vector<int> local_nic_;      // local GPU -> the NIC serving it (Topology::nic_of)
};

}  // namespace nnsim
