// nnsim topology: a cluster as nnsim reads it, --nodes and --topo-set applied, in plain words
// (what a what-if changed, checked before a search or simulation), and written back as YAML
// with -o to keep it.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace nnsim::tool {

struct TopologyArgs {
  std::string topo;
  int nodes = 0;
  std::vector<std::string> topo_set;
  std::string output;  // the resolved topology as YAML
};

CLI::App* add_topology_command(CLI::App& app, TopologyArgs& a);
int run_topology(const TopologyArgs& a);

}  // namespace nnsim::tool
