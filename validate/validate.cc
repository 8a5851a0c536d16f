#include "validate/validate.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/json_format.h"
#include "core/memory_check.h"
#include "sim/simulator.h"
#include "validate/case_builder.h"

namespace nnsim {

namespace {

CaseOutcome run_case_timed(const ValidationCase& c, const ValidateOptions& options);

CaseOutcome run_case(const ValidationCase& c, const ValidateOptions& options) {
  auto t0 = std::chrono::steady_clock::now();
  CaseOutcome out = run_case_timed(c, options);
  out.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

CaseOutcome run_case_timed(const ValidationCase& c, const ValidateOptions& options) {
  CaseOutcome out;
  out.id = c.id;
  out.gpus = c.gpus();
  out.framework = c.parallel.framework;
  out.source = c.source_name();
  out.parallel_stated = c.parallel_stated();
  out.measured_s = c.measured.iteration_time_s;
  out.measured_memory_gib = c.measured.peak_memory_gib;
  auto fail = [&](const Error& e) {
    out.status = e.message();
    return out;
  };
  Expected<Topology> topo = case_topology(c);
  if (!topo) return fail(topo.error());
  Expected<Plan> plan = case_plan(c, *topo);
  if (!plan) return fail(plan.error());
  CompileOptions compile = options.compile;
  Expected<Program> prog = compile_plan(*plan, *topo, compile);
  if (!prog) return fail(prog.error());
  // Out-of-memory plans are still simulated: the measured run did fit, and the predicted peak
  // is compared below.
  Expected<SimResult> r = simulate(*prog);
  if (!r) return fail(r.error());
  out.predicted_s = r->iteration_time;
  out.error_pct = 100 * (out.predicted_s - out.measured_s) / out.measured_s;
  const LaneReport& fullest = worst_memory_lane(*r);
  out.predicted_memory_gib = fullest.peak_memory / (1024.0 * 1024 * 1024);
  out.memory = fullest.static_memory;
  out.peak_activations_bytes = fullest.peak_activations;
  const LaneReport* last = &r->lanes.front();
  for (const auto& l : r->lanes) {
    if (l.finish_time > last->finish_time) last = &l;
  }
  out.compute_s = last->breakdown.compute;
  out.recompute_s = last->breakdown.recompute;
  out.optimizer_s = last->breakdown.optimizer;
  out.exposed_comm_s = last->breakdown.total_exposed_comm();
  out.bubble_s = last->breakdown.bubble;
  out.exposed_by_group = last->breakdown.exposed_comm;
  if (out.measured_memory_gib) {
    out.memory_error_pct =
        100 * (*out.predicted_memory_gib - *out.measured_memory_gib) / *out.measured_memory_gib;
  }
  return out;
}

}  // namespace

std::vector<CaseOutcome> run_validation(const std::vector<ValidationCase>& cases,
                                        const ValidateOptions& options) {
  std::vector<CaseOutcome> outcomes(cases.size());
  std::atomic<size_t> next{0};
  std::atomic<int> done{0};
  std::mutex progress_mutex;
  auto worker = [&] {
    for (size_t i = next++; i < cases.size(); i = next++) {
      outcomes[i] = run_case(cases[i], options);
      int d = ++done;
      if (options.progress) {
        std::lock_guard<std::mutex> lock(progress_mutex);
        options.progress(d, static_cast<int>(cases.size()));
      }
    }
  };
  const int jobs = std::max(1, std::min<int>(options.jobs, static_cast<int>(cases.size())));
  std::vector<std::thread> threads;
  for (int j = 1; j < jobs; ++j) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  return outcomes;
}

ErrorStats error_stats(std::vector<double> e) {
  ErrorStats s;
  s.count = static_cast<int>(e.size());
  if (e.empty()) return s;
  std::sort(e.begin(), e.end());
  double sum = 0;
  for (double x : e) sum += x;
  s.mean = sum / e.size();
  auto quantile = [&](double q) {
    double pos = q * (e.size() - 1);
    size_t lo = static_cast<size_t>(std::floor(pos));
    size_t hi = std::min(e.size() - 1, lo + 1);
    return e[lo] + (pos - lo) * (e[hi] - e[lo]);
  };
  s.median = quantile(0.5);
  s.p90 = quantile(0.9);
  s.max = e.back();
  return s;
}

ValidationSummary summarize(const std::vector<CaseOutcome>& outcomes) {
  ValidationSummary s;
  s.cases = static_cast<int>(outcomes.size());
  std::vector<double> all, stated, memory;
  std::map<std::string, std::vector<double>> by_source;
  for (const auto& o : outcomes) {
    if (!o.ok()) {
      ++s.failures;
      continue;
    }
    all.push_back(std::fabs(o.error_pct));
    by_source[o.source].push_back(std::fabs(o.error_pct));
    if (o.parallel_stated) stated.push_back(std::fabs(o.error_pct));
    if (o.memory_error_pct) memory.push_back(std::fabs(*o.memory_error_pct));
  }
  s.time = error_stats(all);
  s.time_stated = error_stats(stated);
  s.memory = error_stats(memory);
  for (auto& [source, errors] : by_source) s.time_by_source[source] = error_stats(errors);
  return s;
}

std::string validation_json(const std::vector<CaseOutcome>& outcomes, const ValidationSummary& s) {
  using json = nlohmann::ordered_json;
  json cases = json::array();
  for (const auto& o : outcomes) {
    json c;
    c["id"] = o.id;
    c["status"] = o.status;
    c["gpus"] = o.gpus;
    c["framework"] = o.framework;
    c["source"] = o.source;
    c["parallel_stated"] = o.parallel_stated;
    c["predicted_iteration_time_s"] = o.ok() ? json(o.predicted_s) : json(nullptr);
    c["measured_iteration_time_s"] = o.measured_s;
    c["error_pct"] = o.ok() ? json(o.error_pct) : json(nullptr);
    c["wall_s"] = o.wall_s;
    if (o.ok()) {
      json exposed = json::object();
      for (const auto& [g, v] : o.exposed_by_group) exposed[g] = v;
      c["breakdown"] = {{"compute_s", o.compute_s},
                        {"recompute_s", o.recompute_s},
                        {"optimizer_s", o.optimizer_s},
                        {"exposed_comm_s", exposed},
                        {"bubble_s", o.bubble_s}};
    }
    c["predicted_peak_memory_gib"] =
        o.predicted_memory_gib ? json(*o.predicted_memory_gib) : json(nullptr);
    if (o.ok()) {
      c["memory"] = {{"weights_bytes", o.memory.weights},
                     {"gradients_bytes", o.memory.gradients},
                     {"gathered_bytes", o.memory.gathered},
                     {"optimizer_bytes", o.memory.optimizer},
                     {"comm_buffers_bytes", o.memory.comm_buffers},
                     {"pipeline_buffers_bytes", o.memory.pipeline_buffers},
                     {"runtime_bytes", o.memory.runtime},
                     {"peak_activations_bytes", o.peak_activations_bytes}};
    }
    if (o.measured_memory_gib) {
      c["measured_peak_memory_gib"] = *o.measured_memory_gib;
      c["memory_error_pct"] = o.memory_error_pct ? json(*o.memory_error_pct) : json(nullptr);
    }
    cases.push_back(c);
  }
  auto stats = [](const ErrorStats& e) {
    return json{{"cases", e.count},
                {"mean_abs_error_pct", e.mean},
                {"median_abs_error_pct", e.median},
                {"p90_abs_error_pct", e.p90},
                {"max_abs_error_pct", e.max}};
  };
  json by_source = json::object();
  for (const auto& [source, e] : s.time_by_source) by_source[source] = stats(e);
  json j;
  j["format"] = "nnsim-validation-report";
  j["version"] = 1;
  j["cases"] = cases;
  j["summary"] = {{"cases", s.cases},
                  {"failures", s.failures},
                  {"iteration_time", stats(s.time)},
                  {"iteration_time_parallel_stated", stats(s.time_stated)},
                  {"iteration_time_by_source", by_source},
                  {"peak_memory", stats(s.memory)}};
  return format_json(j);
}

}  // namespace nnsim
