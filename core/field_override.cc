#include "core/field_override.h"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>

namespace nnsim {

Expected<FieldOverride> parse_field_override(std::string_view text) {
  FieldOverride o;
  o.text = std::string(text);
  const size_t eq = text.find('=');
  if (eq == std::string_view::npos) {
    return Error(fmt::format("'{}': expected FIELD=VALUE, e.g. node.nics.bandwidth=800Gb/s", text));
  }
  std::string_view field = text.substr(0, eq);
  o.value = std::string(text.substr(eq + 1));
  while (true) {
    const size_t dot = field.find('.');
    std::string_view key = field.substr(0, dot);
    const bool plain = !key.empty() && std::all_of(key.begin(), key.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_';
    });
    if (!plain) {
      return Error(fmt::format(
          "'{}': FIELD must be keys joined by dots (letters, digits, _), e.g. node.nics.bandwidth",
          text));
    }
    o.field.emplace_back(key);
    if (dot == std::string_view::npos) break;
    field.remove_prefix(dot + 1);
  }
  if (o.value.find_first_not_of(" \t") == std::string::npos) {
    return Error(fmt::format("'{}': the value is empty", text));
  }
  return o;
}

std::string name_with_overrides(const std::string& name,
                                const std::vector<FieldOverride>& overrides) {
  std::string out = name;
  for (size_t i = 0; i < overrides.size(); ++i) {
    if (overrides[i].field == std::vector<std::string>{"name"}) return name;
    out += (i == 0 ? " with " : ", ") + overrides[i].text;
  }
  return out;
}

}  // namespace nnsim
