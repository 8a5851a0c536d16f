// A model's plan as the builder makes it, compiled for a cluster, and what the plan-feature tests
// read back from the program.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>

#include "core/memory_check.h"
#include "core/program.h"
#include "planner/megatron.h"

namespace nnsim::testing {

inline Expected<Program> build_and_compile(const ModelSpec& m, const Topology& t,
                                           const MegatronOptions& o) {
  Expected<Plan> plan = build_megatron_plan(m, t, o);
  if (!plan) return plan.error();
  return compile_plan(*plan, t);
}

// The program's first template of `kind` (of `segment`; -1: any).
inline const BlockTemplate& first_template(const Program& p, BlockKind kind, int segment = -1) {
  const auto it = std::find_if(p.templates.begin(), p.templates.end(), [&](const BlockTemplate& t) {
    return t.kind == kind && (segment < 0 || t.segment == segment);
  });
  EXPECT_NE(it, p.templates.end());
  return *it;
}

// The highest of the lanes' memory peaks.
inline double highest_peak(const Program& p) {
  double peak = 0;
  for (const LaneMemoryPeak& l : lane_memory_peaks(p)) peak = std::max(peak, l.peak);
  return peak;
}

}  // namespace nnsim::testing
