#include "tools/topology_command.h"

#include <cstdio>

#include <fmt/format.h>

#include "core/topology_writer.h"
#include "core/units.h"
#include "tools/cli_checks.h"
#include "tools/driver.h"

namespace nnsim::tool {
namespace {

const char* intra_name(IntraNodeKind k) {
  switch (k) {
    case IntraNodeKind::kNvSwitch:
      return "NVSwitch";
    case IntraNodeKind::kNvLinkMesh:
      return "NVLink mesh";
    case IntraNodeKind::kPcie:
      return "PCIe";
  }
  return "";
}

const char* fabric_name(FabricKind k) {
  switch (k) {
    case FabricKind::kSingleSwitch:
      return "one switch";
    case FabricKind::kFatTree:
      return "fat tree";
    case FabricKind::kRailOptimized:
      return "rail-optimized";
  }
  return "";
}

void print_topology(const Topology& t) {
  std::printf("%s: %d node%s x %d GPUs = %d GPUs\n", t.name.c_str(), t.nodes,
              t.nodes == 1 ? "" : "s", t.gpus_per_node, t.num_gpus());
  const GpuSpec& g = t.gpu;
  std::string peaks;
  for (const auto& [precision, flops] : g.dense_flops) {
    peaks += fmt::format("{}{} {}", peaks.empty() ? "" : ", ", to_string(precision),
                         format_flops(flops));
  }
  std::printf("  GPU        %s: %s; %s of memory at %s; %d SMs\n", g.name.c_str(), peaks.c_str(),
              format_bytes(g.hbm_bytes).c_str(), format_rate(g.hbm_bandwidth).c_str(), g.sms);
  if (g.base != g.name) {
    std::printf("             hypothetical: %s's measured efficiencies\n", g.base.c_str());
  }
  const IntraNodeSpec& in = t.intra;
  if (in.kind == IntraNodeKind::kNvLinkMesh) {
    std::printf("  in a node  NVLink mesh of %zu links, %s per link per direction, %s\n",
                in.mesh.size(), format_rate(in.bandwidth).c_str(),
                format_seconds(in.latency).c_str());
  } else if (in.kind == IntraNodeKind::kPcie) {
    std::printf("  in a node  PCIe, %s per GPU link, %s per switch uplink, %s per hop\n",
                format_rate(in.pcie.gpu_link_bandwidth).c_str(),
                format_rate(in.pcie.switch_uplink_bandwidth).c_str(),
                format_seconds(in.pcie.latency).c_str());
  } else {
    std::printf("  in a node  %s, %s per GPU per direction, %s\n", intra_name(in.kind),
                format_rate(in.bandwidth).c_str(), format_seconds(in.latency).c_str());
    if (in.has_pcie) {
      std::printf("  PCIe       %s per GPU link (to its NIC and the host), %zu switches\n",
                  format_rate(in.pcie.gpu_link_bandwidth).c_str(), in.pcie.switches.size());
    }
  }
  if (t.nics.empty()) {
    std::printf("  NICs       none\n");
  } else {
    double total = 0;
    for (const NicSpec& n : t.nics) total += n.bandwidth;
    std::printf("  NICs       %zu a node, %s each per direction (%s a node), %s\n", t.nics.size(),
                format_rate(t.nics.front().bandwidth).c_str(), format_rate(total).c_str(),
                format_seconds(t.nics.front().latency).c_str());
  }
  if (t.has_host) {
    std::printf("  host       %s of memory at %s a node, %s per GPU per direction to it\n",
                format_bytes(t.host.memory).c_str(), format_rate(t.host.memory_bandwidth).c_str(),
                format_rate(t.host.link_bandwidth).c_str());
  }
  const FabricSpec& f = t.fabric;
  if (f.kind == FabricKind::kSingleSwitch) {
    std::printf("  fabric     %s\n", fabric_name(f.kind));
  } else {
    std::printf("  fabric     %s, %d nodes a group, oversubscription %g, %s per extra switch\n",
                fabric_name(f.kind), t.group_size(), f.oversubscription,
                format_seconds(f.switch_latency).c_str());
  }
}

}  // namespace

CLI::App* add_topology_command(CLI::App& app, TopologyArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "topology",
      "show a cluster as nnsim reads it (--nodes and --topo-set applied); -o writes it");
  cmd->add_option("--topo", a.topo, "topology YAML file or preset name")->required();
  cmd->add_option("--nodes", a.nodes, "resize the topology to this many nodes")->check(at_least(1));
  add_topo_set_option(cmd, a.topo_set);
  cmd->add_option("-o,--output", a.output,
                  "write it as YAML (every figure in base units), to simulate or plan on it");
  return cmd;
}

int run_topology(const TopologyArgs& a) {
  Expected<Topology> t = load_topology_sized(a.topo, a.nodes, a.topo_set);
  if (!t) return fail(t.error().message());
  print_topology(*t);
  note_hypothetical_gpu(t->gpu);
  if (!a.output.empty()) {
    Expected<std::string> yaml = topology_to_yaml(*t);
    if (!yaml) return fail(yaml.error().message());
    std::string error;
    if (!write_file(a.output, *yaml, &error)) return fail(error);
    std::printf("wrote %s\n", a.output.c_str());
  }
  return 0;
}

}  // namespace nnsim::tool
