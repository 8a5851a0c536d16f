// Fine-grained activation offloading in plans (docs/cost-model.md, "Fine-grained activation
// offloading"): the builder's module names, the copies and waits the compiler places around the
// chosen operators, the memory they take off the GPUs and put on the host, and what is refused.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/host_copy.h"
#include "core/memory_check.h"
#include "core/program.h"
#include "planner/constraints.h"
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

// Llama 3 8B at TP 4 over two 1F1B stages of 16 layers, 16 micro-batches.
MegatronOptions options(std::vector<std::string> modules) {
  MegatronOptions o;
  o.tp = 4;
  o.pp = 2;
  o.zero = 1;
  o.global_batch = 16;
  o.offload_modules = std::move(modules);
  return o;
}

Expected<Program> compile(const Topology& t, const MegatronOptions& o) {
  return testing::build_and_compile(llama8b(), t, o);
}

std::vector<const Step*> copies(const BlockTemplate& t, StepKind kind) {
  std::vector<const Step*> out;
  for (const Step& s : t.steps) {
    if (s.kind == kind) out.push_back(&s);
  }
  return out;
}

bool has(const std::string& message, const std::string& part) {
  return message.find(part) != std::string::npos;
}

// Each layer copies what its core attention saves right after that operator's forward, and
// waits at its end for the layer before's copy; the backward brings each copy back one ahead
// and waits for it just before the operator's backward. The last stage keeps its last layer's.
TEST(ModuleOffloadPlan, CopiesWhatTheChosenOperatorsSave) {
  const Topology t = dgx_a100();
  Expected<Program> none = compile(t, options({}));
  Expected<Program> attn = compile(t, options({"core_attn"}));
  ASSERT_TRUE(none.ok()) << none.error().message();
  ASSERT_TRUE(attn.ok()) << attn.error().message();
  EXPECT_EQ(attn->plan.activation_offload_modules, std::vector<std::string>{"attn.core"});
  for (int segment : {0, 1}) {
    SCOPED_TRACE(segment);
    const BlockTemplate& f0 = testing::first_template(*none, BlockKind::kForward, segment);
    const BlockTemplate& f = testing::first_template(*attn, BlockKind::kForward, segment);
    const std::vector<const Step*> out = copies(f, StepKind::kHostCopyLaunch);
    const int offloading_layers = segment == 0 ? 16 : 15;
    ASSERT_EQ(static_cast<int>(out.size()), offloading_layers);
    double bytes = 0;
    for (const Step* s : out) {
      EXPECT_TRUE(s->to_host);
      EXPECT_DOUBLE_EQ(s->seconds, host_copy_seconds(s->bytes, true, t, attn->compute_model));
      bytes += s->bytes;
    }
    EXPECT_NEAR(f0.kept_bytes - f.kept_bytes, bytes, 1e-9 * bytes);
    // Each copy follows its operator's compute.
    for (size_t i = 1; i < f.steps.size(); ++i) {
      if (f.steps[i].kind != StepKind::kHostCopyLaunch) continue;
      EXPECT_EQ(attn->labels[f.steps[i - 1].label], "attn.core") << i;
    }
    // One wait a layer, leaving the layer's own copy on its way.
    const std::vector<const Step*> waits = copies(f, StepKind::kHostCopyWait);
    ASSERT_EQ(waits.size(), 16u);
    for (size_t l = 0; l < waits.size(); ++l) {
      EXPECT_EQ(waits[l]->tag, segment == 1 && l == 15 ? 0 : 1) << l;
    }

    // The backward: as much back, each wait right before core attention's backward, leaving
    // only the next group's reload running.
    const BlockTemplate& b = testing::first_template(*attn, BlockKind::kBackward, segment);
    EXPECT_NEAR(b.kept_bytes, -f.kept_bytes, 1e-6 * f.kept_bytes);
    const std::vector<const Step*> back = copies(b, StepKind::kHostCopyLaunch);
    ASSERT_EQ(back.size(), out.size());
    double back_bytes = 0;
    for (const Step* s : back) back_bytes += s->bytes;
    EXPECT_NEAR(back_bytes, bytes, 1e-9 * bytes);
    int waited = 0;
    for (size_t i = 0; i + 1 < b.steps.size(); ++i) {
      const Step& s = b.steps[i];
      if (s.kind != StepKind::kHostCopyWait) continue;
      EXPECT_FALSE(s.to_host);
      EXPECT_EQ(attn->labels[b.steps[i + 1].label], "attn.core") << i;
      EXPECT_EQ(s.tag, waited + 1 < offloading_layers ? 1 : 0) << waited;
      ++waited;
    }
    EXPECT_EQ(waited, offloading_layers);
  }
  // The host holds what the stages have in flight: 1F1B's first stage runs two micro-batches'
  // forwards before their backwards, the last stage one.
  const Lane& first = attn->lanes[0];
  const Lane& last = attn->lanes[1];
  EXPECT_GT(first.offloaded_activations, 0);
  EXPECT_NEAR(last.offloaded_activations, first.offloaded_activations * 15 / 16,
              1e-9 * first.offloaded_activations);
  EXPECT_DOUBLE_EQ(first.host_bytes, 2 * first.offloaded_activations);
  EXPECT_DOUBLE_EQ(last.host_bytes, last.offloaded_activations);
  EXPECT_LT(testing::highest_peak(*attn), testing::highest_peak(*none));

  // More operators, more off the GPU. (A tensor two operators save goes with the first: core
  // attention's output, which the projection saves too.)
  Expected<Program> more = compile(t, options({"core_attn", "mlp_norm", "mlp.fc1"}));
  ASSERT_TRUE(more.ok()) << more.error().message();
  EXPECT_EQ(
      copies(testing::first_template(*more, BlockKind::kForward, 0), StepKind::kHostCopyLaunch)
          .size(),
      3u * 16);
  EXPECT_GT(more->lanes[0].offloaded_activations, first.offloaded_activations);
  EXPECT_LT(testing::highest_peak(*more), testing::highest_peak(*attn));
}

// Interleaved: each chunk offloads its own layers; only the pipeline's last chunk keeps its last
// layer's, and a micro-batch's copies on a lane are its chunks' together.
TEST(ModuleOffloadPlan, EveryChunkOfAnInterleavedStageOffloads) {
  const Topology t = dgx_a100();
  MegatronOptions o = options({"core_attn"});
  o.vpp = 2;
  o.schedule = ScheduleKind::kInterleaved;
  Expected<Program> p = compile(t, o);
  ASSERT_TRUE(p.ok()) << p.error().message();
  const int last = static_cast<int>(p->plan.segments.size()) - 1;
  for (size_t l = 0; l < p->lanes.size(); ++l) {
    double bytes = 0;
    for (int segment = 0; segment <= last; ++segment) {
      const BlockTemplate& f = testing::first_template(*p, BlockKind::kForward, segment);
      if (f.lane != static_cast<int>(l)) continue;
      const std::vector<const Step*> out = copies(f, StepKind::kHostCopyLaunch);
      EXPECT_EQ(out.size(), segment == last ? 7u : 8u) << segment;
      for (const Step* s : out) bytes += s->bytes;
    }
    EXPECT_NEAR(p->lanes[l].offloaded_activations, bytes, 1e-9 * bytes) << l;
    EXPECT_GE(p->lanes[l].host_bytes, p->lanes[l].offloaded_activations) << l;
  }
}

// Offloading sits beside recomputation: what the recomputation drops is not copied, and a
// choice that leaves nothing to copy is an error.
TEST(ModuleOffloadPlan, RecomputedOperatorsHaveNothingToCopy) {
  const Topology t = dgx_a100();
  MegatronOptions o = options({"attn_proj"});
  o.recompute = RecomputeMode::kSelective;
  Expected<Program> beside = compile(t, o);
  ASSERT_TRUE(beside.ok()) << beside.error().message();
  EXPECT_FALSE(beside->plan.recompute.empty());
  EXPECT_GT(beside->lanes[0].offloaded_activations, 0);

  // Megatron's selective recomputation recomputes core attention; full recomputation every
  // operator, the layer's input staying with the checkpoint.
  for (const auto& [mode, module] : {std::pair{RecomputeMode::kSelective, "core_attn"},
                                     std::pair{RecomputeMode::kFull, "attn_norm"}}) {
    o = options({module});
    o.recompute = mode;
    Expected<Program> nothing = compile(t, o);
    ASSERT_FALSE(nothing.ok()) << module;
    EXPECT_TRUE(has(nothing.error().message(), "save nothing for the backward"))
        << nothing.error().message();
  }
}

TEST(ModuleOffloadPlan, RefusesWhatItDoesNotModel) {
  const Topology t = dgx_a100();
  auto builder_error = [&](const MegatronOptions& o, const Topology& topo) {
    Expected<Plan> p = build_megatron_plan(llama8b(), topo, o);
    return p ? std::string() : p.error().message();
  };
  MegatronOptions o = options({"expert_fc1"});
  EXPECT_TRUE(has(builder_error(o, t), "'expert_fc1' is a module this model's layers do not have"))
      << builder_error(o, t);
  o = options({"attn.nothing"});
  EXPECT_TRUE(has(builder_error(o, t), "matches no operator")) << builder_error(o, t);
  EXPECT_TRUE(has(builder_error(o, t), "attn.core")) << builder_error(o, t);
  o = options({"core_attn"});
  o.pp = 1;
  o.activation_offload = 4;
  EXPECT_TRUE(has(builder_error(o, t), "drop one")) << builder_error(o, t);
  o = options({"core_attn"});
  o.framework = "fsdp";
  o.zero = 3;
  o.pp = 1;
  EXPECT_TRUE(has(builder_error(o, t), "not --framework fsdp's")) << builder_error(o, t);
  Topology no_host = t;
  no_host.has_host = false;
  EXPECT_TRUE(has(builder_error(options({"core_attn"}), no_host), "describes no host"));

  // The compiler's checks, for plan files the builder did not write.
  Expected<Plan> plan = build_megatron_plan(llama8b(), t, options({"core_attn"}));
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  auto compile_error = [&](const Plan& p, const Topology& topo) {
    Expected<Program> prog = compile_plan(p, topo);
    return prog ? std::string() : prog.error().message();
  };
  EXPECT_TRUE(has(compile_error(*plan, no_host), "activation_offload_modules: offloaded"))
      << compile_error(*plan, no_host);
  Plan other = *plan;
  other.framework = "deepspeed";
  EXPECT_TRUE(has(compile_error(other, t), "use framework megatron"));
  Plan typo = *plan;
  typo.activation_offload_modules = {"attn.cor"};
  EXPECT_TRUE(has(compile_error(typo, t), "activation_offload_modules[0]: 'attn.cor'"))
      << compile_error(typo, t);
  MegatronOptions split = options({"core_attn"});
  split.schedule = ScheduleKind::kZbH1;
  EXPECT_TRUE(has(builder_error(split, t), "unpaired F and B blocks only"))
      << builder_error(split, t);
}

// The plan file carries the operator patterns; one form of offloading at a time.
TEST(ModuleOffloadPlan, ThePlanFileCarriesIt) {
  Expected<Plan> plan = build_megatron_plan(llama8b(), dgx_a100(), options({"core_attn"}));
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  const std::string text = plan_to_json(*plan);
  Expected<Plan> back = parse_plan(text, "offload.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->activation_offload_modules, std::vector<std::string>{"attn.core"});
  std::string both = text;
  const std::string field = "\"activation_offload_modules\"";
  ASSERT_NE(both.find(field), std::string::npos) << text;
  both.insert(both.find(field), "\"activation_offload_layers\": 2, ");
  Expected<Plan> refused = parse_plan(both, "offload.json");
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(has(refused.error().message(), "offload.json")) << refused.error().message();
  EXPECT_TRUE(has(refused.error().message(), "remove one of them")) << refused.error().message();
  Expected<Plan> without = build_megatron_plan(llama8b(), dgx_a100(), options({}));
  ASSERT_TRUE(without.ok());
  EXPECT_FALSE(has(plan_to_json(*without), "activation_offload_modules"));

  // The host's memory check names it.
  Topology small_host = dgx_a100();
  small_host.host.memory = 1e9;
  Expected<Program> p = compile(small_host, options({"core_attn"}));
  ASSERT_TRUE(p.ok()) << p.error().message();
  Status fits = check_memory_fits(*p);
  ASSERT_FALSE(fits.ok());
  EXPECT_TRUE(has(fits.error().message(), "of offloaded activations")) << fits.error().message();
  EXPECT_TRUE(has(fits.error().message(), "fewer activation_offload_modules (--offload-modules)"))
      << fits.error().message();
}

// Llama 3 8B on one DGX A100 at 32 sequences a step: candidates that do not fit offload the
// fewest modules, in offloadable_modules' order, that make them fit, pipelined ones too.
TEST(ModuleOffloadPlan, TheSearchOffloadsTheFewestModulesThatFit) {
  const Topology t = dgx_a100();
  EXPECT_EQ(
      offloadable_modules(llama8b()),
      (std::vector<std::string>{"core_attn", "qkv_linear", "attn_proj", "mlp_norm", "attn_norm"}));
  SearchOptions o;
  o.global_batch = 32;
  o.jobs = 2;
  o.confirm = 0;
  o.top = 2000;
  Expected<SearchResult> plain = search_plans(llama8b(), t, o);
  ASSERT_TRUE(plain.ok()) << plain.error().message();
  for (const Candidate& c : plain->ranked) EXPECT_TRUE(c.options.offload_modules.empty());
  o.module_offload_as_needed = true;
  Expected<SearchResult> r = search_plans(llama8b(), t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const double usable = t.gpu.hbm_bytes * (1 - o.memory_headroom);
  const std::vector<std::string> order = offloadable_modules(llama8b());
  int offloading = 0, pipelined = 0;
  for (const Candidate& c : r->ranked) {
    EXPECT_LE(c.estimate.peak_memory, usable) << c.describe();
    const std::vector<std::string>& m = c.options.offload_modules;
    if (m.empty()) continue;
    // In the order, each lowering the peak.
    for (size_t i = 1; i < m.size(); ++i) {
      EXPECT_LT(std::find(order.begin(), order.end(), m[i - 1]),
                std::find(order.begin(), order.end(), m[i]))
          << c.describe();
    }
    pipelined += c.options.pp > 1 ? 1 : 0;
    if (offloading++ < 3) {
      // One module fewer does not fit.
      MegatronOptions fewer = c.options;
      fewer.offload_modules.pop_back();
      Expected<Plan> plan = build_megatron_plan(llama8b(), t, fewer);
      ASSERT_TRUE(plan.ok()) << plan.error().message();
      Expected<Program> prog = compile_plan(*plan, t);
      if (prog) {
        EXPECT_GT(estimate_program(*prog).peak_memory, usable) << c.describe();
      }
    }
  }
  EXPECT_GT(offloading, 0);
  EXPECT_GT(pipelined, 0);
  EXPECT_GT(r->ranked.size(), plain->ranked.size());

  // Modules the constraints name are in every plan, and the search adds to them as needed.
  Expected<Constraints> c = parse_constraints("offload_modules: [qkv_linear]\n", "c.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message();
  o.constraints = *c;
  Expected<SearchResult> pinned = search_plans(llama8b(), t, o);
  ASSERT_TRUE(pinned.ok()) << pinned.error().message();
  ASSERT_FALSE(pinned->ranked.empty());
  bool added = false;
  for (const Candidate& c : pinned->ranked) {
    const std::vector<std::string>& m = c.options.offload_modules;
    ASSERT_FALSE(m.empty()) << c.describe();
    EXPECT_EQ(m.front(), "qkv_linear") << c.describe();
    added = added || m.size() > 1;
  }
  EXPECT_TRUE(added);
  ASSERT_FALSE(pinned->best.activation_offload_modules.empty());
  EXPECT_EQ(pinned->best.activation_offload_modules.front(), "attn.qkv");
  o.constraints.offload_modules = {"expert_fc1"};
  Expected<SearchResult> absent = search_plans(llama8b(), t, o);
  ASSERT_FALSE(absent.ok());
  EXPECT_TRUE(has(absent.error().message(), "c.yaml: field 'offload_modules': 'expert_fc1'"))
      << absent.error().message();
  o.constraints.offload_modules.clear();

  o.framework = "fsdp";
  Expected<SearchResult> fsdp = search_plans(llama8b(), t, o);
  ASSERT_FALSE(fsdp.ok());
  EXPECT_TRUE(has(fsdp.error().message(), "not --framework fsdp's")) << fsdp.error().message();
  o.framework = "megatron";
  Topology no_host = t;
  no_host.has_host = false;
  Expected<SearchResult> refused = search_plans(llama8b(), no_host, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(has(refused.error().message(), "describes no host"));
}

}  // namespace
}  // namespace nnsim
