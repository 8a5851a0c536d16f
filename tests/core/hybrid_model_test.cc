// Hybrid models (layer_pattern): Mamba-2, attention-only, MLP-only and expert-only layers.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/opgraph.h"
#include "tests/core/model_test_helpers.h"

namespace nnsim {
namespace {

using namespace test;

ModelSpec preset(const std::string& name) {
  auto m = load_model(name);
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
  return *m;
}

// A small hybrid with every kind of layer; tests replace one line to break it.
const char* kHybrid =
    "name: tiny-hybrid\n"
    "layer_pattern: \"M-*EM-\"\n"
    "hidden: 256\n"
    "heads: 4\n"
    "kv_heads: 2\n"
    "ffn_hidden: 512\n"
    "mlp: squared_relu\n"
    "vocab: 1000\n"
    "seq_len: 512\n"
    "position: none\n"
    "norm: rmsnorm\n"
    "bias: false\n"
    "experts: 8\n"
    "experts_per_token: 2\n"
    "expert_ffn_hidden: 128\n"
    "mamba_heads: 8\n"
    "mamba_head_dim: 64\n"
    "mamba_state: 32\n"
    "mamba_groups: 2\n";

// Nemotron-H 8B: 24 Mamba-2, 4 attention and 24 MLP layers, 8.1 billion parameters (its name's),
// every one of them in a layer of the operator graph.
TEST(HybridModel, NemotronHHoldsItsParametersLayerByLayer) {
  const ModelSpec m = preset("nemotron-h-8b");
  ASSERT_TRUE(m.hybrid());
  EXPECT_EQ(m.layers, 52);  // taken from the pattern
  EXPECT_EQ(m.layer_kinds(), "M-*");
  EXPECT_EQ(m.block_shapes(), 3);
  EXPECT_EQ(m.block_shape(0), 0);
  EXPECT_EQ(m.block_shape(1), 1);
  EXPECT_EQ(m.block_shape(7), 2);  // "M-M-M-M*": the first attention layer
  EXPECT_NEAR(static_cast<double>(m.parameters()), 8.1e9, 0.01e9);

  const OpGraph g = lower_model(m, 1);
  ASSERT_EQ(g.blocks.size(), 3u);
  double total = params(g.embedding) + params(g.head);
  for (int l = 0; l < m.layers; ++l) total += params(g.layer_at(l));
  EXPECT_EQ(total, static_cast<double>(m.parameters()));
  EXPECT_EQ(params(g.blocks[0]), static_cast<double>(m.mamba_layer_parameters()));
  EXPECT_EQ(names(g.blocks[0]),
            (std::vector<std::string>{"ssm.norm", "ssm.in_proj", "ssm.scan", "ssm.gate_norm",
                                      "ssm.out_proj", "ssm.residual"}));
  EXPECT_EQ(names(g.blocks[1]), (std::vector<std::string>{"mlp.norm", "mlp.fc1", "mlp.act",
                                                          "mlp.fc2", "mlp.residual"}));
  EXPECT_EQ(names(g.blocks[2]), (std::vector<std::string>{"attn.norm", "attn.qkv", "attn.core",
                                                          "attn.proj", "attn.residual"}));
  // No position embedding: the embedding is the word lookup alone.
  EXPECT_EQ(params(g.embedding), 131072.0 * 4096);
}

// The input projection yields z and x (the inner width each), B and C (groups x state each) and
// a dt per head; the scan's matrix products are a few percent of the layer's FLOPs (Megatron-LM's
// FLOP counter: "small percent of overall layer flops"), the projections the rest.
TEST(HybridModel, MambaLayerIsItsProjectionsAndAScan) {
  const ModelSpec m = preset("nemotron-h-8b");
  const OpGraph g = lower_model(m, 1);
  const GraphPart& mamba = g.blocks[0];
  const double tokens = 8192, h = 4096, d = 128 * 64, gn = 8 * 128;
  const Op* in_proj = find_op(mamba, "ssm.in_proj");
  ASSERT_NE(in_proj, nullptr);
  EXPECT_EQ(in_proj->output.elements, tokens * (2 * d + 2 * gn + 128));
  EXPECT_EQ(find_op(mamba, "ssm.out_proj")->fwd_flops, 2 * tokens * d * h);
  const double scan_share = find_op(mamba, "ssm.scan")->fwd_flops / fwd(mamba);
  EXPECT_GT(scan_share, 0.02);
  EXPECT_LT(scan_share, 0.05);
  // The scan's traffic, not its FLOPs, sets its time: on an H100 (3.35 TB/s, 989 TFLOP/s bf16)
  // its bytes take longer than its FLOPs.
  const Op* scan = find_op(mamba, "ssm.scan");
  EXPECT_GT(scan->fwd_bytes / 3.35e12, scan->fwd_flops / 989e12);
  EXPECT_TRUE(scan->unsplittable.contains(Dim::kSeq));
}

// What a Mamba-2 layer keeps for the backward (Megatron-Core with the fused scan): the norm's
// input and output, the input projection's output and the ungated output the scan saves, the
// gated output (the gated norm's input) and the output projection's input.
TEST(HybridModel, MambaLayerKeepsItsSavedTensors) {
  const ModelSpec m = preset("nemotron-h-8b");
  const OpGraph g = lower_model(m, 2);
  const double tokens = 2 * 8192, h = 4096, d = 128 * 64, gn = 8 * 128, heads = 128;
  EXPECT_EQ(layer_activation_bytes(g, {}), 2 * tokens * (2 * h + 5 * d + 2 * gn + heads));
}

// Every layer kind of the pattern lowers to its own block; 'E' holds the experts, '-' a dense
// MLP, '*' the attention alone.
TEST(HybridModel, EveryLayerKindIsABlock) {
  auto m = parse_model(kHybrid, "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->layers, 6);
  EXPECT_EQ(m->layer_kinds(), "M-*E");
  EXPECT_EQ(m->moe_layers(), 1);
  EXPECT_TRUE(m->is_moe_layer(3));
  EXPECT_FALSE(m->is_moe_layer(1));
  const OpGraph g = lower_model(*m, 1);
  ASSERT_EQ(g.blocks.size(), 4u);
  EXPECT_EQ(g.block_of_layer, (std::vector<int>{0, 1, 2, 3, 0, 1}));
  EXPECT_NE(find_op(g.blocks[3], "moe.fc1"), nullptr);
  EXPECT_EQ(find_op(g.blocks[1], "moe.fc1"), nullptr);
  EXPECT_EQ(find_op(g.blocks[2], "mlp.fc1"), nullptr);
  double total = params(g.embedding) + params(g.head);
  for (int l = 0; l < m->layers; ++l) total += params(g.layer_at(l));
  EXPECT_EQ(total, static_cast<double>(m->parameters()));
  EXPECT_EQ(m->expert_parameters(), 8 * 2 * 256 * 128);
  // The model as JSON (how a plan carries it) reads back the same.
  auto back = parse_model(model_to_json(*m), "m.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(model_to_json(*back), model_to_json(*m));
  EXPECT_EQ(back->mamba_state, 32);
}

TEST(HybridModel, BadPatternsAndMixersNameTheField) {
  EXPECT_NE(parse_error(replace(kHybrid, "M-*EM-", "M-*XM-")).find("character 4 ('X')"),
            std::string::npos);
  EXPECT_NE(
      parse_error(replace(kHybrid, "name: tiny-hybrid\n", "name: t\nlayers: 5\n")).find("layers"),
      std::string::npos);
  EXPECT_NE(parse_error(replace(kHybrid, "M-*EM-", "M-*-M-")).find("experts"), std::string::npos);
  EXPECT_NE(
      parse_error(replace(kHybrid, "mamba_groups: 2", "mamba_groups: 3")).find("mamba_groups"),
      std::string::npos);
  EXPECT_NE(parse_error(replace(kHybrid, "mamba_heads: 8\n", "")).find("mamba_heads"),
            std::string::npos);
  EXPECT_NE(parse_error(replace(kHybrid, "bias: false\n", "bias: false\nsliding_window: 128\n"))
                .find("sliding_window"),
            std::string::npos);
  EXPECT_NE(parse_error(replace(kHybrid, "bias: false\n", "bias: false\nmoe_layer_interval: 2\n"))
                .find("moe_layer_interval"),
            std::string::npos);
  // The mixer's fields without 'M' layers, and without a pattern at all.
  EXPECT_NE(parse_error(replace(kHybrid, "M-*EM-", "--*E--")).find("mamba_"), std::string::npos);
  EXPECT_NE(parse_error(replace(kHybrid, "layer_pattern: \"M-*EM-\"\n", "layers: 6\n"))
                .find("layer_pattern"),
            std::string::npos);
  EXPECT_NE(parse_error(replace(kHybrid, "\"M-*EM-\"", "\"\"")).find("layer_pattern"),
            std::string::npos);
}

// Megatron-LM's full notation: '|' between pipeline segments (its flexible virtual pipeline
// stages) and '/' before each multi-token prediction module's layers, which nnsim reads as an
// attention layer and the model's MLP or experts.
TEST(HybridModel, MegatronPatternSeparatorsSetSegmentsAndModules) {
  auto m = parse_model(replace(kHybrid, "\"M-*EM-\"", "\"M-*|EM-/*E\""), "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->layer_pattern, "M-*EM-");
  EXPECT_EQ(m->layers, 6);
  EXPECT_EQ(m->pipeline_layout, (std::vector<int>{3, 3}));
  EXPECT_EQ(m->mtp_layers, 1);
  const std::string json = model_to_json(*m);
  EXPECT_NE(json.find("\"M-*|EM-\""), std::string::npos) << json;
  auto back = parse_model(json, "m.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(model_to_json(*back), json);
  EXPECT_EQ(back->pipeline_layout, m->pipeline_layout);

  EXPECT_NE(parse_error(replace(kHybrid, "\"M-*EM-\"", "\"M-*EM-/*E/*-\"")).find("the same"),
            std::string::npos);
  EXPECT_NE(parse_error(replace(kHybrid, "\"M-*EM-\"", "\"M-*EM-/*-\"")).find("'*E'"),
            std::string::npos);
  EXPECT_NE(parse_error(replace(kHybrid, "\"M-*EM-\"", "\"[M-]*EM-\"")).find("layer groups"),
            std::string::npos);
  EXPECT_NE(parse_error(replace(replace(kHybrid, "\"M-*EM-\"", "\"M-*EM-/*E\""), "bias: false\n",
                                "bias: false\nmtp_layers: 2\n"))
                .find("mtp_layers"),
            std::string::npos);
  // A model built in code whose segments do not cover its layers.
  ModelSpec bad = *m;
  bad.pipeline_layout = {3, 2};
  const Status s = validate_model(bad);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message().find("layer_pattern"), std::string::npos) << s.error().message();
}

}  // namespace
}  // namespace nnsim
