#include "core/training_time.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <string>

#include <fmt/format.h>

namespace nnsim {

Expected<TrainingTime> training_time(double tokens, double tokens_per_step, double iteration_time,
                                     int gpus) {
  if (!(tokens > 0) || !std::isfinite(tokens)) {
    return Error(fmt::format("training tokens must be a positive number, not {}", tokens));
  }
  if (!(tokens_per_step > 0) || !(iteration_time > 0) || gpus <= 0) {
    return Error(fmt::format("no time to train from {} tokens a step, {} s an iteration on {} GPUs",
                             tokens_per_step, iteration_time, gpus));
  }
  const double steps = std::ceil(tokens / tokens_per_step);
  if (steps > 9e15) {  // beyond what an int64_t step count holds exactly
    return Error(fmt::format("{} tokens are {} steps of {} tokens: too many to count", tokens,
                             steps, tokens_per_step));
  }
  TrainingTime t;
  t.tokens = tokens;
  t.tokens_per_step = tokens_per_step;
  t.steps = static_cast<int64_t>(steps);
  t.seconds = steps * iteration_time;
  t.gpus = gpus;
  t.gpu_hours = gpus * t.seconds / 3600.0;
  return t;
}

Expected<FailureCost> failure_cost(const TrainingTime& t, const FailureModel& f) {
  if (!(f.gpu_failures_per_hour > 0) || !(f.checkpoint_seconds >= 0) || !(f.restart_seconds >= 0) ||
      t.gpus <= 0 || t.steps <= 0) {
    return Error(fmt::format(
        "no failure cost from {} failures a GPU-hour, {} s a checkpoint, {} s a restart",
        f.gpu_failures_per_hour, f.checkpoint_seconds, f.restart_seconds));
  }
  FailureCost c;
  c.mtbf_seconds = 3600.0 / (t.gpus * f.gpu_failures_per_hour);
  const double step = t.seconds / static_cast<double>(t.steps);
  c.checkpoint_interval = std::max(step, std::sqrt(2.0 * f.checkpoint_seconds * c.mtbf_seconds));
  c.lost_fraction = f.checkpoint_seconds / c.checkpoint_interval +
                    (c.checkpoint_interval / 2 + f.restart_seconds) / c.mtbf_seconds;
  if (c.lost_fraction >= 0.5) {
    return Error(fmt::format(
        "the job fails every {:.3g} s on average and would lose {:.0f} % of its time to "
        "checkpoints and restarts (a first-order estimate no longer holds): checkpoint and "
        "restart faster, or use fewer GPUs",
        c.mtbf_seconds, 100 * c.lost_fraction));
  }
  c.seconds = t.seconds / (1 - c.lost_fraction);
  c.failures = c.seconds / c.mtbf_seconds;
  c.gpu_hours = t.gpus * c.seconds / 3600.0;
  c.model = f;
  return c;
}

Expected<double> parse_token_count(std::string_view text) {
  auto bad = [&] {
    return Error(fmt::format(
        "'{}' is not a token count (expected e.g. 15T, 300B, 2.5e11 or '1.2 M tokens'; suffixes "
        "k, M, B or G, T)",
        text));
  };
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  double value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end == s.data() || !std::isfinite(value)) return bad();
  s.remove_prefix(end - s.data());
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  double factor = 1;
  if (!s.empty()) {
    switch (s.front()) {
      case 'k':
      case 'K':
        factor = 1e3;
        break;
      case 'M':
        factor = 1e6;
        break;
      case 'B':
      case 'G':
        factor = 1e9;
        break;
      case 'T':
        factor = 1e12;
        break;
      default:
        factor = 0;
    }
    if (factor != 0)
      s.remove_prefix(1);
    else
      factor = 1;
  }
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (!s.empty() && s != "tokens" && s != "token") return bad();
  if (!(value > 0)) {
    return Error(fmt::format("'{}': the token count must be positive", text));
  }
  return value * factor;
}

}  // namespace nnsim
