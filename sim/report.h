// The simulation report as JSON (--json): every figure in base units (seconds, bytes, FLOP/s).
// Field-by-field description in docs/simulator.md.
#pragma once

#include <string>

#include "core/program.h"
#include "sim/result.h"

namespace nnsim {

std::string report_json(const Program& program, const SimResult& result);

}  // namespace nnsim
