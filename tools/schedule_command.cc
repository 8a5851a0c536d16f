#include "tools/schedule_command.h"

#include <cstdio>
#include <optional>

#include <fmt/format.h>

#include "core/plan.h"
#include "core/program.h"
#include "core/units.h"
#include "planner/estimator.h"
#include "planner/schedule_gen.h"
#include "tools/cli_checks.h"
#include "tools/driver.h"

namespace nnsim::tool {

CLI::App* add_schedule_command(CLI::App& app, ScheduleArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "schedule", "rewrite a plan's pipeline block orders with a schedule generator");
  cmd->add_option("--plan", a.plan, "plan.json to reschedule")->required();
  cmd->add_option("--topo", a.topo,
                  "topology YAML file or preset (default: the one the plan names)");
  cmd->add_option("--nodes", a.nodes, "resize the topology to this many nodes")->check(at_least(1));
  cmd->add_option("--generator", a.generator,
                  "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipev or merak");
  cmd->add_flag("--search", a.search,
                "search the plan's own placement for a repeating schedule (Tessel, Z3)");
  cmd->add_option(
      "--memory-limit", a.memory_limit,
      "bytes per GPU the schedule may use (e.g. 60GB); zb-h1, zb-h2, zb-v, merak, --search "
      "(default: the plan's current peak)");
  cmd->add_option("--calib", a.calib,
                  "calibration file (HDF5): time the blocks with its cost model");
  cmd->add_option("-o,--output", a.output, "where to write the plan")->required();
  return cmd;
}

int run_schedule(const ScheduleArgs& a) {
  Expected<Plan> plan = load_plan(a.plan);
  if (!plan) return fail(plan.error().message());
  std::string topo_name = a.topo.empty() ? plan->topology_name : a.topo;
  if (topo_name.empty()) return fail(a.plan + ": the plan names no topology; give --topo");
  int nodes = a.nodes;
  Expected<Topology> topo = load_topology_sized(topo_name, nodes);
  if (!topo) return fail(topo.error().message());
  if (nodes == 0 && plan->topology_gpus > 0 && plan->topology_gpus != topo->num_gpus() &&
      plan->topology_gpus % topo->gpus_per_node == 0) {
    // A preset resized with --nodes when the plan was built.
    topo = resize_topology(*topo, plan->topology_gpus / topo->gpus_per_node);
    if (!topo) return fail(topo.error().message());
  }
  if (a.search == !a.generator.empty()) {
    return fail("nnsim schedule: give either --generator NAME or --search");
  }
  std::optional<double> limit;
  if (!a.memory_limit.empty()) {
    Expected<double> bytes = parse_quantity(a.memory_limit, Dimension::kBytes);
    if (!bytes || *bytes <= 0) {
      return fail(fmt::format("--memory-limit '{}': give bytes per GPU, e.g. 60GB or 64GiB",
                              a.memory_limit));
    }
    limit = *bytes;
  }
  // The blocks are timed with the cost model the plan will be simulated with.
  CompileOptions compile;
  Calibration storage;
  Expected<const Calibration*> calib = optional_calibration(a.calib, storage);
  if (!calib) return fail(calib.error().message());
  compile.calibration = *calib;
  Expected<Program> before = compile_plan(*plan, *topo, compile);
  if (!before) return fail(fmt::format("{}: {}", a.plan, before.error().message()));
  Expected<Plan> out = Error("");
  std::optional<SearchedSchedule> searched;
  if (a.search) {
    Expected<SearchedSchedule> s = search_schedule(*plan, *topo, limit, compile);
    if (!s) return fail(fmt::format("{}: {}", a.plan, s.error().message()));
    out = s->plan;
    searched = std::move(*s);
  } else {
    Expected<ScheduleKind> kind = parse_schedule_kind(a.generator);
    if (!kind) return fail("--generator: " + kind.error().message());
    out = generate_schedule(*plan, *topo, *kind, limit, compile);
  }
  if (!out) return fail(fmt::format("{}: {}", a.plan, out.error().message()));
  const std::string name = a.search ? "tessel" : a.generator;
  // The new orders go through the same checks as any plan (dependencies, deadlock).
  Expected<Program> after = compile_plan(*out, *topo, compile);
  if (!after) return fail(after.error().message());
  const Estimate e0 = estimate_program(*before), e1 = estimate_program(*after);
  if (limit && e1.peak_memory > *limit) {
    return fail(
        fmt::format("the {} schedule needs {} per GPU, over --memory-limit {}; raise the "
                    "limit or recompute activations (the plan's weights, gradients and "
                    "optimizer state alone take {})",
                    name, format_bytes(e1.peak_memory), format_bytes(*limit),
                    format_bytes(after->lanes.front().memory.total())));
  }
  std::string error;
  if (!write_file(a.output, plan_to_json(*out), &error)) return fail(error);
  std::printf("wrote %s: %s schedule, %zu schedule orders, %d micro-batches\n", a.output.c_str(),
              searched && searched->kept_input ? out->schedule_name.c_str() : name.c_str(),
              out->schedule.size(), out->num_micro_batches());
  if (searched) {
    const TesselSchedule& t = searched->tessel;
    std::printf(
        "  repetend of %s per micro-batch (busiest device's work %s), backward %s, %d solver "
        "calls; blocks and transfers between them: %s (was %s)%s\n",
        format_seconds(t.period).c_str(), format_seconds(t.lower_bound).c_str(),
        searched->split_backward ? "split" : "whole", t.solver_calls,
        format_seconds(t.makespan).c_str(), format_seconds(searched->input_makespan).c_str(),
        t.ends_searched         ? ", warm-up and cool-down searched"
        : t.ends_list_scheduled ? ", warm-up and cool-down list-scheduled"
                                : "");
    if (searched->kept_input) {
      std::printf("  no faster schedule than the plan's own orders: kept them\n");
    }
  }
  std::printf("  estimated iteration %s (was %s with %s), peak memory %s (was %s)\n",
              format_seconds(e1.iteration_time).c_str(), format_seconds(e0.iteration_time).c_str(),
              plan->schedule_name.empty() ? "the plan's orders" : plan->schedule_name.c_str(),
              format_bytes(e1.peak_memory).c_str(), format_bytes(e0.peak_memory).c_str());
  return 0;
}

}  // namespace nnsim::tool
