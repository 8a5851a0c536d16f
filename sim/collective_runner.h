// Runs communication inside the simulation: the flows of a collective or of a pipeline transfer
// become SimGrid parallel tasks (SimGrid's L07 model advances every flow of a task at the rate of
// the task's bottleneck link, as a pipelined NCCL ring does), plus the latency of the steps the
// task itself does not pay.
#pragma once

#include <vector>

#include <simgrid/s4u/Host.hpp>

#include "core/collective.h"
#include "core/network.h"

namespace nnsim {

struct PreparedComm {
  // One SimGrid parallel task, kept sparse: its dense hosts x hosts matrix is built only when
  // it runs.
  struct Task {
    std::vector<int> gpus;  // hosts of the task (from the GPU count on: waypoints, as below)
    std::vector<std::pair<int, int>> pairs;         // (source, destination) indices into gpus
    std::vector<double> bytes;                      // per pair
    std::vector<std::pair<int, double>> link_load;  // bytes each link carries
    double latency = 0;                             // largest route latency (paid once by L07)
    bool to_waypoint = false;  // a host copy's: its routes end at a waypoint, which pays none
    // What SimGrid runs, when it has fewer route links than the pairs above: every flow split
    // at its route's waypoint (Network::waypoint), the halves summed per (source, waypoint) and
    // (waypoint, destination). L07 sums a task's bytes per link and advances the task at one
    // rate, so every link carries the same bytes and the task ends at the same time; what it
    // saves is L07 looking up every flow's route at every start, n(n-1) of them for an
    // all-to-all over n GPUs against a few halves per GPU. Hosts from the GPU count on are
    // waypoints (GPU count + Waypoint). Halves report no latency: the task waits `latency`
    // before it starts.
    std::vector<int> split_hosts;
    std::vector<std::pair<int, int>> split_pairs;  // indices into split_hosts
    std::vector<double> split_bytes;
  };
  std::vector<Task> tasks;
  double extra_latency = 0;  // seconds before the tasks start
  double bytes_per_device = 0;
  // For running it in closed form when nothing else shares its links: the links its flows
  // cross, the GPUs taking part (sorted) and the time it takes alone.
  std::vector<int> links;
  std::vector<int> gpus;
  double alone_seconds = 0;
  // Time alone when `overlap_seconds` of compute runs alongside (see CollectiveRunner::run).
  double alone_with_overlap(double overlap_seconds) const;
};

// Seconds until every task ends when the tasks share links max-min fairly, each task's flows
// advancing together (SimGrid L07's bandwidth sharing), after each task's latency.
double fluid_seconds(const std::vector<PreparedComm::Task>& tasks,
                     const std::vector<NetLink>& links);

class CollectiveRunner {
 public:
  // `hosts` holds the GPUs' hosts, then the network's waypoints' (sim/platform.h).
  CollectiveRunner(const Network& net, const std::vector<simgrid::s4u::Host*>& hosts,
                   Algorithm algorithm, const CommModel& comm, const ExpertRouting& routing = {})
      : net_(net), hosts_(hosts), algorithm_(algorithm), comm_(comm), routing_(routing) {}

  // Every group (GPU lists) runs the same collective at once.
  PreparedComm prepare(const std::vector<std::vector<int>>& groups, CollectiveKind kind,
                       double bytes);
  // src_gpus[i] sends `bytes` to dst_gpus[i], all at once.
  PreparedComm prepare_transfer(const std::vector<int>& src_gpus, const std::vector<int>& dst_gpus,
                                double bytes);
  // Every GPU of `gpus` copies `bytes` to (or from) its node's memory, taking `1 / efficiency`
  // times its bytes' share of the links it crosses (PCIe's measured efficiency).
  PreparedComm prepare_host_copy(const std::vector<int>& gpus, double bytes, bool to_host,
                                 double efficiency);
  // Runs it from the calling actor and returns when every flow has arrived; with
  // `overlap_seconds` > 0, the caller's compute of that length runs alongside.
  // Returns the number of SimGrid activities used.
  int run(const PreparedComm& comm, double overlap_seconds = 0);

 private:
  void add_flows(const std::vector<Flow>& flows, PreparedComm& out);
  void finish(PreparedComm& out);
  void split_at_waypoints(PreparedComm::Task& task, size_t route_links);

  const Network& net_;
  const std::vector<simgrid::s4u::Host*>& hosts_;
  Algorithm algorithm_;
  CommModel comm_;
  ExpertRouting routing_;  // for expert exchanges (CollectiveKind::kExpertExchange)
  LinkLoadScratch scratch_;
};

}  // namespace nnsim
