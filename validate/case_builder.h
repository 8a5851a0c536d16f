// A validation case's cluster, model and plan, built through the same code paths a user's
// `nnsim plan` and `nnsim simulate` take: the cluster from the topology preset of its GPU
// generation, the plan from the pinned plan builder with the framework's conventions.
#pragma once

#include "core/error.h"
#include "core/plan.h"
#include "core/topology.h"
#include "planner/megatron.h"
#include "validate/validation_set.h"

namespace nnsim {

// DGX-style nodes of the case's GPU (NVSwitch, its NICs) on the fabric of the generation's
// preset: dgx-a100x4 (one non-blocking switch) for A100, dgx-h100-superpod (rail-optimized)
// for H100.
Expected<Topology> case_topology(const ValidationCase& c);

// The builder's options for the case: its degrees, batch, recompute and precision, and the
// framework's conventions (docs/VALIDATION.md lists them).
Expected<MegatronOptions> case_options(const ValidationCase& c);

Expected<Plan> case_plan(const ValidationCase& c, const Topology& topology);

}  // namespace nnsim
