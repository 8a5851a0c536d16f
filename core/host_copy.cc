#include "core/host_copy.h"

#include <algorithm>

namespace nnsim {

double host_link_bandwidth(const Topology& topology) {
  const double host = topology.host.link_bandwidth;
  return topology.intra.has_pcie ? std::min(host, topology.intra.pcie.gpu_link_bandwidth) : host;
}

double host_copy_seconds(double bytes, bool to_host, const Topology& topology,
                         const ComputeModel& model) {
  const double efficiency =
      to_host ? model.device_to_host_efficiency : model.host_to_device_efficiency;
  const double latency = topology.intra.has_pcie ? topology.intra.pcie.latency : 0.0;
  return latency + bytes / (host_link_bandwidth(topology) * efficiency);
}

}  // namespace nnsim
