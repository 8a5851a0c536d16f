#include "core/host_copy.h"

namespace nnsim {

double host_copy_seconds(double bytes, bool to_host, const Topology& topology,
                         const ComputeModel& model) {
  const double efficiency =
      to_host ? model.device_to_host_efficiency : model.host_to_device_efficiency;
  return bytes / (topology.host.link_bandwidth * efficiency);
}

}  // namespace nnsim
