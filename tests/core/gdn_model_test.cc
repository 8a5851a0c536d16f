// Gated DeltaNet layers ('G') and gated attention outputs: Qwen3-Next's layer kinds.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/opgraph.h"
#include "tests/core/model_test_helpers.h"

namespace nnsim {
namespace {

using namespace test;

ModelSpec qwen3_next() {
  auto m = load_model("qwen3-next-80b-a3b");
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
  return *m;
}

// Qwen3-Next-80B-A3B's released config, layer by layer: 36 Gated DeltaNet mixers, 12 gated
// attention mixers, 48 expert layers, untied embeddings, and a multi-token prediction module (a
// gated attention layer and its experts). Its model card says 80B parameters, 79.7B here without
// the module.
TEST(GatedDeltaNet, QwenNextHoldsItsParametersLayerByLayer) {
  const ModelSpec m = qwen3_next();
  EXPECT_EQ(m.layers, 96);
  EXPECT_EQ(m.layer_kinds(), "GE*");
  const double h = 2048;
  // The norm, Q K V z beta a (16 x 128 twice, 32 x 128 twice, 32 twice), the 4-tap
  // convolution over Q K V, dt bias and A per value head, the gated norm's 128 and out_proj.
  const double gdn =
      h + h * (2 * 2048 + 2 * 4096 + 64) + (2 * 2048 + 4096) * 4 + 64 + 128 + 4096 * h;
  EXPECT_EQ(static_cast<double>(m.gdn_layer_parameters()), gdn);
  // The norm, Q K V and the output gate (16 + 2 + 2 + 16 heads of 256), the query and key norms,
  // the output projection.
  const double attention = h + h * (16 + 2 + 2 + 16) * 256 + 2 * 256 + 16 * 256 * h;
  EXPECT_EQ(static_cast<double>(m.attention_parameters()), attention);
  const double experts = h + h * 512 + 512 * 3 * h * 512 + 3 * h * 512;
  // The module: its embedding's and hidden state's norms, the 2h -> h projection, its block and
  // its head's norm (the embedding and the output head are the model's).
  const double mtp = 3 * h + 2 * h * h + attention + experts;
  const double total = 36 * gdn + 12 * attention + 48 * experts + 2 * 151936 * h + h + mtp;
  EXPECT_EQ(static_cast<double>(m.parameters()), total);
  EXPECT_NEAR(total - mtp, 79.7e9, 0.1e9);

  const OpGraph g = lower_model(m, 1);
  ASSERT_EQ(g.blocks.size(), 3u);
  double in_graph = params(g.embedding) + params(g.head);
  for (int l = 0; l < m.layers; ++l) in_graph += params(g.layer_at(l));
  EXPECT_EQ(in_graph, total);
  EXPECT_EQ(names(g.blocks[0]),
            (std::vector<std::string>{"gdn.norm", "gdn.in_proj", "gdn.scan", "gdn.gate_norm",
                                      "gdn.out_proj", "gdn.residual"}));
  EXPECT_EQ(names(g.blocks[2]),
            (std::vector<std::string>{"attn.norm", "attn.qkv", "attn.qk_norm", "attn.core",
                                      "attn.gate", "attn.proj", "attn.residual"}));
}

// The delta rule's FLOPs a token: for each of the 32 value heads (chunks of 64, keys and values
// 128 wide) K.K^T (2 x 64 x 128), the triangular inverse (2 x 64^2 / 3), W and U
// (2 x 64 x 256), the chunk states (4 x 128^2) and the output (2 x 128^2 + 2 x 64 x 256); and the
// convolution's 4 taps over Q, K and V (8,192 channels). The projections are the bulk of the
// layer's work.
TEST(GatedDeltaNet, LayerIsItsProjectionsAndADeltaRule) {
  const ModelSpec m = qwen3_next();
  const OpGraph g = lower_model(m, 1);
  const GraphPart& gdn = g.blocks[0];
  const double tokens = 4096, h = 2048;
  const Op* in_proj = find_op(gdn, "gdn.in_proj");
  ASSERT_NE(in_proj, nullptr);
  EXPECT_EQ(in_proj->output.elements, tokens * 12352);
  EXPECT_EQ(find_op(gdn, "gdn.out_proj")->fwd_flops, 2 * tokens * 4096 * h);
  const Op* scan = find_op(gdn, "gdn.scan");
  ASSERT_NE(scan, nullptr);
  const double per_head = 2 * 64 * 128 + 2 * 64 * 64 / 3.0 + 2 * 64 * 256 + 4 * 128 * 128 +
                          2 * 128 * 128 + 2 * 64 * 256;
  EXPECT_NEAR(scan->fwd_flops, tokens * (32 * per_head + 2 * 4 * 8192), 1e-6 * scan->fwd_flops);
  EXPECT_DOUBLE_EQ(scan->bwd_input_flops, 3 * scan->fwd_flops);
  // Its bytes (docs/opgraph.md's count, 233 KiB a token) take ten times its FLOPs' time on an
  // H100 (3.35 TB/s, 989 TFLOP/s bf16).
  EXPECT_DOUBLE_EQ(scan->fwd_bytes, tokens * 238976);
  EXPECT_GT(scan->fwd_bytes / 3.35e12, 5 * scan->fwd_flops / 989e12);
  const double share = scan->fwd_flops / fwd(gdn);
  EXPECT_NEAR(share, 0.081, 0.001);  // the projections hold the other 92 %
  EXPECT_TRUE(scan->unsplittable.contains(Dim::kSeq));
  EXPECT_EQ(scan->kind, OpKind::kScan);
  // Its heads split by query/key head (16), each with its two value heads.
  EXPECT_EQ(scan->granularity[static_cast<int>(Dim::kHeads)], 16);
}

// What a Gated DeltaNet layer keeps for the backward, a token, in 16-bit: the norm's input and
// output, the input projection's output (12,352), the convolution's output (8,192), the
// L2-normalized Q and K (4,096) and their repetition to the value heads (8,192), each value
// head's inverted chunk matrix row (32 x 64), the delta rule's output and the gated norm's
// (4,096 each); in fp32 each value head's g and beta.
TEST(GatedDeltaNet, LayerKeepsItsSavedTensors) {
  const ModelSpec m = qwen3_next();
  const OpGraph g = lower_model(m, 2);
  const double tokens = 2 * 4096;
  const double sixteen_bit = 2 * 2048 + 12352 + 8192 + 4096 + 8192 + 32 * 64 + 2 * 4096;
  EXPECT_EQ(layer_activation_bytes(g, {}), tokens * (2 * sixteen_bit + 4 * 2 * 32));
}

// The output gate: the projection yields a gate channel per query channel, and the gate keeps
// the attention's output and the gate for its backward.
TEST(GatedDeltaNet, AttentionOutputGateWidensTheProjection) {
  ModelSpec m = qwen3_next();
  const OpGraph gated = lower_model(m, 1);
  m.attention_output_gate = false;
  const OpGraph plain = lower_model(m, 1);
  const double tokens = 4096;
  const Op* qkv = find_op(gated.blocks[2], "attn.qkv");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->output.elements - find_op(plain.blocks[2], "attn.qkv")->output.elements,
            tokens * 16 * 256);
  const Op* gate = find_op(gated.blocks[2], "attn.gate");
  ASSERT_NE(gate, nullptr);
  EXPECT_EQ(gate->output.elements, tokens * 16 * 256);
  EXPECT_EQ(find_op(plain.blocks[2], "attn.gate"), nullptr);
  EXPECT_EQ(params(gated.blocks[2]) - params(plain.blocks[2]), 2048.0 * 16 * 256);
}

// A small model with every field, and bad values of each.
const char* kGdn =
    "name: tiny-gdn\n"
    "layer_pattern: \"G-G*\"\n"
    "hidden: 256\n"
    "heads: 4\n"
    "kv_heads: 2\n"
    "ffn_hidden: 512\n"
    "mlp: swiglu\n"
    "vocab: 1000\n"
    "seq_len: 512\n"
    "position: rope\n"
    "norm: rmsnorm\n"
    "bias: false\n"
    "attention_output_gate: true\n"
    "gdn_key_heads: 2\n"
    "gdn_value_heads: 4\n"
    "gdn_key_head_dim: 32\n"
    "gdn_value_head_dim: 64\n";

TEST(GatedDeltaNet, FieldsReadBackAndBadOnesNameTheField) {
  auto m = parse_model(kGdn, "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->gdn_conv, 4);
  EXPECT_EQ(m->gdn_chunk, 64);
  auto back = parse_model(model_to_json(*m), "m.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(model_to_json(*back), model_to_json(*m));
  EXPECT_EQ(back->gdn_value_head_dim, 64);
  EXPECT_TRUE(back->attention_output_gate);

  EXPECT_NE(parse_error(replace(kGdn, "gdn_value_heads: 4", "gdn_value_heads: 3"))
                .find("gdn_value_heads"),
            std::string::npos);
  EXPECT_NE(parse_error(replace(kGdn, "gdn_key_heads: 2\n", "")).find("gdn_key_heads"),
            std::string::npos);
  EXPECT_NE(
      parse_error(replace(kGdn, "gdn_key_head_dim: 32\n", "gdn_key_head_dim: 32\ngdn_chunk: 0\n"))
          .find("gdn_chunk"),
      std::string::npos);
  // The mixer's fields without 'G' layers.
  EXPECT_NE(parse_error(replace(kGdn, "G-G*", "--**")).find("only 'G' layers"), std::string::npos);
  EXPECT_NE(
      parse_error(replace(kGdn, "layer_pattern: \"G-G*\"\n", "layers: 4\n")).find("gdn_key_heads"),
      std::string::npos);
  // A multi-token prediction module, an attention layer and an MLP here, needs both kinds in the
  // pattern to be parallelized as they are.
  EXPECT_TRUE(
      parse_model(replace(kGdn, "bias: false\n", "bias: false\nmtp_layers: 1\n"), "m.yaml").ok());
  EXPECT_NE(parse_error(replace(replace(kGdn, "bias: false\n", "bias: false\nmtp_layers: 1\n"),
                                "G-G*", "G*G*"))
                .find("'*' and '-' layers"),
            std::string::npos);
  // An output gate without attention layers, or on latent attention.
  EXPECT_NE(parse_error(replace(kGdn, "G-G*", "G-G-")).find("attention_output_gate"),
            std::string::npos);
  const std::string mla =
      "name: m\nlayers: 2\nhidden: 256\nheads: 4\nffn_hidden: 512\nmlp: gelu\nvocab: 1000\n"
      "seq_len: 512\n"
      "kv_lora_rank: 64\nqk_nope_head_dim: 32\nqk_rope_head_dim: 16\nv_head_dim: 32\n"
      "attention_output_gate: true\n";
  EXPECT_NE(parse_error(mla).find("attention_output_gate"), std::string::npos);
}

}  // namespace
}  // namespace nnsim
