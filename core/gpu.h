// GPU datasheet figures. The catalog holds the GPUs nnsim knows by name; a topology may also
// describe its own GPU (a hypothetical part for a what-if study) starting from a catalog entry.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/precision.h"

namespace nnsim {

struct GpuSpec {
  std::string name;                         // catalog key, e.g. "a100-sxm4-80gb"
  std::map<Precision, double> dense_flops;  // peak dense FLOP/s per matmul precision
  double hbm_bytes = 0;                     // memory capacity
  double hbm_bandwidth = 0;                 // bytes/s
  double nvlink_bandwidth = 0;              // bytes/s per direction per GPU; 0 = no NVLink
  int sms = 0;                              // streaming multiprocessors
  std::string source;                       // where the figures come from
  // The catalog GPU this one derives from: its own name for a catalog GPU, the `base` of a
  // hypothetical one, which keeps its base's measured behaviour (GEMM and attention
  // efficiencies, NCCL curves, a calibration file's entry) whatever its name.
  std::string base;

  // The generation whose measurements the cost model uses (by the base's name; a GpuSpec made
  // without a base goes by its own).
  bool ampere() const { return lineage().rfind("a100", 0) == 0; }
  bool hopper() const { return lineage().rfind("h100", 0) == 0 || lineage().rfind("h200", 0) == 0; }
  const std::string& lineage() const { return base.empty() ? name : base; }

  // Peak for `p`; falls back to the closest slower format the GPU has (fp8 on an A100 runs at
  // bf16 rate). Returns 0 when the GPU has no matmul unit for it.
  double peak_flops(Precision p) const;
};

// All catalog GPUs, ordered by name.
const std::vector<GpuSpec>& gpu_catalog();
Expected<GpuSpec> find_gpu(const std::string& name);

}  // namespace nnsim
