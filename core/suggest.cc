#include "core/suggest.h"

#include <algorithm>
#include <cctype>

namespace nnsim {
namespace {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                  std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (same ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string suggest(std::string_view name, const std::vector<std::string>& candidates) {
  if (candidates.empty()) return "";
  const std::string* best = nullptr;
  size_t best_d = 0;
  for (const auto& c : candidates) {
    size_t d = edit_distance(name, c);
    if (!best || d < best_d) {
      best = &c;
      best_d = d;
    }
  }
  if (best_d <= std::max<size_t>(2, name.size() / 3)) return " (did you mean '" + *best + "'?)";
  std::string list;
  for (const auto& c : candidates) list += (list.empty() ? "" : ", ") + c;
  return " (known: " + list + ")";
}

}  // namespace nnsim
