#include "tools/simulate_command.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/host_copy.h"
#include "core/memory_check.h"
#include "core/plan.h"
#include "core/program.h"
#include "core/training_time.h"
#include "core/units.h"
#include "sim/report.h"
#include "sim/sensitivity.h"
#include "sim/simulator.h"
#include "sim/trace.h"
#include "tools/cli_checks.h"
#include "tools/driver.h"

namespace nnsim::tool {
namespace {

std::string lane_gpus(const LaneReport& l) {
  if (l.gpus.size() == 1) return std::to_string(l.gpus.front());
  auto [lo, hi] = std::minmax_element(l.gpus.begin(), l.gpus.end());
  return fmt::format("{}-{}", *lo, *hi);
}

void print_report(const Program& prog, const SimResult& r,
                  const std::optional<TrainingTime>& training) {
  const Topology& t = prog.topology;
  std::printf(
      "%s\n",
      fmt::format(
          "{} on {} ({} x {}{})", prog.plan.name, t.name, r.num_gpus, t.gpu.name,
          r.num_gpus < t.num_gpus() ? fmt::format("; {} GPUs idle", t.num_gpus() - r.num_gpus) : "")
          .c_str());
  std::printf("  iteration time   %s (%d micro-batch%s per replica)\n",
              format_seconds(r.iteration_time).c_str(), r.micro_batches,
              r.micro_batches == 1 ? "" : "es");
  std::printf("  throughput       %s tokens/s, %s per GPU (MFU %.1f%% of %s)\n",
              format_count(r.tokens_per_second).c_str(),
              format_flops(r.model_flops_per_gpu).c_str(), 100 * r.mfu,
              format_flops(r.peak_flops_per_gpu).c_str());
  if (training) std::printf("  to train         %s\n", describe_training(*training).c_str());
  const LaneReport& worst = worst_memory_lane(r);
  std::printf("  peak memory      %s of %s (GPU %d, %s)\n", format_bytes(worst.peak_memory).c_str(),
              format_bytes(t.gpu.hbm_bytes).c_str(), worst.gpus.front(), worst.name.c_str());
  std::printf("    %s\n",
              describe_memory_parts(worst.static_memory, worst.peak_activations).c_str());
  const bool optimizer_offload = prog.plan.optimizer.offload_fraction > 0;
  if (const NodeHostMemory host = busiest_host_memory(prog); host.node >= 0) {
    std::printf("  host memory      %s of %s (node %d: offloaded %s)\n",
                format_bytes(host.bytes).c_str(), format_bytes(t.host.memory).c_str(), host.node,
                describe_host_contents(prog.plan).c_str());
  }
  if (prog.plan.offloads_activations()) {
    // The lane that offloads the most, per micro-batch; its copies run one after another.
    size_t most = 0;
    for (size_t i = 0; i < prog.lanes.size(); ++i) {
      if (prog.lanes[i].offloaded_activations > prog.lanes[most].offloaded_activations) most = i;
    }
    const double bytes = prog.lanes[most].offloaded_activations;
    const std::string what =
        prog.plan.activation_offload_layers > 0
            ? fmt::format("{} layers", prog.plan.activation_offload_layers)
            : fmt::format("{} of each layer", fmt::join(prog.plan.activation_offload_modules, ","));
    std::printf("  offloaded acts   %s, %s a micro-batch (%s): %s to the host, %s back\n",
                what.c_str(), format_bytes(bytes).c_str(), r.lanes[most].name.c_str(),
                format_seconds(host_copy_seconds(bytes, true, t, prog.compute_model)).c_str(),
                format_seconds(host_copy_seconds(bytes, false, t, prog.compute_model)).c_str());
  }
  if (optimizer_offload) {
    // The lane whose offloaded step is longest, part by part.
    size_t slowest = 0;
    for (size_t i = 0; i < prog.lanes.size(); ++i) {
      if (prog.lanes[i].offloaded_step.seconds > prog.lanes[slowest].offloaded_step.seconds) {
        slowest = i;
      }
    }
    const OffloadedStep& o = prog.lanes[slowest].offloaded_step;
    if (prog.plan.optimizer.offload_params) {
      std::printf(
          "  optimizer step   %s (%s): the host's update; the shards cross PCIe beside the "
          "gathers and reductions\n",
          format_seconds(o.seconds).c_str(), r.lanes[slowest].name.c_str());
    } else {
      std::printf(
          "  optimizer step   %s (%s): gradients to the host %s, the host's update %s, parameters "
          "back %s%s, %s\n",
          format_seconds(o.seconds).c_str(), r.lanes[slowest].name.c_str(),
          format_seconds(o.to_host).c_str(), format_seconds(o.host).c_str(),
          format_seconds(o.to_device).c_str(),
          o.gpu > 0 ? fmt::format(", the GPU's part {}", format_seconds(o.gpu)).c_str() : "",
          prog.plan.optimizer.offload_overlap ? "overlapped tensor by tensor"
                                              : "one after another");
    }
  }
  // Per-lane breakdown.
  std::vector<std::string> groups;
  for (const auto& l : r.lanes) {
    for (const auto& [g, s] : l.breakdown.exposed_comm) {
      if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
    }
  }
  std::sort(groups.begin(), groups.end());
  std::string header = fmt::format("  {:<10} {:>9} {:>10} {:>10} {:>10}", "lane", "gpus", "compute",
                                   "recompute", "optimizer");
  for (const auto& g : groups) header += fmt::format(" {:>10}", "exp." + g);
  header += fmt::format(" {:>10} {:>11}", "bubble", "peak mem");
  std::printf("breakdown per lane (devices in lockstep; every GPU listed has these figures):\n");
  std::printf("%s\n", header.c_str());
  size_t shown = 0;
  for (const auto& l : r.lanes) {
    if (shown++ == 32 && r.lanes.size() > 34) {
      std::printf("  ... %zu more lanes in --json\n", r.lanes.size() - 32);
      break;
    }
    const Breakdown& b = l.breakdown;
    std::string row = fmt::format("  {:<10} {:>9} {:>10} {:>10} {:>10}", l.name, lane_gpus(l),
                                  format_seconds(b.compute), format_seconds(b.recompute),
                                  format_seconds(b.optimizer));
    for (const auto& g : groups) {
      auto it = b.exposed_comm.find(g);
      row += fmt::format(" {:>10}", format_seconds(it == b.exposed_comm.end() ? 0 : it->second));
    }
    row += fmt::format(" {:>10} {:>11}", format_seconds(b.bubble), format_bytes(l.peak_memory));
    std::printf("%s\n", row.c_str());
  }
  if (r.fidelity == Fidelity::kSymmetric && prog.replicas > 1) {
    std::printf("  (simulated 1 of %d data-parallel replicas; the others mirror it)\n",
                prog.replicas);
  }
  note_unvalidated_moe(prog.plan.model);
  note_unvalidated_hybrid(prog.plan.model);
  note_hypothetical_gpu(prog.topology.gpu);
}

}  // namespace

void add_simulate_options(CLI::App* app, SimulateArgs& a, bool required) {
  auto* topo = app->add_option("--topo", a.topo, "topology YAML file or preset name");
  auto* plan = app->add_option("plan", a.plan, "plan.json to simulate");
  if (required) {
    topo->required();
    plan->required();
  }
  app->add_option("--nodes", a.nodes, "resize the topology to this many nodes (what-if)")
      ->check(at_least(1));
  add_topo_set_option(app, a.topo_set);
  app->add_option("--json", a.json, "write the report as JSON to this file");
  app->add_option("--trace", a.trace, "write a Chrome/Perfetto timeline (JSON) to this file");
  app->add_flag("--trace-per-gpu", a.trace_per_gpu,
                "one trace process per GPU instead of one per lane (lockstep GPUs repeat)");
  app->add_option("--hdf5", a.hdf5, "write the task-level timeline (HDF5) to this file");
  app->add_option("--fidelity", a.fidelity,
                  "symmetric: simulate one data-parallel replica (default); full: all of them")
      ->check(CLI::IsMember({"symmetric", "full"}));
  app->add_flag("--no-fold", a.no_fold,
                "run every collective as SimGrid activities, even those whose links nothing else "
                "crosses, and every lane rank's group of a per-rank collective (slower; the same "
                "result)");
  app->add_option("--calib", a.calib,
                  "calibration file (HDF5) replacing the cost model's constants for its GPUs");
  app->add_option("--train-tokens", a.train_tokens,
                  "also report how long training this many tokens takes at the simulated "
                  "iteration time, e.g. 15T or 300B (checkpoints, evaluation and restarts not "
                  "counted)");
  add_failure_options(app, a.failures);
  app->add_option("--sensitivity", a.sensitivity,
                  "also simulate the plan with each resource (GPU compute, HBM bandwidth, "
                  "intra-node links, network bandwidth, latency) this many times as fast, one at a "
                  "time, e.g. 2 "
                  "(0.5: half as fast)")
      ->check(at_least(0, true));
  app->add_flag("--allow-oom", a.allow_oom,
                "simulate even when the plan does not fit in GPU memory (still exits non-zero)");
}

int run_simulate(const SimulateArgs& a) {
  if (Status st = check_sensitivity_option(a.sensitivity); !st) return fail(st.error().message());
  std::optional<double> train_tokens;
  if (!a.train_tokens.empty()) {
    Expected<double> n = parse_token_count(a.train_tokens);
    if (!n) return fail("--train-tokens: " + n.error().message());
    train_tokens = *n;
  }
  Expected<std::optional<FailureModel>> failures =
      read_failure_options(a.failures, train_tokens.has_value());
  if (!failures) return fail(failures.error().message());
  Expected<Topology> topo = load_topology_sized(a.topo, a.nodes, a.topo_set);
  if (!topo) return fail(topo.error().message());
  Expected<Plan> plan = load_plan(a.plan);
  if (!plan) return fail(plan.error().message());
  CompileOptions compile;
  Calibration storage;
  Expected<const Calibration*> calib = optional_calibration(a.calib, storage);
  if (!calib) return fail(calib.error().message());
  compile.calibration = *calib;
  Expected<Program> prog = compile_plan(*plan, *topo, compile);
  if (!prog) return fail(fmt::format("{}: {}", a.plan, prog.error().message()));
  Status fits = check_memory_fits(*prog);
  if (!fits && !a.allow_oom) return fail(fits.error().message());

  SimOptions opts;
  opts.fidelity = a.fidelity == "full" ? Fidelity::kFull : Fidelity::kSymmetric;
  opts.record_tasks = !a.trace.empty() || !a.hdf5.empty();
  opts.fold_exclusive_collectives = !a.no_fold;
  opts.mirror_lane_ranks = !a.no_fold;
  Progress progress("simulating");
  opts.progress = [&progress](double f) { progress.update(f); };
  Expected<SimResult> result = simulate(*prog, opts);
  progress.done();
  if (!result) return fail(result.error().message());

  std::optional<TrainingTime> training;
  if (train_tokens) {
    Expected<TrainingTime> t = training_time(*train_tokens, prog->tokens_per_iteration,
                                             result->iteration_time, result->num_gpus);
    if (!t) return fail("--train-tokens: " + t.error().message());
    if (Status st = add_failure_cost(*t, *failures); !st) return fail(st.error().message());
    training = *t;
  }
  print_report(*prog, *result, training);
  std::optional<Sensitivity> sens;
  if (a.sensitivity > 0) {
    Expected<Sensitivity> s =
        run_sensitivity(*plan, *topo, compile, opts, a.sensitivity, result->iteration_time);
    if (!s) return fail(s.error().message());
    print_sensitivity(*s);
    sens = *s;
  }
  std::string error;
  if (!a.json.empty() && !write_file(a.json, report_json(*prog, *result, training, sens), &error)) {
    return fail(error);
  }
  if (!a.trace.empty() &&
      !write_file(a.trace, chrome_trace_json(*prog, *result, a.trace_per_gpu), &error)) {
    return fail(error);
  }
  if (!a.hdf5.empty()) {
    if (Status s = write_hdf5_timeline(a.hdf5, *prog, *result); !s)
      return fail(s.error().message());
  }
  if (!fits) return fail(fits.error().message());
  return 0;
}

}  // namespace nnsim::tool
