// The simulation report as JSON (--json): every figure in base units (seconds, bytes, FLOP/s).
// Field-by-field description in docs/simulator.md.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/program.h"
#include "core/training_time.h"
#include "sim/result.h"
#include "sim/sensitivity.h"

namespace nnsim {

// `training`, when given, adds the time to train its tokens ("training"); `sensitivity`, the
// plan's iteration time with each resource scaled ("sensitivity").
std::string report_json(const Program& program, const SimResult& result,
                        const std::optional<TrainingTime>& training = std::nullopt,
                        const std::optional<Sensitivity>& sensitivity = std::nullopt);

// The "sensitivity" object of the report (and of a sweep's points).
nlohmann::ordered_json sensitivity_json(const Sensitivity& s);

}  // namespace nnsim
