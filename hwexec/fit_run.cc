// A run file's operator timings as points of the calibration fit (docs/hwexec.md, "Calibrating
// from run files"): each operator priced the way the simulator's compiler prices it
// (core/compile_ops.cc), from the plan's operator graph and partition.
#include <algorithm>
#include <map>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "core/layout.h"
#include "core/opgraph.h"
#include "core/program.h"
#include "hwexec/fit.h"

namespace nnsim::hwexec {

namespace {

struct PricedOp {
  const Op* op = nullptr;
  OpPartition partition;
};

bool memory_bound(OpKind k) {
  return k == OpKind::kNorm || k == OpKind::kActivation || k == OpKind::kDropoutAdd ||
         k == OpKind::kAdd;
}

// The ranks of `rank`'s group along `axes` ("tp", "dp+cp"): those with its coordinates on every
// other mesh axis.
std::vector<const RankResult*> group_of(const RunResults& run, const RankResult& rank,
                                        const std::string& axes) {
  std::vector<bool> along(run.mesh_axes.size(), false);
  size_t start = 0;
  while (start <= axes.size()) {
    const size_t end = std::min(axes.find('+', start), axes.size());
    const std::string axis = axes.substr(start, end - start);
    for (size_t a = 0; a < run.mesh_axes.size(); ++a)
      along[a] = along[a] || run.mesh_axes[a] == axis;
    start = end + 1;
  }
  std::vector<const RankResult*> out;
  for (const RankResult& other : run.ranks) {
    bool same = other.coordinates.size() == rank.coordinates.size();
    for (size_t a = 0; same && a < rank.coordinates.size(); ++a) {
      same = (a < along.size() && along[a]) || other.coordinates[a] == rank.coordinates[a];
    }
    if (same) out.push_back(&other);
  }
  return out;
}

// The run's all-reduces, all-gathers and reduce-scatters as microbenchmark-style series: per
// link class (the group inside one machine or not), kind and group size, each message size's
// time per call, mean and fastest over the ranks (each rank times its own call, waits
// included, as nccl-tests does).
void collect_collectives(const RunResults& run, RunPoints& out) {
  out.hosts_known = !run.ranks.empty();
  for (const RankResult& r : run.ranks) out.hosts_known = out.hosts_known && !r.host.empty();
  if (!out.hosts_known) return;
  // (crosses hosts, kind, ranks) -> bytes -> per-call seconds of each rank
  std::map<std::tuple<bool, std::string, int>, std::map<double, std::vector<double>>> times;
  for (const RankResult& r : run.ranks) {
    for (const CollTime& c : r.collectives) {
      if (c.kind != "all_reduce" && c.kind != "all_gather" && c.kind != "reduce_scatter") continue;
      if (c.calls <= 0 || c.seconds <= 0 || c.bytes <= 0) continue;
      const std::vector<const RankResult*> group = group_of(run, r, c.axes);
      if (group.size() < 2) continue;
      bool crosses = false;
      for (const RankResult* g : group) crosses = crosses || g->host != r.host;
      times[{crosses, c.kind, static_cast<int>(group.size())}][c.bytes].push_back(c.seconds /
                                                                                  c.calls);
    }
  }
  for (const auto& [key, by_bytes] : times) {
    const auto& [crosses, kind, ranks] = key;
    CollectiveSeries s;
    s.kind = kind;
    s.ranks = ranks;
    s.dtype = run.dtype;
    for (const auto& [bytes, per_rank] : by_bytes) {
      double sum = 0;
      for (double t : per_rank) sum += t;
      const double fastest = *std::min_element(per_rank.begin(), per_rank.end());
      s.samples.push_back({bytes, {sum / per_rank.size(), fastest}});
    }
    (crosses ? out.cross_host : out.same_host).push_back(s);
  }
}

}  // namespace

Expected<RunPoints> run_points(const RunResults& run, const Plan& plan, const GpuSpec& gpu,
                               const std::string& path) {
  RunPoints out;
  out.path = path;
  Expected<Precision> precision = parse_precision(run.dtype);
  if (!precision) return precision.error().with_context(path + ": attribute 'dtype' of /");
  out.precision = *precision;
  if (out.precision == Precision::kFp8) {
    // nnexec run emulates fp8 (run_precision.h): its linear layers' times are those of 16-bit
    // GEMMs with the rounding around them, not of fp8 GEMMs.
    return Error(fmt::format(
        "{}: the run computed in fp8, which nnexec run emulates (bf16 GEMMs on values rounded "
        "to fp8): its GEMM times are not fp8's; calibrate fp8 GEMMs from nnexec bench",
        path));
  }
  if (plan.precision != out.precision) {
    out.notes.push_back(fmt::format(
        "{}: the plan trains in {} but the run computed in {}: gemm_efficiency_{} is fitted, "
        "which a simulation of the plan in {} does not use",
        path, to_string(plan.precision), run.dtype, run.dtype, to_string(plan.precision)));
  }
  // The operator graph as the compiler builds it, and each operator's partition.
  ModelSpec model = plan.model;
  model.precision = plan.precision;
  const OpGraph graph = lower_model(model, plan.micro_batch);
  std::map<std::string, PricedOp> ops;
  for (const GraphPart* part : graph.parts()) {
    Expected<std::vector<OpPartition>> parts = resolve_partitions(*part, plan);
    if (!parts) return parts.error().with_context(path + ": the plan");
    for (size_t i = 0; i < part->ops.size(); ++i) {
      ops.emplace(part->ops[i].name, PricedOp{&part->ops[i], (*parts)[i]});
    }
  }
  const ComputeModel ideal = ideal_compute(gpu, out.precision);
  // nnexec runs every elementwise operator as its own unfused LibTorch kernels, whatever
  // framework the plan names: the unfused frameworks' traffic factor describes them.
  const double traffic = ComputeModel::defaults_for(gpu).elementwise_traffic;
  out.elementwise_traffic = traffic;
  std::map<std::string, size_t> series;  // "name phase" -> index into out.memory
  for (const RankResult& r : run.ranks) {
    for (const OpTime& t : r.ops) {
      auto it = ops.find(t.name);
      if (it == ops.end() || t.calls <= 0 || t.seconds <= 0) continue;
      const Op& op = *it->second.op;
      const OpPartition& p = it->second.partition;
      // A zero-bubble split backward times a linear's input-gradient GEMM (bwd_input) apart
      // from its weight-gradient GEMM (bwd_weight); every other operator's backward runs whole
      // in bwd_input.
      const bool fwd = t.phase == "fwd";
      const bool input_only = t.phase == "bwd_input";
      const bool weight_only = t.phase == "bwd_weight";
      if (!fwd && t.phase != "bwd" && !input_only && !weight_only) continue;
      const double per_call = t.seconds / t.calls;
      const std::string what = fmt::format("{} {}, rank {} ({})", t.name, t.phase, r.rank, path);
      if (op.kind == OpKind::kLinear) {
        const PieceShape s = linear_piece_shape(op, p, plan.mesh);
        const Precision pr = out.precision;
        const double input_grad = gemm_seconds(s.m, s.k, s.n, pr, gpu, ideal);
        const double weight_grad = gemm_seconds(s.k, s.n, s.m, pr, gpu, ideal);
        const double ideal_s = fwd           ? gemm_seconds(s.m, s.n, s.k, pr, gpu, ideal)
                               : input_only  ? input_grad
                               : weight_only ? weight_grad
                                             : input_grad + weight_grad;
        const double flops = (t.phase == "bwd" ? 4 : 2) * s.m * s.n * s.k;
        out.gemm.push_back({what, 0, 0, 0, flops, ideal_s, per_call, run.device == "cpu"});
      } else if (memory_bound(op.kind) && !weight_only) {
        // The compiler prices a backward with weight gradients as two kernels, half the traffic
        // each; everything else as one.
        const double f = p.factor(op.dims, plan.mesh);
        const double bytes = (fwd ? op.fwd_bytes : op.bwd_bytes) / f * traffic;
        const int kernels = !fwd && op.bwd_weight_flops > 0 ? 2 : 1;
        if (bytes <= 0) continue;
        const std::string key = t.name + " " + t.phase;
        auto [s, added] = series.emplace(key, out.memory.size());
        if (added) out.memory.push_back({key, {}});
        // Per kernel: the relative residual of (overhead + bytes/bw) per kernel is that of the
        // operator's kernels together.
        out.memory[s->second].points.push_back({bytes / kernels, per_call / kernels});
      }
    }
  }
  collect_collectives(run, out);
  if (out.gemm.empty() && out.memory.empty()) {
    return Error(fmt::format(
        "{}: no operator of the run is a linear or memory-bound operator of the plan's graph "
        "(is the embedded plan the one that ran?)",
        path));
  }
  return out;
}

}  // namespace nnsim::hwexec
