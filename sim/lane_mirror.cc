#include "sim/lane_mirror.h"

#include <algorithm>
#include <map>
#include <set>

namespace nnsim {

void LinkUses::add(const PreparedComm& comm, LinkUse use, const std::vector<bool>& relevant) {
  for (const auto& task : comm.tasks) {
    for (const auto& [link, bytes] : task.link_load) {
      if (!relevant[link]) continue;
      use.bytes = bytes;
      by_link[link].push_back(use);
    }
  }
}

void LinkUses::sort_all() {
  for (auto& uses : by_link) std::sort(uses.begin(), uses.end());
}

namespace {

// Matches `other`'s links to `first`'s, flow by flow and hop by hop, into `to_first`; false when
// the two differ in flows, bytes or the kind of link at some hop, or a link would match two.
bool match_links(const PreparedComm& first, const PreparedComm& other, const Network& net,
                 std::map<int, int>& to_first) {
  if (first.tasks.size() != other.tasks.size() || first.extra_latency != other.extra_latency ||
      first.alone_seconds != other.alone_seconds) {
    return false;
  }
  std::vector<int> route_first, route_other;
  const std::vector<NetLink>& links = net.links();
  for (size_t t = 0; t < first.tasks.size(); ++t) {
    const PreparedComm::Task& a = first.tasks[t];
    const PreparedComm::Task& b = other.tasks[t];
    if (a.pairs.size() != b.pairs.size() || a.bytes != b.bytes || a.latency != b.latency) {
      return false;
    }
    for (size_t p = 0; p < a.pairs.size(); ++p) {
      route_first.clear();
      route_other.clear();
      net.route(a.gpus[a.pairs[p].first], a.gpus[a.pairs[p].second], route_first);
      net.route(b.gpus[b.pairs[p].first], b.gpus[b.pairs[p].second], route_other);
      if (route_first.size() != route_other.size()) return false;
      for (size_t h = 0; h < route_first.size(); ++h) {
        const NetLink& la = links[route_first[h]];
        const NetLink& lb = links[route_other[h]];
        if (la.kind != lb.kind || la.bandwidth != lb.bandwidth || la.latency != lb.latency) {
          return false;
        }
        auto [it, fresh] = to_first.emplace(route_other[h], route_first[h]);
        if (!fresh && it->second != route_first[h]) return false;
      }
    }
  }
  return true;
}

// Whether lane `instance`'s per-rank collectives mirror their first rank's; `partners` gets the
// other lanes whose per-rank groups cross the same links (they must run as their first rank's
// alone too).
bool lane_mirrors_first_rank(int instance, const std::vector<PerRankCollective>& collectives,
                             const Network& net, const LinkUses& uses, std::set<int>& partners) {
  if (collectives.empty()) return false;
  const size_t ranks = collectives.front().groups.size();
  if (ranks < 2) return false;
  auto uses_of = [&](int link) -> const std::vector<LinkUse>& { return uses.by_link.at(link); };
  for (size_t p = 1; p < ranks; ++p) {
    // Rank p's links, each with the first rank's link it stands for.
    std::map<int, int> to_first;
    for (const PerRankCollective& c : collectives) {
      if (c.groups.size() != ranks || !match_links(*c.groups[0], *c.groups[p], net, to_first)) {
        return false;
      }
    }
    for (const auto& [link, first_link] : to_first) {
      if (link == first_link) return false;
      std::vector<LinkUse> as_first;
      for (LinkUse u : uses_of(link)) {
        if (u.rank >= 0) {
          // Only rank p's per-rank groups (this lane's or another's): they go with it.
          if (u.rank != static_cast<int>(p)) return false;
          if (u.instance != instance) partners.insert(u.instance);
          u.rank = 0;
        }
        as_first.push_back(u);
      }
      std::sort(as_first.begin(), as_first.end());
      if (as_first != uses_of(first_link)) return false;
    }
  }
  return true;
}

}  // namespace

std::vector<bool> lanes_mirroring_first_rank(
    const std::vector<std::vector<PerRankCollective>>& per_lane, const Network& net,
    const LinkUses& uses) {
  std::vector<bool> mirror(per_lane.size(), false);
  std::vector<std::set<int>> partners(per_lane.size());
  for (size_t i = 0; i < per_lane.size(); ++i) {
    mirror[i] = lane_mirrors_first_rank(static_cast<int>(i), per_lane[i], net, uses, partners[i]);
  }
  // A lane sharing links with one that cannot mirror cannot either.
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = 0; i < per_lane.size(); ++i) {
      if (!mirror[i]) continue;
      for (int j : partners[i]) {
        if (!mirror[j]) {
          mirror[i] = false;
          changed = true;
          break;
        }
      }
    }
  }
  return mirror;
}

}  // namespace nnsim
