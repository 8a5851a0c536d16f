#include "tools/presets_command.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/gpu.h"
#include "core/model.h"
#include "core/precision.h"
#include "core/topology.h"
#include "core/units.h"
#include "tools/driver.h"

namespace nnsim::tool {
namespace {

// What a model's layers are: dense blocks, experts, or a hybrid pattern's kinds counted.
std::string layer_summary(const ModelSpec& m) {
  std::vector<std::string> parts;
  if (m.hybrid()) {
    const std::pair<char, const char*> kinds[] = {{'M', "Mamba-2"},
                                                  {'G', "Gated DeltaNet"},
                                                  {'*', "attention"},
                                                  {'-', "MLP"},
                                                  {'E', "experts"}};
    std::string counts;
    for (const auto& [c, name] : kinds) {
      const auto n = std::count(m.layer_pattern.begin(), m.layer_pattern.end(), c);
      if (n > 0) counts += fmt::format("{}{} {}", counts.empty() ? "" : ", ", n, name);
    }
    parts.push_back("hybrid: " + counts);
  } else {
    parts.emplace_back(m.moe() ? "transformer" : "dense transformer");
  }
  if (m.moe()) {
    parts.push_back(fmt::format("{} experts, top {}{}", m.experts, m.experts_per_token,
                                m.shared_expert_ffn_hidden > 0 ? " + shared" : ""));
  }
  if (m.mla()) parts.emplace_back("latent attention");
  if (m.attention_output_gate) parts.emplace_back("gated attention");
  if (m.windowed()) parts.push_back(fmt::format("{}-token windows", m.sliding_window));
  if (m.mtp_layers > 0) {
    parts.push_back(
        fmt::format("{} prediction module{}", m.mtp_layers, m.mtp_layers > 1 ? "s" : ""));
  }
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

// Prints the model presets, adding each to `out` (its description as a plan records it, and its
// parameters); false if one of them does not load (its error is printed).
bool print_models(nlohmann::ordered_json& out) {
  std::printf("models (models/; --model NAME):\n");
  std::printf("  %-26s %12s %7s %7s %8s  %s\n", "name", "parameters", "layers", "hidden", "seq_len",
              "layers are");
  bool ok = true;
  for (const std::string& name : model_preset_names()) {
    Expected<ModelSpec> m = load_model(name);
    if (!m) {
      fail(m.error().message());  // the others are still listed
      ok = false;
      continue;
    }
    nlohmann::ordered_json entry;
    entry["name"] = name;
    entry["parameters"] = m->parameters();
    entry["model"] = nlohmann::ordered_json::parse(model_to_json(*m));
    out.push_back(std::move(entry));
    std::printf("  %-26s %10.2f B %7d %7lld %8lld  %s\n", name.c_str(),
                static_cast<double>(m->parameters()) / 1e9, m->layers,
                static_cast<long long>(m->hidden), static_cast<long long>(m->seq_len),
                layer_summary(*m).c_str());
  }
  return ok;
}

bool print_topologies(nlohmann::ordered_json& out) {
  std::printf("topologies (topologies/; --topo NAME, --nodes N resizes):\n");
  std::printf("  %-22s %-22s  %s\n", "name", "GPUs", "description");
  bool ok = true;
  for (const std::string& name : topology_preset_names()) {
    Expected<Topology> t = load_topology(name);
    if (!t) {
      fail(t.error().message());  // the others are still listed
      ok = false;
      continue;
    }
    out.push_back({{"name", name},
                   {"gpu", t->gpu.name},
                   {"nodes", t->nodes},
                   {"gpus_per_node", t->gpus_per_node},
                   {"description", t->description}});
    const std::string gpus = fmt::format("{} x {} {}", t->nodes, t->gpus_per_node, t->gpu.name);
    std::printf("  %-22s %-22s  %s\n", name.c_str(), gpus.c_str(), t->description.c_str());
  }
  return ok;
}

// Prints the GPU catalog (the names a topology's `gpu` takes), adding each to `out`.
void print_gpus(nlohmann::ordered_json& out) {
  std::printf("GPUs (the catalog; a topology's gpu: NAME, or --topo-set gpu=NAME):\n");
  std::printf("  %-18s %12s %12s %10s %12s %12s %5s\n", "name", "bf16", "fp8", "memory", "HBM",
              "NVLink", "SMs");
  for (const GpuSpec& g : gpu_catalog()) {
    nlohmann::ordered_json flops = nlohmann::ordered_json::object();
    for (const auto& [precision, f] : g.dense_flops) flops[std::string(to_string(precision))] = f;
    out.push_back({{"name", g.name},
                   {"dense_flops", flops},
                   {"hbm_bytes", g.hbm_bytes},
                   {"hbm_bandwidth", g.hbm_bandwidth},
                   {"nvlink_bandwidth", g.nvlink_bandwidth},
                   {"sms", g.sms},
                   {"source", g.source}});
    const auto fp8 = g.dense_flops.find(Precision::kFp8);
    std::printf("  %-18s %12s %12s %10s %12s %12s %5d\n", g.name.c_str(),
                format_flops(g.peak_flops(Precision::kBf16)).c_str(),
                fp8 == g.dense_flops.end() ? "-" : format_flops(fp8->second).c_str(),
                format_bytes(g.hbm_bytes).c_str(), format_rate(g.hbm_bandwidth).c_str(),
                g.nvlink_bandwidth > 0 ? format_rate(g.nvlink_bandwidth).c_str() : "-", g.sms);
  }
}

}  // namespace

CLI::App* add_presets_command(CLI::App& app, PresetsArgs& a) {
  CLI::App* cmd = app.add_subcommand("presets", "list the model and topology presets");
  cmd->add_option("kind", a.kind, "only 'models', 'topologies' or 'gpus'")
      ->check(CLI::IsMember({"models", "topologies", "gpus"}));
  cmd->add_option("--json", a.json,
                  "also write them as JSON: each model's full description and parameters, each "
                  "topology's GPUs");
  return cmd;
}

int run_presets(const PresetsArgs& a) {
  bool ok = true;
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  if (a.kind.empty() || a.kind == "models") {
    out["models"] = nlohmann::ordered_json::array();
    ok = print_models(out["models"]) && ok;
  }
  if (a.kind.empty()) std::printf("\n");
  if (a.kind.empty() || a.kind == "topologies") {
    out["topologies"] = nlohmann::ordered_json::array();
    ok = print_topologies(out["topologies"]) && ok;
  }
  if (a.kind.empty()) std::printf("\n");
  if (a.kind.empty() || a.kind == "gpus") {
    out["gpus"] = nlohmann::ordered_json::array();
    print_gpus(out["gpus"]);
  }
  std::string error;
  if (!a.json.empty() && !write_file(a.json, out.dump(1) + "\n", &error)) return fail(error);
  return ok ? 0 : 1;
}

}  // namespace nnsim::tool
