// A model preset, loaded once per test binary, every failure reported as a test failure.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "core/model.h"

namespace nnsim::testing {

inline const ModelSpec& preset_model(const std::string& name) {
  static std::map<std::string, ModelSpec> loaded;
  auto it = loaded.find(name);
  if (it == loaded.end()) {
    Expected<ModelSpec> m = load_model(name);
    EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
    it = loaded.emplace(name, m ? *m : ModelSpec{}).first;
  }
  return it->second;
}

}  // namespace nnsim::testing
