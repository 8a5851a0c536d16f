// Optimizer offloading in plans: the builder's options, the compiled memory and optimizer step,
// the host's memory check, and the search planning with it.
#include <algorithm>
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "core/host_copy.h"
#include "core/memory_check.h"
#include "core/optimizer_offload.h"
#include "core/program.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/search.h"
#include "tests/support/preset_topology.h"

namespace nnsim {
namespace {

Topology one_node() {
  return testing::preset_topology("dgx-a100x4", 1);
}

MegatronOptions gpt_options(double offload, bool overlap) {
  MegatronOptions o;
  o.tp = 4;
  o.pp = 1;
  o.zero = 1;
  o.global_batch = 16;
  o.optimizer_offload = offload;
  o.offload_overlap = overlap;
  return o;
}

Expected<Program> compile_gpt(const Topology& t, double offload, bool overlap) {
  const ModelSpec m = *load_model("gpt3-1.3b");
  Expected<Plan> plan = build_megatron_plan(m, t, gpt_options(offload, overlap));
  if (!plan) return plan.error();
  return compile_plan(*plan, t);
}

// Llama 3 8B's options on one DGX A100 under ZeRO-3, data parallel only, 16 sequences a step.
MegatronOptions zero3_options(const std::string& framework) {
  MegatronOptions o;
  o.tp = 1;
  o.pp = 1;
  o.zero = 3;
  o.framework = framework;
  o.global_batch = 16;
  return o;
}

double optimizer_step_seconds(const Program& p) {
  for (const Step& s : p.lanes[0].epilogue) {
    if (s.kind == StepKind::kCompute && s.compute_class == ComputeClass::kOptimizer) {
      return s.seconds;
    }
  }
  ADD_FAILURE() << "no optimizer step";
  return 0;
}

TEST(OptimizerOffloadPlan, MovesTheStateToTheHostAndPaysTheCopies) {
  const Topology t = one_node();
  Expected<Program> gpu = compile_gpt(t, 0, false);
  Expected<Program> half = compile_gpt(t, 0.5, false);
  ASSERT_TRUE(gpu.ok()) << gpu.error().message();
  ASSERT_TRUE(half.ok()) << half.error().message();
  EXPECT_EQ(half->plan.optimizer.offload_fraction, 0.5);
  // Megatron's host copies are fp32.
  EXPECT_EQ(half->plan.optimizer.offload_param_bytes, 4);
  const Lane& a = gpu->lanes[0];
  const Lane& b = half->lanes[0];
  EXPECT_DOUBLE_EQ(b.memory.optimizer, a.memory.optimizer / 2);
  EXPECT_EQ(b.memory.gradients, a.memory.gradients);
  EXPECT_EQ(a.host_bytes, 0);
  // ZeRO-1 over dp 2: half of the shard's 12 + 4 bytes a parameter.
  const double shard = a.memory.optimizer / 12;
  EXPECT_DOUBLE_EQ(b.host_bytes, 0.5 * shard * 16);
  EXPECT_EQ(busiest_host_memory(*gpu).node, -1);
  EXPECT_DOUBLE_EQ(busiest_host_memory(*half).bytes, 8 * b.host_bytes);

  // The step is the offloaded one; with nothing else after it, the estimate moves by as much.
  const double largest = 51200.0 * 2048 / 4;  // the embedding's rows over tp (50,257 padded)
  const OffloadedStep step =
      offloaded_optimizer_step(shard, largest, half->plan.optimizer, t, half->compute_model);
  EXPECT_NEAR(optimizer_step_seconds(*half), step.seconds, 1e-9);
  EXPECT_GT(optimizer_step_seconds(*half), optimizer_step_seconds(*gpu));
  EXPECT_NEAR(estimate_program(*half).iteration_time - estimate_program(*gpu).iteration_time,
              optimizer_step_seconds(*half) - optimizer_step_seconds(*gpu), 1e-6);

  Expected<Program> overlap = compile_gpt(t, 0.5, true);
  ASSERT_TRUE(overlap.ok()) << overlap.error().message();
  EXPECT_LT(optimizer_step_seconds(*overlap), optimizer_step_seconds(*half));
}

TEST(OptimizerOffloadPlan, DeepSpeedCopiesBack16BitParameters) {
  const Topology t = one_node();
  MegatronOptions o = gpt_options(1, false);
  o.framework = "deepspeed";
  Expected<Plan> plan = build_megatron_plan(*load_model("gpt3-1.3b"), t, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_EQ(plan->optimizer.offload_param_bytes, 2);
}

TEST(OptimizerOffloadPlan, BadOptionsAreRefused) {
  const Topology t = one_node();
  const ModelSpec m = *load_model("gpt3-1.3b");
  auto error = [&](const MegatronOptions& o) {
    Expected<Plan> p = build_megatron_plan(m, t, o);
    return p ? std::string() : p.error().message();
  };
  EXPECT_NE(error(gpt_options(1.5, false)).find("from 0 to 1"), std::string::npos);
  EXPECT_NE(error(gpt_options(0, true)).find("add --optimizer-offload"), std::string::npos);
  MegatronOptions fsdp = gpt_options(0.5, false);
  fsdp.framework = "fsdp";
  fsdp.zero = 3;
  EXPECT_NE(error(fsdp).find("CPUOffload moves all"), std::string::npos) << error(fsdp);
}

TEST(OptimizerOffloadPlan, NeedsAHostThatHoldsIt) {
  Topology no_host = one_node();
  no_host.has_host = false;
  // The builder refuses, and so does the compiler a plan written for another cluster.
  Expected<Program> p = compile_gpt(no_host, 1, false);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message().find("describes no host: add node.host"), std::string::npos)
      << p.error().message();
  Expected<Plan> offloading =
      build_megatron_plan(*load_model("gpt3-1.3b"), one_node(), gpt_options(1, false));
  ASSERT_TRUE(offloading.ok()) << offloading.error().message();
  p = compile_plan(*offloading, no_host);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message().find("optimizer.offload_fraction 1 keeps optimizer state in host "
                                     "memory"),
            std::string::npos)
      << p.error().message();

  Topology small = one_node();
  small.host.memory = 1e9;
  p = compile_gpt(small, 1, false);
  ASSERT_TRUE(p.ok()) << p.error().message();
  Status fits = check_memory_fits(*p);
  ASSERT_FALSE(fits.ok());
  EXPECT_NE(fits.error().message().find("does not fit in host memory: node 0"), std::string::npos)
      << fits.error().message();
  EXPECT_TRUE(check_memory_fits(*compile_gpt(one_node(), 1, false)).ok());

  // A plan too big for its GPUs: offloading is among the fixes where there is a host.
  Topology tight = one_node();
  tight.gpu.hbm_bytes = 1e9;
  Expected<Program> big = compile_gpt(tight, 0, false);
  ASSERT_TRUE(big.ok()) << big.error().message();
  Status over = check_memory_fits(*big);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.error().message().find("optimizer offloading (--optimizer-offload)"),
            std::string::npos)
      << over.error().message();
  tight.has_host = false;
  big = compile_gpt(tight, 0, false);
  ASSERT_TRUE(big.ok()) << big.error().message();
  EXPECT_EQ(check_memory_fits(*big).error().message().find("offload"), std::string::npos);
}

// FSDP's CPUOffload: the GPU keeps no shard at all, only ZeRO-3's gathered working set; the
// host keeps the fp32 parameters, gradients and Adam's moments; every gather copies its shard
// in first and every reduction copies its shard out, on the data-parallel stream, and the
// host's update needs no copies of its own.
TEST(OptimizerOffloadPlan, FsdpMovesItsShardsToTheHost) {
  const Topology t = one_node();
  const ModelSpec m = *load_model("llama3-8b");
  MegatronOptions o = zero3_options("fsdp");
  Expected<Plan> gpu_plan = build_megatron_plan(m, t, o);
  o.optimizer_offload = 1;
  Expected<Plan> host_plan = build_megatron_plan(m, t, o);
  ASSERT_TRUE(gpu_plan.ok()) << gpu_plan.error().message();
  ASSERT_TRUE(host_plan.ok()) << host_plan.error().message();
  EXPECT_TRUE(host_plan->optimizer.offload_params);
  EXPECT_FALSE(gpu_plan->optimizer.offload_params);
  Expected<Program> gpu = compile_plan(*gpu_plan, t);
  Expected<Program> host = compile_plan(*host_plan, t);
  ASSERT_TRUE(gpu.ok()) << gpu.error().message();
  ASSERT_TRUE(host.ok()) << host.error().message();
  const Lane& a = gpu->lanes[0];
  const Lane& b = host->lanes[0];
  EXPECT_GT(a.memory.weights, 0);
  EXPECT_EQ(b.memory.weights, 0);
  EXPECT_EQ(b.memory.gradients, 0);
  EXPECT_EQ(b.memory.optimizer, 0);
  EXPECT_EQ(b.memory.gathered, a.memory.gathered);
  const OptimizerSpec& spec = host->plan.optimizer;
  const double shard = a.memory.weights / spec.weight_shard_bytes;
  EXPECT_DOUBLE_EQ(b.host_bytes,
                   shard * (spec.weight_shard_bytes + spec.grad_bytes + spec.state_bytes));
  // The copies: a gather's fp32 shard in, a reduction's shard out, over dp 8.
  int gathers = 0, reductions = 0;
  for (const BlockTemplate& tpl : host->templates) {
    for (const Step& s : tpl.steps) {
      if (s.kind != StepKind::kDpLaunch) continue;
      if (s.collective == CollectiveKind::kAllGather) {
        const double elements = s.bytes / 2 / 8;
        EXPECT_DOUBLE_EQ(s.host_seconds, host_copy_seconds(elements * spec.weight_shard_bytes,
                                                           false, t, host->compute_model));
        ++gathers;
      } else if (s.collective == CollectiveKind::kReduceScatter) {
        EXPECT_DOUBLE_EQ(s.host_seconds,
                         host_copy_seconds(s.bytes / 8, true, t, host->compute_model));
        ++reductions;
      }
    }
  }
  EXPECT_GT(gathers, 0);
  EXPECT_GT(reductions, 0);
  for (const BlockTemplate& tpl : gpu->templates) {
    for (const Step& s : tpl.steps) EXPECT_EQ(s.host_seconds, 0);
  }
  // The step is the host's update alone: parameters, gradients and moments read, the
  // parameters and moments written, at the GPU's eighth of the node's bandwidth.
  EXPECT_EQ(b.offloaded_step.to_host, 0);
  EXPECT_EQ(b.offloaded_step.to_device, 0);
  const double traffic = 2 * spec.grad_bytes + 2 * spec.state_bytes + 2 * spec.weight_shard_bytes;
  EXPECT_DOUBLE_EQ(b.offloaded_step.host, shard * traffic / (t.host.memory_bandwidth / 8));
  EXPECT_DOUBLE_EQ(optimizer_step_seconds(*host), b.offloaded_step.seconds);
  EXPECT_GT(estimate_program(*host).iteration_time, estimate_program(*gpu).iteration_time);
  EXPECT_LT(estimate_program(*host).peak_memory, estimate_program(*gpu).peak_memory);

  // The plan file carries it, and reading it checks it.
  Expected<Plan> back = parse_plan(plan_to_json(*host_plan), "fsdp.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_TRUE(back->optimizer.offload_params);
  Plan partial = *host_plan;
  partial.optimizer.offload_fraction = 0.5;
  Expected<Plan> refused = parse_plan(plan_to_json(partial), "fsdp.json");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("optimizer.offload_params"), std::string::npos)
      << refused.error().message();
  EXPECT_NE(refused.error().message().find("\"offload_fraction\": 1"), std::string::npos)
      << refused.error().message();

  // What FSDP's CPUOffload cannot do is refused with the fix.
  auto error = [&](const MegatronOptions& opts) {
    Expected<Plan> p = build_megatron_plan(m, t, opts);
    return p ? std::string() : p.error().message();
  };
  MegatronOptions half = o;
  half.optimizer_offload = 0.5;
  EXPECT_NE(error(half).find("use --optimizer-offload 1"), std::string::npos) << error(half);
  MegatronOptions overlap = o;
  overlap.offload_overlap = true;
  EXPECT_NE(error(overlap).find("without --offload-overlap"), std::string::npos) << error(overlap);
  MegatronOptions zero2 = o;
  zero2.zero = 2;
  EXPECT_NE(error(zero2).find("use --zero 3"), std::string::npos) << error(zero2);
}

// Searches for Llama 3 70B on one DGX A100, 16 sequences a step, every candidate ranked.
SearchOptions search_options() {
  SearchOptions o;
  o.global_batch = 16;
  o.jobs = 2;
  o.confirm = 0;
  o.top = 1000;
  return o;
}

// Every ranked plan keeps whole ZeRO-3 shards on the host, parameters included.
void expect_whole_shards_offloaded(const Expected<SearchResult>& r) {
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  for (const Candidate& c : r->ranked) {
    EXPECT_EQ(c.options.optimizer_offload, 1) << c.describe();
    EXPECT_EQ(c.options.zero, 3) << c.describe();
  }
  EXPECT_TRUE(r->best.optimizer.offload_params);
}

// Llama 3 70B on one DGX A100: no plan fits on the GPUs alone; with the optimizer on the host,
// the search finds plans, every one of them offloading.
TEST(OptimizerOffloadPlan, TheSearchPlansWithTheStateOnTheHost) {
  const Topology t = one_node();
  const ModelSpec m = *load_model("llama3-70b");
  SearchOptions o = search_options();
  // Without: nothing fits, and the error points at the host.
  Expected<SearchResult> none = search_plans(m, t, o);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message().find("host memory (--optimizer-offload auto)"),
            std::string::npos)
      << none.error().message();
  EXPECT_NE(none.error().message().find("chosen modules' activations (--offload-modules auto)"),
            std::string::npos)
      << none.error().message();
  Topology no_host = t;
  no_host.has_host = false;
  none = search_plans(m, no_host, o);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().message().find("--optimizer-offload"), std::string::npos);
  o.optimizer_offload = 1;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  for (const Candidate& c : r->ranked) EXPECT_EQ(c.options.optimizer_offload, 1);
  EXPECT_EQ(r->best.optimizer.offload_fraction, 1);

  Expected<SearchResult> refused = search_plans(m, no_host, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("describes no host"), std::string::npos);
}

// Offloading as needed: plans that fit on their GPUs keep their state there; those that do not
// offload the least fraction, in hundredths, that makes them fit.
TEST(OptimizerOffloadPlan, TheSearchOffloadsWhatEachPlanNeeds) {
  const Topology t = one_node();
  const ModelSpec m = *load_model("llama3-70b");
  SearchOptions o = search_options();
  o.offload_as_needed = true;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  const double usable = t.gpu.hbm_bytes * (1 - o.memory_headroom);
  auto peak = [&](MegatronOptions opts, double fraction) {
    opts.optimizer_offload = fraction;
    Expected<Plan> plan = build_megatron_plan(m, t, opts);
    EXPECT_TRUE(plan.ok()) << plan.error().message();
    Expected<Program> prog = compile_plan(*plan, t);
    EXPECT_TRUE(prog.ok()) << prog.error().message();
    return estimate_program(*prog).peak_memory;
  };
  int partial = 0;
  for (const Candidate& c : r->ranked) {
    const double f = c.options.optimizer_offload;
    ASSERT_GT(f, 0) << c.describe();  // 70B does not fit on 8 GPUs with its state
    EXPECT_NEAR(f * 100, std::round(f * 100), 1e-9) << c.describe();
    EXPECT_LE(c.estimate.peak_memory, usable) << c.describe();
    if (f < 1 && partial < 3) {
      ++partial;
      EXPECT_GT(peak(c.options, f - 0.01), usable) << c.describe();
    }
  }
  EXPECT_GT(partial, 0);

  // With the overlap: the same plans, each offloading one overlapped.
  o.offload_overlap = true;
  Expected<SearchResult> overlapped = search_plans(m, t, o);
  ASSERT_TRUE(overlapped.ok()) << overlapped.error().message();
  ASSERT_FALSE(overlapped->ranked.empty());
  for (const Candidate& c : overlapped->ranked) {
    EXPECT_TRUE(c.options.offload_overlap) << c.describe();
  }
  EXPECT_LT(overlapped->ranked.front().estimate.iteration_time,
            r->ranked.front().estimate.iteration_time);
  o.offload_overlap = false;

  // Both a fraction and "as needed" is refused.
  o.optimizer_offload = 0.5;
  Expected<SearchResult> both = search_plans(m, t, o);
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.error().message().find("not both"), std::string::npos);
}

// FSDP as needed: the plans that do not fit offload everything of their ZeRO-3 shard, the
// only way FSDP's CPUOffload goes; Llama 3 70B fits on one DGX A100 only so.
TEST(OptimizerOffloadPlan, TheSearchOffloadsFsdpShardsWhole) {
  const Topology t = one_node();
  const ModelSpec m = *load_model("llama3-70b");
  SearchOptions o = search_options();
  o.framework = "fsdp";
  Expected<SearchResult> none = search_plans(m, t, o);
  ASSERT_FALSE(none.ok());
  o.offload_as_needed = true;
  expect_whole_shards_offloaded(search_plans(m, t, o));
}

// DeepSpeed's offload_param: ZeRO-3's parameter shards on the host with the optimizer state, as
// FSDP's CPUOffload keeps them, but 16-bit parameters copied back (offload_param_bytes 2).
TEST(OptimizerOffloadPlan, DeepSpeedOffloadsItsParameterShardsOnRequest) {
  const Topology t = one_node();
  const ModelSpec m = *load_model("llama3-8b");
  MegatronOptions o = zero3_options("deepspeed");
  o.optimizer_offload = 1;
  Expected<Plan> state_only = build_megatron_plan(m, t, o);
  o.offload_params = true;
  Expected<Plan> shards = build_megatron_plan(m, t, o);
  ASSERT_TRUE(state_only.ok()) << state_only.error().message();
  ASSERT_TRUE(shards.ok()) << shards.error().message();
  EXPECT_FALSE(state_only->optimizer.offload_params);
  EXPECT_TRUE(shards->optimizer.offload_params);
  EXPECT_EQ(shards->optimizer.offload_param_bytes, 2);
  Expected<Program> a = compile_plan(*state_only, t);
  Expected<Program> b = compile_plan(*shards, t);
  ASSERT_TRUE(a.ok()) << a.error().message();
  ASSERT_TRUE(b.ok()) << b.error().message();
  // Only the tensors under DeepSpeed's persistence threshold (the norms) stay whole on the GPU.
  EXPECT_GT(a->lanes[0].memory.weights, 1000 * b->lanes[0].memory.weights);
  EXPECT_EQ(b->lanes[0].memory.gradients, 0);
  EXPECT_EQ(b->lanes[0].memory.optimizer, 0);
  EXPECT_GT(b->lanes[0].host_bytes, a->lanes[0].host_bytes);
  bool copies = false;
  for (const BlockTemplate& tpl : b->templates) {
    for (const Step& s : tpl.steps) copies = copies || s.host_seconds > 0;
  }
  EXPECT_TRUE(copies);

  // What it cannot be is refused with the fix.
  auto error = [&](const MegatronOptions& opts) {
    Expected<Plan> p = build_megatron_plan(m, t, opts);
    return p ? std::string() : p.error().message();
  };
  MegatronOptions megatron = o;
  megatron.framework = "megatron";
  EXPECT_NE(error(megatron).find("use --framework deepspeed"), std::string::npos)
      << error(megatron);
  MegatronOptions fsdp = o;
  fsdp.framework = "fsdp";
  EXPECT_NE(error(fsdp).find("with --optimizer-offload 1 alone"), std::string::npos) << error(fsdp);
  MegatronOptions half = o;
  half.optimizer_offload = 0.5;
  EXPECT_NE(error(half).find("give --optimizer-offload 1"), std::string::npos) << error(half);
  MegatronOptions none = o;
  none.optimizer_offload = 0;
  EXPECT_NE(error(none).find("give --optimizer-offload 1"), std::string::npos) << error(none);
  MegatronOptions zero2 = o;
  zero2.zero = 2;
  EXPECT_NE(error(zero2).find("use --zero 3"), std::string::npos) << error(zero2);
}

// Llama 3 70B on one DGX A100 under DeepSpeed: with the parameter shards on the host too, the
// search's offloading plans are all ZeRO-3 with every shard offloaded.
TEST(OptimizerOffloadPlan, TheSearchOffloadsDeepSpeedShardsWholeWhenAsked) {
  const Topology t = one_node();
  const ModelSpec m = *load_model("llama3-70b");
  SearchOptions o = search_options();
  o.framework = "deepspeed";
  o.offload_as_needed = true;
  o.offload_params = true;
  const Expected<SearchResult> r = search_plans(m, t, o);
  expect_whole_shards_offloaded(r);
  if (r.ok()) {
    for (const Candidate& c : r->ranked) EXPECT_TRUE(c.options.offload_params) << c.describe();
  }
  o.framework = "megatron";
  Expected<SearchResult> refused = search_plans(m, t, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("--offload-params is DeepSpeed's"), std::string::npos)
      << refused.error().message();
}

}  // namespace
}  // namespace nnsim
