#include "sim/collective_runner.h"

#include <algorithm>
#include <unordered_map>

#include <simgrid/s4u/Actor.hpp>
#include <simgrid/s4u/Exec.hpp>

namespace nnsim {

namespace sg4 = simgrid::s4u;

namespace {
// A parallel task's bytes matrix is dense (hosts x hosts); long rings are cut into tasks of at
// most this many flows. Flows of different tasks still share links fairly.
constexpr size_t kMaxFlowsPerTask = 256;
}  // namespace

double PreparedComm::alone_with_overlap(double overlap_seconds) const {
  if (tasks.empty()) return overlap_seconds;
  return overlap_seconds > extra_latency ? std::max(overlap_seconds, alone_seconds) : alone_seconds;
}

// Links, participants and the closed-form time of a prepared communication. A parallel task
// alone takes its largest route latency plus its bottleneck link's bytes over bandwidth
// (SimGrid's L07 model); tasks on disjoint links run side by side.
void CollectiveRunner::finish(PreparedComm& out) {
  std::vector<int> owner;  // link -> task that uses it
  double longest = 0;
  for (size_t t = 0; t < out.tasks.size(); ++t) {
    const auto& task = out.tasks[t];
    const size_t n = task.hosts.size();
    std::vector<std::pair<int, double>> load;
    double latency = 0;
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < n; ++j) {
        double b = task.bytes[i * n + j];
        if (b <= 0) continue;
        scratch_.route.clear();
        int src = gpu_index_.at(task.hosts[i]);
        int dst = gpu_index_.at(task.hosts[j]);
        latency = std::max(latency, net_.route(src, dst, scratch_.route));
        for (int l : scratch_.route) load.emplace_back(l, b);
      }
    }
    std::sort(load.begin(), load.end());
    double worst = 0;
    for (size_t k = 0; k < load.size();) {
      int l = load[k].first;
      double sum = 0;
      for (; k < load.size() && load[k].first == l; ++k) sum += load[k].second;
      worst = std::max(worst, sum / net_.links()[l].bandwidth);
      if (owner.size() <= static_cast<size_t>(l)) owner.resize(l + 1, -1);
      if (owner[l] >= 0 && owner[l] != static_cast<int>(t)) out.tasks_disjoint = false;
      if (owner[l] < 0) out.links.push_back(l);
      owner[l] = static_cast<int>(t);
    }
    longest = std::max(longest, worst + latency);
    for (auto* h : task.hosts) out.gpus.push_back(gpu_index_.at(h));
  }
  std::sort(out.links.begin(), out.links.end());
  std::sort(out.gpus.begin(), out.gpus.end());
  out.gpus.erase(std::unique(out.gpus.begin(), out.gpus.end()), out.gpus.end());
  out.alone_seconds = out.extra_latency + longest;
}

void CollectiveRunner::add_flows(const std::vector<Flow>& flows, PreparedComm& out) {
  for (size_t begin = 0; begin < flows.size(); begin += kMaxFlowsPerTask) {
    size_t end = std::min(flows.size(), begin + kMaxFlowsPerTask);
    PreparedComm::Task task;
    std::unordered_map<int, int> index;
    auto host_index = [&](int gpu) {
      auto [it, inserted] = index.emplace(gpu, static_cast<int>(task.hosts.size()));
      if (inserted) task.hosts.push_back(hosts_[gpu]);
      return it->second;
    };
    std::vector<std::pair<std::pair<int, int>, double>> entries;
    for (size_t i = begin; i < end; ++i) {
      const Flow& f = flows[i];
      if (f.bytes <= 0 || f.src == f.dst) continue;
      entries.push_back({{host_index(f.src), host_index(f.dst)}, f.bytes});
    }
    if (entries.empty()) continue;
    const size_t n = task.hosts.size();
    task.flops.assign(n, 0.0);
    task.bytes.assign(n * n, 0.0);
    for (const auto& [pair, b] : entries) task.bytes[pair.first * n + pair.second] += b;
    out.tasks.push_back(std::move(task));
  }
}

PreparedComm CollectiveRunner::prepare(const std::vector<std::vector<int>>& groups,
                                       CollectiveKind kind, double bytes) {
  PreparedComm out;
  out.bytes_per_device = bytes;
  for (const auto& g : groups) {
    CollectiveFlows c = decompose_collective(kind, g, bytes, algorithm_, net_);
    if (c.flows.empty()) continue;
    // A task pays one route latency; the remaining pipelined steps are paid up front.
    double lat = max_route_latency(c, net_, scratch_);
    out.extra_latency = std::max(out.extra_latency, (c.steps - 1) * lat);
    add_flows(c.flows, out);
  }
  finish(out);
  return out;
}

PreparedComm CollectiveRunner::prepare_transfer(const std::vector<int>& src_gpus,
                                                const std::vector<int>& dst_gpus, double bytes) {
  PreparedComm out;
  out.bytes_per_device = bytes;
  std::vector<Flow> flows;
  for (size_t i = 0; i < src_gpus.size() && i < dst_gpus.size(); ++i) {
    flows.push_back({src_gpus[i], dst_gpus[i], bytes});
  }
  add_flows(flows, out);
  finish(out);
  return out;
}

int CollectiveRunner::run(const PreparedComm& comm, double overlap_seconds) {
  int activities = 0;
  if (comm.tasks.empty()) {
    if (overlap_seconds > 0) {
      sg4::this_actor::sleep_for(overlap_seconds);
      ++activities;
    }
    return activities;
  }
  std::vector<sg4::ExecPtr> running;
  running.reserve(comm.tasks.size());
  auto start_tasks = [&] {
    for (const auto& t : comm.tasks) {
      sg4::ExecPtr e = sg4::Exec::init();
      e->set_hosts(t.hosts);
      e->set_flops_amounts(t.flops);
      e->set_bytes_amounts(t.bytes);
      e->start();
      running.push_back(e);
      ++activities;
    }
  };
  auto sleep = [&](double seconds) {
    if (seconds <= 0) return;
    sg4::this_actor::sleep_for(seconds);
    ++activities;
  };
  if (overlap_seconds > comm.extra_latency) {
    // Compute and communication start together; the latency delays only the transfer.
    sleep(comm.extra_latency);
    start_tasks();
    sleep(overlap_seconds - comm.extra_latency);
  } else {
    sleep(comm.extra_latency);
    start_tasks();
  }
  for (auto& e : running) e->wait();
  return activities;
}

}  // namespace nnsim
