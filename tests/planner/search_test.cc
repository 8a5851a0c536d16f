// The plan search: constraints are obeyed, contradictions are reported, placement is priced.
#include "planner/search.h"

#include <set>

#include <gtest/gtest.h>

#include "core/memory_check.h"

namespace nnsim {
namespace {

Topology topo(const std::string& name, int nodes) {
  Expected<Topology> t = load_topology(name);
  EXPECT_TRUE(t.ok());
  Expected<Topology> r = resize_topology(*t, nodes);
  EXPECT_TRUE(r.ok());
  return *r;
}

SearchOptions options(int global_batch) {
  SearchOptions o;
  o.global_batch = global_batch;
  o.jobs = 2;
  o.confirm = 0;
  o.top = 50;
  return o;
}

// The search for the preset `model` on `t` with `pins` (every other choice searched).
Expected<SearchResult> search_pinned(const std::string& model, const Topology& t, int global_batch,
                                     const SearchPins& pins) {
  SearchOptions o = options(global_batch);
  o.pins = pins;
  return search_plans(*load_model(model), t, o);
}

// A 4-layer preset at 2,048 tokens, small enough to search in full.
ModelSpec small_model(const std::string& name) {
  ModelSpec m = *load_model(name);
  m.layers = 4;
  m.seq_len = 2048;
  return m;
}

// The search under the constraints of `yaml`, every candidate ranked.
Expected<SearchResult> search_under(const ModelSpec& m, const Topology& t, int global_batch,
                                    const std::string& yaml) {
  SearchOptions o = options(global_batch);
  o.top = 1000;
  Expected<Constraints> c = parse_constraints(yaml, "c.yaml");
  EXPECT_TRUE(c.ok()) << c.error().message();
  if (c.ok()) o.constraints = *c;
  return search_plans(m, t, o);
}

// Whether every group along `axis` (absent: none) has its GPUs in one node.
bool inside_nodes(const Program& p, const char* axis = "tp") {
  const int tp = p.plan.mesh.axis_index(axis);
  if (tp < 0) return true;
  for (const Lane& lane : p.lanes) {
    for (int r : lane.ranks) {
      auto group = p.group_of(r, 1u << tp);
      for (int g : group) {
        if (p.topology.node_of(p.gpu_of_rank[g]) !=
            p.topology.node_of(p.gpu_of_rank[group.front()])) {
          return false;
        }
      }
    }
  }
  return true;
}

TEST(Search, EveryPlanObeysTheConstraints) {
  const ModelSpec m = *load_model("gpt3-13b");
  const Topology t = topo("dgx-a100x4", 4);
  SearchOptions o = options(64);
  Expected<Constraints> c =
      parse_constraints("tp_within_node: true\nmemory_cap: 60 GB\n", "c.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message();
  o.constraints = *c;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  for (const Candidate& cand : r->ranked) {
    Expected<Plan> plan = build_megatron_plan(m, t, cand.options);
    ASSERT_TRUE(plan.ok());
    Expected<Program> prog = compile_plan(*plan, t);
    ASSERT_TRUE(prog.ok());
    EXPECT_TRUE(inside_nodes(*prog)) << cand.describe();
    for (const auto& peak : lane_memory_peaks(*prog)) {
      EXPECT_LE(peak.peak, 60e9) << cand.describe();
    }
  }
  // Without the constraints, faster plans exist that break them. Within half a percent: a
  // chain stops at the first recomputation and ZeRO level that fits, taking the later ones to
  // cost more time, and compute slowed by communication beside it (decided per stretch) can
  // make ZeRO-3 a hair faster than ZeRO-2 (TP 1, CP 2, DP 16: 1.605 s against 1.607 s), which
  // only the 60 GB cap reaches.
  o.constraints = {};
  Expected<SearchResult> free = search_plans(m, t, o);
  ASSERT_TRUE(free.ok());
  EXPECT_LE(free->ranked.front().time(), 1.005 * r->ranked.front().time());
}

// ep_within_node keeps every expert-parallel group, and its all-to-alls, inside a node.
TEST(Search, ExpertParallelGroupsStayInsideNodesWhenAsked) {
  const ModelSpec m = small_model("mixtral-8x7b");
  const Topology t = topo("dgx-a100x4", 2);
  Expected<SearchResult> r = search_under(m, t, 64, "ep_within_node: true\n");
  ASSERT_TRUE(r.ok()) << r.error().message();
  std::set<int> eps;
  for (const Candidate& cand : r->ranked) {
    eps.insert(cand.options.ep);
    Expected<Plan> plan = build_megatron_plan(m, t, cand.options);
    ASSERT_TRUE(plan.ok());
    Expected<Program> prog = compile_plan(*plan, t);
    ASSERT_TRUE(prog.ok());
    EXPECT_TRUE(inside_nodes(*prog, "ep")) << cand.describe();
  }
  EXPECT_TRUE(eps.count(8)) << "no plan spreads the experts over a whole node";
  bool counted = false;
  for (const auto& [why, n] : r->rejections)
    counted = counted || (why == "ep_within_node" && n > 0);
  EXPECT_TRUE(counted) << "no expert-parallel group crossed a node: the constraint pruned nothing";

  // Grouped expert GEMMs asked of a dense model: the search names the flag.
  SearchOptions dense = options(64);
  dense.moe_grouped_gemm = true;
  Expected<SearchResult> refused = search_plans(*load_model("gpt3-13b"), t, dense);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("--moe-grouped-gemm"), std::string::npos);

  // Forbidding the experts' split rules expert parallelism out.
  r = search_under(m, t, 64, "operators:\n  - match: \"moe.fc*\"\n    forbid: [expert]\n");
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  for (const Candidate& cand : r->ranked) EXPECT_EQ(cand.options.ep, 1) << cand.describe();
}

// In a mixture with dense blocks an operator rule's layer range reaches the block shapes of the
// layers it covers: the dense first block's MLP is layer 0's only.
TEST(Search, LayerRangesReachTheBlockShapesTheyCover) {
  const ModelSpec m = small_model("deepseek-moe-16b");
  const Topology t = topo("dgx-a100x4", 1);
  Expected<SearchResult> r = search_under(
      m, t, 32, "operators:\n  - match: \"mlp.fc*\"\n    layers: [0, 1]\n    max_degree: 1\n");
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  for (const Candidate& cand : r->ranked) EXPECT_EQ(cand.options.tp, 1) << cand.describe();
  // Layers 1-3 have experts, no mlp.fc*: the rule binds nothing and tensor parallelism is back.
  r = search_under(m, t, 32,
                   "operators:\n  - match: \"mlp.fc*\"\n    layers: [1, 4]\n    max_degree: 1\n");
  ASSERT_TRUE(r.ok()) << r.error().message();
  bool saw_tp = false;
  for (const Candidate& cand : r->ranked) saw_tp |= cand.options.tp > 1;
  EXPECT_TRUE(saw_tp);
}

// Asked to (SearchOptions::tp_sub_batches), the search tries Merak's sub-pipelined tensor
// parallelism on its best plans; with tensor parallelism pinned at 8 it hides most of the
// collectives and wins.
TEST(Search, SubPipelinedTensorParallelismIsTriedWhenAsked) {
  const ModelSpec m = *load_model("gpt3-13b");
  const Topology t = topo("dgx-a100x4", 2);
  SearchOptions o = options(64);
  o.pins.tp = 8;
  o.pins.pp = 1;
  Expected<SearchResult> plain = search_plans(m, t, o);
  ASSERT_TRUE(plain.ok()) << plain.error().message();
  EXPECT_EQ(plain->sub_pipelined_tried, 0u);
  o.tp_sub_batches = 2;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_GT(r->sub_pipelined_tried, 0u);
  ASSERT_FALSE(r->ranked.empty());
  const Candidate& best = r->ranked.front();
  EXPECT_EQ(best.options.tp_sub_batches, 2) << best.describe();
  EXPECT_LT(best.time(), plain->ranked.front().time());
  for (const Candidate& c : r->ranked) {
    if (c.options.tp_sub_batches > 1) {
      EXPECT_EQ(c.options.micro_batch % 2, 0) << c.describe();
    }
  }
}

// Qwen3-30B-A3B cut to 4 layers with its experts over two nodes: the all-to-alls cross
// InfiniBand, and the combined-1F1B variant of the best plans wins when asked for.
// Qwen3-30B-A3B cut to `layers` (into `m`), and a search pinned to TP 1, `pp` stages, EP 16
// (the experts over two nodes: the all-to-alls cross InfiniBand) and micro-batch 1.
SearchOptions qwen_moe_search(ModelSpec& m, int layers, int pp) {
  m = *load_model("qwen3-30b-a3b");
  m.layers = layers;
  SearchOptions o = options(128);
  o.pins.tp = 1;
  o.pins.pp = pp;
  o.pins.ep = 16;
  o.pins.micro_batch = 1;
  return o;
}

TEST(Search, CombinedOneFOneBIsTriedWhenAsked) {
  ModelSpec m;
  SearchOptions o = qwen_moe_search(m, 4, 1);
  const Topology t = topo("dgx-h100-superpod", 2);
  Expected<SearchResult> plain = search_plans(m, t, o);
  ASSERT_TRUE(plain.ok()) << plain.error().message();
  EXPECT_EQ(plain->ep_overlap_tried, 0u);
  o.ep_overlap = true;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_GT(r->ep_overlap_tried, 0u);
  ASSERT_FALSE(r->ranked.empty());
  const Candidate& best = r->ranked.front();
  EXPECT_TRUE(best.options.ep_overlap) << best.describe();
  EXPECT_NE(best.describe().find("ep-overlap"), std::string::npos);
  EXPECT_LT(best.time(), plain->ranked.front().time());
}

// Pipelines with expert parallelism are rescheduled with DualPipeV too; across InfiniBand, where
// the all-to-alls weigh most, its pairs make it the fastest of the schedules tried.
TEST(Search, DualPipeVIsTriedForExpertParallelPipelines) {
  ModelSpec m;
  const SearchOptions o = qwen_moe_search(m, 8, 2);
  const Topology t = topo("dgx-h100-superpod", 4);
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  const Candidate& best = r->ranked.front();
  EXPECT_EQ(best.options.schedule, ScheduleKind::kDualPipeV) << best.describe();
  EXPECT_NE(best.describe().find("dualpipev"), std::string::npos) << best.describe();
  EXPECT_FALSE(best.options.ep_overlap);
}

// A V whose devices recompute only what their two chunks need: Qwen3-Next on 32 H100s (TP 1,
// PP 4, EP 8) fits only recomputing, and its DualPipeV with per-device recomputation beats the
// same degrees' DualPipeV with every layer recomputed, keeping some layers' activations.
TEST(Search, VSchedulesRecomputePerDevice) {
  const Topology t = topo("dgx-h100-superpod", 4);
  SearchPins pins;
  pins.tp = 1;
  pins.pp = 4;
  pins.ep = 8;
  Expected<SearchResult> r = search_pinned("qwen3-next-80b-a3b", t, 256, pins);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_GT(r->recompute_schedules_tried, 0u);
  const Candidate* per_device = nullptr;
  const Candidate* uniform = nullptr;
  for (const Candidate& c : r->ranked) {
    if (c.options.schedule != ScheduleKind::kDualPipeV) continue;
    if (!per_device && !c.options.recompute_layers.empty()) per_device = &c;
    if (!uniform && c.options.recompute == RecomputeMode::kFull) uniform = &c;
  }
  ASSERT_NE(per_device, nullptr);
  ASSERT_NE(uniform, nullptr);
  EXPECT_LT(per_device->time(), uniform->time()) << per_device->describe();
  EXPECT_LE(per_device->estimate.peak_memory, t.gpu.hbm_bytes);
  int recomputed = 0, held = 0;
  for (size_t i = 0; i < per_device->options.stage_layers.size(); ++i) {
    recomputed += per_device->options.recompute_layers[i];
    held += per_device->options.stage_layers[i];
  }
  EXPECT_LT(recomputed, held);
}

// Llama 3 70B on 32 H100s pinned to TP 4, PP 8, one chunk a stage, 16 micro-batches: 1F1B fits
// only with its stages re-partitioned (no recomputation), and ZB-H1 only recomputing some
// layers, more on its early stages (which hold more micro-batches in flight), yet it wins: its
// bubble is about a third of 1F1B's (7 stages' fill and drain over 16 micro-batches). Without
// per-stage recomputation for the zero-bubble schedules the best plan is 1F1B.
TEST(Search, ZeroBubbleRecomputesPerStage) {
  const Topology t = topo("dgx-h100-superpod", 4);
  SearchPins pins;
  pins.tp = 4;
  pins.pp = 8;
  pins.vpp = 1;
  Expected<SearchResult> r = search_pinned("llama3-70b", t, 16, pins);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_GT(r->recompute_schedules_tried, 0u);
  const Candidate& best = r->ranked.front();
  EXPECT_EQ(best.options.schedule, ScheduleKind::kZbH1) << best.describe();
  ASSERT_EQ(best.options.recompute_layers.size(), 8u) << best.describe();
  EXPECT_GT(best.options.recompute_layers.front(), best.options.recompute_layers.back());
  EXPECT_LE(best.estimate.peak_memory, t.gpu.hbm_bytes);
  const Candidate* one_f_one_b = nullptr;
  for (const Candidate& c : r->ranked) {
    if (!one_f_one_b && c.options.schedule == ScheduleKind::kOneFOneB) one_f_one_b = &c;
  }
  ASSERT_NE(one_f_one_b, nullptr);
  EXPECT_LT(best.time(), 0.97 * one_f_one_b->time()) << one_f_one_b->describe();
}

TEST(Search, ContradictoryConstraintsReportWhatEmptiedTheSpace) {
  const ModelSpec m = *load_model("gpt3-13b");
  const Topology t = topo("dgx-a100x4", 4);
  SearchOptions o = options(64);
  Expected<Constraints> c =
      parse_constraints("memory_cap: 2 GB\nmax_stages: 2\n", "contradiction.yaml");
  ASSERT_TRUE(c.ok());
  o.constraints = *c;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_FALSE(r.ok());
  const std::string& msg = r.error().message();
  EXPECT_NE(msg.find("no plan is feasible under the constraints of contradiction.yaml"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("max_stages"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not fit in memory"), std::string::npos) << msg;
}

TEST(Search, SlowInterNodeLinksKeepTensorParallelismInsideNodes) {
  const ModelSpec m = *load_model("gpt3-13b");
  Topology t = topo("dgx-a100x4", 4);
  for (auto& nic : t.nics) nic.bandwidth /= 10;
  SearchOptions o = options(64);
  o.pins.tp = 8;  // large enough that placement decides where its traffic goes
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  Expected<Program> best = compile_plan(r->best, t);
  ASSERT_TRUE(best.ok());
  EXPECT_TRUE(inside_nodes(*best));
  // The table prices the alternative: tensor parallelism across nodes, much slower.
  const Candidate* inner = nullptr;
  const Candidate* across = nullptr;
  for (const Candidate& c : r->best_per_placement) {
    if (c.placement == "tp-innermost") inner = &c;
    if (c.placement == "dp-innermost") across = &c;
  }
  ASSERT_NE(inner, nullptr);
  ASSERT_NE(across, nullptr);
  EXPECT_GT(across->time(), 1.5 * inner->time());
  // Every other order of the mesh axes was priced for the winner; all are slower or equal, and
  // those that split its tensor-parallel groups over nodes much slower.
  ASSERT_FALSE(r->other_placements_of_best.empty());
  const Candidate& winner = r->ranked.front();
  size_t split = 0;
  for (const Candidate& c : r->other_placements_of_best) {
    EXPECT_EQ(c.options.tp, winner.options.tp);
    EXPECT_EQ(c.options.pp, winner.options.pp);
    EXPECT_NE(c.placement, winner.placement);
    EXPECT_GE(c.estimate.iteration_time, winner.estimate.iteration_time);
    Expected<Plan> p = build_megatron_plan(m, t, c.options);
    ASSERT_TRUE(p.ok());
    Expected<Program> prog = compile_plan(*p, t);
    ASSERT_TRUE(prog.ok());
    if (!inside_nodes(*prog)) {
      ++split;
      EXPECT_GT(c.estimate.iteration_time, 1.5 * winner.estimate.iteration_time) << c.placement;
    }
  }
  EXPECT_GT(split, 0u);
  // The ranking lists each set of degrees once.
  std::set<std::string> degrees;
  for (Candidate c : r->ranked) {
    c.placement = "tp-innermost";
    EXPECT_TRUE(degrees.insert(c.describe()).second) << c.describe();
  }
}

TEST(Search, ZeroBubbleSchedulesAreTriedForThePipelinedPlans) {
  const ModelSpec m = *load_model("gpt3-13b");
  const Topology t = topo("dgx-a100x4", 4);
  SearchOptions o = options(64);
  o.pins.pp = 4;
  Expected<Constraints> c = parse_constraints("schedules: [1f1b, zb-h1]\n", "c.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message();
  o.constraints = *c;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_GT(r->schedules_tried, 0u);
  // ZB-H1 keeps 1F1B's memory and shortens its bubble, so it wins every set of degrees it was
  // tried for; nothing outside the allowed schedules appears.
  ASSERT_FALSE(r->ranked.empty());
  EXPECT_EQ(r->ranked.front().options.schedule, ScheduleKind::kZbH1)
      << r->ranked.front().describe();
  for (const Candidate& cand : r->ranked) {
    EXPECT_TRUE(cand.options.schedule == ScheduleKind::kOneFOneB ||
                cand.options.schedule == ScheduleKind::kZbH1)
        << cand.describe();
  }
  // A pinned schedule is not replaced.
  o.pins.schedule = ScheduleKind::kOneFOneB;
  Expected<SearchResult> pinned = search_plans(m, t, o);
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ(pinned->schedules_tried, 0u);
  for (const Candidate& cand : pinned->ranked) {
    EXPECT_EQ(cand.options.schedule, ScheduleKind::kOneFOneB);
  }
  EXPECT_LT(r->ranked.front().time(), pinned->ranked.front().time());
}

TEST(Search, TesselIsTriedWhenTheConstraintsAskForIt) {
  const ModelSpec m = *load_model("gpt3-13b");
  const Topology t = topo("dgx-a100x4", 1);
  SearchOptions o = options(16);
  o.pins.pp = 4;
  o.pins.vpp = 1;
  Expected<Constraints> c = parse_constraints("schedules: [1f1b, tessel]\n", "c.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message();
  o.constraints = *c;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_GT(r->schedules_tried, 0u);
  // The search's repetend has no steady-state bubble at 1F1B's memory: it wins the degrees.
  ASSERT_FALSE(r->ranked.empty());
  EXPECT_EQ(r->ranked.front().options.schedule, ScheduleKind::kTessel)
      << r->ranked.front().describe();
}

TEST(Search, AllChoicesPinnedIsTheBuilder) {
  const ModelSpec m = *load_model("gpt3-1.3b");
  const Topology t = topo("dgx-a100x4", 4);
  SearchOptions o = options(64);
  o.pins.tp = 2;
  o.pins.pp = 4;
  o.pins.cp = 1;
  o.pins.vpp = 1;
  o.pins.micro_batch = 1;
  o.pins.sequence_parallel = false;
  o.pins.recompute = RecomputeMode::kNone;
  o.pins.zero = 1;
  o.pins.schedule = ScheduleKind::kOneFOneB;
  o.pins.placement = std::vector<std::string>{"pp", "dp", "cp", "tp"};
  o.pins.stage_layers = std::vector<int>{6, 6, 6, 6};
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_EQ(r->ranked.size(), 1u);
  EXPECT_EQ(r->balanced, 0u);
  MegatronOptions b;
  b.tp = 2;
  b.pp = 4;
  b.global_batch = 64;
  b.zero = 1;
  b.stage_layers = {6, 6, 6, 6};
  Expected<Plan> built = build_megatron_plan(m, t, b);
  ASSERT_TRUE(built.ok());
  EXPECT_EQ(plan_to_json(r->best), plan_to_json(*built));
}

TEST(Search, ConfirmationsRunAtOnceAndEachPlanKeepsItsOwnResult) {
  // A stand-in for the simulator whose answer depends on the program it is given, so that a
  // result stored on the wrong candidate shows.
  auto fake = [](const Program& p) -> Expected<double> {
    return 1.0 + 1e-3 * static_cast<double>(p.lanes.size()) + 1e-6 * p.micro_batches;
  };
  const ModelSpec m = *load_model("gpt3-1.3b");
  const Topology t = topo("dgx-a100x4", 2);
  SearchOptions o = options(64);
  o.confirm = 6;
  o.simulate = fake;
  std::vector<std::string> order[2];
  for (int jobs : {1, 2}) {
    o.jobs = jobs;
    Expected<SearchResult> r = search_plans(m, t, o);
    ASSERT_TRUE(r.ok()) << r.error().message();
    ASSERT_EQ(r->confirmed, 6u);
    int simulated = 0;
    for (const Candidate& cand : r->ranked) {
      order[jobs - 1].push_back(cand.describe());
      if (!cand.simulated) continue;
      ++simulated;
      Expected<Plan> plan = build_megatron_plan(m, t, cand.options);
      ASSERT_TRUE(plan.ok());
      Expected<Program> prog = compile_plan(*plan, t, cand.options.costs);
      ASSERT_TRUE(prog.ok());
      EXPECT_EQ(*cand.simulated, *fake(*prog)) << cand.describe();
    }
    EXPECT_EQ(simulated, 6);
  }
  EXPECT_EQ(order[0], order[1]);
}

TEST(Search, AvoidedNodesAndGpusAreNeverUsed) {
  const ModelSpec m = *load_model("gpt3-1.3b");
  const Topology t = topo("dgx-a100x4", 4);
  Expected<Constraints> c = parse_constraints("avoid_nodes: [1]\navoid_gpus: [3]\n", "c.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message();
  SearchOptions o = options(64);
  o.constraints = *c;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  for (const Candidate& cand : r->ranked) {
    Expected<Plan> p = build_megatron_plan(m, t, cand.options);
    ASSERT_TRUE(p.ok());
    Expected<Program> prog = compile_plan(*p, t);
    ASSERT_TRUE(prog.ok());
    EXPECT_LE(prog->gpu_of_rank.size(), 23u);
    for (int g : prog->gpu_of_rank) {
      EXPECT_NE(g, 3) << cand.describe();
      EXPECT_NE(g / 8, 1) << cand.describe();
    }
  }
  Expected<Constraints> bad = parse_constraints("avoid_nodes: [4]\n", "c.yaml");
  ASSERT_TRUE(bad.ok());
  o.constraints = *bad;
  Expected<SearchResult> none = search_plans(m, t, o);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message().find("c.yaml: field 'avoid_nodes': node 4 does not exist"),
            std::string::npos)
      << none.error().message();
}

TEST(Constraints, BadFilesNameTheField) {
  auto r = parse_constraints("memory_cap: 60 GB/s\n", "c.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("c.yaml:1: field 'memory_cap'"), std::string::npos)
      << r.error().message();
  r = parse_constraints("schedules: [1f1c]\n", "c.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("did you mean '1f1b'"), std::string::npos);
  r = parse_constraints("operators:\n  - match: attn.*\n    forbid: [heds]\n", "c.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("did you mean 'heads'"), std::string::npos);
  r = parse_constraints("max_bubbles: 0.1\n", "c.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("did you mean 'max_bubble'"), std::string::npos);
  r = parse_constraints("operators:\n  - kind: atention\n    replicate: true\n", "c.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("did you mean 'attention'"), std::string::npos);
  r = parse_constraints("operators:\n  - layers: [4, 2]\n    replicate: true\n", "c.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("field 'operators[0].layers'"), std::string::npos)
      << r.error().message();
  r = parse_constraints("operators:\n  - replicate: true\n", "c.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("needs match, kind or layers"), std::string::npos);
}

TEST(Constraints, RecomputationPerStageAndPerModule) {
  const ModelSpec m = *load_model("gpt3-13b");
  const Topology t = topo("dgx-a100x4", 4);
  SearchOptions o = options(64);
  Expected<Constraints> c = parse_constraints(
      "recompute: [full, selective, none, none]\nrecompute_modules: [\"mlp.act\"]\n", "r.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message();
  o.constraints = *c;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  for (const Candidate& cand : r->ranked) {
    EXPECT_EQ(cand.options.pp, 4) << cand.describe();  // one mode per stage pins the stages
    Expected<Plan> p = build_megatron_plan(m, t, cand.options);
    ASSERT_TRUE(p.ok());
    // Every layer recomputes mlp.act; stage 0's layers everything; stage 1's the attention
    // core; stages 2 and 3 nothing else.
    for (const Segment& s : p->segments) {
      const int stage = s.devices.at("pp");
      for (int layer = s.first_layer; layer < s.end_layer; ++layer) {
        std::set<std::string> rules;
        for (const RecomputeRule& rule : p->recompute) {
          if (layer >= rule.first_layer && layer < rule.end_layer) rules.insert(rule.match);
        }
        std::set<std::string> want = {"mlp.act"};
        if (stage == 0) want.insert("*");
        if (stage == 1) want.insert("attn.core");
        EXPECT_EQ(rules, want) << cand.describe() << " layer " << layer;
      }
    }
  }
  c = parse_constraints("recompute_modules: [mlp.actt]\n", "r.yaml");
  ASSERT_TRUE(c.ok());
  o.constraints = *c;
  r = search_plans(m, t, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("r.yaml: field 'recompute_modules': 'mlp.actt' matches no "
                                     "operator of a layer (did you mean 'mlp.act'?)"),
            std::string::npos)
      << r.error().message();
}

TEST(Constraints, OperatorRulesRestrictPartitioning) {
  const ModelSpec m = *load_model("gpt3-13b");
  const Topology t = topo("dgx-a100x4", 4);
  SearchOptions o = options(64);
  // No operator of the MLP split more than 2 ways: tensor parallelism of at most 2.
  Expected<Constraints> c =
      parse_constraints("operators:\n  - match: \"mlp.*\"\n    max_degree: 2\n", "ops.yaml");
  ASSERT_TRUE(c.ok());
  o.constraints = *c;
  Expected<SearchResult> r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  for (const Candidate& cand : r->ranked) EXPECT_LE(cand.options.tp, 2) << cand.describe();

  // By kind and layer range: attention cores of layers 0-9 never split along the sequence (no
  // context parallelism); linear layers at most 4 ways.
  c = parse_constraints(
      "operators:\n  - kind: attention\n    layers: [0, 10]\n    forbid: [seq]\n"
      "  - kind: linear\n    max_degree: 4\n",
      "ops.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message();
  o.constraints = *c;
  r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  bool saw_tp = false;
  for (const Candidate& cand : r->ranked) {
    EXPECT_EQ(cand.options.cp, 1) << cand.describe();
    EXPECT_LE(cand.options.tp, 4) << cand.describe();
    saw_tp |= cand.options.tp > 1;
  }
  EXPECT_TRUE(saw_tp);  // the kind rule does not forbid tensor parallelism
  // Without the kind rule, context parallelism wins some places in the ranking.
  c = parse_constraints("operators:\n  - kind: linear\n    max_degree: 4\n", "ops.yaml");
  o.constraints = *c;
  r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok());
  bool saw_cp = false;
  for (const Candidate& cand : r->ranked) saw_cp |= cand.options.cp > 1;
  EXPECT_TRUE(saw_cp);
  // A range past the model's layers covers no operator.
  c = parse_constraints("operators:\n  - layers: [60, 70]\n    replicate: true\n", "ops.yaml");
  o.constraints = *c;
  r = search_plans(m, t, o);
  ASSERT_TRUE(r.ok());
  EXPECT_GT(r->ranked.front().options.tp * r->ranked.front().options.cp, 1);
}

}  // namespace
}  // namespace nnsim
