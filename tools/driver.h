// What the nnsim commands share: the error line, optional calibration files, output files,
// resized topologies and progress on a terminal.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/calibration.h"
#include "core/error.h"
#include "core/model.h"
#include "core/topology.h"
#include "core/training_time.h"
#include "sim/sensitivity.h"

namespace nnsim::tool {

// Prints "nnsim: error: <message>" and returns the exit status 1.
int fail(const std::string& message);

// Loads the calibration file `path` into `storage` when one is given; the pointer the compile
// options take (null without a file).
Expected<const Calibration*> optional_calibration(const std::string& path, Calibration& storage);

bool write_file(const std::string& path, const std::string& text, std::string* error);

// --topo-set FIELD=VALUE, once an occurrence (a plan file after it stays a positional).
void add_topo_set_option(CLI::App* app, std::vector<std::string>& topo_set);

// The topology of `path` (a file or a preset) with the fields `--topo-set` gave replaced
// ("node.nics.bandwidth=800Gb/s"), resized to `nodes` when that is positive.
Expected<Topology> load_topology_sized(const std::string& path, int nodes,
                                       const std::vector<std::string>& topo_set = {});

// For a mixture of experts, a note that its step times are not validated yet: the published
// MoE runs nnsim has been set against ran slower or faster than it predicts (docs/moe.md).
void note_unvalidated_moe(const ModelSpec& model);
// A hybrid model's Mamba-2 pricing has no kernel measurement behind it (docs/hybrid.md).
void note_unvalidated_hybrid(const ModelSpec& model);

// For a hypothetical GPU (a what-if part), a note that its figures are as given and its
// efficiencies its base GPU's measured ones (docs/topology.md).
void note_hypothetical_gpu(const GpuSpec& gpu);

// --checkpoint-seconds, --restart-seconds and --gpu-failure-rate: a long run's failures.
struct FailureArgs {
  double checkpoint_seconds = -1;
  double restart_seconds = -1;
  double gpu_failures_per_hour = -1;
};
void add_failure_options(CLI::App* app, FailureArgs& a);
// The failure model the options give (none: nullopt); an error when one is given without the
// other or without --train-tokens.
Expected<std::optional<FailureModel>> read_failure_options(const FailureArgs& a, bool train_tokens);
// `t` with its failure cost added when `f` is given.
Status add_failure_cost(TrainingTime& t, const std::optional<FailureModel>& f);

// "15.0 T tokens in 3,576,279 steps of 4.19 M tokens: 54.2 days on 2048 GPUs, 2.66 M GPU-hours".
std::string describe_training(const TrainingTime& t);

// --sensitivity F: refused before anything runs when F (> 0: asked for) is out of range.
Status check_sensitivity_option(double factor);
// The sensitivity study, with progress on a terminal; its errors name the option.
Expected<Sensitivity> run_sensitivity(const Plan& plan, const Topology& topo,
                                      const CompileOptions& compile, const SimOptions& sim,
                                      double factor, double baseline);
// The sensitivity study's table (--sensitivity): a resource a row, its step and the change.
void print_sensitivity(const Sensitivity& s);

// Progress on a terminal only; pipes and files stay quiet.
class Progress {
 public:
  explicit Progress(const char* what) : what_(what), tty_(::isatty(STDERR_FILENO) != 0) {}
  ~Progress() { done(); }
  void update(double fraction) {
    if (!tty_) return;
    std::fprintf(stderr, "\r%s %3.0f%%", what_, 100 * fraction);
    std::fflush(stderr);
    shown_ = true;
  }
  void done() {
    if (shown_) std::fprintf(stderr, "\r%*s\r", 40, "");
    shown_ = false;
  }

 private:
  const char* what_;
  bool tty_;
  bool shown_ = false;
};

}  // namespace nnsim::tool
