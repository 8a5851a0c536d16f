#include "core/training_time.h"

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
