// "Did you mean ...?" for unknown names in user input.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace nnsim {

// Returns " (did you mean 'x'?)" for the closest candidate within a small edit distance, else
// for the candidates that contain `name` (an abbreviation of a long name: one, or " (did you
// mean one of: x, y?)" for a few), else " (known: a, b, c)", the first dozen of a longer list
// and how many there are; empty when there are no candidates.
std::string suggest(std::string_view name, const std::vector<std::string>& candidates);

}  // namespace nnsim
