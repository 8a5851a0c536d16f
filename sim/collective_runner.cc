#include "sim/collective_runner.h"

#include <algorithm>
#include <limits>
#include <map>
#include <unordered_map>

#include <simgrid/s4u/Exec.hpp>

#include "sim/wait.h"

namespace nnsim {

namespace sg4 = simgrid::s4u;

namespace {
// A collective is one parallel task, so all its flows advance together, unless it spans more
// than kMaxTaskHosts GPUs: a task's bytes matrix is dense (hosts x hosts, 2 MiB at 512), so
// those are cut into tasks of at most kMaxFlowsPerTask flows. Flows of different tasks still
// share links fairly.
constexpr size_t kMaxTaskHosts = 512;
constexpr size_t kMaxFlowsPerTask = 256;
}  // namespace

double PreparedComm::alone_with_overlap(double overlap_seconds) const {
  if (tasks.empty()) return overlap_seconds;
  return overlap_seconds > extra_latency ? std::max(overlap_seconds, alone_seconds) : alone_seconds;
}

double fluid_seconds(const std::vector<PreparedComm::Task>& tasks,
                     const std::vector<NetLink>& links) {
  const size_t n = tasks.size();
  if (n == 0) return 0;
  // Progressive filling, event by event: every unfinished task's rate (fraction of its bytes
  // per second) is raised equally until a link saturates; the tasks crossing it are frozen;
  // repeat. Then advance to the next task end (or latency end) and solve again.
  std::vector<double> remaining(n, 1.0), rate(n, 0.0);
  std::unordered_map<int, size_t> slot;  // link -> index in the per-link arrays
  std::vector<int> link_ids;
  for (const auto& t : tasks) {
    for (const auto& [l, b] : t.link_load) {
      if (slot.emplace(l, link_ids.size()).second) link_ids.push_back(l);
    }
  }
  std::vector<double> used(link_ids.size()), demand(link_ids.size());
  double now = 0;
  size_t done = 0;
  std::vector<bool> finished(n, false);
  while (done < n) {
    // Tasks still in their latency wait do not transfer yet.
    std::vector<bool> active(n, false), frozen(n, false);
    double next_latency_end = std::numeric_limits<double>::infinity();
    for (size_t t = 0; t < n; ++t) {
      if (finished[t]) continue;
      if (tasks[t].latency > now) {
        next_latency_end = std::min(next_latency_end, tasks[t].latency);
      } else {
        active[t] = true;
      }
      rate[t] = 0;
    }
    std::fill(used.begin(), used.end(), 0.0);
    for (;;) {
      std::fill(demand.begin(), demand.end(), 0.0);
      bool any = false;
      for (size_t t = 0; t < n; ++t) {
        if (!active[t] || frozen[t]) continue;
        any = true;
        for (const auto& [l, b] : tasks[t].link_load) demand[slot[l]] += b;
      }
      if (!any) break;
      double step = std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < link_ids.size(); ++i) {
        if (demand[i] > 0) {
          step = std::min(step, (links[link_ids[i]].bandwidth - used[i]) / demand[i]);
        }
      }
      step = std::max(step, 0.0);
      for (size_t t = 0; t < n; ++t) {
        if (active[t] && !frozen[t]) rate[t] += step;
      }
      for (size_t i = 0; i < link_ids.size(); ++i) used[i] += step * demand[i];
      // Freeze the tasks crossing a saturated link.
      for (size_t t = 0; t < n; ++t) {
        if (!active[t] || frozen[t]) continue;
        for (const auto& [l, b] : tasks[t].link_load) {
          size_t i = slot[l];
          if (links[l].bandwidth - used[i] <= 1e-9 * links[l].bandwidth) {
            frozen[t] = true;
            break;
          }
        }
      }
    }
    double dt = next_latency_end - now;
    for (size_t t = 0; t < n; ++t) {
      if (active[t] && rate[t] > 0) dt = std::min(dt, remaining[t] / rate[t]);
    }
    if (!(dt < std::numeric_limits<double>::infinity())) break;  // nothing can progress
    now += dt;
    for (size_t t = 0; t < n; ++t) {
      if (!active[t]) continue;
      remaining[t] -= rate[t] * dt;
      if (remaining[t] <= 1e-12) {
        finished[t] = true;
        ++done;
      }
    }
  }
  return now;
}

// Links, participants and the closed-form time of a prepared communication.
void CollectiveRunner::finish(PreparedComm& out) {
  std::vector<std::pair<int, double>> load;
  for (auto& task : out.tasks) {
    load.clear();
    task.latency = 0;
    const int gpus = net_.topology().num_gpus();
    for (size_t p = 0; p < task.pairs.size(); ++p) {
      scratch_.route.clear();
      int src = task.gpus[task.pairs[p].first];
      int dst = task.gpus[task.pairs[p].second];
      double latency = 0;
      if (dst >= gpus || src >= gpus) {
        // Only host copies end at a waypoint (kHostMemory).
        task.to_waypoint = true;
        latency = dst >= gpus ? net_.host_route(src, true, scratch_.route)
                              : net_.host_route(dst, false, scratch_.route);
      } else {
        latency = net_.route(src, dst, scratch_.route);
      }
      task.latency = std::max(task.latency, latency);
      for (int l : scratch_.route) load.emplace_back(l, task.bytes[p]);
    }
    const size_t route_links = load.size();
    std::sort(load.begin(), load.end());
    task.link_load.clear();
    for (size_t k = 0; k < load.size();) {
      int l = load[k].first;
      double sum = 0;
      for (; k < load.size() && load[k].first == l; ++k) sum += load[k].second;
      task.link_load.emplace_back(l, sum);
      out.links.push_back(l);
    }
    for (int h : task.gpus) {
      if (h < gpus) out.gpus.push_back(h);
    }
    if (!task.to_waypoint) split_at_waypoints(task, route_links);
  }
  std::sort(out.links.begin(), out.links.end());
  out.links.erase(std::unique(out.links.begin(), out.links.end()), out.links.end());
  std::sort(out.gpus.begin(), out.gpus.end());
  out.gpus.erase(std::unique(out.gpus.begin(), out.gpus.end()), out.gpus.end());
  out.alone_seconds = out.extra_latency + fluid_seconds(out.tasks, net_.links());
}

void CollectiveRunner::split_at_waypoints(PreparedComm::Task& task, size_t route_links) {
  const int gpus = net_.topology().num_gpus();
  std::map<std::pair<int, int>, double> halves;  // (source, destination) host -> bytes
  for (size_t p = 0; p < task.pairs.size(); ++p) {
    const int src = task.gpus[task.pairs[p].first];
    const int dst = task.gpus[task.pairs[p].second];
    const Network::Waypoint w = net_.waypoint(src, dst);
    if (w == Network::Waypoint::kNone) {
      halves[{src, dst}] += task.bytes[p];
    } else {
      const int host = gpus + static_cast<int>(w);
      halves[{src, host}] += task.bytes[p];
      halves[{host, dst}] += task.bytes[p];
    }
  }
  size_t split_links = 0;
  for (const auto& [ends, bytes] : halves) {
    scratch_.route.clear();
    const auto [src, dst] = ends;
    if (dst >= gpus) {
      net_.route_to(src, static_cast<Network::Waypoint>(dst - gpus), scratch_.route);
    } else if (src >= gpus) {
      net_.route_from(static_cast<Network::Waypoint>(src - gpus), dst, scratch_.route);
    } else {
      net_.route(src, dst, scratch_.route);
    }
    split_links += scratch_.route.size();
  }
  if (split_links >= route_links) return;  // rings and trees: their flows share few links
  std::unordered_map<int, int> index;
  auto host_index = [&](int host) {
    auto [it, inserted] = index.emplace(host, static_cast<int>(task.split_hosts.size()));
    if (inserted) task.split_hosts.push_back(host);
    return it->second;
  };
  for (const auto& [ends, bytes] : halves) {
    task.split_pairs.emplace_back(host_index(ends.first), host_index(ends.second));
    task.split_bytes.push_back(bytes);
  }
}

void CollectiveRunner::add_flows(const std::vector<Flow>& flows, PreparedComm& out) {
  std::vector<int> hosts;
  for (const Flow& f : flows) {
    hosts.push_back(f.src);
    hosts.push_back(f.dst);
  }
  std::sort(hosts.begin(), hosts.end());
  const bool whole = std::unique(hosts.begin(), hosts.end()) - hosts.begin() <=
                     static_cast<std::ptrdiff_t>(kMaxTaskHosts);
  const size_t per_task = whole ? flows.size() : kMaxFlowsPerTask;
  for (size_t begin = 0; begin < flows.size(); begin += per_task) {
    size_t end = std::min(flows.size(), begin + per_task);
    PreparedComm::Task task;
    std::unordered_map<int, int> index;
    auto host_index = [&](int gpu) {
      auto [it, inserted] = index.emplace(gpu, static_cast<int>(task.gpus.size()));
      if (inserted) task.gpus.push_back(gpu);
      return it->second;
    };
    for (size_t i = begin; i < end; ++i) {
      const Flow& f = flows[i];
      if (f.bytes <= 0 || f.src == f.dst) continue;
      task.pairs.emplace_back(host_index(f.src), host_index(f.dst));
      task.bytes.push_back(f.bytes);
    }
    if (!task.pairs.empty()) out.tasks.push_back(std::move(task));
  }
}

PreparedComm CollectiveRunner::prepare(const std::vector<std::vector<int>>& groups,
                                       CollectiveKind kind, double bytes) {
  PreparedComm out;
  out.bytes_per_device = bytes;
  for (const auto& g : groups) {
    CollectiveFlows c = decompose_collective(kind, g, bytes, algorithm_, net_, comm_, routing_);
    if (c.flows.empty()) continue;
    // A task pays one route latency; the rest of the steps' time is paid up front.
    double lat = max_route_latency(c, net_, scratch_);
    out.extra_latency = std::max(out.extra_latency, c.steps * step_seconds(c, lat) - lat);
    add_flows(c.flows, out);
  }
  finish(out);
  return out;
}

PreparedComm CollectiveRunner::prepare_host_copy(const std::vector<int>& gpus, double bytes,
                                                 bool to_host, double efficiency) {
  PreparedComm out;
  out.bytes_per_device = bytes;
  PreparedComm::Task task;
  task.gpus = gpus;
  const int memory = net_.topology().num_gpus() + static_cast<int>(Network::Waypoint::kHostMemory);
  task.gpus.push_back(memory);
  const int m = static_cast<int>(gpus.size());
  for (int i = 0; i < m; ++i) {
    task.pairs.emplace_back(to_host ? i : m, to_host ? m : i);
    task.bytes.push_back(bytes / efficiency);
  }
  if (bytes > 0 && m > 0) out.tasks.push_back(std::move(task));
  finish(out);
  return out;
}

PreparedComm CollectiveRunner::prepare_transfer(const std::vector<int>& src_gpus,
                                                const std::vector<int>& dst_gpus, double bytes) {
  PreparedComm out;
  out.bytes_per_device = bytes;
  CollectiveFlows c = decompose_transfer(src_gpus, dst_gpus, bytes, net_, comm_);
  if (!c.flows.empty()) {
    double lat = max_route_latency(c, net_, scratch_);
    out.extra_latency = step_seconds(c, lat) - lat;
  }
  add_flows(c.flows, out);
  finish(out);
  return out;
}

int CollectiveRunner::run(const PreparedComm& comm, double overlap_seconds) {
  int activities = 0;
  auto wait = [&](double seconds) {
    if (seconds <= 0) return;
    wait_for(seconds);
    ++activities;
  };
  if (comm.tasks.empty()) {
    wait(overlap_seconds);
    return activities;
  }
  std::vector<sg4::ExecPtr> running;
  running.reserve(comm.tasks.size());
  auto start_task = [&](const PreparedComm::Task& t) {
    const bool split = !t.split_pairs.empty();
    const std::vector<int>& task_hosts = split ? t.split_hosts : t.gpus;
    const auto& pairs = split ? t.split_pairs : t.pairs;
    const auto& bytes = split ? t.split_bytes : t.bytes;
    const size_t n = task_hosts.size();
    std::vector<sg4::Host*> hosts(n);
    for (size_t i = 0; i < n; ++i) hosts[i] = hosts_[task_hosts[i]];
    std::vector<double> matrix(n * n, 0.0);
    for (size_t p = 0; p < pairs.size(); ++p) {
      matrix[pairs[p].first * n + pairs[p].second] += bytes[p];
    }
    sg4::ExecPtr e = sg4::Exec::init();
    e->set_hosts(hosts);
    e->set_flops_amounts(std::vector<double>(n, 0.0));
    e->set_bytes_amounts(matrix);
    e->start();
    running.push_back(e);
    ++activities;
  };
  // Tasks start after the steps' latency, and a task split at its waypoints, or a host copy,
  // after its route latency too (SimGrid pays it for the others). Compute of
  // `overlap_seconds` runs alongside.
  std::vector<std::pair<double, size_t>> starts;  // (seconds from now, task)
  for (size_t i = 0; i < comm.tasks.size(); ++i) {
    const PreparedComm::Task& t = comm.tasks[i];
    const bool pays_latency = t.split_pairs.empty() && !t.to_waypoint;
    starts.emplace_back(comm.extra_latency + (pays_latency ? 0.0 : t.latency), i);
  }
  std::stable_sort(starts.begin(), starts.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  double now = 0;
  for (const auto& [at, i] : starts) {
    wait(at - now);
    now = std::max(now, at);
    start_task(comm.tasks[i]);
  }
  wait(overlap_seconds - now);
  for (auto& e : running) e->wait();
  return activities;
}

}  // namespace nnsim
