#include "hwexec/compare.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/collective.h"
#include "core/network.h"
#include "core/program.h"
#include "core/transfer_peer.h"
#include "sim/simulator.h"

namespace nnsim::hwexec {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double relative(double simulated, double measured) {
  return measured > 0 ? (simulated - measured) / measured : kNaN;
}

double median_abs(const std::vector<double>& errors) {
  std::vector<double> v;
  for (double e : errors) {
    if (std::isfinite(e)) v.push_back(std::abs(e));
  }
  if (v.empty()) return kNaN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The run file's names for the collectives.
std::string collective_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
    case CollectiveKind::kExpertExchange:
      return "expert_exchange";
  }
  return "?";
}

std::optional<CollectiveKind> parse_collective(const std::string& name) {
  for (CollectiveKind k : {CollectiveKind::kAllReduce, CollectiveKind::kAllGather,
                           CollectiveKind::kReduceScatter, CollectiveKind::kAllToAll}) {
    if (collective_name(k) == name) return k;
  }
  return std::nullopt;
}

// As nnexec run names them: a zero-bubble split backward's halves are phases of their own.
std::string phase_of(BlockKind k) {
  switch (k) {
    case BlockKind::kForward:
    case BlockKind::kRecompute:
      return "fwd";
    case BlockKind::kBackwardInput:
      return "bwd_input";
    case BlockKind::kBackwardWeight:
      return "bwd_weight";
    default:
      return "bwd";
  }
}

// What one rank does per iteration in the compiled program.
struct SimulatedRank {
  std::map<std::pair<std::string, std::string>, std::pair<double, double>> ops;  // calls, seconds
  // (kind, axes) -> calls, bytes, seconds
  std::map<std::pair<std::string, std::string>, std::array<double, 3>> traffic;
  // (kind, axes, label) -> calls, bytes, seconds
  std::map<std::tuple<std::string, std::string, std::string>, std::array<double, 3>> colls;
  // (send or recv, label) -> each call's bytes and the rank at its other end.
  std::map<std::pair<std::string, std::string>, std::vector<std::pair<double, int>>> transfers;

  void add(const std::string& kind, const std::string& axes, const std::string& label, double bytes,
           double seconds) {
    for (std::array<double, 3>* v : {&traffic[{kind, axes}], &colls[{kind, axes, label}]}) {
      (*v)[0] += 1;
      (*v)[1] += bytes;
      (*v)[2] += seconds;
    }
  }
};

class Pricer {
 public:
  explicit Pricer(const Program& p) : prog_(p), net_(p.topology) {}

  // One collective of `bytes` over `rank`'s group along `axes`, alone on the network.
  double collective(CollectiveKind kind, int rank, uint32_t axes, double bytes) {
    std::vector<int> gpus;
    for (int r : prog_.group_of(rank, axes)) gpus.push_back(prog_.gpu_of_rank[r]);
    return collective_on(kind, gpus, bytes);
  }
  double collective_on(CollectiveKind kind, const std::vector<int>& gpus, double bytes) {
    CollectiveFlows c =
        decompose_collective(kind, gpus, bytes, prog_.algorithm, net_, prog_.comm_model);
    return isolated_seconds(c, net_, scratch_);
  }
  double transfer(int src_gpu, int dst_gpu, double bytes) {
    CollectiveFlows c = decompose_transfer({src_gpu}, {dst_gpu}, bytes, net_, prog_.comm_model);
    return isolated_seconds(c, net_, scratch_);
  }

 private:
  const Program& prog_;
  Network net_;
  LinkLoadScratch scratch_;
};

std::string pipeline_axes(const Plan& plan) {
  std::set<std::string> axes;
  for (const DeviceOrder& o : plan.schedule) {
    for (const auto& [axis, c] : o.devices) axes.insert(axis);
  }
  std::string s;
  for (const MeshAxis& a : plan.mesh.axes) {
    if (axes.count(a.name)) s += (s.empty() ? "" : "+") + a.name;
  }
  return s.empty() ? "pp" : s;
}

SimulatedRank simulate_rank(const Program& prog, int rank, Pricer& pricer,
                            const std::string& pp_axes) {
  SimulatedRank out;
  const int r0 = prog.rank_in_replica(rank, 0);
  const int lane_index = lane_of(prog, rank);
  if (lane_index < 0) return out;
  const Lane* lane = &prog.lanes[lane_index];
  // `partner_phase`: a paired block's partner's (its steps' `member` 1), which nnexec runs
  // after the block.
  auto walk = [&](const std::vector<Step>& steps, const std::string& block_phase,
                  const std::string& partner_phase = "") {
    for (const Step& s : steps) {
      const std::string& phase = s.member == 1 ? partner_phase : block_phase;
      const std::string label = s.label >= 0 ? prog.labels[s.label] : "";
      switch (s.kind) {
        case StepKind::kCompute: {
          const bool opt = s.compute_class == ComputeClass::kOptimizer;
          // Recomputation, inside a backward block or an R block, is its own phase (as
          // nnexec run records it).
          const char* recompute =
              s.compute_class == ComputeClass::kRecompute ? "recompute" : nullptr;
          auto& [calls, seconds] = out.ops[{opt ? "optimizer" : label, opt         ? "step"
                                                                       : recompute ? recompute
                                                                                   : phase}];
          calls += 1;
          seconds += s.seconds;
          break;
        }
        case StepKind::kCollective:
        case StepKind::kDpLaunch:
        case StepKind::kCommLaunch: {  // a paired block's all-to-all (nnexec runs it in line)
          if (s.kind == StepKind::kCollective && s.seconds > 0) {
            // Compute running alongside the collective (ring attention), recomputed too.
            const bool again = s.compute_class == ComputeClass::kRecompute;
            auto& [calls, seconds] = out.ops[{label, again ? "recompute" : phase}];
            calls += 1;
            seconds += s.seconds;
          }
          double t = 0;
          if (s.group >= 0) {
            for (const auto& members : prog.explicit_groups[s.group]) {
              if (std::find(members.begin(), members.end(), r0) == members.end()) continue;
              std::vector<int> gpus;
              for (int m : members) gpus.push_back(prog.gpu_of_rank[m]);
              t = pricer.collective_on(s.collective, gpus, s.bytes);
            }
          } else {
            t = pricer.collective(s.collective, rank, s.axes, s.bytes);
          }
          out.add(collective_name(s.collective), s.group >= 0 ? "explicit" : prog.axes_name(s.axes),
                  label, s.bytes, t);
          break;
        }
        case StepKind::kSend:
        case StepKind::kRecv: {
          const int peer = transfer_peer(prog, rank, s);
          if (peer < 0) break;
          const double t = pricer.transfer(prog.gpu_of_rank[rank], prog.gpu_of_rank[peer], s.bytes);
          const std::string kind = s.kind == StepKind::kSend ? "send" : "recv";
          out.add(kind, pp_axes, label, s.bytes, t);
          out.transfers[{kind, label}].push_back({s.bytes, peer});
          break;
        }
        default:
          break;
      }
    }
  };
  walk(lane->prologue, "fwd");
  for (const BlockInstance& b : lane->blocks) {
    const BlockTemplate& t = prog.templates[b.template_index];
    walk(t.steps, phase_of(t.kind), b.paired ? phase_of(b.partner.kind) : "");
  }
  walk(lane->epilogue, "step");
  return out;
}

// The simulator's time for one of `rank`'s measured point-to-point calls `x`: the program's
// transfers of its kind and label (those of its size if any, else all) priced at the measured
// size between `rank` and each one's peer, averaged (a rank of an interleaved or spanning
// pipeline sends one label to several peers). NaN if the program makes none.
double transfer_seconds(const Program& prog, const SimulatedRank& sim, int rank, const CollTime& x,
                        Pricer& pricer) {
  auto it = sim.transfers.find({x.kind, x.label});
  if (it == sim.transfers.end()) return kNaN;
  const std::vector<std::pair<double, int>>& calls = it->second;
  const bool sized =
      std::any_of(calls.begin(), calls.end(), [&](const auto& c) { return c.first == x.bytes; });
  double sum = 0;
  int n = 0;
  for (const auto& [bytes, peer] : calls) {
    if (sized && bytes != x.bytes) continue;
    sum += pricer.transfer(prog.gpu_of_rank[rank], prog.gpu_of_rank[peer], x.bytes);
    ++n;
  }
  return sum / n;
}

uint32_t axes_mask(const Plan& plan, const std::string& axes, bool* ok) {
  uint32_t mask = 0;
  *ok = true;
  size_t start = 0;
  while (start <= axes.size()) {
    size_t plus = axes.find('+', start);
    if (plus == std::string::npos) plus = axes.size();
    const int a = plan.mesh.axis_index(axes.substr(start, plus - start));
    if (a < 0)
      *ok = false;
    else
      mask |= 1u << a;
    start = plus + 1;
  }
  return mask;
}

// Graph order of the operator names, and each operator's kind.
struct GraphIndex {
  std::map<std::string, int> order;
  std::map<std::string, std::string> kind;
};

GraphIndex index_graph(const OpGraph& g) {
  GraphIndex x;
  for (const GraphPart* part : g.parts()) {
    for (const Op& op : part->ops) {
      x.order.emplace(op.name, static_cast<int>(x.order.size()));
      x.kind.emplace(op.name, std::string(to_string(op.kind)));
    }
  }
  x.order.emplace("optimizer", static_cast<int>(x.order.size()));
  x.kind.emplace("optimizer", "optimizer");
  return x;
}

int phase_order(const std::string& p) {
  return p == "fwd"          ? 0
         : p == "recompute"  ? 1
         : p == "bwd"        ? 2
         : p == "bwd_input"  ? 3
         : p == "bwd_weight" ? 4
                             : 5;
}

}  // namespace

double OpRow::error() const {
  return relative(simulated, measured);
}
double KindRow::error() const {
  return relative(simulated, measured);
}
double CollectiveRow::error() const {
  return relative(simulated, measured);
}
double CollectiveRow::bytes_per_call() const {
  if (measured_calls > 0) return measured_bytes / measured_calls;
  return simulated_calls > 0 ? simulated_bytes / simulated_calls : 0;
}
double TrafficRow::error() const {
  return relative(simulated, measured);
}
double Comparison::iteration_error() const {
  return relative(simulated_iteration, measured_iteration);
}
double Comparison::compute_error() const {
  return relative(simulated_compute, measured_compute);
}
double Comparison::memory_error() const {
  return measured_peak_memory < 0 ? kNaN : relative(simulated_peak_memory, measured_peak_memory);
}

Expected<Plan> plan_of_run(const RunResults& run, const std::string& run_path,
                           const std::string& given_path) {
  Expected<Plan> embedded = parse_plan(run.plan_json, run_path + ": /plan");
  if (!embedded) return embedded.error();
  if (given_path.empty()) return embedded;
  Expected<Plan> given = load_plan(given_path);
  if (!given) return given.error();
  const std::string a = plan_to_json(*embedded), b = plan_to_json(*given);
  if (a == b) return given;
  // Name the first top-level field that differs.
  std::string field = "?";
  const nlohmann::ordered_json ja = nlohmann::ordered_json::parse(a, nullptr, false);
  const nlohmann::ordered_json jb = nlohmann::ordered_json::parse(b, nullptr, false);
  if (ja.is_object() && jb.is_object()) {
    for (const auto& [key, value] : ja.items()) {
      if (!jb.contains(key) || jb.at(key) != value) {
        field = key;
        break;
      }
    }
    if (field == "?") {
      for (const auto& [key, value] : jb.items()) {
        if (!ja.contains(key)) {
          field = key;
          break;
        }
      }
    }
  }
  return Error(fmt::format(
      "{}: differs from the plan {} ran ('{}'), first in field '{}'; leave the plan out to "
      "compare with the run's own plan, or run this one (nnexec run --plan {})",
      given_path, run_path, embedded->name, field, given_path));
}

namespace {

// The calibration the simulated side uses, and notes on what the two sides differ in.
void describe_sides(const RunResults& run, const Plan& plan, const Topology& topology,
                    const CompareOptions& options, Comparison& c) {
  c.calibration = "built-in cost model";
  if (options.calibration) {
    auto it = options.calibration->gpus.find(topology.gpu.name);
    if (it == options.calibration->gpus.end()) {
      std::string has;
      for (const auto& [name, g] : options.calibration->gpus)
        has += (has.empty() ? "" : ", ") + name;
      c.notes.push_back(fmt::format(
          "{} has no entry for {} (it has: {}); the built-in values are used. Calibrate for this "
          "GPU: nnsim calibrate ... --gpu {}",
          options.calibration_path, topology.gpu.name, has.empty() ? "none" : has,
          topology.gpu.name));
    } else {
      c.calibration = it->second.source.empty() ? options.calibration_path : it->second.source;
    }
  }
  const bool calibrated = c.calibration != "built-in cost model";
  if (run.device == "cpu" && !calibrated) {
    c.notes.push_back(fmt::format(
        "measured on a CPU; the simulator models {}: without a calibration fitted to this "
        "machine (nnsim calibrate RUN.h5 --gpu {}) the errors are the distance between the two",
        topology.gpu.name, topology.gpu.name));
  }
  if (std::string(to_string(plan.precision)) != run.dtype) {
    c.notes.push_back(fmt::format("the plan trains in {}, the run computed in {}",
                                  to_string(plan.precision), run.dtype));
  }
}

// Measured and simulated operators and collectives, summed rank by rank.
struct Tally {
  const Program& prog;
  const Plan& plan;
  Pricer pricer;
  const std::string pp_axes;
  const GraphIndex& graph;
  // Operators: per (name, phase), per rank, measured and simulated.
  struct Acc {
    int ranks = 0;
    double mc = 0, sc = 0, m = 0, s = 0;
  };
  std::map<std::pair<std::string, std::string>, Acc> ops;
  std::map<std::pair<std::string, std::string>, std::array<double, 6>> traffic;
  struct CollAcc {
    int ranks = 0;
    double mc = 0, sc = 0, mb = 0, sb = 0, m = 0, s = 0;
  };
  std::map<std::tuple<std::string, std::string, std::string>, CollAcc> colls;
  std::map<std::string, std::pair<double, double>> kinds;
  double measured_compute = 0, simulated_compute = 0;

  Tally(const Program& p, const GraphIndex& g)
      : prog(p), plan(p.plan), pricer(p), pp_axes(pipeline_axes(p.plan)), graph(g) {}

  // One rank: its measured operators and collectives beside the simulator's for that rank.
  void add_rank(const RankResult& r) {
    const SimulatedRank sim = simulate_rank(prog, r.rank, pricer, pp_axes);
    std::map<std::pair<std::string, std::string>, std::pair<double, double>> measured;
    for (const OpTime& o : r.ops) {
      auto& [calls, seconds] = measured[{o.name, o.phase}];
      calls += o.calls;
      seconds += o.seconds;
    }
    std::set<std::pair<std::string, std::string>> keys;
    for (const auto& [k, v] : measured) keys.insert(k);
    for (const auto& [k, v] : sim.ops) keys.insert(k);
    for (const auto& k : keys) {
      auto m = measured.count(k) ? measured[k] : std::pair<double, double>{0, 0};
      auto it = sim.ops.find(k);
      auto s = it != sim.ops.end() ? it->second : std::pair<double, double>{0, 0};
      Acc& a = ops[k];
      a.ranks += 1;
      a.mc += m.first;
      a.m += m.second;
      a.sc += s.first;
      a.s += s.second;
      const std::string kind = graph.kind.count(k.first) ? graph.kind.at(k.first) : "other";
      kinds[kind].first += m.second;
      kinds[kind].second += s.second;
      measured_compute += m.second;
      simulated_compute += s.second;
    }
    for (const auto& [k, v] : sim.traffic) {
      auto& t = traffic[k];
      t[1] += v[0];
      t[3] += v[1];
      t[5] += v[2];
    }
    // Per (kind, axes, label): the run's calls, bytes, seconds and the simulator's time for
    // them.
    std::map<std::tuple<std::string, std::string, std::string>, std::array<double, 4>> mine;
    for (const CollTime& x : r.collectives) {
      auto& t = traffic[{x.kind, x.axes}];
      t[0] += x.calls;
      t[2] += x.calls * x.bytes;
      t[4] += x.seconds;
      // The simulator's time for these calls.
      double one = kNaN;
      bool known = false;
      const uint32_t mask = axes_mask(plan, x.axes, &known);
      if (x.kind == "send" || x.kind == "recv") {
        one = transfer_seconds(prog, sim, r.rank, x, pricer);
      } else if (auto kind = parse_collective(x.kind); kind && known) {
        one = pricer.collective(*kind, r.rank, mask, x.bytes);
      } else if (kind && x.axes == "explicit") {
        // The program's explicit groups (the tied embedding's first/last-stage pairs), as the
        // simulator prices them: the group of the rank's counterpart in replica 0.
        const int r0 = prog.rank_in_replica(r.rank, 0);
        for (const auto& groups : prog.explicit_groups) {
          for (const auto& members : groups) {
            if (std::find(members.begin(), members.end(), r0) == members.end()) continue;
            std::vector<int> gpus;
            for (int g : members) gpus.push_back(prog.gpu_of_rank[g]);
            one = pricer.collective_on(*kind, gpus, x.bytes);
          }
        }
      }
      auto& v = mine[{x.kind, x.axes, x.label}];
      v[0] += x.calls;
      v[1] += x.calls * x.bytes;
      v[2] += x.seconds;
      v[3] += x.calls * one;
    }
    std::set<std::tuple<std::string, std::string, std::string>> ckeys;
    for (const auto& [k, v] : mine) ckeys.insert(k);
    for (const auto& [k, v] : sim.colls) ckeys.insert(k);
    for (const auto& k : ckeys) {
      CollAcc& a = colls[k];
      a.ranks += 1;
      auto m = mine.find(k);
      auto s = sim.colls.find(k);
      if (m != mine.end()) {
        a.mc += m->second[0];
        a.mb += m->second[1];
        a.m += m->second[2];
        a.s += m->second[3];
      } else {
        a.s += s->second[2];
      }
      if (s != sim.colls.end()) {
        a.sc += s->second[0];
        a.sb += s->second[1];
      }
    }
  }

  // The comparison's rows, per rank (over the ranks that ran each operator or collective, and
  // over the world for the totals).
  void fill(Comparison& c, double world) const {
    for (const auto& [k, a] : ops) {
      OpRow row;
      row.name = k.first;
      row.phase = k.second;
      row.kind = graph.kind.count(k.first) ? graph.kind.at(k.first) : "other";
      row.ranks = a.ranks;
      row.measured_calls = a.mc / a.ranks;
      row.simulated_calls = a.sc / a.ranks;
      row.measured = a.m / a.ranks;
      row.simulated = a.s / a.ranks;
      c.ops.push_back(row);
    }
    std::stable_sort(c.ops.begin(), c.ops.end(), [&](const OpRow& x, const OpRow& y) {
      const int px = phase_order(x.phase), py = phase_order(y.phase);
      if (px != py) return px < py;
      const int ox = graph.order.count(x.name) ? graph.order.at(x.name) : 1 << 20;
      const int oy = graph.order.count(y.name) ? graph.order.at(y.name) : 1 << 20;
      if (ox != oy) return ox < oy;
      return x.name < y.name;
    });
    for (const auto& [kind, v] : kinds) {
      c.kinds.push_back({kind, v.first / world, v.second / world});
    }
    for (const auto& [k, a] : colls) {
      CollectiveRow row;
      std::tie(row.kind, row.axes, row.label) = k;
      row.ranks = a.ranks;
      row.measured_calls = a.mc / a.ranks;
      row.simulated_calls = a.sc / a.ranks;
      row.measured_bytes = a.mb / a.ranks;
      row.simulated_bytes = a.sb / a.ranks;
      row.measured = a.m / a.ranks;
      row.simulated = a.s / a.ranks;
      c.collectives.push_back(row);
    }
    for (const auto& [k, t] : traffic) {
      c.traffic.push_back({k.first, k.second, t[0] / world, t[1] / world, t[2] / world,
                           t[3] / world, t[4] / world, t[5] / world});
    }
  }
};

// Medians of the rows' errors, the iterations and the peak memory, measured and simulated.
Status summarize(const RunResults& run, const Program& prog, const CompareOptions& options,
                 Comparison& c) {
  std::vector<double> all, gemm, coll;
  for (const OpRow& r : c.ops) {
    all.push_back(r.error());
    if (r.kind == "linear") gemm.push_back(r.error());
  }
  for (const CollectiveRow& r : c.collectives) coll.push_back(r.error());
  c.median_op_error = median_abs(all);
  c.median_gemm_error = median_abs(gemm);
  c.median_collective_error = median_abs(coll);

  c.measured_iterations = run.iteration_seconds();
  c.measured_iteration = median(c.measured_iterations);
  c.simulated_iteration = kNaN;
  c.simulated_peak_memory = kNaN;
  for (const RankResult& r : run.ranks) {
    if (r.peak_allocated_bytes <= c.measured_peak_memory) continue;
    c.measured_peak_memory = r.peak_allocated_bytes;
    const auto top = std::max_element(
        r.memory.begin(), r.memory.end(),
        [](const OpMemory& a, const OpMemory& b) { return a.peak_bytes < b.peak_bytes; });
    c.measured_peak_operator = top == r.memory.end() ? "" : top->name;
    c.measured_peak_phase = top == r.memory.end() ? "" : top->phase;
  }
  if (options.simulate_iteration) {
    Expected<SimResult> sim = simulate(prog);
    if (!sim) return sim.error().with_context("simulating the plan");
    c.simulated_iteration = sim->iteration_time;
    const LaneReport& worst = worst_memory_lane(*sim);
    c.simulated_untracked_memory = worst.static_memory.runtime + worst.static_memory.comm_buffers;
    c.simulated_peak_memory = worst.peak_memory - c.simulated_untracked_memory;
  }
  return Status::Ok();
}

}  // namespace

Expected<Comparison> compare_run(const RunResults& run, const Plan& plan, const Topology& topology,
                                 const CompareOptions& options) {
  if (plan.mesh.num_ranks() != run.world) {
    return Error(fmt::format("the plan has {} mesh ranks but the run has {}", plan.mesh.num_ranks(),
                             run.world));
  }
  CompileOptions compile;
  compile.calibration = options.calibration;
  Expected<Program> compiled = compile_plan(plan, topology, compile);
  if (!compiled) return compiled.error().with_context("the plan on " + topology.name);
  const Program& prog = *compiled;

  Comparison c;
  c.plan_name = plan.name;
  c.topology = topology.name;
  c.gpu = topology.gpu.name;
  c.device = run.device;
  c.dtype = run.dtype;
  c.ranks = run.world;
  describe_sides(run, plan, topology, options, c);
  const GraphIndex graph = index_graph(prog.graph);
  Tally tally(prog, graph);
  for (const RankResult& r : run.ranks) tally.add_rank(r);
  const double world = static_cast<double>(run.world);
  c.measured_compute = tally.measured_compute / world;
  c.simulated_compute = tally.simulated_compute / world;
  tally.fill(c, world);
  if (Status s = summarize(run, prog, options, c); !s) return s.error();
  return c;
}

std::string comparison_json(const Comparison& c) {
  using json = nlohmann::ordered_json;
  auto num = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
  json j;
  j["plan"] = c.plan_name;
  j["topology"] = c.topology;
  j["gpu"] = c.gpu;
  j["calibration"] = c.calibration;
  j["device"] = c.device;
  j["dtype"] = c.dtype;
  j["ranks"] = c.ranks;
  j["iteration"] = {{"measured_s", num(c.measured_iteration)},
                    {"simulated_s", num(c.simulated_iteration)},
                    {"error", num(c.iteration_error())},
                    {"measured_each_s", c.measured_iterations}};
  j["memory"] = {
      {"measured_peak_bytes", num(c.measured_peak_memory < 0 ? kNaN : c.measured_peak_memory)},
      {"simulated_peak_bytes", num(c.simulated_peak_memory)},
      {"simulated_untracked_bytes", num(c.simulated_untracked_memory)},
      {"measured_peak_operator", c.measured_peak_operator},
      {"measured_peak_phase", c.measured_peak_phase},
      {"error", num(c.memory_error())}};
  j["compute"] = {{"measured_s", num(c.measured_compute)},
                  {"simulated_s", num(c.simulated_compute)},
                  {"error", num(c.compute_error())}};
  j["summary"] = {{"median_abs_op_error", num(c.median_op_error)},
                  {"median_abs_gemm_error", num(c.median_gemm_error)},
                  {"median_abs_collective_error", num(c.median_collective_error)}};
  json ops = json::array();
  for (const OpRow& r : c.ops) {
    ops.push_back({{"name", r.name},
                   {"phase", r.phase},
                   {"kind", r.kind},
                   {"ranks", r.ranks},
                   {"measured_calls", r.measured_calls},
                   {"simulated_calls", r.simulated_calls},
                   {"measured_s", r.measured},
                   {"simulated_s", r.simulated},
                   {"error", num(r.error())}});
  }
  j["operators"] = ops;
  json kinds = json::array();
  for (const KindRow& r : c.kinds) {
    kinds.push_back({{"kind", r.kind},
                     {"measured_s", r.measured},
                     {"simulated_s", r.simulated},
                     {"error", num(r.error())}});
  }
  j["operator_kinds"] = kinds;
  json colls = json::array();
  for (const CollectiveRow& r : c.collectives) {
    colls.push_back({{"kind", r.kind},
                     {"axes", r.axes},
                     {"label", r.label},
                     {"bytes_per_call", r.bytes_per_call()},
                     {"ranks", r.ranks},
                     {"measured_calls", r.measured_calls},
                     {"simulated_calls", r.simulated_calls},
                     {"measured_bytes", r.measured_bytes},
                     {"simulated_bytes", r.simulated_bytes},
                     {"measured_s", r.measured},
                     {"simulated_s", num(r.simulated)},
                     {"error", num(r.error())}});
  }
  j["collectives"] = colls;
  json traffic = json::array();
  for (const TrafficRow& r : c.traffic) {
    traffic.push_back({{"kind", r.kind},
                       {"axes", r.axes},
                       {"measured_calls", r.measured_calls},
                       {"simulated_calls", r.simulated_calls},
                       {"measured_bytes", r.measured_bytes},
                       {"simulated_bytes", r.simulated_bytes},
                       {"measured_s", r.measured},
                       {"simulated_s", r.simulated},
                       {"error", num(r.error())}});
  }
  j["traffic"] = traffic;
  j["notes"] = c.notes;
  return j.dump(2) + "\n";
}

}  // namespace nnsim::hwexec
