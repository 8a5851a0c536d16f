#include "core/collective.h"

#include <algorithm>
#include <map>

namespace nnsim {
namespace {

// Members grouped by node, nodes in order of first appearance, members in group order.
std::vector<std::vector<int>> by_node(const std::vector<int>& gpus, const Network& net) {
  std::vector<std::vector<int>> nodes;
  std::map<int, size_t> index;
  for (int g : gpus) {
    int node = net.topology().node_of(g);
    auto [it, inserted] = index.emplace(node, nodes.size());
    if (inserted) nodes.emplace_back();
    nodes[it->second].push_back(g);
  }
  return nodes;
}

// Ring edges of all channels, each edge carrying `edge_bytes` / channels.
CollectiveFlows ring(const std::vector<int>& gpus, double edge_bytes, int steps,
                     const Network& net) {
  CollectiveFlows c;
  c.algorithm = "ring";
  c.steps = steps;
  auto nodes = by_node(gpus, net);
  const int per_node = static_cast<int>(nodes.front().size());
  bool uniform = std::all_of(nodes.begin(), nodes.end(),
                             [&](const auto& n) { return static_cast<int>(n.size()) == per_node; });
  if (nodes.size() == 1 || !uniform || per_node == 1) {
    // One ring through the members in node order.
    std::vector<int> order;
    for (const auto& n : nodes) order.insert(order.end(), n.begin(), n.end());
    for (size_t i = 0; i < order.size(); ++i) {
      c.flows.push_back({order[i], order[(i + 1) % order.size()], edge_bytes});
    }
    return c;
  }
  // Channel ch enters every node at local member ch and leaves it at member ch-1.
  const int channels = per_node;
  const double per_channel = edge_bytes / channels;
  for (int ch = 0; ch < channels; ++ch) {
    std::vector<int> order;
    for (const auto& n : nodes) {
      for (int i = 0; i < per_node; ++i) order.push_back(n[(ch + i) % per_node]);
    }
    for (size_t i = 0; i < order.size(); ++i) {
      c.flows.push_back({order[i], order[(i + 1) % order.size()], per_channel});
    }
  }
  return c;
}

// Parent of node index i in a binary tree over n nodes laid out in-order (NCCL builds its trees
// so that the second tree mirrors the first; here tree 1 uses the reversed node order).
int tree_parent(int i) {
  return i == 0 ? -1 : (i - 1) / 2;
}

CollectiveFlows tree(const std::vector<int>& gpus, double bytes, const Network& net) {
  CollectiveFlows c;
  c.algorithm = "tree";
  auto nodes = by_node(gpus, net);
  const int n = static_cast<int>(nodes.size());
  int max_chain = 0;
  for (const auto& members : nodes) {
    max_chain = std::max(max_chain, static_cast<int>(members.size()));
    // Intra-node chain: both trees' halves go up (reduce) and down (broadcast) every edge.
    for (size_t i = 0; i + 1 < members.size(); ++i) {
      c.flows.push_back({members[i + 1], members[i], bytes});
      c.flows.push_back({members[i], members[i + 1], bytes});
    }
  }
  int depth = 0;
  for (int t = 0; t < 2 && n > 1; ++t) {
    for (int i = 1; i < n; ++i) {
      int child = t == 0 ? i : n - 1 - i;
      int parent = t == 0 ? tree_parent(i) : n - 1 - tree_parent(i);
      // Tree t talks through local member 0 (tree 0) or the last member (tree 1) of each node.
      int cg = t == 0 ? nodes[child].front() : nodes[child].back();
      int pg = t == 0 ? nodes[parent].front() : nodes[parent].back();
      c.flows.push_back({cg, pg, bytes / 2});
      c.flows.push_back({pg, cg, bytes / 2});
    }
  }
  for (int span = 1; span < n; span = 2 * span + 1) ++depth;
  c.steps = std::max(1, 2 * (depth + max_chain - 1));
  return c;
}

}  // namespace

namespace {

// Divides every flow by NCCL's efficiency for this buffer size on the links it crosses (NVLink
// inside one node, the network otherwise) and sets the per-step time.
CollectiveFlows apply_protocol(CollectiveFlows c, double bytes, bool all_reduce, const Network& net,
                               const CommModel& comm) {
  bool crosses_nodes = false;
  for (const Flow& f : c.flows) crosses_nodes = crosses_nodes || !net.same_node(f.src, f.dst);
  const bool nvlink = !crosses_nodes && net.topology().intra.kind != IntraNodeKind::kPcie;
  const LinkClassModel& cls = nvlink ? comm.nvlink : comm.network;
  const double e = cls.efficiency(bytes, all_reduce);
  for (Flow& f : c.flows) f.bytes /= e;
  c.step_latency = cls.step_latency;
  return c;
}

CollectiveFlows decompose_bare(CollectiveKind kind, const std::vector<int>& gpus, double bytes,
                               Algorithm algorithm, const Network& net);

}  // namespace

double step_seconds(const CollectiveFlows& c, double route_latency) {
  return std::max(route_latency, c.step_latency);
}

CollectiveFlows decompose_collective(CollectiveKind kind, const std::vector<int>& gpus,
                                     double bytes, Algorithm algorithm, const Network& net,
                                     const CommModel& comm) {
  if (gpus.size() <= 1 || bytes <= 0) return CollectiveFlows{"none", {}, 0, 0};
  if (kind == CollectiveKind::kAllReduce && algorithm == Algorithm::kAuto) {
    // NCCL's tuner: the algorithm that is faster alone.
    CollectiveFlows r = apply_protocol(decompose_bare(kind, gpus, bytes, Algorithm::kRing, net),
                                       bytes, true, net, comm);
    if (by_node(gpus, net).size() == 1) return r;
    CollectiveFlows t = apply_protocol(decompose_bare(kind, gpus, bytes, Algorithm::kTree, net),
                                       bytes, true, net, comm);
    LinkLoadScratch s;
    return isolated_seconds(t, net, s) < isolated_seconds(r, net, s) ? t : r;
  }
  return apply_protocol(decompose_bare(kind, gpus, bytes, algorithm, net), bytes,
                        kind == CollectiveKind::kAllReduce, net, comm);
}

CollectiveFlows decompose_transfer(const std::vector<int>& src_gpus,
                                   const std::vector<int>& dst_gpus, double bytes,
                                   const Network& net, const CommModel& comm) {
  CollectiveFlows c;
  c.algorithm = "p2p";
  c.steps = 1;
  for (size_t i = 0; i < src_gpus.size() && i < dst_gpus.size(); ++i) {
    c.flows.push_back({src_gpus[i], dst_gpus[i], bytes});
  }
  return apply_protocol(std::move(c), bytes, false, net, comm);
}

namespace {

CollectiveFlows decompose_bare(CollectiveKind kind, const std::vector<int>& gpus, double bytes,
                               Algorithm algorithm, const Network& net) {
  const int n = static_cast<int>(gpus.size());
  if (n <= 1 || bytes <= 0) return CollectiveFlows{"none", {}, 0};
  const double frac = static_cast<double>(n - 1) / n;
  switch (kind) {
    case CollectiveKind::kAllReduce:
      if (algorithm == Algorithm::kTree) return tree(gpus, bytes, net);
      return ring(gpus, 2 * frac * bytes, 2 * (n - 1), net);
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
      return ring(gpus, frac * bytes, n - 1, net);
    case CollectiveKind::kAllToAll: {
      CollectiveFlows c;
      c.algorithm = "all-to-all";
      c.steps = 1;
      for (int a = 0; a < n; ++a) {
        for (int b = 0; b < n; ++b) {
          if (a != b) c.flows.push_back({gpus[a], gpus[b], bytes / n});
        }
      }
      return c;
    }
  }
  return {};
}

}  // namespace

double max_route_latency(const CollectiveFlows& c, const Network& net, LinkLoadScratch& s) {
  double lat = 0;
  for (const Flow& f : c.flows) {
    s.route.clear();
    lat = std::max(lat, net.route(f.src, f.dst, s.route));
  }
  return lat;
}

double isolated_seconds(const CollectiveFlows& c, const Network& net, LinkLoadScratch& s) {
  if (c.flows.empty()) return 0;
  if (s.load.size() != net.links().size()) s.load.assign(net.links().size(), 0.0);
  double lat = 0;
  for (const Flow& f : c.flows) {
    s.route.clear();
    lat = std::max(lat, net.route(f.src, f.dst, s.route));
    for (int l : s.route) {
      if (s.load[l] == 0) s.touched.push_back(l);
      s.load[l] += f.bytes;
    }
  }
  double worst = 0;
  for (int l : s.touched) {
    worst = std::max(worst, s.load[l] / net.links()[l].bandwidth);
    s.load[l] = 0;
  }
  s.touched.clear();
  return worst + c.steps * step_seconds(c, lat);
}

}  // namespace nnsim
