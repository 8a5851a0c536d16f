// Megatron-style plans of Gated DeltaNet hybrids (Qwen3-Next): the mixers split by query/key
// head, the degrees a mixer refuses, context parallelism's all-to-alls, and the search.
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

using test::first_forward;
using test::forward_flops;

double forward_seconds(const Program& p, const std::string& op) {
  double t = 0;
  for (const Step& s : first_forward(p)->steps) {
    if (s.kind == StepKind::kCompute && p.labels[s.label] == op) t += s.seconds;
  }
  return t;
}

struct QwenNextOnOneNode : test::PresetOnOneNode {
  QwenNextOnOneNode() : PresetOnOneNode("qwen3-next-80b-a3b") {}
};

// Tensor parallelism splits the Gated DeltaNet mixers (projections, delta rule) and the gated
// attention's gate: a GPU does half of each one's work at tp 2.
TEST_F(QwenNextOnOneNode, TensorParallelismSplitsTheMixersAndTheGate) {
  o.ep = 8;
  Expected<Program> whole = compile(o);
  ASSERT_TRUE(whole.ok()) << whole.error().message();
  o.tp = 2;
  o.ep = 4;
  o.sequence_parallel = true;
  Expected<Program> split = compile(o);
  ASSERT_TRUE(split.ok()) << split.error().message();
  // The same model work, but for the vocabulary's padding to a multiple of 128 x tp (151,936
  // is one at tp 1, 152,064 at tp 2) in the head and the prediction module's head.
  EXPECT_NEAR(split->model_flops_per_iteration, whole->model_flops_per_iteration,
              2e-4 * whole->model_flops_per_iteration);
  EXPECT_GT(split->model_flops_per_iteration, whole->model_flops_per_iteration);
  for (const char* op : {"gdn.in_proj", "gdn.scan", "gdn.out_proj"}) {
    EXPECT_GT(forward_flops(*whole, op), 0) << op;
    EXPECT_DOUBLE_EQ(forward_flops(*split, op), forward_flops(*whole, op) / 2) << op;
  }
  // The gate and the gated norm move bytes only: half of them, in less time.
  for (const char* op : {"attn.gate", "gdn.gate_norm"}) {
    EXPECT_GT(forward_seconds(*whole, op), 0) << op;
    EXPECT_LT(forward_seconds(*split, op), forward_seconds(*whole, op)) << op;
  }
}

TEST_F(QwenNextOnOneNode, DegreesAMixerCannotTakeAreRefused) {
  model.gdn_key_heads = 3;
  model.gdn_value_heads = 6;
  o.tp = 2;
  Expected<Program> tp = compile(o);
  ASSERT_FALSE(tp.ok());
  EXPECT_NE(tp.error().message().find("3 Gated DeltaNet key heads (gdn_key_heads)"),
            std::string::npos)
      << tp.error().message();
  // Context parallelism splits a tensor-parallel rank's key heads: 4 over tp 2 leave 2.
  model.gdn_key_heads = 4;
  model.gdn_value_heads = 8;
  o.cp = 4;
  Expected<Program> cp = compile(o);
  ASSERT_FALSE(cp.ok());
  EXPECT_NE(cp.error().message().find("2 Gated DeltaNet key heads"), std::string::npos)
      << cp.error().message();
}

// Context parallelism (Megatron-Core's GatedDeltaNet): an all-to-all hands every rank its heads
// of the input projection's output for the whole sequence, one hands the delta rule's output
// back: two over cp a Gated DeltaNet layer's forward.
TEST_F(QwenNextOnOneNode, ContextParallelismExchangesHeadsAroundTheDeltaRule) {
  o.tp = 2;
  o.cp = 2;
  o.sequence_parallel = true;
  Expected<Program> p = compile(o);
  ASSERT_TRUE(p.ok()) << p.error().message();
  // The prediction module's projection has layout changes of its own.
  const std::vector<double> bytes = test::forward_all_to_alls(*p, "gdn.");
  ASSERT_EQ(bytes.size(), 2u * 36);
  // A rank's half of the sequence, its tensor-parallel half of Q, K, V, z, beta and the decay's
  // input, in 16-bit; then its quarter of the value heads' outputs for the whole sequence.
  EXPECT_DOUBLE_EQ(bytes[0], 4096.0 / 2 * 12352 / 2 * 2);
  EXPECT_DOUBLE_EQ(bytes[1], 4096 * 4096.0 / 4 * 2);
}

// The search plans a Gated DeltaNet hybrid: its best plan compiles and fits the GPUs.
TEST_F(QwenNextOnOneNode, TheSearchFindsAPlan) {
  Expected<ModelSpec> m = parse_model(
      "name: small-next\n"
      "layer_pattern: \"GEGEGE*EGEGEGE*E\"\n"
      "hidden: 1024\nheads: 8\nkv_heads: 2\nhead_dim: 128\nqk_norm: true\n"
      "attention_output_gate: true\nffn_hidden: 1024\nmlp: swiglu\n"
      "vocab: 32768\nseq_len: 4096\nposition: rope\nnorm: rmsnorm\nbias: false\n"
      "experts: 32\nexperts_per_token: 4\nexpert_ffn_hidden: 512\n"
      "shared_expert_ffn_hidden: 512\n"
      "gdn_key_heads: 8\ngdn_value_heads: 16\n",
      "small-next.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  SearchOptions so;
  so.global_batch = 64;
  so.jobs = 2;
  so.confirm = 0;
  so.pins.pp = 2;
  Expected<SearchResult> r = search_plans(*m, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_FALSE(r->ranked.empty());
  const Candidate& best = r->ranked.front();
  EXPECT_EQ(best.options.pp, 2);
  EXPECT_EQ(2 % best.options.tp, 0);  // the attention's 2 key/value heads bound it
  EXPECT_LE(best.estimate.peak_memory, topo.gpu.hbm_bytes);
}

}  // namespace
}  // namespace nnsim
