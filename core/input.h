// Reading structured input (YAML, and JSON as its subset) with errors that name the file, the
// line and the field. Parsers written on top of InputNode throw InputError; each public load_*
// function catches it and returns an Error, so nothing escapes the library as an exception.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "core/field_override.h"
#include "core/units.h"

namespace nnsim {

class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InputNode {
 public:
  // Reads a YAML or JSON file. Syntax errors throw InputError with the file, line and column.
  static InputNode load_file(const std::string& path);
  // The same with fields replaced, in order (what-if studies without copying the file): maps
  // on a field's way are created, and where the way runs through the scalar field
  // `scalar_field` ("gpu: h100-sxm5-80gb") that becomes a map holding it under `scalar_key`
  // ({base: h100-sxm5-80gb}). An error in a replaced value names `flag` and the override
  // ("--topo-set node.nics.bandwidth=fast: field 'node.nics.bandwidth': ...").
  static InputNode load_file(const std::string& path, const std::vector<FieldOverride>& overrides,
                             const std::string& flag, std::string_view scalar_field = "",
                             std::string_view scalar_key = "");
  static InputNode load_string(const std::string& text, const std::string& display_name);

  bool is_map() const { return node_.IsMap(); }
  bool is_sequence() const { return node_.IsSequence(); }
  bool is_scalar() const { return node_.IsScalar(); }
  bool is_null() const { return !node_ || node_.IsNull(); }

  bool has(std::string_view key) const;
  InputNode operator[](std::string_view key) const;                // required field
  std::optional<InputNode> get(std::string_view key) const;        // optional field
  std::vector<InputNode> items() const;                            // sequence elements
  std::vector<std::pair<std::string, InputNode>> entries() const;  // map entries in file order

  std::string as_string() const;
  int64_t as_int() const;
  // An integer for a count, size or index: within +-(2^30 - 1), so that it fits an int and
  // products of two such values are not far from fitting (a wrapped value would pass checks).
  int as_small_int() const;
  double as_double() const;  // finite: "inf" and "nan" are errors
  bool as_bool() const;
  double as_quantity(Dimension dim) const;  // a number in base units or "25 GB/s"
  std::vector<int> as_small_int_list() const;

  // Maps a string to an enum value from a table of (name, value) pairs.
  template <class E>
  E as_enum(std::initializer_list<std::pair<std::string_view, E>> table) const {
    std::string s = as_string();
    std::vector<std::string> names;
    for (const auto& [name, value] : table) {
      if (name == s) return value;
      names.emplace_back(name);
    }
    fail_unknown(s, names);
  }

  // Optional-field shorthands.
  std::string get_string(std::string_view key, const std::string& fallback) const;
  int get_small_int(std::string_view key, int fallback) const;
  double get_double(std::string_view key, double fallback) const;
  bool get_bool(std::string_view key, bool fallback) const;
  double get_quantity(std::string_view key, Dimension dim, double fallback) const;

  // Rejects keys outside `allowed` (catches typos: "unknown field 'hiden' (did you mean ...)").
  void check_keys(std::initializer_list<std::string_view> allowed) const;

  // Throws InputError "file:line: field 'path': message".
  [[noreturn]] void fail(const std::string& message) const;
  [[noreturn]] void fail_unknown(const std::string& value,
                                 const std::vector<std::string>& known) const;

  const std::string& path() const { return path_; }
  const std::string& file() const { return *file_; }
  int line() const;

 private:
  // Fields replaced from the command line, and where they came from ("--topo-set a.b=v").
  struct Replaced {
    std::string field;  // "a.b"
    std::string origin;
  };
  using ReplacedList = std::shared_ptr<const std::vector<Replaced>>;

  // YAML::Node has reference semantics: copying it is cheap and shares the document.
  InputNode(const YAML::Node& node, std::shared_ptr<const std::string> file, std::string path,
            YAML::Mark mark, ReplacedList replaced = nullptr)
      : node_(node),
        file_(std::move(file)),
        path_(std::move(path)),
        mark_(mark),
        replaced_(std::move(replaced)) {}
  InputNode child(const YAML::Node& n, std::string path) const;
  std::string location() const;

  YAML::Node node_;
  std::shared_ptr<const std::string> file_;
  std::string path_;
  YAML::Mark mark_;  // where this node (or, if missing, its parent) is
  ReplacedList replaced_;
};

// Runs `parse` and turns an InputError into an Error; any other exception also becomes an Error
// (with the file name) instead of escaping.
template <class T, class F>
Expected<T> catch_input_errors(const std::string& what, F&& parse) {
  try {
    return parse();
  } catch (const InputError& e) {
    return Error(e.what());
  } catch (const std::exception& e) {
    return Error(what + ": " + e.what());
  }
}

}  // namespace nnsim
