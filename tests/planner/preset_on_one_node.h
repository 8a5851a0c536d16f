// A model preset on one DGX H100 node, planned by the Megatron builder and compiled: the fixture
// the hybrid-model planning tests share, and the steps of the first forward block they read.
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/megatron.h"

namespace nnsim::test {

class PresetOnOneNode : public ::testing::Test {
 protected:
  explicit PresetOnOneNode(std::string preset) : preset_(std::move(preset)) {}
  void SetUp() override {
    Expected<ModelSpec> m = load_model(preset_);
    ASSERT_TRUE(m.ok()) << m.error().message();
    model = *m;
    Expected<Topology> t = load_topology("dgx-h100-superpod");
    ASSERT_TRUE(t.ok());
    Expected<Topology> r = resize_topology(*t, 1);
    ASSERT_TRUE(r.ok());
    topo = *r;
    o.global_batch = 16;
  }
  Expected<Program> compile(const MegatronOptions& opts) const {
    Expected<Plan> plan = build_megatron_plan(model, topo, opts);
    if (!plan) return plan.error();
    return compile_plan(*plan, topo);
  }
  ModelSpec model;
  Topology topo;
  MegatronOptions o;

 private:
  std::string preset_;
};

// Lane 0's first forward block.
inline const BlockTemplate* first_forward(const Program& p) {
  for (const BlockTemplate& t : p.templates) {
    if (t.lane == 0 && t.kind == BlockKind::kForward) return &t;
  }
  return nullptr;
}

// The FLOPs of operator `op`'s compute steps in lane 0's first forward block.
inline double forward_flops(const Program& p, const std::string& op) {
  double f = 0;
  for (const Step& s : first_forward(p)->steps) {
    if (s.kind == StepKind::kCompute && p.labels[s.label] == op) f += s.flops;
  }
  return f;
}

// The bytes of the all-to-alls in lane 0's first forward block, in order; with `label_prefix`,
// of those labelled by an operator whose name starts with it.
inline std::vector<double> forward_all_to_alls(const Program& p,
                                               const std::string& label_prefix = "") {
  std::vector<double> bytes;
  for (const Step& s : first_forward(p)->steps) {
    if (s.kind == StepKind::kCollective && s.collective == CollectiveKind::kAllToAll &&
        p.labels[s.label].rfind(label_prefix, 0) == 0) {
      bytes.push_back(s.bytes);
    }
  }
  return bytes;
}

}  // namespace nnsim::test
