#include "core/topology_writer.h"

#include <map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "core/gpu.h"
#include "core/precision.h"

namespace nnsim {
namespace {

// The shortest text that reads back as the same double (base units, no unit suffix).
std::string number(double v) {
  return fmt::format("{}", v);
}

YAML::Node flow(YAML::Node n) {
  n.SetStyle(YAML::EmitterStyle::Flow);
  return n;
}

YAML::Node int_list(const std::vector<int>& v) {
  YAML::Node n(YAML::NodeType::Sequence);
  for (int x : v) n.push_back(x);
  return flow(n);
}

// The field of a hypothetical GPU's peak in `p` ("bf16_flops").
std::string precision_key(Precision p) {
  return std::string(to_string(p)) + "_flops";
}

bool same_figures(const GpuSpec& a, const GpuSpec& b) {
  return a.dense_flops == b.dense_flops && a.hbm_bytes == b.hbm_bytes &&
         a.hbm_bandwidth == b.hbm_bandwidth && a.nvlink_bandwidth == b.nvlink_bandwidth &&
         a.sms == b.sms;
}

bool same_precisions(const GpuSpec& a, const GpuSpec& b) {
  if (a.dense_flops.size() != b.dense_flops.size()) return false;
  for (const auto& [p, v] : a.dense_flops) {
    if (!b.dense_flops.count(p)) return false;
  }
  return true;
}

// A catalog GPU by name, or a hypothetical one as a base with every figure given.
Expected<YAML::Node> gpu_node(const GpuSpec& gpu) {
  const std::vector<GpuSpec>& catalog = gpu_catalog();
  for (const GpuSpec& c : catalog) {
    if (c.name == gpu.name && same_figures(c, gpu)) return YAML::Node(gpu.name);
  }
  // Its own base (whose measured behaviour it keeps), or one with the same precisions (a
  // hypothetical GPU overrides figures, not which formats it has): the one its name starts
  // with when there is one ("h100-sxm5-80gb-custom").
  const GpuSpec* base = nullptr;
  for (const GpuSpec& c : catalog) {
    if (!same_precisions(c, gpu)) continue;
    if (c.name == gpu.base) {
      base = &c;
      break;
    }
    if (!base || gpu.name.rfind(c.name, 0) == 0) base = &c;
  }
  if (!base) {
    return Error(fmt::format(
        "GPU '{}' cannot be written as a topology's gpu: no catalog GPU has its precisions",
        gpu.name));
  }
  YAML::Node n;
  n["base"] = base->name;
  n["name"] = gpu.name;
  for (const auto& [p, flops] : gpu.dense_flops) n[precision_key(p)] = number(flops);
  n["hbm_bytes"] = number(gpu.hbm_bytes);
  n["hbm_bandwidth"] = number(gpu.hbm_bandwidth);
  n["nvlink_bandwidth"] = number(gpu.nvlink_bandwidth);
  n["sms"] = gpu.sms;
  return n;
}

YAML::Node intra_node(const IntraNodeSpec& in) {
  YAML::Node n;
  switch (in.kind) {
    case IntraNodeKind::kNvSwitch:
      n["kind"] = "nvswitch";
      break;
    case IntraNodeKind::kNvLinkMesh:
      n["kind"] = "nvlink_mesh";
      break;
    case IntraNodeKind::kPcie:
      n["kind"] = "pcie";
      return flow(n);  // node.pcie carries its figures
  }
  n["bandwidth"] = number(in.bandwidth);
  n["latency"] = number(in.latency);
  if (in.kind == IntraNodeKind::kNvLinkMesh) {
    YAML::Node links(YAML::NodeType::Sequence);
    for (const MeshLink& l : in.mesh) links.push_back(int_list({l.a, l.b, l.links}));
    n["links"] = links;
  }
  return in.kind == IntraNodeKind::kNvSwitch ? flow(n) : n;
}

YAML::Node pcie_node(const PcieSpec& p) {
  YAML::Node n;
  n["gpu_link_bandwidth"] = number(p.gpu_link_bandwidth);
  n["switch_uplink_bandwidth"] = number(p.switch_uplink_bandwidth);
  n["latency"] = number(p.latency);
  YAML::Node switches(YAML::NodeType::Sequence);
  for (const auto& s : p.switches) switches.push_back(int_list(s));
  n["switches"] = flow(switches);
  n["nic_switch"] = int_list(p.nic_switch);
  return n;
}

Expected<YAML::Node> nics_node(const std::vector<NicSpec>& nics) {
  YAML::Node n;
  n["count"] = static_cast<int>(nics.size());
  n["bandwidth"] = number(nics.front().bandwidth);
  n["latency"] = number(nics.front().latency);
  YAML::Node gpus(YAML::NodeType::Sequence);
  for (const NicSpec& nic : nics) {
    if (nic.bandwidth != nics.front().bandwidth || nic.latency != nics.front().latency) {
      return Error(
          "the node's NICs differ in bandwidth or latency, which node.nics cannot describe "
          "(one figure for every NIC)");
    }
    gpus.push_back(int_list(nic.gpus));
  }
  n["gpus"] = flow(gpus);
  return n;
}

YAML::Node fabric_node(const FabricSpec& f) {
  YAML::Node n;
  switch (f.kind) {
    case FabricKind::kSingleSwitch:
      n["kind"] = "single_switch";
      return flow(n);
    case FabricKind::kFatTree:
      n["kind"] = "fat_tree";
      break;
    case FabricKind::kRailOptimized:
      n["kind"] = "rail_optimized";
      break;
  }
  n["nodes_per_group"] = f.nodes_per_group;
  n["oversubscription"] = number(f.oversubscription);
  n["switch_latency"] = number(f.switch_latency);
  return flow(n);
}

}  // namespace

Expected<std::string> topology_to_yaml(const Topology& topo) {
  Expected<YAML::Node> gpu = gpu_node(topo.gpu);
  if (!gpu) return gpu.error().with_context(fmt::format("topology '{}'", topo.name));
  YAML::Node root;
  root["name"] = topo.name;
  if (!topo.description.empty()) root["description"] = topo.description;
  root["gpu"] = *gpu;
  root["nodes"] = topo.nodes;
  YAML::Node node;
  node["gpus"] = topo.gpus_per_node;
  node["intra"] = intra_node(topo.intra);
  if (topo.intra.has_pcie) node["pcie"] = pcie_node(topo.intra.pcie);
  if (topo.has_host) {
    YAML::Node host;
    host["memory"] = number(topo.host.memory);
    host["memory_bandwidth"] = number(topo.host.memory_bandwidth);
    host["link_bandwidth"] = number(topo.host.link_bandwidth);
    node["host"] = flow(host);
  }
  if (!topo.nics.empty()) {
    Expected<YAML::Node> nics = nics_node(topo.nics);
    if (!nics) return nics.error().with_context(fmt::format("topology '{}'", topo.name));
    node["nics"] = *nics;
  }
  root["node"] = node;
  root["fabric"] = fabric_node(topo.fabric);
  YAML::Emitter out;
  out << root;
  if (!out.good()) {
    return Error(
        fmt::format("topology '{}': writing YAML failed: {}", topo.name, out.GetLastError()));
  }
  return std::string(out.c_str()) + "\n";
}

}  // namespace nnsim
