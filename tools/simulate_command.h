// nnsim simulate (and nnsim --topo T plan.json): one plan, one iteration, the report.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "tools/driver.h"

namespace nnsim::tool {

struct SimulateArgs {
  std::string topo;
  std::string plan;
  int nodes = 0;
  std::vector<std::string> topo_set;  // topology fields replaced: "node.nics.bandwidth=800Gb/s"
  std::string json;
  std::string trace;
  std::string hdf5;
  bool trace_per_gpu = false;
  std::string fidelity = "symmetric";
  bool allow_oom = false;
  bool no_fold = false;
  std::string calib;
  std::string train_tokens;  // e.g. "15T": also report the time to train that many tokens
  FailureArgs failures;      // and with hardware failures, checkpoints and restarts
  double sensitivity = 0;    // > 0: simulate again with each resource this many times as fast
};

// The simulate options on `app` (the top level, where they are optional, or the subcommand).
void add_simulate_options(CLI::App* app, SimulateArgs& a, bool required);
int run_simulate(const SimulateArgs& a);

}  // namespace nnsim::tool
