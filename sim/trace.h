// Timeline outputs of a simulation run with recorded tasks:
//  - a Chrome / Perfetto trace (JSON "traceEvents"; open in ui.perfetto.dev or chrome://tracing):
//    one process per lane (or per GPU with `per_gpu`), one thread per stream;
//  - an HDF5 task table for analysis with h5py (layout in docs/simulator.md).
#pragma once

#include <string>

#include "core/error.h"
#include "core/program.h"
#include "sim/result.h"

namespace nnsim {

std::string chrome_trace_json(const Program& program, const SimResult& result,
                              bool per_gpu = false);
Status write_hdf5_timeline(const std::string& path, const Program& program,
                           const SimResult& result);

}  // namespace nnsim
