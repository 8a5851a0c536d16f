// nnsim plan: build a pinned Megatron-style plan, or search the choices not given.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/calibration.h"
#include "planner/megatron.h"
#include "planner/search.h"
#include "tools/driver.h"

namespace nnsim::tool {

struct PlanArgs {
  std::string model;
  std::string topo;
  int nodes = 0;
  std::vector<std::string> topo_set;   // topology fields replaced: "node.nics.bandwidth=800Gb/s"
  std::vector<std::string> model_set;  // model fields replaced: "seq_len=32768"
  MegatronOptions o;
  std::string recompute = "none";
  std::string schedule = "1f1b";
  std::string precision;
  std::string loss;  // the model's cross-entropy kernel, replaced
  // Optimizer offloading: a fraction (into o.optimizer_offload), or "auto" for the search
  // (SearchOptions::offload_as_needed).
  std::string optimizer_offload;
  bool offload_as_needed = false;
  // Activation offloading: a layer count (into o.activation_offload), or "auto" for the search
  // (SearchOptions::activation_offload_as_needed).
  std::string activation_offload;
  // Fine-grained offloading: module names (into o.offload_modules), or "auto" for the search
  // (SearchOptions::module_offload_as_needed).
  bool module_offload_auto = false;
  std::string output;
  // Search.
  bool search = false;
  std::string constraints;
  int top = 10;
  int confirm = 5;
  int jobs = 0;
  std::string csv;
  std::string train_tokens;  // e.g. "15T": the best plan's time to train that many tokens
  std::optional<double> train_token_count;  // read from `train_tokens`
  FailureArgs failures;                     // and with hardware failures, checkpoints and restarts
  std::optional<FailureModel> failure_model;  // read from `failures`
  double sensitivity = 0;  // > 0: the best plan again with each resource this many times as fast
  SearchPins pins;         // what was given on the command line
  std::string calib;
  Calibration calibration;  // loaded from `calib`; a.o.costs points at it
};

CLI::App* add_plan_command(CLI::App& app, PlanArgs& a);
// After parsing: what the user pinned (the options given on `cmd`), then the build or search.
int run_plan_command(PlanArgs& a, const CLI::App& cmd);

// What `nnsim sweep` shares with `plan`: the model, topology and every choice of the plan and
// its search, without the node count, the global batch and the outputs.
void add_plan_choices(CLI::App* cmd, PlanArgs& a);
// After parsing: the pins (the options given on `cmd`), the names read (recompute, schedule,
// precision) and the calibration loaded; a builder-only option under a search is an error.
Status read_plan_choices(PlanArgs& a, const CLI::App& cmd);
// The model with the fields `--model-set` gave replaced and the cross-entropy `--loss` gave;
// `more` adds model fields (a sweep's point).
Expected<ModelSpec> load_plan_model(const PlanArgs& a, const std::vector<std::string>& more = {});
// The search's options (constraints, pins, recomputed modules, simulation of the best plans);
// no progress callback.
Expected<SearchOptions> search_options(const PlanArgs& a, const ModelSpec& model);

}  // namespace nnsim::tool
