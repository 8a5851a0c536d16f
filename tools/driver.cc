#include "tools/driver.h"

#include <fstream>
#include <utility>

#include <fmt/format.h>

#include "core/units.h"

namespace nnsim::tool {

int fail(const std::string& message) {
  std::fprintf(stderr, "nnsim: error: %s\n", message.c_str());
  return 1;
}

Expected<const Calibration*> optional_calibration(const std::string& path, Calibration& storage) {
  if (path.empty()) return static_cast<const Calibration*>(nullptr);
  Expected<Calibration> c = load_calibration(path);
  if (!c) return c.error();
  storage = std::move(*c);
  return static_cast<const Calibration*>(&storage);
}

bool write_file(const std::string& path, const std::string& text, std::string* error) {
  std::ofstream out(path, std::ios::binary);
  if (!out) {
    *error = fmt::format("cannot write '{}' (does its folder exist?)", path);
    return false;
  }
  out << text;
  if (!out.flush()) {
    *error = fmt::format("writing '{}' failed", path);
    return false;
  }
  return true;
}

void add_topo_set_option(CLI::App* app, std::vector<std::string>& topo_set) {
  app->add_option("--topo-set", topo_set,
                  "replace a field of the topology (what-if; repeatable), e.g. "
                  "node.nics.bandwidth=800Gb/s, fabric.oversubscription=2, gpu.hbm_bytes=141GB (a "
                  "GPU given by name becomes a hypothetical one based on it)")
      ->allow_extra_args(false);
}

Expected<Topology> load_topology_sized(const std::string& path, int nodes,
                                       const std::vector<std::string>& topo_set) {
  std::vector<FieldOverride> overrides;
  for (const std::string& text : topo_set) {
    Expected<FieldOverride> o = parse_field_override(text);
    if (!o) return Error("--topo-set " + o.error().message());
    overrides.push_back(*o);
  }
  Expected<Topology> topo = load_topology(path, overrides, "--topo-set");
  if (!topo || nodes <= 0) return topo;
  return resize_topology(*topo, nodes);
}

namespace {
// "1.2 M" (format_count leaves a space for the unit when there is no prefix).
std::string count(double n) {
  std::string s = format_count(n);
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}
// Tokens as the field writes them: billions with B ("300 B"), not G.
std::string tokens(double n) {
  std::string s = count(n);
  if (!s.empty() && s.back() == 'G') s.back() = 'B';
  return s;
}
// 3576279 -> "3,576,279".
std::string grouped(int64_t n) {
  std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}
}  // namespace

std::string describe_training(const TrainingTime& t) {
  std::string text = fmt::format("{} tokens in {} steps of {} tokens: {} on {} GPUs, {} GPU-hours",
                                 tokens(t.tokens), grouped(t.steps), tokens(t.tokens_per_step),
                                 format_duration(t.seconds), t.gpus, count(t.gpu_hours));
  if (const std::optional<FailureCost>& f = t.with_failures) {
    text += fmt::format(
        "\n                   with failures: {}, {} GPU-hours (+{:.1f} %): {:.1f} failures "
        "expected, one every {}; a checkpoint every {}",
        format_duration(f->seconds), count(f->gpu_hours), 100 * (f->seconds / t.seconds - 1),
        f->failures, format_duration(f->mtbf_seconds), format_duration(f->checkpoint_interval));
  }
  return text;
}

void add_failure_options(CLI::App* app, FailureArgs& a) {
  app->add_option("--checkpoint-seconds", a.checkpoint_seconds,
                  "with --train-tokens: seconds a checkpoint save blocks training; with "
                  "--restart-seconds, the time to train counts failures (docs/simulator.md)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--restart-seconds", a.restart_seconds,
                  "with --train-tokens: seconds from a failure to training again")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--gpu-failure-rate", a.gpu_failures_per_hour,
                  "failures a GPU-hour (default: Llama 3's, 419 in 54 days on 16,384 GPUs)")
      ->check(CLI::PositiveNumber);
}

Expected<std::optional<FailureModel>> read_failure_options(const FailureArgs& a,
                                                           bool train_tokens) {
  const bool checkpoint = a.checkpoint_seconds >= 0;
  const bool restart = a.restart_seconds >= 0;
  if (!checkpoint && !restart) {
    if (a.gpu_failures_per_hour > 0) {
      return Error("--gpu-failure-rate needs --checkpoint-seconds and --restart-seconds");
    }
    return std::optional<FailureModel>();
  }
  if (checkpoint != restart) {
    return Error(
        "give both --checkpoint-seconds and --restart-seconds: a failure's cost is the "
        "checkpoints' and the restart's");
  }
  if (!train_tokens) {
    return Error("--checkpoint-seconds and --restart-seconds need --train-tokens");
  }
  FailureModel f;
  f.checkpoint_seconds = a.checkpoint_seconds;
  f.restart_seconds = a.restart_seconds;
  if (a.gpu_failures_per_hour > 0) f.gpu_failures_per_hour = a.gpu_failures_per_hour;
  return std::optional<FailureModel>(f);
}

Status add_failure_cost(TrainingTime& t, const std::optional<FailureModel>& f) {
  if (!f) return Status::Ok();
  Expected<FailureCost> c = failure_cost(t, *f);
  if (!c) return c.error();
  t.with_failures = *c;
  return Status::Ok();
}

void note_hypothetical_gpu(const GpuSpec& gpu) {
  if (gpu.base.empty() || gpu.base == gpu.name) return;
  std::printf(
      "note: %s is a hypothetical GPU: its peaks, memory and NVLink as the topology gives them, "
      "its GEMM, attention and NCCL efficiencies %s's measured ones (docs/topology.md)\n",
      gpu.name.c_str(), gpu.base.c_str());
}

void note_unvalidated_moe(const ModelSpec& model) {
  if (!model.moe()) return;
  std::printf(
      "note: mixture-of-experts step times are not validated yet: NVIDIA's published H100 runs "
      "of Qwen3-30B-A3B and GPT-OSS 120B took 1.4-3x nnsim's time, of DeepSeek-V3 over 16 nodes "
      "0.4-0.6x (docs/moe.md)\n");
}

void note_unvalidated_hybrid(const ModelSpec& model) {
  if (model.has_layer_kind('G')) {
    std::printf(
        "note: Gated DeltaNet layers are priced by their kernels' FLOPs and traffic, which no "
        "kernel measurement or published training run has checked yet (docs/hybrid.md)\n");
  }
  if (!model.has_layer_kind('M')) return;
  std::printf(
      "note: Mamba-2 layers are priced by their kernels' traffic, which no kernel measurement "
      "has checked yet; on NVIDIA's published Nemotron-H 56B H100 runs nnsim's step is within "
      "2.4 %% without tensor-parallel communication overlap and 22-25 %% short with it, and the "
      "runs do not state which (docs/hybrid.md)\n");
}

Status check_sensitivity_option(double factor) {
  if (factor <= 0) return Status::Ok();
  if (Status st = check_sensitivity_factor(factor); !st) {
    return Error("--sensitivity: " + st.error().message());
  }
  return Status::Ok();
}

Expected<Sensitivity> run_sensitivity(const Plan& plan, const Topology& topo,
                                      const CompileOptions& compile, const SimOptions& sim,
                                      double factor, double baseline) {
  Progress progress("sensitivity");
  Expected<Sensitivity> s = sensitivity(plan, topo, compile, sim, factor, baseline,
                                        [&progress](double f) { progress.update(f); });
  progress.done();
  if (!s) return Error("--sensitivity: " + s.error().message());
  return s;
}

void print_sensitivity(const Sensitivity& s) {
  std::printf("sensitivity: the plan simulated again with one resource %gx as fast:\n", s.factor);
  std::printf("  %-11s %10s %8s  %s\n", "resource", "iteration", "change", "what scales");
  for (const ResourceSensitivity& x : s.resources) {
    std::printf("  %-11s %10s %+7.1f%%  %s\n", std::string(resource_name(x.resource)).c_str(),
                format_seconds(x.iteration_time).c_str(), 100 * (x.iteration_time / s.baseline - 1),
                std::string(resource_description(x.resource)).c_str());
  }
}

}  // namespace nnsim::tool
