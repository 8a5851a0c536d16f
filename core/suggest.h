// "Did you mean ...?" for unknown names in user input.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace nnsim {

// Returns " (did you mean 'x'?)" for the closest candidate within a small edit distance, or
// " (known: a, b, c)" when nothing is close; empty when there are no candidates.
std::string suggest(std::string_view name, const std::vector<std::string>& candidates);

}  // namespace nnsim
