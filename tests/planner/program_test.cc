// Compiled Megatron plans against the published formulas: Korthikanti et al. 2022's activation
// memory under tensor and sequence parallelism, mixed-precision Adam's bytes per parameter,
// ZeRO sharding and the tensor-parallel collectives of a layer.
#include "core/program.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/model.h"
#include "core/plan.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"

namespace nnsim {
namespace {

ModelSpec preset(const std::string& name) {
  auto m = load_model(name);
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
  return *m;
}

// Korthikanti et al.'s model: unfused attention keeping its softmax and dropout, dropout after
// attention and MLP, multi-head attention, f = 4h, 16-bit activations.
ModelSpec korthikanti(const std::string& name) {
  ModelSpec m = preset(name);
  m.attention = AttentionKernel::kUnfused;
  m.dropout = true;
  return m;
}

Topology dgx() {
  auto t = load_topology("dgx-a100x4");  // 4 x 8 A100
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  return *t;
}

Program compile(const ModelSpec& m, const MegatronOptions& o) {
  auto plan = build_megatron_plan(m, dgx(), o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  if (!plan.ok()) return Program{};
  auto prog = compile_plan(*plan, dgx());
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  return prog.ok() ? *prog : Program{};
}

MegatronOptions options(int tp, int pp, bool sp, RecomputeMode rc, int micro_batch = 2) {
  MegatronOptions o;
  o.tp = tp;
  o.pp = pp;
  o.sequence_parallel = sp;
  o.recompute = rc;
  o.micro_batch = micro_batch;
  o.global_batch = 32 / (tp * pp) * micro_batch * pp;  // pp micro-batches per replica
  return o;
}

// Korthikanti et al. 2022, Table 2: activation bytes per layer per device.
TEST(Program, KorthikantiActivationsUnderTensorAndSequenceParallelism) {
  for (const char* name : {"gpt3-1.3b", "gpt3-175b"}) {
    const ModelSpec m = korthikanti(name);
    const double s = m.seq_len, h = m.hidden, a = m.heads, t = 8;
    for (int pp : {1, 4}) {
      for (int b : {1, 2}) {
        const double sbh = s * b * h;
        struct Case {
          const char* what;
          bool sp;
          RecomputeMode rc;
          double bytes;
        };
        const Case cases[] = {
            {"tp", false, RecomputeMode::kNone, sbh * (10 + 24 / t + 5 * a * s / (h * t))},
            {"tp+sp", true, RecomputeMode::kNone, sbh / t * (34 + 5 * a * s / h)},
            {"tp+sp+selective", true, RecomputeMode::kSelective, 34 * sbh / t},
            {"tp+selective", false, RecomputeMode::kSelective, sbh * (10 + 24 / t)},
            {"tp+full", false, RecomputeMode::kFull, 2 * sbh},
            {"tp+sp+full", true, RecomputeMode::kFull, 2 * sbh / t},
        };
        for (const Case& c : cases) {
          Program prog = compile(m, options(8, pp, c.sp, c.rc, b));
          ASSERT_EQ(prog.layer_activation_bytes.size(), static_cast<size_t>(m.layers))
              << name << " " << c.what;
          for (int l = 0; l < m.layers; ++l) {
            EXPECT_DOUBLE_EQ(prog.layer_activation_bytes[l], c.bytes)
                << name << " " << c.what << " pp=" << pp << " b=" << b << " layer " << l;
          }
        }
      }
    }
  }
}

TEST(Program, ModelFlopsAreMegatrons) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = options(8, 4, true, RecomputeMode::kFull, 1);
  Program prog = compile(m, o);
  const double B = o.global_batch, s = m.seq_len, l = m.layers, h = m.hidden, V = m.vocab;
  // Model FLOPs exclude recomputation: 72 B s l h^2 (1 + s / 6h + V / 12lh).
  const double want = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
  EXPECT_NEAR(prog.model_flops_per_iteration / want, 1.0, 1e-9);
  EXPECT_DOUBLE_EQ(prog.tokens_per_iteration, B * s);
}

// Mixed-precision Adam: 2-byte weights, gradients (2 bytes for fp16; Megatron accumulates bf16
// gradients in fp32: 4) and 12 bytes of optimizer state (fp32 master copy and two moments).
TEST(Program, MixedPrecisionAdamBytesPerParameter) {
  const ModelSpec m = preset("gpt3-1.3b");
  for (auto [precision, bytes] :
       {std::pair{Precision::kFp16, 16.0}, std::pair{Precision::kBf16, 18.0}}) {
    MegatronOptions o = options(1, 1, false, RecomputeMode::kNone, 1);
    o.precision = precision;
    Program prog = compile(m, o);
    ASSERT_EQ(prog.lanes.size(), 1u);
    const Lane& lane = prog.lanes[0];
    // One stage holds the whole model; the tied output projection is the embedding itself.
    EXPECT_EQ(lane.parameters, static_cast<double>(m.parameters()));
    const StaticMemory& mem = lane.memory;
    EXPECT_DOUBLE_EQ(mem.weights / lane.parameters, 2);
    EXPECT_DOUBLE_EQ(mem.gradients / lane.parameters, bytes - 14);
    EXPECT_DOUBLE_EQ(mem.optimizer / lane.parameters, 12);
    EXPECT_DOUBLE_EQ((mem.weights + mem.gradients + mem.optimizer) / lane.parameters, bytes)
        << to_string(precision);
  }
}

TEST(Program, ZeroShardsOverDataParallelRanks) {
  const ModelSpec m = preset("gpt3-1.3b");
  const double dp = 32;
  MegatronOptions o = options(1, 1, false, RecomputeMode::kNone, 1);
  Program base = compile(m, o);
  ASSERT_EQ(base.replicas, 32);
  const double P = base.lanes[0].parameters;
  const double layer = static_cast<double>(m.layer_parameters());
  for (int zero = 0; zero <= 3; ++zero) {
    o.zero = zero;
    Program prog = compile(m, o);
    const Lane& lane = prog.lanes[0];
    EXPECT_EQ(lane.parameters, P) << "parameters are counted before sharding";
    const StaticMemory& mem = lane.memory;
    const double opt = zero >= 1 ? 12 * P / dp : 12 * P;
    const double grads = zero >= 2 ? 4 * P / dp : 4 * P;
    const double weights = zero == 3 ? 2 * P / dp : 2 * P;
    // ZeRO-3's working set: the gathered layer in use and the one prefetched, and the gradients
    // of the layer being reduced.
    const double gathered = zero == 3 ? 2 * 2 * layer + 4 * layer : 0;
    EXPECT_DOUBLE_EQ(mem.optimizer, opt) << "zero " << zero;
    EXPECT_DOUBLE_EQ(mem.gradients, grads) << "zero " << zero;
    EXPECT_DOUBLE_EQ(mem.weights, weights) << "zero " << zero;
    EXPECT_DOUBLE_EQ(mem.gathered, gathered) << "zero " << zero;
  }
}

// fp32 training: the fp32 weights are Adam's master copy (8 bytes of state, two moments), and
// ZeRO-3's shard of them is that copy, 4 bytes a parameter (16 in all, sharded), not a 16-bit
// copy's 2 (what FSDP and Megatron keep between iterations; tests/hwexec/run_memory_test.cc).
TEST(Program, Fp32ZeroThreeShardIsTheMasterCopy) {
  const ModelSpec m = preset("gpt3-1.3b");
  const double dp = 32;
  MegatronOptions o = options(1, 1, false, RecomputeMode::kNone, 1);
  o.precision = Precision::kFp32;
  o.zero = 3;
  Program prog = compile(m, o);
  ASSERT_EQ(prog.replicas, 32);
  const Lane& lane = prog.lanes[0];
  const double P = lane.parameters;
  const double layer = static_cast<double>(m.layer_parameters());
  EXPECT_DOUBLE_EQ(lane.memory.weights, 4 * P / dp);
  EXPECT_DOUBLE_EQ(lane.memory.gradients, 4 * P / dp);
  EXPECT_DOUBLE_EQ(lane.memory.optimizer, 8 * P / dp);
  EXPECT_DOUBLE_EQ(lane.memory.gathered, 2 * 4 * layer + 4 * layer);
}

// Per device under Megatron tensor parallelism (no SP): column- and row-parallel weights and the
// column-parallel biases divide by t; row-parallel biases, norms and learned positions do not.
TEST(Program, TensorParallelParametersPerDevice) {
  const ModelSpec m = preset("gpt3-1.3b");
  const double h = m.hidden, t = 8, V = m.vocab, s = m.seq_len, l = m.layers;
  Program prog = compile(m, options(8, 1, false, RecomputeMode::kNone, 1));
  ASSERT_EQ(prog.lanes.size(), 1u);
  const double layer = (12 * h * h + 7 * h) / t + 6 * h;
  const double embedding = V * h / t + s * h;
  const double head = 2 * h;  // final LayerNorm; the projection is the (tied) embedding
  EXPECT_DOUBLE_EQ(prog.lanes[0].parameters, l * layer + embedding + head);
}

// With a pipeline the last stage holds its own copy of the tied embedding.
TEST(Program, PipelineStagesHoldTheModelOnce) {
  const ModelSpec m = preset("gpt3-1.3b");
  Program prog = compile(m, options(1, 4, false, RecomputeMode::kNone, 1));
  ASSERT_EQ(prog.lanes.size(), 4u);
  double total = 0;
  for (const Lane& lane : prog.lanes) total += lane.parameters;
  EXPECT_EQ(total, static_cast<double>(m.parameters() + m.vocab * m.hidden));
  ASSERT_EQ(prog.explicit_groups.size(), 1u);  // first and last stage sum the tied gradients
  // ... of the word matrix only (the learned position table is the embedding's own): V h
  // gradients, once per iteration on the first and on the last stage.
  const double grad = prog.plan.optimizer.grad_bytes;
  for (int l : {0, 3}) {
    double bytes = 0;
    for (const Step& st : prog.lanes[l].epilogue) {
      if (st.kind == StepKind::kCollective && st.group == 0) bytes += st.bytes;
    }
    EXPECT_DOUBLE_EQ(bytes, static_cast<double>(m.vocab) * m.hidden * grad) << "lane " << l;
  }
}

// The tied word matrix's two copies summed once an iteration, after the data-parallel wait and
// just before the optimizer step: whole gradients without ZeRO and under ZeRO-1; under ZeRO 2-3,
// whose per-micro-batch reduce-scatters leave each rank only its chunk, the chunks (V h / dp).
TEST(Program, TiedGradientsSummedBeforeTheStepAsWholeOrChunks) {
  const ModelSpec m = preset("gpt3-1.3b");
  for (int zero = 0; zero <= 3; ++zero) {
    for (bool overlap_gather : {true, false}) {
      MegatronOptions o = options(1, 4, false, RecomputeMode::kNone, 1);
      o.zero = zero;
      auto plan = build_megatron_plan(m, dgx(), o);
      ASSERT_TRUE(plan.ok()) << plan.error().message();
      plan->comm.overlap_param_gather = overlap_gather;
      auto prog = compile_plan(*plan, dgx());
      ASSERT_TRUE(prog.ok()) << prog.error().message();
      const int dp = plan->data_parallel();
      ASSERT_EQ(dp, 8);  // 32 GPUs over 4 stages
      const double whole = static_cast<double>(m.vocab) * m.hidden * plan->optimizer.grad_bytes;
      for (int l : {0, 3}) {
        const std::vector<Step>& ep = prog->lanes[l].epilogue;
        int sync = -1, wait = -1, step = -1;
        for (int i = 0; i < static_cast<int>(ep.size()); ++i) {
          if (ep[i].kind == StepKind::kCollective && ep[i].group == 0) {
            EXPECT_EQ(sync, -1) << "two tied syncs";
            sync = i;
            EXPECT_DOUBLE_EQ(ep[i].bytes, zero >= 2 ? whole / dp : whole)
                << "zero " << zero << " lane " << l;
          }
          if (ep[i].kind == StepKind::kDpWait && wait < 0) wait = i;
          if (ep[i].kind == StepKind::kCompute && ep[i].compute_class == ComputeClass::kOptimizer) {
            step = i;
          }
        }
        ASSERT_GE(sync, 0) << "zero " << zero;
        EXPECT_LT(wait, sync) << "zero " << zero << " overlap " << overlap_gather;
        EXPECT_EQ(sync + 1, step) << "zero " << zero << " overlap " << overlap_gather;
      }
    }
  }
}

// Multi-token prediction looks up the next tokens with the embedding's matrix: an untied model's
// last stage holds a copy, summed with the first stage's as a tied head's is, and the stage
// holds the module's block and projection. On one stage there is one matrix and no sum.
TEST(Program, MultiTokenPredictionHoldsAnEmbeddingCopyOnTheLastStage) {
  ModelSpec m = preset("llama2-7b");  // untied
  const double h = m.hidden, v = m.vocab;
  const Program plain = compile(m, options(1, 4, false, RecomputeMode::kNone, 1));
  m.mtp_layers = 1;
  const Program mtp = compile(m, options(1, 4, false, RecomputeMode::kNone, 1));
  EXPECT_DOUBLE_EQ(mtp.lanes[3].parameters - plain.lanes[3].parameters,
                   static_cast<double>(m.mtp_parameters()) + v * h);
  EXPECT_DOUBLE_EQ(mtp.lanes[0].parameters, plain.lanes[0].parameters);
  auto tied_syncs = [](const Program& p, int lane) {
    int n = 0;
    for (const Step& x : p.lanes[lane].epilogue) {
      n += x.kind == StepKind::kCollective && p.labels[x.label] == "tied embedding grad sync";
    }
    return n;
  };
  EXPECT_EQ(tied_syncs(plain, 3), 0);
  for (int lane : {0, 3}) EXPECT_EQ(tied_syncs(mtp, lane), 1) << lane;
  // One stage, tensor and sequence parallel, fully recomputed: every twin rule matches, the
  // module recomputes as the blocks do, and the projection splits its output over tp.
  const Program one = compile(m, options(8, 1, true, RecomputeMode::kFull, 1));
  EXPECT_EQ(tied_syncs(one, 0), 0);
  bool recomputed = false, split = false;
  for (const RecomputeRule& r : one.plan.recompute) recomputed |= r.match == "mtp.*";
  for (const PartitionRule& r : one.plan.partition) split |= r.match == "mtp.proj";
  EXPECT_TRUE(recomputed);
  EXPECT_TRUE(split);
  // A mixed mixture's module has experts: a per-module rule for the dense blocks' MLP gets no
  // twin there (it would match nothing), the experts' does.
  ModelSpec moe = preset("deepseek-moe-16b");
  moe.layers = 4;
  moe.mtp_layers = 1;
  MegatronOptions mo = options(1, 2, false, RecomputeMode::kNone, 1);
  mo.recompute_modules = {"mlp.act", "moe.act"};
  const Program mixed = compile(moe, mo);
  std::set<std::string> rules;
  for (const RecomputeRule& r : mixed.plan.recompute) rules.insert(r.match);
  EXPECT_EQ(rules, (std::set<std::string>{"mlp.act", "moe.act", "mtp.moe.act"}));
}

// Collectives of the layers' operators in one block template, by kind; each must run along
// `axis` (tensor parallel by default).
std::map<CollectiveKind, int> layer_collectives(const Program& prog, int segment, BlockKind kind,
                                                const char* axis = "tp") {
  std::set<std::string> layer_ops;
  for (const auto& op : prog.graph.blocks[0].ops) layer_ops.insert(op.name);
  const uint32_t tp = 1u << prog.plan.mesh.axis_index(axis);
  std::map<CollectiveKind, int> count;
  for (const BlockTemplate& t : prog.templates) {
    if (t.segment != segment || t.kind != kind) continue;
    for (const Step& s : t.steps) {
      if (s.kind != StepKind::kCollective || s.label < 0) continue;
      if (!layer_ops.count(prog.labels[s.label])) continue;
      EXPECT_EQ(s.axes, tp) << prog.labels[s.label];
      ++count[s.collective];
    }
    return count;  // every template of a kind has the same layer collectives
  }
  ADD_FAILURE() << "no template for segment " << segment;
  return count;
}

// The steps of the program's first forward template (every forward runs the same layers).
const std::vector<Step>& first_forward(const Program& prog) {
  static const std::vector<Step> none;
  for (const BlockTemplate& t : prog.templates) {
    if (t.kind == BlockKind::kForward) return t.steps;
  }
  ADD_FAILURE() << "no forward template";
  return none;
}

using Counts = std::map<CollectiveKind, int>;

std::string listed_counts(const std::map<std::string, int>& m) {
  std::string out;
  for (const auto& [k, v] : m) out += fmt::format("{}: {}; ", k, v);
  return out;
}
constexpr auto kAR = CollectiveKind::kAllReduce;
constexpr auto kAG = CollectiveKind::kAllGather;
constexpr auto kRS = CollectiveKind::kReduceScatter;

// Megatron tensor parallelism (Shoeybi et al. 2019): f and g, two all-reduces per layer in the
// forward pass (after the attention and MLP row-parallel matmuls) and two in the backward pass
// (of the column-parallel matmuls' input gradients).
TEST(Program, TensorParallelLayerAllReduces) {
  const ModelSpec m = korthikanti("gpt3-1.3b");  // 24 layers
  for (int pp : {1, 4}) {
    Program prog = compile(m, options(8, pp, false, RecomputeMode::kNone, 1));
    const int n = m.layers / pp;
    const int seg = pp == 1 ? 0 : 1;  // a middle stage when there is one
    EXPECT_EQ(layer_collectives(prog, seg, BlockKind::kForward), (Counts{{kAR, 2 * n}}));
    EXPECT_EQ(layer_collectives(prog, seg, BlockKind::kBackward), (Counts{{kAR, 2 * n}}));
  }
}

// Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): g becomes an all-gather and g-bar
// a reduce-scatter; the backward mirrors them (reduce-scatter <-> all-gather) and re-gathers
// the sequence-split inputs of the QKV and first MLP matmuls for their weight gradients.
TEST(Program, SequenceParallelLayerCollectives) {
  const ModelSpec m = korthikanti("gpt3-1.3b");
  for (int pp : {1, 4}) {
    Program prog = compile(m, options(8, pp, true, RecomputeMode::kNone, 1));
    const int n = m.layers / pp;
    const int seg = pp == 1 ? 0 : 1;
    EXPECT_EQ(layer_collectives(prog, seg, BlockKind::kForward),
              (Counts{{kAG, 2 * n}, {kRS, 2 * n}}));
    EXPECT_EQ(layer_collectives(prog, seg, BlockKind::kBackward),
              (Counts{{kAG, 2 * n + 2 * n}, {kRS, 2 * n}}));
  }
}

// Gemma's post-norms normalize the row-parallel matmuls' outputs: the all-reduce (or, under
// sequence parallelism, the reduce-scatter) comes before them, so a layer keeps the collectives
// of one without them, and the norms run on each GPU's share of the sequence.
// Sliding windows: each layer's attention is priced at its own share of the query-key pairs (a
// fused kernel computes only those), not at the model's average. GPT-3 1.3B (24 layers of 2,048
// tokens) with 256-token windows in five layers of six, on 8 stages of 3 layers: the stages
// holding a full layer (1, 3, 5, 7) take longer than those without; the FLOPs still sum to the
// model's.
TEST(Program, EachLayersAttentionIsPricedAtItsOwnWindow) {
  ModelSpec m = korthikanti("gpt3-1.3b");
  m.attention = AttentionKernel::kFlash;
  m.sliding_window = 256;
  m.full_attention_interval = 6;
  const Program prog = compile(m, options(1, 8, false, RecomputeMode::kNone));
  ASSERT_EQ(prog.plan.segments.size(), 8u);
  std::vector<double> seconds(8, 0), flops(8, 0);
  std::vector<bool> seen(8, false);
  for (const BlockTemplate& t : prog.templates) {
    if (t.kind != BlockKind::kForward || seen[t.segment]) continue;
    seen[t.segment] = true;
    for (const Step& s : t.steps) {
      if (s.kind == StepKind::kCompute && prog.labels[s.label] == "attn.core") {
        seconds[t.segment] += s.seconds;
        flops[t.segment] += s.flops;
      }
    }
  }
  for (int stage : {0, 2, 4, 6}) {
    EXPECT_DOUBLE_EQ(seconds[stage], seconds[0]) << stage;
    EXPECT_GT(seconds[stage + 1], 1.5 * seconds[stage]) << stage;
  }
  double average = 0;  // the operator graph's per-layer FLOPs: the model's average share
  for (const Op& op : prog.graph.blocks[0].ops) {
    if (op.name == "attn.core") average = op.fwd_flops;
  }
  double total = 0;
  for (double f : flops) total += f;
  EXPECT_NEAR(total, 24 * average, 1e-9 * total);
  EXPECT_NEAR(flops[1] / flops[0],
              (2 * window_attended_fraction(m) + 1) / (3 * window_attended_fraction(m)), 1e-9);
}

TEST(Program, PostNormsFollowTheRowParallelCollectives) {
  ModelSpec m = korthikanti("gpt3-1.3b");
  m.post_norms = true;
  const int n = m.layers;
  Program plain = compile(m, options(8, 1, false, RecomputeMode::kNone, 1));
  EXPECT_EQ(layer_collectives(plain, 0, BlockKind::kForward), (Counts{{kAR, 2 * n}}));
  Program sp = compile(m, options(8, 1, true, RecomputeMode::kNone, 1));
  EXPECT_EQ(layer_collectives(sp, 0, BlockKind::kForward), (Counts{{kAG, 2 * n}, {kRS, 2 * n}}));
  std::map<std::string, int> scattered;  // label -> count
  for (const Step& step : first_forward(sp)) {
    if (step.kind == StepKind::kCollective && step.collective == kRS && step.label >= 0) {
      ++scattered[sp.labels[step.label]];
    }
  }
  EXPECT_EQ(scattered["attn.post_norm"], n) << listed_counts(scattered);
  EXPECT_EQ(scattered["mlp.post_norm"], n) << listed_counts(scattered);
}

// Multi-head latent attention under tensor parallelism (Megatron-Core's MLA): the heads split,
// the down-projections and latent norms stay whole. Without sequence parallelism nothing but
// the two all-reduces a dense block has, and in the backward the latent's gradient summed (the
// up-projection's partial sums, the rotary key part's with it); with it, each GPU projects and
// normalizes its share of the sequence and the up-projection all-gathers the key/value latent
// with its rotary key part (512 + 64 wide here): one all-gather more, of a quarter of the hidden
// state's bytes, whose backward is one reduce-scatter (no all-reduce).
TEST(Program, LatentAttentionUnderTensorParallelism) {
  ModelSpec m = preset("deepseek-v2-lite");
  m.experts = m.experts_per_token = m.expert_ffn_hidden = m.shared_expert_ffn_hidden = 0;
  m.first_dense_layers = 0;
  m.layers = 4;
  // One more, in the first layer's norm: the vocabulary-parallel embedding's partial sums (a
  // rotary model has no position table to take them).
  Program plain = compile(m, options(8, 1, false, RecomputeMode::kNone, 1));
  EXPECT_EQ(layer_collectives(plain, 0, BlockKind::kForward), (Counts{{kAR, 2 * 4 + 1}}));
  Program sp = compile(m, options(8, 1, true, RecomputeMode::kNone, 1));
  EXPECT_EQ(layer_collectives(sp, 0, BlockKind::kForward),
            (Counts{{kAG, 3 * 4}, {kRS, 2 * 4 + 1}}));
  std::map<double, int> gathered;  // bytes -> count, per GPU
  for (const Step& s : first_forward(sp)) {
    if (s.kind == StepKind::kCollective && s.collective == kAG) ++gathered[s.bytes];
  }
  const double tokens = m.seq_len;  // one sequence a micro-batch
  EXPECT_EQ(gathered[tokens * (512 + 64) * 2], 4) << gathered.size();
  EXPECT_EQ(gathered[tokens * 2048 * 2], 2 * 4 + 1);  // and the head's input
  std::map<std::string, double> backward;             // "label kind" -> bytes
  for (const BlockTemplate& t : sp.templates) {
    if (t.kind != BlockKind::kBackward) continue;
    for (const Step& s : t.steps) {
      if (s.kind == StepKind::kCollective && s.label >= 0) {
        backward[fmt::format("{} {}", sp.labels[s.label], to_string(s.collective))] = s.bytes;
      }
    }
    break;
  }
  EXPECT_DOUBLE_EQ(backward["attn.kv_up reduce-scatter"], tokens * (512 + 64) * 2)
      << backward.size();
  EXPECT_EQ(backward.count("attn.kv_norm all-reduce") + backward.count("attn.kv_up all-reduce") +
                backward.count("attn.kv_norm reduce-scatter"),
            0u);
  EXPECT_EQ(layer_collectives(plain, 0, BlockKind::kBackward), (Counts{{kAR, 3 * 4}}));
}

// Experts under tensor and sequence parallelism, as Megatron's all-to-all token dispatcher runs
// them: tokens are routed where their sequence slice is, the routed copies all-gathered over tp
// for the experts (split along their FFN width) and their outputs reduce-scattered back before
// the combine. So a block's collectives are a dense block's, but the MLP's carry the k routed
// copies of every token.
std::string listed(const std::map<std::string, double>& m) {
  std::string out;
  for (const auto& [k, v] : m) out += fmt::format("{}: {}; ", k, v);
  return out;
}

TEST(Program, ExpertsUnderSequenceParallelism) {
  ModelSpec m = preset("mixtral-8x7b");
  m.layers = 4;
  m.seq_len = 2048;
  Program prog = compile(m, options(8, 1, true, RecomputeMode::kNone, 1));
  // (The embedding's reduce-scatter is labelled with the first layer's norm: one more.)
  EXPECT_EQ(layer_collectives(prog, 0, BlockKind::kForward),
            (Counts{{kAG, 2 * 4}, {kRS, 2 * 4 + 1}}));
  const double routed_bytes = 1.0 * m.seq_len * 2 * m.hidden * 2;  // b s k h, bf16
  const double token_bytes = 1.0 * m.seq_len * m.hidden * 2;
  std::map<std::string, double> bytes;
  for (const BlockTemplate& t : prog.templates) {
    if (t.kind != BlockKind::kForward) continue;
    for (const Step& s : t.steps) {
      if (s.kind == StepKind::kCollective && s.label >= 0) {
        bytes[fmt::format("{} {}", prog.labels[s.label], to_string(s.collective))] = s.bytes;
      }
    }
    break;
  }
  EXPECT_DOUBLE_EQ(bytes["moe.fc1 all-gather"], routed_bytes) << listed(bytes);
  EXPECT_DOUBLE_EQ(bytes["moe.combine reduce-scatter"], routed_bytes) << listed(bytes);
  EXPECT_DOUBLE_EQ(bytes["attn.qkv all-gather"], token_bytes) << listed(bytes);
  // Every GPU holds a tp share of every expert, and the router and norms whole (the
  // embedding and the head: the vocabulary padded to 32,768 rows and split).
  const double h = m.hidden, experts = 8 * 3 * h * m.expert_ffn_hidden;
  const double attention = h * (h + 2 * 1024) + h * h, router = h * 8, norms = 2 * h;
  EXPECT_DOUBLE_EQ(prog.lanes[0].parameters,
                   m.layers * ((experts + attention) / 8 + router + norms) + h + 2 * 32768 * h / 8);
}

// A mixture-of-experts preset cut to a few layers of 2,048 tokens, built with expert
// parallelism `ep` and ZeRO-1 on the 32 GPUs, 64 sequences a step.
Program compile_moe(const std::string& name, int layers, int ep, ModelSpec* model) {
  *model = preset(name);
  model->layers = layers;
  model->seq_len = 2048;
  MegatronOptions o = options(1, 1, false, RecomputeMode::kNone, 1);
  o.ep = ep;
  o.zero = 1;
  o.global_batch = 64;
  return compile(*model, o);
}

// Gradient bytes a lane reduce-scatters over its iteration, by the mesh axes of the group.
std::map<uint32_t, double> reduce_scattered_by_axes(const Program& prog, const Lane& lane) {
  std::map<uint32_t, double> reduced;
  auto add = [&](const std::vector<Step>& steps) {
    for (const Step& s : steps) {
      if (s.kind == StepKind::kDpLaunch && s.collective == CollectiveKind::kReduceScatter) {
        reduced[s.axes] += s.bytes;
      }
    }
  };
  for (const BlockInstance& b : lane.blocks) add(prog.templates[b.template_index].steps);
  add(lane.epilogue);
  return reduced;
}

// A GPU of replica 0 holds every dense parameter and 1/ep of the experts, and reduce-scatters
// the dense gradients (4 bytes each) over dp x ep and the experts' over dp.
void expect_dense_and_expert_groups(const Program& prog, const ModelSpec& m, int ep_degree) {
  const Mesh& mesh = prog.plan.mesh;
  const uint32_t dp = 1u << mesh.axis_index("dp"), ep = 1u << mesh.axis_index("ep");
  const double experts = static_cast<double>(m.expert_parameters()) / ep_degree;
  const double dense = static_cast<double>(m.parameters() - m.expert_parameters());
  const Lane& lane = prog.lanes[0];
  EXPECT_DOUBLE_EQ(lane.parameters, dense + experts);
  std::map<uint32_t, double> reduced = reduce_scattered_by_axes(prog, lane);
  EXPECT_DOUBLE_EQ(reduced[dp | ep], 4 * dense);
  EXPECT_DOUBLE_EQ(reduced[dp], 4 * experts);
}

// Expert parallelism: each rank keeps its own sequence in the dense operators and 1/ep of the
// experts; every routed token copy goes to its expert's rank and back (two all-to-alls a layer
// each way). The dense weights' gradients sum over dp x ep, the experts' over dp alone, and
// ZeRO shards each over its own group.
TEST(Program, ExpertParallelismExchangesTokensAndShardsExpertsApart) {
  ModelSpec m;
  // 32 GPUs: 4 replicas of 8 expert-parallel ranks, 2 micro-batches.
  const Program prog = compile_moe("mixtral-8x7b", 4, 8, &m);
  ASSERT_FALSE(prog.lanes.empty());
  const Mesh& mesh = prog.plan.mesh;
  const uint32_t dp = 1u << mesh.axis_index("dp"), ep = 1u << mesh.axis_index("ep");
  EXPECT_EQ(mesh.axis_size("dp"), 4);
  EXPECT_EQ(prog.plan.micro_batch, 8);
  EXPECT_EQ(prog.micro_batches, 2);

  const double routed_bytes = 1.0 * m.seq_len * 2 * m.hidden * 2;  // one sequence, k = 2, bf16
  for (BlockKind kind : {BlockKind::kForward, BlockKind::kBackward}) {
    EXPECT_EQ(layer_collectives(prog, 0, kind, "ep"), (Counts{{CollectiveKind::kAllToAll, 2 * 4}}));
    for (const BlockTemplate& t : prog.templates) {
      if (t.kind != kind) continue;
      for (const Step& s : t.steps) {
        if (s.kind != StepKind::kCollective) continue;
        EXPECT_EQ(s.axes, ep) << prog.labels[s.label];
        EXPECT_DOUBLE_EQ(s.bytes, routed_bytes) << prog.labels[s.label];
      }
    }
  }

  // Parameters per GPU: the dense ones whole, an eighth of the experts.
  const double h = m.hidden, vocab = 32000;
  const double experts = m.layers * 8 * 3 * h * m.expert_ffn_hidden / 8;
  const double dense = m.layers * (h * (h + 2 * 1024) + h * h + h * 8 + 2 * h) + h + 2 * vocab * h;
  const Lane& lane = prog.lanes[0];
  EXPECT_DOUBLE_EQ(lane.parameters, dense + experts);
  // Gradient reduce-scatters (4-byte gradients) by group.
  std::map<uint32_t, double> reduced = reduce_scattered_by_axes(prog, lane);
  EXPECT_EQ(reduced.size(), 2u);
  EXPECT_DOUBLE_EQ(reduced[dp | ep], 4 * dense);
  EXPECT_DOUBLE_EQ(reduced[dp], 4 * experts);
  EXPECT_DOUBLE_EQ(lane.memory.optimizer, 12 * (dense / 32 + experts / 4));

  // Padded to a capacity factor of 1.5, every all-to-all moves half as much again; the model's
  // FLOPs stay.
  Plan padded = prog.plan;
  padded.model.expert_capacity_factor = 1.5;
  auto compiled = compile_plan(padded, dgx());
  ASSERT_TRUE(compiled.ok()) << compiled.error().message();
  const Program& wide = *compiled;
  for (const BlockTemplate& t : wide.templates) {
    for (const Step& s : t.steps) {
      if (s.kind == StepKind::kCollective) {
        EXPECT_DOUBLE_EQ(s.bytes, 1.5 * routed_bytes);
      }
    }
  }
  EXPECT_DOUBLE_EQ(wide.model_flops_per_iteration, prog.model_flops_per_iteration);

  // Through DeepEP the same exchanges, with the same bytes, are expert exchanges, and the
  // program carries the router's figures they are priced with.
  Plan deepep = prog.plan;
  deepep.moe_deepep = true;
  auto exchanged = compile_plan(deepep, dgx());
  ASSERT_TRUE(exchanged.ok()) << exchanged.error().message();
  for (BlockKind kind : {BlockKind::kForward, BlockKind::kBackward}) {
    EXPECT_EQ(layer_collectives(*exchanged, 0, kind, "ep"),
              (Counts{{CollectiveKind::kExpertExchange, 2 * 4}}));
  }
  EXPECT_EQ(exchanged->expert_routing.experts, 8);
  EXPECT_EQ(exchanged->expert_routing.per_token, 2);
  EXPECT_EQ(prog.expert_routing.experts, 0);  // NCCL's all-to-all needs none

  // Each GPU runs one of the replica's 8 sequences: no room for two sub-batches.
  Plan halves = prog.plan;
  halves.comm.tp_sub_batches = 2;
  auto split = compile_plan(halves, dgx());
  ASSERT_FALSE(split.ok());
  EXPECT_NE(split.error().message().find("communication.tp_sub_batches: 2 sub-batches do not "
                                         "divide the 1 sequence"),
            std::string::npos)
      << split.error().message();

  // ZeRO-3 by whole layers (FSDP): each group's part of a layer is gathered and reduced over
  // its own devices, and each GPU stores its shard of both (16-bit shards here).
  Plan sharded = prog.plan;
  sharded.optimizer.zero = 3;
  auto z3 = compile_plan(sharded, dgx());
  ASSERT_TRUE(z3.ok()) << z3.error().message();
  const Lane& zl = z3->lanes[0];
  EXPECT_DOUBLE_EQ(zl.memory.weights, 2 * (dense / 32 + experts / 4));
  std::map<uint32_t, double> gathered;
  for (const BlockInstance& b : zl.blocks) {
    for (const Step& s : z3->templates[b.template_index].steps) {
      if (s.kind == StepKind::kDpLaunch && s.collective == CollectiveKind::kAllGather) {
        gathered[s.axes] += s.bytes;
      }
    }
  }
  EXPECT_EQ(gathered.size(), 2u);
  EXPECT_NEAR(gathered[dp | ep] * experts, gathered[dp] * dense, 1e-9 * gathered[dp] * dense);
  std::map<uint32_t, double> reduced3 = reduce_scattered_by_axes(*z3, zl);
  EXPECT_DOUBLE_EQ(reduced3[dp | ep], z3->micro_batches * 4 * dense);  // every micro-batch
  EXPECT_DOUBLE_EQ(reduced3[dp], z3->micro_batches * 4 * experts);
  // Tensor by tensor (DeepSpeed) it would mix the groups' tensors: refused, naming the field.
  sharded.comm.zero3_per_tensor = true;
  auto refused = compile_plan(sharded, dgx());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("communication.zero3_per_tensor"), std::string::npos)
      << refused.error().message();
}

// A mixture with dense blocks (DeepSeekMoE: the first layer's MLP is dense): only the expert
// blocks exchange tokens, a dense block's weights are all dense-group weights, and each block
// costs its own compute.
TEST(Program, DenseBlocksOfAMixtureAreDense) {
  ModelSpec m;
  // 4 layers (1 dense, 3 with experts), 32 GPUs: 4 replicas of 8 expert-parallel ranks.
  const Program prog = compile_moe("deepseek-moe-16b", 4, 8, &m);
  ASSERT_FALSE(prog.lanes.empty());
  ASSERT_EQ(m.moe_layers(), 3);
  int all_to_all = 0;
  for (const Step& s : first_forward(prog)) {
    all_to_all += s.kind == StepKind::kCollective && s.collective == CollectiveKind::kAllToAll;
  }
  EXPECT_EQ(all_to_all, 2 * 3);  // to the experts and back, in each expert block
  expect_dense_and_expert_groups(prog, m, 8);
  EXPECT_NE(prog.layer_activation_bytes[0], prog.layer_activation_bytes[1]);
  EXPECT_EQ(prog.layer_activation_bytes[1], prog.layer_activation_bytes[3]);

  // Forward compute on one GPU: the mixed model is the all-expert one with one block's cost
  // swapped for a dense block's, which is a quarter of the way to the all-dense model.
  auto forward_seconds = [](const ModelSpec& model) {
    MegatronOptions o = options(1, 1, false, RecomputeMode::kNone, 1);
    o.global_batch = 32;
    const Program p = compile(model, o);
    double sum = 0;
    for (const Step& s : first_forward(p)) sum += s.kind == StepKind::kCompute ? s.seconds : 0.0;
    return sum;
  };
  ModelSpec all_experts = m, all_dense = m;
  all_experts.first_dense_layers = 0;
  all_dense.experts = all_dense.experts_per_token = all_dense.expert_ffn_hidden = 0;
  all_dense.shared_expert_ffn_hidden = all_dense.first_dense_layers = 0;
  const double mixed = forward_seconds(m), moe = forward_seconds(all_experts);
  EXPECT_GT(mixed, 0);
  EXPECT_NEAR(mixed - moe, (forward_seconds(all_dense) - moe) / 4, 1e-9 * mixed);

  // Two stages: the first holds the dense block and one expert block, the second two expert
  // blocks; together they hold the model once.
  MegatronOptions two = options(1, 2, false, RecomputeMode::kNone, 1);
  two.global_batch = 32;
  const Program staged = compile(m, two);
  ASSERT_EQ(staged.lanes.size(), 2u);
  EXPECT_DOUBLE_EQ(staged.lanes[0].parameters + staged.lanes[1].parameters,
                   static_cast<double>(m.parameters()));
  EXPECT_LT(staged.lanes[0].parameters - m.embedding_parameters(),
            staged.lanes[1].parameters - m.head_parameters());
}

// Expert tensor parallelism folded (--etp 1): the tensor-parallel ranks hold whole experts of
// their own, so the routed tokens reach them by all-to-all over tp too (instead of an all-gather
// before the experts and a reduce-scatter after them), and each GPU holds as many expert
// parameters as when the experts split along their width.
TEST(Program, FoldedExpertTensorParallelismExchangesTokensOverTp) {
  ModelSpec m = preset("mixtral-8x7b");
  m.layers = 4;
  m.seq_len = 2048;
  auto forward = [&](int expert_tp, double* params, bool deepep = false) {
    MegatronOptions o = options(2, 1, true, RecomputeMode::kNone, 1);
    o.ep = 4;
    o.expert_tp = expert_tp;
    o.moe_deepep = deepep;
    o.global_batch = 32;
    const Program prog = compile(m, o);
    std::set<std::string> layer_ops;
    for (const auto& op : prog.graph.blocks[0].ops) layer_ops.insert(op.name);
    std::map<std::string, int> count;  // "axis kind" -> collectives of one layer's forward
    for (const BlockTemplate& t : prog.templates) {
      if (t.kind != BlockKind::kForward) continue;
      for (const Step& s : t.steps) {
        if (s.kind != StepKind::kCollective || !layer_ops.count(prog.labels[s.label])) continue;
        ++count[fmt::format("{} {}", prog.axes_name(s.axes), to_string(s.collective))];
      }
      break;
    }
    for (auto& [what, n] : count) n /= m.layers;
    *params = prog.lanes.empty() ? 0 : prog.lanes[0].parameters;
    return count;
  };
  double split = 0, folded = 0;
  EXPECT_EQ(forward(0, &split),
            (std::map<std::string, int>{
                {"ep all-to-all", 2}, {"tp all-gather", 2}, {"tp reduce-scatter", 2}}));
  EXPECT_EQ(forward(1, &folded), (std::map<std::string, int>{{"ep all-to-all", 2},
                                                             {"tp all-to-all", 2},
                                                             {"tp all-gather", 1},
                                                             {"tp reduce-scatter", 1}}));
  EXPECT_DOUBLE_EQ(folded, split);
  // Through DeepEP, the exchange over ep alone is an expert exchange; with the experts split
  // over ep and tp both stay all-to-alls (docs/cost-model.md).
  EXPECT_EQ(forward(0, &split, true),
            (std::map<std::string, int>{
                {"ep expert exchange", 2}, {"tp all-gather", 2}, {"tp reduce-scatter", 2}}));
  EXPECT_EQ(forward(1, &folded, true), forward(1, &folded));
}

// A shared expert is dense: every expert-parallel rank holds all of it and its gradients sum
// over dp x ep with the attention's; only the routed experts are divided.
TEST(Program, SharedExpertIsDenseUnderExpertParallelism) {
  ModelSpec m;
  const Program prog = compile_moe("qwen1.5-moe-a2.7b", 2, 4, &m);
  ASSERT_FALSE(prog.lanes.empty());
  expect_dense_and_expert_groups(prog, m, 4);
}

// The builder's expert-parallel degree must fit the model and the data-parallel ranks.
TEST(Program, ExpertParallelDegreesAreChecked) {
  ModelSpec moe = preset("mixtral-8x7b");
  moe.layers = 4;
  moe.seq_len = 2048;
  struct Case {
    ModelSpec model;
    int tp, ep, expert_tp;
    const char* says;
  };
  const Case cases[] = {
      {korthikanti("gpt3-1.3b"), 1, 2, 0, "has none (model.experts)"},
      {moe, 1, 16, 0, "does not divide the model's 8 experts"},
      {moe, 8, 8, 0, "must divide the data-parallel degree 4"},
      {moe, 4, 1, 2, "--etp 2: the experts split over all the tensor-parallel ranks (--etp 4"},
      {moe, 4, 4, 1, "ep x tp = 4 x 4 ranks, which does not divide the model's 8 experts"},
      {korthikanti("gpt3-1.3b"), 2, 1, 1, "--etp 1 spreads experts over the tensor-parallel"},
  };
  for (const Case& c : cases) {
    MegatronOptions o = options(c.tp, 1, false, RecomputeMode::kNone, 1);
    o.ep = c.ep;
    o.expert_tp = c.expert_tp;
    auto plan = build_megatron_plan(c.model, dgx(), o);
    ASSERT_FALSE(plan.ok()) << c.says;
    EXPECT_NE(plan.error().message().find(c.says), std::string::npos) << plan.error().message();
  }
  MegatronOptions o = options(1, 1, false, RecomputeMode::kNone, 1);
  o.moe_grouped_gemm = true;  // nothing to group in a dense model
  auto plan = build_megatron_plan(korthikanti("gpt3-1.3b"), dgx(), o);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.error().message().find("--moe-grouped-gemm groups a mixture of experts' GEMMs"),
            std::string::npos)
      << plan.error().message();
}

// Transformer Engine's tensor-parallel overlap (NeMo's defaults, bulk dgrad and wgrad): in the
// backward the input-gradient GEMM runs alongside the all-gather before it and the
// weight-gradient GEMM alongside the input gradient's reduce-scatter, so no layer collective is
// left exposed, and the block's GEMM FLOPs are the same as without the overlap.
TEST(Program, TensorParallelOverlapHidesEveryBackwardLayerCollective) {
  const ModelSpec m = korthikanti("gpt3-1.3b");
  std::set<std::string> layer_ops;
  auto backward = [&](bool overlap) {
    MegatronOptions o = options(8, 1, true, RecomputeMode::kNone, 1);
    o.tp_comm_overlap = overlap;
    Program prog = compile(m, o);
    for (const auto& op : prog.graph.blocks[0].ops) layer_ops.insert(op.name);
    std::vector<Step> steps;
    for (const BlockTemplate& t : prog.templates) {
      if (t.kind != BlockKind::kBackward) continue;
      for (const Step& s : t.steps) {
        if (s.label >= 0 && layer_ops.count(prog.labels[s.label])) steps.push_back(s);
      }
      break;
    }
    return steps;
  };
  auto flops = [](const std::vector<Step>& steps) {
    double f = 0;
    for (const Step& s : steps) f += s.flops;
    return f;
  };
  const std::vector<Step> plain = backward(false), overlapped = backward(true);
  int collectives = 0;
  for (const Step& s : overlapped) {
    if (s.kind != StepKind::kCollective) continue;
    ++collectives;
    EXPECT_GT(s.seconds, 0) << "exposed "
                            << (s.collective == kAG ? "all-gather" : "reduce-scatter");
  }
  EXPECT_EQ(collectives, 6 * m.layers);  // two mirrored, two re-gathered, two reduce-scatters
  EXPECT_GT(flops(plain), 0);
  EXPECT_NEAR(flops(overlapped), flops(plain), 1e-9 * flops(plain));
}

// Merak's sub-pipelined tensor parallelism: with two sub-batches every block does the same work
// (FLOPs, compute seconds, collective bytes) in twice as many collectives of half the bytes, and
// all but the last of each stretch run beside the other sub-batch's compute, which takes less
// time overall than the blocking collectives did.
TEST(Program, SubPipelinedTensorParallelismHidesCollectivesBehindTheOtherSubBatch) {
  const ModelSpec m = preset("gpt3-1.3b");
  auto build = [&](int sub_batches) {
    MegatronOptions o = options(8, 1, false, RecomputeMode::kSelective, 2);
    o.tp_sub_batches = sub_batches;
    return compile(m, o);
  };
  const Program plain = build(1), sub = build(2);
  ASSERT_EQ(plain.templates.size(), sub.templates.size());
  const double interference = sub.compute_model.comm_interference;
  for (size_t i = 0; i < plain.templates.size(); ++i) {
    struct Sums {
      double flops = 0, compute = 0, bytes = 0;
      int collectives = 0, overlapped = 0;
    };
    auto sum = [&](const BlockTemplate& t) {
      Sums x;
      for (const Step& s : t.steps) {
        x.flops += s.flops;
        if (s.kind == StepKind::kCompute) x.compute += s.seconds;
        if (s.kind != StepKind::kCollective) continue;
        x.compute += s.seconds / (1 + interference);
        x.bytes += s.bytes;
        ++x.collectives;
        if (s.seconds > 0) ++x.overlapped;
      }
      return x;
    };
    const Sums a = sum(plain.templates[i]), b = sum(sub.templates[i]);
    SCOPED_TRACE(to_string(plain.templates[i].kind));
    EXPECT_NEAR(b.flops, a.flops, 1e-9 * a.flops);
    EXPECT_NEAR(b.compute, a.compute, 1e-9 * a.compute);
    EXPECT_NEAR(b.bytes, a.bytes, 1e-9 * a.bytes);
    EXPECT_EQ(b.collectives, 2 * a.collectives);
    EXPECT_EQ(a.overlapped, 0);
    // A stretch's last pieces and the loss's back-to-back statistics stay exposed; the rest pair.
    EXPECT_GE(b.overlapped, 0.9 * b.collectives);
  }
  EXPECT_LT(estimate_program(sub).iteration_time, 0.95 * estimate_program(plain).iteration_time);

  // A whole number of sequences per sub-batch, and one way of hiding the collectives at a time.
  MegatronOptions o = options(8, 1, false, RecomputeMode::kNone, 1);
  o.tp_sub_batches = 2;
  auto refused = build_megatron_plan(m, dgx(), o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("must divide the micro-batch"), std::string::npos);
  o = options(8, 1, false, RecomputeMode::kNone, 2);
  o.tp_sub_batches = 2;
  o.tp_comm_overlap = true;
  refused = build_megatron_plan(m, dgx(), o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("choose one"), std::string::npos);
  // The plan file carries it, and refuses it beside tp_overlap.
  Plan p = sub.plan;
  auto back = parse_plan(plan_to_json(p), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->comm.tp_sub_batches, 2);
  p.comm.tp_overlap = true;
  back = parse_plan(plan_to_json(p), "plan.json");
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.error().message().find("tp_sub_batches"), std::string::npos)
      << back.error().message();
}

// PyTorch's tensor parallelism saves the two gathered norm outputs (the inputs of the QKV and
// first MLP linears) whole instead of gathering them again in the backward: Korthikanti et
// al.'s tp+sp bytes plus (1 - 1/t) of two 2-byte s b h tensors, and no backward all-gathers.
TEST(Program, SavedGatheredInputsCostMemoryAndSaveTheBackwardGathers) {
  const ModelSpec m = korthikanti("gpt3-1.3b");
  const double s = m.seq_len, h = m.hidden, a = m.heads, t = 8, b = 1;
  const double sbh = s * b * h;
  auto plan = build_megatron_plan(m, dgx(), options(8, 1, true, RecomputeMode::kNone, 1));
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_FALSE(plan->comm.save_gathered_inputs);  // Megatron
  plan->comm.save_gathered_inputs = true;
  auto prog = compile_plan(*plan, dgx());
  ASSERT_TRUE(prog.ok()) << prog.error().message();
  for (int l = 0; l < m.layers; ++l) {
    EXPECT_DOUBLE_EQ(prog->layer_activation_bytes[l],
                     sbh / t * (34 + 5 * a * s / h) + 2 * 2 * sbh * (1 - 1 / t))
        << "layer " << l;
  }
  const int n = m.layers;
  EXPECT_EQ(layer_collectives(*prog, 0, BlockKind::kForward), (Counts{{kAG, 2 * n}, {kRS, 2 * n}}));
  EXPECT_EQ(layer_collectives(*prog, 0, BlockKind::kBackward),
            (Counts{{kAG, 2 * n}, {kRS, 2 * n}}));

  MegatronOptions o = options(8, 1, true, RecomputeMode::kNone, 1);
  o.framework = "fsdp";
  auto fsdp = build_megatron_plan(m, dgx(), o);
  ASSERT_TRUE(fsdp.ok()) << fsdp.error().message();
  EXPECT_TRUE(fsdp->comm.save_gathered_inputs);
}

// Full recompute replays the forward (with its collectives) inside the backward block.
TEST(Program, FullRecomputeRepeatsTheForwardCollectives) {
  const ModelSpec m = korthikanti("gpt3-1.3b");
  const int n = m.layers;
  Program prog = compile(m, options(8, 1, false, RecomputeMode::kFull, 1));
  EXPECT_EQ(layer_collectives(prog, 0, BlockKind::kForward), (Counts{{kAR, 2 * n}}));
  EXPECT_EQ(layer_collectives(prog, 0, BlockKind::kBackward), (Counts{{kAR, 4 * n}}));
  prog = compile(m, options(8, 1, true, RecomputeMode::kFull, 1));
  // Recompute: 2 AG + 2 RS; backward: 2 AG + 2 RS of the gradients (the saved inputs are
  // recomputed, so nothing is re-gathered).
  EXPECT_EQ(layer_collectives(prog, 0, BlockKind::kBackward), (Counts{{kAG, 4 * n}, {kRS, 4 * n}}));
}

// PyTorch's non-reentrant checkpoint stops a layer's recomputation once the tensors its backward
// needs are back: the last one saved is the second MLP linear's input, saved before that linear
// runs, so the linear and the residual add after it are not recomputed. Megatron's checkpoint
// replays the whole layer, and so does PyTorch's when the residual add saves a dropout mask.
TEST(Program, PyTorchCheckpointStopsRecomputingAfterTheLastSavedTensor) {
  auto recomputed = [](const ModelSpec& m, const std::string& framework) {
    MegatronOptions o = options(1, 1, false, RecomputeMode::kFull, 1);
    o.framework = framework;
    auto plan = build_megatron_plan(m, dgx(), o);
    EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
    std::multiset<std::string> labels;
    if (!plan.ok()) return labels;
    EXPECT_EQ(plan->recompute_early_stop, framework == "fsdp");
    auto back = parse_plan(plan_to_json(*plan), "plan.json");
    EXPECT_TRUE(back.ok() && back->recompute_early_stop == plan->recompute_early_stop);
    auto prog = compile_plan(*plan, dgx());
    EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
    if (!prog.ok()) return labels;
    for (const BlockTemplate& t : prog->templates) {
      if (t.kind != BlockKind::kBackward) continue;
      for (const Step& s : t.steps) {
        if (s.kind == StepKind::kCompute && s.compute_class == ComputeClass::kRecompute) {
          labels.insert(prog->labels[s.label]);
        }
      }
      break;
    }
    return labels;
  };
  ModelSpec m = preset("gpt3-1.3b");
  m.dropout = false;
  const size_t n = m.layers;
  const auto megatron = recomputed(m, "megatron");
  const auto fsdp = recomputed(m, "fsdp");
  for (const char* op : {"attn.qkv", "attn.core", "mlp.fc1", "mlp.act"}) {
    EXPECT_EQ(megatron.count(op), n) << op;
    EXPECT_EQ(fsdp.count(op), n) << op;
  }
  for (const char* op : {"mlp.fc2", "mlp.residual"}) {
    EXPECT_EQ(megatron.count(op), n) << op;
    EXPECT_EQ(fsdp.count(op), 0u) << op;
  }
  // With dropout the residual add saves its mask: the whole layer runs again.
  m.dropout = true;
  const auto fsdp_dropout = recomputed(m, "fsdp");
  EXPECT_EQ(fsdp_dropout.count("mlp.fc2"), n);
  EXPECT_EQ(fsdp_dropout.count("mlp.residual"), n);
}

// With expert parallelism a mixture's early stop ends at the combine, whose saved input (the
// experts' outputs) comes back to the tokens' ranks through an all-to-all: the recomputation
// exchanges them again though the combine does not run, as Megatron's full replay does.
TEST(Program, EarlyStopStillExchangesTheCombinesSavedInput) {
  ModelSpec m = preset("mixtral-8x7b");
  m.layers = 4;
  auto combine_exchanges = [&](const std::string& framework, int* recomputed_combines) {
    MegatronOptions o = options(1, 1, false, RecomputeMode::kFull, 1);
    o.framework = framework;
    o.ep = 8;
    o.global_batch = 32;
    auto plan = build_megatron_plan(m, dgx(), o);
    EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
    if (!plan.ok()) return -1;
    auto prog = compile_plan(*plan, dgx());
    EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
    if (!prog.ok()) return -1;
    int exchanges = 0;
    *recomputed_combines = 0;
    for (const BlockTemplate& t : prog->templates) {
      if (t.kind != BlockKind::kBackward) continue;
      for (const Step& s : t.steps) {
        const std::string& label = s.label >= 0 ? prog->labels[s.label] : "";
        if (label != "moe.combine") continue;
        exchanges += s.kind == StepKind::kCollective && s.collective == CollectiveKind::kAllToAll;
        *recomputed_combines +=
            s.kind == StepKind::kCompute && s.compute_class == ComputeClass::kRecompute;
      }
      break;
    }
    return exchanges;
  };
  int megatron_runs = 0, fsdp_runs = 0;
  const int megatron = combine_exchanges("megatron", &megatron_runs);
  const int fsdp = combine_exchanges("fsdp", &fsdp_runs);
  // Per layer: the recomputation's exchange into the combine and the backward's out of it.
  EXPECT_EQ(megatron, 2 * m.layers);
  EXPECT_EQ(fsdp, 2 * m.layers);
  EXPECT_EQ(megatron_runs, m.layers);
  EXPECT_EQ(fsdp_runs, 0);
}

// With rotary positions the first layer receives the vocabulary-parallel embedding's partial
// sums and reduces them at its first norm (layer 0's forward has one all-reduce more). The
// reduced tensor is the layer's saved input, so its recomputation starts from it: the backward
// repeats the 2 n layer all-reduces of the forward plus its own 2 n, not the embedding's.
TEST(Program, RecomputationDoesNotReduceTheEmbeddingAgain) {
  const ModelSpec m = preset("llama3-8b");
  ASSERT_EQ(m.position, PositionKind::kRope);
  const int n = m.layers;
  Program prog = compile(m, options(8, 1, false, RecomputeMode::kFull, 1));
  EXPECT_EQ(layer_collectives(prog, 0, BlockKind::kForward), (Counts{{kAR, 2 * n + 1}}));
  EXPECT_EQ(layer_collectives(prog, 0, BlockKind::kBackward), (Counts{{kAR, 4 * n}}));
}

// Data-parallel launches of one kind over a lane's iteration.
int dp_launches(const Program& prog, const Lane& lane, CollectiveKind kind) {
  int n = 0;
  for (const BlockInstance& b : lane.blocks) {
    for (const Step& s : prog.templates[b.template_index].steps) {
      n += s.kind == StepKind::kDpLaunch && s.collective == kind;
    }
  }
  return n;
}

// PyTorch FSDP under a pipeline keeps the gathered parameters and their unsharded fp32
// gradients for the iteration: one gather and one reduce-scatter per parameter unit instead of
// per micro-batch, for the memory of the whole unsharded stage.
TEST(Program, FsdpUnderAPipelineKeepsParametersGathered) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = options(1, 2, false, RecomputeMode::kNone, 1);
  o.framework = "fsdp";
  o.zero = 3;
  auto plan = build_megatron_plan(m, dgx(), o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_TRUE(plan->optimizer.keep_gathered);
  auto kept = compile_plan(*plan, dgx());
  ASSERT_TRUE(kept.ok()) << kept.error().message();
  plan->optimizer.keep_gathered = false;
  auto resharded = compile_plan(*plan, dgx());
  ASSERT_TRUE(resharded.ok()) << resharded.error().message();

  const int micro_batches = kept->micro_batches;
  ASSERT_GE(micro_batches, 2);
  const double shard = kept->replicas;
  for (size_t l = 0; l < kept->lanes.size(); ++l) {
    const Lane& lane = kept->lanes[l];
    // Units: the stage's layers, plus the embedding or the head.
    const int units = m.layers / 2 + 1;
    SCOPED_TRACE(fmt::format("lane {}", l));
    EXPECT_EQ(dp_launches(*kept, lane, kAG), units);
    EXPECT_EQ(dp_launches(*kept, lane, kRS), units);
    EXPECT_EQ(dp_launches(*resharded, resharded->lanes[l], kAG), 2 * units * micro_batches);
    EXPECT_EQ(dp_launches(*resharded, resharded->lanes[l], kRS), units * micro_batches);

    const double P = lane.parameters;
    EXPECT_DOUBLE_EQ(lane.memory.weights, 4 * P / shard);
    EXPECT_DOUBLE_EQ(lane.memory.gradients, 4 * P / shard);
    EXPECT_DOUBLE_EQ(lane.memory.gathered, 2 * P + 4 * P);  // every parameter, all iteration
    EXPECT_LT(resharded->lanes[l].memory.gathered, lane.memory.gathered);
  }

  // Megatron's own conventions are untouched.
  o.framework = "megatron";
  auto megatron = build_megatron_plan(m, dgx(), o);
  ASSERT_TRUE(megatron.ok());
  EXPECT_FALSE(megatron->optimizer.keep_gathered);
}

// Data-parallel all-gathered bytes over a lane's iteration.
double dp_gathered_bytes(const Program& prog, const Lane& lane) {
  double bytes = 0;
  for (const BlockInstance& b : lane.blocks) {
    for (const Step& s : prog.templates[b.template_index].steps) {
      if (s.kind == StepKind::kDpLaunch && s.collective == kAG) bytes += s.bytes;
    }
  }
  return bytes;
}

// Data-parallel bytes of one collective kind launched over a lane's iteration (blocks and
// epilogue).
double dp_bytes(const Program& prog, const Lane& lane, CollectiveKind kind) {
  double bytes = 0;
  auto add = [&](const Step& s) {
    if (s.kind == StepKind::kDpLaunch && s.collective == kind) bytes += s.bytes;
  };
  for (const BlockInstance& b : lane.blocks) {
    for (const Step& s : prog.templates[b.template_index].steps) add(s);
  }
  for (const Step& s : lane.epilogue) add(s);
  return bytes;
}

// Data parallelism only, under DeepSpeed's ZeRO-3.
MegatronOptions deepspeed_zero3(RecomputeMode recompute) {
  MegatronOptions o = options(1, 1, false, recompute, 1);
  o.zero = 3;
  o.framework = "deepspeed";
  return o;
}

// DeepSpeed's ZeRO-3 gathers a recomputed layer twice in the backward pass: for the
// recomputation and for the backward (FSDP recomputes inside the unit it has gathered).
TEST(Program, DeepSpeedRegathersRecomputedLayers) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = deepspeed_zero3(RecomputeMode::kFull);
  auto plan = build_megatron_plan(m, dgx(), o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_TRUE(plan->comm.zero3_regather_for_recompute);
  plan->comm.zero3_persistence_threshold = 0;  // every tensor gathered: the formula below
  auto regathered = compile_plan(*plan, dgx());
  ASSERT_TRUE(regathered.ok()) << regathered.error().message();
  plan->comm.zero3_regather_for_recompute = false;
  plan->comm.zero3_prefetch_elements = 0;  // tensor-grained prefetch needs the regather
  auto once = compile_plan(*plan, dgx());
  ASSERT_TRUE(once.ok()) << once.error().message();

  const double P = once->lanes[0].parameters;
  const double layer = static_cast<double>(m.layer_parameters());
  const double mb = once->micro_batches;
  // 16-bit parameters: a forward and a backward gather of everything per micro-batch (the tied
  // head gathers the embedding matrix again), plus the recomputation's gather of every layer.
  const double tied = static_cast<double>(plan->model.vocab) * m.hidden;
  EXPECT_DOUBLE_EQ(dp_gathered_bytes(*once, once->lanes[0]), mb * 2 * 2 * (P + tied));
  EXPECT_DOUBLE_EQ(dp_gathered_bytes(*regathered, regathered->lanes[0]),
                   mb * (2 * 2 * (P + tied) + 2 * m.layers * layer));

  o.framework = "fsdp";
  auto fsdp = build_megatron_plan(m, dgx(), o);
  ASSERT_TRUE(fsdp.ok());
  EXPECT_FALSE(fsdp->comm.zero3_regather_for_recompute);
}

// DeepSpeed's ZeRO-3 gathers and reduces each parameter tensor on its own: a GPT layer's twelve
// (LayerNorm's scale and shift are two parameters), the same bytes as FSDP's gather of the
// whole layer at once; with DeepSpeed's persistence threshold, tensors under 1e5 elements (the
// biases and norms) stay whole on every GPU and are never gathered.
TEST(Program, DeepSpeedGathersTensorByTensor) {
  const ModelSpec m = preset("gpt3-1.3b");  // LayerNorm with biases, learned positions, tied
  MegatronOptions o = deepspeed_zero3(RecomputeMode::kNone);
  auto plan = build_megatron_plan(m, dgx(), o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_TRUE(plan->comm.zero3_per_tensor);
  EXPECT_DOUBLE_EQ(plan->comm.zero3_persistence_threshold, 1e5);
  EXPECT_DOUBLE_EQ(plan->comm.zero3_reduce_bucket, 5e8);
  auto bucketed = compile_plan(*plan, dgx());
  ASSERT_TRUE(bucketed.ok()) << bucketed.error().message();
  plan->comm.zero3_reduce_bucket = 0;
  auto persistent = compile_plan(*plan, dgx());
  ASSERT_TRUE(persistent.ok()) << persistent.error().message();
  plan->comm.zero3_persistence_threshold = 0;
  auto per_tensor = compile_plan(*plan, dgx());
  ASSERT_TRUE(per_tensor.ok()) << per_tensor.error().message();
  plan->comm.zero3_per_tensor = false;
  plan->comm.zero3_prefetch_elements = 0;
  auto per_unit = compile_plan(*plan, dgx());
  ASSERT_TRUE(per_unit.ok()) << per_unit.error().message();

  const int mb = per_unit->micro_batches;
  const Lane& unit_lane = per_unit->lanes[0];
  const Lane& tensor_lane = per_tensor->lanes[0];
  // Units: the embedding, each layer, the head. Tensors: the word and position tables; per
  // layer two norms of two, qkv, proj, fc1 and fc2 with their biases; the head's norm (two) and
  // its projection (the tied embedding matrix: gathered again by the head, whose hooks fetch
  // it, but its gradient reduced once, with the embedding's).
  const int units = m.layers + 2, tensors = 2 + 12 * m.layers + 3;
  EXPECT_EQ(dp_launches(*per_unit, unit_lane, kAG), 2 * units * mb);
  EXPECT_EQ(dp_launches(*per_unit, unit_lane, kRS), units * mb);
  EXPECT_EQ(dp_launches(*per_tensor, tensor_lane, kAG), 2 * tensors * mb);
  EXPECT_EQ(dp_launches(*per_tensor, tensor_lane, kRS), (tensors - 1) * mb);
  // The same bytes as a whole unit's gather but for the head's gathers of the tied matrix
  // (16-bit weights, a forward and a backward per micro-batch).
  const double tied = static_cast<double>(plan->model.vocab) * m.hidden;
  EXPECT_DOUBLE_EQ(dp_gathered_bytes(*per_tensor, tensor_lane),
                   dp_gathered_bytes(*per_unit, unit_lane) + mb * 2 * 2 * tied);

  // Persistent: a layer gathers its four matrices, the embedding its two tables, the head the
  // tied matrix; every gradient is still reduced. The 13 h of a layer's biases and norms and the
  // head norm's 2 h are held whole (16 bits) instead.
  const Lane& persistent_lane = persistent->lanes[0];
  const int gathered = 2 + 4 * m.layers + 1;
  EXPECT_EQ(dp_launches(*persistent, persistent_lane, kAG), 2 * gathered * mb);
  EXPECT_EQ(dp_launches(*persistent, persistent_lane, kRS), (tensors - 1) * mb);
  const double small = (13.0 * m.layers + 2) * m.hidden;
  EXPECT_DOUBLE_EQ(dp_gathered_bytes(*persistent, persistent_lane),
                   dp_gathered_bytes(*per_tensor, tensor_lane) - mb * 2 * 2 * small);
  EXPECT_DOUBLE_EQ(persistent_lane.memory.weights, tensor_lane.memory.weights + 2 * small);
  // After the step their updated chunks come back in one all-gather (DeepSpeed's), 16-bit.
  std::vector<double> epilogue_gathers;
  for (const Step& s : persistent_lane.epilogue) {
    if (s.kind == StepKind::kDpLaunch && s.collective == kAG) epilogue_gathers.push_back(s.bytes);
  }
  ASSERT_EQ(epilogue_gathers.size(), 1u);
  EXPECT_DOUBLE_EQ(epilogue_gathers[0], 2 * small);
  for (const Step& s : tensor_lane.epilogue) {
    EXPECT_FALSE(s.kind == StepKind::kDpLaunch && s.collective == kAG);
  }

  // DeepSpeed's reduce bucket: whole tensors' gradients wait until the next would overflow 5e8
  // elements (and the backward ends), then go in one reduce-scatter: the same bytes in a few
  // calls a micro-batch, at least ceil(P / 5e8), at most one more than the buckets' count when
  // each is short by the largest tensor (the word table).
  const Lane& bucketed_lane = bucketed->lanes[0];
  EXPECT_DOUBLE_EQ(dp_bytes(*bucketed, bucketed_lane, kRS),
                   dp_bytes(*persistent, persistent_lane, kRS));
  const double P = bucketed_lane.parameters;
  const double largest = static_cast<double>(plan->model.vocab) * m.hidden;
  const int calls = dp_launches(*bucketed, bucketed_lane, kRS);
  EXPECT_GE(calls, std::ceil(P / 5e8) * mb);
  EXPECT_LE(calls, (std::floor(P / (5e8 - largest)) + 1) * mb);
}

// DeepSpeed's prefetch (stage3_prefetch_bucket_size): each operator waits for its own tensors'
// gathers, launched by then together with those after them up to 5e7 elements ahead; the same
// gathers as a whole unit fetched ahead, waited for operator by operator.
TEST(Program, DeepSpeedPrefetchesTensorsAheadOfEachOperator) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = deepspeed_zero3(RecomputeMode::kNone);
  auto plan = build_megatron_plan(m, dgx(), o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_DOUBLE_EQ(plan->comm.zero3_prefetch_elements, 5e7);
  auto prefetched = compile_plan(*plan, dgx());
  ASSERT_TRUE(prefetched.ok()) << prefetched.error().message();
  plan->comm.zero3_prefetch_elements = 1e12;  // everything in flight from the first operator
  auto everything = compile_plan(*plan, dgx());
  ASSERT_TRUE(everything.ok()) << everything.error().message();
  plan->comm.zero3_prefetch_elements = 0;
  auto per_unit = compile_plan(*plan, dgx());
  ASSERT_TRUE(per_unit.ok()) << per_unit.error().message();

  const Lane& lane = prefetched->lanes[0];
  EXPECT_EQ(dp_launches(*prefetched, lane, kAG), dp_launches(*per_unit, per_unit->lanes[0], kAG));
  EXPECT_DOUBLE_EQ(dp_gathered_bytes(*prefetched, lane),
                   dp_gathered_bytes(*per_unit, per_unit->lanes[0]));
  // Every GEMM (the layers' four linears, the head's projection: all sharded) waits for a
  // gather after the previous GEMM; a wait is for a gather already launched; a block ends with
  // all it launched waited for.
  for (const BlockTemplate& t : prefetched->templates) {
    std::set<int> launched;
    int last_waited = -1;
    bool waited = false;
    for (const Step& s : t.steps) {
      if (s.kind == StepKind::kDpLaunch && s.collective == kAG) launched.insert(s.tag);
      if (s.kind == StepKind::kDpWait && launched.count(s.tag)) {
        waited = true;
        last_waited = std::max(last_waited, s.tag);
      }
      if (s.kind == StepKind::kDpWait && s.tag >= 100000000) {
        EXPECT_TRUE(launched.count(s.tag)) << "waits for gather " << s.tag << " not launched";
      }
      if (s.kind == StepKind::kCompute && s.matmul) {
        EXPECT_TRUE(waited) << prefetched->labels[s.label] << " runs without its gather";
        waited = false;
      }
    }
    if (!launched.empty()) {
      EXPECT_EQ(last_waited, *launched.rbegin());
    }
  }

  // The working set: the most elements gathered at once, 16-bit, plus one tensor's unsharded
  // gradient and the reduce bucket. At 5e7 elements ahead: the embedding's two tables and the
  // first layer's four matrices (12 h^2 >= 5e7) in the forward; the head's matrix and the last
  // layer's in the backward, fewer. With everything ahead: every sharded tensor, the tied matrix
  // twice (the head gathers it again).
  const double V = m.vocab, h = m.hidden, s = m.seq_len, L = m.layers;
  const double reduce_bytes =
      plan->comm.grad_reduce_bytes > 0 ? plan->comm.grad_reduce_bytes : plan->optimizer.grad_bytes;
  const double fixed =
      V * h * plan->optimizer.grad_bytes + std::min(5e8, lane.parameters) * reduce_bytes;
  EXPECT_DOUBLE_EQ(lane.memory.gathered, (V * h + s * h + 12 * h * h) * 2 + fixed);
  EXPECT_DOUBLE_EQ(everything->lanes[0].memory.gathered,
                   (2 * V * h + s * h + L * 12 * h * h) * 2 + fixed);
}

// Tensor-grained prefetch under every pipeline schedule and recomputation: each block launches
// the gathers the whole-unit prefetch does (the same calls and bytes over the iteration), and
// waits only for gathers it launched, the last of them included. Under selective recomputation
// the recomputed operators (attention's core) hold no weights, so nothing is gathered again for
// them, as DeepSpeed's hooks fetch nothing for a module without parameters: the gathers of the
// plan without recomputation (the whole-unit prefetch gathers the recomputed layer again).
TEST(Program, DeepSpeedPrefetchGathersWhatUnitsGatherUnderEverySchedule) {
  const ModelSpec m = preset("gpt3-1.3b");
  auto compile = [&](ScheduleKind schedule, int vpp, RecomputeMode rc, double prefetch) {
    MegatronOptions o = deepspeed_zero3(rc);
    o.pp = 2;
    o.global_batch = 32;
    o.schedule = schedule;
    o.vpp = vpp;
    auto plan = build_megatron_plan(m, dgx(), o);
    EXPECT_TRUE(plan.ok()) << plan.error().message();
    plan->comm.zero3_persistence_threshold = 0;
    plan->comm.zero3_prefetch_elements = prefetch;
    auto prog = compile_plan(*plan, dgx());
    EXPECT_TRUE(prog.ok()) << prog.error().message();
    return *prog;
  };
  for (auto [schedule, vpp] :
       {std::pair{ScheduleKind::kOneFOneB, 1}, std::pair{ScheduleKind::kInterleaved, 2},
        std::pair{ScheduleKind::kZbH1, 1}, std::pair{ScheduleKind::kZbV, 2}}) {
    for (RecomputeMode rc :
         {RecomputeMode::kNone, RecomputeMode::kSelective, RecomputeMode::kFull}) {
      const std::string what =
          fmt::format("schedule {} recompute {}", static_cast<int>(schedule), to_string(rc));
      const Program tensors = compile(schedule, vpp, rc, 5e7);
      const Program units =
          compile(schedule, vpp, rc == RecomputeMode::kSelective ? RecomputeMode::kNone : rc, 0);
      ASSERT_EQ(tensors.lanes.size(), units.lanes.size()) << what;
      for (size_t l = 0; l < units.lanes.size(); ++l) {
        EXPECT_EQ(dp_launches(tensors, tensors.lanes[l], kAG),
                  dp_launches(units, units.lanes[l], kAG))
            << what << ", lane " << l;
        EXPECT_DOUBLE_EQ(dp_gathered_bytes(tensors, tensors.lanes[l]),
                         dp_gathered_bytes(units, units.lanes[l]))
            << what << ", lane " << l;
      }
      for (const BlockTemplate& t : tensors.templates) {
        std::set<int> launched, waited;
        for (const Step& s : t.steps) {
          if (s.kind == StepKind::kDpLaunch && s.collective == kAG) launched.insert(s.tag);
          if (s.kind == StepKind::kDpWait && s.tag >= 100000000) {
            EXPECT_TRUE(launched.count(s.tag)) << what << ": a wait for an unlaunched gather";
            waited.insert(s.tag);
          }
        }
        if (!launched.empty()) {
          EXPECT_TRUE(waited.count(*launched.rbegin())) << what << ": the last gather not waited";
        }
      }
    }
  }
}

// Tied embeddings with the embedding and the head in one segment: the head's projection is the
// embedding's matrix, one parameter of V h. Its gradient (the sum of both uses, which autograd
// accumulates before any hook sees it) is reduced once; ZeRO-3 gathers it with the embedding's
// unit under FSDP (the unit holding both, once per pass) and again for the head under DeepSpeed
// (its hooks fetch a module's parameters at the module's forward and backward).
TEST(Program, ATiedHeadInTheEmbeddingsSegmentIsOneParameter) {
  const ModelSpec m = preset("gpt3-1.3b");
  ASSERT_TRUE(m.tied_embeddings);
  const double V = m.vocab, h = m.hidden, s = m.seq_len, L = m.layers;
  // The model's parameters by hand: the word and position tables, L layers of two LayerNorms
  // (2 h each) and qkv, proj, fc1, fc2 with biases, the final LayerNorm; the head's matrix is
  // the word table.
  const double f = m.ffn_hidden;
  const double P =
      V * h + s * h + L * (4 * h + 3 * h * h + 3 * h + h * h + h + 2 * h * f + f + h) + 2 * h;
  for (const char* framework : {"fsdp", "deepspeed", "megatron"}) {
    SCOPED_TRACE(framework);
    MegatronOptions o = options(1, 1, false, RecomputeMode::kNone, 1);
    o.framework = framework;
    o.zero = std::string(framework) == "megatron" ? 0 : 3;
    auto plan = build_megatron_plan(m, dgx(), o);
    ASSERT_TRUE(plan.ok()) << plan.error().message();
    plan->comm.zero3_persistence_threshold = 0;  // every tensor gathered: the counts below
    auto prog = compile_plan(*plan, dgx());
    ASSERT_TRUE(prog.ok()) << prog.error().message();
    const Lane& lane = prog->lanes[0];
    EXPECT_DOUBLE_EQ(lane.parameters, P);
    const double mb = prog->micro_batches;
    const double grad = plan->comm.grad_reduce_bytes > 0 ? plan->comm.grad_reduce_bytes
                                                         : plan->optimizer.grad_bytes;
    if (o.zero == 0) {
      // One all-reduce of every gradient per iteration, and the loss's (one fp32 scalar).
      EXPECT_DOUBLE_EQ(dp_bytes(*prog, lane, kAR), grad * P + 4);
      continue;
    }
    // ZeRO-3: every micro-batch reduce-scatters each gradient once, and gathers the 16-bit
    // weights for its forward and its backward.
    EXPECT_DOUBLE_EQ(dp_bytes(*prog, lane, kRS), mb * grad * P);
    const double gathered = std::string(framework) == "deepspeed" ? P + V * h : P;
    EXPECT_DOUBLE_EQ(dp_bytes(*prog, lane, kAG), mb * 2 * 2 * gathered);
  }
}

// Data-parallel bytes of one collective kind over a lane's iteration: prologue, blocks, epilogue.
double lane_dp_bytes(const Program& prog, const Lane& lane, CollectiveKind kind) {
  double bytes = 0;
  for (const Step& s : lane.prologue) {
    if (s.kind == StepKind::kDpLaunch && s.collective == kind) bytes += s.bytes;
  }
  return bytes + dp_bytes(prog, lane, kind);
}

// Tied embeddings on a V-shaped placement (ZB-V): the first device holds the embedding's segment
// and the head's, so the head projects with the embedding's matrix, one parameter (no copy, no
// tied sync). Its gradient is reduced once, with the embedding's unit; ZeRO-1/2 gather it once
// after the step; ZeRO-3 gathers it again for the head's unit (a block of its own).
TEST(Program, ATiedHeadOnTheEmbeddingsDevicesInAVIsOneParameter) {
  const ModelSpec m = preset("gpt3-1.3b");
  ASSERT_TRUE(m.tied_embeddings);
  const double tied = static_cast<double>(m.vocab) * m.hidden;
  for (auto [zero, framework] :
       {std::pair{0, "megatron"}, std::pair{1, "megatron"}, std::pair{2, "megatron"},
        std::pair{3, "fsdp"}, std::pair{3, "deepspeed"}}) {
    SCOPED_TRACE(fmt::format("zero {} {}", zero, framework));
    MegatronOptions o = options(1, 2, false, RecomputeMode::kNone, 1);
    o.vpp = 2;
    o.schedule = ScheduleKind::kZbV;
    o.global_batch = 64;  // 16 replicas of 4 micro-batches
    o.zero = zero;
    o.framework = framework;
    auto plan = build_megatron_plan(m, dgx(), o);
    ASSERT_TRUE(plan.ok()) << plan.error().message();
    plan->comm.zero3_persistence_threshold = 0;    // every tensor gathered: the bytes below
    ASSERT_EQ(plan->precision, Precision::kBf16);  // 2-byte compute weights
    auto prog = compile_plan(*plan, dgx());
    ASSERT_TRUE(prog.ok()) << prog.error().message();
    ASSERT_EQ(prog->lanes.size(), 2u);
    EXPECT_TRUE(prog->explicit_groups.empty()) << "a tied sync with itself";
    double total = 0;
    for (const Lane& lane : prog->lanes) total += lane.parameters;
    EXPECT_EQ(total, static_cast<double>(m.parameters()));
    // The lane holding the embedding's and the head's segments.
    int emb = -1;
    for (size_t i = 0; i < plan->segments.size(); ++i) {
      if (plan->segments[i].embedding) emb = static_cast<int>(i);
    }
    const Lane* v = nullptr;
    for (const Lane& lane : prog->lanes) {
      for (const BlockInstance& b : lane.blocks) {
        if (b.block.segment == emb) v = &lane;
      }
    }
    ASSERT_NE(v, nullptr);
    const double P = v->parameters, mb = prog->micro_batches, w = 2;
    const double grad = plan->comm.grad_reduce_bytes > 0 ? plan->comm.grad_reduce_bytes
                                                         : plan->optimizer.grad_bytes;
    const bool kept = plan->optimizer.keep_gathered;
    switch (zero) {
      case 0:  // every gradient all-reduced once, and the loss (one fp32 scalar)
        EXPECT_DOUBLE_EQ(lane_dp_bytes(*prog, *v, kAR), grad * P + 4);
        break;
      case 1:
      case 2:
        EXPECT_DOUBLE_EQ(lane_dp_bytes(*prog, *v, kRS), (zero == 2 ? mb : 1) * grad * P);
        EXPECT_DOUBLE_EQ(lane_dp_bytes(*prog, *v, kAG), w * P);
        break;
      default:
        // Reduced every micro-batch (FSDP kept gathered: once); gathered for every F, BI and BW
        // block (kept: once), the head's unit with the matrix again.
        EXPECT_DOUBLE_EQ(lane_dp_bytes(*prog, *v, kRS), (kept ? 1 : mb) * grad * P);
        EXPECT_DOUBLE_EQ(lane_dp_bytes(*prog, *v, kAG), (kept ? 1 : 3 * mb) * w * (P + tied));
    }
  }
}

// The distributed optimizer shards over dp x cp: with one replica and context parallelism the
// state is still sharded over the cp ranks, so each reduce-scatters its gradients and gathers
// the parameters the others updated, along cp.
TEST(Program, ZeroShardsOverContextParallelRanksWithOneReplica) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = options(8, 1, true, RecomputeMode::kNone, 1);
  o.cp = 4;  // 32 GPUs: tp 8 x cp 4, dp 1
  o.zero = 1;
  o.global_batch = 4;
  const Program prog = compile(m, o);
  ASSERT_EQ(prog.lanes.size(), 1u);
  ASSERT_EQ(prog.replicas, 1);
  const Lane& lane = prog.lanes[0];
  const double P = lane.parameters;
  EXPECT_DOUBLE_EQ(lane.memory.optimizer, 12 * P / 4);
  EXPECT_DOUBLE_EQ(lane_dp_bytes(prog, lane, kRS), prog.plan.optimizer.grad_bytes * P);
  EXPECT_DOUBLE_EQ(lane_dp_bytes(prog, lane, kAG), 2 * P);  // 16-bit weights
}

// ZeRO-3 reduce-scatters each unit's gradients in the backward also when overlap_grad_reduce is
// off (that setting moves only ZeRO 0-2's buckets after the backward): never unreduced.
TEST(Program, ZeroThreeReducesInTheBackwardWithoutOverlap) {
  const ModelSpec m = preset("gpt3-1.3b");
  MegatronOptions o = options(1, 1, false, RecomputeMode::kNone, 1);
  o.zero = 3;
  auto plan = build_megatron_plan(m, dgx(), o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  auto overlapped = compile_plan(*plan, dgx());
  ASSERT_TRUE(overlapped.ok()) << overlapped.error().message();
  plan->comm.overlap_grad_reduce = false;
  auto after = compile_plan(*plan, dgx());
  ASSERT_TRUE(after.ok()) << after.error().message();
  const int units = m.layers + 2;  // the embedding, each layer, the head
  const int mb = after->micro_batches;
  EXPECT_EQ(dp_launches(*overlapped, overlapped->lanes[0], kRS), units * mb);
  EXPECT_EQ(dp_launches(*after, after->lanes[0], kRS), units * mb);
  for (const Step& s : after->lanes[0].epilogue) {
    EXPECT_FALSE(s.kind == StepKind::kDpLaunch && s.collective == kRS) << "reduced twice";
  }
}

// ZeRO-3 gathers the weights the forward reads: 2 bytes a parameter in 16-bit and fp8 training,
// 4 in fp32.
TEST(Program, ZeroThreeGathersTheComputeWeights) {
  const ModelSpec m = preset("gpt3-1.3b");
  for (Precision p : {Precision::kBf16, Precision::kFp8, Precision::kFp32}) {
    MegatronOptions o = options(1, 1, false, RecomputeMode::kNone, 1);
    o.zero = 3;
    o.framework = "fsdp";
    o.precision = p;
    auto plan = build_megatron_plan(m, dgx(), o);
    ASSERT_TRUE(plan.ok()) << plan.error().message();
    auto prog = compile_plan(*plan, dgx());
    ASSERT_TRUE(prog.ok()) << prog.error().message();
    const double P = prog->lanes[0].parameters;  // the tied head's matrix is the embedding's
    const double w = p == Precision::kFp32 ? 4 : 2;
    EXPECT_DOUBLE_EQ(dp_gathered_bytes(*prog, prog->lanes[0]), prog->micro_batches * 2 * w * P)
        << to_string(p);
  }
}

// Collective bytes of one layer under tensor parallelism: each all-reduce carries the whole
// [b, s, h] activation; with sequence parallelism each all-gather outputs and each
// reduce-scatter takes the whole activation.
TEST(Program, TensorParallelCollectiveBytes) {
  const ModelSpec m = korthikanti("gpt3-1.3b");
  const double act = 2.0 * m.seq_len * m.hidden * 2;  // b = 2, bf16
  for (bool sp : {false, true}) {
    Program prog = compile(m, options(8, 1, sp, RecomputeMode::kNone, 2));
    std::set<std::string> layer_ops;
    for (const auto& op : prog.graph.blocks[0].ops) layer_ops.insert(op.name);
    int seen = 0;
    for (const BlockTemplate& t : prog.templates) {
      for (const Step& s : t.steps) {
        if (s.kind != StepKind::kCollective || !layer_ops.count(prog.labels[s.label])) continue;
        EXPECT_DOUBLE_EQ(s.bytes, act) << prog.labels[s.label] << " " << to_string(s.collective);
        ++seen;
      }
    }
    EXPECT_GT(seen, 0);
  }
}

// A model whose embedding ends in the vocab-parallel lookup (no learned positions, no
// dropout): with sequence parallelism its partial sums are reduce-scattered into the first
// layer's sequence split, and the backward must all-gather the first layer's input gradient
// (Megatron: reduce_scatter_to_sequence_parallel_region, whose backward is an all-gather) so that
// the embedding gets the whole gradient.
TEST(Program, SequenceParallelEmbeddingGradientIsGathered) {
  const ModelSpec m = preset("llama2-7b");  // 32 layers, RoPE, no dropout
  const int n = m.layers;
  Program prog = compile(m, options(8, 1, true, RecomputeMode::kNone, 1));
  EXPECT_EQ(layer_collectives(prog, 0, BlockKind::kForward),
            (Counts{{kAG, 2 * n}, {kRS, 2 * n + 1}}));
  const Counts backward = layer_collectives(prog, 0, BlockKind::kBackward);
  EXPECT_EQ(backward, (Counts{{kAG, 4 * n + 1}, {kRS, 2 * n}}));
}

// Collectives labelled with an operator of the embedding, in forward templates of segment 0.
std::map<std::string, Counts> embedding_forward_collectives(const Program& prog) {
  std::set<std::string> ops;
  for (const auto& op : prog.graph.embedding.ops) ops.insert(op.name);
  std::map<std::string, Counts> out;
  for (const BlockTemplate& t : prog.templates) {
    if (t.segment != 0 || t.kind != BlockKind::kForward) continue;
    for (const Step& s : t.steps) {
      if (s.kind == StepKind::kCollective && ops.count(prog.labels[s.label])) {
        ++out[prog.labels[s.label]][s.collective];
      }
    }
    break;
  }
  return out;
}

// The word embedding reads token ids, which every rank has: its input needs no collective.
// The vocab-parallel lookup yields partial sums, which its consumer converts: the learned
// position add (GPT: all-reduce, or reduce-scatter into the sequence split), or the first
// layer's norm (Llama: labelled attn.norm, counted with the layer's collectives).
TEST(Program, EmbeddingLookupNeedsNoInputCollective) {
  struct Case {
    const char* model;
    bool sp;
    std::map<std::string, Counts> embedding;  // expected
    int layer_ar, layer_ag, layer_rs;         // expected forward layer collectives, n layers
  };
  const ModelSpec gpt = korthikanti("gpt3-1.3b");
  const ModelSpec llama = preset("llama2-7b");
  const int g = gpt.layers, l = llama.layers;
  const Case cases[] = {
      {"gpt3-1.3b", false, {{"embed.position", {{kAR, 1}}}}, 2 * g, 0, 0},
      {"gpt3-1.3b", true, {{"embed.position", {{kRS, 1}}}}, 0, 2 * g, 2 * g},
      {"llama2-7b", false, {}, 2 * l + 1, 0, 0},
      {"llama2-7b", true, {}, 0, 2 * l, 2 * l + 1},
  };
  for (const Case& c : cases) {
    const ModelSpec& m = std::string(c.model) == "gpt3-1.3b" ? gpt : llama;
    Program prog = compile(m, options(8, 1, c.sp, RecomputeMode::kNone, 1));
    Counts layer;
    if (c.layer_ar) layer[kAR] = c.layer_ar;
    if (c.layer_ag) layer[kAG] = c.layer_ag;
    if (c.layer_rs) layer[kRS] = c.layer_rs;
    EXPECT_EQ(layer_collectives(prog, 0, BlockKind::kForward), layer) << c.model << " sp=" << c.sp;
    auto got = embedding_forward_collectives(prog);
    EXPECT_EQ(got, c.embedding) << c.model << " sp=" << c.sp;
  }
}

// The all-reduces of the lane's epilogue labelled `label`, bytes by axes.
std::map<uint32_t, double> epilogue_all_reduces(const Program& prog, const Lane& lane,
                                                const std::string& label) {
  std::map<uint32_t, double> out;
  for (const Step& s : lane.epilogue) {
    if ((s.kind == StepKind::kCollective || s.kind == StepKind::kDpLaunch) &&
        s.collective == CollectiveKind::kAllReduce && prog.labels[s.label] == label) {
      out[s.axes] += s.bytes;
    }
  }
  return out;
}

// Megatron's sequence parallelism applies the norms, the row-parallel linears' biases (added
// after the reduce-scatter, to the rank's slice of the sequence) and the learned position table
// to slices of the sequence, so their gradients are partial sums over tp, all-reduced after the
// backward (finalize_model_grads). The column-parallel biases are split, not summed; without
// sequence parallelism nothing is summed; with ZeRO each rank sums its shard only.
TEST(Program, SequenceParallelGradientSumsCoverNormsAndRowParallelBiases) {
  const ModelSpec gpt = preset("gpt3-1.3b");    // LayerNorm, biases, learned positions
  const ModelSpec llama = preset("llama2-7b");  // RMSNorm, no biases, RoPE
  for (const ModelSpec* m : {&gpt, &llama}) {
    const double h = m->hidden, l = m->layers, s = m->seq_len;
    const double params = m->bias ? l * (4 * h + 2 * h) + s * h + 2 * h : l * 2 * h + h;
    for (int zero : {0, 1}) {
      for (bool sp : {false, true}) {
        MegatronOptions o = options(8, 1, sp, RecomputeMode::kNone, 1);
        o.zero = zero;
        Program prog = compile(*m, o);
        ASSERT_EQ(prog.replicas, 4);
        const uint32_t tp = 1u << prog.plan.mesh.axis_index("tp");
        const double grad_bytes = prog.plan.comm.grad_reduce_bytes > 0
                                      ? prog.plan.comm.grad_reduce_bytes
                                      : prog.plan.optimizer.grad_bytes;
        const auto got = epilogue_all_reduces(prog, prog.lanes[0], "norm grad sync");
        if (!sp) {
          EXPECT_TRUE(got.empty()) << m->name << " zero " << zero;
          continue;
        }
        const double want = params * grad_bytes / (zero >= 1 ? 4 : 1);
        EXPECT_EQ(got, (std::map<uint32_t, double>{{tp, want}})) << m->name << " zero " << zero;
      }
    }
  }
}

// Per-head query and key norms split along the heads with the projection: each tensor-parallel
// rank's gradient of their shared scales is a partial sum, summed over tp with and without
// sequence parallelism.
TEST(Program, QueryAndKeyNormScalesAreSummedOverTensorParallelRanks) {
  ModelSpec m = preset("llama2-7b");  // RMSNorm, no biases
  m.qk_norm = true;
  const double h = m.hidden, l = m.layers, d = m.head_dim();
  for (bool sp : {false, true}) {
    Program prog = compile(m, options(8, 1, sp, RecomputeMode::kNone, 1));
    const uint32_t tp = 1u << prog.plan.mesh.axis_index("tp");
    const double grad_bytes = prog.plan.comm.grad_reduce_bytes > 0
                                  ? prog.plan.comm.grad_reduce_bytes
                                  : prog.plan.optimizer.grad_bytes;
    // The two d-wide scales of every layer, and with sequence parallelism the norms of width h.
    const double params = l * 2 * d + (sp ? l * 2 * h + h : 0);
    EXPECT_EQ(epilogue_all_reduces(prog, prog.lanes[0], "norm grad sync"),
              (std::map<uint32_t, double>{{tp, params * grad_bytes}}))
        << "sp " << sp;
  }
}

// The head's ranks sum the loss over the replicas every iteration (one fp32 scalar); without
// replicas, or on a stage without the head, there is nothing to sum.
TEST(Program, TheLossIsSummedOverTheReplicasOnTheHeadsStage) {
  const ModelSpec m = preset("gpt3-1.3b");
  for (int pp : {4, 2}) {
    const int dp = 32 / (8 * pp);
    Program prog = compile(m, options(8, pp, false, RecomputeMode::kNone, 1));
    ASSERT_EQ(prog.replicas, dp);
    const uint32_t dp_axis = 1u << prog.plan.mesh.axis_index("dp");
    int head_segment = -1;
    for (size_t s = 0; s < prog.plan.segments.size(); ++s) {
      if (prog.plan.segments[s].head) head_segment = static_cast<int>(s);
    }
    ASSERT_GE(head_segment, 0);
    const std::vector<int>& head_lanes = prog.lanes_of_segment[head_segment];
    for (size_t l = 0; l < prog.lanes.size(); ++l) {
      const Lane& lane = prog.lanes[l];
      const bool head = std::count(head_lanes.begin(), head_lanes.end(), static_cast<int>(l)) > 0;
      const auto got = epilogue_all_reduces(prog, lane, "loss");
      if (dp == 1 || !head) {
        EXPECT_TRUE(got.empty()) << "lane " << l << " dp " << dp;
      } else {
        EXPECT_EQ(got, (std::map<uint32_t, double>{{dp_axis, 4.0}})) << "lane " << l;
      }
    }
  }
}

// Context parallelism: every weight's gradient is a partial sum over cp, reduced together with
// dp (Megatron's combined data-parallel + context-parallel group), in the overlapped buckets.
TEST(Program, ContextParallelGradientsGoInTheBuckets) {
  for (const char* name : {"llama2-7b", "gpt3-1.3b"}) {
    const ModelSpec m = preset(name);
    MegatronOptions o = options(4, 1, false, RecomputeMode::kNone, 1);
    o.cp = 2;
    o.global_batch = 8;  // dp 4
    Program prog = compile(m, o);
    const uint32_t dp_cp =
        (1u << prog.plan.mesh.axis_index("dp")) | (1u << prog.plan.mesh.axis_index("cp"));
    int launches = 0;
    bool dp_only = false;
    for (const BlockTemplate& t : prog.templates) {
      for (const Step& s : t.steps) {
        if (s.kind != StepKind::kDpLaunch) continue;
        ++launches;
        dp_only = dp_only || s.axes != dp_cp;
      }
    }
    EXPECT_GT(launches, 0) << name;
    double cp_epilogue = 0;
    for (const Step& s : prog.lanes[0].epilogue) {
      if (s.kind == StepKind::kCollective && s.axes == (1u << prog.plan.mesh.axis_index("cp"))) {
        cp_epilogue += s.bytes;
      }
    }
    EXPECT_FALSE(dp_only) << name << ": a gradient bucket does not reduce over dp+cp";
    EXPECT_EQ(cp_epilogue, 0) << name;
  }
}

// A partition or recompute rule that matches no operator (a typo, a rule for another model)
// is an error naming the rule and the model's operators; the builder emits only rules that
// match (no embed.position rule for a rotary model, no embed.dropout without dropout).
TEST(Program, RulesThatMatchNoOperatorAreErrors) {
  MegatronOptions o = options(2, 1, true, RecomputeMode::kNone);
  const ModelSpec rope = preset("llama3-8b");  // rotary positions, no dropout
  auto plan = build_megatron_plan(rope, dgx(), o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  for (const auto& rule : plan->partition) {
    EXPECT_NE(rule.match, "embed.position");
    EXPECT_NE(rule.match, "embed.dropout");
  }
  ASSERT_TRUE(compile_plan(*plan, dgx()).ok());

  Plan typo = *plan;
  typo.partition[1].match = "attn.qvk";
  auto e = compile_plan(typo, dgx());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message().find("partition[1]: match 'attn.qvk' matches no operator"),
            std::string::npos)
      << e.error().message();
  EXPECT_NE(e.error().message().find("attn.qkv"), std::string::npos);  // the operators listed

  Plan recompute = *plan;
  recompute.recompute.push_back({"mlp.gelu", 0, -1});
  e = compile_plan(recompute, dgx());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message().find("recompute[0]: match 'mlp.gelu'"), std::string::npos)
      << e.error().message();
}

}  // namespace
}  // namespace nnsim
