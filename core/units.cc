#include "core/units.h"

#include <fmt/format.h>
#include <cctype>
#include <charconv>
#include <cmath>

namespace nnsim {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Splits a leading SI or binary prefix off `unit`; returns the multiplier (1 when none).
double take_prefix(std::string_view& unit) {
  struct Prefix {
    std::string_view text;
    double factor;
  };
  static constexpr Prefix kPrefixes[] = {
      {"Ki", 1024.0},
      {"Mi", 1048576.0},
      {"Gi", 1073741824.0},
      {"Ti", 1099511627776.0},
      {"Pi", 1125899906842624.0},
      {"k", 1e3},
      {"K", 1e3},
      {"M", 1e6},
      {"G", 1e9},
      {"T", 1e12},
      {"P", 1e15},
      {"E", 1e18},
      {"m", 1e-3},
      {"u", 1e-6},
      {"n", 1e-9},
  };
  for (const auto& p : kPrefixes) {
    if (unit.size() > p.text.size() && unit.substr(0, p.text.size()) == p.text) {
      unit.remove_prefix(p.text.size());
      return p.factor;
    }
  }
  return 1.0;
}

std::string expected_units(Dimension dim) {
  switch (dim) {
    case Dimension::kBytes:
      return "B, KB, MB, GB, KiB, MiB, GiB, TiB";
    case Dimension::kSeconds:
      return "s, ms, us, ns";
    case Dimension::kBytesPerSecond:
      return "B/s, GB/s, Gb/s, Gbit/s, Gbps";
    case Dimension::kFlopsPerSecond:
      return "FLOP/s, TFLOP/s, PFLOP/s";
    case Dimension::kFlops:
      return "FLOP, GFLOP, TFLOP";
  }
  return "";
}

// Multiplier that turns a unit without prefix into the base unit of `dim`; NaN if it does not
// belong to `dim`.
double base_unit(std::string_view unit, Dimension dim) {
  switch (dim) {
    case Dimension::kBytes:
      if (unit == "B" || unit == "byte" || unit == "bytes") return 1.0;
      if (unit == "b" || unit == "bit" || unit == "bits") return 0.125;
      break;
    case Dimension::kSeconds:
      if (unit == "s" || unit == "sec") return 1.0;
      break;
    case Dimension::kBytesPerSecond:
      if (unit == "B/s" || unit == "Bps") return 1.0;
      if (unit == "b/s" || unit == "bit/s" || unit == "bps") return 0.125;
      break;
    case Dimension::kFlopsPerSecond:
      if (unit == "FLOP/s" || unit == "FLOPS" || unit == "flop/s") return 1.0;
      break;
    case Dimension::kFlops:
      if (unit == "FLOP" || unit == "flop") return 1.0;
      break;
  }
  return std::nan("");
}

}  // namespace

Expected<double> parse_quantity(std::string_view text, Dimension dim) {
  std::string_view s = trim(text);
  double value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end == s.data()) {
    return Error(fmt::format("'{}' is not a number (expected e.g. 25e9 or '25 GB/s'; units: {})",
                             text, expected_units(dim)));
  }
  std::string_view unit = trim(std::string_view(end, s.data() + s.size() - end));
  if (!std::isfinite(value)) {
    return Error(fmt::format("'{}' is not a finite number", text));
  }
  if (unit.empty()) return value;
  double factor = 1.0;
  double base = base_unit(unit, dim);
  if (std::isnan(base)) {
    std::string_view rest = unit;
    factor = take_prefix(rest);
    base = base_unit(rest, dim);
  }
  if (std::isnan(base)) {
    return Error(fmt::format("unknown unit '{}' in '{}' (expected one of: {})", unit, text,
                             expected_units(dim)));
  }
  return value * factor * base;
}

std::string format_bytes(double bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", v) : fmt::format("{:.2f} {}", v, kUnits[u]);
}

std::string format_seconds(double seconds) {
  double a = std::fabs(seconds);
  if (a < 1e-10) return "0 s";  // rounding residue of sums of times, not a duration
  if (a >= 1.0) return fmt::format("{:.3f} s", seconds);
  if (a >= 1e-3) return fmt::format("{:.2f} ms", seconds * 1e3);
  if (a >= 1e-6) return fmt::format("{:.2f} us", seconds * 1e6);
  return fmt::format("{:.1f} ns", seconds * 1e9);
}

namespace {
std::string format_decimal(double v, const char* unit) {
  static constexpr const char* kPrefix[] = {"", "k", "M", "G", "T", "P", "E"};
  int p = 0;
  while (std::fabs(v) >= 1000.0 && p < 6) {
    v /= 1000.0;
    ++p;
  }
  return fmt::format("{:.{}f} {}{}", v, std::fabs(v) >= 100 ? 0 : (std::fabs(v) >= 10 ? 1 : 2),
                     kPrefix[p], unit);
}
}  // namespace

std::string format_rate(double bytes_per_s) {
  return format_decimal(bytes_per_s, "B/s");
}
std::string format_flops(double flops_per_s) {
  return format_decimal(flops_per_s, "FLOP/s");
}
std::string format_count(double n) {
  return format_decimal(n, "");
}

std::string format_duration(double seconds) {
  const double a = std::fabs(seconds);
  if (a >= 2 * 86400.0) return fmt::format("{:.1f} days", seconds / 86400.0);
  if (a >= 2 * 3600.0) return fmt::format("{:.1f} hours", seconds / 3600.0);
  if (a >= 2 * 60.0) return fmt::format("{:.1f} min", seconds / 60.0);
  return format_seconds(seconds);
}

}  // namespace nnsim
