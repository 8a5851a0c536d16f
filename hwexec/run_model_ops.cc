// ALiBi's slopes and dropout's seeds (run_model_ops.h).
#include "hwexec/run_model_ops.h"

#include <cmath>

namespace nnsim::hwexec {

namespace {

// Slopes of a power of two n heads: 2^(-8/n), 2^(-16/n), ..., 2^-8.
std::vector<double> power_of_two_slopes(int64_t n) {
  std::vector<double> s;
  for (int64_t i = 1; i <= n; ++i) s.push_back(std::exp2(-8.0 * static_cast<double>(i) / n));
  return s;
}

// SplitMix64's finalizer: a bijective mix of 64 bits.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

std::vector<double> alibi_slopes(int64_t heads) {
  if (heads < 1) return {};
  int64_t m = 1;
  while (m * 2 <= heads) m *= 2;
  std::vector<double> s = power_of_two_slopes(m);
  const std::vector<double> twice = power_of_two_slopes(2 * m);
  for (int64_t i = 0; static_cast<int64_t>(s.size()) < heads; i += 2) s.push_back(twice[i]);
  return s;
}

std::uint64_t dropout_seed(unsigned long long run_seed, int iteration, int layer, DropoutSite site,
                           int64_t row, int pass) {
  std::uint64_t h = mix(run_seed);
  for (std::uint64_t v : {static_cast<std::uint64_t>(iteration), static_cast<std::uint64_t>(layer),
                          static_cast<std::uint64_t>(site), static_cast<std::uint64_t>(row)}) {
    h = mix(h ^ v);
  }
  return pass > 0 ? mix(h ^ (0x70617373ull << 32 | static_cast<std::uint64_t>(pass))) : h;
}

}  // namespace nnsim::hwexec
