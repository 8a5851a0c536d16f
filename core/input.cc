#include "core/input.h"

#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/suggest.h"

namespace nnsim {
namespace {

bool looks_like_json(const std::string& text) {
  for (char c : text) {
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    return c == '{' || c == '[';
  }
  return false;
}

// nlohmann reports a byte offset; users want line and column.
std::pair<int, int> line_col(const std::string& text, size_t offset) {
  int line = 1, col = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

}  // namespace

InputNode InputNode::load_string(const std::string& text, const std::string& display_name) {
  auto file = std::make_shared<const std::string>(display_name);
  if (looks_like_json(text)) {
    // JSON syntax is checked by a JSON parser: its messages are precise ("expected ',' or '}'").
    try {
      nlohmann::json parsed = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      auto [line, col] = line_col(text, e.byte == 0 ? 0 : e.byte - 1);
      std::string what = e.what();
      auto pos = what.find("syntax error");
      throw InputError(fmt::format("{}:{}:{}: malformed JSON: {}", display_name, line, col,
                                   pos == std::string::npos ? what : what.substr(pos)));
    }
  }
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw InputError(fmt::format("{}:{}:{}: malformed YAML: {}", display_name, e.mark.line + 1,
                                 e.mark.column + 1, e.msg));
  }
  if (!root || root.IsNull()) throw InputError(display_name + ": the file is empty");
  return InputNode(root, file, "", root.Mark());
}

namespace {

// A value from the command line, its YAML read.
YAML::Node override_value(const FieldOverride& o, const std::string& origin) {
  try {
    return YAML::Load(o.value);
  } catch (const YAML::Exception& e) {
    throw InputError(fmt::format("{}: malformed YAML value: {}", origin, e.msg));
  }
}

}  // namespace

InputNode InputNode::load_file(const std::string& path, const std::vector<FieldOverride>& overrides,
                               const std::string& flag, std::string_view scalar_field,
                               std::string_view scalar_key) {
  InputNode root = load_file(path);
  if (overrides.empty()) return root;
  auto replaced = std::make_shared<std::vector<Replaced>>();
  for (const FieldOverride& o : overrides) {
    const std::string origin = fmt::format("{} {}", flag, o.text);
    // Assigning one YAML::Node to another writes into the tree; reset() only rebinds.
    YAML::Node at;
    at.reset(root.node_);
    std::string field;
    for (size_t i = 0; i < o.field.size(); ++i) {
      const std::string& key = o.field[i];
      if (at.IsDefined() && !at.IsMap() && !at.IsNull()) {
        throw InputError(fmt::format("{}: field '{}' of {} holds a {}, not fields", origin, field,
                                     path, at.IsSequence() ? "list" : "value"));
      }
      field += (field.empty() ? "" : ".") + key;
      if (i + 1 == o.field.size()) {
        at[key] = override_value(o, origin);
        break;
      }
      if (YAML::Node next = at[key]; next.IsScalar() && field == scalar_field) {
        YAML::Node holder(YAML::NodeType::Map);
        holder[std::string(scalar_key)] = YAML::Clone(next);
        at[key] = holder;
      }
      at.reset(at[key]);
    }
    replaced->push_back({field, origin});
  }
  root.replaced_ = std::move(replaced);
  return root;
}

InputNode InputNode::load_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open the file (does it exist?)");
  std::stringstream ss;
  ss << in.rdbuf();
  return load_string(ss.str(), path);
}

int InputNode::line() const {
  return mark_.is_null() ? 0 : mark_.line + 1;
}

std::string InputNode::location() const {
  if (replaced_) {
    // The last override that covers the field set its value.
    for (auto r = replaced_->rbegin(); r != replaced_->rend(); ++r) {
      if (path_ == r->field || path_.starts_with(r->field + ".")) {
        return fmt::format("{}: field '{}'", r->origin, path_);
      }
    }
  }
  std::string where = line() > 0 ? fmt::format("{}:{}", *file_, line()) : *file_;
  if (path_.empty()) return where;
  return fmt::format("{}: field '{}'", where, path_);
}

void InputNode::fail(const std::string& message) const {
  throw InputError(location() + ": " + message);
}

void InputNode::fail_unknown(const std::string& value,
                             const std::vector<std::string>& known) const {
  fail(fmt::format("unknown value '{}'{}", value, suggest(value, known)));
}

InputNode InputNode::child(const YAML::Node& n, std::string path) const {
  YAML::Mark mark = n ? n.Mark() : mark_;
  if (mark.is_null()) mark = mark_;
  return InputNode(n, file_, std::move(path), mark, replaced_);
}

bool InputNode::has(std::string_view key) const {
  if (!node_.IsMap()) return false;
  YAML::Node n = node_[std::string(key)];
  return n.IsDefined() && !n.IsNull();
}

InputNode InputNode::operator[](std::string_view key) const {
  std::string child_path = path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  if (!node_.IsMap()) fail(fmt::format("expected a mapping with field '{}'", key));
  YAML::Node n = node_[std::string(key)];
  if (!n.IsDefined() || n.IsNull()) {
    throw InputError(fmt::format("{}: missing required field '{}'", location(), child_path));
  }
  return child(n, child_path);
}

std::optional<InputNode> InputNode::get(std::string_view key) const {
  if (!has(key)) return std::nullopt;
  return (*this)[key];
}

std::vector<InputNode> InputNode::items() const {
  if (!node_.IsSequence()) fail("expected a list");
  std::vector<InputNode> out;
  out.reserve(node_.size());
  for (size_t i = 0; i < node_.size(); ++i) {
    out.push_back(child(node_[i], fmt::format("{}[{}]", path_, i)));
  }
  return out;
}

std::vector<std::pair<std::string, InputNode>> InputNode::entries() const {
  if (!node_.IsMap()) fail("expected a mapping");
  std::vector<std::pair<std::string, InputNode>> out;
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    std::string key = it->first.as<std::string>();
    out.emplace_back(key, child(it->second, path_.empty() ? key : path_ + "." + key));
  }
  return out;
}

std::string InputNode::as_string() const {
  if (!node_.IsScalar()) fail("expected a single value, got a list or mapping");
  return node_.Scalar();
}

int64_t InputNode::as_int() const {
  std::string s = as_string();
  int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec == std::errc() && end == s.data() + s.size()) return v;
  // Accept integral values written as floats ("1e3", "8.0").
  double d = 0;
  auto [end2, ec2] = std::from_chars(s.data(), s.data() + s.size(), d);
  // 2^63 bounds what converts to int64_t (converting a larger double is undefined).
  if (ec2 == std::errc() && end2 == s.data() + s.size() && std::fabs(d) < 0x1p63 &&
      d == static_cast<double>(static_cast<int64_t>(d))) {
    return static_cast<int64_t>(d);
  }
  fail(fmt::format("expected an integer, got '{}'", s));
}

int InputNode::as_small_int() const {
  constexpr int64_t kLimit = (int64_t{1} << 30) - 1;
  const int64_t v = as_int();
  if (v > kLimit || v < -kLimit) {
    fail(fmt::format("{} is out of range (at most {} in magnitude)", v, kLimit));
  }
  return static_cast<int>(v);
}

double InputNode::as_double() const {
  std::string s = as_string();
  double v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) {
    fail(fmt::format("expected a number, got '{}'", s));
  }
  if (!std::isfinite(v)) fail(fmt::format("expected a finite number, got '{}'", s));
  return v;
}

bool InputNode::as_bool() const {
  std::string s = as_string();
  if (s == "true" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "no" || s == "off") return false;
  fail(fmt::format("expected true or false, got '{}'", s));
}

double InputNode::as_quantity(Dimension dim) const {
  Expected<double> v = parse_quantity(as_string(), dim);
  if (!v) fail(v.error().message());
  return *v;
}

std::vector<int> InputNode::as_small_int_list() const {
  std::vector<int> out;
  for (const auto& item : items()) out.push_back(item.as_small_int());
  return out;
}

std::string InputNode::get_string(std::string_view key, const std::string& fallback) const {
  return has(key) ? (*this)[key].as_string() : fallback;
}
int InputNode::get_small_int(std::string_view key, int fallback) const {
  return has(key) ? (*this)[key].as_small_int() : fallback;
}
double InputNode::get_double(std::string_view key, double fallback) const {
  return has(key) ? (*this)[key].as_double() : fallback;
}
bool InputNode::get_bool(std::string_view key, bool fallback) const {
  return has(key) ? (*this)[key].as_bool() : fallback;
}
double InputNode::get_quantity(std::string_view key, Dimension dim, double fallback) const {
  return has(key) ? (*this)[key].as_quantity(dim) : fallback;
}

void InputNode::check_keys(std::initializer_list<std::string_view> allowed) const {
  if (!node_.IsMap()) fail("expected a mapping");
  std::vector<std::string> known(allowed.begin(), allowed.end());
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    std::string key = it->first.as<std::string>();
    bool ok = false;
    for (auto a : allowed) ok = ok || a == key;
    if (!ok) {
      InputNode at = child(it->first, path_.empty() ? key : path_ + "." + key);
      at.fail(fmt::format("unknown field '{}'{}", key, suggest(key, known)));
    }
    // `key:` with nothing after it (or JSON null) would read as absent and take the default
    // without a word: most often a value was forgotten.
    if (it->second.IsNull()) {
      child(it->first, path_.empty() ? key : path_ + "." + key)
          .fail("has no value; give it one, or remove the field to take its default");
    }
  }
}

}  // namespace nnsim
