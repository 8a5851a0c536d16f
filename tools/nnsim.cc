// nnsim: the command-line driver. It parses arguments, calls the libraries and talks to the
// user; the libraries never print or exit.
//
//   nnsim --topo topologies/dgx-a100x4.yaml plan.json     (same as `nnsim simulate ...`)
//   nnsim plan --model gpt3-175b --topo dgx-a100x4 --tp 8 --pp 4 ... -o plan.json
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include "core/memory_check.h"
#include "core/model.h"
#include "core/plan.h"
#include "core/program.h"
#include "core/suggest.h"
#include "core/topology.h"
#include "core/units.h"
#include "hwexec/compare.h"
#include "hwexec/fit.h"
#include "hwexec/fit_network.h"
#include "hwexec/run.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/schedule_gen.h"
#include "planner/search.h"
#include "sim/report.h"
#include "sim/simulator.h"
#include "sim/trace.h"
#include "tools/cli_checks.h"
#include "validate/case_builder.h"
#include "validate/validate.h"

namespace nnsim {
namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "nnsim: error: %s\n", message.c_str());
  return 1;
}

// Loads the calibration file `path` into `storage` when one is given; the pointer the compile
// options take (null without a file).
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

Expected<Topology> load_topology_sized(const std::string& path, int nodes) {
  Expected<Topology> topo = load_topology(path);
  if (!topo || nodes <= 0) return topo;
  return resize_topology(*topo, nodes);
}

// Progress on a terminal only; pipes and files stay quiet.
class Progress {
 public:
  explicit Progress(const char* what) : what_(what), tty_(::isatty(STDERR_FILENO) != 0) {}
  ~Progress() { done(); }
  void update(double fraction) {
    if (!tty_) return;
    std::fprintf(stderr, "\r%s %3.0f%%", what_, 100 * fraction);
    std::fflush(stderr);
    shown_ = true;
  }
  void done() {
    if (shown_) std::fprintf(stderr, "\r%*s\r", 40, "");
    shown_ = false;
  }

 private:
  const char* what_;
  bool tty_;
  bool shown_ = false;
};

struct SimulateArgs {
  std::string topo;
  std::string plan;
  int nodes = 0;
  std::string json;
  std::string trace;
  std::string hdf5;
  bool trace_per_gpu = false;
  std::string fidelity = "symmetric";
  bool allow_oom = false;
  bool no_fold = false;
  std::string calib;
};

void add_simulate_options(CLI::App* app, SimulateArgs& a, bool required) {
  auto* topo = app->add_option("--topo", a.topo, "topology YAML file or preset name");
  auto* plan = app->add_option("plan", a.plan, "plan.json to simulate");
  if (required) {
    topo->required();
    plan->required();
  }
  app->add_option("--nodes", a.nodes, "resize the topology to this many nodes (what-if)")
      ->check(at_least(1));
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
  app->add_flag("--allow-oom", a.allow_oom,
                "simulate even when the plan does not fit in GPU memory (still exits non-zero)");
}

std::string lane_gpus(const LaneReport& l) {
  if (l.gpus.size() == 1) return std::to_string(l.gpus.front());
  auto [lo, hi] = std::minmax_element(l.gpus.begin(), l.gpus.end());
  return fmt::format("{}-{}", *lo, *hi);
}

void print_report(const Program& prog, const SimResult& r) {
  const Topology& t = prog.topology;
  std::printf(
      "%s\n",
      fmt::format(
          "{} on {} ({} x {}{})", prog.plan.name, t.name, r.num_gpus, t.gpu.name,
          r.num_gpus < t.num_gpus() ? fmt::format("; {} GPUs idle", t.num_gpus() - r.num_gpus) : "")
          .c_str());
  std::printf("  iteration time   %s (%d micro-batches per replica)\n",
              format_seconds(r.iteration_time).c_str(), r.micro_batches);
  std::printf("  throughput       %s tokens/s, %s per GPU (MFU %.1f%% of %s)\n",
              format_count(r.tokens_per_second).c_str(),
              format_flops(r.model_flops_per_gpu).c_str(), 100 * r.mfu,
              format_flops(r.peak_flops_per_gpu).c_str());
  const LaneReport& worst = worst_memory_lane(r);
  std::printf("  peak memory      %s of %s (GPU %d, %s)\n", format_bytes(worst.peak_memory).c_str(),
              format_bytes(t.gpu.hbm_bytes).c_str(), worst.gpus.front(), worst.name.c_str());
  std::printf("    %s\n",
              describe_memory_parts(worst.static_memory, worst.peak_activations).c_str());
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
}

int run_simulate(const SimulateArgs& a) {
  Expected<Topology> topo = load_topology_sized(a.topo, a.nodes);
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

  print_report(*prog, *result);
  std::string error;
  if (!a.json.empty() && !write_file(a.json, report_json(*prog, *result), &error)) {
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

struct PlanArgs {
  std::string model;
  std::string topo;
  int nodes = 0;
  MegatronOptions o;
  std::string recompute = "none";
  std::string schedule = "1f1b";
  std::string precision;
  std::string loss;  // the model's cross-entropy kernel, replaced
  std::string output;
  // Search.
  bool search = false;
  std::string constraints;
  int top = 10;
  int confirm = 5;
  int jobs = 0;
  std::string csv;
  SearchPins pins;  // what was given on the command line
  std::string calib;
  Calibration calibration;  // loaded from `calib`; a.o.costs points at it
};

std::string csv_escape(const std::string& s) {
  return s.find(',') == std::string::npos ? s : "\"" + s + "\"";
}

int run_search(PlanArgs& a, const ModelSpec& model, const Topology& topo) {
  SearchOptions so;
  so.global_batch = a.o.global_batch;
  so.precision = a.o.precision;
  so.framework = a.o.framework;
  so.tp_comm_overlap = a.o.tp_comm_overlap;
  so.compile = a.o.costs;
  so.pins = a.pins;
  so.top = a.top;
  so.confirm = a.confirm;
  so.jobs =
      a.jobs > 0 ? a.jobs : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!a.constraints.empty()) {
    Expected<Constraints> c = load_constraints(a.constraints);
    if (!c) return fail(c.error().message());
    so.constraints = *c;
  }
  for (int g : a.o.avoid_gpus) so.constraints.avoid_gpus.push_back(g);
  Progress progress("searching");
  so.progress = [&progress](const std::string& phase, size_t done, size_t all) {
    const double f = static_cast<double>(done) / all;
    if (phase == "estimating") progress.update(0.75 * f);
    if (phase == "balancing stages") progress.update(0.75 + 0.1 * f);
    if (phase == "placing ranks") progress.update(0.85 + 0.025 * f);
    if (phase == "scheduling") progress.update(0.875 + 0.025 * f);
    if (phase == "simulating") progress.update(0.9 + 0.1 * f);
  };
  so.simulate = [](const Program& p) -> Expected<double> {
    Expected<SimResult> r = simulate(p);
    if (!r) return r.error();
    return r->iteration_time;
  };
  Expected<SearchResult> r = search_plans(model, topo, so);
  progress.done();
  if (!r) return fail(r.error().message());
  std::printf("searched %zu candidates (%zu compiled and estimated, %zu confirmed by simulation)\n",
              r->enumerated, r->evaluated, r->confirmed);
  if (r->balanced > 0) {
    std::printf("stages re-partitioned for %zu pipelines; %zu beat their uniform split\n",
                r->balanced, r->balanced_better);
  }
  if (r->placements_tried > 0) {
    std::printf("%zu other rank placements tried for the best plans\n", r->placements_tried);
  }
  if (r->schedules_tried > 0) {
    std::printf(
        "%zu other pipeline schedules (zero bubble, Merak, Tessel) tried for the best pipelined "
        "plans\n",
        r->schedules_tried);
  }
  std::printf("%4s  %-60s %11s %11s %10s %6s\n", "rank", "plan", "estimated", "simulated",
              "peak mem", "MFU");
  int rank = 0;
  for (const Candidate& c : r->ranked) {
    const double mfu =
        c.simulated ? c.estimate.mfu * c.estimate.iteration_time / *c.simulated : c.estimate.mfu;
    std::printf("%4d  %-60s %11s %11s %10s %5.1f%%\n", ++rank, c.describe().c_str(),
                format_seconds(c.estimate.iteration_time).c_str(),
                c.simulated ? format_seconds(*c.simulated).c_str() : "-",
                format_bytes(c.estimate.peak_memory).c_str(), 100 * mfu);
  }
  if (!r->other_placements_of_best.empty()) {
    const auto& others = r->other_placements_of_best;
    std::printf("the best plan placed otherwise (%zu placements, mesh axes outermost first):\n",
                others.size());
    for (size_t i = 0; i < others.size(); ++i) {
      // The closest few, and the worst for scale.
      if (i >= 5 && i + 1 < others.size()) continue;
      const Candidate& c = others[i];
      std::printf(
          "      %-24s %11s  %+.1f%%\n", c.placement.c_str(),
          format_seconds(c.estimate.iteration_time).c_str(),
          100 * (c.estimate.iteration_time / r->ranked.front().estimate.iteration_time - 1));
    }
  }
  if (r->other_placements_of_best.empty() && r->best_per_placement.size() > 1) {
    std::printf("best plan per rank placement:\n");
    for (const Candidate& c : r->best_per_placement) {
      std::printf("      %-60s %11s  (%s)\n", c.describe().c_str(),
                  format_seconds(c.time()).c_str(), c.placement.c_str());
    }
  }
  if (!r->rejected.empty()) {
    std::printf("faster plans that lost:\n");
    for (const Candidate& c : r->rejected) {
      if (c.estimate.iteration_time >= r->ranked.front().time()) continue;
      std::printf("      %-60s %11s  %s\n", c.describe().c_str(),
                  format_seconds(c.estimate.iteration_time).c_str(), c.status.c_str());
    }
  }
  std::printf("candidates removed:");
  for (const auto& [why, n] : r->rejections) std::printf(" %s %zu;", why.c_str(), n);
  std::printf("\n");
  if (r->rank_pairs > 0) {
    std::printf("estimator vs simulator: %zu of %zu pairs of confirmed plans ranked differently\n",
                r->rank_disagreements, r->rank_pairs);
  }
  std::string error;
  if (!a.csv.empty()) {
    std::string csv =
        "rank,plan,tp,pp,vpp,cp,dp,micro_batch,sequence_parallel,recompute,zero,schedule,"
        "placement,stage_layers,recompute_layers,estimated_s,simulated_s,peak_memory_bytes,mfu,"
        "status\n";
    int k = 0;
    auto row = [&](const Candidate& c, const std::string& rank_text) {
      const MegatronOptions& o = c.options;
      csv += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n", rank_text,
                         csv_escape(c.describe()), o.tp, o.pp, o.vpp, o.cp, o.dp, o.micro_batch,
                         o.sequence_parallel ? 1 : 0, to_string(o.recompute), o.zero,
                         to_string(o.schedule), c.placement, fmt::join(o.stage_layers, ";"),
                         fmt::join(o.recompute_layers, ";"), c.estimate.iteration_time,
                         c.simulated ? fmt::format("{}", *c.simulated) : "", c.estimate.peak_memory,
                         c.estimate.mfu, csv_escape(c.status));
    };
    for (const Candidate& c : r->ranked) row(c, std::to_string(++k));
    for (const Candidate& c : r->rejected) row(c, "");
    if (!write_file(a.csv, csv, &error)) return fail(error);
  }
  if (!write_file(a.output, plan_to_json(r->best), &error)) return fail(error);
  std::printf("wrote %s: %s\n", a.output.c_str(), r->best.name.c_str());
  return 0;
}

struct ScheduleArgs {
  std::string plan;
  std::string topo;  // default: the topology the plan names
  int nodes = 0;
  std::string generator;
  bool search = false;  // Tessel's repetend search instead of a generator
  std::string memory_limit;
  std::string output;
  std::string calib;
};

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

int run_plan(PlanArgs& a) {
  Expected<ModelSpec> model = load_model(a.model);
  if (!model) return fail(model.error().message());
  if (!a.loss.empty()) {
    Expected<LossKernel> loss = parse_loss_kernel(a.loss);
    if (!loss) return fail("--loss: " + loss.error().message());
    model->loss = *loss;
  }
  Expected<Topology> topo = load_topology_sized(a.topo, a.nodes);
  if (!topo) return fail(topo.error().message());
  Expected<RecomputeMode> rec = parse_recompute_mode(a.recompute);
  if (!rec) return fail("--recompute: " + rec.error().message());
  a.o.recompute = *rec;
  Expected<ScheduleKind> sched = parse_schedule_kind(a.schedule);
  if (!sched) return fail("--schedule: " + sched.error().message());
  a.o.schedule = *sched;
  if (!a.precision.empty()) {
    static const std::pair<const char*, Precision> kNames[] = {{"fp32", Precision::kFp32},
                                                               {"tf32", Precision::kTf32},
                                                               {"bf16", Precision::kBf16},
                                                               {"fp16", Precision::kFp16},
                                                               {"fp8", Precision::kFp8}};
    bool found = false;
    for (const auto& [n, p] : kNames) {
      if (a.precision == n) {
        a.o.precision = p;
        found = true;
      }
    }
    if (!found) return fail("--precision: expected one of fp32, tf32, bf16, fp16, fp8");
  }
  Expected<const Calibration*> calib = optional_calibration(a.calib, a.calibration);
  if (!calib) return fail(calib.error().message());
  a.o.costs.calibration = *calib;
  if (a.search) return run_search(a, *model, *topo);
  Expected<Plan> plan = build_megatron_plan(*model, *topo, a.o);
  if (!plan) return fail(plan.error().message());
  // The plan must compile on its topology: check now rather than at simulation time.
  Expected<Program> prog = compile_plan(*plan, *topo, a.o.costs);
  if (!prog) return fail(prog.error().message());
  std::string error;
  if (!write_file(a.output, plan_to_json(*plan), &error)) return fail(error);
  std::printf("wrote %s: %s\n", a.output.c_str(), plan->name.c_str());
  if (Status fits = check_memory_fits(*prog); !fits) {
    std::fprintf(stderr, "nnsim: warning: %s\n", fits.error().message().c_str());
  }
  return 0;
}

struct ValidateArgs {
  std::string set;
  std::string json;
  std::string calib;
  std::vector<std::string> only;
  std::string plans_dir;
  int jobs = 0;
};

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
  if (!a.plans_dir.empty()) {
    // The plans exactly as simulated, for inspection or for `nnsim simulate`.
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
      std::string error;
      if (!write_file(a.plans_dir + "/" + c.id + ".json", plan_to_json(*plan), &error)) {
        return fail(error);
      }
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
  if (!a.json.empty()) {
    std::string error;
    if (!write_file(a.json, validation_json(out, s), &error)) return fail(error);
  }
  if (s.failures > 0) {
    return fail(fmt::format("{} of {} cases could not be simulated", s.failures, s.cases));
  }
  return 0;
}

struct CalibrateArgs {
  std::vector<std::string> inputs;  // at most one nnexec bench file, any number of run files
  std::string gpu;
  std::string output;
  std::string topo;  // the machines' topology: the network's bandwidth (run files)
  int nodes = 0;
};

// nnsim calibrate: fits the cost model to an `nnexec bench` file and/or `nnexec run` files
// (docs/hwexec.md).
int run_calibrate(const CalibrateArgs& a) {
  std::optional<hwexec::MicroResults> micro;
  std::string micro_path;
  std::vector<std::pair<std::string, hwexec::RunResults>> runs;
  for (const std::string& path : a.inputs) {
    Expected<std::string> format = hwexec::hdf5_format(path);
    if (!format) {
      return fail(
          fmt::format("{}; give an nnexec bench file (nnexec bench --out) or nnexec run "
                      "files (nnexec run --out)",
                      format.error().message()));
    }
    if (*format == hwexec::kRunFormat) {
      Expected<hwexec::RunResults> run = hwexec::read_run(path);
      if (!run) return fail(run.error().message());
      runs.emplace_back(path, std::move(*run));
    } else {
      if (micro) {
        return fail(
            fmt::format("{} and {} are both microbenchmark files; give one", micro_path, path));
      }
      Expected<hwexec::MicroResults> m = hwexec::read_micro(path);
      if (!m) return fail(m.error().message());
      micro = std::move(*m);
      micro_path = path;
    }
  }
  std::optional<Topology> topo;
  if (!a.topo.empty()) {
    Expected<Topology> t = load_topology_sized(a.topo, a.nodes);
    if (!t) return fail("--topo: " + t.error().message());
    if (runs.empty()) {
      return fail(fmt::format(
          "--topo {}: only run files (nnexec run) have collectives across machines to fit the "
          "network with; give one, or leave --topo out",
          a.topo));
    }
    if (!a.gpu.empty() && a.gpu != t->gpu.name) {
      return fail(
          fmt::format("--gpu {} and --topo {} (GPU {}) differ: nnsim compare and simulate read the "
                      "calibration of the topology's GPU; leave --gpu out or give the same GPU",
                      a.gpu, a.topo, t->gpu.name));
    }
    topo = std::move(*t);
  } else if (a.nodes > 0) {
    return fail("--nodes resizes the topology: give --topo too");
  }
  // The GPU: --gpu, else the topology's, else the one the CUDA microbenchmark file names. CPU
  // files need one of the first two.
  std::string gpu_name = a.gpu.empty() && topo ? topo->gpu.name : a.gpu;
  if (gpu_name.empty()) {
    if (micro && micro->device == "cpu") {
      return fail(fmt::format(
          "{} was measured on a CPU ('{}'), which has no catalog entry: name the catalog GPU "
          "whose parameters it should set with --gpu (its efficiencies are then relative to that "
          "GPU's datasheet peaks; docs/hwexec.md)",
          micro_path, micro->device_name));
    }
    for (const auto& [path, run] : runs) {
      if (run.device == "cpu") {
        return fail(fmt::format(
            "{} was run on a CPU, which has no catalog entry: name the catalog GPU whose "
            "parameters it should set with --gpu (the topology's GPU, for nnsim compare; "
            "docs/hwexec.md)",
            path));
      }
    }
    if (!micro) {
      return fail(fmt::format("{} does not name its GPU model: give --gpu", runs.front().first));
    }
    Expected<std::string> matched = hwexec::match_catalog_gpu(micro->device_name);
    if (!matched) return fail(fmt::format("{}: {}", micro_path, matched.error().message()));
    gpu_name = *matched;
  }
  Expected<GpuSpec> gpu = find_gpu(gpu_name);
  if (!gpu) return fail("--gpu: " + gpu.error().message());

  std::vector<hwexec::RunPoints> points;
  std::string source = "nnsim calibrate";
  if (micro) {
    source += fmt::format(" {} (nnexec bench on {} '{}', LibTorch {})", micro_path, micro->device,
                          micro->device_name, micro->torch_version);
  }
  bool cpu = micro && micro->device == "cpu";
  for (const auto& [path, run] : runs) {
    Expected<Plan> plan = hwexec::plan_of_run(run, path, "");
    if (!plan) return fail(plan.error().message());
    Expected<hwexec::RunPoints> p = hwexec::run_points(run, *plan, *gpu, path);
    if (!p) return fail(p.error().message());
    if (topo) {
      if (Status s = hwexec::price_cross_host(run, *plan, *topo, path, *p); !s) {
        return fail(s.error().message());
      }
    }
    points.push_back(std::move(*p));
    source += fmt::format(" {} (nnexec run of '{}' on {}, {} ranks, LibTorch {})", path,
                          run.plan_name, run.device, run.world, run.torch_version);
    cpu = cpu || run.device == "cpu";
  }
  if (cpu) source += fmt::format("; relative to {}'s datasheet", gpu->name);
  if (topo) source += fmt::format("; network relative to {}'s links", topo->name);
  const std::string inputs = fmt::format("{}", fmt::join(a.inputs, " "));
  Expected<hwexec::Fit> fit =
      hwexec::fit_all(micro ? &*micro : nullptr, micro_path, points, *gpu, source);
  if (!fit) return fail(fmt::format("{}: {}", inputs, fit.error().message()));
  Calibration c;
  c.gpus[gpu->name] = fit->calibration;
  if (Status s = save_calibration(a.output, c); !s) return fail(s.error().message());

  std::printf("%s -> %s (%s)\n", inputs.c_str(), a.output.c_str(), gpu->name.c_str());
  if (cpu) {
    std::printf("  note: measured on a CPU; efficiencies are relative to %s's datasheet\n",
                gpu->name.c_str());
  }
  for (const hwexec::GemmFit& g : fit->gemm) {
    const std::string at = g.m > 0 ? fmt::format("{:.0f}x{:.0f}x{:.0f}", g.m, g.n, g.k) : g.best;
    std::printf(
        "  gemm_efficiency_%-4s %.4g  (relative least squares over %d GEMMs: median error %.1f%%, "
        "max %.1f%%, %d slower and %d faster than measured; best %.4g FLOP/s, e %.4g, at %s of "
        "%.4g peak)\n",
        std::string(to_string(g.precision)).c_str(), g.efficiency, g.samples, 100 * g.median_error,
        100 * g.max_error, g.slower, g.faster, g.best_flops, g.best_efficiency, at.c_str(), g.peak);
  }
  if (fit->memory) {
    const hwexec::MemoryFit& m = *fit->memory;
    if (m.fixed_bandwidth) {
      std::printf(
          "  memory_efficiency    %.4g  (%.4g bytes/s of %.4g, fixed: %s; the free line over %s "
          "gave %.4g, above HBM)\n",
          m.efficiency, m.bandwidth, gpu->hbm_bandwidth, m.bandwidth_from.c_str(), m.from.c_str(),
          m.free_bandwidth);
    } else {
      std::printf("  memory_efficiency    %.4g  (%.4g bytes/s of %.4g; from %s)\n", m.efficiency,
                  m.bandwidth, gpu->hbm_bandwidth, m.from.c_str());
    }
    std::printf("  kernel_overhead      %.4g s  (%s over %d kernels: median %.1f%%, max %.1f%%)\n",
                m.overhead, m.fixed_bandwidth ? "fitted with the bandwidth fixed" : "line fit",
                m.samples, 100 * m.median_error, 100 * m.max_error);
    for (const auto& op : m.per_op) {
      std::printf("    %-16s alone: %.4g bytes/s, %.4g s per kernel\n", op.op.c_str(), op.bandwidth,
                  op.overhead);
    }
  }
  if (fit->attention) {
    const hwexec::AttentionFit& at = *fit->attention;
    std::printf("  attention_fwd_efficiency %.4g  (%s %s, %d shapes, of %.4g 16-bit peak)\n",
                at.fwd_efficiency, at.dtype.c_str(), at.kernel.c_str(), at.samples, at.peak);
    std::printf("  attention_bwd_efficiency %.4g\n", at.bwd_efficiency);
    std::printf(
        "  attention_seq_half   %.4g%s  (model error over %d forwards and backwards: "
        "median %.1f%%, max %.1f%%)\n",
        at.seq_half, at.seq_half_fitted ? "" : " (built-in, kept)", 2 * at.samples,
        100 * at.median_error, 100 * at.max_error);
  }
  for (const auto& [name, link] :
       {std::pair{"nvlink", &fit->nvlink}, std::pair{"network", &fit->network}}) {
    if (!*link) continue;
    const hwexec::LinkFit& l = **link;
    std::string what =
        fmt::format("step latency {}", format_seconds(l.link.step_latency.value_or(0)));
    if (l.link.max_efficiency)
      what += fmt::format(", max efficiency {:.3g}", *l.link.max_efficiency);
    if (l.link.all_reduce_max_efficiency) {
      what += fmt::format(", all-reduce {:.3g}", *l.link.all_reduce_max_efficiency);
    }
    if (!l.link.curve.empty()) what += fmt::format(", {} curve points", l.link.curve.size());
    std::printf("  %-20s %s  (%d GPUs, %s)\n", name, what.c_str(), l.ranks,
                fmt::format("{}", fmt::join(l.from, ", ")).c_str());
    for (const hwexec::LinkFit::GroupCheck& c : l.checks) {
      std::printf("    %s over %d GPUs: model error median %.1f%%, max %.1f%% (%d sizes)\n",
                  c.kind.c_str(), c.ranks, 100 * c.median_error, 100 * c.max_error, c.samples);
    }
  }
  for (const std::string& n : fit->notes) std::printf("  note: %s\n", n.c_str());
  return 0;
}

struct CompareArgs {
  std::string run;
  std::string topo;
  int nodes = 0;
  std::string plan;
  std::string calib;
  std::string json;
};

std::string percent(double error) {
  return std::isfinite(error) ? fmt::format("{:+.1f}%", 100 * error) : std::string("n/a");
}

std::string seconds_or_na(double s) {
  return std::isfinite(s) ? format_seconds(s) : std::string("n/a");
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

}  // namespace
}  // namespace nnsim

int main(int argc, char** argv) {
  using namespace nnsim;
  CLI::App app{"nnsim: simulate distributed LLM training plans on GPU clusters"};
  app.set_version_flag("--version", "nnsim 0.1.0");
  SimulateArgs top;
  add_simulate_options(&app, top, false);

  SimulateArgs sim;
  CLI::App* simulate_cmd = app.add_subcommand("simulate", "simulate one training iteration");
  add_simulate_options(simulate_cmd, sim, true);

  PlanArgs plan;
  CLI::App* plan_cmd = app.add_subcommand("plan", "build a fully pinned Megatron-style plan");
  plan_cmd->add_option("--model", plan.model, "model YAML file or preset name")->required();
  plan_cmd->add_option("--topo", plan.topo, "topology YAML file or preset name")->required();
  plan_cmd->add_option("--nodes", plan.nodes, "resize the topology to this many nodes")
      ->check(at_least(1));
  plan_cmd->add_option("--tp", plan.o.tp, "tensor-parallel degree");
  plan_cmd->add_option("--pp", plan.o.pp, "pipeline-parallel degree (stages)");
  plan_cmd->add_option("--dp", plan.o.dp, "data-parallel degree (default: GPUs / (tp pp cp))")
      ->check(at_least(1));
  plan_cmd->add_option("--cp", plan.o.cp, "context-parallel degree");
  plan_cmd->add_option("--vpp", plan.o.vpp, "model chunks per pipeline rank (interleaved)");
  plan_cmd->add_flag("--sequence-parallel", plan.o.sequence_parallel,
                     "Megatron sequence parallelism inside tensor-parallel groups");
  plan_cmd->add_flag("--shard-head", plan.o.shard_head,
                     "the head as a segment spanning every pipeline stage, vocabulary split "
                     "over pp (1f1b, gpipe or tessel; builder only)");
  plan_cmd->add_flag("--shard-embedding", plan.o.shard_embedding,
                     "the embedding as a segment spanning every pipeline stage, vocabulary "
                     "split over pp (--schedule tessel; builder only)");
  plan_cmd->add_option("--micro-batch", plan.o.micro_batch, "sequences per micro-batch");
  plan_cmd->add_option("--recycle", plan.o.recycle,
                       "forward passes per micro-batch before its backward (AlphaFold's "
                       "recycling; gpipe, 1f1b or tessel; builder only)");
  plan_cmd->add_option("--global-batch", plan.o.global_batch, "sequences per optimizer step")
      ->required();
  plan_cmd->add_option("--recompute", plan.recompute, "none, selective or full");
  plan_cmd->add_option("--zero", plan.o.zero, "optimizer sharding stage 0-3");
  plan_cmd->add_option("--schedule", plan.schedule,
                       "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v (with --vpp 2) or merak");
  plan_cmd->add_option("--precision", plan.precision, "fp32, tf32, bf16, fp16 or fp8");
  plan_cmd->add_option("--loss", plan.loss,
                       "the training code's cross-entropy, replacing the model's: fused, "
                       "vocab_parallel (Megatron's default), unfused (PyTorch), loss_parallel "
                       "(PyTorch under tensor parallelism), flash_attn (llm-foundry)");
  plan_cmd->add_option("--framework", plan.o.framework,
                       "whose kernels and conventions: megatron, fsdp, deepspeed, other");
  plan_cmd->add_flag("--tp-comm-overlap", plan.o.tp_comm_overlap,
                     "overlap tensor-parallel collectives with GEMMs (Transformer Engine)");
  plan_cmd
      ->add_option("--zero3-persistence-threshold", plan.o.zero3_persistence_threshold,
                   "DeepSpeed ZeRO-3: tensors of fewer elements stay whole on every GPU "
                   "(stage3_param_persistence_threshold; default 1e5)")
      ->check(at_least(0));
  plan_cmd
      ->add_option("--stage-layers", plan.o.stage_layers,
                   "layers per segment (pp x vpp numbers), default as even as possible")
      ->delimiter(',');
  plan_cmd
      ->add_option("--placement", plan.o.placement,
                   "rank order over the GPUs, outermost first (default pp,dp,cp,tp); an axis "
                   "may be split: tp:2,pp,dp,cp,tp puts TP 8 as 2 x 4")
      ->delimiter(',');
  plan_cmd
      ->add_option("--avoid-gpus", plan.o.avoid_gpus,
                   "GPUs (indices) no rank may use; the degrees use what is left")
      ->delimiter(',');
  plan_cmd
      ->add_option("--recompute-layers", plan.o.recompute_layers,
                   "per segment, how many of its first layers are fully recomputed")
      ->delimiter(',');
  plan_cmd->add_option("-o,--output", plan.output, "where to write plan.json")->required();
  plan_cmd->add_flag("--search", plan.search,
                     "search the choices not given (implied when --tp or --pp is missing)");
  plan_cmd->add_option("--constraints", plan.constraints, "constraints file (YAML) for the search");
  plan_cmd->add_option("--top", plan.top, "plans shown in the ranked table (default 10)");
  plan_cmd->add_option("--confirm", plan.confirm,
                       "best estimates confirmed by simulation (default 5)");
  plan_cmd->add_option("--jobs", plan.jobs, "candidates evaluated at once (default: cores)");
  plan_cmd->add_option("--csv", plan.csv, "write the ranked and rejected plans as CSV");
  plan_cmd->add_option("--calib", plan.calib,
                       "calibration file (HDF5): estimate, schedule and simulate with its cost "
                       "model");

  ScheduleArgs sched;
  CLI::App* schedule_cmd = app.add_subcommand(
      "schedule", "rewrite a plan's pipeline block orders with a schedule generator");
  schedule_cmd->add_option("--plan", sched.plan, "plan.json to reschedule")->required();
  schedule_cmd->add_option("--topo", sched.topo,
                           "topology YAML file or preset (default: the one the plan names)");
  schedule_cmd->add_option("--nodes", sched.nodes, "resize the topology to this many nodes")
      ->check(at_least(1));
  schedule_cmd->add_option("--generator", sched.generator,
                           "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v or merak");
  schedule_cmd->add_flag("--search", sched.search,
                         "search the plan's own placement for a repeating schedule (Tessel, Z3)");
  schedule_cmd->add_option(
      "--memory-limit", sched.memory_limit,
      "bytes per GPU the schedule may use (e.g. 60GB); zb-h1, zb-h2, zb-v, merak, --search "
      "(default: the plan's current peak)");
  schedule_cmd->add_option("--calib", sched.calib,
                           "calibration file (HDF5): time the blocks with its cost model");
  schedule_cmd->add_option("-o,--output", sched.output, "where to write the plan")->required();

  ValidateArgs validate;
  CLI::App* validate_cmd =
      app.add_subcommand("validate", "simulate published runs and compare with their measurements");
  validate_cmd->add_option("set", validate.set, "validation set YAML (shared/validation schema)")
      ->required();
  validate_cmd->add_option("--json", validate.json, "write per-case results and the summary");
  validate_cmd->add_option("--jobs", validate.jobs, "simulations run at once (default: cores)");
  validate_cmd
      ->add_option("--only", validate.only,
                   "simulate only these case ids (space- or comma-separated; '*' matches any "
                   "run of characters: 'mosaic-*-h100*')")
      ->delimiter(',');
  validate_cmd->add_option("--write-plans", validate.plans_dir,
                           "write every case's plan (as simulated) into this folder (created if "
                           "missing)");
  validate_cmd->add_option("--calib", validate.calib,
                           "calibration file (HDF5) replacing the cost model's constants");

  std::vector<std::string> export_gpus;
  std::string export_out, export_attention, export_framework;
  CLI::App* calib_cmd = app.add_subcommand("calibration", "calibration files");
  CLI::App* export_cmd =
      calib_cmd->add_subcommand("export", "write the built-in cost model as a calibration file");
  export_cmd->add_option("--gpu", export_gpus, "catalog GPU (repeatable)")->required();
  export_cmd->add_option("--attention", export_attention, "attention kernels: flash2 or fused3")
      ->check(CLI::IsMember({"flash2", "fused3"}));
  export_cmd
      ->add_option("--framework", export_framework,
                   "the model a plan of this framework gets (its attention library and "
                   "elementwise fusion): megatron, fsdp, deepspeed or other")
      ->check(CLI::IsMember({"megatron", "fsdp", "deepspeed", "other"}))
      ->excludes("--attention");
  export_cmd->add_option("-o,--output", export_out, "the HDF5 file to write")->required();
  calib_cmd->require_subcommand(1);

  CalibrateArgs calibrate;
  CLI::App* calibrate_cmd = app.add_subcommand(
      "calibrate",
      "fit the cost model to microbenchmarks (nnexec bench) and/or runs (nnexec run) into a "
      "calibration file");
  calibrate_cmd
      ->add_option("files", calibrate.inputs,
                   "an nnexec bench file (micro.h5) and/or nnexec run files (run.h5)")
      ->required();
  calibrate_cmd->add_option("--gpu", calibrate.gpu,
                            "catalog GPU to calibrate (default: the microbenchmark file's "
                            "device; required for CPU files and run files)");
  calibrate_cmd->add_option("-o,--output", calibrate.output, "the calibration file to write")
      ->required();
  calibrate_cmd->add_option("--topo", calibrate.topo,
                            "topology YAML file or preset name whose nodes are the run files' "
                            "machines: fits the network's efficiency relative to its links "
                            "(default GPU: its GPU)");
  calibrate_cmd->add_option("--nodes", calibrate.nodes, "resize the topology to this many nodes")
      ->check(at_least(1));

  CompareArgs compare;
  CLI::App* compare_cmd = app.add_subcommand(
      "compare",
      "compare a run file (nnexec run) with the simulator, per operator, collective "
      "and iteration");
  compare_cmd->add_option("run", compare.run, "nnexec run output (HDF5)")->required();
  compare_cmd->add_option("plan", compare.plan,
                          "plan.json (default: the plan embedded in the run file; must match it)");
  compare_cmd->add_option("--topo", compare.topo, "topology YAML file or preset name")->required();
  compare_cmd->add_option("--nodes", compare.nodes, "resize the topology to this many nodes")
      ->check(at_least(1));
  compare_cmd->add_option("--calib", compare.calib,
                          "calibration file (HDF5) replacing the cost model's constants");
  compare_cmd->add_option("--json", compare.json, "write the comparison as JSON (SI units)");

  if (std::optional<int> done = parse_command_line(app, argc, argv, "nnsim")) return *done;
  if (simulate_cmd->parsed()) return run_simulate(sim);
  if (plan_cmd->parsed()) {
    // What the user pinned; the search explores the rest.
    auto given = [&](const char* name) { return plan_cmd->count(name) > 0; };
    SearchPins& p = plan.pins;
    if (given("--tp")) p.tp = plan.o.tp;
    if (given("--pp")) p.pp = plan.o.pp;
    if (given("--dp")) p.dp = plan.o.dp;
    if (given("--cp")) p.cp = plan.o.cp;
    if (given("--vpp")) p.vpp = plan.o.vpp;
    if (given("--micro-batch")) p.micro_batch = plan.o.micro_batch;
    if (given("--zero")) p.zero = plan.o.zero;
    if (given("--sequence-parallel")) p.sequence_parallel = true;
    if (given("--stage-layers")) p.stage_layers = plan.o.stage_layers;
    if (given("--placement")) p.placement = plan.o.placement;
    if (given("--recompute")) {
      Expected<RecomputeMode> r = parse_recompute_mode(plan.recompute);
      if (!r) return fail("--recompute: " + r.error().message());
      p.recompute = *r;
    }
    if (given("--schedule")) {
      Expected<ScheduleKind> s = parse_schedule_kind(plan.schedule);
      if (!s) return fail("--schedule: " + s.error().message());
      p.schedule = *s;
    }
    if (!p.tp || !p.pp) plan.search = true;
    if (plan.search && (given("--shard-head") || given("--shard-embedding"))) {
      return fail(
          "--shard-head and --shard-embedding are for the builder: give --tp and --pp (the "
          "search does not shard the head or the embedding)");
    }
    if (plan.search && given("--recycle")) {
      return fail(
          "--recycle is for the builder: give --tp and --pp (the plan search does not place "
          "repeated forwards)");
    }
    if (plan.search && given("--recompute-layers")) {
      return fail(
          "--recompute-layers pins the builder's per-stage recomputation; the search chooses "
          "it (give --tp and --pp without --search to build a plan with it)");
    }
    return run_plan(plan);
  }
  if (validate_cmd->parsed()) return run_validate(validate);
  if (schedule_cmd->parsed()) return run_schedule(sched);
  if (calibrate_cmd->parsed()) return run_calibrate(calibrate);
  if (compare_cmd->parsed()) return run_compare(compare);
  if (export_cmd->parsed()) {
    Calibration c;
    for (const auto& name : export_gpus) {
      Expected<GpuSpec> gpu = find_gpu(name);
      if (!gpu) return fail("--gpu: " + gpu.error().message());
      const AttentionLibrary lib =
          export_attention == "fused3" ? AttentionLibrary::kFused3 : AttentionLibrary::kFlash2;
      ComputeModel compute = ComputeModel::defaults_for(*gpu, lib);
      if (!export_framework.empty()) {
        Plan plan;
        plan.framework = export_framework;
        compute = default_compute_model(plan, *gpu);
      }
      c.gpus[name] = describe_models(compute, CommModel::defaults_for(*gpu),
                                     "nnsim built-in defaults (docs/cost-model.md)");
    }
    if (Status s = save_calibration(export_out, c); !s) return fail(s.error().message());
    std::printf("wrote %s\n", export_out.c_str());
    return 0;
  }
  if (top.topo.empty() || top.plan.empty()) {
    std::fprintf(stderr, "%s", app.help().c_str());
    return fail("give a topology and a plan: nnsim --topo TOPOLOGY.yaml plan.json");
  }
  return run_simulate(top);
}
