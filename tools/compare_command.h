// nnsim compare: a run file (nnexec run) against the simulator.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace nnsim::tool {

struct CompareArgs {
  std::string run;
  std::string topo;
  int nodes = 0;
  std::string plan;
  std::string calib;
  std::string json;
};

CLI::App* add_compare_command(CLI::App& app, CompareArgs& a);
int run_compare(const CompareArgs& a);

}  // namespace nnsim::tool
