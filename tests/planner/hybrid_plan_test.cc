// Megatron-style plans of hybrid models (Nemotron-H): Mamba-2 mixers split by group of heads,
// the degrees a mixer refuses, and the search over them.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/megatron.h"
#include "planner/search.h"
#include "tests/planner/preset_on_one_node.h"

namespace nnsim {
namespace {

struct NemotronH8bOnOneNode : test::PresetOnOneNode {
  NemotronH8bOnOneNode() : PresetOnOneNode("nemotron-h-8b") {}
};

using test::forward_flops;

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
  model.mamba_groups = 2;  // 128 heads in 2 groups: tp 4 would split a group
  o.tp = 4;
  Expected<Program> tp = compile(o);
  ASSERT_FALSE(tp.ok());
  EXPECT_NE(tp.error().message().find("2 Mamba-2 groups (mamba_groups)"), std::string::npos)
      << tp.error().message();
  // Context parallelism splits a tensor-parallel rank's heads: 6 heads over tp 2 leave 3.
  o.tp = 2;
  o.cp = 2;
  model.mamba_heads = 6;
  Expected<Program> heads = compile(o);
  ASSERT_FALSE(heads.ok());
  EXPECT_NE(heads.error().message().find("3 Mamba-2 heads"), std::string::npos)
      << heads.error().message();
  // 12 heads in 6 groups over tp 2: 3 groups a rank, which cp 2 neither splits nor repeats.
  model.mamba_heads = 12;
  model.mamba_groups = 6;
  Expected<Program> groups = compile(o);
  ASSERT_FALSE(groups.ok());
  EXPECT_NE(groups.error().message().find("3 Mamba-2 groups"), std::string::npos)
      << groups.error().message();
}

// Context parallelism (Megatron-Core's MambaContextParallel): around each scan an all-to-all
// hands every rank its heads for the whole sequence (the input projection's output) and one
// hands the scan's output back, so a Mamba-2 layer's forward has two all-to-alls over cp.
TEST_F(NemotronH8bOnOneNode, ContextParallelismExchangesHeadsAroundTheScan) {
  o.tp = 2;
  o.cp = 2;
  o.sequence_parallel = true;
  Expected<Program> p = compile(o);
  ASSERT_TRUE(p.ok()) << p.error().message();
  const std::vector<double> bytes = test::forward_all_to_alls(*p);
  ASSERT_EQ(bytes.size(), 2u * 24);
  // A rank's half of the sequence, its tensor-parallel half of z, x, B, C and dt, in 16-bit;
  // then its quarter of the heads' outputs for the whole sequence.
  const double in_width = 2 * 8192 + 2 * 8 * 128 + 128;
  EXPECT_DOUBLE_EQ(bytes[0], 8192.0 / 2 * in_width / 2 * 2);
  EXPECT_DOUBLE_EQ(bytes[1], 8192 * 8192.0 / 4 * 2);
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

// The pattern's own pipeline segments ('|', Megatron-LM's flexible virtual pipeline stages) are
// the plan's unless --stage-layers gives others; a pipeline of another number of segments is
// refused, and the search keeps to them.
TEST_F(NemotronH8bOnOneNode, PatternSegmentsSplitThePipeline) {
  model.pipeline_layout = {20, 32};
  o.pp = 2;
  Expected<Plan> plan = build_megatron_plan(model, topo, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  ASSERT_EQ(plan->segments.size(), 2u);
  EXPECT_EQ(plan->segments[0].end_layer, 20);
  EXPECT_EQ(plan->segments[1].end_layer, 52);
  o.stage_layers = {26, 26};
  Expected<Plan> given = build_megatron_plan(model, topo, o);
  ASSERT_TRUE(given.ok()) << given.error().message();
  EXPECT_EQ(given->segments[0].end_layer, 26);
  o.stage_layers.clear();
  o.pp = 4;
  Expected<Plan> four = build_megatron_plan(model, topo, o);
  ASSERT_FALSE(four.ok());
  EXPECT_NE(four.error().message().find("2 pipeline segments ('|': 20,32)"), std::string::npos)
      << four.error().message();

  SearchOptions so;
  so.global_batch = 16;
  so.jobs = 2;
  so.confirm = 0;
  so.top = 100;
  Expected<SearchResult> r = search_plans(model, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  for (const Candidate& c : r->ranked) {
    EXPECT_EQ(c.options.pp * c.options.vpp, 2) << c.describe();
    EXPECT_EQ(c.options.stage_layers, model.pipeline_layout) << c.describe();
  }
}

}  // namespace
}  // namespace nnsim
