// How long a training run of a given number of tokens takes at a simulated iteration time:
// whole optimizer steps of the plan's global batch, one iteration each (docs/simulator.md,
// "Time to train"). Checkpoints, evaluation, restarts after failures, data loading stalls and
// batch-size warm-up are not counted.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/error.h"

namespace nnsim {

struct TrainingTime {
  double tokens = 0;           // asked for
  double tokens_per_step = 0;  // global batch x sequence length
  int64_t steps = 0;           // tokens / tokens_per_step, rounded up
  double seconds = 0;          // steps x iteration time
  int gpus = 0;                // the GPUs the plan runs on
  double gpu_hours = 0;        // gpus x seconds / 3600
};

Expected<TrainingTime> training_time(double tokens, double tokens_per_step, double iteration_time,
                                     int gpus);

// A token count as people write it: "15T", "300B", "2.5e11", "1.2 M tokens". The suffixes are
// decimal: k/K 1e3, M 1e6, B/G 1e9, T 1e12.
Expected<double> parse_token_count(std::string_view text);

}  // namespace nnsim
