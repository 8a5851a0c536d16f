// Megatron-style plans of hybrid models (Nemotron-H): Mamba-2 mixers split by group of heads,
// the degrees a mixer refuses, and the search over them.
#include <string>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/megatron.h"
#include "planner/search.h"

namespace nnsim {
namespace {

// The FLOPs of operator `op`'s compute steps in the first forward block of the first lane.
double forward_flops(const Program& p, const std::string& op) {
  double f = 0;
  for (const BlockTemplate& t : p.templates) {
    if (t.lane != 0 || t.kind != BlockKind::kForward) continue;
    for (const Step& s : t.steps) {
      if (s.kind == StepKind::kCompute && p.labels[s.label] == op) f += s.flops;
    }
    break;
  }
  return f;
}

struct NemotronH8bOnOneNode : ::testing::Test {
  void SetUp() override {
    Expected<ModelSpec> m = load_model("nemotron-h-8b");
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
};

// Tensor parallelism splits every layer kind (the mixers by group of heads): a GPU holds half
// the model's parameters at tp 2, all but the replicated norms' scales.
TEST_F(NemotronH8bOnOneNode, TensorParallelismSplitsTheMixers) {
  Expected<Program> whole = compile(o);
  ASSERT_TRUE(whole.ok()) << whole.error().message();
  o.tp = 2;
  o.sequence_parallel = true;
  Expected<Program> split = compile(o);
  ASSERT_TRUE(split.ok()) << split.error().message();
  const double params = static_cast<double>(model.parameters());
  EXPECT_DOUBLE_EQ(whole->lanes[0].parameters, params);
  EXPECT_NEAR(split->lanes[0].parameters, params / 2, 0.001 * params);
  EXPECT_GT(split->lanes[0].parameters, params / 2);
  // The same model work in all; each mixer operator a GPU does half of it.
  EXPECT_DOUBLE_EQ(split->model_flops_per_iteration, whole->model_flops_per_iteration);
  for (const char* op : {"ssm.in_proj", "ssm.scan", "ssm.out_proj"}) {
    EXPECT_DOUBLE_EQ(forward_flops(*split, op), forward_flops(*whole, op) / 2) << op;
    EXPECT_GT(forward_flops(*whole, op), 0) << op;
  }
}

TEST_F(NemotronH8bOnOneNode, DegreesAMixerCannotTakeAreRefused) {
  o.cp = 2;
  Expected<Program> cp = compile(o);
  ASSERT_FALSE(cp.ok());
  EXPECT_NE(cp.error().message().find("--cp with Mamba-2 layers"), std::string::npos)
      << cp.error().message();
  o.cp = 1;
  model.mamba_groups = 2;  // 128 heads in 2 groups: tp 4 would split a group
  o.tp = 4;
  Expected<Program> tp = compile(o);
  ASSERT_FALSE(tp.ok());
  EXPECT_NE(tp.error().message().find("2 Mamba-2 groups (mamba_groups)"), std::string::npos)
      << tp.error().message();
}

// A hybrid mixture of experts (Nemotron 3's kind: Mamba-2 and expert layers, a few attention
// layers): expert parallelism spreads the 'E' layers' experts, whose parameters a GPU holds a
// share of, beside tensor, sequence and pipeline parallelism.
TEST_F(NemotronH8bOnOneNode, ExpertLayersTakeExpertParallelism) {
  Expected<ModelSpec> m = parse_model(
      "name: hybrid-moe\n"
      "layer_pattern: \"MEM*EMEM*E\"\n"
      "hidden: 1024\nheads: 16\nkv_heads: 4\nffn_hidden: 1024\nmlp: squared_relu\n"
      "vocab: 32768\nseq_len: 4096\nposition: none\nnorm: rmsnorm\nbias: false\n"
      "experts: 16\nexperts_per_token: 4\nexpert_ffn_hidden: 512\n"
      "shared_expert_ffn_hidden: 1024\n"
      "mamba_heads: 32\nmamba_head_dim: 64\nmamba_state: 64\nmamba_groups: 4\n",
      "hybrid-moe.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  model = *m;
  o.tp = 2;
  o.sequence_parallel = true;
  o.pp = 2;
  Expected<Program> without = compile(o);
  ASSERT_TRUE(without.ok()) << without.error().message();
  o.ep = 2;
  Expected<Program> with = compile(o);
  ASSERT_TRUE(with.ok()) << with.error().message();
  // Stage 0 holds layers 0-4 ("MEM*E"): two expert layers, whose experts ep halves.
  const double experts_here = 2.0 * 16 * 2 * 1024 * 512 / 2;  // two layers' experts over tp
  EXPECT_NEAR(without->lanes[0].parameters - with->lanes[0].parameters, experts_here / 2,
              1e-9 * experts_here);
}

// The search plans a hybrid model: every plan it ranks compiles, and its best fits the GPUs.
TEST_F(NemotronH8bOnOneNode, TheSearchFindsAPlan) {
  SearchOptions so;
  so.global_batch = 64;
  so.jobs = 2;
  so.confirm = 0;
  so.pins.pp = 2;
  Expected<SearchResult> r = search_plans(model, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  const Candidate& best = r->ranked.front();
  EXPECT_EQ(best.options.pp, 2);
  EXPECT_EQ(8 % best.options.tp, 0);
  EXPECT_LE(best.estimate.peak_memory, topo.gpu.hbm_bytes);
}

}  // namespace
}  // namespace nnsim
