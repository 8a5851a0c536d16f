// Validation sets: published, measured training runs in the schema of
// shared/validation/README.md (schema nnsim-validation/1): model, cluster, parallel
// configuration and what was measured.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/model.h"
#include "core/precision.h"

namespace nnsim {

struct ValidationCluster {
  std::string gpu;  // catalog name: a100-sxm4-80gb, h100-sxm5-80gb, ...
  int nodes = 0;
  int gpus_per_node = 0;
  double nic_bandwidth = 0;  // bytes/s per NIC per direction
  int nics_per_node = 0;
};

struct ValidationParallel {
  int tp = 1, pp = 1, dp = 1, cp = 1, ep = 1, vp = 1;
  int micro_batch = 1;
  int global_batch = 1;
  std::string recompute = "none";  // none, selective, full
  bool sequence_parallel = false;
  int zero = 0;
  Precision precision = Precision::kBf16;
  std::string framework = "megatron";  // megatron, fsdp, deepspeed, other
};

struct ValidationMeasured {
  double iteration_time_s = 0;
  std::optional<double> tokens_per_s_per_gpu;
  std::optional<double> mfu_pct;
  std::optional<double> peak_memory_gib;
};

struct ValidationCase {
  std::string id;
  std::string source;
  ModelSpec model;
  ValidationCluster cluster;
  ValidationParallel parallel;
  ValidationMeasured measured;
  std::vector<std::string> assumed;  // dotted field names filled in by the transcriber

  int gpus() const { return cluster.nodes * cluster.gpus_per_node; }
  // True when no parallel.* field was assumed.
  bool parallel_stated() const;
  // The source's name: its line up to the first comma outside parentheses ("Korthikanti et
  // al. 2022 (arXiv:2205.05198)"), for summaries by source.
  std::string source_name() const;
};

Expected<std::vector<ValidationCase>> load_validation_set(const std::string& path);
Expected<std::vector<ValidationCase>> parse_validation_set(const std::string& yaml_text,
                                                           const std::string& display_name);

}  // namespace nnsim
