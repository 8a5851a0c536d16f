#include "tools/sweep_command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/json_format.h"
#include "core/plan.h"
#include "core/training_time.h"
#include "core/units.h"
#include "planner/search.h"
#include "sim/report.h"
#include "sim/sensitivity.h"
#include "sim/simulator.h"
#include "tools/cli_checks.h"
#include "tools/driver.h"

namespace nnsim::tool {
namespace {

// A field swept over its values: "FIELD=V1,V2" as "FIELD=V1", "FIELD=V2".
struct Varied {
  std::string flag;  // "--vary" (topology) or "--vary-model"
  std::string field;
  std::vector<std::string> sets = {""};  // "FIELD=V" each ({""}: not varied)
  size_t width = 0;                      // of the column: the field or its longest value
};

// One point of the sweep: a cluster size, a global batch, a topology and a model field's value.
struct Point {
  int nodes = 0;
  int global_batch = 0;
  std::string set;        // "FIELD=VALUE" (--vary), or empty
  std::string model_set;  // "FIELD=VALUE" (--vary-model), or empty
  int group = 0;          // points that differ only in nodes share one: scaling is read along it
};

// What a row reads from a simulation of the point's best plan (peak memory: the fullest GPU's;
// lane and breakdown: the lane that waits least, a pipeline's slowest stage).
struct Simulated {
  double iteration_time = 0;
  double tokens_per_s = 0;
  double mfu = 0;
  double peak_memory = 0;
  std::string lane;
  Breakdown breakdown;
};

// What the search found at a point.
struct Row {
  Point point;
  int gpus = 0;
  std::string status = "ok";  // or why no plan came out
  Plan best;
  std::string choices;  // the search's words for it: "tp2 pp4 dp2 mb1 sp none zero1 1f1b"
  Simulated sim;        // the best plan's simulation
  std::optional<TrainingTime> training;
  std::optional<Sensitivity> sensitivity;  // the best plan with each resource scaled
  double vs_first = 1;                     // tokens/s a GPU over the group's first planned point's
};

// A multi-line message on one row: "a:\n   b\n   c" -> "a: b; c".
std::string one_line(const std::string& message) {
  std::string out;
  size_t from = 0;
  while (from <= message.size()) {
    size_t end = message.find('\n', from);
    if (end == std::string::npos) end = message.size();
    std::string line = message.substr(from, end - from);
    line.erase(0, line.find_first_not_of(' '));
    if (!line.empty()) {
      if (!out.empty()) out += out.back() == ':' ? " " : "; ";
      out += line;
    }
    from = end + 1;
  }
  return out;
}

double per_gpu(const Row& r) {
  return r.gpus > 0 ? r.sim.tokens_per_s / r.gpus : 0;
}

Expected<Varied> read_varied(const std::string& flag, const std::string& text) {
  Varied v;
  v.flag = flag;
  if (text.empty()) return v;
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size()) {
    return Error(fmt::format(
        "{} '{}': expected FIELD=V1,V2,..., e.g. {}", flag, text,
        flag == "--vary" ? "node.nics.bandwidth=200Gb/s,400Gb/s" : "seq_len=8192,32768"));
  }
  v.field = text.substr(0, eq);
  v.width = v.field.size();
  v.sets.clear();
  size_t from = eq + 1;
  while (true) {
    const size_t comma = text.find(',', from);
    const std::string value = text.substr(from, comma == std::string::npos ? comma : comma - from);
    if (value.empty()) return Error(fmt::format("{} '{}': an empty value", flag, text));
    v.sets.push_back(fmt::format("{}={}", v.field, value));
    v.width = std::max(v.width, value.size());
    if (comma == std::string::npos) break;
    from = comma + 1;
  }
  return v;
}

std::string value_of(const std::string& set) {
  return set.substr(set.find('=') + 1);
}

std::string row_line(const Row& r, const Varied& topo, const Varied& model, bool train,
                     bool sensitivity) {
  std::string line =
      fmt::format("  {:>5} {:>6} {:>6}", r.point.nodes, r.gpus, r.point.global_batch);
  if (!topo.field.empty()) line += fmt::format(" {:<{}}", value_of(r.point.set), topo.width);
  if (!model.field.empty()) {
    line += fmt::format(" {:<{}}", value_of(r.point.model_set), model.width);
  }
  if (r.status != "ok") return line + "  " + r.status;
  const Breakdown& b = r.sim.breakdown;
  auto share = [&](double seconds) { return 100 * seconds / r.sim.iteration_time; };
  line += fmt::format(" {:>10} {:>10.0f} {:>7.1f}% {:>5.1f}% {:>10} {:>5.0f}% {:>5.0f}% {:>5.0f}%",
                      format_seconds(r.sim.iteration_time), per_gpu(r), 100 * r.vs_first,
                      100 * r.sim.mfu, format_bytes(r.sim.peak_memory),
                      share(b.compute + b.recompute + b.optimizer), share(b.total_exposed_comm()),
                      share(b.bubble));
  if (train) {
    const TrainingTime& t = *r.training;
    line += fmt::format(" {:>11}",
                        format_duration(t.with_failures ? t.with_failures->seconds : t.seconds));
  }
  if (sensitivity) {
    for (const ResourceSensitivity& x : r.sensitivity->resources) {
      // Whole percent; a change that rounds to none is "0%", not "-0%" or "+0%".
      const double percent = std::round(100 * (x.iteration_time / r.sim.iteration_time - 1));
      line += fmt::format(" {:>{}}", percent == 0 ? "0%" : fmt::format("{:+.0f}%", percent),
                          std::max<size_t>(resource_name(x.resource).size(), 4));
    }
  }
  return line + "  " + r.choices;
}

std::string sweep_json(const SweepArgs& a, const std::vector<Row>& rows) {
  using json = nlohmann::ordered_json;
  json points = json::array();
  for (const Row& r : rows) {
    json p = {{"nodes", r.point.nodes},
              {"gpus", r.gpus},
              {"global_batch", r.point.global_batch},
              {"set", r.point.set.empty() ? json(nullptr) : json(r.point.set)},
              {"model_set", r.point.model_set.empty() ? json(nullptr) : json(r.point.model_set)},
              {"status", r.status}};
    if (r.status == "ok") {
      p["plan"] = r.best.name;
      p["choices"] = r.choices;
      p["iteration_time_s"] = r.sim.iteration_time;
      p["tokens_per_s"] = r.sim.tokens_per_s;
      p["tokens_per_s_per_gpu"] = per_gpu(r);
      p["per_gpu_vs_group_first"] = r.vs_first;
      p["mfu"] = r.sim.mfu;
      p["peak_memory_bytes"] = r.sim.peak_memory;
      json exposed = json::object();
      for (const auto& [group, seconds] : r.sim.breakdown.exposed_comm) exposed[group] = seconds;
      p["pace_lane"] = {{"name", r.sim.lane},
                        {"compute_s", r.sim.breakdown.compute},
                        {"recompute_s", r.sim.breakdown.recompute},
                        {"optimizer_s", r.sim.breakdown.optimizer},
                        {"exposed_comm_s", exposed},
                        {"bubble_s", r.sim.breakdown.bubble}};
      if (r.training) {
        p["training"] = {{"tokens", r.training->tokens},
                         {"steps", r.training->steps},
                         {"time_s", r.training->seconds},
                         {"gpu_hours", r.training->gpu_hours}};
        if (const std::optional<FailureCost>& f = r.training->with_failures) {
          p["training"]["with_failures"] = {{"time_s", f->seconds},
                                            {"gpu_hours", f->gpu_hours},
                                            {"failures", f->failures},
                                            {"lost_fraction", f->lost_fraction},
                                            {"checkpoint_interval_s", f->checkpoint_interval}};
        }
      }
      if (r.sensitivity) p["sensitivity"] = sensitivity_json(*r.sensitivity);
    }
    points.push_back(p);
  }
  json j = {{"format", "nnsim-sweep"},
            {"version", 1},
            {"model", a.plan.model},
            {"topology", a.plan.topo},
            {"topo_set", a.plan.topo_set},
            {"model_set", a.plan.model_set},
            {"points", points}};
  return format_json(j);
}

std::string sweep_csv(const std::vector<Row>& rows) {
  std::string csv =
      "nodes,gpus,global_batch,set,model_set,status,plan,iteration_time_s,tokens_per_s,"
      "tokens_per_s_per_gpu,per_gpu_vs_group_first,mfu,peak_memory_bytes,busy_s,exposed_comm_s,"
      "bubble_s,train_time_s,gpu_hours,train_time_with_failures_s,compute_change,hbm_change,"
      "intra_node_change,network_change,latency_change\n";
  const auto columns = static_cast<size_t>(std::count(csv.begin(), csv.end(), ',') + 1);
  auto quoted = [](const std::string& s) {
    std::string q = "\"";
    for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  };
  for (const Row& r : rows) {
    csv += fmt::format("{},{},{},{},{},{}", r.point.nodes, r.gpus, r.point.global_batch,
                       quoted(r.point.set), quoted(r.point.model_set), quoted(r.status));
    if (r.status != "ok") {
      csv += std::string(columns - 6, ',') + "\n";  // no plan: six fields, then none
      continue;
    }
    const Breakdown& b = r.sim.breakdown;
    csv += fmt::format(",{},{},{},{},{},{},{},{},{},{},{},{},{}\n", quoted(r.best.name),
                       r.sim.iteration_time, r.sim.tokens_per_s, per_gpu(r), r.vs_first, r.sim.mfu,
                       r.sim.peak_memory, b.compute + b.recompute + b.optimizer,
                       b.total_exposed_comm(), b.bubble,
                       r.training ? fmt::format("{}", r.training->seconds) : "",
                       r.training ? fmt::format("{}", r.training->gpu_hours) : "",
                       r.training && r.training->with_failures
                           ? fmt::format("{}", r.training->with_failures->seconds)
                           : "");
    csv.pop_back();  // the row goes on with the sensitivity's changes, empty without it
    for (size_t i = 0; i < kResources.size(); ++i) {
      csv += r.sensitivity
                 ? fmt::format(
                       ",{}", r.sensitivity->resources[i].iteration_time / r.sim.iteration_time - 1)
                 : ",";
    }
    csv += "\n";
  }
  return csv;
}

// What a row gives beyond its step: the time to train, with failures, and the sensitivity.
struct Costing {
  std::optional<double> train_tokens;
  std::optional<FailureModel> failures;
  double sensitivity = 0;  // > 0: the factor
};

// Every point of a sweep with its model and cluster, read before any search so that a bad value
// stops the sweep at once.
struct Grid {
  Varied topo_vary;
  Varied model_vary;
  std::vector<ModelSpec> models;  // one per --vary-model value
  std::vector<Point> points;
  std::vector<Topology> topologies;  // per point
  std::vector<size_t> model_of;      // per point, into `models`
};

// Each model's global batches in sequences: --global-batch as given, or --global-batch-tokens
// over the model's sequence length (a whole number of sequences, else an error).
Expected<std::vector<int>> batches_of(const SweepArgs& a, const ModelSpec& m) {
  if (a.global_batches.empty() == a.global_batch_tokens.empty()) {
    return Error("give the global batch: --global-batch (sequences) or --global-batch-tokens");
  }
  std::vector<int> out = a.global_batches;
  for (const std::string& text : a.global_batch_tokens) {
    Expected<double> n = parse_token_count(text);
    if (!n) return Error("--global-batch-tokens: " + n.error().message());
    const double sequences = *n / static_cast<double>(m.seq_len);
    if (sequences < 1 || sequences != std::floor(sequences) || sequences > 1e9) {
      return Error(fmt::format(
          "--global-batch-tokens {}: {} tokens are {:.4g} sequences of {} tokens ({}): give a "
          "whole number of sequences",
          text, *n, sequences, m.seq_len, m.name));
    }
    out.push_back(static_cast<int>(sequences));
  }
  return out;
}

Expected<Grid> read_grid(const SweepArgs& a) {
  const PlanArgs& pa = a.plan;
  Grid g;
  Expected<Varied> topo_vary = read_varied("--vary", a.vary);
  if (!topo_vary) return topo_vary.error();
  g.topo_vary = *topo_vary;
  Expected<Varied> model_vary = read_varied("--vary-model", a.vary_model);
  if (!model_vary) return model_vary.error();
  g.model_vary = *model_vary;
  const std::vector<int> nodes = a.nodes.empty() ? std::vector<int>{0} : a.nodes;
  // Each cluster once: per --vary value, per node count.
  std::vector<std::vector<Topology>> clusters;
  for (const std::string& set : g.topo_vary.sets) {
    std::vector<std::string> topo_set = pa.topo_set;
    if (!set.empty()) topo_set.push_back(set);
    clusters.emplace_back();
    for (int n : nodes) {
      Expected<Topology> topo = load_topology_sized(pa.topo, n, topo_set);
      if (!topo) {
        if (set.empty()) return topo.error();
        return Error(fmt::format("--vary {}: {}", set, topo.error().message()));
      }
      clusters.back().push_back(*topo);
    }
  }
  int group = 0;
  for (size_t mi = 0; mi < g.model_vary.sets.size(); ++mi) {
    const std::string& model_set = g.model_vary.sets[mi];
    Expected<ModelSpec> m = load_plan_model(
        pa, model_set.empty() ? std::vector<std::string>{} : std::vector{model_set});
    if (!m) {
      if (model_set.empty()) return m.error();
      return Error(fmt::format("--vary-model {}: {}", model_set, m.error().message()));
    }
    g.models.push_back(*m);
    Expected<std::vector<int>> batches = batches_of(a, *m);
    if (!batches) return batches.error();
    for (size_t ti = 0; ti < g.topo_vary.sets.size(); ++ti) {
      for (int gb : *batches) {
        for (const Topology& topo : clusters[ti]) {
          g.points.push_back({topo.nodes, gb, g.topo_vary.sets[ti], model_set, group});
          g.topologies.push_back(topo);
          g.model_of.push_back(mi);
        }
        ++group;
      }
    }
  }
  return g;
}

void print_header(const SweepArgs& a, const Grid& g, const Costing& costing) {
  std::string header = fmt::format("  {:>5} {:>6} {:>6}", "nodes", "GPUs", "batch");
  for (const Varied* v : {&g.topo_vary, &g.model_vary}) {
    if (!v->field.empty()) header += fmt::format(" {:<{}}", v->field, v->width);
  }
  header += fmt::format(" {:>10} {:>10} {:>8} {:>6} {:>10} {:>6} {:>6} {:>6}", "step", "tok/s/GPU",
                        "vs first", "MFU", "peak mem", "busy", "comm", "bubble");
  if (costing.train_tokens) {
    header += fmt::format(" {:>11}", costing.failures ? "w/ failures" : "to train");
  }
  if (costing.sensitivity > 0) {
    for (Resource r : kResources) {
      const std::string name(resource_name(r));
      header += fmt::format(" {:>{}}", name, std::max<size_t>(name.size(), 4));
    }
  }
  header += "  best plan";
  std::string cluster = a.plan.topo;
  for (size_t i = 0; i < a.plan.topo_set.size(); ++i) {
    cluster += (i == 0 ? " with " : ", ") + a.plan.topo_set[i];
  }
  std::printf("%s on %s: %zu point%s, each searched\n",
              g.model_vary.field.empty() ? g.models.front().name.c_str() : a.plan.model.c_str(),
              cluster.c_str(), g.points.size(), g.points.size() == 1 ? "" : "s");
  std::printf("%s\n", header.c_str());
  std::fflush(stdout);
}

Simulated summarize(const SimResult& sim) {
  Simulated s;
  s.iteration_time = sim.iteration_time;
  s.tokens_per_s = sim.tokens_per_second;
  s.mfu = sim.mfu;
  s.peak_memory = worst_memory_lane(sim).peak_memory;
  const LaneReport* pace = &sim.lanes.front();
  for (const LaneReport& l : sim.lanes) {
    if (l.breakdown.bubble < pace->breakdown.bubble) pace = &l;
  }
  s.lane = pace->name;
  s.breakdown = pace->breakdown;
  return s;
}

// The search at one point. Its confirming simulations are kept by plan, so that the best
// plan's breakdown and memory come from the simulation that confirmed it; a best plan the
// search did not simulate is simulated here. No plan: a row that says why. An error only when
// the best plan does not simulate or cost.
Expected<Row> plan_point(PlanArgs& pa, const Point& point, const ModelSpec& model,
                         const Topology& topo, const Costing& costing,
                         const std::function<void(double)>& progress) {
  Row row;
  row.point = point;
  row.gpus = topo.num_gpus();
  pa.o.global_batch = point.global_batch;
  Expected<SearchOptions> so = search_options(pa, model);
  if (!so) return so.error();
  so->progress = [&](const std::string&, size_t done, size_t all) {
    progress(static_cast<double>(done) / static_cast<double>(all));
  };
  // The search confirms several plans at once (SearchOptions::jobs threads).
  std::mutex mutex;
  std::map<std::string, Simulated> confirmed;  // plan.json -> its simulation
  so->simulate = [&](const Program& p) -> Expected<double> {
    Expected<SimResult> r = simulate(p);
    if (!r) return r.error();
    const Simulated s = summarize(*r);
    std::lock_guard<std::mutex> lock(mutex);
    confirmed[plan_to_json(p.plan)] = s;
    return s.iteration_time;
  };
  Expected<SearchResult> r = search_plans(model, topo, *so);
  if (!r) {
    row.status = one_line(r.error().message());
    return row;
  }
  if (auto it = confirmed.find(plan_to_json(r->best)); it != confirmed.end()) {
    row.sim = it->second;
  } else {
    Expected<Program> prog = compile_plan(r->best, topo, pa.o.costs);
    Expected<SimResult> sim = prog ? simulate(*prog) : Expected<SimResult>(prog.error());
    if (!sim) return Error(fmt::format("{}: {}", r->best.name, sim.error().message()));
    row.sim = summarize(*sim);
  }
  row.best = r->best;
  row.choices = r->ranked.front().describe();
  row.gpus = r->best.mesh.num_ranks();
  if (costing.sensitivity > 0) {
    Expected<Sensitivity> sens =
        sensitivity(r->best, topo, pa.o.costs, {}, costing.sensitivity, row.sim.iteration_time);
    if (!sens)
      return Error(fmt::format("{}: --sensitivity: {}", r->best.name, sens.error().message()));
    row.sensitivity = *sens;
  }
  if (costing.train_tokens) {
    Expected<TrainingTime> t = training_time(
        *costing.train_tokens, static_cast<double>(point.global_batch) * model.seq_len,
        row.sim.iteration_time, row.gpus);
    if (!t) return Error("--train-tokens: " + t.error().message());
    if (Status st = add_failure_cost(*t, costing.failures); !st) {
      return Error(fmt::format("{}: {}", r->best.name, st.error().message()));
    }
    row.training = *t;
  }
  return row;
}

// Each point's best plan in `dir`: nodes<N>-gb<B>[-t<i>][-m<j>].json.
Status write_plans(const std::string& dir, const std::vector<Row>& rows, const Grid& g) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Error(fmt::format("--plans: cannot create '{}': {}", dir, ec.message()));
  auto index = [](const Varied& v, const std::string& set) {
    return std::find(v.sets.begin(), v.sets.end(), set) - v.sets.begin() + 1;
  };
  for (const Row& r : rows) {
    if (r.status != "ok") continue;
    std::string name = fmt::format("nodes{}-gb{}", r.point.nodes, r.point.global_batch);
    if (!g.topo_vary.field.empty()) name += fmt::format("-t{}", index(g.topo_vary, r.point.set));
    if (!g.model_vary.field.empty()) {
      name += fmt::format("-m{}", index(g.model_vary, r.point.model_set));
    }
    std::string error;
    const std::string path = (std::filesystem::path(dir) / (name + ".json")).string();
    if (!write_file(path, plan_to_json(r.best), &error)) return Error(error);
  }
  return Status::Ok();
}

}  // namespace

CLI::App* add_sweep_command(CLI::App& app, SweepArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "sweep",
      "search the best plan at each cluster size, global batch, topology and model field value, "
      "and tabulate them (what-if studies)");
  cmd->add_option("--nodes", a.nodes,
                  "cluster sizes in nodes, e.g. 8,16,32,64 (default: the topology's)")
      ->delimiter(',')
      ->check(at_least(1));
  CLI::Option* sequences =
      cmd->add_option("--global-batch", a.global_batches,
                      "sequences per optimizer step; several, e.g. 512,1024, are swept too")
          ->delimiter(',')
          ->check(at_least(1));
  CLI::Option* tokens =
      cmd->add_option("--global-batch-tokens", a.global_batch_tokens,
                      "tokens per optimizer step instead, e.g. 4194304 or 8.388608M: each "
                      "point's global batch is that many tokens' sequences (with --vary-model "
                      "seq_len, the same tokens a step at every length)")
          ->delimiter(',');
  sequences->excludes(tokens);
  tokens->excludes(sequences);
  cmd->add_option("--vary", a.vary,
                  "a topology field's values, swept as --topo-set sets one: "
                  "FIELD=V1,V2,... (e.g. node.nics.bandwidth=200Gb/s,400Gb/s,800Gb/s)");
  cmd->add_option("--vary-model", a.vary_model,
                  "a model field's values, swept as --model-set sets one: FIELD=V1,V2,... "
                  "(e.g. seq_len=8192,32768,131072)");
  add_plan_choices(cmd, a.plan);
  cmd->add_option("--train-tokens", a.train_tokens,
                  "also the time to train this many tokens at each point's step, e.g. 15T");
  add_failure_options(cmd, a.failures);
  cmd->add_option("--sensitivity", a.sensitivity,
                  "also each best plan with each resource (GPU compute, HBM bandwidth, "
                  "intra-node links, network bandwidth, latency) this many times as fast, one at a "
                  "time, e.g. 2: "
                  "the step's change a column each")
      ->check(at_least(0, true));
  cmd->add_option("--csv", a.csv, "write the rows as CSV");
  cmd->add_option("--json", a.json, "write the rows as JSON");
  cmd->add_option("--plans", a.plans_dir,
                  "write each point's best plan in this folder (nodes<N>-gb<B>[-t<i>][-m<j>].json: "
                  "the i-th --vary and j-th --vary-model value)");
  return cmd;
}

int run_sweep(SweepArgs& a, const CLI::App& cmd) {
  PlanArgs& pa = a.plan;
  pa.search = true;  // every point is searched; builder-only options are refused
  if (Status st = read_plan_choices(pa, cmd); !st) return fail(st.error().message());
  Costing costing;
  if (!a.train_tokens.empty()) {
    Expected<double> n = parse_token_count(a.train_tokens);
    if (!n) return fail("--train-tokens: " + n.error().message());
    costing.train_tokens = *n;
  }
  Expected<std::optional<FailureModel>> failures =
      read_failure_options(a.failures, costing.train_tokens.has_value());
  if (!failures) return fail(failures.error().message());
  costing.failures = *failures;
  if (Status st = check_sensitivity_option(a.sensitivity); !st) return fail(st.error().message());
  costing.sensitivity = a.sensitivity;
  Expected<Grid> grid = read_grid(a);
  if (!grid) return fail(grid.error().message());
  print_header(a, *grid, costing);

  std::vector<Row> rows;
  Progress progress("sweeping");
  for (size_t k = 0; k < grid->points.size(); ++k) {
    auto on_progress = [&](double f) {
      progress.update((static_cast<double>(k) + f) / static_cast<double>(grid->points.size()));
    };
    Expected<Row> row = plan_point(pa, grid->points[k], grid->models[grid->model_of[k]],
                                   grid->topologies[k], costing, on_progress);
    progress.done();
    if (!row) return fail(row.error().message());
    // Scaling along the nodes: against the first point of the group that has a plan.
    for (const Row& earlier : rows) {
      if (earlier.point.group == row->point.group && earlier.status == "ok") {
        row->vs_first = per_gpu(*row) / per_gpu(earlier);
        break;
      }
    }
    rows.push_back(*row);
    std::printf("%s\n", row_line(rows.back(), grid->topo_vary, grid->model_vary,
                                 costing.train_tokens.has_value(), costing.sensitivity > 0)
                            .c_str());
    std::fflush(stdout);
  }
  std::printf(
      "vs first: tokens/s a GPU against the first point with the same batch%s; busy, comm, "
      "bubble: the step's shares of compute, exposed communication and waiting on the lane "
      "that waits least\n",
      grid->topo_vary.field.empty() && grid->model_vary.field.empty() ? "" : " and values");
  if (costing.sensitivity > 0) {
    std::printf(
        "compute, hbm, intra-node, network, latency: the best plan's step with that resource %gx "
        "as fast (GPU FLOP/s, HBM bandwidth, links inside a node, NICs; latencies divided), the "
        "plan unchanged\n",
        costing.sensitivity);
  }
  note_unvalidated_moe(grid->models.front());
  note_unvalidated_hybrid(grid->models.front());
  note_hypothetical_gpu(grid->topologies.front().gpu);

  std::string error;
  if (!a.csv.empty() && !write_file(a.csv, sweep_csv(rows), &error)) return fail(error);
  if (!a.json.empty() && !write_file(a.json, sweep_json(a, rows), &error)) return fail(error);
  if (!a.plans_dir.empty()) {
    if (Status st = write_plans(a.plans_dir, rows, *grid); !st) return fail(st.error().message());
  }
  const bool any =
      std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.status == "ok"; });
  if (!any) return fail("no point of the sweep has a feasible plan (the rows say why)");
  return 0;
}

}  // namespace nnsim::tool
