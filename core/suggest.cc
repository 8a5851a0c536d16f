#include "core/suggest.h"

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

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

bool contains_ignoring_case(std::string_view text, std::string_view part) {
  auto lower = [](char c) { return std::tolower(static_cast<unsigned char>(c)); };
  return std::search(text.begin(), text.end(), part.begin(), part.end(),
                     [&](char a, char b) { return lower(a) == lower(b); }) != text.end();
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
  // Listing more than a dozen names buries the message.
  constexpr size_t kListed = 12;
  auto join = [](const std::vector<const std::string*>& names) {
    std::string list;
    for (const std::string* n : names) list += (list.empty() ? "" : ", ") + *n;
    return list;
  };
  std::vector<const std::string*> containing;
  for (const auto& c : candidates) {
    if (!name.empty() && contains_ignoring_case(c, name)) containing.push_back(&c);
  }
  if (containing.size() == 1) return " (did you mean '" + *containing.front() + "'?)";
  if (!containing.empty() && containing.size() <= kListed) {
    return " (did you mean one of: " + join(containing) + "?)";
  }
  std::vector<const std::string*> listed;
  for (size_t i = 0; i < candidates.size() && i < kListed; ++i) listed.push_back(&candidates[i]);
  if (candidates.size() <= kListed) return " (known: " + join(listed) + ")";
  return " (known: " + join(listed) + ", ... " + std::to_string(candidates.size()) + " in all)";
}

}  // namespace nnsim
