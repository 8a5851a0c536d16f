// Runs communication inside the simulation: the flows of a collective or of a pipeline transfer
// become SimGrid parallel tasks (SimGrid's L07 model advances every flow of a task at the rate of
// the task's bottleneck link, as a pipelined NCCL ring does), plus the latency of the steps the
// task itself does not pay.
#pragma once

#include <unordered_map>
#include <vector>

#include <simgrid/s4u/Host.hpp>

#include "core/collective.h"
#include "core/network.h"

namespace nnsim {

struct PreparedComm {
  struct Task {
    std::vector<simgrid::s4u::Host*> hosts;
    std::vector<double> flops;  // zeros: communication only
    std::vector<double> bytes;  // hosts x hosts matrix
  };
  std::vector<Task> tasks;
  double extra_latency = 0;  // seconds before the tasks start
  double bytes_per_device = 0;
  // For running it in closed form when nothing else shares its links: the links its flows
  // cross, the time it takes alone, and whether its tasks touch disjoint links.
  std::vector<int> links;
  std::vector<int> gpus;  // every GPU taking part, sorted
  double alone_seconds = 0;
  bool tasks_disjoint = true;
  // Time alone when `overlap_seconds` of compute runs alongside (see CollectiveRunner::run).
  double alone_with_overlap(double overlap_seconds) const;
};

class CollectiveRunner {
 public:
  CollectiveRunner(const Network& net, const std::vector<simgrid::s4u::Host*>& hosts,
                   Algorithm algorithm)
      : net_(net), hosts_(hosts), algorithm_(algorithm) {
    for (size_t g = 0; g < hosts.size(); ++g) gpu_index_[hosts[g]] = static_cast<int>(g);
  }

  // Every group (GPU lists) runs the same collective at once.
  PreparedComm prepare(const std::vector<std::vector<int>>& groups, CollectiveKind kind,
                       double bytes);
  // src_gpus[i] sends `bytes` to dst_gpus[i], all at once.
  PreparedComm prepare_transfer(const std::vector<int>& src_gpus, const std::vector<int>& dst_gpus,
                                double bytes);
  // Runs it from the calling actor and returns when every flow has arrived; with
  // `overlap_seconds` > 0, the caller's compute of that length runs alongside.
  // Returns the number of SimGrid activities used.
  int run(const PreparedComm& comm, double overlap_seconds = 0);

 private:
  void add_flows(const std::vector<Flow>& flows, PreparedComm& out);
  void finish(PreparedComm& out);

  const Network& net_;
  const std::vector<simgrid::s4u::Host*>& hosts_;
  Algorithm algorithm_;
  LinkLoadScratch scratch_;
  std::unordered_map<const simgrid::s4u::Host*, int> gpu_index_;
};

}  // namespace nnsim
