// `nnsim validate`: simulate every case of a validation set and compare with what was measured.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/program.h"
#include "validate/validation_set.h"

namespace nnsim {

struct CaseOutcome {
  std::string id;
  std::string status = "ok";  // "ok", or why the case could not be simulated
  int gpus = 0;
  std::string framework;
  std::string source;           // ValidationCase::source_name
  bool parallel_stated = true;  // no parallel.* field of the case was assumed
  double predicted_s = 0;
  double measured_s = 0;
  double error_pct = 0;  // signed: (predicted - measured) / measured
  std::optional<double> predicted_memory_gib;
  std::optional<double> measured_memory_gib;
  std::optional<double> memory_error_pct;
  double wall_s = 0;  // time this case took to build and simulate
  // Where the predicted time went, on the lane that finished last.
  double compute_s = 0, recompute_s = 0, optimizer_s = 0, exposed_comm_s = 0, bubble_s = 0;
  std::map<std::string, double> exposed_by_group;
  // What the predicted peak holds, bytes per GPU, on the lane with the highest peak.
  StaticMemory memory;
  double peak_activations_bytes = 0;
  bool ok() const { return status == "ok"; }
};

struct ErrorStats {
  int count = 0;
  double mean = 0;  // of absolute errors, percent
  double median = 0;
  double p90 = 0;  // linear interpolation between order statistics
  double max = 0;
};

struct ValidationSummary {
  int cases = 0;
  int failures = 0;
  ErrorStats time;                                   // all simulated cases
  ErrorStats time_stated;                            // cases with no assumed parallel.* field
  ErrorStats memory;                                 // cases with a measured peak memory
  std::map<std::string, ErrorStats> time_by_source;  // simulated cases of each source
};

struct ValidateOptions {
  int jobs = 1;
  CompileOptions compile;
  // Called after each case with (cases done, cases in all).
  std::function<void(int, int)> progress;
};

std::vector<CaseOutcome> run_validation(const std::vector<ValidationCase>& cases,
                                        const ValidateOptions& options);
ValidationSummary summarize(const std::vector<CaseOutcome>& outcomes);
ErrorStats error_stats(std::vector<double> absolute_errors);
// The JSON written by `nnsim validate --json` (docs/VALIDATION.md).
std::string validation_json(const std::vector<CaseOutcome>& outcomes,
                            const ValidationSummary& summary);

}  // namespace nnsim
