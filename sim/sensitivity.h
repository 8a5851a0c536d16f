// Which hardware resource sets a plan's pace: the plan simulated again on its cluster with one
// resource (compute, HBM, intra-node links, network, latency) `factor` times as fast, the plan
// and every other resource unchanged (docs/simulator.md, "Sensitivity").
#pragma once

#include <functional>
#include <vector>

#include "core/error.h"
#include "core/plan.h"
#include "core/program.h"
#include "core/resource_scaling.h"
#include "core/topology.h"
#include "sim/simulator.h"

namespace nnsim {

inline constexpr double kMinFactor = 0.01;
inline constexpr double kMaxFactor = 100;

struct ResourceSensitivity {
  Resource resource = Resource::kCompute;
  double iteration_time = 0;  // seconds, with the resource scaled
};

struct Sensitivity {
  double factor = 2;
  double baseline = 0;                         // seconds, the cluster as given
  std::vector<ResourceSensitivity> resources;  // in kResources' order
};

// Refuses a factor outside [kMinFactor, kMaxFactor], saying what the factor means.
Status check_sensitivity_factor(double factor);

// `baseline` is the plan's simulated iteration time on `topo` as given (the caller has it).
// Refuses a factor outside [kMinFactor, kMaxFactor]. `progress` gets the fraction of
// simulations done.
Expected<Sensitivity> sensitivity(const Plan& plan, const Topology& topo,
                                  const CompileOptions& compile, const SimOptions& sim,
                                  double factor, double baseline,
                                  const std::function<void(double)>& progress = {});

}  // namespace nnsim
