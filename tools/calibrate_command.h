// nnsim calibrate (fit the cost model to nnexec's files) and nnsim calibration export (the
// built-in model as a calibration file).
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace nnsim::tool {

struct CalibrateArgs {
  std::vector<std::string> inputs;  // at most one nnexec bench file, any number of run files
  std::string gpu;
  std::string output;
  std::string topo;  // the machines' topology: the network's bandwidth (run files)
  int nodes = 0;
};

struct ExportArgs {
  std::vector<std::string> gpus;  // catalog names
  std::string attention;          // flash2 or fused3
  std::string framework;          // whose defaults (excludes `attention`)
  std::string output;
};

CLI::App* add_calibrate_command(CLI::App& app, CalibrateArgs& a);
int run_calibrate(const CalibrateArgs& a);
// `nnsim calibration export`: returns the export subcommand.
CLI::App* add_calibration_command(CLI::App& app, ExportArgs& a);
int run_calibration_export(const ExportArgs& a);

}  // namespace nnsim::tool
