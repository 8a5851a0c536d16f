// nnsim sweep: the plan search repeated over cluster sizes, global batches, one topology field
// and one model field (what-if studies), one row a point: the best plan, its simulated step,
// throughput per GPU against the group's first point, memory, with --train-tokens the time to
// train and with --sensitivity what each resource made faster would buy the best plan.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "tools/driver.h"
#include "tools/plan_command.h"

namespace nnsim::tool {

struct SweepArgs {
  PlanArgs plan;                                 // the model, topology and choices (plan's options)
  std::vector<int> nodes;                        // empty: the topology's own
  std::vector<int> global_batches;               // sequences per step
  std::vector<std::string> global_batch_tokens;  // or tokens per step ("4194304")
  std::string vary;                              // "FIELD=V1,V2,...": a topology field's values
  std::string vary_model;                        // the same for a model field
  std::string train_tokens;
  FailureArgs failures;    // hardware failures, checkpoints and restarts in the time to train
  double sensitivity = 0;  // > 0: each best plan again with each resource this many times as fast
  std::string csv;
  std::string json;
  std::string plans_dir;  // each point's best plan written here
};

CLI::App* add_sweep_command(CLI::App& app, SweepArgs& a);
int run_sweep(SweepArgs& a, const CLI::App& cmd);

}  // namespace nnsim::tool
