// A run's collectives across machines priced on a topology (fit_network.h).
#include "hwexec/fit_network.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "core/collective.h"
#include "core/network.h"
#include "core/program.h"

namespace nnsim::hwexec {

namespace {

std::optional<CollectiveKind> collective_kind(const std::string& kind) {
  if (kind == "all_reduce") return CollectiveKind::kAllReduce;
  if (kind == "all_gather") return CollectiveKind::kAllGather;
  if (kind == "reduce_scatter") return CollectiveKind::kReduceScatter;
  return std::nullopt;
}

// The mesh axes a run file names ("dp+cp") as the plan's axis mask; nullopt for an unknown axis.
std::optional<uint32_t> mesh_axes(const Plan& plan, const std::string& axes) {
  uint32_t mask = 0;
  size_t start = 0;
  while (start <= axes.size()) {
    const size_t end = std::min(axes.find('+', start), axes.size());
    const int a = plan.mesh.axis_index(axes.substr(start, end - start));
    if (a < 0) return std::nullopt;
    mask |= 1u << a;
    start = end + 1;
  }
  return mask;
}

}  // namespace

Status price_cross_host(const RunResults& run, const Plan& plan, const Topology& topology,
                        const std::string& path, RunPoints& points) {
  if (!points.hosts_known) return Status::Ok();
  if (topology.num_gpus() < run.world) {
    const int per_node = std::max(1, topology.gpus_per_node);
    return Error(fmt::format(
        "--topo {}: its {} node(s) of {} GPUs ({} GPUs) cannot hold the {} ranks of {}; give "
        "--nodes {} (the machines the run's ranks stand for) or a topology with more GPUs",
        topology.name, topology.nodes, topology.gpus_per_node, topology.num_gpus(), run.world, path,
        (run.world + per_node - 1) / per_node));
  }
  if (plan.mesh.num_ranks() != run.world) {
    return Error(fmt::format("{}: the plan has {} mesh ranks but the run has {}", path,
                             plan.mesh.num_ranks(), run.world));
  }
  Expected<Program> compiled = compile_plan(plan, topology, CompileOptions{});
  if (!compiled) {
    return compiled.error().with_context(fmt::format("{}: the plan on {}", path, topology.name));
  }
  const Program& prog = *compiled;
  // The hosts against the nodes the plan places the ranks on: ranks share a machine exactly
  // when they share a node.
  std::map<int, const RankResult*> by_rank;
  std::map<std::string, const RankResult*> first_on_host;
  std::map<int, const RankResult*> first_on_node;
  auto node_of = [&](const RankResult& r) { return topology.node_of(prog.gpu_of_rank[r.rank]); };
  for (const RankResult& r : run.ranks) {
    if (r.rank < 0 || r.rank >= run.world) {
      return Error(
          fmt::format("{}: rank {} is outside the run's {} ranks", path, r.rank, run.world));
    }
    by_rank[r.rank] = &r;
    const int node = node_of(r);
    const RankResult* h = first_on_host.emplace(r.host, &r).first->second;
    const RankResult* n = first_on_node.emplace(node, &r).first->second;
    if (node_of(*h) != node) {
      return Error(fmt::format(
          "{}: ranks {} and {} ran on one machine ('{}') but the plan places them on nodes {} "
          "and {} of {} ({} GPUs a node): the run's hosts disagree with the topology's nodes; "
          "give the topology (--topo, --nodes) whose nodes are the machines the run used",
          path, h->rank, r.rank, r.host, node_of(*h), node, topology.name, topology.gpus_per_node));
    }
    if (n->host != r.host) {
      return Error(fmt::format(
          "{}: ranks {} and {} ran on different machines ('{}' and '{}') but the plan places "
          "both on node {} of {} ({} GPUs a node): the run's hosts disagree with the "
          "topology's nodes; give the topology (--topo, --nodes) whose nodes are the machines "
          "the run used",
          path, n->rank, r.rank, n->host, r.host, node, topology.name, topology.gpus_per_node));
    }
  }
  // Each collective across machines decomposed as the simulator runs it, with efficiency 1 and
  // no protocol latency: the bottleneck link's time is its bandwidth term, volume / bandwidth.
  const Network net(topology);
  const CommModel ideal = CommModel::ideal();
  LinkLoadScratch scratch;
  using Key = std::tuple<std::string, int, int, long long, std::string>;
  struct Series {
    CollectiveRoute route;
    std::map<double, std::vector<double>> times;  // bytes -> each rank's seconds per call
  };
  std::map<Key, Series> series;
  for (const RankResult& r : run.ranks) {
    for (const CollTime& c : r.collectives) {
      const std::optional<CollectiveKind> kind = collective_kind(c.kind);
      if (!kind || c.calls <= 0 || c.seconds <= 0 || c.bytes <= 0) continue;
      const std::optional<uint32_t> mask = mesh_axes(plan, c.axes);
      if (!mask) continue;
      const std::vector<int> group = prog.group_of(r.rank, *mask);
      if (group.size() < 2) continue;
      std::vector<int> gpus;
      bool crosses = false;
      for (int m : group) {
        gpus.push_back(prog.gpu_of_rank[m]);
        auto it = by_rank.find(m);
        crosses = crosses || (it != by_rank.end() && it->second->host != r.host);
      }
      if (!crosses) continue;
      const CollectiveFlows flows =
          decompose_collective(*kind, gpus, c.bytes, prog.algorithm, net, ideal);
      const double latency = max_route_latency(flows, net, scratch);
      const double wire =
          isolated_seconds(flows, net, scratch) - flows.steps * step_seconds(flows, latency);
      if (wire <= 0) continue;
      const int n = static_cast<int>(group.size());
      const double bandwidth = bus_factor(c.kind, n) * c.bytes / wire;
      const Key key{c.kind, n, flows.steps, std::llround(bandwidth / 1e3), flows.algorithm};
      Series& s = series[key];
      s.route = {flows.steps, bandwidth, flows.algorithm};
      s.times[c.bytes].push_back(c.seconds / c.calls);
    }
  }
  points.cross_host.clear();
  points.cross_host_routes.clear();
  for (const auto& [key, s] : series) {
    CollectiveSeries out;
    out.kind = std::get<0>(key);
    out.ranks = std::get<1>(key);
    out.dtype = run.dtype;
    for (const auto& [bytes, per_rank] : s.times) {
      double sum = 0;
      for (double t : per_rank) sum += t;
      const double fastest = *std::min_element(per_rank.begin(), per_rank.end());
      out.samples.push_back({bytes, {sum / per_rank.size(), fastest}});
    }
    points.cross_host.push_back(out);
    points.cross_host_routes.push_back(s.route);
  }
  points.topology = topology.name;
  return Status::Ok();
}

}  // namespace nnsim::hwexec
