// nnsim: the command-line driver. It parses arguments, calls the libraries and talks to the
// user; the libraries never print or exit. One file a command (tools/*_command.h).
//
//   nnsim --topo topologies/dgx-a100x4.yaml plan.json     (same as `nnsim simulate ...`)
//   nnsim plan --model gpt3-175b --topo dgx-a100x4 --tp 8 --pp 4 ... -o plan.json
//   nnsim sweep --model llama3-70b --topo dgx-h100-superpod --nodes 8,16,32 --global-batch 512
#include <cstdio>
#include <optional>

#include <CLI/CLI.hpp>

#include "tools/calibrate_command.h"
#include "tools/cli_checks.h"
#include "tools/compare_command.h"
#include "tools/driver.h"
#include "tools/plan_command.h"
#include "tools/presets_command.h"
#include "tools/schedule_command.h"
#include "tools/simulate_command.h"
#include "tools/sweep_command.h"
#include "tools/topology_command.h"
#include "tools/validate_command.h"

int main(int argc, char** argv) {
  using namespace nnsim::tool;
  CLI::App app{"nnsim: simulate distributed LLM training plans on GPU clusters"};
  app.set_version_flag("--version", "nnsim 0.1.0");
  SimulateArgs top;
  add_simulate_options(&app, top, false);

  SimulateArgs sim;
  CLI::App* simulate_cmd = app.add_subcommand("simulate", "simulate one training iteration");
  add_simulate_options(simulate_cmd, sim, true);
  PlanArgs plan;
  CLI::App* plan_cmd = add_plan_command(app, plan);
  ScheduleArgs schedule;
  CLI::App* schedule_cmd = add_schedule_command(app, schedule);
  ValidateArgs validate;
  CLI::App* validate_cmd = add_validate_command(app, validate);
  ExportArgs export_args;
  CLI::App* export_cmd = add_calibration_command(app, export_args);
  CalibrateArgs calibrate;
  CLI::App* calibrate_cmd = add_calibrate_command(app, calibrate);
  CompareArgs compare;
  CLI::App* compare_cmd = add_compare_command(app, compare);
  PresetsArgs presets;
  CLI::App* presets_cmd = add_presets_command(app, presets);
  SweepArgs sweep;
  CLI::App* sweep_cmd = add_sweep_command(app, sweep);
  TopologyArgs topology;
  CLI::App* topology_cmd = add_topology_command(app, topology);

  if (std::optional<int> done = nnsim::parse_command_line(app, argc, argv, "nnsim")) return *done;
  if (simulate_cmd->parsed()) return run_simulate(sim);
  if (plan_cmd->parsed()) return run_plan_command(plan, *plan_cmd);
  if (validate_cmd->parsed()) return run_validate(validate);
  if (schedule_cmd->parsed()) return run_schedule(schedule);
  if (calibrate_cmd->parsed()) return run_calibrate(calibrate);
  if (compare_cmd->parsed()) return run_compare(compare);
  if (presets_cmd->parsed()) return run_presets(presets);
  if (sweep_cmd->parsed()) return run_sweep(sweep, *sweep_cmd);
  if (topology_cmd->parsed()) return run_topology(topology);
  if (export_cmd->parsed()) return run_calibration_export(export_args);
  if (top.topo.empty() || top.plan.empty()) {
    std::fprintf(stderr, "%s", app.help().c_str());
    return fail("give a topology and a plan: nnsim --topo TOPOLOGY.yaml plan.json");
  }
  return run_simulate(top);
}
