#include "sim/sensitivity.h"

#include <fmt/format.h>

namespace nnsim {

Status check_sensitivity_factor(double factor) {
  // Far outside this range a scaled bandwidth stops being a machine anyone could build, and
  // SimGrid's rates would overflow long before 1e300.
  if (!(factor >= kMinFactor && factor <= kMaxFactor)) {
    return Error(fmt::format(
        "the factor must be from {:g} to {:g} (2: twice as fast, 0.5: half as fast), got {:g}",
        kMinFactor, kMaxFactor, factor));
  }
  return Status::Ok();
}

Expected<Sensitivity> sensitivity(const Plan& plan, const Topology& topo,
                                  const CompileOptions& compile, const SimOptions& sim,
                                  double factor, double baseline,
                                  const std::function<void(double)>& progress) {
  if (Status st = check_sensitivity_factor(factor); !st) return st.error();
  Sensitivity s;
  s.factor = factor;
  s.baseline = baseline;
  SimOptions options = sim;
  options.record_tasks = false;  // the timeline is the baseline's
  options.progress = nullptr;
  for (size_t i = 0; i < kResources.size(); ++i) {
    const Resource r = kResources[i];
    Expected<Program> prog = compile_plan(plan, scale_resource(topo, r, factor), compile);
    // The simulator reads the communication model from the program (the compiler resolved it:
    // the GPU's defaults and a calibration file's entry).
    if (prog) prog->comm_model = scale_resource(prog->comm_model, r, factor);
    Expected<SimResult> result = prog ? simulate(*prog, options) : prog.error();
    if (!result) {
      return Error(
          fmt::format("with {} x{:g}: {}", resource_name(r), factor, result.error().message()));
    }
    s.resources.push_back({r, result->iteration_time});
    if (progress) progress(static_cast<double>(i + 1) / kResources.size());
  }
  return s;
}

}  // namespace nnsim
