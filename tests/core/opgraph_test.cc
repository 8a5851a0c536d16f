#include "core/opgraph.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/model.h"

namespace nnsim {
namespace {

// Sum of a graph part's FLOPs.
double fwd(const GraphPart& part) {
  double f = 0;
  for (const auto& op : part.ops) f += op.fwd_flops;
  return f;
}
double bwd(const GraphPart& part) {
  double f = 0;
  for (const auto& op : part.ops) f += op.bwd_input_flops + op.bwd_weight_flops;
  return f;
}

// FLOPs of one iteration of `global_batch` sequences, from the operator graph: every layer runs
// forward, backward and (with full recompute) a second forward; the head runs forward and
// backward.
double graph_flops(const ModelSpec& m, int64_t global_batch, int64_t micro_batch, bool recompute) {
  OpGraph g = lower_model(m, micro_batch);
  const double per_layer = (recompute ? 2 : 1) * fwd(g.blocks[0]) + bwd(g.blocks[0]);
  const double per_micro_batch =
      m.layers * per_layer + fwd(g.head) + bwd(g.head) + fwd(g.embedding) + bwd(g.embedding);
  return static_cast<double>(global_batch / micro_batch) * per_micro_batch;
}

// Narayanan et al. 2021, eq. 3 (full recompute) and the same count without recompute.
double megatron_flops(const ModelSpec& m, double B, bool recompute) {
  const double s = m.seq_len, l = m.layers, h = m.hidden, V = m.vocab;
  if (recompute) return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
  return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
}

ModelSpec preset(const std::string& name) {
  auto m = load_model(name);
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
  return *m;
}

// The model of Korthikanti et al. 2022: multi-head attention, f = 4h, unfused attention whose
// softmax and dropout are kept, dropout after attention and MLP, 16-bit activations.
ModelSpec korthikanti(const std::string& name) {
  ModelSpec m = preset(name);
  m.attention = AttentionKernel::kUnfused;
  m.dropout = true;
  m.precision = Precision::kBf16;
  EXPECT_EQ(m.kv_heads, m.heads);
  EXPECT_EQ(m.ffn_hidden, 4 * m.hidden);
  return m;
}

std::vector<std::string> layer_op_names(const OpGraph& g) {
  std::vector<std::string> names;
  for (const auto& op : g.blocks[0].ops) names.push_back(op.name);
  return names;
}

const Op* find_op(const GraphPart& part, const std::string& name) {
  for (const auto& op : part.ops) {
    if (op.name == name) return &op;
  }
  return nullptr;
}

TEST(OpGraph, MegatronFlopsWithFullRecompute) {
  struct Case {
    std::string model;
    int64_t global_batch, micro_batch;
  };
  for (const Case& c :
       {Case{"gpt3-175b", 1536, 1}, Case{"gpt3-1.3b", 512, 4}, Case{"gpt3-13b", 96, 2}}) {
    ModelSpec m = preset(c.model);
    const double got = graph_flops(m, c.global_batch, c.micro_batch, true);
    const double want = megatron_flops(m, static_cast<double>(c.global_batch), true);
    EXPECT_NEAR(got / want, 1.0, 1e-9) << c.model << ": " << got << " vs " << want;
  }
}

TEST(OpGraph, MegatronFlopsWithoutRecompute) {
  for (const char* name : {"gpt3-175b", "gpt3-1.3b", "gpt3-6.7b"}) {
    ModelSpec m = preset(name);
    const double got = graph_flops(m, 256, 2, false);
    const double want = megatron_flops(m, 256, false);
    EXPECT_NEAR(got / want, 1.0, 1e-9) << name;
    // forward_flops + backward_flops are the same count, per micro-batch.
    OpGraph g = lower_model(m, 2);
    EXPECT_NEAR((g.forward_flops() + g.backward_flops()) * 128 / want, 1.0, 1e-9) << name;
  }
}

TEST(OpGraph, LayerFlopsAndBackwardRatio) {
  ModelSpec m = preset("gpt3-1.3b");
  const double b = 3, s = m.seq_len, h = m.hidden;
  OpGraph g = lower_model(m, 3);
  // 24 b s h^2 (QKV 6, projection 2, MLP 16) + 4 b s^2 h (scores and weighted values).
  EXPECT_DOUBLE_EQ(fwd(g.blocks[0]), 24 * b * s * h * h + 4 * b * s * s * h);
  EXPECT_DOUBLE_EQ(bwd(g.blocks[0]), 2 * fwd(g.blocks[0]));
  // Head: 2 b s h V forward, twice that backward; the embedding lookup is free.
  EXPECT_DOUBLE_EQ(fwd(g.head), 2 * b * s * h * m.vocab);
  EXPECT_DOUBLE_EQ(bwd(g.head), 4 * b * s * h * m.vocab);
  EXPECT_EQ(fwd(g.embedding), 0);
  EXPECT_EQ(bwd(g.embedding), 0);
  const Op* core = find_op(g.blocks[0], "attn.core");
  ASSERT_NE(core, nullptr);
  EXPECT_EQ(core->bwd_weight_flops, 0);
  EXPECT_DOUBLE_EQ(core->bwd_input_flops, 2 * core->fwd_flops);
}

TEST(OpGraph, GatedMlpAndGqaFlops) {
  ModelSpec m = preset("llama3-8b");
  const double s = m.seq_len, h = m.hidden, f = m.ffn_hidden, a = m.heads, k = m.kv_heads;
  const double d = h / a;
  OpGraph g = lower_model(m, 1);
  const double qkv = 2 * s * h * (a + 2 * k) * d;
  const double proj = 2 * s * h * h;
  const double mlp = 2 * s * h * 2 * f + 2 * s * f * h;
  const double attn = 4 * s * s * h;
  EXPECT_DOUBLE_EQ(fwd(g.blocks[0]), qkv + proj + mlp + attn);
}

// Heads wider than hidden / heads (Qwen3: 32 of 128 over 2,048): Q, K and V come out
// (a + 2k) d wide, the attention runs over a d-wide heads and the output projection reads a d.
TEST(OpGraph, HeadDimSetsTheAttentionWidths) {
  ModelSpec m = preset("qwen3-30b-a3b");
  const double s = m.seq_len, h = m.hidden, a = m.heads, k = m.kv_heads, d = 128;
  ASSERT_NE(a * d, h);
  OpGraph g = lower_model(m, 1);
  const Op* qkv = find_op(g.blocks[0], "attn.qkv");
  const Op* core = find_op(g.blocks[0], "attn.core");
  const Op* proj = find_op(g.blocks[0], "attn.proj");
  ASSERT_TRUE(qkv && core && proj);
  EXPECT_DOUBLE_EQ(qkv->fwd_flops, 2 * s * h * (a + 2 * k) * d);
  EXPECT_DOUBLE_EQ(core->fwd_flops, 4 * s * s * a * d);
  EXPECT_DOUBLE_EQ(core->head_dim, d);
  EXPECT_DOUBLE_EQ(proj->fwd_flops, 2 * s * a * d * h);
  EXPECT_DOUBLE_EQ(proj->parameters(), a * d * h);
}

// Per-head query and key norms (qk_norm): an operator between the projection and the attention,
// split along the heads, whose normalized Q and K the attention keeps beside the projection's
// output: (a + k) d more a token, in the compute precision.
TEST(OpGraph, QkNormKeepsTheNormalizedQueriesAndKeys) {
  ModelSpec m = preset("qwen3-30b-a3b");
  ASSERT_TRUE(m.qk_norm);
  const double b = 2, s = m.seq_len, a = m.heads, k = m.kv_heads, d = m.head_dim();
  OpGraph with = lower_model(m, 2);
  const Op* norm = find_op(with.blocks[0], "attn.qk_norm");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(&with.blocks[0].ops[2], norm);
  EXPECT_EQ(with.blocks[0].ops[3].name, "attn.core");
  EXPECT_EQ(with.blocks[0].ops[3].inputs.size(), 2u);  // normalized Q and K; V from the projection
  EXPECT_FALSE(norm->unsplittable.contains(Dim::kHeads));
  EXPECT_DOUBLE_EQ(norm->parameters(), 2 * d);
  EXPECT_DOUBLE_EQ(norm->fwd_bytes, 2 * b * s * (a + k) * d * 2);
  m.qk_norm = false;
  OpGraph without = lower_model(m, 2);
  EXPECT_EQ(find_op(without.blocks[0], "attn.qk_norm"), nullptr);
  EXPECT_DOUBLE_EQ(layer_activation_bytes(with, {}) - layer_activation_bytes(without, {}),
                   b * s * (a + k) * d * 2);
  EXPECT_DOUBLE_EQ(with.forward_flops(), without.forward_flops());
}

// A multi-token prediction module after the head: the next token's lookup (with the embedding's
// matrix), two norms, the 2h -> h projection of both, a block of the model's, a norm, the head's
// projection (its matrix: no parameters of its own) and a loss.
TEST(OpGraph, MultiTokenPredictionFollowsTheHead) {
  ModelSpec m = preset("llama3-8b");
  const double b = 2, s = m.seq_len, h = m.hidden, v = m.vocab;
  const OpGraph plain = lower_model(m, 2);
  m.mtp_layers = 1;
  const OpGraph g = lower_model(m, 2);
  const size_t main_ops = plain.head.ops.size(), block = plain.blocks[0].ops.size();
  ASSERT_EQ(g.head.ops.size(), main_ops + 4 + block + 3);
  EXPECT_EQ(g.head.ops[main_ops].name, "mtp.embed");
  EXPECT_TRUE(g.head.ops[main_ops].tied_to_embedding);  // untied model: a copy of the matrix
  EXPECT_EQ(g.head.ops[main_ops + 3].name, "mtp.proj");
  EXPECT_EQ(g.head.ops[main_ops + 3].inputs.size(), 2u);  // [embedding; hidden]
  for (size_t i = 0; i < block; ++i) {
    EXPECT_EQ(g.head.ops[main_ops + 4 + i].name, "mtp." + plain.blocks[0].ops[i].name);
  }
  EXPECT_EQ(g.head.ops.back().name, "mtp.loss");
  const Op* logits = find_op(g.head, "mtp.head.proj");
  ASSERT_NE(logits, nullptr);
  EXPECT_EQ(logits->parameters(), 0);
  // FLOPs: the projection, a block and another pass through the output projection.
  EXPECT_DOUBLE_EQ(fwd(g.head) - fwd(plain.head),
                   2 * b * s * 2 * h * h + fwd(plain.blocks[0]) + 2 * b * s * h * v);
  EXPECT_DOUBLE_EQ(g.forward_flops() - plain.forward_flops(), fwd(g.head) - fwd(plain.head));
  // The block reads the projection's output where a layer reads its input.
  const Op& first = g.head.ops[main_ops + 4];
  EXPECT_EQ(first.inputs.front(), (TensorRef{static_cast<int>(main_ops) + 3, 0}));
  // Tied embeddings: the head's projection already holds the matrix the lookup reads.
  m.tied_embeddings = true;
  const OpGraph tied = lower_model(m, 2);
  EXPECT_TRUE(find_op(tied.head, "mtp.embed")->weights.empty());
}

TEST(OpGraph, PartsHoldTheModelsParameters) {
  for (const char* name : {"gpt3-175b", "gpt3-1.3b", "llama2-70b", "llama3-8b", "mixtral-8x7b",
                           "deepseek-v2-lite", "deepseek-v3", "qwen3-30b-a3b", "gemma-3-27b"}) {
    ModelSpec m = preset(name);
    OpGraph g = lower_model(m, 1);
    auto params = [](const GraphPart& p) {
      double n = 0;
      for (const auto& op : p.ops) n += op.parameters();
      return n;
    };
    EXPECT_EQ(params(g.blocks[0]), static_cast<double>(m.layer_parameters())) << name;
    if (m.mixed_layers()) {
      EXPECT_EQ(params(g.blocks[1]), static_cast<double>(m.dense_layer_parameters())) << name;
    }
    EXPECT_EQ(params(g.embedding), static_cast<double>(m.embedding_parameters())) << name;
    EXPECT_EQ(params(g.head), static_cast<double>(m.head_parameters())) << name;
  }
}

TEST(OpGraph, LayerOperatorsInOrder) {
  OpGraph g = lower_model(korthikanti("gpt3-1.3b"), 1);
  EXPECT_EQ(
      layer_op_names(g),
      (std::vector<std::string>{"attn.norm", "attn.qkv", "attn.core", "attn.proj", "attn.residual",
                                "mlp.norm", "mlp.fc1", "mlp.act", "mlp.fc2", "mlp.residual"}));
  std::vector<std::string> embed, head;
  for (const auto& op : g.embedding.ops) embed.push_back(op.name);
  for (const auto& op : g.head.ops) head.push_back(op.name);
  EXPECT_EQ(embed, (std::vector<std::string>{"embed.word", "embed.position", "embed.dropout"}));
  EXPECT_EQ(head, (std::vector<std::string>{"head.norm", "head.proj", "loss"}));
  // Without learned positions or dropout the embedding is the lookup alone.
  OpGraph llama = lower_model(preset("llama3-8b"), 1);
  ASSERT_EQ(llama.embedding.ops.size(), 1u);
  EXPECT_EQ(llama.embedding.ops[0].name, "embed.word");
}

// Gemma's post-norms: the attention's and the MLP's outputs are normalized before the residual
// adds them.
TEST(OpGraph, PostNormsComeBeforeTheResiduals) {
  ModelSpec m = preset("llama3-8b");
  m.post_norms = true;
  const OpGraph g = lower_model(m, 1);
  EXPECT_EQ(layer_op_names(g),
            (std::vector<std::string>{"attn.norm", "attn.qkv", "attn.core", "attn.proj",
                                      "attn.post_norm", "attn.residual", "mlp.norm", "mlp.fc1",
                                      "mlp.act", "mlp.fc2", "mlp.post_norm", "mlp.residual"}));
  const auto& ops = g.blocks[0].ops;
  auto index = [&](const std::string& name) {
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].name == name) return static_cast<int>(i);
    }
    return -1;
  };
  EXPECT_EQ(ops[index("attn.post_norm")].inputs[0].op, index("attn.proj"));
  EXPECT_EQ(ops[index("attn.residual")].inputs[0].op, index("attn.post_norm"));
  EXPECT_EQ(ops[index("mlp.residual")].inputs[0].op, index("mlp.post_norm"));
  EXPECT_EQ(ops[index("mlp.residual")].inputs[1].op, index("attn.residual"));
  // In a mixture of experts the norm follows the combine.
  ModelSpec moe = preset("mixtral-8x7b");
  moe.post_norms = true;
  const OpGraph e = lower_model(moe, 1);
  const auto& eops = e.blocks[0].ops;
  ASSERT_GE(eops.size(), 3u);
  EXPECT_EQ(eops[eops.size() - 2].name, "mlp.post_norm");
  EXPECT_EQ(eops[eops.size() - 3].name, "moe.combine");
}

// A mixture of experts: the MLP becomes a router, the dispatch of each token to its top-k
// experts, the experts' MLPs over the routed tokens and the weighted combine. Each token runs
// k experts' MLPs, so the block's matmul FLOPs are a dense block's with k MLPs plus the router.
TEST(OpGraph, MixtureOfExpertsBlock) {
  const ModelSpec moe = preset("mixtral-8x7b");
  const OpGraph g = lower_model(moe, 2);
  EXPECT_EQ(
      layer_op_names(g),
      (std::vector<std::string>{"attn.norm", "attn.qkv", "attn.core", "attn.proj", "attn.residual",
                                "mlp.norm", "moe.router", "moe.dispatch", "moe.fc1", "moe.act",
                                "moe.fc2", "moe.combine", "mlp.residual"}));
  ModelSpec dense = moe;
  dense.experts = dense.experts_per_token = dense.expert_ffn_hidden = 0;
  const OpGraph d = lower_model(dense, 2);
  const double b = 2, s = moe.seq_len, h = moe.hidden, f = moe.expert_ffn_hidden, k = 2, E = 8;
  const double mlp =
      find_op(d.blocks[0], "mlp.fc1")->fwd_flops + find_op(d.blocks[0], "mlp.fc2")->fwd_flops;
  const double router = 2 * b * s * h * E;
  EXPECT_DOUBLE_EQ(fwd(g.blocks[0]), fwd(d.blocks[0]) - mlp + k * mlp + router);
  EXPECT_DOUBLE_EQ(bwd(g.blocks[0]), bwd(d.blocks[0]) + 2 * ((k - 1) * mlp + router));
  // The experts' weights span the expert dimension; their GEMM counts every routed token.
  const Op& fc1 = *find_op(g.blocks[0], "moe.fc1");
  EXPECT_TRUE(fc1.weights[0].dims.contains(Dim::kExpert));
  EXPECT_DOUBLE_EQ(fc1.weights[0].elements, E * h * 2 * f);
  EXPECT_DOUBLE_EQ(fc1.gemm.m, b * s * k);
  EXPECT_EQ(fc1.granularity[static_cast<int>(Dim::kExpert)], 8);
  // The routed tokens are k copies of the block's input: what the experts keep for backward.
  EXPECT_DOUBLE_EQ(fc1.saved[0].elements, b * s * k * h);
  const Op& combine = *find_op(g.blocks[0], "moe.combine");
  EXPECT_TRUE(combine.reduced.contains(Dim::kExpert));
  EXPECT_DOUBLE_EQ(combine.output.elements, b * s * h);
}

// A shared expert is a dense MLP beside the routed ones: its FLOPs are an MLP's of its width,
// its output joins the combine's sum.
TEST(OpGraph, SharedExpertIsAnMlpBesideTheRoutedOnes) {
  ModelSpec moe = preset("mixtral-8x7b");
  const OpGraph routed = lower_model(moe, 2);
  moe.shared_expert_ffn_hidden = 4096;
  const OpGraph both = lower_model(moe, 2);
  const double b = 2, s = moe.seq_len, h = moe.hidden, fs = 4096;
  EXPECT_DOUBLE_EQ(fwd(both.blocks[0]), fwd(routed.blocks[0]) + 2 * b * s * h * 3 * fs);
  for (const char* name : {"moe.shared.fc1", "moe.shared.act", "moe.shared.fc2"}) {
    const Op* op = find_op(both.blocks[0], name);
    ASSERT_NE(op, nullptr) << name;
    EXPECT_FALSE(op->dims.contains(Dim::kExpert)) << name;
    EXPECT_EQ(op->granularity[static_cast<int>(Dim::kFfn)], 4096) << name;
  }
  const Op& combine = *find_op(both.blocks[0], "moe.combine");
  ASSERT_EQ(combine.inputs.size(), 2u);
  EXPECT_EQ(both.blocks[0].ops[combine.inputs[1].op].name, "moe.shared.fc2");
}

// A capacity factor c sizes every expert for c times its share: the grouped GEMMs, the
// activation and the routed copies (what the all-to-alls move and the experts keep) grow by c;
// the FLOPs, the model's work, do not.
TEST(OpGraph, ExpertCapacityFactorPadsTheExpertsNotTheirFlops) {
  ModelSpec moe = preset("mixtral-8x7b");
  const OpGraph even = lower_model(moe, 2);
  moe.expert_capacity_factor = 1.25;
  const OpGraph padded = lower_model(moe, 2);
  EXPECT_DOUBLE_EQ(fwd(padded.blocks[0]), fwd(even.blocks[0]));
  EXPECT_DOUBLE_EQ(bwd(padded.blocks[0]), bwd(even.blocks[0]));
  for (const char* name : {"moe.fc1", "moe.fc2"}) {
    const Op& p = *find_op(padded.blocks[0], name);
    const Op& e = *find_op(even.blocks[0], name);
    EXPECT_DOUBLE_EQ(p.gemm.m, 1.25 * e.gemm.m) << name;
    EXPECT_DOUBLE_EQ(p.saved[0].elements, 1.25 * e.saved[0].elements) << name;
  }
  for (const char* name : {"moe.dispatch", "moe.act"}) {
    EXPECT_DOUBLE_EQ(find_op(padded.blocks[0], name)->output.elements,
                     1.25 * find_op(even.blocks[0], name)->output.elements)
        << name;
  }
  EXPECT_DOUBLE_EQ(find_op(padded.blocks[0], "moe.combine")->output.elements,
                   find_op(even.blocks[0], "moe.combine")->output.elements);
}

// Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
// section 4: s b h (34 + 5 a s / h) bytes per layer with no parallelism.
TEST(OpGraph, KorthikantiActivationMemory) {
  for (const char* name : {"gpt3-175b", "gpt3-1.3b", "gpt3-13b"}) {
    ModelSpec m = korthikanti(name);
    for (int64_t b : {1, 2, 4}) {
      OpGraph g = lower_model(m, b);
      const double s = m.seq_len, h = m.hidden, a = m.heads, bb = b;
      // s b h (34 + 5 a s / h) = 34 s b h + 5 a s^2 b, exact in doubles.
      EXPECT_EQ(layer_activation_bytes(g, {}), 34 * s * bb * h + 5 * a * s * s * bb)
          << name << " b=" << b;
      EXPECT_EQ(layer_activation_bytes(g, {"attn.core"}), 34 * s * bb * h) << name;
      EXPECT_EQ(layer_activation_bytes(g, layer_op_names(g)), 2 * s * bb * h) << name;
    }
  }
}

// The 34: where each s b h of the layer's activations comes from.
TEST(OpGraph, SavedActivationsPerOperator) {
  ModelSpec m = korthikanti("gpt3-1.3b");
  OpGraph g = lower_model(m, 1);
  const double sbh = static_cast<double>(m.seq_len) * m.hidden;
  const double as2 = static_cast<double>(m.heads) * m.seq_len * m.seq_len;
  auto saved = [&](const std::string& name) {
    const Op* op = find_op(g.blocks[0], name);
    EXPECT_NE(op, nullptr) << name;
    double n = 0;
    for (const auto& t : op->saved) n += t.bytes();
    return n;
  };
  EXPECT_EQ(saved("attn.norm"), 2 * sbh);
  EXPECT_EQ(saved("attn.qkv"), 2 * sbh);
  EXPECT_EQ(saved("attn.core"), 6 * sbh + 5 * as2);  // Q, K, V; softmax, mask, dropout output
  EXPECT_EQ(saved("attn.proj"), 2 * sbh);
  EXPECT_EQ(saved("attn.residual"), 1 * sbh);  // dropout mask, one byte per element
  EXPECT_EQ(saved("mlp.norm"), 2 * sbh);
  EXPECT_EQ(saved("mlp.fc1"), 2 * sbh);
  EXPECT_EQ(saved("mlp.act"), 8 * sbh);
  EXPECT_EQ(saved("mlp.fc2"), 8 * sbh);
  EXPECT_EQ(saved("mlp.residual"), 1 * sbh);
}

TEST(OpGraph, FlashAttentionKeepsOutputAndStatistics) {
  ModelSpec m = korthikanti("gpt3-1.3b");
  m.attention = AttentionKernel::kFlash;
  OpGraph g = lower_model(m, 2);
  const double s = m.seq_len, h = m.hidden, a = m.heads, b = 2;
  // The output is shared with the projection's saved input (counted once); the fp32 row
  // log-sum-exp replaces the s x s tensors.
  EXPECT_EQ(layer_activation_bytes(g, {}), 34 * s * b * h + 4 * b * a * s);
  // Without dropout the two masks go.
  m.dropout = false;
  EXPECT_EQ(layer_activation_bytes(lower_model(m, 2), {}), 32 * s * b * h + 4 * b * a * s);
}

// The loss operator of `m` lowered with the cross-entropy `kind` (micro-batch 2).
Op loss_op(ModelSpec m, LossKernel kind) {
  m.loss = kind;
  const OpGraph g = lower_model(m, 2);
  const Op* op = find_op(g.head, "loss");
  EXPECT_NE(op, nullptr);
  return op != nullptr ? *op : Op{};
}

double logits_of(const ModelSpec& m) {
  return 2.0 * m.seq_len * m.vocab;
}  // micro-batch 2

// Both cross-entropies keep the fp32 (log-)softmax of every logit. The fused kernel then
// allocates only the fp32 copy that becomes it; PyTorch's unfused one peaks in the backward pass
// with the log-softmax's gradient and the input gradient, both fp32, beside it, and the logits.
TEST(OpGraph, CrossEntropyMemoryByKernel) {
  ModelSpec m = preset("llama3-8b");
  const double logits = logits_of(m);
  const Op fused = loss_op(m, LossKernel::kFused);
  ASSERT_EQ(fused.saved.size(), 1u);
  EXPECT_DOUBLE_EQ(fused.saved[0].bytes(), 4 * logits);
  // Beside the fp32 buffer: the logits in bf16 (forward) or their gradient (backward); the
  // projection's output is the loss's input, worked on in place.
  EXPECT_DOUBLE_EQ(fused.transient_bytes, 2 * logits);
  EXPECT_TRUE(fused.in_place_input);
  EXPECT_DOUBLE_EQ(fused.fwd_bytes, 10 * logits);
  EXPECT_DOUBLE_EQ(fused.bwd_bytes, 6 * logits);
  m.precision = Precision::kFp32;  // fp32 logits are the buffer itself
  EXPECT_DOUBLE_EQ(loss_op(m, LossKernel::kFused).transient_bytes, 0);
  m.precision = Precision::kBf16;

  const Op unfused = loss_op(m, LossKernel::kUnfused);
  EXPECT_DOUBLE_EQ(unfused.saved[0].bytes(), 4 * logits);
  // ... and the bf16 logits' block, which the caching allocator keeps but cannot give to the
  // fp32 gradients (none with fp32 logits: the cast is the logits themselves).
  EXPECT_DOUBLE_EQ(unfused.transient_bytes, (8 + 2) * logits);
  m.precision = Precision::kFp32;
  EXPECT_DOUBLE_EQ(loss_op(m, LossKernel::kUnfused).transient_bytes, 8 * logits);
  EXPECT_GT(unfused.fwd_bytes, fused.fwd_bytes);
  EXPECT_GT(unfused.bwd_bytes, fused.bwd_bytes);
}

// Megatron's default cross-entropy holds the fused kernel's buffers but runs each step as a
// kernel of its own: forward cast (2 + 4), max (4), subtract (8), exp (8), sum (4), divide (8);
// backward scale (8) and cast back (4 + 2), per logit.
TEST(OpGraph, MegatronCrossEntropyStepByStep) {
  const ModelSpec m = preset("llama3-8b");
  const double logits = logits_of(m);
  const Op fused = loss_op(m, LossKernel::kFused);
  const Op vp = loss_op(m, LossKernel::kVocabParallel);
  EXPECT_DOUBLE_EQ(vp.saved[0].bytes(), fused.saved[0].bytes());
  EXPECT_DOUBLE_EQ(vp.transient_bytes, fused.transient_bytes);
  EXPECT_TRUE(vp.in_place_input);
  EXPECT_DOUBLE_EQ(vp.fwd_bytes, 38 * logits);
  EXPECT_DOUBLE_EQ(vp.bwd_bytes, 14 * logits);
}

// PyTorch's loss_parallel(): the unfused call's saved log-softmax; its backward holds the zeros,
// the exp and their sum (fp32) beside it, and the bf16 logits' block: 4 bytes a logit more than
// the unfused call's peak.
TEST(OpGraph, LossParallelCrossEntropy) {
  const ModelSpec m = preset("llama3-8b");
  const double logits = logits_of(m);
  const Op lp = loss_op(m, LossKernel::kLossParallel);
  EXPECT_DOUBLE_EQ(lp.saved[0].bytes(), 4 * logits);
  EXPECT_DOUBLE_EQ(lp.transient_bytes, (12 + 2) * logits);
  EXPECT_DOUBLE_EQ(lp.transient_bytes - loss_op(m, LossKernel::kUnfused).transient_bytes,
                   4 * logits);
  EXPECT_DOUBLE_EQ(lp.fwd_bytes, 38 * logits);
  EXPECT_DOUBLE_EQ(lp.bwd_bytes, 38 * logits);
  EXPECT_FALSE(lp.in_place_input);
}

// flash-attn's kernel keeps the bf16 logits (no fp32 copy) and writes their bf16 gradient:
// reads them once forward, reads and writes once backward.
TEST(OpGraph, FlashAttnCrossEntropy) {
  const ModelSpec m = preset("llama3-8b");
  const double logits = logits_of(m);
  const Op fa = loss_op(m, LossKernel::kFlashAttn);
  ASSERT_EQ(fa.saved.size(), 1u);
  EXPECT_DOUBLE_EQ(fa.saved[0].bytes(), 2 * logits);
  ASSERT_EQ(fa.inputs.size(), 1u);
  EXPECT_EQ(fa.saved[0].ref, fa.inputs[0]);  // the logits themselves
  EXPECT_DOUBLE_EQ(fa.transient_bytes, 2 * logits);
  EXPECT_DOUBLE_EQ(fa.fwd_bytes, 2 * logits);
  EXPECT_DOUBLE_EQ(fa.bwd_bytes, 4 * logits);
}

TEST(OpGraph, RecomputingTheMlpKeepsItsCheckpoint) {
  ModelSpec m = korthikanti("gpt3-1.3b");
  OpGraph g = lower_model(m, 1);
  const double sbh = static_cast<double>(m.seq_len) * m.hidden;
  const double as2 = static_cast<double>(m.heads) * m.seq_len * m.seq_len;
  // Recomputing fc1, act and fc2 keeps only fc1's input (the norm output, 2 sbh) of the 18 sbh
  // they save.
  EXPECT_EQ(layer_activation_bytes(g, {"mlp.fc1", "mlp.act", "mlp.fc2"}),
            34 * sbh + 5 * as2 - 16 * sbh);
  // Unknown names recompute nothing.
  EXPECT_EQ(layer_activation_bytes(g, {"nothing"}), 34 * sbh + 5 * as2);
}

// DeepSeekMoE's first block is dense: the graph lowers both block shapes, and the model's FLOPs
// count each layer's own.
TEST(OpGraph, MixedModelLowersADenseAndAnExpertBlock) {
  Expected<ModelSpec> m = load_model("deepseek-moe-16b");
  ASSERT_TRUE(m.ok()) << m.error().message();
  const OpGraph g = lower_model(*m, 1);
  EXPECT_EQ(&g.layer_at(0), &g.blocks[1]);
  EXPECT_EQ(&g.layer_at(1), &g.blocks[0]);
  auto names = [](const GraphPart& p) {
    std::vector<std::string> n;
    for (const Op& op : p.ops) n.push_back(op.name);
    return n;
  };
  const std::vector<std::string> dense = names(g.blocks[1]);
  EXPECT_NE(std::find(dense.begin(), dense.end(), "mlp.fc1"), dense.end());
  EXPECT_EQ(std::find(dense.begin(), dense.end(), "moe.router"), dense.end());
  EXPECT_EQ(g.blocks[1].ops.back().name, g.blocks[0].ops.back().name);
  double params = 0;
  for (const Op& op : g.blocks[1].ops) params += op.parameters();
  EXPECT_EQ(params, static_cast<double>(m->dense_layer_parameters()));

  ModelSpec all_experts = *m;
  all_experts.first_dense_layers = 0;
  const OpGraph uniform = lower_model(all_experts, 1);
  EXPECT_EQ(uniform.blocks.size(), 1u);  // one block shape
  ModelSpec all_dense = *m;
  all_dense.experts = all_dense.experts_per_token = all_dense.shared_expert_ffn_hidden = 0;
  all_dense.first_dense_layers = 0;
  const double per_block_gap =
      (lower_model(all_dense, 1).forward_flops() - uniform.forward_flops()) / m->layers;
  EXPECT_NEAR(g.forward_flops() - uniform.forward_flops(), per_block_gap,
              1e-12 * g.forward_flops());
}

// DeepSeek-V3's latent attention: the queries and the keys/values come up from their latents,
// and the core multiplies over 192-wide queries/keys and 128-wide values.
TEST(OpGraph, LatentAttention) {
  ModelSpec m = preset("deepseek-v3");
  const OpGraph g = lower_model(m, 1);
  std::vector<std::string> names;
  for (size_t i = 0; i < 9; ++i) names.push_back(g.blocks[0].ops[i].name);
  EXPECT_EQ(names, (std::vector<std::string>{"attn.norm", "attn.q_down", "attn.q_norm", "attn.q_up",
                                             "attn.kv_down", "attn.kv_norm", "attn.kv_up",
                                             "attn.core", "attn.proj"}));
  const Op& core = g.blocks[0].ops[7];
  const double s = 4096, a = 128;
  EXPECT_DOUBLE_EQ(core.fwd_flops, 2 * s * s * a * (192 + 128));
  EXPECT_DOUBLE_EQ(core.head_dim, 192);
  // Kept: Q and K (192 wide a head), V's storage (the up-projection's 256 a head), the output
  // and the log-sum-exp.
  double saved = 0;
  for (const TensorSpec& t : core.saved) saved += t.bytes();
  EXPECT_DOUBLE_EQ(saved, s * a * (2 * 192 + 256 + 128) * 2 + s * a * 4);
  EXPECT_EQ(g.blocks[0].ops[4].gemm.n, 512 + 64);  // the latent and the rotary key part
  // The key/value norm normalizes the latent and carries the rotary key part through (so it
  // travels with the latent), its scale the latent's width; the up-projection reads the latent.
  const Op& kv_norm = g.blocks[0].ops[5];
  EXPECT_EQ(kv_norm.output.elements, s * (512 + 64));
  EXPECT_EQ(kv_norm.weights[0].elements, 512);
  EXPECT_EQ(kv_norm.saved[0].elements, s * 512);
  EXPECT_EQ(g.blocks[0].ops[6].gemm.k, 512);
}

// GPT-OSS's alternating sliding windows (128 tokens, every other layer, 4,096-token sequences):
// a windowed layer's queries see 128 w - 128 x 127 / 2 ... pairs, the model's average is
// counted in the attention's FLOPs and its backward.
TEST(OpGraph, SlidingWindowsCountTheAttendedPairs) {
  const ModelSpec m = preset("gpt-oss-20b");
  const OpGraph g = lower_model(m, 1);
  const Op* core = find_op(g.blocks[0], "attn.core");
  ASSERT_NE(core, nullptr);
  const double s = 4096, w = 128, a = 64, d = 64;
  const double windowed = (w * s - w * (w - 1) / 2) / (s * (s + 1) / 2);
  const double expected = (12 * windowed + 12) / 24;
  EXPECT_NEAR(core->attended_fraction, expected, 1e-12);
  EXPECT_NEAR(core->fwd_flops, 4 * s * s * a * d * expected, 1e-6 * core->fwd_flops);
  EXPECT_DOUBLE_EQ(core->bwd_input_flops, 2 * core->fwd_flops);
  // A window as long as the sequence leaves every pair.
  ModelSpec wide = m;
  wide.sliding_window = 4096;
  EXPECT_DOUBLE_EQ(find_op(lower_model(wide, 1).blocks[0], "attn.core")->attended_fraction, 1);
}

TEST(OpGraph, DimensionNames) {
  for (int i = 0; i < kNumDims; ++i) {
    Dim d{};
    ASSERT_TRUE(parse_dim(to_string(static_cast<Dim>(i)), &d));
    EXPECT_EQ(d, static_cast<Dim>(i));
  }
  Dim d{};
  EXPECT_FALSE(parse_dim("hiden", &d));
  DimSet s{Dim::kBatch, Dim::kSeq};
  EXPECT_TRUE(s.contains(Dim::kSeq));
  EXPECT_FALSE(s.contains(Dim::kHidden));
  EXPECT_TRUE(s.with(Dim::kHidden).contains(Dim::kHidden));
  EXPECT_TRUE(DimSet{}.empty());
}

TEST(OpGraph, HeadsSplitByKeyValueGroup) {
  OpGraph g = lower_model(preset("llama3-8b"), 1);
  const Op* qkv = find_op(g.blocks[0], "attn.qkv");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->granularity[static_cast<int>(Dim::kHeads)], 8);
  EXPECT_TRUE(qkv->reduced.contains(Dim::kHidden));
  const Op* norm = find_op(g.blocks[0], "attn.norm");
  ASSERT_NE(norm, nullptr);
  EXPECT_TRUE(norm->unsplittable.contains(Dim::kHidden));
}

}  // namespace
}  // namespace nnsim
