// nnsim schedule: rewrite a plan's pipeline block orders (a generator, or Tessel's search).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace nnsim::tool {

struct ScheduleArgs {
  std::string plan;
  std::string topo;  // default: the topology the plan names
  int nodes = 0;
  std::string generator;
  bool search = false;  // Tessel's repetend search instead of a generator
  std::string memory_limit;
  std::string output;
  std::string calib;
};

CLI::App* add_schedule_command(CLI::App& app, ScheduleArgs& a);
int run_schedule(const ScheduleArgs& a);

}  // namespace nnsim::tool
