// A topology preset resized to a number of nodes, every failure reported as a test failure.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/topology.h"

namespace nnsim::testing {

inline Topology preset_topology(const std::string& name, int nodes) {
  Expected<Topology> t = load_topology(name);
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  if (!t) return {};
  Expected<Topology> r = resize_topology(*t, nodes);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
  if (!r) return {};
  return *r;
}

}  // namespace nnsim::testing
