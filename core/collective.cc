#include "core/collective.h"

#include <algorithm>
#include <cmath>
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
                               Algorithm algorithm, const Network& net,
                               const ExpertRouting& routing = {});

}  // namespace

double step_seconds(const CollectiveFlows& c, double route_latency) {
  return std::max(route_latency, c.step_latency);
}

CollectiveFlows decompose_collective(CollectiveKind kind, const std::vector<int>& gpus,
                                     double bytes, Algorithm algorithm, const Network& net,
                                     const CommModel& comm, const ExpertRouting& routing) {
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
  return apply_protocol(decompose_bare(kind, gpus, bytes, algorithm, net, routing), bytes,
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

// C(a, k) / C(b, k): the chance that k distinct picks among b all fall outside b - a.
double choose_ratio(double a, double b, double k) {
  double r = 1;
  for (int i = 0; i < static_cast<int>(k); ++i) {
    if (a - i <= 0) return 0;
    r *= (a - i) / (b - i);
  }
  return r;
}

double log_choose(double n, double k) {
  return std::lgamma(n + 1) - std::lgamma(k + 1) - std::lgamma(n - k + 1);
}

}  // namespace

double expert_hit_probability(const ExpertRouting& r, double held) {
  if (r.experts <= 0 || r.per_token <= 0 || held <= 0) return 0;
  if (held >= r.experts) return 1;
  double groups = r.groups, topk = r.group_topk;
  const double size = r.experts / groups;
  // A set that neither fills whole groups nor fits in one is priced as if routing were not
  // group-limited.
  const bool whole = held >= size && std::fmod(held, size) == 0;
  const bool inside = held < size && std::fmod(size, held) == 0;
  if (!whole && !inside) groups = topk = 1;
  const double pool = topk * r.experts / groups;  // the experts of a token's groups
  double none = 0;
  if (groups == 1 || inside) {
    // Its group is one of the token's with probability topk / groups.
    const double picked = groups == 1 ? 1 : topk / groups;
    none = (1 - picked) + picked * choose_ratio(pool - held, pool, r.per_token);
  } else {
    // j of its c groups among the token's (hypergeometric), then no pick among their experts.
    const double c = held / size;
    for (double j = std::max(0.0, topk - (groups - c)); j <= std::min(c, topk); ++j) {
      const double p_j =
          std::exp(log_choose(c, j) + log_choose(groups - c, topk - j) - log_choose(groups, topk));
      none += p_j * choose_ratio(pool - j * size, pool, r.per_token);
    }
  }
  return std::clamp(1 - none, 0.0, 1.0);
}

namespace {

// DeepEP's exchange (see the header): per token, one copy to each other node it has experts
// on, to the GPU of the same local index, and one over NVLink to each GPU of a node holding one
// of its experts (from its own GPU, or forwarded by the GPU it arrived at). Nodes must hold the
// same number of the group's GPUs; otherwise (or with no routing) it is the all-to-all.
CollectiveFlows expert_exchange(const std::vector<int>& gpus, double bytes,
                                const ExpertRouting& routing, const Network& net) {
  const auto nodes = by_node(gpus, net);
  const size_t per_node = nodes.front().size();
  const bool uniform =
      std::all_of(nodes.begin(), nodes.end(), [&](const auto& n) { return n.size() == per_node; });
  if (routing.experts <= 0 || routing.per_token <= 0 || !uniform) return {};
  const double n = static_cast<double>(nodes.size());
  const double token_bytes = bytes / (routing.per_token * routing.capacity_factor);
  const double to_gpu = expert_hit_probability(routing, routing.experts / (n * per_node));
  const double to_node = expert_hit_probability(routing, routing.experts / n);
  CollectiveFlows c;
  c.algorithm = "expert exchange";
  c.steps = 1;
  for (const auto& node : nodes) {
    for (int a : node) {
      for (int b : node) {
        if (a != b) c.flows.push_back({a, b, n * token_bytes * to_gpu});
      }
    }
  }
  for (size_t x = 0; x < nodes.size(); ++x) {
    for (size_t y = 0; y < nodes.size(); ++y) {
      if (x == y) continue;
      for (size_t i = 0; i < per_node; ++i) {
        c.flows.push_back({nodes[x][i], nodes[y][i], token_bytes * to_node});
      }
    }
  }
  return c;
}

CollectiveFlows decompose_bare(CollectiveKind kind, const std::vector<int>& gpus, double bytes,
                               Algorithm algorithm, const Network& net,
                               const ExpertRouting& routing) {
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
    case CollectiveKind::kExpertExchange: {
      CollectiveFlows c = expert_exchange(gpus, bytes, routing, net);
      if (!c.flows.empty()) return c;
      [[fallthrough]];
    }
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
