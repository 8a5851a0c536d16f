#include "tools/validate_command.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include "core/plan.h"
#include "core/suggest.h"
#include "core/topology_writer.h"
#include "core/units.h"
#include "tools/driver.h"
#include "validate/case_builder.h"
#include "validate/validate.h"

namespace nnsim::tool {

CLI::App* add_validate_command(CLI::App& app, ValidateArgs& a) {
  CLI::App* cmd =
      app.add_subcommand("validate", "simulate published runs and compare with their measurements");
  cmd->add_option("set", a.set, "validation set YAML (shared/validation schema)")->required();
  cmd->add_option("--json", a.json, "write per-case results and the summary");
  cmd->add_option("--jobs", a.jobs, "simulations run at once (default: cores)");
  cmd->add_option("--only", a.only,
                  "simulate only these case ids (space- or comma-separated; '*' matches any "
                  "run of characters: 'mosaic-*-h100*')")
      ->delimiter(',');
  cmd->add_option("--write-plans", a.plans_dir,
                  "write every case's plan (ID.json, as simulated) and cluster "
                  "(ID.topology.yaml) into this folder (created if missing)");
  cmd->add_option("--calib", a.calib,
                  "calibration file (HDF5) replacing the cost model's constants");
  return cmd;
}

int run_validate(const ValidateArgs& a) {
  Expected<std::vector<ValidationCase>> cases = load_validation_set(a.set);
  if (!cases) return fail(cases.error().message());
  if (!a.only.empty()) {
    std::vector<ValidationCase> kept;
    std::vector<std::string> ids;
    for (const auto& c : *cases) ids.push_back(c.id);
    // An id, or a pattern with '*' (`mosaic-*-h100*`); the set's order is kept.
    std::vector<bool> picked(cases->size(), false);
    for (const auto& id : a.only) {
      bool any = false;
      for (size_t i = 0; i < cases->size(); ++i) {
        if (!match_pattern(id, (*cases)[i].id)) continue;
        picked[i] = true;
        any = true;
      }
      if (!any) return fail(fmt::format("--only: no case '{}'{}", id, suggest(id, ids)));
    }
    for (size_t i = 0; i < cases->size(); ++i) {
      if (picked[i]) kept.push_back((*cases)[i]);
    }
    *cases = kept;
  }
  int written = 0;
  if (!a.plans_dir.empty()) {
    // The plans exactly as simulated and the clusters they ran on: `nnsim simulate --topo
    // DIR/ID.topology.yaml DIR/ID.json` replays a case.
    std::error_code ec;
    std::filesystem::create_directories(a.plans_dir, ec);
    if (ec) {
      return fail(fmt::format("--write-plans: cannot create the folder '{}': {}", a.plans_dir,
                              ec.message()));
    }
    for (const auto& c : *cases) {
      Expected<Topology> topo = case_topology(c);
      if (!topo) continue;
      Expected<Plan> plan = case_plan(c, *topo);
      if (!plan) continue;
      Expected<std::string> cluster = topology_to_yaml(*topo);
      if (!cluster) return fail(fmt::format("case {}: {}", c.id, cluster.error().message()));
      std::string error;
      if (!write_file(a.plans_dir + "/" + c.id + ".json", plan_to_json(*plan), &error) ||
          !write_file(a.plans_dir + "/" + c.id + ".topology.yaml", *cluster, &error)) {
        return fail(error);
      }
      ++written;
    }
  }
  ValidateOptions opts;
  Calibration storage;
  Expected<const Calibration*> calib = optional_calibration(a.calib, storage);
  if (!calib) return fail(calib.error().message());
  opts.compile.calibration = *calib;
  opts.jobs =
      a.jobs > 0 ? a.jobs : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Progress progress("validating");
  opts.progress = [&progress](int done, int all) {
    progress.update(static_cast<double>(done) / all);
  };
  std::vector<CaseOutcome> out = run_validation(*cases, opts);
  progress.done();
  ValidationSummary s = summarize(out);
  int id_width = 48;  // wider for longer ids, so that the columns stay aligned
  for (const CaseOutcome& o : out) id_width = std::max(id_width, static_cast<int>(o.id.size()));
  std::printf("%-*s %6s %-9s %11s %11s %8s %9s %9s %8s\n", id_width, "case", "gpus", "framework",
              "measured", "predicted", "error", "mem meas", "mem pred", "mem err");
  for (const CaseOutcome& o : out) {
    if (!o.ok()) {
      std::printf("%-*s %6d %-9s %11s  FAILED: %s\n", id_width, o.id.c_str(), o.gpus,
                  o.framework.c_str(), format_seconds(o.measured_s).c_str(), o.status.c_str());
      continue;
    }
    std::string mem_meas =
        o.measured_memory_gib ? fmt::format("{:.1f} GiB", *o.measured_memory_gib) : "";
    std::string mem_pred =
        o.predicted_memory_gib ? fmt::format("{:.1f} GiB", *o.predicted_memory_gib) : "";
    std::string mem_err = o.memory_error_pct ? fmt::format("{:+.1f}%", *o.memory_error_pct) : "";
    std::printf("%-*s %6d %-9s %11s %11s %+7.1f%% %9s %9s %8s%s\n", id_width, o.id.c_str(), o.gpus,
                o.framework.c_str(), format_seconds(o.measured_s).c_str(),
                format_seconds(o.predicted_s).c_str(), o.error_pct, mem_meas.c_str(),
                mem_pred.c_str(), mem_err.c_str(),
                o.parallel_stated ? "" : "  (parallel config assumed)");
  }
  auto line = [](const char* what, const ErrorStats& e) {
    if (e.count == 0) return;
    std::printf("%s (%d cases): median %.1f%%, p90 %.1f%%, max %.1f%%, mean %.1f%%\n", what,
                e.count, e.median, e.p90, e.max, e.mean);
  };
  std::printf("\n");
  line("iteration time, absolute error", s.time);
  line("  cases with a stated parallel configuration", s.time_stated);
  line("peak memory, absolute error", s.memory);
  if (s.time_by_source.size() > 1) {
    std::printf("iteration time, absolute error by source:\n");
    for (const auto& [source, e] : s.time_by_source) {
      std::printf("  %-66s %3d: median %5.1f%%, max %5.1f%%, mean %5.1f%%\n", source.c_str(),
                  e.count, e.median, e.max, e.mean);
    }
  }
  if (s.failures > 0) std::printf("%d of %d cases could not be simulated\n", s.failures, s.cases);
  if (!a.plans_dir.empty()) {
    std::printf(
        "wrote the plan and cluster of %d case%s to %s (replay one: nnsim simulate --topo "
        "%s/ID.topology.yaml %s/ID.json)\n",
        written, written == 1 ? "" : "s", a.plans_dir.c_str(), a.plans_dir.c_str(),
        a.plans_dir.c_str());
  }
  if (!a.json.empty()) {
    std::string error;
    if (!write_file(a.json, validation_json(out, s), &error)) return fail(error);
  }
  if (s.failures > 0) {
    return fail(fmt::format("{} of {} cases could not be simulated", s.failures, s.cases));
  }
  return 0;
}

}  // namespace nnsim::tool
