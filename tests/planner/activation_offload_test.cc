// Activation offloading in plans (docs/cost-model.md, "Activation offloading"): what the builder
// accepts, the copies and memory the compiler gives a plan, the host's memory check, and the
// search offloading what each plan needs.
#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/host_copy.h"
#include "core/memory_check.h"
#include "core/program.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/search.h"
#include "tests/support/compiled_plan.h"
#include "tests/support/preset_model.h"
#include "tests/support/preset_topology.h"

namespace nnsim {
namespace {

Topology dgx_a100() {
  return testing::preset_topology("dgx-a100x4", 1);
}

const ModelSpec& llama8b() {
  return testing::preset_model("llama3-8b");
}

// Llama 3 8B at tp 4 on one stage: 32 layers of 8,192 tokens.
MegatronOptions options(int offloaded) {
  MegatronOptions o;
  o.tp = 4;
  o.pp = 1;
  o.zero = 1;
  o.global_batch = 16;
  o.activation_offload = offloaded;
  return o;
}

Expected<Program> compile(const Topology& t, const MegatronOptions& o) {
  return testing::build_and_compile(llama8b(), t, o);
}

int count_steps(const BlockTemplate& t, StepKind kind, bool to_host) {
  return static_cast<int>(std::count_if(t.steps.begin(), t.steps.end(), [&](const Step& s) {
    return s.kind == kind && s.to_host == to_host;
  }));
}

// The first N layers' activations leave the GPU after the forward: the forward keeps that much
// less, the host holds it, each layer is copied out and back once, and the peak falls with N.
TEST(ActivationOffloadPlan, MovesTheFirstLayersActivationsToTheHost) {
  const Topology t = dgx_a100();
  Expected<Program> none = compile(t, options(0));
  Expected<Program> eight = compile(t, options(8));
  ASSERT_TRUE(none.ok()) << none.error().message();
  ASSERT_TRUE(eight.ok()) << eight.error().message();
  EXPECT_EQ(eight->plan.activation_offload_layers, 8);
  double offloaded = 0;
  for (int l = 0; l < 8; ++l) offloaded += eight->layer_activation_bytes[l];
  ASSERT_GT(offloaded, 0);
  const BlockTemplate& f0 = testing::first_template(*none, BlockKind::kForward);
  const BlockTemplate& f8 = testing::first_template(*eight, BlockKind::kForward);
  EXPECT_NEAR(f0.kept_bytes - f8.kept_bytes, offloaded, 1e-6 * offloaded);
  // The backward frees what stayed; the offloaded layers come back and go within it.
  EXPECT_NEAR(testing::first_template(*eight, BlockKind::kBackward).kept_bytes, -f8.kept_bytes, 1);
  const Lane& lane = eight->lanes[0];
  EXPECT_NEAR(lane.offloaded_activations, offloaded, 1e-6 * offloaded);
  EXPECT_DOUBLE_EQ(lane.host_bytes, lane.offloaded_activations);
  EXPECT_EQ(none->lanes[0].host_bytes, 0);
  // Eight GPUs of the node, one micro-batch's activations each.
  EXPECT_DOUBLE_EQ(busiest_host_memory(*eight).bytes, 8 * lane.host_bytes);

  // One copy out per offloaded layer, each waited for; one back, the last waited for twice
  // (its window's and the first layer's backward).
  EXPECT_EQ(count_steps(f8, StepKind::kHostCopyLaunch, true), 8);
  EXPECT_EQ(count_steps(f8, StepKind::kHostCopyWait, true), 8);
  const BlockTemplate& b8 = testing::first_template(*eight, BlockKind::kBackward);
  EXPECT_EQ(count_steps(b8, StepKind::kHostCopyLaunch, false), 8);
  EXPECT_EQ(count_steps(b8, StepKind::kHostCopyWait, false), 9);
  EXPECT_EQ(count_steps(f0, StepKind::kHostCopyLaunch, true), 0);
  int layer = 0;
  for (const Step& s : f8.steps) {
    if (s.kind != StepKind::kHostCopyLaunch) continue;
    EXPECT_NEAR(s.bytes, eight->layer_activation_bytes[layer], 1e-6 * s.bytes);
    EXPECT_DOUBLE_EQ(s.seconds, host_copy_seconds(s.bytes, true, t, eight->compute_model));
    ++layer;
  }

  double last = testing::highest_peak(*none);
  for (int n : {8, 16, 31}) {
    Expected<Program> p = compile(t, options(n));
    ASSERT_TRUE(p.ok()) << p.error().message();
    EXPECT_LT(testing::highest_peak(*p), last) << n;
    last = testing::highest_peak(*p);
  }
}

// The copies run beside the compute: over a link fast enough they cost nothing; over a slow
// one every copy of every micro-batch waits in line, out and back.
TEST(ActivationOffloadPlan, TheCopiesRunBesideTheCompute) {
  Topology fast = dgx_a100();
  fast.host.link_bandwidth = 1e18;
  Expected<Program> none = compile(fast, options(0));
  Expected<Program> hidden = compile(fast, options(8));
  ASSERT_TRUE(none.ok()) << none.error().message();
  ASSERT_TRUE(hidden.ok()) << hidden.error().message();
  const double base = estimate_program(*none).iteration_time;
  EXPECT_NEAR(estimate_program(*hidden).iteration_time, base, 1e-9 * base);

  Topology slow = dgx_a100();
  slow.host.link_bandwidth = 1e8;
  Expected<Program> exposed = compile(slow, options(8));
  ASSERT_TRUE(exposed.ok()) << exposed.error().message();
  const double bytes = exposed->lanes[0].offloaded_activations;
  const double copies =
      exposed->micro_batches * (host_copy_seconds(bytes, true, slow, exposed->compute_model) +
                                host_copy_seconds(bytes, false, slow, exposed->compute_model));
  const double t = estimate_program(*exposed).iteration_time;
  EXPECT_GE(t, copies);
  EXPECT_LE(t, copies + base);
}

TEST(ActivationOffloadPlan, RefusesWhatMegatronCoreRefuses) {
  const Topology t = dgx_a100();
  auto builder_error = [&](const MegatronOptions& o, const Topology& topo) {
    Expected<Plan> p = build_megatron_plan(llama8b(), topo, o);
    return p ? std::string() : p.error().message();
  };
  auto has = [](const std::string& message, const std::string& part) {
    return message.find(part) != std::string::npos;
  };
  MegatronOptions o = options(32);
  EXPECT_TRUE(has(builder_error(o, t), "from 1 to 31")) << builder_error(o, t);
  o = options(-1);
  EXPECT_TRUE(has(builder_error(o, t), "from 1 to 31"));
  o = options(8);
  o.pp = 2;
  EXPECT_TRUE(has(builder_error(o, t), "use --pp 1")) << builder_error(o, t);
  o = options(8);
  o.recompute = RecomputeMode::kSelective;
  EXPECT_TRUE(has(builder_error(o, t), "drop --recompute")) << builder_error(o, t);
  o = options(8);
  o.framework = "fsdp";
  o.zero = 3;
  EXPECT_TRUE(has(builder_error(o, t), "not --framework fsdp's")) << builder_error(o, t);
  Topology no_host = t;
  no_host.has_host = false;
  EXPECT_TRUE(has(builder_error(options(8), no_host), "describes no host"));

  // A plan file the builder did not write meets the same checks in the compiler.
  Expected<Plan> plan = build_megatron_plan(llama8b(), t, options(8));
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  auto compile_error = [&](const Plan& p, const Topology& topo) {
    Expected<Program> prog = compile_plan(p, topo);
    return prog ? std::string() : prog.error().message();
  };
  EXPECT_TRUE(has(compile_error(*plan, no_host), "activation_offload_layers 8"));
  EXPECT_TRUE(has(compile_error(*plan, no_host), "describes no host"));
  Plan recomputing = *plan;
  recomputing.recompute.push_back({"*", 0, -1});
  EXPECT_TRUE(has(compile_error(recomputing, t), "remove the recompute rules"))
      << compile_error(recomputing, t);
  Plan other = *plan;
  other.framework = "deepspeed";
  EXPECT_TRUE(has(compile_error(other, t), "use framework megatron"));
  MegatronOptions staged = options(0);
  staged.tp = 2;
  staged.pp = 2;
  Expected<Plan> two = build_megatron_plan(llama8b(), t, staged);
  ASSERT_TRUE(two.ok()) << two.error().message();
  two->activation_offload_layers = 4;
  EXPECT_TRUE(has(compile_error(*two, t), "the plan has 2 segments")) << compile_error(*two, t);
}

// The plan file carries the count, and reading it checks it.
TEST(ActivationOffloadPlan, ThePlanFileCarriesIt) {
  Expected<Plan> plan = build_megatron_plan(llama8b(), dgx_a100(), options(8));
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  const std::string text = plan_to_json(*plan);
  Expected<Plan> back = parse_plan(text, "offload.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->activation_offload_layers, 8);
  std::string bad = text;
  const std::string field = "\"activation_offload_layers\": 8";
  ASSERT_NE(bad.find(field), std::string::npos) << text;
  bad.replace(bad.find(field), field.size(), "\"activation_offload_layers\": 32");
  Expected<Plan> refused = parse_plan(bad, "offload.json");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("offload.json"), std::string::npos);
  EXPECT_NE(refused.error().message().find("activation_offload_layers"), std::string::npos);
  EXPECT_NE(refused.error().message().find("from 0 to 31"), std::string::npos)
      << refused.error().message();
  Expected<Plan> without = build_megatron_plan(llama8b(), dgx_a100(), options(0));
  ASSERT_TRUE(without.ok());
  EXPECT_EQ(plan_to_json(*without).find("activation_offload_layers"), std::string::npos);
}

TEST(ActivationOffloadPlan, TheMemoryChecksNameIt) {
  Topology small_host = dgx_a100();
  small_host.host.memory = 1e9;
  Expected<Program> p = compile(small_host, options(8));
  ASSERT_TRUE(p.ok()) << p.error().message();
  Status fits = check_memory_fits(*p);
  ASSERT_FALSE(fits.ok());
  const std::string& message = fits.error().message();
  EXPECT_NE(message.find("node 0's GPUs keep"), std::string::npos) << message;
  EXPECT_NE(message.find("of offloaded activations"), std::string::npos) << message;
  EXPECT_NE(message.find("fewer activation_offload_layers (--activation-offload)"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("--optimizer-offload"), std::string::npos) << message;

  // A plan too big for its GPUs on one stage without recomputation: offloading activations is
  // among the fixes where there is a host, and not once the plan recomputes.
  Topology tight = dgx_a100();
  tight.gpu.hbm_bytes = 1e9;
  Expected<Program> big = compile(tight, options(0));
  ASSERT_TRUE(big.ok()) << big.error().message();
  EXPECT_NE(check_memory_fits(*big).error().message().find(
                "activation offloading (--activation-offload)"),
            std::string::npos);
  MegatronOptions recompute = options(0);
  recompute.recompute = RecomputeMode::kFull;
  big = compile(tight, recompute);
  ASSERT_TRUE(big.ok()) << big.error().message();
  EXPECT_EQ(check_memory_fits(*big).error().message().find("--activation-offload"),
            std::string::npos);
}

// Llama 3 8B on one DGX A100 at 32 sequences a step: plans on one stage without recomputation
// that do not fit offload the fewest layers that make them fit; recomputing and pipelined plans
// compete beside them.
TEST(ActivationOffloadPlan, TheSearchOffloadsTheFewestLayersThatFit) {
  const Topology t = dgx_a100();
  SearchOptions o;
  o.global_batch = 32;
  o.jobs = 2;
  o.confirm = 0;
  o.top = 1000;
  Expected<SearchResult> plain = search_plans(llama8b(), t, o);
  ASSERT_TRUE(plain.ok()) << plain.error().message();
  for (const Candidate& c : plain->ranked) EXPECT_EQ(c.options.activation_offload, 0);
  o.activation_offload_as_needed = true;
  Expected<SearchResult> r = search_plans(llama8b(), t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const double usable = t.gpu.hbm_bytes * (1 - o.memory_headroom);
  int offloading = 0;
  for (const Candidate& c : r->ranked) {
    EXPECT_LE(c.estimate.peak_memory, usable) << c.describe();
    const int n = c.options.activation_offload;
    if (n == 0) continue;
    EXPECT_EQ(c.options.pp, 1) << c.describe();
    EXPECT_EQ(c.options.recompute, RecomputeMode::kNone) << c.describe();
    if (offloading++ < 3) {
      // One layer fewer does not fit.
      MegatronOptions fewer = c.options;
      fewer.activation_offload = n - 1;
      Expected<Plan> plan = build_megatron_plan(llama8b(), t, fewer);
      ASSERT_TRUE(plan.ok()) << plan.error().message();
      Expected<Program> prog = compile_plan(*plan, t);
      ASSERT_TRUE(prog.ok()) << prog.error().message();
      EXPECT_GT(estimate_program(*prog).peak_memory, usable) << c.describe();
    }
  }
  EXPECT_GT(offloading, 0);
  EXPECT_GT(r->ranked.size(), plain->ranked.size());

  o.framework = "fsdp";
  Expected<SearchResult> fsdp = search_plans(llama8b(), t, o);
  ASSERT_FALSE(fsdp.ok());
  EXPECT_NE(fsdp.error().message().find("not --framework fsdp's"), std::string::npos);
  o.framework = "megatron";
  Topology no_host = t;
  no_host.has_host = false;
  Expected<SearchResult> refused = search_plans(llama8b(), no_host, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("describes no host"), std::string::npos);
}

}  // namespace
}  // namespace nnsim
