// Helpers the model and operator-graph tests share: a part's parameters, FLOPs, operators by
// name, and a model YAML edited or refused.
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/opgraph.h"

namespace nnsim::test {

inline double params(const GraphPart& part) {
  double n = 0;
  for (const Op& op : part.ops) n += op.parameters();
  return n;
}

inline double fwd(const GraphPart& part) {
  double f = 0;
  for (const Op& op : part.ops) f += op.fwd_flops;
  return f;
}

inline const Op* find_op(const GraphPart& part, const std::string& name) {
  for (const Op& op : part.ops) {
    if (op.name == name) return &op;
  }
  return nullptr;
}

inline std::vector<std::string> names(const GraphPart& part) {
  std::vector<std::string> out;
  for (const Op& op : part.ops) out.push_back(op.name);
  return out;
}

// `text` with the first `from` replaced by `to` (a failed expectation when it has none).
inline std::string replace(std::string text, const std::string& from, const std::string& to) {
  const auto pos = text.find(from);
  EXPECT_NE(pos, std::string::npos) << from;
  return text.replace(pos, from.size(), to);
}

// The error a model YAML is refused with (a failed expectation when it is accepted).
inline std::string parse_error(const std::string& yaml) {
  auto m = parse_model(yaml, "m.yaml");
  EXPECT_FALSE(m.ok());
  return m.ok() ? "" : m.error().message();
}

}  // namespace nnsim::test
