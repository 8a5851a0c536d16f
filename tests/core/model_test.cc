#include "core/model.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/input.h"
#include "tests/core/model_test_helpers.h"

namespace nnsim {
namespace {

using test::parse_error;
using test::replace;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A small valid model; tests replace one line to break it.
const char* kSmall =
    "name: small\n"  // line 1
    "layers: 2\n"    // line 2
    "hidden: 64\n"   // line 3
    "heads: 4\n"     // line 4
    "ffn_hidden: 256\n"
    "mlp: gelu\n"    // line 6
    "vocab: 1000\n"  // line 7
    "seq_len: 128\n";

TEST(Model, EveryPresetLoadsAndValidates) {
  const std::vector<std::string> expected = {
      "gpt3-1.3b", "gpt3-13b",    "gpt3-175b",  "gpt3-2.7b", "gpt3-6.7b",    "llama2-70b",
      "llama2-7b", "llama3-405b", "llama3-70b", "llama3-8b", "mixtral-8x7b", "qwen1.5-moe-a2.7b"};
  std::vector<std::string> names = model_preset_names();
  for (const auto& name : expected) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  for (const auto& name : names) {
    auto m = load_model(name);
    ASSERT_TRUE(m.ok()) << m.error().message();
    EXPECT_EQ(m->name, name);
    EXPECT_TRUE(validate_model(*m).ok()) << name;
    EXPECT_EQ(m->precision, Precision::kBf16) << name;
    EXPECT_EQ(m->attention, AttentionKernel::kFlash) << name;
    // The preset path loads the same model.
    auto by_path = load_model(model_preset_path(name));
    ASSERT_TRUE(by_path.ok()) << by_path.error().message();
    EXPECT_EQ(by_path->parameters(), m->parameters());
  }
}

TEST(Model, PresetParameterCountsArePinned) {
  // The numbers in docs/model.md.
  const std::pair<const char*, int64_t> counts[] = {
      {"gpt3-1.3b", 1'317'654'528},           {"gpt3-2.7b", 2'653'967'360},
      {"gpt3-6.7b", 6'662'266'880},           {"gpt3-13b", 12'858'214'400},
      {"gpt3-175b", 174'615'846'912},         {"llama2-7b", 6'738'415'616},
      {"llama2-70b", 68'976'648'192},         {"llama3-8b", 8'030'261'248},
      {"llama3-70b", 70'553'706'496},         {"llama3-405b", 405'853'388'800},
      {"mixtral-8x7b", 46'702'792'704},       {"qwen1.5-moe-a2.7b", 14'315'587'584},
      {"deepseek-moe-16b", 16'375'728'128},   {"deepseek-v2-lite", 15'706'484'224},
      {"deepseek-v3", 682'636'472'320},       {"qwen3-30b-a3b", 30'532'122'624},
      {"qwen3-235b-a22b", 235'093'634'560},   {"glm-4.5", 356'784'551'168},
      {"kimi-k2", 1'026'408'209'408},         {"gpt-oss-20b", 20'914'754'880},
      {"gpt-oss-120b", 116'829'149'760},      {"mistral-7b", 7'241'732'096},
      {"qwen3-next-80b-a3b", 81'324'762'368}, {"nemotron-3-nano-30b-a3b", 31'577'937'344},
  };
  for (const auto& [name, count] : counts) {
    auto m = load_model(name);
    ASSERT_TRUE(m.ok()) << m.error().message();
    EXPECT_EQ(m->parameters(), count) << name;
  }
}

TEST(Model, Gpt3_175bMatchesNarayanan) {
  auto m = load_model("gpt3-175b");
  ASSERT_TRUE(m.ok()) << m.error().message();
  // Narayanan et al. 2021 (SC'21) state 174.6B for this shape.
  EXPECT_NEAR(static_cast<double>(m->parameters()), 174.6e9, 174.6e9 * 0.001);

  // The formula spelled out: l = 96, h = 12288, a = k = 96, d = 128, f = 4h, V = 51200, s = 2048.
  const int64_t h = 12288, f = 4 * h, V = 51200, s = 2048;
  const int64_t qkv = h * 3 * h + 3 * h;
  const int64_t proj = h * h + h;
  const int64_t mlp = 2 * h * f + f + h;
  const int64_t norms = 2 * 2 * h;
  EXPECT_EQ(m->layer_parameters(), qkv + proj + mlp + norms);
  EXPECT_EQ(m->embedding_parameters(), V * h + s * h);
  EXPECT_EQ(m->head_parameters(), 2 * h);  // tied: only the final LayerNorm
  EXPECT_EQ(m->parameters(), 96 * (qkv + proj + mlp + norms) + V * h + s * h + 2 * h);
  EXPECT_EQ(m->parameters(), 174'615'846'912);
}

TEST(Model, LlamaCountsMatchPublishedSizes) {
  const std::pair<const char*, double> published[] = {
      {"llama2-7b", 6.74e9},
      {"llama3-8b", 8.03e9},
      {"llama3-70b", 70.6e9},
      {"llama3-405b", 405.8e9},
  };
  for (const auto& [name, size] : published) {
    auto m = load_model(name);
    ASSERT_TRUE(m.ok()) << m.error().message();
    EXPECT_NEAR(static_cast<double>(m->parameters()), size, size * 0.005) << name;
  }
  // Llama 3 8B, by hand: GQA with 8 KV heads of 128, SwiGLU, RMSNorm, untied.
  auto m = load_model("llama3-8b");
  ASSERT_TRUE(m.ok());
  const int64_t h = 4096, f = 14336, kv = 8 * 128, V = 128256;
  EXPECT_EQ(m->layer_parameters(), h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h);
  EXPECT_EQ(m->embedding_parameters(), V * h);
  EXPECT_EQ(m->head_parameters(), V * h + h);
}

TEST(Model, BiasAndNormVariantsFollowTheFormula) {
  // Gated MLP with biases, LayerNorm with biases, GQA, untied, rotary.
  std::string yaml = replace(kSmall, "mlp: gelu", "mlp: swiglu") +
                     "kv_heads: 2\nposition: rope\nnorm: layernorm\nbias: true\n";
  auto m = parse_model(yaml, "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  const int64_t h = 64, d = 16, f = 256, qkv_out = (4 + 2 * 2) * d;
  EXPECT_EQ(m->layer_parameters(),
            (h * qkv_out + qkv_out) + (h * h + h) + (3 * h * f + 2 * f + h) + 2 * 2 * h);
  EXPECT_EQ(m->embedding_parameters(), 1000 * h);
  EXPECT_EQ(m->head_parameters(), 2 * h + 1000 * h);

  // Without biases, LayerNorm keeps only its scale; squared-ReLU MLP is not gated.
  auto nb =
      parse_model(replace(yaml, "bias: true", "bias: false") + "tied_embeddings: true\n", "m.yaml");
  ASSERT_TRUE(nb.ok()) << nb.error().message();
  EXPECT_EQ(nb->layer_parameters(), h * qkv_out + h * h + 3 * h * f + 2 * h);
  EXPECT_EQ(nb->head_parameters(), h);

  auto sq = parse_model(replace(yaml, "mlp: swiglu", "mlp: squared_relu"), "m.yaml");
  ASSERT_TRUE(sq.ok()) << sq.error().message();
  EXPECT_FALSE(sq->gated_mlp());
  EXPECT_EQ(sq->layer_parameters(),
            (h * qkv_out + qkv_out) + (h * h + h) + (2 * h * f + f + h) + 2 * 2 * h);
  EXPECT_EQ(sq->parameters(),
            2 * sq->layer_parameters() + sq->embedding_parameters() + sq->head_parameters());
}

TEST(Model, OptionalFieldsTakeTheDocumentedDefaults) {
  auto m = parse_model(kSmall, "dir/tiny.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->name, "small");
  EXPECT_EQ(m->family, "");
  EXPECT_EQ(m->kv_heads, 4);
  EXPECT_FALSE(m->tied_embeddings);
  EXPECT_EQ(m->position, PositionKind::kLearned);
  EXPECT_EQ(m->norm, NormKind::kLayerNorm);
  EXPECT_TRUE(m->bias);
  EXPECT_FALSE(m->dropout);
  EXPECT_EQ(m->attention, AttentionKernel::kFlash);
  EXPECT_EQ(m->loss, LossKernel::kFused);
  EXPECT_EQ(m->precision, Precision::kBf16);
  EXPECT_EQ(m->head_dim(), 16);

  // Without `name`, the file name (less its extension) names the model.
  auto unnamed = parse_model(replace(kSmall, "name: small\n", ""), "dir/tiny.yaml");
  ASSERT_TRUE(unnamed.ok());
  EXPECT_EQ(unnamed->name, "tiny");
}

TEST(Model, ReadsEveryEnumSpelling) {
  std::string yaml =
      std::string(kSmall) +
      "position: alibi\nnorm: rmsnorm\nattention: unfused\nloss: unfused\nprecision: fp8\n"
      "dropout: true\nfamily: mpt\n";
  auto m = parse_model(replace(yaml, "mlp: gelu", "mlp: relu"), "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->mlp, MlpKind::kRelu);
  EXPECT_EQ(m->position, PositionKind::kAlibi);
  EXPECT_EQ(m->norm, NormKind::kRmsNorm);
  EXPECT_EQ(m->attention, AttentionKernel::kUnfused);
  EXPECT_EQ(m->loss, LossKernel::kUnfused);
  EXPECT_EQ(m->precision, Precision::kFp8);
  EXPECT_TRUE(m->dropout);
  EXPECT_EQ(m->family, "mpt");

  EXPECT_EQ(to_string(MlpKind::kSquaredRelu), "squared_relu");
  EXPECT_EQ(to_string(MlpKind::kSwiglu), "swiglu");
  EXPECT_EQ(to_string(PositionKind::kRope), "rope");
  EXPECT_EQ(to_string(NormKind::kLayerNorm), "layernorm");
  EXPECT_EQ(to_string(AttentionKernel::kFlash), "flash");
  EXPECT_EQ(to_string(LossKernel::kUnfused), "unfused");
  EXPECT_EQ(to_string(LossKernel::kVocabParallel), "vocab_parallel");
  auto vp = parse_model(std::string(kSmall) + "loss: vocab_parallel\n", "m.yaml");
  ASSERT_TRUE(vp.ok()) << vp.error().message();
  EXPECT_EQ(vp->loss, LossKernel::kVocabParallel);
  EXPECT_EQ(to_string(LossKernel::kLossParallel), "loss_parallel");
  auto lp = parse_model(std::string(kSmall) + "loss: loss_parallel\n", "m.yaml");
  ASSERT_TRUE(lp.ok()) << lp.error().message();
  EXPECT_EQ(lp->loss, LossKernel::kLossParallel);
  EXPECT_EQ(to_string(LossKernel::kFlashAttn), "flash_attn");
  auto fa = parse_model(std::string(kSmall) + "loss: flash_attn\n", "m.yaml");
  ASSERT_TRUE(fa.ok()) << fa.error().message();
  EXPECT_EQ(fa->loss, LossKernel::kFlashAttn);
  // The spellings round-trip, and a typo is named with a suggestion.
  for (LossKernel k : {LossKernel::kFused, LossKernel::kVocabParallel, LossKernel::kUnfused,
                       LossKernel::kLossParallel, LossKernel::kFlashAttn}) {
    auto parsed = parse_loss_kernel(std::string(to_string(k)));
    ASSERT_TRUE(parsed.ok()) << to_string(k);
    EXPECT_EQ(*parsed, k);
  }
  auto typo = parse_loss_kernel("flash_atn");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.error().message().find("did you mean 'flash_attn'"), std::string::npos)
      << typo.error().message();
  // A misspelt kernel names the field and the spellings it takes.
  auto bad = parse_model(std::string(kSmall) + "loss: fussed\n", "m.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("loss"), std::string::npos) << bad.error().message();
  EXPECT_NE(bad.error().message().find("fused"), std::string::npos) << bad.error().message();
}

TEST(Model, MalformedYamlNamesFileAndLine) {
  std::string msg = parse_error("layers: 2\nhidden: [64\nheads: 4\n");
  EXPECT_TRUE(contains(msg, "m.yaml:")) << msg;
  EXPECT_TRUE(contains(msg, "malformed YAML")) << msg;
}

TEST(Model, MixtralCountsMatchThePaper) {
  auto m = load_model("mixtral-8x7b");
  ASSERT_TRUE(m.ok()) << m.error().message();
  // Jiang et al. 2024: 46.7B parameters.
  EXPECT_NEAR(static_cast<double>(m->parameters()), 46.7e9, 46.7e9 * 0.002);
  // By hand: GQA attention, a router (h x experts) and 8 SwiGLU experts, two RMSNorms.
  const int64_t h = 4096, f = 14336, kv = 8 * 128, E = 8;
  EXPECT_EQ(m->layer_parameters(), h * (h + 2 * kv) + h * h + h * E + E * 3 * h * f + 2 * h);
}

// The model card's 14.3B: 60 SwiGLU experts and a shared one of 5632 beside them.
TEST(Model, QwenMoeCountsMatchTheModelCard) {
  auto m = load_model("qwen1.5-moe-a2.7b");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_NEAR(static_cast<double>(m->parameters()), 14.3e9, 14.3e9 * 0.002);
  const int64_t h = 2048, E = 60;
  EXPECT_EQ(m->layer_parameters(), 4 * h * h + h * E + E * 3 * h * 1408 + 3 * h * 5632 + 2 * h);
  // The shared expert is no routed expert: expert parallelism does not divide it.
  EXPECT_EQ(m->expert_parameters(), 24 * E * 3 * h * 1408);
}

// Qwen3's heads are wider than hidden / heads: 32 of 128 over a hidden size of 2,048.
TEST(Model, Qwen3CountsMatchTheModelCard) {
  auto m = load_model("qwen3-30b-a3b");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->head_dim(), 128);
  EXPECT_NEAR(static_cast<double>(m->parameters()), 30.5e9, 30.5e9 * 0.002);
  const double embeddings =
      static_cast<double>(m->embedding_parameters()) + static_cast<double>(m->head_parameters());
  EXPECT_NEAR(static_cast<double>(m->parameters()) - embeddings, 29.9e9, 29.9e9 * 0.002);
  const int64_t h = 2048, d = 128;
  // The norm, Q, K, V (32 + 2 x 4 heads), the query and key norms and the output projection from
  // the 4,096-wide heads.
  EXPECT_EQ(m->attention_parameters(), h + h * (32 + 2 * 4) * d + 2 * d + 32 * d * h);
}

// The 2025 mixtures of experts against their model cards: Qwen3-235B-A22B's 235B; GLM-4.5's 355B
// (nnsim's 356.8B hold the multi-token prediction module, 4.0B of them); Kimi K2's "1T".
TEST(Model, LargeMixturesMatchTheirModelCards) {
  auto qwen = load_model("qwen3-235b-a22b");
  ASSERT_TRUE(qwen.ok()) << qwen.error().message();
  EXPECT_NEAR(static_cast<double>(qwen->parameters()), 235e9, 235e9 * 0.002);
  auto glm = load_model("glm-4.5");
  ASSERT_TRUE(glm.ok()) << glm.error().message();
  EXPECT_NEAR(static_cast<double>(glm->parameters()), 355e9, 355e9 * 0.006);
  auto kimi = load_model("kimi-k2");
  ASSERT_TRUE(kimi.ok()) << kimi.error().message();
  EXPECT_NEAR(static_cast<double>(kimi->parameters()), 1.0e12, 1.0e12 * 0.04);
  EXPECT_EQ(kimi->experts, 384);
  EXPECT_EQ(kimi->first_dense_layers, 1);
}

// GPT-OSS against its model card (116.83B and 20.91B; the heads' attention sinks and the
// routers' biases, 6,912 and 2,304 parameters, are not modelled), and its alternating sliding
// windows: the first block and every other one after it attend within 128 tokens.
TEST(Model, GptOssMatchesItsModelCardAndAlternatesWindows) {
  auto big = load_model("gpt-oss-120b");
  ASSERT_TRUE(big.ok()) << big.error().message();
  EXPECT_NEAR(static_cast<double>(big->parameters()), 116.83e9, 0.01e9);
  auto small = load_model("gpt-oss-20b");
  ASSERT_TRUE(small.ok()) << small.error().message();
  EXPECT_NEAR(static_cast<double>(small->parameters()), 20.91e9, 0.01e9);
  EXPECT_EQ(big->sliding_window, 128);
  EXPECT_TRUE(big->windowed());
  EXPECT_TRUE(big->is_windowed_layer(0));
  EXPECT_FALSE(big->is_windowed_layer(1));
  EXPECT_TRUE(big->is_windowed_layer(34));
  EXPECT_FALSE(big->is_windowed_layer(35));
  EXPECT_EQ(big->windowed_layers(), 18);
}

// GeGLU is gated as SwiGLU is: three matrices, and the plan records it.
TEST(Model, GegluIsAGatedMlp) {
  auto geglu = parse_model(replace(kSmall, "mlp: gelu", "mlp: geglu"), "m.yaml");
  ASSERT_TRUE(geglu.ok()) << geglu.error().message();
  auto swiglu = parse_model(replace(kSmall, "mlp: gelu", "mlp: swiglu"), "m.yaml");
  ASSERT_TRUE(swiglu.ok()) << swiglu.error().message();
  EXPECT_TRUE(geglu->gated_mlp());
  EXPECT_EQ(geglu->parameters(), swiglu->parameters());
  auto back = parse_model(model_to_json(*geglu), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->mlp, MlpKind::kGeglu);
}

TEST(Model, PostNormsAddANormAfterTheAttentionAndTheMlp) {
  auto plain = parse_model(kSmall, "m.yaml");
  ASSERT_TRUE(plain.ok()) << plain.error().message();
  auto post = parse_model(std::string(kSmall) + "post_norms: true\n", "m.yaml");
  ASSERT_TRUE(post.ok()) << post.error().message();
  // Two norms a block, each a scale and (LayerNorm with biases) a shift of hidden's width.
  const int64_t per_norm =
      plain->hidden * (plain->norm == NormKind::kLayerNorm && plain->bias ? 2 : 1);
  EXPECT_EQ(post->parameters() - plain->parameters(), plain->layers * 2 * per_norm);
  auto back = parse_model(model_to_json(*post), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_TRUE(back->post_norms);
  EXPECT_FALSE(contains(model_to_json(*plain), "post_norms"));
  const std::string msg = parse_error(std::string(kSmall) + "post_norms: sometimes\n");
  EXPECT_TRUE(contains(msg, "post_norms")) << msg;
}

TEST(Model, Gemma3LanguageModel) {
  // google/gemma-3-27b-pt's text_config: 62 blocks of 32 query and 16 key/value heads of width
  // 128 over 5,376, GeGLU of 21,504, a 262,208-token vocabulary tied to the head: 27.0B (the
  // checkpoint's "27B" without its SigLIP vision encoder). Five windowed blocks to one global.
  auto m = load_model("gemma-3-27b");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->parameters(), 27'009'346'304);
  EXPECT_TRUE(m->post_norms);
  EXPECT_TRUE(m->qk_norm);
  EXPECT_EQ(m->windowed_layers(), 62 - 62 / 6);
}

TEST(Model, SlidingWindowFieldsAreCheckedAndRoundTrip) {
  // Every layer within the window unless an interval says which attend fully.
  auto all = parse_model(std::string(kSmall) + "sliding_window: 32\n", "m.yaml");
  ASSERT_TRUE(all.ok()) << all.error().message();
  EXPECT_EQ(all->windowed_layers(), all->layers);
  auto back = parse_model(model_to_json(*all), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->sliding_window, 32);
  EXPECT_EQ(back->full_attention_interval, 0);
  auto alternate = parse_model(
      std::string(kSmall) + "sliding_window: 32\nfull_attention_interval: 2\n", "m.yaml");
  ASSERT_TRUE(alternate.ok()) << alternate.error().message();
  EXPECT_EQ(alternate->windowed_layers(), alternate->layers - alternate->layers / 2);
  EXPECT_FALSE(contains(model_to_json(*parse_model(kSmall, "m.yaml")), "sliding_window"));

  std::string msg = parse_error(std::string(kSmall) + "sliding_window: 0\n");
  EXPECT_TRUE(contains(msg, "sliding_window")) << msg;
  EXPECT_TRUE(contains(msg, "must be a positive number of tokens")) << msg;
  msg = parse_error(std::string(kSmall) + "full_attention_interval: 2\n");
  EXPECT_TRUE(contains(msg, "full_attention_interval")) << msg;
  EXPECT_TRUE(contains(msg, "give 'sliding_window' too")) << msg;
  msg = parse_error(std::string(kSmall) + "sliding_window: 8\nfull_attention_interval: -1\n");
  EXPECT_TRUE(contains(msg, "must be between 0 (every layer attends within the window)")) << msg;
}

TEST(Model, HeadDimGivesTheHeadsTheirOwnWidth) {
  // 5 heads of 16 over a hidden size of 64: they need not divide it.
  const std::string wide = replace(kSmall, "heads: 4", "heads: 5") + "head_dim: 16\nkv_heads: 1\n";
  auto m = parse_model(wide, "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->head_dim(), 16);
  const int64_t h = 64;
  EXPECT_EQ(m->attention_parameters(), 2 * h + (h * (5 + 2) * 16 + (5 + 2) * 16) +
                                           (5 * 16 * h + h));  // norm, Q/K/V, output, biases
  auto back = parse_model(model_to_json(*m), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->head_width, 16);
  EXPECT_EQ(back->parameters(), m->parameters());

  std::string msg = parse_error(std::string(kSmall) + "head_dim: 0\n");
  EXPECT_TRUE(contains(msg, "field 'head_dim'")) << msg;
  EXPECT_TRUE(contains(msg, "positive integer")) << msg;
  msg = parse_error(std::string(kSmall) + "head_dim: -8\n");
  EXPECT_TRUE(contains(msg, "field 'head_dim'")) << msg;
  msg = parse_error(replace(kSmall, "heads: 4", "heads: 1024") + "head_dim: 20000\n");
  EXPECT_TRUE(contains(msg, "field 'head_dim'")) << msg;
  EXPECT_TRUE(contains(msg, "over the 16777216 nnsim handles")) << msg;
  msg = parse_error(std::string(kSmall) +
                    "head_dim: 16\nkv_lora_rank: 32\nqk_nope_head_dim: 16\n"
                    "qk_rope_head_dim: 8\nv_head_dim: 16\n");
  EXPECT_TRUE(contains(msg, "field 'head_dim'")) << msg;
  EXPECT_TRUE(contains(msg, "remove head_dim")) << msg;
  // Without it, heads must still divide hidden, and the message offers head_dim.
  msg = parse_error(replace(kSmall, "heads: 4", "heads: 5"));
  EXPECT_TRUE(contains(msg, "or give head_dim")) << msg;
}

TEST(Model, QkNormAddsTwoHeadWideNorms) {
  auto m = parse_model(std::string(kSmall) + "qk_norm: true\n", "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_TRUE(m->qk_norm);
  auto plain = parse_model(kSmall, "m.yaml");
  ASSERT_TRUE(plain.ok());
  // LayerNorm with a shift (the defaults): a scale and a shift of d = 16 for queries and keys.
  EXPECT_EQ(m->attention_parameters() - plain->attention_parameters(), 2 * 2 * 16);
  auto back = parse_model(model_to_json(*m), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_TRUE(back->qk_norm);
  EXPECT_FALSE(contains(model_to_json(*plain), "qk_norm"));
  const std::string msg = parse_error(std::string(kSmall) +
                                      "qk_norm: true\nkv_lora_rank: 32\nqk_nope_head_dim: 16\n"
                                      "qk_rope_head_dim: 8\nv_head_dim: 16\n");
  EXPECT_TRUE(contains(msg, "field 'qk_norm'")) << msg;
  EXPECT_TRUE(contains(msg, "remove qk_norm")) << msg;
}

TEST(Model, MixtureOfExpertsFieldsAreChecked) {
  const std::string moe = std::string(kSmall) + "experts: 8\nexperts_per_token: 2\n";
  auto m = parse_model(moe, "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->expert_ffn_hidden, 256);  // ffn_hidden unless given
  // Router (64 x 8) and 8 GeLU MLPs with biases replace the MLP.
  const int64_t dense = parse_model(kSmall, "m.yaml")->layer_parameters();
  const int64_t mlp = 2 * 64 * 256 + 256 + 64;
  EXPECT_EQ(m->layer_parameters(), dense - mlp + 64 * 8 + 8 * mlp);

  std::string msg = parse_error(std::string(kSmall) + "experts: 1\nexperts_per_token: 1\n");
  EXPECT_TRUE(contains(msg, "m.yaml:9: field 'experts'")) << msg;
  EXPECT_TRUE(contains(msg, "between 2 and")) << msg;
  msg = parse_error(std::string(kSmall) + "experts: 8\nexperts_per_token: 9\n");
  EXPECT_TRUE(contains(msg, "field 'experts_per_token'")) << msg;
  EXPECT_TRUE(contains(msg, "between 1 and experts (8), got 9")) << msg;
  msg = parse_error(std::string(kSmall) + "experts: 8\n");
  EXPECT_TRUE(contains(msg, "missing required field 'experts_per_token'")) << msg;
  msg = parse_error(std::string(kSmall) + "expert_ffn_hidden: 128\n");
  EXPECT_TRUE(contains(msg, "field 'expert_ffn_hidden'")) << msg;
  EXPECT_TRUE(contains(msg, "give 'experts' too")) << msg;
  msg = parse_error(moe + "expert_ffn_hidden: 0\n");
  EXPECT_TRUE(contains(msg, "field 'expert_ffn_hidden'")) << msg;
  for (const char* c : {"0.5", "4.5"}) {  // dropping tokens; more than every token per expert
    msg = parse_error(moe + "expert_capacity_factor: " + c + "\n");
    EXPECT_TRUE(contains(msg, "field 'expert_capacity_factor'")) << msg;
    EXPECT_TRUE(contains(msg, "between 1 (balanced) and experts / experts_per_token (4)")) << msg;
  }
  msg = parse_error(moe + "shared_expert_ffn_hidden: -5\n");
  EXPECT_TRUE(contains(msg, "field 'shared_expert_ffn_hidden'")) << msg;
  msg = parse_error(std::string(kSmall) + "shared_expert_ffn_hidden: 128\n");
  EXPECT_TRUE(contains(msg, "give 'experts' too")) << msg;
  msg = parse_error(std::string(kSmall) + "expert_capacity_factor: 1.25\n");
  EXPECT_TRUE(contains(msg, "give 'experts' too")) << msg;
  auto padded = parse_model(moe + "expert_capacity_factor: 1.25\n", "m.yaml");
  ASSERT_TRUE(padded.ok()) << padded.error().message();
  EXPECT_EQ(parse_model(model_to_json(*padded), "plan.json")->expert_capacity_factor, 1.25);
  EXPECT_FALSE(contains(model_to_json(*m), "capacity"));  // 1 is the default
  // A dense model's JSON has no expert fields; a mixture's keeps them.
  EXPECT_FALSE(contains(model_to_json(*parse_model(kSmall, "m.yaml")), "experts"));
  auto back = parse_model(model_to_json(*m), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->experts, 8);
  EXPECT_EQ(back->experts_per_token, 2);
}

// The paper's 16.4B: a dense first layer (SwiGLU of 10944), then 27 layers of 64 routed experts
// and a shared MLP of 2 x 1408.
TEST(Model, DeepSeekMoeCountsMatchThePaper) {
  auto m = load_model("deepseek-moe-16b");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_NEAR(static_cast<double>(m->parameters()), 16.4e9, 16.4e9 * 0.002);
  const int64_t h = 2048, E = 64, attention = 4 * h * h, norms = 2 * h;
  EXPECT_EQ(m->dense_layer_parameters(), attention + 3 * h * 10944 + norms);
  EXPECT_EQ(m->layer_parameters(), attention + h * E + E * 3 * h * 1408 + 3 * h * 2816 + norms);
  EXPECT_EQ(m->moe_layers(), 27);
  EXPECT_TRUE(m->mixed_layers());
  EXPECT_FALSE(m->is_moe_layer(0));
  EXPECT_TRUE(m->is_moe_layer(1));
  EXPECT_EQ(m->expert_parameters(), 27 * E * 3 * h * 1408);
  EXPECT_EQ(m->parameters(),
            27 * m->layer_parameters() + m->dense_layer_parameters() + 2 * 102400 * h + h);
}

// Megatron-Core's --moe-layer-freq and DeepSeek's first_k_dense_replace: which blocks have
// experts, what the JSON keeps, and the bad values.
TEST(Model, ExpertBlocksFollowTheDenseLayersAndInterval) {
  const std::string moe =
      replace(std::string(kSmall), "layers: 2", "layers: 8") + "experts: 8\nexperts_per_token: 2\n";
  auto all = parse_model(moe, "m.yaml");
  ASSERT_TRUE(all.ok()) << all.error().message();
  EXPECT_FALSE(all->mixed_layers());
  EXPECT_EQ(all->moe_layers(), 8);
  auto m = parse_model(moe + "first_dense_layers: 1\nmoe_layer_interval: 2\n", "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  std::vector<int> expert_blocks;
  for (int l = 0; l < 8; ++l) {
    if (m->is_moe_layer(l)) expert_blocks.push_back(l);
  }
  EXPECT_EQ(expert_blocks, (std::vector<int>{1, 3, 5, 7}));  // Llama 4's and Qwen2-MoE's odd layers
  EXPECT_EQ(m->parameters(), 4 * m->layer_parameters() + 4 * all->dense_layer_parameters() +
                                 all->embedding_parameters() + all->head_parameters());
  auto back = parse_model(model_to_json(*m), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->first_dense_layers, 1);
  EXPECT_EQ(back->moe_layer_interval, 2);
  EXPECT_FALSE(contains(model_to_json(*all), "first_dense_layers"));  // defaults stay out

  std::string msg = parse_error(moe + "first_dense_layers: 8\n");
  EXPECT_TRUE(contains(msg, "m.yaml:11: field 'first_dense_layers'")) << msg;
  EXPECT_TRUE(contains(msg, "between 0 and layers - 1 (7)")) << msg;
  msg = parse_error(moe + "first_dense_layers: -1\n");
  EXPECT_TRUE(contains(msg, "between 0 and layers (8), got -1")) << msg;
  msg = parse_error(moe + "moe_layer_interval: 0\n");
  EXPECT_TRUE(contains(msg, "field 'moe_layer_interval'")) << msg;
  EXPECT_TRUE(contains(msg, "between 1 (every block has experts) and layers (8)")) << msg;
  msg = parse_error(moe + "moe_layer_interval: 5000000000\n");
  EXPECT_TRUE(contains(msg, "between 0 and layers (8), got 5000000000")) << msg;
  msg = parse_error(std::string(kSmall) + "first_dense_layers: 1\n");
  EXPECT_TRUE(contains(msg, "give 'experts' too")) << msg;
}

// Group-limited routing (DeepSeek-V3's node-limited routing): kept in the JSON, and the values
// that leave a token no room for its experts are refused with the field.
TEST(Model, RouterGroupsLimitWhereATokensExpertsAre) {
  const std::string moe = std::string(kSmall) + "experts: 16\nexperts_per_token: 4\n";
  auto m = parse_model(moe + "router_groups: 8\nrouter_group_topk: 2\n", "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  auto back = parse_model(model_to_json(*m), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->router_groups, 8);
  EXPECT_EQ(back->router_group_topk, 2);
  auto v3 = load_model("deepseek-v3");
  ASSERT_TRUE(v3.ok());
  EXPECT_EQ(v3->router_groups, 8);
  EXPECT_EQ(v3->router_group_topk, 4);

  std::string msg = parse_error(moe + "router_groups: 3\nrouter_group_topk: 1\n");
  EXPECT_TRUE(contains(msg, "field 'router_groups': must divide experts (16)")) << msg;
  msg = parse_error(moe + "router_groups: 8\nrouter_group_topk: 1\n");  // 2 experts < top-4
  EXPECT_TRUE(contains(msg, "field 'router_group_topk'")) << msg;
  EXPECT_TRUE(contains(msg, "room for experts_per_token (4)")) << msg;
  msg = parse_error(moe + "router_groups: 8\nrouter_group_topk: 9\n");
  EXPECT_TRUE(contains(msg, "between 1 and router_groups (8)")) << msg;
  msg = parse_error(moe + "router_group_topk: 2\n");
  EXPECT_TRUE(contains(msg, "needs 'router_groups' too")) << msg;
  msg = parse_error(moe + "router_groups: 8\n");
  EXPECT_TRUE(contains(msg, "router_group_topk")) << msg;
  msg = parse_error(std::string(kSmall) + "router_groups: 2\n");
  EXPECT_TRUE(contains(msg, "give 'experts' too")) << msg;
}

// Multi-head latent attention: DeepSeek-V3's 671B (the paper's, without its multi-token
// prediction module) and its attention by hand.
TEST(Model, DeepSeekV3CountsMatchThePaper) {
  auto m = load_model("deepseek-v3");
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_TRUE(m->mla());
  // The main model's 671B, and the prediction module's own: with the checkpoint's copies of the
  // embedding and the output head it is the released 685B.
  ASSERT_EQ(m->mtp_layers, 1);
  const int64_t mtp = m->mtp_parameters();
  EXPECT_NEAR(static_cast<double>(m->parameters() - mtp), 671e9, 671e9 * 0.001);
  EXPECT_NEAR(static_cast<double>(m->parameters() + 2 * m->embedding_parameters()), 685e9,
              685e9 * 0.002);
  // Its norms, the 2h -> h projection and a block with experts.
  EXPECT_EQ(mtp, 3 * 7168 + 2 * 7168 * 7168 + m->layer_parameters());
  const int64_t h = 7168, a = 128;
  const int64_t q = h * 1536 + 1536 + 1536 * a * 192;  // down, norm, up
  const int64_t kv = h * (512 + 64) + 512 + 512 * a * (128 + 128);
  EXPECT_EQ(m->attention_parameters(), h + q + kv + a * 128 * h);
  EXPECT_EQ(m->moe_layers(), 58);
  auto lite = load_model("deepseek-v2-lite");
  ASSERT_TRUE(lite.ok()) << lite.error().message();
  EXPECT_NEAR(static_cast<double>(lite->parameters()), 15.7e9, 15.7e9 * 0.002);  // the card's
  // No query latent: one projection to the heads.
  EXPECT_EQ(lite->attention_parameters(),
            2048 + 2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048);
}

TEST(Model, MultiTokenPredictionFieldIsChecked) {
  auto m = parse_model(std::string(kSmall) + "mtp_layers: 2\n", "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  auto plain = parse_model(kSmall, "m.yaml");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(m->head_parameters() - plain->head_parameters(), 2 * m->mtp_parameters());
  // LayerNorm with a shift: three norms of 2h, the 2h -> h projection and a block.
  EXPECT_EQ(m->mtp_parameters(), 3 * 2 * 64 + 2 * 64 * 64 + plain->layer_parameters());
  auto back = parse_model(model_to_json(*m), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->mtp_layers, 2);
  EXPECT_FALSE(contains(model_to_json(*plain), "mtp_layers"));
  for (const char* bad : {"mtp_layers: -1\n", "mtp_layers: 17\n"}) {
    const std::string msg = parse_error(std::string(kSmall) + bad);
    EXPECT_TRUE(contains(msg, "field 'mtp_layers'")) << msg;
    EXPECT_TRUE(contains(msg, "between 0 (no multi-token prediction) and 16")) << msg;
  }
}

TEST(Model, LatentAttentionFieldsAreChecked) {
  const std::string mla = std::string(kSmall) +
                          "kv_lora_rank: 32\nqk_nope_head_dim: 16\nqk_rope_head_dim: 8\n"
                          "v_head_dim: 16\n";
  auto m = parse_model(mla, "m.yaml");
  ASSERT_TRUE(m.ok()) << m.error().message();
  auto back = parse_model(model_to_json(*m), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->attention_parameters(), m->attention_parameters());
  EXPECT_EQ(back->v_head_dim, 16);

  std::string msg = parse_error(std::string(kSmall) + "kv_lora_rank: 32\n");
  EXPECT_TRUE(contains(msg, "qk_nope_head_dim")) << msg;  // required with it
  msg = parse_error(std::string(kSmall) + "v_head_dim: 16\n");
  EXPECT_TRUE(contains(msg, "give 'kv_lora_rank' too")) << msg;
  msg = parse_error(replace(mla, "v_head_dim: 16", "v_head_dim: 0"));
  EXPECT_TRUE(contains(msg, "field 'v_head_dim'")) << msg;
  EXPECT_TRUE(contains(msg, "positive integer")) << msg;
  msg = parse_error(mla + "q_lora_rank: -1\n");
  EXPECT_TRUE(contains(msg, "field 'q_lora_rank'")) << msg;
  msg = parse_error(
      replace(replace(mla, "v_head_dim: 16", "v_head_dim: 20000"), "heads: 4", "heads: 1024"));
  EXPECT_TRUE(contains(msg, "field 'v_head_dim'")) << msg;
  EXPECT_TRUE(contains(msg, "over the 16777216 nnsim handles")) << msg;
  msg = parse_error(mla + "kv_heads: 2\n");
  EXPECT_TRUE(contains(msg, "kv_heads must equal heads (4)")) << msg;
}

TEST(Model, UnknownFieldSuggestsTheRightOne) {
  std::string msg = parse_error(replace(kSmall, "hidden: 64", "hiden: 64"));
  EXPECT_TRUE(contains(msg, "m.yaml:3")) << msg;
  EXPECT_TRUE(contains(msg, "unknown field 'hiden'")) << msg;
  EXPECT_TRUE(contains(msg, "did you mean 'hidden'")) << msg;
}

TEST(Model, HeadsMustDivideHidden) {
  std::string msg = parse_error(replace(kSmall, "heads: 4", "heads: 5"));
  EXPECT_TRUE(contains(msg, "m.yaml:4")) << msg;
  EXPECT_TRUE(contains(msg, "field 'heads'")) << msg;
  EXPECT_TRUE(contains(msg, "must divide hidden (64)")) << msg;
  EXPECT_TRUE(contains(msg, "use heads = 4 or 8")) << msg;
}

TEST(Model, KvHeadsMustDivideHeads) {
  std::string msg = parse_error(std::string(kSmall) + "kv_heads: 3\n");
  EXPECT_TRUE(contains(msg, "m.yaml:9")) << msg;
  EXPECT_TRUE(contains(msg, "field 'kv_heads'")) << msg;
  EXPECT_TRUE(contains(msg, "must divide heads (4)")) << msg;
}

TEST(Model, UnknownMlpSuggestsTheRightOne) {
  std::string msg = parse_error(replace(kSmall, "mlp: gelu", "mlp: swiglue"));
  EXPECT_TRUE(contains(msg, "m.yaml:6")) << msg;
  EXPECT_TRUE(contains(msg, "field 'mlp'")) << msg;
  EXPECT_TRUE(contains(msg, "unknown value 'swiglue'")) << msg;
  EXPECT_TRUE(contains(msg, "did you mean 'swiglu'")) << msg;
}

TEST(Model, MissingRequiredFieldIsNamed) {
  std::string msg = parse_error(replace(kSmall, "vocab: 1000\n", ""));
  EXPECT_TRUE(contains(msg, "m.yaml:1")) << msg;
  EXPECT_TRUE(contains(msg, "missing required field 'vocab'")) << msg;
}

TEST(Model, NonPositiveAndHugeSizesAreRejected) {
  std::string msg = parse_error(replace(kSmall, "layers: 2", "layers: 0"));
  EXPECT_TRUE(contains(msg, "m.yaml:2: field 'layers'")) << msg;
  EXPECT_TRUE(contains(msg, "must be a positive integer, got 0")) << msg;

  msg = parse_error(replace(kSmall, "layers: 2", "layers: 4294967298"));
  EXPECT_TRUE(contains(msg, "m.yaml:2: field 'layers'")) << msg;
  EXPECT_TRUE(contains(msg, "too large")) << msg;

  msg = parse_error(replace(kSmall, "seq_len: 128", "seq_len: 12.5"));
  EXPECT_TRUE(contains(msg, "field 'seq_len'")) << msg;
  EXPECT_TRUE(contains(msg, "expected an integer")) << msg;

  msg = parse_error(std::string(kSmall) + "bias: maybe\n");
  EXPECT_TRUE(contains(msg, "field 'bias'")) << msg;
}

TEST(Model, ValidateNamesTheModelAndField) {
  auto m = load_model("llama3-8b");
  ASSERT_TRUE(m.ok());
  ModelSpec bad = *m;
  bad.kv_heads = 3;
  Status s = validate_model(bad);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(), "model 'llama3-8b': field 'kv_heads'"))
      << s.error().message();
  bad = *m;
  bad.seq_len = -1;
  s = validate_model(bad);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(), "field 'seq_len'")) << s.error().message();
}

TEST(Model, LoadsFilesAndReportsTheirPath) {
  std::string path = testing::TempDir() + "nnsim_model_test_bad.yaml";
  {
    std::ofstream out(path);
    out << replace(kSmall, "heads: 4", "heads: 6");
  }
  auto m = load_model(path);
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(contains(m.error().message(), path + ":4: field 'heads'")) << m.error().message();

  auto missing = load_model(testing::TempDir() + "no_such_model.yaml");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(contains(missing.error().message(), "no_such_model.yaml"))
      << missing.error().message();
}

TEST(Model, UnknownPresetSuggestsANearOne) {
  auto m = load_model("gpt3-175");
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(contains(m.error().message(), "did you mean 'gpt3-175b'")) << m.error().message();
}

TEST(Model, JsonRoundTripKeepsEveryField) {
  for (const auto& name : model_preset_names()) {
    auto m = load_model(name);
    ASSERT_TRUE(m.ok()) << m.error().message();
    auto back = parse_model(model_to_json(*m), "plan.json");
    ASSERT_TRUE(back.ok()) << back.error().message();
    EXPECT_EQ(model_to_json(*back), model_to_json(*m));
    EXPECT_EQ(back->parameters(), m->parameters());
  }
  ModelSpec odd = *parse_model(std::string(kSmall) +
                                   "position: alibi\nnorm: rmsnorm\nattention: unfused\n"
                                   "precision: fp16\nbias: false\ndropout: true\nfamily: mpt\n",
                               "m.yaml");
  auto back = parse_model(model_to_json(odd), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(model_to_json(*back), model_to_json(odd));
  EXPECT_TRUE(contains(model_to_json(odd), "\"attention\":\"unfused\""));
}

TEST(Model, ParsesAModelEmbeddedInALargerFile) {
  InputNode root = InputNode::load_string(
      "case: x\nmodel:\n  layers: 2\n  hidden: 64\n  heads: 3\n  ffn_hidden: 256\n  mlp: gelu\n"
      "  vocab: 10\n  seq_len: 8\n",
      "cases.yaml");
  try {
    parse_model_node(root["model"], "x");
    FAIL() << "expected an InputError";
  } catch (const InputError& e) {
    EXPECT_TRUE(contains(e.what(), "cases.yaml:5: field 'model.heads'")) << e.what();
  }
}

}  // namespace
}  // namespace nnsim
