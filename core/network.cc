#include "core/network.h"

#include <algorithm>
#include <cassert>
#include <cstddef>

#include <fmt/format.h>

namespace nnsim {

Network::Network(const Topology& topo, bool host_copies) : topo_(topo) {
  // The topology is assumed to pass validate_topology (every parser and resize_topology check it).
  const int nodes = topo_.nodes;
  const int g = topo_.gpus_per_node;
  const int nics = static_cast<int>(topo_.nics.size());
  const IntraNodeSpec& in = topo_.intra;
  const int switches = in.has_pcie ? static_cast<int>(in.pcie.switches.size()) : 0;
  const FabricSpec& fabric = topo_.fabric;

  local_switch_.assign(g, -1);
  for (int s = 0; s < switches; ++s) {
    for (int gpu : in.pcie.switches[s]) {
      if (gpu >= 0 && gpu < g && local_switch_[gpu] < 0) local_switch_[gpu] = s;
    }
  }
  local_nic_.assign(g, -1);
  for (int j = 0; j < g; ++j) local_nic_[j] = topo_.nic_of(j);
  // Behind an NVSwitch no GPU-to-GPU traffic crosses PCIe either.
  pcie_to_nic_.assign(g, in.has_pcie);
  const bool nic_only = in.kind == IntraNodeKind::kNvSwitch && !host_copies;
  for (int j = 0; j < g && in.has_pcie && nic_only; ++j) {
    const bool idle = local_nic_[j] >= 0 && in.pcie.latency == 0 &&
                      in.pcie.gpu_link_bandwidth >= topo_.nics[local_nic_[j]].bandwidth;
    pcie_to_nic_[j] = !idle;
  }

  int groups = 0;
  int rails = 0;
  if (fabric.kind != FabricKind::kSingleSwitch && nics > 0 && fabric.nodes_per_group > 0) {
    groups = (nodes + fabric.nodes_per_group - 1) / fabric.nodes_per_group;
    rails = fabric.kind == FabricKind::kRailOptimized ? nics : 1;
  }

  // Size everything up front: a 16,384-GPU cluster has tens of thousands of links.
  size_t per_node = 0;
  if (in.kind == IntraNodeKind::kNvSwitch) per_node += g;
  if (in.kind == IntraNodeKind::kNvLinkMesh) per_node += in.mesh.size();
  if (in.has_pcie) per_node += g + switches;
  per_node += nics;
  if (topo_.has_host) per_node += g;
  links_.reserve(2 * (per_node * nodes + static_cast<size_t>(groups) * rails));
  if (in.kind == IntraNodeKind::kNvSwitch) nvswitch_port_.reserve(static_cast<size_t>(nodes) * g);
  if (in.kind == IntraNodeKind::kNvLinkMesh) {
    mesh_link_.assign(static_cast<size_t>(nodes) * g * g, -1);
  }
  if (in.has_pcie) {
    pcie_gpu_.reserve(static_cast<size_t>(nodes) * g);
    pcie_uplink_.reserve(static_cast<size_t>(nodes) * switches);
  }
  nic_.reserve(static_cast<size_t>(nodes) * nics);
  if (topo_.has_host) host_link_.reserve(static_cast<size_t>(nodes) * g);

  for (int node = 0; node < nodes; ++node) {
    if (in.kind == IntraNodeKind::kNvSwitch) {
      // Two ports per transfer: half the GPU-to-GPU latency on each.
      for (int j = 0; j < g; ++j) {
        nvswitch_port_.push_back(add_duplex(fmt::format("n{}.g{}.nvl", node, j), LinkKind::kNvLink,
                                            in.bandwidth, in.latency / 2));
      }
    } else if (in.kind == IntraNodeKind::kNvLinkMesh) {
      const size_t base = static_cast<size_t>(node) * g * g;
      for (const MeshLink& m : in.mesh) {
        int lo = std::min(m.a, m.b);
        int hi = std::max(m.a, m.b);
        int id = add_duplex(fmt::format("n{}.g{}-g{}.nvl", node, lo, hi), LinkKind::kNvLink,
                            m.links * in.bandwidth, in.latency);
        mesh_link_[base + static_cast<size_t>(lo) * g + hi] = id;
        mesh_link_[base + static_cast<size_t>(hi) * g + lo] = id;
      }
    }
    if (in.has_pcie) {
      const PcieSpec& p = in.pcie;
      for (int j = 0; j < g; ++j) {
        pcie_gpu_.push_back(add_duplex(fmt::format("n{}.g{}.pcie", node, j), LinkKind::kPcie,
                                       p.gpu_link_bandwidth, p.latency));
      }
      for (int s = 0; s < switches; ++s) {
        pcie_uplink_.push_back(add_duplex(fmt::format("n{}.psw{}", node, s), LinkKind::kPcie,
                                          p.switch_uplink_bandwidth, p.latency));
      }
    }
    for (int n = 0; n < nics; ++n) {
      const NicSpec& nic = topo_.nics[n];
      nic_.push_back(add_duplex(fmt::format("n{}.nic{}", node, n), LinkKind::kNic, nic.bandwidth,
                                nic.latency));
    }
    // The way on to host memory: link_bandwidth is a GPU's share of it while all copy, so
    // every GPU gets a link of its own at that bandwidth (its latency is counted in the PCIe
    // link's, or nowhere for NVLink-C2C).
    if (topo_.has_host) {
      for (int j = 0; j < g; ++j) {
        host_link_.push_back(add_duplex(fmt::format("n{}.g{}.host", node, j), LinkKind::kHost,
                                        topo_.host.link_bandwidth, 0));
      }
    }
  }

  if (groups > 0) {
    const double os = fabric.oversubscription;
    if (fabric.kind == FabricKind::kFatTree) {
      // A leaf's uplinks carry what its nodes' NICs can send, divided by the oversubscription.
      double node_bw = 0;
      for (const NicSpec& nic : topo_.nics) node_bw += nic.bandwidth;
      for (int grp = 0; grp < groups; ++grp) {
        fabric_uplink_.push_back(add_duplex(fmt::format("leaf{}", grp), LinkKind::kFabric,
                                            fabric.nodes_per_group * node_bw / os,
                                            fabric.switch_latency));
      }
    } else {
      // One leaf per (scalable unit, rail); its uplinks carry what the unit's NICs of that rail
      // can send, divided by the oversubscription.
      for (int grp = 0; grp < groups; ++grp) {
        for (int r = 0; r < rails; ++r) {
          fabric_uplink_.push_back(add_duplex(fmt::format("su{}.rail{}", grp, r), LinkKind::kFabric,
                                              fabric.nodes_per_group * topo_.nics[r].bandwidth / os,
                                              fabric.switch_latency));
        }
      }
    }
  }
}

int Network::add_duplex(const std::string& name, LinkKind kind, double bandwidth, double latency) {
  int id = static_cast<int>(links_.size());  // even: every link is added here, in pairs
  links_.push_back({name + ".up", kind, bandwidth, latency});
  links_.push_back({name + ".down", kind, bandwidth, latency});
  return id;
}

Network::Waypoint Network::waypoint(int src, int dst) const {
  const int g = topo_.gpus_per_node;
  const int ls = src % g;
  const int ld = dst % g;
  if (src / g == dst / g) {
    switch (topo_.intra.kind) {
      case IntraNodeKind::kNvSwitch:
        return Waypoint::kNvSwitch;
      case IntraNodeKind::kNvLinkMesh:
        if (mesh_link_[static_cast<size_t>(src / g) * g * g + static_cast<size_t>(ls) * g + ld] >=
            0) {
          return Waypoint::kNone;  // one direct NVLink
        }
        break;  // no NVLink between them: PCIe
      case IntraNodeKind::kPcie:
        break;
    }
    return local_switch_[ls] == local_switch_[ld] ? Waypoint::kPcieSwitch : Waypoint::kPcieRoot;
  }
  if (fabric_uplink_.empty()) return Waypoint::kFabricLeaf;
  const FabricSpec& f = topo_.fabric;
  const bool other_group = src / g / f.nodes_per_group != dst / g / f.nodes_per_group;
  // Rail-optimized: only the same rail of the same unit shares a leaf switch.
  const bool other_rail = f.kind == FabricKind::kRailOptimized && local_nic_[ls] != local_nic_[ld];
  return other_group || other_rail ? Waypoint::kFabricSpine : Waypoint::kFabricLeaf;
}

void Network::route_to(int gpu, Waypoint w, std::vector<int>& out) const {
  const int g = topo_.gpus_per_node;
  const int node = gpu / g;
  const int local = gpu % g;
  const size_t switch_base = static_cast<size_t>(node) * topo_.intra.pcie.switches.size();
  switch (w) {
    case Waypoint::kNone:
      return;
    case Waypoint::kHostMemory:
      assert(topo_.has_host);
      if (topo_.intra.has_pcie) out.push_back(pcie_gpu_[gpu]);
      out.push_back(host_link_[gpu]);
      return;
    case Waypoint::kNvSwitch:
      out.push_back(nvswitch_port_[gpu]);
      return;
    case Waypoint::kPcieSwitch:
      out.push_back(pcie_gpu_[gpu]);
      return;
    case Waypoint::kPcieRoot:
      out.push_back(pcie_gpu_[gpu]);
      out.push_back(pcie_uplink_[switch_base + local_switch_[local]]);
      return;
    case Waypoint::kFabricLeaf:
    case Waypoint::kFabricSpine: {
      const int nic = local_nic_[local];
      if (topo_.intra.has_pcie) gpu_to_nic(node, local, nic, true, out);
      out.push_back(nic_[static_cast<size_t>(node) * topo_.nics.size() + nic]);
      if (w == Waypoint::kFabricSpine) out.push_back(fabric_uplink_[uplink_index(node, nic)]);
      return;
    }
  }
}

void Network::route_from(Waypoint w, int gpu, std::vector<int>& out) const {
  // The way in is the way out backwards, every link crossed in its other direction (the two
  // entries of a duplex link are an even index and the next).
  const size_t start = out.size();
  route_to(gpu, w, out);
  std::reverse(out.begin() + static_cast<std::ptrdiff_t>(start), out.end());
  for (size_t i = start; i < out.size(); ++i) out[i] ^= 1;
}

double Network::host_route(int gpu, bool to_host, std::vector<int>& out) const {
  const size_t start = out.size();
  if (to_host) {
    route_to(gpu, Waypoint::kHostMemory, out);
  } else {
    route_from(Waypoint::kHostMemory, gpu, out);
  }
  double latency = 0;
  for (size_t i = start; i < out.size(); ++i) latency += links_[out[i]].latency;
  return latency;
}

size_t Network::uplink_index(int node, int nic) const {
  const FabricSpec& f = topo_.fabric;
  const size_t group = static_cast<size_t>(node / f.nodes_per_group);
  if (f.kind == FabricKind::kFatTree) return group;
  return group * topo_.nics.size() + nic;
}

void Network::gpu_to_nic(int node, int local, int nic, bool outbound, std::vector<int>& out) const {
  const int g = topo_.gpus_per_node;
  const int switches = static_cast<int>(topo_.intra.pcie.switches.size());
  const size_t switch_base = static_cast<size_t>(node) * switches;
  const int gpu_link = pcie_gpu_[static_cast<size_t>(node) * g + local];
  const int sg = local_switch_[local];
  const int sn = topo_.intra.pcie.nic_switch[nic];
  const bool listed = pcie_to_nic_[local];
  if (outbound) {
    if (listed) out.push_back(gpu_link);
    if (sg != sn) {
      out.push_back(pcie_uplink_[switch_base + sg]);
      out.push_back(pcie_uplink_[switch_base + sn] + 1);
    }
  } else {
    if (sg != sn) {
      out.push_back(pcie_uplink_[switch_base + sn]);
      out.push_back(pcie_uplink_[switch_base + sg] + 1);
    }
    if (listed) out.push_back(gpu_link + 1);
  }
}

double Network::route(int src, int dst, std::vector<int>& out) const {
  assert(src >= 0 && src < topo_.num_gpus() && dst >= 0 && dst < topo_.num_gpus());
  if (src == dst) return 0;
  const size_t start = out.size();
  const Waypoint w = waypoint(src, dst);
  if (w == Waypoint::kNone) {
    // A direct NVLink of a mesh: the up entry carries lower -> higher index.
    const int g = topo_.gpus_per_node;
    const int id = mesh_link_[static_cast<size_t>(src / g) * g * g +
                              static_cast<size_t>(src % g) * g + dst % g];
    out.push_back(src % g < dst % g ? id : id + 1);
  } else {
    route_to(src, w, out);
    route_from(w, dst, out);
  }
  double latency = 0;
  for (size_t i = start; i < out.size(); ++i) latency += links_[out[i]].latency;
  return latency;
}

}  // namespace nnsim
