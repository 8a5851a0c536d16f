// Calibration files (HDF5, format "nnsim-calibration", version 1; layout in docs/cost-model.md):
// per GPU type, values that replace the built-in cost model's constants. nnsim can write the
// built-in values as a starting point (`nnsim calibration export`); the hardware validator
// writes fitted ones.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/comm_model.h"
#include "core/cost_model.h"
#include "core/error.h"

namespace nnsim {

// What one GPU type's calibration sets. Anything absent keeps the built-in value.
struct GpuCalibration {
  std::map<std::string, double> compute;  // ComputeModel scalar fields by name
  std::map<Precision, double> gemm_efficiency;
  struct Link {
    std::vector<EfficiencyPoint> curve;
    std::optional<double> max_efficiency, all_reduce_max_efficiency, step_latency;
  };
  std::optional<Link> nvlink, network;
  std::string source;  // where the values come from
};

struct Calibration {
  std::map<std::string, GpuCalibration> gpus;  // by catalog GPU name
};

// Names of the ComputeModel scalars a calibration may set.
const std::vector<std::string>& compute_parameter_names();

// Applies the calibration for `gpu` (if the file has one) on top of the models.
void apply_calibration(const Calibration& c, const std::string& gpu, ComputeModel& compute,
                       CommModel& comm);
// ... for a GPU: its own entry, or else its base's (a hypothetical GPU keeps its base's
// measured behaviour).
void apply_calibration(const Calibration& c, const GpuSpec& gpu, ComputeModel& compute,
                       CommModel& comm);
// The built-in models of a GPU as a calibration entry.
GpuCalibration describe_models(const ComputeModel& compute, const CommModel& comm,
                               const std::string& source);

Expected<Calibration> load_calibration(const std::string& path);
Status save_calibration(const std::string& path, const Calibration& c);

}  // namespace nnsim
