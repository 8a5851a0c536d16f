// How close NCCL gets to the links' bandwidth, by message size, and what each step of a
// collective costs beyond the wire latency. Derived from nccl-tests measurements
// (shared/calibration/refs.yaml, collectives_measured): a collective of S bytes over n GPUs
// measured in t(S) takes
//   t(S) = alpha + volume(S) / (B * efficiency(S)),
// where alpha is the time of the smallest messages (all latency), volume(S) the bytes the
// busiest link carries (2(n-1)/n S for a ring all-reduce) and B the link's bandwidth; so
//   efficiency(S) = volume(S) / (B * (t(S) - alpha)).
// docs/cost-model.md has the tables and their sources.
#pragma once

#include <vector>

#include "core/gpu.h"
#include "core/network.h"

namespace nnsim {

struct EfficiencyPoint {
  double bytes = 0;
  double efficiency = 0;
};

// One kind of link (NVLink inside a node, the NICs between nodes).
struct LinkClassModel {
  std::vector<EfficiencyPoint> curve;  // by collective buffer size, increasing
  double max_efficiency = 1;           // cap (ring-only collectives; NVLS lifts all-reduce)
  double all_reduce_max_efficiency = 1;
  // Least time a step of a collective takes, wire latency included (a step never takes less
  // than its route's latency either).
  double step_latency = 0;
  // Efficiency at `bytes` (log-linear interpolation; flat beyond the ends).
  double efficiency(double bytes, bool all_reduce) const;
};

struct CommModel {
  LinkClassModel nvlink;
  LinkClassModel network;  // NICs, PCIe and fabric: anything leaving the NVLink domain
  static CommModel defaults_for(const GpuSpec& gpu);
  // An ideal network: efficiency 1, no protocol latency (closed-form tests).
  static CommModel ideal();
};

}  // namespace nnsim
