#include "core/json_format.h"

namespace nnsim {
namespace {

using json = nlohmann::ordered_json;

constexpr size_t kInlineWidth = 100;

// A value that fits on one line: scalars, and arrays/objects made only of such values.
bool is_flat(const json& v, int depth = 0) {
  if (!v.is_structured()) return true;
  if (depth >= 3) return false;
  for (const auto& x : v) {
    if (!is_flat(x, depth + 1)) return false;
  }
  return true;
}

std::string inline_text(const json& v) {
  if (v.is_array()) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + inline_text(v[i]);
    return s + "]";
  }
  if (v.is_object()) {
    std::string s = "{";
    bool first = true;
    for (const auto& [k, x] : v.items()) {
      s += (first ? "" : ", ") + json(k).dump() + ": " + inline_text(x);
      first = false;
    }
    return s + "}";
  }
  return v.dump();
}

void write(const json& v, int indent, std::string& out) {
  if (is_flat(v)) {
    std::string s = inline_text(v);
    if (s.size() + static_cast<size_t>(indent) <= kInlineWidth || !v.is_structured()) {
      out += s;
      return;
    }
  }
  const std::string pad(static_cast<size_t>(indent) + 1, ' ');
  const std::string end_pad(static_cast<size_t>(indent), ' ');
  if (v.is_array()) {
    if (v.empty()) {
      out += "[]";
      return;
    }
    out += "[\n";
    for (size_t i = 0; i < v.size(); ++i) {
      out += pad;
      write(v[i], indent + 1, out);
      out += i + 1 < v.size() ? ",\n" : "\n";
    }
    out += end_pad + "]";
    return;
  }
  if (v.empty()) {
    out += "{}";
    return;
  }
  out += "{\n";
  size_t i = 0;
  for (const auto& [k, x] : v.items()) {
    out += pad + json(k).dump() + ": ";
    write(x, indent + 1, out);
    out += ++i < v.size() ? ",\n" : "\n";
  }
  out += end_pad + "}";
}

}  // namespace

std::string format_json(const nlohmann::ordered_json& value) {
  std::string out;
  write(value, 0, out);
  return out + "\n";
}

}  // namespace nnsim
