// nnsim validate: the validation-set reader, its errors, and the accuracy regression bound on
// shared/validation/dev.yaml (fails when accuracy drops).
#include "validate/validate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/topology_writer.h"
#include "validate/case_builder.h"

namespace nnsim {
namespace {

const std::string kDevSet = std::string(NNSIM_SHARED_DIR) + "/validation/dev.yaml";

const char* kOneCase = R"(schema: nnsim-validation/1
cases:
- id: tiny
  source: a test
  model: {family: gpt, layers: 4, hidden: 1024, heads: 16, kv_heads: 16, ffn_hidden: 4096,
          mlp: gelu, vocab: 50257, seq_len: 1024, tied_embeddings: true, position: learned}
  cluster: {gpu: a100-sxm4-80gb, nodes: 1, gpus_per_node: 8, nic_gbps: 200, nics_per_node: 8}
  parallel: {tp: 2, pp: 2, dp: 2, cp: 1, ep: 1, vp: 1, micro_batch: 1, global_batch: 8,
             recompute: none, sequence_parallel: true, zero: 1, precision: bf16,
             framework: megatron}
  measured: {iteration_time_s: 0.1, peak_memory_gib: 10}
  assumed: [parallel.vp]
)";

TEST(ValidationSet, ReadsTheSchema) {
  auto set = parse_validation_set(kOneCase, "one.yaml");
  ASSERT_TRUE(set.ok()) << set.error().message();
  ASSERT_EQ(set->size(), 1u);
  const ValidationCase& c = set->front();
  EXPECT_EQ(c.gpus(), 8);
  EXPECT_DOUBLE_EQ(c.cluster.nic_bandwidth, 25e9);
  EXPECT_FALSE(c.parallel_stated());
  EXPECT_EQ(*c.measured.peak_memory_gib, 10);
}

// Summaries group cases by the source's name: its line up to the first comma outside
// parentheses, so "(SC'21, arXiv:...)" stays whole.
TEST(ValidationSet, SourceNameEndsAtTheFirstCommaOutsideParentheses) {
  ValidationCase c;
  c.source = "Narayanan et al. 2021 (SC'21, arXiv:2104.04473), Table 2 (PTD-P, ZeRO-3)";
  EXPECT_EQ(c.source_name(), "Narayanan et al. 2021 (SC'21, arXiv:2104.04473)");
  c.source = "torchtitan benchmarks, llama3_h100_202412_torchtitan.md, Table 2";
  EXPECT_EQ(c.source_name(), "torchtitan benchmarks");
  c.source = "a test";
  EXPECT_EQ(c.source_name(), "a test");
}

TEST(ValidationSet, BadInputNamesTheFieldAndTheFix) {
  std::string bad = kOneCase;
  bad.replace(bad.find("schema: nnsim-validation/1"), 26, "schema: other/2");
  auto r = parse_validation_set(bad, "bad.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("bad.yaml:1: field 'schema'"), std::string::npos)
      << r.error().message();
  bad = kOneCase;
  bad.replace(bad.find("framework: megatron"), 19, "framework: megatronn");
  r = parse_validation_set(bad, "bad.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("did you mean 'megatron'"), std::string::npos)
      << r.error().message();
  // The schema's models are dense: nothing for expert parallelism to spread.
  bad = kOneCase;
  bad.replace(bad.find("tp: 2,"), 6, "tp: 2, ep: 2,");
  r = parse_validation_set(bad, "bad.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("parallel.ep': must be 1"), std::string::npos)
      << r.error().message();
}

// A measurement of zero or below would print an infinite error and poison the summary's
// statistics; a NIC of zero bandwidth would leave the cluster unconnected.
TEST(ValidationSet, MeasuredValuesAndLinkSpeedsMustBePositive) {
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"iteration_time_s: 0.1", "iteration_time_s: 0"},
      {"iteration_time_s: 0.1", "iteration_time_s: -2"},
      {"peak_memory_gib: 10", "peak_memory_gib: 0"},
      {"nic_gbps: 200", "nic_gbps: 0"},
      {"peak_memory_gib: 10", "peak_memory_gib: 10, mfu_pct: 140"},
  };
  for (const auto& [from, to] : edits) {
    std::string bad = kOneCase;
    bad.replace(bad.find(from), from.size(), to);
    auto r = parse_validation_set(bad, "bad.yaml");
    ASSERT_FALSE(r.ok()) << to;
    const std::string field = to.substr(0, to.rfind(':'));
    const std::string last = field.substr(field.rfind(' ') + 1);
    EXPECT_NE(r.error().message().find("bad.yaml:"), std::string::npos) << r.error().message();
    EXPECT_NE(r.error().message().find("." + last + "'"), std::string::npos) << r.error().message();
  }
}

// Degrees, sizes and batches are counts: a 0 (or a ZeRO stage past 3) is an error at its own
// field and line, not a failed case quoting the plan builder's option.
TEST(ValidationSet, CountsMustBeInRange) {
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"tp: 2,", "tp: 0,"},
      {"vp: 1,", "vp: 0,"},
      {"global_batch: 8", "global_batch: -8"},
      {"zero: 1", "zero: 4"},
      {"nodes: 1", "nodes: 0"},
      {"layers: 4", "layers: 0"},
      {"seq_len: 1024", "seq_len: 0"},
  };
  for (const auto& [from, to] : edits) {
    std::string bad = kOneCase;
    bad.replace(bad.find(from), from.size(), to);
    auto r = parse_validation_set(bad, "bad.yaml");
    ASSERT_FALSE(r.ok()) << to;
    const std::string field = to.substr(0, to.find(':'));
    const std::string& msg = r.error().message();
    EXPECT_NE(msg.find("bad.yaml:"), std::string::npos) << msg;
    EXPECT_NE(msg.find("." + field + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(field == "zero" ? "must be 0 to 3" : "must be at least"), std::string::npos)
        << msg;
  }
}

TEST(Validate, SimulatesACaseAndReportsItsError) {
  auto set = parse_validation_set(kOneCase, "one.yaml");
  ASSERT_TRUE(set.ok());
  ValidateOptions o;
  auto out = run_validation(*set, o);
  ASSERT_EQ(out.size(), 1u);
  ASSERT_TRUE(out[0].ok()) << out[0].status;
  EXPECT_GT(out[0].predicted_s, 0);
  EXPECT_NEAR(out[0].error_pct, 100 * (out[0].predicted_s - 0.1) / 0.1, 1e-9);
  ASSERT_TRUE(out[0].memory_error_pct.has_value());
  // The JSON's memory parts (bytes) add up to the predicted peak (GiB).
  const auto j = nlohmann::json::parse(validation_json(out, summarize(out)));
  const auto& mem = j["cases"][0]["memory"];
  double bytes = 0;
  for (const char* part : {"weights_bytes", "gradients_bytes", "optimizer_bytes",
                           "comm_buffers_bytes", "runtime_bytes", "peak_activations_bytes"}) {
    ASSERT_TRUE(mem.contains(part)) << part;
    EXPECT_GT(mem[part].get<double>(), 0) << part;
    bytes += mem[part].get<double>();
  }
  ASSERT_TRUE(mem.contains("gathered_bytes"));  // ZeRO-3's working set: none here
  EXPECT_EQ(mem["gathered_bytes"].get<double>(), 0);
  ASSERT_TRUE(mem.contains("pipeline_buffers_bytes"));  // no pipeline here
  EXPECT_EQ(mem["pipeline_buffers_bytes"].get<double>(), 0);
  EXPECT_NEAR(bytes / (1024.0 * 1024 * 1024),
              j["cases"][0]["predicted_peak_memory_gib"].get<double>(), 1e-9);
}

// The model the builder gives kOneCase with each `from` text replaced by its `to`.
ModelSpec case_model(const std::vector<std::pair<std::string, std::string>>& edits) {
  std::string text = kOneCase;
  for (const auto& [from, to] : edits) text.replace(text.find(from), from.size(), to);
  auto set = parse_validation_set(text, "one.yaml");
  EXPECT_TRUE(set.ok()) << set.error().message();
  if (!set.ok()) return {};
  auto topo = case_topology(set->front());
  EXPECT_TRUE(topo.ok()) << topo.error().message();
  if (!topo.ok()) return {};
  auto plan = case_plan(set->front(), *topo);
  EXPECT_TRUE(plan.ok()) << plan.error().message();
  return plan.ok() ? plan->model : ModelSpec{};
}

// The loss kernel is the training code's: PyTorch FSDP loops call F.cross_entropy (unfused;
// under loss_parallel() with tensor parallelism), llm-foundry's MPT calls flash-attn's kernel,
// Megatron runs its vocab-parallel cross-entropy step by step.
TEST(Validate, CaseLossKernelFollowsTheTrainingCode) {
  auto loss_of = [](const std::string& family, const std::string& framework, int tp) {
    return case_model(
               {{"family: gpt", "family: " + family},
                {"framework: megatron", "framework: " + framework},
                {"tp: 2, pp: 2, dp: 2", tp == 2 ? "tp: 2, pp: 2, dp: 2" : "tp: 1, pp: 2, dp: 4"}})
        .loss;
  };
  EXPECT_EQ(loss_of("gpt", "megatron", 2), LossKernel::kVocabParallel);
  EXPECT_EQ(loss_of("llama", "fsdp", 1), LossKernel::kUnfused);
  EXPECT_EQ(loss_of("llama", "fsdp", 2), LossKernel::kLossParallel);
  EXPECT_EQ(loss_of("mpt", "fsdp", 2), LossKernel::kFlashAttn);
}

// fp16 Megatron and DeepSpeed runs are GPT-3-era (2021-22): Megatron's fused scale-mask-softmax
// (scores materialized) with dropout; bf16 and fp8 runs use FlashAttention without dropout.
TEST(Validate, CaseAttentionFollowsTheTrainingCodesEra) {
  auto model_of = [](const std::string& precision, const std::string& framework) {
    return case_model({{"precision: bf16", "precision: " + precision},
                       {"framework: megatron", "framework: " + framework}});
  };
  const ModelSpec fp16 = model_of("fp16", "megatron");
  EXPECT_EQ(fp16.attention, AttentionKernel::kUnfused);
  EXPECT_TRUE(fp16.dropout);
  EXPECT_EQ(model_of("fp16", "deepspeed").attention, AttentionKernel::kUnfused);
  const ModelSpec bf16 = model_of("bf16", "megatron");
  EXPECT_EQ(bf16.attention, AttentionKernel::kFlash);
  EXPECT_FALSE(bf16.dropout);
  EXPECT_EQ(model_of("fp16", "fsdp").attention, AttentionKernel::kFlash);
}

// Megatron-style ALiBi (BLOOM's Megatron-DeepSpeed) adds the bias to materialized scores;
// llm-foundry's MPT runs ALiBi in its flash kernels.
TEST(Validate, CaseAttentionWithAlibiIsUnfusedUnderMegatron) {
  auto model_of = [](const std::string& framework) {
    return case_model({{"position: learned", "position: alibi"},
                       {"framework: megatron", "framework: " + framework}});
  };
  const ModelSpec megatron = model_of("megatron");
  EXPECT_EQ(megatron.position, PositionKind::kAlibi);
  EXPECT_EQ(megatron.attention, AttentionKernel::kUnfused);
  EXPECT_FALSE(megatron.dropout);
  EXPECT_EQ(model_of("fsdp").attention, AttentionKernel::kFlash);
}

// The schema's every framework, precision, ZeRO stage and recompute mode, on four layouts
// (3D, pure data parallel, tensor x context parallel, interleaved pipeline), with its MLPs,
// positions, tied or untied embeddings and GPUs cycled through: each combination simulates.
TEST(Validate, EveryCombinationOfTheSchemasValuesSimulates) {
  auto set = parse_validation_set(kOneCase, "one.yaml");
  ASSERT_TRUE(set.ok());
  const ValidationCase base = set->front();
  struct Layout {
    int tp, pp, dp, cp, vp;
  };
  const std::vector<Layout> layouts = {
      {2, 2, 2, 1, 1}, {1, 1, 8, 1, 1}, {2, 1, 2, 2, 1}, {1, 2, 4, 1, 2}};
  const std::vector<std::string> gpus = {"a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm5-80gb",
                                         "h100-sxm5-96gb"};
  std::vector<ValidationCase> cases;
  for (const char* framework : {"megatron", "fsdp", "deepspeed", "other"}) {
    for (Precision precision : {Precision::kBf16, Precision::kFp16, Precision::kFp8}) {
      for (int zero = 0; zero <= 3; ++zero) {
        for (const char* recompute : {"none", "selective", "full"}) {
          for (const Layout& l : layouts) {
            ValidationCase c = base;
            const int n = static_cast<int>(cases.size());
            c.id = "combination " + std::to_string(n);
            c.model.mlp = static_cast<MlpKind>(n % 4);
            c.model.position = static_cast<PositionKind>(n % 3);
            c.model.tied_embeddings = n % 2 == 0;
            c.cluster.gpu = gpus[(n / 3) % gpus.size()];
            ValidationParallel& p = c.parallel;
            p.tp = l.tp;
            p.pp = l.pp;
            p.dp = l.dp;
            p.cp = l.cp;
            p.vp = l.vp;
            p.global_batch = 4 * l.dp;
            p.recompute = recompute;
            p.sequence_parallel = l.tp > 1;
            p.zero = zero;
            p.precision = precision;
            p.framework = framework;
            cases.push_back(c);
          }
        }
      }
    }
  }
  ValidateOptions o;
  o.jobs = 2;
  const auto out = run_validation(cases, o);
  ASSERT_EQ(out.size(), 576u);
  for (const auto& r : out) {
    ASSERT_TRUE(r.ok()) << r.id << ": " << r.status;
    EXPECT_GT(r.predicted_s, 0) << r.id;
    EXPECT_TRUE(std::isfinite(r.predicted_s)) << r.id;
    ASSERT_TRUE(r.predicted_memory_gib.has_value()) << r.id;
    EXPECT_GT(*r.predicted_memory_gib, 0) << r.id;
  }
}

TEST(Validate, ACaseThatCannotBeSimulatedIsAFailureWithItsReason) {
  std::string bad = kOneCase;
  bad.replace(bad.find("tp: 2, pp: 2, dp: 2"), 19, "tp: 3, pp: 2, dp: 2");
  auto set = parse_validation_set(bad, "one.yaml");
  ASSERT_TRUE(set.ok());
  auto out = run_validation(*set, {});
  ASSERT_FALSE(out[0].ok());
  EXPECT_NE(out[0].status.find("tiny"), std::string::npos) << out[0].status;
  ValidationSummary s = summarize(out);
  EXPECT_EQ(s.failures, 1);
  EXPECT_EQ(s.time.count, 0);
}

TEST(Validate, SummaryGroupsErrorsBySource) {
  auto outcome = [](const std::string& source, double error_pct) {
    CaseOutcome o;
    o.id = source + std::to_string(error_pct);
    o.source = source;
    o.error_pct = error_pct;
    return o;
  };
  std::vector<CaseOutcome> out = {outcome("paper A", -2), outcome("paper B", 10),
                                  outcome("paper A", 4)};
  out.push_back(outcome("paper C", 0));
  out.back().status = "cannot build the plan";  // failures count in no source's errors
  ValidationSummary s = summarize(out);
  ASSERT_EQ(s.time_by_source.size(), 2u);
  EXPECT_EQ(s.time_by_source.at("paper A").count, 2);
  EXPECT_DOUBLE_EQ(s.time_by_source.at("paper A").mean, 3);
  EXPECT_DOUBLE_EQ(s.time_by_source.at("paper A").max, 4);
  EXPECT_DOUBLE_EQ(s.time_by_source.at("paper B").median, 10);
  const auto j = nlohmann::json::parse(validation_json(out, s));
  EXPECT_EQ(j["cases"][1]["source"], "paper B");
  const auto& by_source = j["summary"]["iteration_time_by_source"];
  ASSERT_TRUE(by_source.contains("paper A"));
  EXPECT_EQ(by_source["paper A"]["cases"], 2);
  EXPECT_FALSE(by_source.contains("paper C"));
}

TEST(Validate, ErrorStatisticsInterpolatePercentiles) {
  ErrorStats s = error_stats({4, 1, 3, 2, 10});
  EXPECT_DOUBLE_EQ(s.median, 3);
  EXPECT_DOUBLE_EQ(s.p90, 4 + 0.6 * 6);
  EXPECT_DOUBLE_EQ(s.max, 10);
  EXPECT_DOUBLE_EQ(s.mean, 4);
}

// The regression bound: the accuracy docs/VALIDATION.md reports, with a small margin. Tighten
// it when the model improves; it fails when a change makes predictions worse.
// --write-plans leaves every case's cluster as YAML: each dev-set cluster writes, reads back and
// writes again to the same text (the writer puts down every field, so the cluster is unchanged).
TEST(Validate, EveryDevSetClusterWritesAndReadsBack) {
  if (!std::filesystem::exists(kDevSet)) GTEST_SKIP() << "no " << kDevSet;
  auto set = load_validation_set(kDevSet);
  ASSERT_TRUE(set.ok()) << set.error().message();
  for (const ValidationCase& c : *set) {
    Expected<Topology> topo = case_topology(c);
    ASSERT_TRUE(topo.ok()) << c.id << ": " << topo.error().message();
    Expected<std::string> text = topology_to_yaml(*topo);
    ASSERT_TRUE(text.ok()) << c.id << ": " << text.error().message();
    Expected<Topology> again = parse_topology(*text, c.id + ".topology.yaml");
    ASSERT_TRUE(again.ok()) << c.id << ": " << again.error().message() << "\n" << *text;
    EXPECT_EQ(again->num_gpus(), c.gpus()) << c.id;
    Expected<std::string> twice = topology_to_yaml(*again);
    ASSERT_TRUE(twice.ok()) << c.id;
    EXPECT_EQ(*twice, *text) << c.id;
  }
}

TEST(Validate, DevSetAccuracyRegressionBound) {
  if (!std::filesystem::exists(kDevSet)) GTEST_SKIP() << "no " << kDevSet;
  auto set = load_validation_set(kDevSet);
  ASSERT_TRUE(set.ok()) << set.error().message();
  ValidateOptions o;
  o.jobs = 2;
  auto out = run_validation(*set, o);
  ValidationSummary s = summarize(out);
  for (const auto& c : out) EXPECT_TRUE(c.ok()) << c.id << ": " << c.status;
  EXPECT_EQ(s.failures, 0);
  // The medians sit among many cases a point or two apart (docs/VALIDATION.md's sweeps move them
  // by a point between neighbouring constants): their bounds keep that margin, the means are
  // the sharper guards.
  EXPECT_LE(s.time.median, 4.6);
  EXPECT_LE(s.time.p90, 17.0);
  EXPECT_LE(s.time.mean, 8.8);
  EXPECT_LE(s.time_stated.median, 4.0);
  EXPECT_LE(s.time_stated.p90, 11.0);
  EXPECT_LE(s.time_stated.mean, 3.8);
  // Memory: since the backward's parts free their activations one after another (the loss's
  // buffers before the last layer's recomputation: nnexec's CPU counts, run_memory_test.cc),
  // PyTorch's unfused loss holds its logits at its backward peak, loss_parallel() three fp32
  // temporaries and PyTorch's pipelining a buffer per micro-batch and every output, the
  // torchtitan runs' predictions sit 2-10 % under their reserved peaks (docs/VALIDATION.md);
  // the issue's bound is 10 %.
  EXPECT_LE(s.memory.median, 4.5);
  EXPECT_LE(s.memory.max, 10.0);
  // Korthikanti et al. 2022: the best public analytical model (Calculon) reaches 3.65 % mean and
  // 8.9 % worst absolute error on these runs; nnsim must stay below both.
  // Each source's mean too (docs/VALIDATION.md lists them), so that a change cannot trade one
  // source's accuracy for another's unnoticed.
  const std::vector<std::pair<std::string, double>> source_means = {
      {"MosaicML llm-foundry MPT benchmarks (README 2024-04-22)", 3.2},
      {"NVIDIA DGX Cloud Benchmarking recipes 24.11", 5.0},
      {"torchtitan benchmarks", 4.5},
      {"Megatron-LM README", 15.0},
      // SC'21's ZeRO-3 runs grew further too fast when the plans learnt what DeepSpeed does not
      // pay: gathers of persistent tensors and per-tensor gradient reductions (27.0 %).
      {"Narayanan et al. 2021 (SC'21, arXiv:2104.04473)", 28.0},
      {"BigScience BLOOM-176B training README (bigscience tr11-176B-ml)", 16.5}};
  for (const auto& [source, bound] : source_means) {
    ASSERT_EQ(s.time_by_source.count(source), 1u) << source;
    EXPECT_LE(s.time_by_source.at(source).mean, bound) << source;
  }
  const auto korthikanti = s.time_by_source.find("Korthikanti et al. 2022 (arXiv:2205.05198)");
  ASSERT_NE(korthikanti, s.time_by_source.end());
  const ErrorStats& k = korthikanti->second;
  ASSERT_EQ(k.count, 8);
  EXPECT_LT(k.mean, 3.65);
  EXPECT_LT(k.max, 8.9);
}

// A set of validate/sets/ (docs/VALIDATION.md "Beyond the dev set"), every case simulated, two
// at a time.
std::vector<CaseOutcome> run_project_set(const std::string& name) {
  auto set = load_validation_set(std::string(NNSIM_TEST_DATA) + "/../../validate/sets/" + name);
  EXPECT_TRUE(set.ok()) << set.error().message();
  if (!set.ok()) return {};
  ValidateOptions o;
  o.jobs = 2;
  std::vector<CaseOutcome> out = run_validation(*set, o);
  for (const auto& c : out) EXPECT_TRUE(c.ok()) << c.id << ": " << c.status;
  return out;
}

// torchtitan's other Llama 3.1 405B rows: a check of the memory model across pipeline schedules
// and context-parallel degrees, held to what it reached when added (median 8.3 %, worst
// 16.4 %: the interleaved row).
TEST(Validate, TorchtitanOtherRowsMemoryBound) {
  const std::vector<CaseOutcome> out = run_project_set("torchtitan-2412-405b-rows.yaml");
  ASSERT_EQ(out.size(), 5u);
  for (const auto& c : out) EXPECT_TRUE(c.memory_error_pct.has_value()) << c.id;
  const ValidationSummary s = summarize(out);
  EXPECT_LE(s.memory.median, 9.0);
  EXPECT_LE(s.memory.max, 17.0);
}

// The dense rows of NVIDIA's newer Megatron-Bridge tables on H100s: runs the cost model never
// saw, held to what it reached when they were added (median 10.1 %, worst 15.8 %: the FSDP
// row).
TEST(Validate, NemoBridgeDenseRowsHeldOut) {
  const std::vector<CaseOutcome> out = run_project_set("nemo-bridge-h100-dense.yaml");
  ASSERT_EQ(out.size(), 5u);
  const ValidationSummary s = summarize(out);
  EXPECT_LE(s.time.median, 10.5);
  EXPECT_LE(s.time.max, 16.0);
}

}  // namespace
}  // namespace nnsim
