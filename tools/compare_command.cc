#include "tools/compare_command.h"

#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "core/plan.h"
#include "core/units.h"
#include "hwexec/compare.h"
#include "hwexec/run.h"
#include "tools/cli_checks.h"
#include "tools/driver.h"

namespace nnsim::tool {
namespace {

std::string percent(double error) {
  return std::isfinite(error) ? fmt::format("{:+.1f}%", 100 * error) : std::string("n/a");
}

std::string seconds_or_na(double s) {
  return std::isfinite(s) ? format_seconds(s) : std::string("n/a");
}

}  // namespace

CLI::App* add_compare_command(CLI::App& app, CompareArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "compare",
      "compare a run file (nnexec run) with the simulator, per operator, collective "
      "and iteration");
  cmd->add_option("run", a.run, "nnexec run output (HDF5)")->required();
  cmd->add_option("plan", a.plan,
                  "plan.json (default: the plan embedded in the run file; must match it)");
  cmd->add_option("--topo", a.topo, "topology YAML file or preset name")->required();
  cmd->add_option("--nodes", a.nodes, "resize the topology to this many nodes")->check(at_least(1));
  cmd->add_option("--calib", a.calib,
                  "calibration file (HDF5) replacing the cost model's constants");
  cmd->add_option("--json", a.json, "write the comparison as JSON (SI units)");
  return cmd;
}

// nnsim compare: a run file against the simulator (docs/hwexec.md).
int run_compare(const CompareArgs& a) {
  Expected<hwexec::RunResults> run = hwexec::read_run(a.run);
  if (!run) return fail(run.error().message());
  Expected<Plan> plan = hwexec::plan_of_run(*run, a.run, a.plan);
  if (!plan) return fail(plan.error().message());
  Expected<Topology> topo = load_topology_sized(a.topo, a.nodes);
  if (!topo) return fail(topo.error().message());
  hwexec::CompareOptions options;
  Calibration storage;
  Expected<const Calibration*> calib = optional_calibration(a.calib, storage);
  if (!calib) return fail(calib.error().message());
  options.calibration = *calib;
  if (*calib) options.calibration_path = a.calib;
  Expected<hwexec::Comparison> c = hwexec::compare_run(*run, *plan, *topo, options);
  if (!c) return fail(fmt::format("{}: {}", a.run, c.error().message()));

  std::printf("%s\n", fmt::format("{}: plan '{}', {} ranks on {} ({}), vs {} x {} ({})", a.run,
                                  c->plan_name, c->ranks, c->device, c->dtype, c->topology, c->gpu,
                                  c->calibration)
                          .c_str());
  std::printf("operators (per iteration, mean over the ranks that run them):\n");
  std::printf("  %-16s %-5s %-11s %5s %7s %7s %11s %11s %8s\n", "operator", "phase", "kind",
              "ranks", "calls", "sim", "measured", "simulated", "error");
  for (const hwexec::OpRow& r : c->ops) {
    std::printf("  %-16s %-5s %-11s %5d %7.4g %7.4g %11s %11s %8s\n", r.name.c_str(),
                r.phase.c_str(), r.kind.c_str(), r.ranks, r.measured_calls, r.simulated_calls,
                format_seconds(r.measured).c_str(), format_seconds(r.simulated).c_str(),
                percent(r.error()).c_str());
  }
  std::printf("operator kinds (per iteration, mean over all ranks):\n");
  for (const hwexec::KindRow& r : c->kinds) {
    std::printf("  %-16s %11s %11s %8s\n", r.kind.c_str(), format_seconds(r.measured).c_str(),
                format_seconds(r.simulated).c_str(), percent(r.error()).c_str());
  }
  std::printf("collectives (per iteration, mean over the ranks that run them):\n");
  std::printf("  %-14s %-5s %-16s %5s %6s %6s %11s %11s %11s %11s %8s\n", "kind", "axes", "label",
              "ranks", "calls", "sim", "bytes", "sim", "measured", "simulated", "error");
  for (const hwexec::CollectiveRow& r : c->collectives) {
    std::printf("  %-14s %-5s %-16s %5d %6.4g %6.4g %11s %11s %11s %11s %8s\n", r.kind.c_str(),
                r.axes.c_str(), r.label.c_str(), r.ranks, r.measured_calls, r.simulated_calls,
                format_bytes(r.measured_bytes).c_str(), format_bytes(r.simulated_bytes).c_str(),
                format_seconds(r.measured).c_str(), seconds_or_na(r.simulated).c_str(),
                percent(r.error()).c_str());
  }
  std::printf("communication by kind and axes (per iteration, mean over all ranks):\n");
  std::printf("  %-14s %-8s %9s %9s %11s %11s %11s %11s\n", "kind", "axes", "calls", "sim", "bytes",
              "sim", "measured", "simulated");
  for (const hwexec::TrafficRow& r : c->traffic) {
    std::printf("  %-14s %-8s %9.4g %9.4g %11s %11s %11s %11s\n", r.kind.c_str(), r.axes.c_str(),
                r.measured_calls, r.simulated_calls, format_bytes(r.measured_bytes).c_str(),
                format_bytes(r.simulated_bytes).c_str(), format_seconds(r.measured).c_str(),
                format_seconds(r.simulated).c_str());
  }
  std::printf("iteration: measured %s (median of %zu, slowest rank), simulated %s, error %s\n",
              format_seconds(c->measured_iteration).c_str(), c->measured_iterations.size(),
              seconds_or_na(c->simulated_iteration).c_str(), percent(c->iteration_error()).c_str());
  if (c->measured_peak_memory >= 0 && std::isfinite(c->simulated_peak_memory)) {
    std::printf(
        "peak memory of tensors (largest rank): measured %s, simulated %s (without "
        "%s of runtime and NCCL buffers), error %s\n",
        format_bytes(c->measured_peak_memory).c_str(),
        format_bytes(c->simulated_peak_memory).c_str(),
        format_bytes(c->simulated_untracked_memory).c_str(), percent(c->memory_error()).c_str());
  }
  if (!c->measured_peak_operator.empty()) {
    std::printf("  measured peak during %s %s (the run's memory timeline)\n",
                c->measured_peak_operator.c_str(), c->measured_peak_phase.c_str());
  }
  std::printf("operators summed: measured %s, simulated %s, error %s\n",
              format_seconds(c->measured_compute).c_str(),
              format_seconds(c->simulated_compute).c_str(), percent(c->compute_error()).c_str());
  auto magnitude = [](double e) {
    return std::isfinite(e) ? fmt::format("{:.1f}%", 100 * e) : std::string("n/a");
  };
  std::printf("median |error|: operators %s, GEMMs (linear) %s, collectives %s\n",
              magnitude(c->median_op_error).c_str(), magnitude(c->median_gemm_error).c_str(),
              magnitude(c->median_collective_error).c_str());
  for (const std::string& n : c->notes) std::printf("note: %s\n", n.c_str());
  if (!a.json.empty()) {
    std::string error;
    if (!write_file(a.json, hwexec::comparison_json(*c), &error)) return fail(error);
  }
  return 0;
}

}  // namespace nnsim::tool
