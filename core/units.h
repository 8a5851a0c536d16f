// Physical quantities. Files hold base units (bytes, seconds, bytes/s, FLOP/s); a value in a YAML
// file may also be written with a unit ("25 GB/s", "200 Gb/s", "1.5 us", "80 GiB",
// "312 TFLOP/s"). The terminal shows human-friendly units.
#pragma once

#include <string>
#include <string_view>

#include "core/error.h"

namespace nnsim {

enum class Dimension { kBytes, kSeconds, kBytesPerSecond, kFlopsPerSecond, kFlops };

// Parses "<number> [unit]" for the given dimension. A bare number is in the base unit.
// Decimal prefixes (k, M, G, T, P) are powers of 1000, binary ones (Ki, Mi, Gi, Ti) of 1024;
// "b"/"bit" is bits (converted to bytes), "B" bytes.
Expected<double> parse_quantity(std::string_view text, Dimension dim);

std::string format_bytes(double bytes);        // "1.50 GiB"
std::string format_seconds(double seconds);    // "12.3 ms"
std::string format_rate(double bytes_per_s);   // "25.0 GB/s"
std::string format_flops(double flops_per_s);  // "312 TFLOP/s"
std::string format_count(double n);            // "1.2 M"
std::string format_duration(double seconds);   // "8.1 days", "5.2 hours", "12.0 min", "3.456 s"

}  // namespace nnsim
