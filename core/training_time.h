// How long a training run of a given number of tokens takes at a simulated iteration time:
// whole optimizer steps of the plan's global batch, one iteration each (docs/simulator.md,
// "Time to train"). Failures, checkpoints and restarts are counted on request (FailureModel);
// evaluation, data loading stalls and batch-size warm-up are not.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "core/error.h"

namespace nnsim {

// Hardware failures over a long run (docs/simulator.md, "Time to train"): the job of N GPUs
// fails every M = 1 / (N x rate) on average, checkpoints every tau = sqrt(2 delta M) (Young's
// optimum interval, at least one step) and loses delta / tau + (tau / 2 + R) / M of its time to
// checkpoint saves, recomputed steps and restarts (first order in tau / M).
struct FailureModel {
  // Unexpected interruptions per GPU-hour: Llama 3's pre-training, 419 in a 54-day snapshot on
  // 16,384 H100s (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4).
  double gpu_failures_per_hour = 419.0 / (54.0 * 24.0 * 16384.0);
  double checkpoint_seconds = 0;  // the step blocked by a checkpoint save (delta)
  double restart_seconds = 0;     // from a failure to training again (R)
};

struct FailureCost {
  double mtbf_seconds = 0;         // the job's mean time between failures (M)
  double checkpoint_interval = 0;  // tau, seconds
  double lost_fraction = 0;        // of the run's wall time
  double seconds = 0;              // the run's expected wall time: ideal / (1 - lost)
  double failures = 0;             // expected over the run
  double gpu_hours = 0;
  FailureModel model;  // what it was computed from
};

struct TrainingTime {
  double tokens = 0;           // asked for
  double tokens_per_step = 0;  // global batch x sequence length
  int64_t steps = 0;           // tokens / tokens_per_step, rounded up
  double seconds = 0;          // steps x iteration time
  int gpus = 0;                // the GPUs the plan runs on
  double gpu_hours = 0;        // gpus x seconds / 3600
  // The same run with hardware failures, checkpoints and restarts (failure_cost), on request.
  std::optional<FailureCost> with_failures;
};

Expected<TrainingTime> training_time(double tokens, double tokens_per_step, double iteration_time,
                                     int gpus);
Expected<FailureCost> failure_cost(const TrainingTime& t, const FailureModel& f);

// A token count as people write it: "15T", "300B", "2.5e11", "1.2 M tokens". The suffixes are
// decimal: k/K 1e3, M 1e6, B/G 1e9, T 1e12.
Expected<double> parse_token_count(std::string_view text);

}  // namespace nnsim
