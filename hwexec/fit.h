// Fitting the simulator's cost-model parameters to microbenchmark results (`nnsim calibrate`).
// The formulas and what each parameter means are in docs/hwexec.md. Independent of LibTorch and
// CUDA: it runs wherever nnsim does.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/calibration.h"
#include "core/gpu.h"
#include "hwexec/micro.h"

namespace nnsim::hwexec {

// The catalog GPU a CUDA device name stands for ("NVIDIA H200" -> "h200-sxm-141gb"), or an
// error that lists the catalog.
Expected<std::string> match_catalog_gpu(const std::string& device_name);

struct GemmFit {
  Precision precision = Precision::kFp32;
  double peak = 0;             // the GPU's dense peak for it, FLOP/s
  double best_flops = 0;       // fastest measured rate, FLOP/s
  double efficiency = 0;       // the fitted gemm_efficiency
  double m = 0, n = 0, k = 0;  // the shape that set it
  // Over all shapes: the model's relative time error |t_model - t| / t with the fitted value.
  double median_error = 0, max_error = 0;
  int samples = 0;
};

struct MemoryFit {
  // The same line fitted to each operator alone: how far apart they are.
  struct PerOp {
    std::string op;
    double bandwidth = 0, overhead = 0;
  };
  std::vector<PerOp> per_op;
  double bandwidth = 0;   // achieved bytes/s (1 / slope)
  double overhead = 0;    // seconds per kernel (intercept)
  double efficiency = 0;  // bandwidth / the GPU's HBM bandwidth
  double median_error = 0, max_error = 0;
  int samples = 0;
};

struct LinkFit {
  int ranks = 0;
  double link_bandwidth = 0;      // bytes/s per direction the efficiencies are relative to
  GpuCalibration::Link link;      // curve, caps and step latency
  std::vector<std::string> from;  // collectives used
};

struct Fit {
  std::string gpu;  // catalog name
  std::vector<GemmFit> gemm;
  std::optional<MemoryFit> memory;
  std::optional<LinkFit> nvlink;
  std::vector<std::string> notes;  // what could not be fitted and why
  GpuCalibration calibration;      // only the fitted values; the rest keep the built-ins
};

// Fits `micro` against the datasheet figures of `gpu`. `source` goes into the calibration
// entry. Errors when nothing can be fitted or a measurement beats the datasheet peak (wrong GPU).
Expected<Fit> fit_micro(const MicroResults& micro, const GpuSpec& gpu, const std::string& source);

}  // namespace nnsim::hwexec
