#include "validate/validation_set.h"

#include <set>

#include <fmt/format.h>

#include "core/input.h"

namespace nnsim {

bool ValidationCase::parallel_stated() const {
  for (const auto& a : assumed) {
    if (a.rfind("parallel.", 0) == 0) return false;
  }
  return true;
}

std::string ValidationCase::source_name() const {
  int depth = 0;
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '(') ++depth;
    if (source[i] == ')') --depth;
    if (source[i] == ',' && depth == 0) return source.substr(0, i);
  }
  return source;
}

namespace {

// A measured or physical quantity: zero or below would make an error percentage infinite or a
// link useless, so it is rejected where it is read.
double positive_double(const InputNode& n, const std::string& what) {
  const double v = n.as_double();
  if (!(v > 0)) n.fail(fmt::format("{} must be positive, got {}", what, v));
  return v;
}

// A count (a degree, a size, a batch) read where it is written, so that a 0 names its field
// and line rather than the option of the plan builder it would reach.
int count_in(const InputNode& n, int min, int max = 1 << 30) {
  const int v = n.as_small_int();
  if (v < min || v > max) {
    n.fail(max < (1 << 30) ? fmt::format("must be {} to {}, got {}", min, max, v)
                           : fmt::format("must be at least {}, got {}", min, v));
  }
  return v;
}

ModelSpec parse_case_model(const InputNode& n, const std::string& id) {
  n.check_keys({"family", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "mlp", "vocab",
                "seq_len", "tied_embeddings", "position"});
  ModelSpec m;
  m.name = id;
  m.family = n["family"].as_string();
  m.layers = count_in(n["layers"], 1);
  m.hidden = count_in(n["hidden"], 1);
  m.heads = count_in(n["heads"], 1);
  m.kv_heads = count_in(n["kv_heads"], 1);
  m.ffn_hidden = count_in(n["ffn_hidden"], 1);
  m.mlp = n["mlp"].as_enum<MlpKind>({{"gelu", MlpKind::kGelu},
                                     {"swiglu", MlpKind::kSwiglu},
                                     {"squared_relu", MlpKind::kSquaredRelu},
                                     {"relu", MlpKind::kRelu}});
  m.vocab = count_in(n["vocab"], 1);
  m.seq_len = count_in(n["seq_len"], 1);
  m.tied_embeddings = n["tied_embeddings"].as_bool();
  m.position = n["position"].as_enum<PositionKind>({{"learned", PositionKind::kLearned},
                                                    {"rope", PositionKind::kRope},
                                                    {"alibi", PositionKind::kAlibi}});
  // The schema leaves these to the family: GPT-style models use LayerNorm with biases,
  // Llama-style ones RMSNorm without (MPT: LayerNorm without biases; Nemotron-4: LayerNorm,
  // no biases).
  const bool llama = m.family == "llama";
  m.norm = llama ? NormKind::kRmsNorm : NormKind::kLayerNorm;
  m.bias = m.family == "gpt";
  return m;
}

ValidationCase parse_case(const InputNode& c) {
  c.check_keys({"id", "source", "model", "cluster", "parallel", "measured", "assumed"});
  ValidationCase v;
  v.id = c["id"].as_string();
  v.source = c["source"].as_string();
  v.model = parse_case_model(c["model"], v.id);

  auto cl = c["cluster"];
  cl.check_keys({"gpu", "nodes", "gpus_per_node", "nic_gbps", "nics_per_node"});
  v.cluster.gpu = cl["gpu"].as_string();
  v.cluster.nodes = count_in(cl["nodes"], 1);
  v.cluster.gpus_per_node = count_in(cl["gpus_per_node"], 1);
  v.cluster.nic_bandwidth = positive_double(cl["nic_gbps"], "the NIC bandwidth (Gb/s)") * 1e9 / 8;
  v.cluster.nics_per_node = count_in(cl["nics_per_node"], 1);

  auto p = c["parallel"];
  p.check_keys({"tp", "pp", "dp", "cp", "ep", "vp", "micro_batch", "global_batch", "recompute",
                "sequence_parallel", "zero", "precision", "framework"});
  ValidationParallel& x = v.parallel;
  x.tp = count_in(p["tp"], 1);
  x.pp = count_in(p["pp"], 1);
  x.dp = count_in(p["dp"], 1);
  x.cp = count_in(p["cp"], 1);
  x.ep = count_in(p["ep"], 1);
  x.vp = count_in(p["vp"], 1);
  x.micro_batch = count_in(p["micro_batch"], 1);
  x.global_batch = count_in(p["global_batch"], 1);
  x.recompute = p["recompute"].as_string();
  if (x.recompute != "none" && x.recompute != "selective" && x.recompute != "full") {
    p["recompute"].fail_unknown(x.recompute, {"none", "selective", "full"});
  }
  x.sequence_parallel = p["sequence_parallel"].as_bool();
  x.zero = count_in(p["zero"], 0, 3);
  x.precision = p["precision"].as_enum<Precision>(
      {{"bf16", Precision::kBf16}, {"fp16", Precision::kFp16}, {"fp8", Precision::kFp8}});
  x.framework = p["framework"].as_string();
  if (x.framework != "megatron" && x.framework != "fsdp" && x.framework != "deepspeed" &&
      x.framework != "other") {
    p["framework"].fail_unknown(x.framework, {"megatron", "fsdp", "deepspeed", "other"});
  }
  // The schema's models have no experts (its `model` fields describe dense transformers).
  if (x.ep != 1) p["ep"].fail("must be 1: the schema's models are dense (no experts to spread)");

  auto m = c["measured"];
  m.check_keys({"iteration_time_s", "tokens_per_s_per_gpu", "mfu_pct", "peak_memory_gib"});
  v.measured.iteration_time_s = positive_double(m["iteration_time_s"], "a measured iteration time");
  if (m.has("tokens_per_s_per_gpu")) {
    v.measured.tokens_per_s_per_gpu = positive_double(m["tokens_per_s_per_gpu"], "a throughput");
  }
  if (m.has("mfu_pct")) {
    v.measured.mfu_pct = positive_double(m["mfu_pct"], "a model FLOP utilization");
    if (*v.measured.mfu_pct > 100) m["mfu_pct"].fail("a model FLOP utilization is at most 100 (%)");
  }
  if (m.has("peak_memory_gib")) {
    v.measured.peak_memory_gib = positive_double(m["peak_memory_gib"], "a measured peak memory");
  }
  if (c.has("assumed")) {
    for (const auto& a : c["assumed"].items()) v.assumed.push_back(a.as_string());
  }
  return v;
}

std::vector<ValidationCase> parse_set(const InputNode& root) {
  root.check_keys({"schema", "cases"});
  if (root["schema"].as_string() != "nnsim-validation/1") {
    root["schema"].fail("expected \"nnsim-validation/1\" (see shared/validation/README.md)");
  }
  std::vector<ValidationCase> out;
  std::set<std::string> ids;
  for (const auto& c : root["cases"].items()) {
    out.push_back(parse_case(c));
    if (!ids.insert(out.back().id).second) c["id"].fail("case id '" + out.back().id + "' repeats");
  }
  return out;
}

}  // namespace

Expected<std::vector<ValidationCase>> parse_validation_set(const std::string& yaml_text,
                                                           const std::string& display_name) {
  return catch_input_errors<std::vector<ValidationCase>>(
      display_name, [&] { return parse_set(InputNode::load_string(yaml_text, display_name)); });
}

Expected<std::vector<ValidationCase>> load_validation_set(const std::string& path) {
  return catch_input_errors<std::vector<ValidationCase>>(
      path, [&] { return parse_set(InputNode::load_file(path)); });
}

}  // namespace nnsim
