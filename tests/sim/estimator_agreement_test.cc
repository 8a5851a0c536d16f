// The plan search's estimator against the simulator it stands in for, where the two once
// parted: what the estimator decides about compute slowed by communication beside it.
#include <gtest/gtest.h>

#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "sim/simulator.h"
#include "tests/support/preset_topology.h"

namespace nnsim {
namespace {

// Llama 3 8B at 65,536 tokens on one DGX H100, context parallel over the eight GPUs, ZeRO-2:
// each micro-batch's gradients are reduce-scattered during its backward, beside the ring
// attention's blocking exchanges. The simulator runs each exchange on its own, so a gradient
// reduction under way slows only the compute that starts beside it; an estimator that folded
// the exchanges into the compute around them slowed whole backwards and came out 7 % slow.
TEST(EstimatorAgreement, ABlockingCollectiveIsAStretchOfItsOwn) {
  const Topology node = testing::preset_topology("dgx-h100-superpod", 1);
  Expected<ModelSpec> m = load_model("llama3-8b");
  ASSERT_TRUE(m.ok()) << m.error().message();
  m->seq_len = 65536;
  MegatronOptions o;
  o.tp = 1;
  o.pp = 1;
  o.cp = 8;
  o.zero = 2;
  o.global_batch = 8;
  Expected<Plan> plan = build_megatron_plan(*m, node, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  Expected<Program> prog = compile_plan(*plan, node);
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  Expected<SimResult> r = simulate(*prog);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_NEAR(estimate_program(*prog).iteration_time, r->iteration_time, 0.01 * r->iteration_time);
}

}  // namespace
}  // namespace nnsim
